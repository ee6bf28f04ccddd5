"""``mmap``: tensors that are views of the files' own pages in the page cache — nothing is copied.

``auto``'s choice for host memory. Reading a cached file into fresh memory makes every byte cross memory
once more than it must, and the new pages must be zeroed first; here each uncompressed file is mapped
(``MAP_PRIVATE``: a write to a tensor copies that page, the file never changes) and its tensors are views
of the mapping, as ``safetensors.safe_open`` hands them out. Before the load returns, every page its
tensors use is asked for at once (``MADV_WILLNEED``: pages evicted meanwhile are read together) and then
mapped (``MADV_POPULATE_READ``), so the tensors are in memory, not faulted in later; a load that checks its
bytes has them mapped by several threads, each checking the pieces it mapped right after. Tensors not aligned
for their dtype in the file, the caller's own destinations (``into``), and compressed tensors are read as
the ``cpu`` backend reads.

When ``auto`` picked it, a cold rank (less than half of it in the page cache, sampled before the plan is
made) is not mapped: it is read as the ``cpu`` backend reads it, by several threads into an arena, which
keeps the disk and every core busy; mapped, the first access to each freshly read page would fall to one
thread, after the reads. Named explicitly (``backend="mmap"``), it maps every rank: the pages stay memory
the kernel can reclaim, which callers streaming a large model through it count on. The report says which
files were mapped (``io=mmap``) and which read (``io=cpu``).

A mapping lives as long as its tensors, and a file truncated in place while mapped makes a later
access fail (``SIGBUS``), as with ``safetensors``; files replaced by a rename (what gdsload's writers
and most tools do) keep their old pages. During the load itself a truncated file is a
:class:`TruncatedFileError`, never a ``SIGBUS``: each file's size is checked against its header under the
mapping, its pages are mapped in with ``MADV_POPULATE_READ`` (which fails where an access would fault),
and the load's own reads of mapped bytes (its checksums, a digest) go through :func:`mapped_pieces`, which maps
each piece in the same way right before reading it (or, where the kernel lacks that call, copies it with
``process_vm_readv``: a fault there is an error code, not a signal). ``auto`` leaves shared
memory (the sidecar's hand-off) to the ``cpu`` backend: only an arena can be handed to another process.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..devices import Device
from ..errors import FileUnreadableError, TruncatedFileError
from ..plan import Extent, LoadPlan
from . import Progress
from .cpu import CpuBackend

__all__ = ["MmapBackend", "mapped_pieces"]

_MADV_POPULATE_READ = 22
"""Linux 5.14+: map every page of a range in one call (fewer faults than touching them one by one); fails with
EFAULT where an access would raise SIGBUS (the file is shorter than the mapping)."""
_PIECE = 4 << 20
"""Bytes :func:`mapped_pieces` hands out at a time."""
_MAP_IN_PIECE = 32 << 20
"""Bytes a thread maps in at a time (and hands to :attr:`~gdsload.loader.io.Backend.on_chunk`)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc: Any = None
_populate_works: bool | None = None
_local = threading.local()


