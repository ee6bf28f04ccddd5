"""``cpu``: parallel ``pread`` straight into host memory. No CUDA at all.

The embedded default (CI, CPU-only hosts). Reader threads each take whole chunks and read
them into their final place; nothing is buffered beyond the destination itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from typing import Any

from ..devices import Device
from ..errors import TruncatedFileError
from ..plan import Extent, LoadPlan, split_extents
from . import Backend, Progress

__all__ = ["CpuBackend", "pread_into"]


def pread_into(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``, looping over short reads."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise TruncatedFileError(
                f"{path!r}: end of file at byte {offset + done} while reading {len(buf)} bytes at {offset}; "
                "the file shrank while it was being loaded"
            )
        done += n


class CpuBackend(Backend):
    name = "cpu"
    DEFAULT_THREADS = 8
    """Readers for cold files (the disk wants requests in flight)."""
    CACHED_THREADS = min(8, max(2, os.cpu_count() or 2))
    """Readers for files in the page cache: copies, so one per core (more only switch between them)."""
    DEFAULT_CHUNK = 16 << 20

    @classmethod
    def probe(cls, device: Device) -> str | None:
        if device.kind != "cpu":
            return f"it reads into host memory only, not {str(device)!r}"
        return None

    def open(self, plan: LoadPlan) -> None:
        super().open(plan)
        self._fds = list(plan.fds)  # the plan's descriptors: the files its headers came from
        self._threads = self.options.num_threads

    def _reader_threads(self) -> int:
        """Readers for this plan's files: the caller's number, else by whether the files are cached (asked
        once, when there is something to read: a mapping backend often has nothing)."""
        if self._threads is None:
            from .pagecache import is_cold

            assert self.plan is not None
            self._threads = self.DEFAULT_THREADS if is_cold(*self.plan.open_paths) else self.CACHED_THREADS
        return self._threads

    def read(self, extents: Sequence[Extent], dsts: Sequence[Any], progress: Progress | None = None) -> None:
        assert self.plan is not None
        if not extents:
            return
        views = [self.device.host_memoryview(d) for d in dsts]
        paths = [f.path for f in self.plan.files]
        on_chunk = self.on_chunk

        def work(c: Extent) -> None:
            pread_into(
                self._fds[c.file_index],
                views[c.buffer][c.offset : c.offset + c.length],
                c.file_offset,
                paths[c.file_index],
            )
            if on_chunk is not None:  # the bytes are still in this core's caches
                on_chunk(c.buffer, c.offset, c.length)
            if progress is not None:
                progress(c.length)

        chunks = split_extents(extents, self.options.chunk_bytes or self.DEFAULT_CHUNK)
        threads = max(1, min(self._reader_threads(), len(chunks)))
        if threads == 1:
            for c in chunks:
                work(c)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="gdsload-cpu") as pool:
            list(pool.map(work, chunks))  # re-raises the first reader error here

    def io_modes(self) -> list[str]:
        assert self.plan is not None
        return ["cpu"] * len(self.plan.files)

    def close(self) -> None:
        self._fds = []  # the plan closes its descriptors
