"""CPU load benchmark: ``gdsload`` (``cpu`` and ``mmap`` backends) against ``safetensors.torch.load_file``.

Every run is a fresh process. Two clocks: ``seconds`` is the whole call as a user's script sees it,
from before the loader's first import (torch included) until every byte of every tensor is in
memory; ``process_s`` is the whole process, from spawn to exit (interpreter start-up and tear-down
included). Tensors backed by a file mapping (safetensors, gdsload's ``mmap`` backend) have every
page touched before the clock stops. The methods take turns, round after round. Cold runs evict
the files from the page cache first and record the resident fraction they started from.

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

METHODS = ("gdsload-cpu", "gdsload-mmap", "safetensors")


def _touch(tensors) -> None:
    """Fault every page of mapping-backed tensors in, so every method stops with all bytes in memory."""
    import torch

    for v in tensors:
        if v.numel():
            raw = v.reshape(-1).view(torch.uint8)
            raw[::4096].max()
            raw[-1:].max()


def _worker(method: str, model_dir: str, threads: int | None) -> None:
    files = sorted(str(p) for p in Path(model_dir).glob("*.safetensors"))
    t = time.perf_counter()
    if method in ("gdsload-cpu", "gdsload-mmap"):
        from gdsload.loader import load_rank

        backend = method.removeprefix("gdsload-")
        result = load_rank(model_dir, 0, device="cpu", backend=backend, num_threads=threads)
        if backend == "mmap":
            _touch(result.tensors.values())
        nbytes = result.report.logical_bytes
    elif method == "safetensors":
        import safetensors.torch

        tensors = {}
        for f in files:
            tensors.update(safetensors.torch.load_file(f, device="cpu"))
        _touch(tensors.values())
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
    else:
        raise SystemExit(f"unknown method {method!r}; choose from {METHODS}")
    seconds = time.perf_counter() - t
    print(json.dumps({"method": method, "seconds": seconds, "bytes": nbytes}))


def _run(method: str, model_dir: Path, threads: int | None) -> dict:
    cmd = [sys.executable, "-m", "gdsload.bench.cpu_load", "--worker", method, str(model_dir)]
    if threads:
        cmd += ["--threads", str(threads)]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    process_s = time.perf_counter() - t
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: {method} failed on {str(model_dir)!r} (exit {p.returncode}): {last}")
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "process_s": process_s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--size", default="1GB", help="synthetic checkpoint size (default 1GB)")
    ap.add_argument("--model", help="use this directory instead of building a synthetic checkpoint")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="reader threads for gdsload-cpu (default: its own)")
    ap.add_argument("--out", default="cpu-bench", help="where the checkpoint and results.json go")
    args = ap.parse_args(argv)
    if args.repeat < 1 or (args.threads is not None and args.threads < 1):
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
        if condition == "warm":
            _run(METHODS[0], model, args.threads)  # warm the page cache
        for i in range(args.repeat):
            order = METHODS[i % len(METHODS):] + METHODS[:i % len(METHODS)]  # taking turns
            for method in order:
                evicted = evict(files) if condition == "cold" else None
                resident = resident_fraction(files)
                r = _run(method, model, args.threads)
                r.update(condition=condition, evicted_by=evicted, resident_before=resident, run=i)
                runs.append(r)
    summary = []
    print(f"\n{'method':14} {'condition':9} {'median GB/s':>11} {'min':>7} {'max':>7} {'call s':>7} {'process s':>9}"
          "  resident-before")
    for condition in ("cold", "warm"):
        for method in METHODS:
            sel = [r for r in runs if r["method"] == method and r["condition"] == condition]
            rates = [r["bytes"] / r["seconds"] / 1e9 for r in sel]
            res = max(r["resident_before"] for r in sel)
            row = {"method": method, "condition": condition, "median_gbps": statistics.median(rates),
                   "min_gbps": min(rates), "max_gbps": max(rates), "max_resident_before": res,
                   "median_call_s": statistics.median(r["seconds"] for r in sel),
                   "median_process_s": statistics.median(r["process_s"] for r in sel),
                   "bytes": sel[0]["bytes"]}
            summary.append(row)
            print(f"{method:14} {condition:9} {row['median_gbps']:11.2f} {row['min_gbps']:7.2f} "
                  f"{row['max_gbps']:7.2f} {row['median_call_s']:7.3f} {row['median_process_s']:9.3f}  {res:.2f}")
    facts = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "cpus": os.cpu_count(),
             "python": platform.python_version(), "threads": args.threads, "files": len(files)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"facts": facts, "summary": summary, "runs": runs}, indent=2))
    print(f"\nresults: {out / 'results.json'}")


if __name__ == "__main__":
    main()