def _vm_read(address: int, buf: Any, n: int) -> int:
    """Copy ``n`` bytes at ``address`` of this process into ``buf`` with ``process_vm_readv``: the bytes copied
    before the first page that cannot be read (no signal), or -errno."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.process_vm_readv.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        libc.process_vm_readv.restype = ctypes.c_ssize_t
        _libc = libc
    local, remote = _Iovec(ctypes.addressof(buf), n), _Iovec(address, n)
    got = _libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return got if got >= 0 else -ctypes.get_errno()


def mapped_pieces(address: int, nbytes: int, path: str) -> Iterator[memoryview]:
    """The ``nbytes`` mapped bytes at ``address`` (of ``path``'s mapping), in pieces a reader can take without
    the risk of ``SIGBUS`` from a file cut short before the piece: each piece is mapped in with
    ``MADV_POPULATE_READ`` (which fails where an access would fault) and then read where it lies, nothing
    copied. A page the file no longer holds is a :class:`TruncatedFileError` naming it. (A truncation in the
    instant between the two would still fault, as any later access to the tensors would.)

    Where ``MADV_POPULATE_READ`` is missing (Linux before 5.14), each piece is copied with ``process_vm_readv``
    into a buffer of this thread's, reused for the next piece (use each piece before asking for the next): a
    fault there is an error code, not a signal.
    """
    global _populate_works
    at = 0
    while at < nbytes:
        n = min(_PIECE, nbytes - at)
        if _populate_works is not False:
            if _populate(address + at, n, path, at):
                _populate_works = True
                yield memoryview((ctypes.c_char * n).from_address(address + at)).cast("B")
                at += n
                continue
            _populate_works = False
        buf = getattr(_local, "buf", None)
        if buf is None:
            buf = _local.buf = ctypes.create_string_buffer(_PIECE)
        got = _vm_read(address + at, buf, n)
        if got < n:
            raise _truncated(path, at + max(got, 0))
        yield memoryview(buf).cast("B")[:n]
        at += n


def _populate(address: int, n: int, path: str, at: int) -> bool:
    """Map the pages of ``n`` bytes at ``address`` in (``MADV_POPULATE_READ``): False where the kernel cannot."""
    global _libc
    if _libc is None:
        _vm_read(address, ctypes.create_string_buffer(1), 0)  # loads libc
    page = mmap.PAGESIZE
    start = address // page * page
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + n - start), _MADV_POPULATE_READ):
        if ctypes.get_errno() == errno.EFAULT:
            raise _truncated(path, at)
        return False
    return True


def _truncated(path: str, at: int) -> TruncatedFileError:
    return TruncatedFileError(
        f"{path!r} was cut short while it was mapped and loaded (its bytes from about "
        f"{at} on of the checked range are gone); re-copy it, and do not change model "
        "files while they load"
    )


_Run = tuple[int, int, int]
"""Neighbouring tensors of one mapped file: ``(start, length)`` of the page-aligned range they lie in, and
their bytes."""


class MmapBackend(CpuBackend):
    name = "mmap"
    maps_files = True
    """Set per load by :meth:`prepare`: False for a cold rank, which is read instead."""

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

    _cold = False

    def prepare(self, paths: Sequence[str]) -> None:
        """Picked by ``auto``: map the rank, unless it is cold (see the module doc), by a sampled ``mincore``,
        under a millisecond (files on tmpfs are always resident). Named explicitly, it always maps (memory
        the kernel can reclaim, where an arena could not be)."""
        if not self.picked_by_auto:
            return
        from .pagecache import COLD_RESIDENCY, resident_fraction

        try:
            self._cold = bool(paths) and resident_fraction(paths, samples=64) < COLD_RESIDENCY
        except OSError:  # a file that cannot be opened: the plan says so, with the fix
            self._cold = False
        self.maps_files = not self._cold

    def open(self, plan: LoadPlan) -> None:
        super().open(plan)
        if self._cold and self._threads is None:
            self._threads = self.DEFAULT_THREADS  # known cold: no second residency probe
        self._maps: list[Any] = []
        self._pending: list[tuple[int, mmap.mmap, list[_Run]]] = []
        import torch

        for i, runs in zip(plan.mapped, _viewed_runs(plan)):
            path, fd = plan.files[i].path, self._fds[i]  # the descriptors the cpu backend opened
            want = plan.files[i].header.file_size
            size = os.fstat(fd).st_size
            if size < want:  # shorter than its header says: its tensors would lie past the end
                raise TruncatedFileError(
                    f"{path!r} is {size} bytes now, its header described {want}: it was cut "
                    "short after its header was read; re-copy it"
                )
            try:
                m = mmap.mmap(fd, want, access=mmap.ACCESS_COPY) if want else None
            except (OSError, ValueError) as e:
                raise FileUnreadableError(f"{path!r} cannot be mapped ({e}); load it with backend='cpu'") from None
            self._maps.append(
                torch.frombuffer(m, dtype=torch.uint8) if m is not None else torch.empty(0, dtype=torch.uint8)
            )
            if m is not None and runs:
                self._pending.append((i, m, runs))

    def read(self, extents: Sequence[Extent], dsts: Sequence[Any], progress: Progress | None = None) -> None:
        self._map_in(progress)
        super().read(extents, dsts, progress)

    def _map_in(self, progress: Progress | None) -> None:
        """Bring in the pages the mapped tensors use (once, at the first read): every file's are asked for
        first, so pages evicted meanwhile are read together rather than one fault's readahead window at a
        time, then they are mapped, piece by piece, by several threads. Each piece mapped is handed to
        :attr:`on_chunk` by the thread that mapped it, right after: a load that checks its bytes computes
        their checksums there, beside the mapping of the next pieces, instead of in a pass of its own."""
        assert self.plan is not None
        pending, self._pending = self._pending, []
        for _, m, runs in pending:
            for start, length, _ in runs:
                try:
                    m.madvise(mmap.MADV_WILLNEED, start, length)
                except OSError:
                    break  # only a hint: the pages still come in below
        first = 1 + len(self.plan.targets)
        buffer = {i: first + k for k, i in enumerate(self.plan.mapped)}
        pieces = [
            (i, m, at, min(_MAP_IN_PIECE, start + length - at), nbytes if at == start else 0)
            for i, m, runs in pending
            for start, length, nbytes in runs
            for at in range(start, start + length, _MAP_IN_PIECE)
        ]
        on_chunk = self.on_chunk
        populate = [True]

        def map_in(piece: tuple[int, mmap.mmap, int, int, int]) -> None:
            i, m, at, n, nbytes = piece
            if populate[0]:
                try:
                    m.madvise(_MADV_POPULATE_READ, at, n)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        self._failed(i, at + n, e)
                    populate[0] = False  # a kernel older than 5.14: the pages come in as they are touched
            if on_chunk is not None and populate[0]:  # else the checks read through mapped_pieces, after
                on_chunk(buffer[i], at, n)
            if progress is not None and nbytes:
                progress(nbytes)

        # Mapping pages in takes locks the threads would share: several threads pay off where each also checks.
        threads = 1 if on_chunk is None else max(1, min(self.options.num_threads or self.CACHED_THREADS, len(pieces)))
        if threads == 1:
            for piece in pieces:
                map_in(piece)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="gdsload-mmap") as pool:
            list(pool.map(map_in, pieces))  # re-raises the first error here

    def _failed(self, i: int, end: int, e: OSError) -> None:
        assert self.plan is not None
        path = self.plan.files[i].path
        if e.errno == errno.EFAULT and os.fstat(self._fds[i]).st_size < end:
            raise TruncatedFileError(
                f"{path!r} was cut short while it was mapped (it ends before byte {end}): the "
                "file shrank while it was being loaded; re-copy it"
            ) from None
        raise FileUnreadableError(
            f"{path!r}: its pages up to byte {end} could not be read into memory "
            f"({os.strerror(e.errno or 0)}); check the device it lies on, or load it with "
            "backend='cpu'"
        ) from None

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
