"""``cufile``: kvikio ``CuFile.pread`` straight into the device arena.

With nvidia-fs (or P2PDMA) this is true GPUDirect Storage: storage DMAs into HBM. Without it,
kvikio (or cuFile) bounces through host memory; the report then says ``compat`` or ``posix``,
never ``gds``. Reads are submitted for every file at once and split by kvikio's thread pool
into ``task_size`` pieces; file offsets of files gdsload writes are 4 KiB aligned.

The arena comes from torch here; :mod:`gdsload.loader.bare` reads the same way into cupy memory
by overriding the three device hooks (``allocate``, ``_use_device``, ``_synchronize``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..iomode import KvikioState, cufile_io_mode, kvikio_state, o_direct_supported
from ..plan import Extent, LoadPlan
from . import Backend, Progress, wait_preads

if TYPE_CHECKING:
    import torch

__all__ = ["CuFileBackend"]

log = logging.getLogger(__name__)


class CuFileBackend(Backend):
    name = "cufile"
    DEFAULT_THREADS = 16
    DEFAULT_TASK = 4 << 20

    @classmethod
    def probe(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"it loads to CUDA devices, not {device.type!r}"
        state = kvikio_state()
        if not state.importable:
            return f"kvikio is not importable ({state.error}); install gdsload[cu12] or gdsload[cu13]"
        return None

    @classmethod
    def auto_skip(cls, device: torch.device) -> str | None:
        """Why ``auto`` prefers another backend even though this one can run."""
        state = kvikio_state()
        if state.compat_preferred or not state.gds_available:
            return ("no GPUDirect Storage here (kvikio compat mode "
                    f"{'on' if state.compat_preferred else 'off'}, cuFile is_gds_available={state.gds_available}); "
                    "it would bounce through host memory")
        return None

    def open(self, plan: LoadPlan) -> None:
        import kvikio
        import kvikio.defaults

        super().open(plan)
        self._use_device()
        self._state: KvikioState = kvikio_state()
        # Process-wide kvikio settings, held from open to close (per read, kvikio would rebuild its
        # thread pool for every staging group of a compressed load).
        self._settings = kvikio.defaults.set(self._kvikio_settings())
        self._files = []
        for f in plan.files:  # one by one: close() closes those opened before a failure
            self._files.append(kvikio.CuFile(f.path, "r"))
        self._modes = [cufile_io_mode(self._state, o_direct_supported(f.path)) for f in plan.files]
        self._direct = [m in ("gds", "p2pdma") for m in self._modes]

    def _kvikio_settings(self) -> dict[str, Any]:
        return {"num_threads": self.options.num_threads or self.DEFAULT_THREADS,
                "task_size": self.options.chunk_bytes or self.DEFAULT_TASK}

    def _use_device(self) -> None:
        """Make the target GPU current on this thread."""
        import torch

        torch.cuda.set_device(self.device)

    def _synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def submit(self, extents: Sequence[Extent], dst: torch.Tensor, progress: Progress | None = None
               ) -> Callable[[], None]:
        assert self.plan is not None
        self._use_device()
        futures = [
            (e, self._files[e.file_index].pread(dst[e.arena_offset : e.arena_offset + e.length], e.length,
                                                e.file_offset))
            for e in extents if e.length
        ]

        def wait() -> None:
            assert self.plan is not None
            wait_preads(self.plan, futures, progress)
            self._synchronize()

        return wait

    def read(self, extents: Sequence[Extent], dst: torch.Tensor, progress: Progress | None = None) -> None:
        self.submit(extents, dst, progress)()

    def io_modes(self) -> list[str]:
        return list(self._modes)

    def direct_io(self) -> list[bool]:
        return list(self._direct)

    def close(self) -> None:
        for f in getattr(self, "_files", []):
            f.close()
        self._files = []
        if getattr(self, "_settings", None) is not None:
            self._settings.__exit__(None, None, None)  # kvikio's settings as they were before open
            self._settings = None
