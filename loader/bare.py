"""Load a rank into GPU memory without importing torch: how a sidecar worker gets ready fast.

``import torch`` took 4-6 s in a fresh process on the H200 machines, more than ten times the load
of a 4.5 GB rank from tmpfs (bench/RESULTS.md). A sidecar worker only has to put its rank in HBM
and hand it to an engine over CUDA IPC, and none of that needs torch:

- memory: cupy, one ``cudaMalloc`` for the arena (not cupy's pool, so the arena is the base of
  its allocation and its CUDA IPC handle maps exactly the arena), the same for staging;
- reads: kvikio ``CuFile.pread`` into the arena, the ``cufile`` backend's engine: GPUDirect
  Storage where the host has it, kvikio's compat mode (POSIX reads through pinned bounce buffers)
  where it does not; the report says which ran, per file;
- decode: the same nvCOMP pipeline as :func:`~gdsload.loader.load_rank`
  (:func:`gdsload.loader.decode.load_compressed`);
- hand-off: :func:`gdsload.loader.ipc.export_rank` gives the arena's CUDA IPC handle and the
  tensor table; :func:`~gdsload.loader.ipc.import_rank` maps it as torch tensors in the engine.

Discovery, planning, the checks and the report are ``load_rank``'s. CPU ranks and the ``pinned``
and ``fastsafetensors`` backends stay with ``load_rank`` (and torch).

>>> result = load_rank_bare("/models/llama-tp2", rank=1)  # doctest: +SKIP
>>> result.report.summary()  # doctest: +SKIP
'rank 1: 4.54 GB in 0.218 s (20.83 GB/s) backend=cufile io=compat files=2'
"""

from __future__ import annotations

import importlib.util
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .api import file_report, verify_digests
from .backends import BARE_BACKENDS, ReadOptions
from .backends.cufile import CuFileBackend
from .config import LoadConfig
from .decode import load_compressed
from .discovery import discover
from .iomode import kvikio_state
from .plan import LoadPlan, plan_rank
from .result import LoadReport

__all__ = ["BARE_BACKENDS", "BareResult", "Slot", "bare_unavailable", "device_facts", "device_uuid", "load_rank_bare"]

log = logging.getLogger(__name__)


def bare_unavailable(backend: str = "auto") -> str | None:
    """Why :func:`load_rank_bare` cannot load here (None when it can)."""
    if backend not in BARE_BACKENDS:
        return f"backend {backend!r} is load_rank's (this path reads with kvikio, as 'cufile' does)"
    for module, package in (("cupy", "cupy-cuda12x or cupy-cuda13x"), ("kvikio", "kvikio-cu12 or kvikio-cu13")):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({package}; gdsload[cu12] or gdsload[cu13] bring it)"
    state = kvikio_state()
    if not state.importable:
        return f"kvikio cannot be imported: {state.error}"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CUDA reports no device"
    except Exception as e:  # no driver, or a broken CUDA install
        return f"CUDA is not usable through cupy ({type(e).__name__}: {e})"
    return None


