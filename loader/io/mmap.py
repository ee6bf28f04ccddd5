"""``mmap``: tensors that are views of the files' own pages in the page cache — nothing is copied.

For a CPU destination whose tensors are only read once more (an engine's ``load_weights`` copies
each into its parameters), reading them into an arena first is one copy too many: every byte
would cross memory twice. Here each uncompressed file is mapped (``MAP_PRIVATE``: a write to a
tensor copies that page, the file never changes) and its tensors are views of the mapping, as
``safetensors.safe_open`` hands them out. Tensors not aligned for their dtype in the file, and
compressed tensors, are read into the arena as the ``cpu`` backend reads.

Never picked by ``auto``: a mapping lives as long as its tensors, and a file truncated while
mapped makes a later access fail (``SIGBUS``); the engine adapters ask for it only where they copy
the tensors right away.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

from gdsload.loader.devices import Device
from gdsload.loader.errors import FileUnreadableError
from gdsload.loader.plan import LoadPlan
from gdsload.loader.io.cpu import CpuBackend

__all__ = ["MmapBackend"]

_MADV_POPULATE_READ = 22
"""Linux 5.14+: map every page of a range in one call (fewer faults than touching them one by one)."""


class MmapBackend(CpuBackend):
    name = "mmap"
    maps_files = True

    @classmethod
    def probe(cls, device: Device) -> str | None:
        if device.kind != "cpu":
            return f"it maps files into host memory only, not {str(device)!r}"
        return None

    def open(self, plan: LoadPlan) -> None:
        super().open(plan)
        self._maps: list[Any] = []
        import torch

        for i in plan.mapped:
            path, fd = plan.files[i].path, self._fds[i]  # the descriptors the cpu backend opened
            try:
                size = os.fstat(fd).st_size
                m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
            except (OSError, ValueError) as e:
                raise FileUnreadableError(f"{path!r} cannot be mapped ({e}); load it with backend='cpu'") from None
            if m is not None:
                try:
                    m.madvise(_MADV_POPULATE_READ)
                except (OSError, ValueError, AttributeError):
                    pass  # an older kernel: the pages come in as they are touched
            self._maps.append(torch.frombuffer(m, dtype=torch.uint8) if m is not None
                              else torch.empty(0, dtype=torch.uint8))

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
