"""Loads into an engine's parameters on a GPU, the way vLLM's loaders fill them, without vLLM.

    python -m gdsload.bench.param_direct MODEL_DIR --rounds 3 --out param-direct.json

vLLM builds the model first (every parameter its own ``torch.empty`` on the GPU), then its loader
fills the parameters. This bench allocates the parameters the same way (one per tensor of the
checkpoint, same dtype and shape) before the clock starts, then times, in a fresh process each,
from the loader's first import until every parameter holds its bytes, the device synchronized:

- ``gdsload:direct``: ``load_rank(..., into=parameters)``, what the vLLM adapter does for a
  pre-sharded directory: every tensor read (or decoded) straight into its parameter;
- ``gdsload:arena+copy``: ``load_rank`` into an arena, then ``parameter.copy_`` per tensor (what the
  direct path avoids), the arena freed afterwards;
- ``vllm-default``: safetensors' ``safe_open(..., device="cpu")`` per file, each tensor copied into
  its parameter (vLLM's default loader, and its ``sharded_state`` loader, read this way);
- ``fastsafetensors``: fastsafetensors' loader onto the GPU, each tensor copied into its parameter
  (vLLM's ``fastsafetensors`` load format).

Every run checks a sample of parameters against the files. Device memory: the peak torch allocated
beyond the parameters themselves (``max_memory_allocated``; the torch-side buffers of each method).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

METHODS = ("gdsload:direct", "gdsload:arena+copy", "vllm-default", "fastsafetensors")


def _files(model_dir: str) -> list[str]:
    from gdsload.loader.format.discovery import discover

    return list(discover(model_dir, 0).files)


def child(method: str, model_dir: str) -> dict[str, Any]:
    import torch

    from gdsload.loader.format.discovery import discover
    from gdsload.loader.plan import rank_index

    torch.cuda.init()
    dev = torch.device("cuda", 0)
    torch.empty(1, device=dev)  # the CUDA context, as an engine has it before it loads
    index = rank_index(discover(model_dir, 0))
    from gdsload.loader.dtypes import to_torch

    params = {n: torch.empty(m.shape, dtype=to_torch(m.dtype), device=dev) for n, m in index.items()}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    files = _files(model_dir)
    start = time.perf_counter()
    if method == "gdsload:direct":
        from gdsload.loader.pipeline import load_rank

        result = load_rank(model_dir, 0, device=dev, into=params)
        report = result.report.to_dict()
        result.close()
    elif method == "gdsload:arena+copy":
        from gdsload.loader.pipeline import load_rank

        result = load_rank(model_dir, 0, device=dev)
        for name, t in result.tensors.items():
            params[name].copy_(t)
        report = result.report.to_dict()
        result.close()
    elif method == "vllm-default":
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="pt", device="cpu") as st:
                for name in st.keys():
                    params[name].copy_(st.get_tensor(name))
        report = None
    elif method == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        loader = SafeTensorsFileLoader(SingleGroup(), str(dev), nogds=True)
        loader.add_filenames({0: files})
        fb = loader.copy_files_to_device()
        for name in loader.get_keys():
            params[name].copy_(fb.get_tensor(name))
        torch.cuda.synchronize()
        fb.close()
        loader.close()
        report = None
    else:
        raise SystemExit(f"unknown method {method!r}")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak_extra = torch.cuda.max_memory_allocated() - base
    # A sample of parameters against the files (safetensors as the oracle), outside the clock.
    from safetensors import safe_open

    wrong = []
    names = sorted(params)[:: max(1, len(params) // 12)]
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in set(names) & set(st.keys()):
                if not torch.equal(params[name].cpu(), st.get_tensor(name)):
                    wrong.append(name)
    logical = sum(m.nbytes for m in index.values())
    return {"method": method, "seconds": seconds, "gbps": logical / seconds / 1e9, "bytes": logical,
            "peak_extra_bytes": peak_extra, "wrong": wrong, "report": report}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("PARAM_DIRECT " + json.dumps(child(args.child, args.model_dir)), flush=True)
        return
    methods = [m for m in args.methods.split(",") if m]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for r in range(args.rounds):
        for m in methods:
            p = subprocess.run([sys.executable, "-m", "gdsload.bench.param_direct", args.model_dir, "--child", m],
                               capture_output=True, text=True, timeout=600)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PARAM_DIRECT ")), None)
            res = json.loads(line[len("PARAM_DIRECT "):]) if line else {"error": (p.stderr or p.stdout)[-500:]}
            runs[m].append(res)
            print(f"round {r + 1} {m}: " + (f"{res['gbps']:.2f} GB/s, {res['seconds']:.3f} s, peak extra "
                                             f"{res['peak_extra_bytes'] / 1e9:.2f} GB, wrong {res['wrong']}"
                                             if "error" not in res else res["error"]), flush=True)
    summary = {}
    for m, rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        if ok:
            g = [x["gbps"] for x in ok]
            summary[m] = {"gbps_median": statistics.median(g), "gbps_min": min(g), "gbps_max": max(g),
                          "peak_extra_gb": max(x["peak_extra_bytes"] for x in ok) / 1e9,
                          "wrong": sorted({w for x in ok for w in x["wrong"]}), "n": len(ok)}
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "model_dir": args.model_dir, "rounds": args.rounds,
           "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
