"""Cold O_DIRECT reads through fastsafetensors' native reader, into our own buffers.

fastsafetensors ships a C++ reader (``fastsafetensors.cpp.nogds_file_reader``): its own threads
``pread`` O_DIRECT pieces (256 KiB as we shape it) into one ``cudaHostAlloc`` block placed on the GPU's NUMA node
and copy each to the GPU asynchronously, waiting for a copy only when its buffer comes round
again. From a cold virtio disk it read a 9 GB rank faster than every reader driven from Python:
kvikio's POSIX path (which waits for each copy before the next read), a ring of pinned buffers, and
the same design from Python threads with cupy. Driven into our own buffers, it loads as fast as
fastsafetensors itself, and about 1.2 x kvikio's best shape. So cold reads use it when
fastsafetensors is installed, and kvikio otherwise.

The reader is fastsafetensors' own library, not a copy: ``gdsload[cu12]``/``[cu13]`` install it.
Its Python surface (``fastsafetensors/cpp.pyi``) is typed but not documented as public, so any
failure to set it up falls back to kvikio with the reason logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import TruncatedFileError
from ..plan import Extent
from . import Progress

__all__ = ["FstReader", "fst_reader_unavailable", "file_runs", "make_fst_reader"]

log = logging.getLogger(__name__)

THREADS = 16
"""Reader threads (fastsafetensors' default)..."""
BOUNCE_KIB = 8 << 10
"""... sharing one 8 MiB pinned block: two 256 KiB buffers each. From a cold virtio disk, 256 KiB pieces loaded a
9 GB rank 6-9 % sooner than fastsafetensors' default 16 MiB block (512 KiB pieces), and 1-2 MiB pieces, or 8, 24,
32 or 64 threads, later (bench/RESULTS.md, 2026-12-06)."""


def fst_reader_unavailable() -> str | None:
    """None when fastsafetensors' native reader can be used here, else why not."""
    try:
        from fastsafetensors import cpp
    except ImportError as e:
        return f"fastsafetensors is not installed ({e}); pip install 'gdsload[cu12]' (or [cu13])"
    missing = [n for n in ("nogds_file_reader", "gds_device_buffer", "load_library_functions") if not hasattr(cpp, n)]
    if missing:
        return f"this fastsafetensors has no {', '.join(missing)} in its native module; install fastsafetensors 0.5"
    return None


def file_runs(extents: Sequence[Extent]) -> list[Extent]:
    """Neighbouring extents merged: the same file and buffer, contiguous in the file and in the buffer."""
    runs: list[Extent] = []
    for e in extents:
        if not e.length:
            continue
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.file_index == e.file_index
            and last.buffer == e.buffer
            and last.file_offset + last.length == e.file_offset
            and last.offset + last.length == e.offset
        ):
            runs[-1] = Extent(e.file_index, last.file_offset, last.length + e.length, last.offset, e.buffer)
        else:
            runs.append(e)
    return runs


class FstReader:
    """One fastsafetensors reader for a load: its threads and pinned block, and our files opened O_DIRECT."""

    def __init__(self, paths: Sequence[str], device_index: int, open_paths: Sequence[str] | None = None):
        from fastsafetensors import cpp
        from fastsafetensors.common import get_device_numa_node

        self._cpp = cpp
        self.paths = list(paths)
        cpp.load_library_functions("")  # the CUDA runtime the process already has loaded
        numa = get_device_numa_node(device_index)
        self._reader = cpp.nogds_file_reader(
            False, BOUNCE_KIB, THREADS, True, device_index, -1 if numa is None else numa
        )
        self._fds: list[int] = []
        try:
            for p in open_paths or self.paths:
                self._fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC))
        except BaseException:
            self.close()
            raise
        # Its waits hold the GIL unless told otherwise (a process-wide switch, off by default), and a compressed
        # load's decoder thread, which runs Python between its kernels, would stall while the reads are waited
        # for. On while this reader lives; set back as it was at close().
        self._gil_was: bool | None = None
        if hasattr(cpp, "set_gil_release") and hasattr(cpp, "get_gil_release"):
            self._gil_was = bool(cpp.get_gil_release())
            cpp.set_gil_release(True)

    def submit(
        self, extents: Sequence[Extent], buffers: Sequence[tuple[int, int]], progress: Progress | None
    ) -> Callable[[], None]:
        """Start reading ``extents`` into device memory; returns the waiter.

        ``buffers[i]`` is ``(address, nbytes)`` of the extents' buffer ``i``. Each submission
        synchronizes the device first (fastsafetensors fences framework allocations that way; during a
        compressed load it also waits for the decoder's kernels in flight), so neighbouring extents go
        as one request. The waiter returns once every byte is on the device (each piece's copy is
        synchronized before its request counts as done).
        """
        dsts: dict[int, Any] = {}
        runs = file_runs(extents)
        requests = []
        for e in runs:
            if e.buffer not in dsts:
                dsts[e.buffer] = self._cpp.gds_device_buffer(*buffers[e.buffer], True)
            requests.append(
                (
                    e,
                    self._reader.submit_read(
                        self._fds[e.file_index], dsts[e.buffer], e.file_offset, e.length, e.offset
                    ),
                )
            )

        def wait(_dsts: Any = dsts) -> None:  # holds the buffer objects until their reads are over
            failed = []
            for e, r in requests:
                if self._reader.wait_read(r) == 0:
                    failed.append(e)
                elif progress is not None:
                    progress(e.length)
            if failed:
                e = failed[0]
                raise TruncatedFileError(
                    f"{self.paths[e.file_index]!r}: reading {e.length} bytes at {e.file_offset} failed "
                    f"({len(failed)} of {len(requests)} reads); the file shrank or the disk failed while loading"
                )

        return wait

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._reader = None
        if getattr(self, "_gil_was", None) is not None:
            self._cpp.set_gil_release(self._gil_was)
            self._gil_was = None


def make_fst_reader(
    paths: Sequence[str], device_index: Callable[[], int], *, open_paths: Sequence[str] | None = None
) -> tuple[Any, str | None]:
    """An :class:`FstReader` for the GPU ``device_index()`` names (asked only when fastsafetensors is
    there), or None and why not (fastsafetensors missing, or its set-up failed). ``open_paths`` are
    what to open (the plan's files by descriptor); ``paths`` name them in messages."""
    why = fst_reader_unavailable()
    if why is not None:
        return None, why
    try:
        return FstReader(paths, device_index(), open_paths), None
    except Exception as e:  # its native set-up (CUDA runtime, pinned block, O_DIRECT open) refused
        return None, f"fastsafetensors' reader could not start ({type(e).__name__}: {e})"
