"""One load, in a fresh process: ``python -m gdsload.bench.methods METHOD DIR DEVICE``.

Prints one JSON line: the method, seconds from the start of the load until every tensor is on
the device and the device is synchronized, logical bytes loaded, and what the loader reported
(backend, I/O modes). Every method's imports (ours include kvikio and nvCOMP) and CUDA
initialisation happen before the clock starts, and are reported separately
(``startup_seconds``) so cold-start totals can include them.

Methods: ``gdsload:BACKEND`` (cpu, pinned, cufile, fastsafetensors, auto), ``safetensors``
(load on CPU, then ``.to(device)``), ``safetensors-device`` (``device=`` straight to the GPU),
``fastsafetensors``, ``instanttensor``, ``runai`` (Run:ai model streamer).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

PROCESS_START = time.perf_counter()

PEERS = ("safetensors", "safetensors-device", "fastsafetensors", "instanttensor", "runai")
PEER_MODULES = {"safetensors": "safetensors", "safetensors-device": "safetensors",
                "fastsafetensors": "fastsafetensors", "instanttensor": "instanttensor",
                "runai": "runai_model_streamer"}


def _files(model_dir: str) -> list[str]:
    return sorted(str(p) for p in Path(model_dir).glob("*.safetensors"))


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run(method: str, model_dir: str, device: str) -> dict[str, Any]:
    import torch

    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"  # peers want an explicit index
    if device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=device)  # context creation is not part of the load
    files = _files(model_dir)
    extra: dict[str, Any] = {}

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    startup = time.perf_counter() - PROCESS_START
    if method.startswith("gdsload:"):
        from gdsload.loader import load_rank

        backend = method.split(":", 1)[1]
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
        t = time.perf_counter()
        res = load_rank(model_dir, 0, device=device, backend=backend)
        sync()
        seconds = time.perf_counter() - t
        nbytes = res.report.logical_bytes
        extra = {"backend": res.report.backend, "io_modes": [f.io_mode for f in res.report.files],
                 "direct_io": [f.direct_io for f in res.report.files], "phases": res.report.phases,
                 "stored_bytes": res.report.stored_bytes, "decode_busy_seconds": res.report.decode_busy_seconds}
    elif method == "safetensors":
        import safetensors.torch

        t = time.perf_counter()
        out = {}
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
        sync()
        seconds = time.perf_counter() - t
        nbytes = _nbytes(out.values())
    elif method == "safetensors-device":
        import safetensors.torch

        t = time.perf_counter()
        out = {}
        for f in files:
            out.update(safetensors.torch.load_file(f, device=device))
        sync()
        seconds = time.perf_counter() - t
        nbytes = _nbytes(out.values())
    elif method == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        t = time.perf_counter()
        loader = SafeTensorsFileLoader(SingleGroup(), device, nogds=True)
        loader.add_filenames({0: files})
        fb = loader.copy_files_to_device()
        out = {k: fb.get_tensor(k) for k in loader.get_keys()}
        sync()
        seconds = time.perf_counter() - t
        nbytes = _nbytes(out.values())
        extra = {"nogds": True}
    elif method == "instanttensor":
        from instanttensor import safe_open

        t = time.perf_counter()
        with safe_open(files, framework="pt", device=device) as f:
            out = dict(f.tensors())
        sync()
        seconds = time.perf_counter() - t
        nbytes = _nbytes(out.values())
    elif method == "runai":
        from runai_model_streamer import SafetensorsStreamer

        t = time.perf_counter()
        out = {}
        with SafetensorsStreamer() as s:
            s.stream_files(files)
            for name, tensor in s.get_tensors():
                out[name] = tensor.to(device)
        sync()
        seconds = time.perf_counter() - t
        nbytes = _nbytes(out.values())
    else:
        raise SystemExit(f"unknown method {method!r}")
    return {"method": method, "seconds": seconds, "bytes": nbytes, "startup_seconds": startup, **extra}


if __name__ == "__main__":
    method, model_dir, device = sys.argv[1:4]
    print(json.dumps(run(method, model_dir, device)))
