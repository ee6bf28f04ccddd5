"""``mmap``: tensors that are views of the files' own pages in the page cache — nothing is copied.

``auto``'s choice for host memory. Reading a file into fresh memory makes every byte cross memory
once more than it must, and the new pages must be zeroed first; here each uncompressed file is
mapped (``MAP_PRIVATE``: a write to a tensor copies that page, the file never changes) and its
tensors are views of the mapping, as ``safetensors.safe_open`` hands them out. Before the load
returns, every page its tensors use is asked for at once (``MADV_WILLNEED``: a cold file's reads are
all in flight) and then mapped (``MADV_POPULATE_READ``), so the tensors are in memory, not faulted in
later. Tensors not aligned for their dtype in the file, the caller's own destinations (``into``), and
compressed tensors are read as the ``cpu`` backend reads.

A mapping lives as long as its tensors, and a file truncated in place while mapped makes a later
access fail (``SIGBUS``), as with ``safetensors``; files replaced by a rename (what gdsload's writers
and most tools do) keep their old pages. ``auto`` leaves shared memory (the sidecar's hand-off) to
the ``cpu`` backend: only an arena can be handed to another process.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence
from typing import Any

from gdsload.loader.devices import Device
from gdsload.loader.errors import FileUnreadableError, TruncatedFileError
from gdsload.loader.plan import Extent, LoadPlan, fd_path
from gdsload.loader.io import Progress
from gdsload.loader.io.cpu import CpuBackend

__all__ = ["MmapBackend"]

_MADV_POPULATE_READ = 22
"""Linux 5.14+: map every page of a range in one call (fewer faults than touching them one by one)."""

_Run = tuple[int, int, int]
"""Neighbouring tensors of one mapped file: ``(start, length)`` of the page-aligned range they lie in, and
their bytes."""


class MmapBackend(CpuBackend):
    name = "mmap"
    maps_files = True
    COLD_PIECE = 8 << 20
    """Bytes of a cold file mapped, then read through, at a time (see :meth:`_map_in`)."""

    @classmethod
    def probe(cls, device: Device) -> str | None:
        if device.kind != "cpu":
            return f"it maps files into host memory only, not {str(device)!r}"
        return None

    @classmethod
    def auto_skip(cls, device: Device) -> str | None:
        if getattr(device, "shared", False):
            return "the load goes to shared memory, to be handed to other processes, and only an arena can be"
        return None

    def open(self, plan: LoadPlan) -> None:
        super().open(plan)
        self._maps: list[Any] = []
        self._pending: list[tuple[int, mmap.mmap, list[_Run], Any]] = []
        import torch

        for k, (i, runs) in enumerate(zip(plan.mapped, _viewed_runs(plan))):
            path, fd = plan.files[i].path, self._fds[i]  # the descriptors the cpu backend opened
            try:
                size = os.fstat(fd).st_size
                m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
            except (OSError, ValueError) as e:
                raise FileUnreadableError(f"{path!r} cannot be mapped ({e}); load it with backend='cpu'") from None
            end = max((start + length for start, length, _ in runs), default=0)
            if size < end:
                raise TruncatedFileError(f"{path!r} holds {size} bytes, but its header places tensors up to byte "
                                         f"{end}; the file shrank while it was being loaded")
            self._maps.append(torch.frombuffer(m, dtype=torch.uint8) if m is not None
                              else torch.empty(0, dtype=torch.uint8))
            if m is not None and runs:
                self._pending.append((i, m, runs, self._maps[-1]))

    def read(self, extents: Sequence[Extent], dsts: Sequence[Any], progress: Progress | None = None) -> None:
        self._map_in(progress)
        super().read(extents, dsts, progress)

    def _map_in(self, progress: Progress | None) -> None:
        """Bring in the pages the mapped tensors use (once, at the first read). Every file's pages are asked
        for first, so a cold rank's files are read at the disk's pace rather than one fault's readahead window
        at a time; then each run is mapped. A cold rank is mapped ``COLD_PIECE`` bytes at a time, each piece
        read through (one byte a page) as soon as it is in: on a virtual machine the first access to a page
        the disk just filled can cost more than the read itself, and done here it overlaps the reads still
        in flight instead of coming after them."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        from gdsload.loader.io.pagecache import COLD_RESIDENCY, resident_fraction

        assert self.plan is not None
        # Asked before any read is started (pages being read count as cached); sampled: under a millisecond.
        cold = resident_fraction([fd_path(self._fds[i]) for i, *_ in pending], samples=64) < COLD_RESIDENCY
        for _, m, runs, _ in pending:
            for start, length, _ in runs:
                try:
                    m.madvise(mmap.MADV_WILLNEED, start, length)
                except OSError:
                    break  # only a hint: the pages still come in below
        populate = True
        for i, m, runs, whole in pending:
            pages = whole.numpy() if cold else None
            for start, length, nbytes in runs:
                step = self.COLD_PIECE if cold else length
                for at in range(start, start + length, step) if populate else ():
                    n = min(step, start + length - at)
                    try:
                        m.madvise(_MADV_POPULATE_READ, at, n)
                    except OSError as e:
                        if e.errno != errno.EINVAL:
                            self._failed(i, at + n, e)
                        populate = False  # a kernel older than 5.14: the pages come in as they are touched
                        break
                    if pages is not None:
                        pages[at : at + n : mmap.PAGESIZE].max()
                if progress is not None:
                    progress(nbytes)

    def _failed(self, i: int, end: int, e: OSError) -> None:
        assert self.plan is not None
        path = self.plan.files[i].path
        if e.errno == errno.EFAULT and os.fstat(self._fds[i]).st_size < end:
            raise TruncatedFileError(f"{path!r} became shorter than byte {end} while its pages were mapped in; "
                                     "the file shrank while it was being loaded") from None
        raise FileUnreadableError(f"{path!r}: its pages up to byte {end} could not be read into memory "
                                  f"({os.strerror(e.errno or 0)}); check the device it lies on, or load it with "
                                  "backend='cpu'") from None

    def io_modes(self) -> list[str]:
        assert self.plan is not None
        mapped = set(self.plan.mapped)
        return ["mmap" if i in mapped else "cpu" for i in range(len(self.plan.files))]

    def file_buffers(self) -> list[Any]:
        """The mapped files as 1-D uint8 tensors, in ``plan.mapped`` order (they keep their mappings alive)."""
        return list(self._maps)

    def close(self) -> None:
        super().close()
        self._maps = []  # the tensors viewing a mapping keep it; it goes with the last of them
        self._pending = []


def _viewed_runs(plan: LoadPlan) -> list[list[_Run]]:
    """Per mapped file, the runs of neighbouring tensors viewed in its mapping: the pages a load maps in,
    and no others (with ``only``, the rest of the file is left unread)."""
    first = 1 + len(plan.targets)
    runs: list[list[_Run]] = [[] for _ in plan.mapped]
    for p in sorted((p for p in plan.placements if p.buffer >= first and p.nbytes), key=lambda p: p.offset):
        start = p.offset - p.offset % mmap.PAGESIZE
        mine = runs[p.buffer - first]
        if mine and start <= mine[-1][0] + mine[-1][1]:
            at, length, nbytes = mine[-1]
            mine[-1] = (at, max(at + length, p.offset + p.nbytes) - at, nbytes + p.nbytes)
        else:
            mine.append((start, p.offset + p.nbytes - start, p.nbytes))
    return runs
