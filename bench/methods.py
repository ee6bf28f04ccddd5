"""One load, in a fresh process: ``python -m gdsload.bench.methods METHOD DIR DEVICE``.

Prints one JSON line: the method, seconds from the start of the load until every tensor is on
the device and the device is synchronized, logical bytes loaded, and what the loader reported
(backend, I/O modes). Every method's imports (ours include kvikio and nvCOMP) and CUDA
initialisation happen before the clock starts, and are reported separately
(``startup_seconds``) so cold-start totals can include them.

Methods: ``gdsload:BACKEND`` (cpu, pinned, cufile, fastsafetensors, auto), ``gdsload:bare`` (the
sidecar workers' path: :func:`gdsload.loader.bare.load_rank_bare`, no torch in the process), ``safetensors``
(load on CPU, then ``.to(device)``), ``safetensors-device`` (``device=`` straight to the GPU),
``fastsafetensors``, ``instanttensor``, ``runai`` (Run:ai model streamer).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

PROCESS_START = time.perf_counter()

BARE = "gdsload:bare"
PEERS = ("safetensors", "safetensors-device", "fastsafetensors", "instanttensor", "runai")
PEER_MODULES = {"safetensors": "safetensors", "safetensors-device": "safetensors",
                "fastsafetensors": "fastsafetensors", "instanttensor": "instanttensor",
                "runai": "runai_model_streamer"}


def _files(model_dir: str) -> list[str]:
    """The files gdsload loads for rank 0 (the manifest's, else every ``*.safetensors``): every method
    reads the same ones, and a stray file beside them counts for none."""
    from gdsload.loader import discover

    return list(discover(model_dir, 0).files)


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def load(method: str, model_dir: str, device: str, *, rank: int = 0,
         files: list[str] | None = None) -> tuple[Any, int, dict[str, Any]]:
    """Load with ``method``, device synchronized; ``(what keeps the tensors alive, logical bytes, extras)``.

    Ours loads ``rank`` of ``model_dir``; a peer loads ``files`` (default: every ``*.safetensors``
    in ``model_dir``). The caller times it; the caller's imports and CUDA context come first.
    """
    if method == BARE:
        import cupy

        from gdsload.loader.bare import load_rank_bare

        bare = load_rank_bare(model_dir, rank, device_index=_index(device))
        cupy.cuda.runtime.deviceSynchronize()
        return bare, bare.report.logical_bytes, _report_extras(bare.report)

    import torch

    files = _files(model_dir) if files is None else files

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    if method.startswith("gdsload:"):
        from gdsload.loader import load_rank

        res = load_rank(model_dir, rank, device=device, backend=method.split(":", 1)[1])
        sync()
        return res, res.report.logical_bytes, _report_extras(res.report)
    out: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if method == "safetensors":
        import safetensors.torch

        for f in files:
            for k, v in safetensors.torch.load_file(f, device="cpu").items():
                out[k] = v.to(device)
        if device == "cpu":
            # load_file hands out mmap-backed tensors: touch every page so the bytes are in memory.
            for v in out.values():
                if v.numel():
                    raw = v.reshape(-1).view(torch.uint8)
                    raw[::4096].max()
                    raw[-1:].max()
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
    return out, _nbytes(out.values()), extra


def _report_extras(report: Any) -> dict[str, Any]:
    return {"backend": report.backend, "io_modes": [f.io_mode for f in report.files],
            "direct_io": [f.direct_io for f in report.files], "phases": report.phases,
            "stored_bytes": report.stored_bytes, "decode_busy_seconds": report.decode_busy_seconds}


def _index(device: str) -> int:
    return int(device.partition(":")[2] or 0)


def prepare(method: str, device: str) -> str:
    """Import what ``method`` needs and create the CUDA context, before any clock; the device to use."""
    if method == BARE:  # as a sidecar worker starts: cupy, kvikio and nvCOMP, never torch
        import cupy

        import gdsload.loader.bare  # noqa: F401
        import gdsload.loader.decode  # noqa: F401

        for optional in ("kvikio", "nvidia.nvcomp"):
            try:
                __import__(optional)
            except ImportError:
                pass
        cupy.cuda.Device(_index(device)).use()
        cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))  # context creation is not part of the load
        return f"cuda:{_index(device)}"
    import torch

    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"  # peers want an explicit index
    if device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=device)  # context creation is not part of the load
    if method.startswith("gdsload:"):
        # Import what the backends import lazily (kvikio, nvCOMP) before the clock, as every peer's
        # own modules are imported before its clock.
        import gdsload.loader.backends.cufile  # noqa: F401
        import gdsload.loader.backends.pinned  # noqa: F401
        import gdsload.loader.decode  # noqa: F401

        for optional in ("kvikio", "nvidia.nvcomp"):
            try:
                __import__(optional)
            except ImportError:
                pass
    elif method in PEER_MODULES:
        __import__(PEER_MODULES[method])
    return device


def run(method: str, model_dir: str, device: str) -> dict[str, Any]:
    device = prepare(method, device)
    startup = time.perf_counter() - PROCESS_START
    t = time.perf_counter()
    keep, nbytes, extra = load(method, model_dir, device)
    seconds = time.perf_counter() - t
    del keep
    return {"method": method, "seconds": seconds, "bytes": nbytes, "startup_seconds": startup, **extra}


if __name__ == "__main__":
    method, model_dir, device = sys.argv[1:4]
    print(json.dumps(run(method, model_dir, device)))
