"""``fastsafetensors``: delegate the reads to fastsafetensors (for comparison, and its users).

fastsafetensors loads whole files into its own device buffers (GDS where present, else its
bounce-buffer path); we then copy every tensor into its place on the device (~4 TB/s), so the
result has the same shape as every other backend's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..devices import Device
from ..errors import BackendUnavailableError
from .iomode import kvikio_state, nvidia_fs_loaded
from ..plan import Extent, LoadPlan
from . import Backend, Progress

__all__ = ["FastSafetensorsBackend"]


class FastSafetensorsBackend(Backend):
    name = "fastsafetensors"

    @classmethod
    def probe(cls, device: Device) -> str | None:
        if device.kind != "cuda":
            return f"this delegate loads to CUDA devices only, not {str(device)!r}"
        try:
            import fastsafetensors  # noqa: F401
        except ImportError as e:
            return f"fastsafetensors is not installed ({e}); pip install fastsafetensors"
        return None

    def open(self, plan: LoadPlan) -> None:
        super().open(plan)
        # fastsafetensors uses GDS only when told to and nvidia-fs is there; otherwise its
        # bounce-buffer ("nogds") path: POSIX reads into pinned memory.
        state = kvikio_state()
        self._gds = bool(state.gds_available and nvidia_fs_loaded())

    def read(self, extents: Sequence[Extent], dsts: Sequence[Any], progress: Progress | None = None) -> None:
        import torch
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        assert self.plan is not None
        self.device.activate()
        by_file: dict[int, list[Extent]] = {}
        for e in extents:
            by_file.setdefault(e.file_index, []).append(e)
        files = [self.plan.files[i] for i in sorted(by_file)]
        for f in files:
            if f.compressed:
                raise BackendUnavailableError(
                    f"{f.path!r}: the fastsafetensors delegate reads uncompressed files only; "
                    "use backend='pinned' or 'cufile' for compressed files"
                )
        loader = SafeTensorsFileLoader(SingleGroup(), str(self.device), nogds=not self._gds)
        try:
            loader.add_filenames({0: [f.path for f in files]})
            fb = loader.copy_files_to_device()
            try:
                for i, es in by_file.items():
                    header = self.plan.files[i].header
                    for t in header.tensors:
                        if not t.nbytes:
                            continue
                        at = header.data_offset + t.start
                        for e in es:  # the extent that holds this tensor's bytes
                            if e.file_offset <= at and at + t.nbytes <= e.file_offset + e.length:
                                src = fb.get_tensor(t.name).reshape(-1).view(torch.uint8)
                                start = e.offset + at - e.file_offset
                                dsts[e.buffer][start : start + t.nbytes].copy_(src)
                                break
                    if progress is not None:
                        progress(sum(e.length for e in es))
                self.device.synchronize()
            finally:
                fb.close()
        finally:
            loader.close()

    def io_modes(self) -> list[str]:
        assert self.plan is not None
        return ["gds" if self._gds else "posix"] * len(self.plan.files)
