"""``cpu``: parallel ``pread`` straight into a host-memory arena. No CUDA at all.

The embedded default (CI, CPU-only hosts). Reader threads each take whole chunks and read
them into their final place in the arena; nothing is buffered beyond the arena itself.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import TruncatedFileError
from ..plan import Extent, LoadPlan
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

    @classmethod
    def probe(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"it reads into host memory only, not {device.type!r}"
        return None

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def read(self, plan: LoadPlan, arena: torch.Tensor, progress: Progress | None = None) -> list[str]:
        view = memoryview(arena.numpy()) if arena.numel() else memoryview(bytearray())
        fds = [os.open(f.path, os.O_RDONLY) for f in plan.files]
        try:

            def work(c: Extent) -> None:
                pread_into(fds[c.file_index], view[c.arena_offset : c.arena_offset + c.length], c.file_offset,
                           plan.files[c.file_index].path)
                if progress is not None:
                    progress(c.length)

            chunks = plan.chunks(self.options.chunk_bytes)
            threads = max(1, min(self.options.num_threads, len(chunks)))
            with ThreadPoolExecutor(threads, thread_name_prefix="gdsload-cpu") as pool:
                # list() re-raises the first reader error here.
                list(pool.map(work, chunks))
        finally:
            for fd in fds:
                os.close(fd)
        return ["cpu"] * len(plan.files)
