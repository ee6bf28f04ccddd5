"""CPU load benchmark: ``gdsload`` (cpu backend) against ``safetensors.torch.load_file``.

Each run is a fresh process that imports its loader, then times only the load; every byte of
every tensor is in memory when the clock stops (our arena is filled by ``pread``; safetensors
returns tensors backed by its mmap, so the worker touches every page before stopping the clock). Cold runs evict the files from the page cache first and record the
resident fraction they started from.

    python -m gdsload.bench.cpu_load --size 1GB --repeat 5 --out /tmp/cpu-bench
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gdsload.loader.io.pagecache import evict, resident_fraction

METHODS = ("gdsload-cpu", "safetensors")


def _worker(method: str, model_dir: str, threads: int) -> None:
    files = sorted(str(p) for p in Path(model_dir).glob("*.safetensors"))
    if method == "gdsload-cpu":
        import torch  # noqa: F401 - load_rank imports it lazily: outside the clock, as for safetensors

        from gdsload.loader import load_rank

        t = time.perf_counter()
        result = load_rank(model_dir, 0, device="cpu", num_threads=threads)
        seconds = time.perf_counter() - t
        nbytes = result.report.logical_bytes
    elif method == "safetensors":
        import safetensors.torch
        import torch

        t = time.perf_counter()
        tensors = {}
        for f in files:
            tensors.update(safetensors.torch.load_file(f, device="cpu"))
        # safetensors hands out tensors backed by its mmap: fault every page in, so both methods
        # stop the clock with all bytes in memory.
        for v in tensors.values():
            if v.numel():
                raw = v.reshape(-1).view(torch.uint8)
                raw[::4096].max()
                raw[-1:].max()
        seconds = time.perf_counter() - t
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
    else:
        raise SystemExit(f"unknown method {method!r}; choose from {METHODS}")
    print(json.dumps({"method": method, "seconds": seconds, "bytes": nbytes}))


def _run(method: str, model_dir: Path, threads: int) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "gdsload.bench.cpu_load", "--worker", method, str(model_dir), "--threads", str(threads)],
        capture_output=True, text=True, check=False,
    )
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: {method} failed on {str(model_dir)!r} (exit {p.returncode}): {last}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--size", default="1GB", help="synthetic checkpoint size (default 1GB)")
    ap.add_argument("--model", help="use this directory instead of building a synthetic checkpoint")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out", default="cpu-bench", help="where the checkpoint and results.json go")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.threads < 1:
        ap.error(f"--repeat and --threads must be at least 1 (got {args.repeat} and {args.threads})")
    if args.worker:
        _worker(args.worker[0], args.worker[1], args.threads)
        return

    from gdsload.loader import parse_size
    from gdsload.loader.prepare.synthetic import make_checkpoint, shape_for_size

    out = Path(args.out)
    model = Path(args.model) if args.model else out / "model"
    if not args.model and not (model / "gdsload.json").exists():
        print(f"building a {args.size} synthetic checkpoint in {model} ...", flush=True)
        make_checkpoint(model, shape_for_size(parse_size(args.size)), tp=1, max_file_bytes=512 << 20)
    files = sorted(str(p) for p in model.glob("*.safetensors"))
    runs = []
    for condition in ("cold", "warm"):
        for method in METHODS:
            if condition == "warm":
                _run(method, model, args.threads)  # warm the page cache
            for i in range(args.repeat):
                evicted = evict(files) if condition == "cold" else None
                resident = resident_fraction(files)
                r = _run(method, model, args.threads)
                r.update(condition=condition, evicted_by=evicted, resident_before=resident, run=i)
                runs.append(r)
    summary = []
    print(f"\n{'method':14} {'condition':9} {'median GB/s':>11} {'min':>7} {'max':>7}  resident-before")
    for condition in ("cold", "warm"):
        for method in METHODS:
            sel = [r for r in runs if r["method"] == method and r["condition"] == condition]
            rates = [r["bytes"] / r["seconds"] / 1e9 for r in sel]
            res = max(r["resident_before"] for r in sel)
            row = {"method": method, "condition": condition, "median_gbps": statistics.median(rates),
                   "min_gbps": min(rates), "max_gbps": max(rates), "max_resident_before": res,
                   "bytes": sel[0]["bytes"]}
            summary.append(row)
            print(f"{method:14} {condition:9} {row['median_gbps']:11.2f} {row['min_gbps']:7.2f} "
                  f"{row['max_gbps']:7.2f}  {res:.2f}")
    facts = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "cpus": os.cpu_count(),
             "python": platform.python_version(), "threads": args.threads, "files": len(files)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"facts": facts, "summary": summary, "runs": runs}, indent=2))
    print(f"\nresults: {out / 'results.json'}")


if __name__ == "__main__":
    main()