def device_facts(index: int = 0) -> dict[str, Any]:
    """Name, UUID (formatted as torch formats it) and memory of a GPU, without torch."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props["name"]
    return {"name": name.decode() if isinstance(name, bytes) else str(name), "uuid": device_uuid(index),
            "total_memory": int(props["totalGlobalMem"])}


def device_uuid(index: int = 0) -> str:
    """The GPU's UUID from the driver (``cuDeviceGetUuid``), as ``str(torch...props.uuid)`` prints it.

    cupy's device properties carry the UUID as a C string, cut at its first zero byte; the
    driver hands all 16 bytes.
    """
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    raw = (ctypes.c_ubyte * 16)()
    get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), index) != 0 or get_uuid(raw, dev) != 0:
        raise RuntimeError(f"the CUDA driver could not report the UUID of device {index}")
    return str(uuid.UUID(bytes=bytes(raw)))


def device_buffer(nbytes: int, index: int) -> Any:
    """A 1-D uint8 cupy array over its own ``cudaMalloc`` on GPU ``index``, freed with the array."""
    import cupy

    with cupy.cuda.Device(index):
        mem = cupy.cuda.Memory(max(nbytes, 1))
    return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


@dataclass(frozen=True)
class Slot:
    """Where one tensor of a bare result lives in the arena."""

    name: str
    dtype: str
    """safetensors dtype name (``BF16``, ``F32``, ...)."""
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class BareResult:
    """A rank in GPU memory, held by a cupy array; no torch tensors."""

    arena: Any
    slots: list[Slot]
    report: LoadReport
    device_index: int

    def close(self) -> None:
        """Free the arena: its ``cudaFree`` runs as soon as no array here views it.

        Exported IPC documents hold no reference: engines that mapped the arena must have released
        it first (the sidecar keeps the result until every lease is released, or unload is forced).
        """
        self.arena = None
        self.slots = []


class _KvikioReader(CuFileBackend):
    """The ``cufile`` backend's kvikio reads, into cupy memory instead of torch's."""

    def __init__(self, index: int, options: ReadOptions):
        super().__init__(None, options)  # type: ignore[arg-type]  # no torch.device here
        self.index = index

    @classmethod
    def probe(cls, device: Any) -> str | None:
        return bare_unavailable()

    def allocate(self, nbytes: int) -> Any:
        return device_buffer(nbytes, self.index)

    def _kvikio_settings(self) -> dict[str, Any]:
        # One bounce buffer per task, as the pinned backend sizes them (kvikio's default is 16 MiB each);
        # cold reads name theirs.
        settings = super()._kvikio_settings()
        return {"bounce_buffer_size": settings["task_size"], **settings}

    def _use_device(self) -> None:
        import cupy

        cupy.cuda.Device(self.index).use()

    def _synchronize(self) -> None:
        import cupy

        cupy.cuda.runtime.deviceSynchronize()

    def _device_index(self) -> int:
        return self.index


def load_rank_bare(
    path: str,
    rank: int = 0,
    *,
    device_index: int = 0,
    num_threads: int | None = None,
    chunk_bytes: int | None = None,
    verify: bool | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[LoadPlan], None] | None = None,
) -> BareResult:
    """Load rank ``rank`` of ``path`` onto GPU ``device_index`` without torch (see the module doc).

    GPU ``device_index`` is left the calling thread's current device.

    Options left as None come from ``GDSLOAD_*`` variables, then defaults; ``progress`` and
    ``on_plan`` as in ``load_rank``.
    """
    import cupy

    cfg = LoadConfig.resolve(num_threads=num_threads, chunk_bytes=chunk_bytes, verify=verify)
    phases: dict[str, float] = {}
    t = time.perf_counter()
    rank_files = discover(path, rank)
    phases["discover"] = time.perf_counter() - t

    t = time.perf_counter()
    plan = plan_rank(rank_files)
    if on_plan is not None:
        on_plan(plan)
    # The GPU stays current on this thread: leaving a `with cupy.cuda.Device(...)` block makes the old
    # device current again, and on CUDA 12+ that opens a context on it (GPU 0, in a process that sees
    # several GPUs; bench/RESULTS.md, session 12).
    cupy.cuda.Device(device_index).use()
    reader = _KvikioReader(device_index, ReadOptions(cfg.num_threads, cfg.chunk_bytes, cfg.pinned_bytes))
    try:
        arena = reader.allocate(plan.arena_bytes)
        reader.open(plan)
        phases["plan"] = time.perf_counter() - t

        t = time.perf_counter()
        reader.read(plan.extents, arena, progress)
        stats = load_compressed(plan, reader, arena, verify=cfg.verify, progress=progress,
                                threads=cfg.num_threads or 4)
        cupy.cuda.runtime.deviceSynchronize()
        phases["read"] = time.perf_counter() - t - stats.tail_seconds
        io_modes, direct = reader.io_modes(), reader.direct_io()
    finally:
        reader.close()

    t = time.perf_counter()
    for p in plan.placements:
        if p.copy_from is not None and p.nbytes:  # a misaligned tensor moves to its aligned slot
            arena[p.arena_offset : p.arena_offset + p.nbytes] = arena[p.copy_from : p.copy_from + p.nbytes]
    cupy.cuda.runtime.deviceSynchronize()
    phases["decode"] = time.perf_counter() - t + stats.tail_seconds

    t = time.perf_counter()
    verified = cfg.verify and verify_digests(rank_files, plan, arena)
    phases["verify"] = time.perf_counter() - t

    report = LoadReport(
        rank=rank,
        device=f"cuda:{device_index}",
        backend=reader.name,
        source=rank_files.source,
        files=[file_report(f, mode, d) for f, mode, d in zip(plan.files, io_modes, direct)],
        phases=phases,
        verified=verified,
        decode_busy_seconds=stats.decode_busy_seconds,
        staging_bytes=stats.staging_bytes,
    )
    log.info("%s (without torch)", report.summary())
    slots = [Slot(p.name, p.dtype, tuple(p.shape), p.arena_offset, p.nbytes) for p in plan.placements]
    return BareResult(arena=arena, slots=slots, report=report, device_index=device_index)
