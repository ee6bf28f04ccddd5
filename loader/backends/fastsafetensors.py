"""``fastsafetensors``: delegate the reads to fastsafetensors (for comparison, and its users).

fastsafetensors loads whole files into its own device buffers (GDS where present, else its
bounce-buffer path); we then copy every tensor into our arena on the device (~4 TB/s), so the
result has the same shape as every other backend's: views into one arena per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import BackendUnavailableError
from ..iomode import kvikio_state, nvidia_fs_loaded
from ..plan import Extent, LoadPlan
from . import Backend, Progress

__all__ = ["FastSafetensorsBackend"]


class FastSafetensorsBackend(Backend):
    name = "fastsafetensors"

    @classmethod
    def probe(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"this delegate loads to CUDA devices only, not {device.type!r}"
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

    def read(self, extents: Sequence[Extent], dst: torch.Tensor, progress: Progress | None = None) -> None:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        assert self.plan is not None
        torch.cuda.set_device(self.device)
        wanted = {e.file_index for e in extents}
        files = [f for i, f in enumerate(self.plan.files) if i in wanted]
        loader = SafeTensorsFileLoader(SingleGroup(), str(self.device), nogds=not self._gds)
        try:
            loader.add_filenames({0: [f.path for f in files]})
            fb = loader.copy_files_to_device()
            try:
                # Each direct extent mirrors a whole data section: copy tensor by tensor into it.
                by_file = {e.file_index: e for e in extents}
                for i, f in enumerate(self.plan.files):
                    e = by_file.get(i)
                    if e is None:
                        continue
                    if (e.file_offset, e.length) != (f.header.data_offset, f.header.data_len):
                        raise BackendUnavailableError(
                            f"{f.path!r}: the fastsafetensors delegate reads whole uncompressed files only; "
                            "use backend='pinned' or 'cufile' for compressed files"
                        )
                    base = e.arena_offset
                    for t in f.header.tensors:
                        if not t.nbytes:
                            continue
                        src = fb.get_tensor(t.name).reshape(-1).view(torch.uint8)
                        dst[base + t.start : base + t.end].copy_(src)
                    if progress is not None:
                        progress(e.length)
                torch.cuda.synchronize(self.device)
            finally:
                fb.close()
        finally:
            loader.close()

    def io_modes(self) -> list[str]:
        assert self.plan is not None
        return ["gds" if self._gds else "posix"] * len(self.plan.files)
