"""One load, in a fresh process: ``python -m gdsload.bench.methods METHOD DIR DEVICE``.

Prints one JSON line: the method, the seconds a user's stopwatch shows, logical bytes loaded, and
what the loader reported (backend, I/O modes, its own phases). The stopwatch runs from the
loader's first import to the last tensor on the device, the device synchronized, and the
loader's set-up and tear-down included (the result is released inside it); a peer gets the list of
files to read before it starts, as its users have it at hand. Before it starts,
the process has what an engine process has: torch imported and its CUDA context made (for the
torch-free method, only the CUDA context, through the driver); that start-up is reported apart
(``startup_seconds``). Memory: the process's peak RSS (``VmHWM``, start-up included) and its RSS
before the load; the GPU memory the load took at its peak (``gpu_peak_from`` says how it is known).
On the CPU the clock stops once every method's tensors are in memory: one byte of each page of their
storage is read (:func:`in_memory`), which faults in the pages of tensors that view a file mapping.

Methods: ``gdsload:BACKEND`` (auto, mmap, cpu, pinned, cufile, fastsafetensors), ``gdsload:torch-free`` (the
sidecar workers' path: ``load_rank`` onto a ``DriverDevice``, no torch in the process), ``safetensors``
(load on CPU, then ``.to(device)``), ``safetensors-device`` (``device=`` straight to the GPU),
``fastsafetensors``, ``instanttensor``, ``runai`` (Run:ai model streamer).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

PROCESS_START = time.perf_counter()

BARE = "gdsload:torch-free"
PEERS = ("safetensors", "safetensors-device", "fastsafetensors", "instanttensor", "runai")
PEER_MODULES = {
    "safetensors": "safetensors",
    "safetensors-device": "safetensors",
    "fastsafetensors": "fastsafetensors",
    "instanttensor": "instanttensor",
    "runai": "runai_model_streamer",
}


def _files(model_dir: str) -> list[str]:
    """The files gdsload loads for rank 0 (the manifest's, else every ``*.safetensors``): every method
    reads the same ones, and a stray file beside them counts for none."""
    from ..loader import discover

    return list(discover(model_dir, 0).files)


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def load(
    method: str, model_dir: str, device: str, *, rank: int = 0, files: list[str] | None = None
) -> tuple[Any, int, dict[str, Any]]:
    """Load with ``method``, device synchronized; ``(what keeps the tensors alive, logical bytes, extras)``.

    Ours loads ``rank`` of ``model_dir``; a peer loads ``files`` (default: every ``*.safetensors``
    in ``model_dir``). The caller times it; the caller's imports and CUDA context come first.
    """
    if method == BARE:
        from ..loader.devices import DriverDevice
        from ..loader.pipeline.load import load_rank

        res = load_rank(model_dir, rank, device=DriverDevice(_index(device)))
        res.device.synchronize()
        return res, res.report.logical_bytes, _report_extras(res.report)

    import torch

    files = _files(model_dir) if files is None else files

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    if method.startswith("gdsload:"):
        from ..loader import load_rank

        res = load_rank(model_dir, rank, device=device, backend=method.split(":", 1)[1])
        sync()
        if device == "cpu":
            in_memory(res.tensors.values())
        return res, res.report.logical_bytes, _report_extras(res.report)
    out: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if method == "safetensors":
        import safetensors.torch

        for f in files:
            for k, v in safetensors.torch.load_file(f, device="cpu").items():
                out[k] = v.to(device)
    elif method == "safetensors-device":
        import safetensors.torch

        for f in files:
            out.update(safetensors.torch.load_file(f, device=device))
    elif method == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        loader = SafeTensorsFileLoader(SingleGroup(), device, nogds=True)
        loader.add_filenames({0: files})
        fb = loader.copy_files_to_device()
        out = {k: fb.get_tensor(k) for k in loader.get_keys()}
        extra = {"nogds": True}
    elif method == "instanttensor":
        from instanttensor import safe_open

        with safe_open(files, framework="pt", device=device) as f:
            out = dict(f.tensors())
    elif method == "runai":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as s:
            s.stream_files(files)
            for name, tensor in s.get_tensors():
                out[name] = tensor.to(device)
    else:
        raise SystemExit(f"unknown method {method!r}")
    sync()
    if device == "cpu":
        in_memory(out.values())
    return out, _nbytes(out.values()), extra


def in_memory(tensors: Any) -> None:
    """Read one byte of every page of every host tensor's storage, each storage once: tensors that are views
    of a file mapping (safetensors' ``load_file``, gdsload's ``mmap`` backend) have their pages faulted in,
    so every method's clock stops with its bytes in memory, at the same small cost for all."""
    import torch

    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        raw = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()  # numpy: one thread, no per-call set-up
        raw[::4096].max()
        raw[-1:].max()


def _report_extras(report: Any) -> dict[str, Any]:
    return {
        "backend": report.backend,
        "io_modes": [f.io_mode for f in report.files],
        "direct_io": [f.direct_io for f in report.files],
        "readers": [f.reader for f in report.files],
        "phases": report.phases,
        "verified": report.verified,
        "verification": report.verification,
        "stored_bytes": report.stored_bytes,
        "decode_busy_seconds": report.decode_busy_seconds,
    }


def _index(device: str) -> int:
    return int(device.partition(":")[2] or 0)


def _driver_context(index: int) -> None:
    """The GPU's primary CUDA context, made through the driver (what cupy and torch then retain)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    if (
        cuda.cuInit(0)
        or cuda.cuDeviceGet(ctypes.byref(dev), index)
        or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    ):
        raise SystemExit(f"no CUDA context on device {index}")


def prepare(method: str, device: str) -> str:
    """Give the process what an engine process has before it loads: torch and its CUDA context (the
    torch-free method: the context only). Nothing of the loader is imported here."""
    if method == BARE:
        _driver_context(_index(device))
        return f"cuda:{_index(device)}"
    import torch

    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"  # peers want an explicit index
    if device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=device)  # context creation is not part of the load
    return device


def _rss(field: str) -> int | None:
    """``VmRSS`` (now) or ``VmHWM`` (the peak so far) of this process, in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gpu_peak(method: str, device: str, keep: Any, base: int) -> tuple[int | None, str | None]:
    """GPU memory the load took at its peak, and how that was known: torch's allocator (less ``base``,
    what it held before) for every method that allocates through torch; the report's arena and staging
    for the torch-free one."""
    if not device.startswith("cuda"):
        return None, None
    if method == BARE:
        return sum(int(a.nbytes) for a in keep.arenas) + keep.report.staging_bytes, "report"
    import torch

    return torch.cuda.max_memory_allocated(device) - base, "torch"


def run(method: str, model_dir: str, device: str) -> dict[str, Any]:
    device = prepare(method, device)
    startup = time.perf_counter() - PROCESS_START
    base = 0
    if method != BARE and device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    # A peer's user has the file list at hand: it is made before the stopwatch (gdsload finds its own files inside).
    files = _files(model_dir) if method in PEERS else None
    rss_before = _rss("VmRSS")
    t = time.perf_counter()
    keep, nbytes, extra = load(method, model_dir, device, files=files)
    # The loader's own tear-down ran inside load(); the tensors stay alive until the stopwatch stops,
    # as a user keeps them.
    seconds = time.perf_counter() - t
    gpu_peak, gpu_how = _gpu_peak(method, device, keep, base)
    del keep
    return {
        "method": method,
        "seconds": seconds,
        "bytes": nbytes,
        "startup_seconds": startup,
        "rss_before_bytes": rss_before,
        "rss_peak_bytes": _rss("VmHWM"),
        "gpu_peak_bytes": gpu_peak,
        "gpu_peak_from": gpu_how,
        **extra,
    }


if __name__ == "__main__":
    method, model_dir, device = sys.argv[1:4]
    print(json.dumps(run(method, model_dir, device)))
