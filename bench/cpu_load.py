"""CPU load benchmark: ``gdsload`` against ``safetensors.torch.load_file``, as a user's script sees it.

Every run is a fresh process. Two clocks: ``seconds`` is the whole call, from before the loader's first
import (torch's import included, for every method) until every byte of every tensor is in memory (one
byte of each page of their storage read: tensors that view a file mapping fault in); ``process_s`` is the
whole process, from spawn to exit (interpreter start-up and tear-down included). Methods: ``gdsload``
(``load_rank`` as it comes: on the CPU the ``auto`` backend maps the files), ``gdsload-cpu`` (the ``cpu``
backend: reads into fresh memory) and ``safetensors``. Conditions: ``tmpfs`` (a copy in /dev/shm),
``warm`` (page cache; the files are read through before every run) and ``cold`` (evicted before every
run; the resident fraction each run started from is recorded). The methods take turns, round after
round. ``gdsload bench DIR --device cpu`` times the same loads with torch imported before the clock.

    python -m gdsload.bench.cpu_load --size 1GB --repeat 5 --out /tmp/cpu-bench
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..loader.io.pagecache import evict, resident_fraction

METHODS = ("gdsload", "gdsload-cpu", "safetensors")
CONDITIONS = ("tmpfs", "warm", "cold")


def _worker(method: str, model_dir: str, threads: int | None) -> None:
    files = sorted(str(p) for p in Path(model_dir).glob("*.safetensors"))
    t = time.perf_counter()
    if method in ("gdsload", "gdsload-cpu"):
        from ..loader import load_rank

        result = load_rank(
            model_dir, 0, device="cpu", backend="cpu" if method == "gdsload-cpu" else None, num_threads=threads
        )
        tensors = result.tensors
        nbytes = result.report.logical_bytes
    elif method == "safetensors":
        import safetensors.torch

        tensors = {}
        for f in files:
            tensors.update(safetensors.torch.load_file(f, device="cpu"))
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
    else:
        raise SystemExit(f"unknown method {method!r}; choose from {METHODS}")
    from .methods import in_memory

    in_memory(tensors.values())
    seconds = time.perf_counter() - t
    print(json.dumps({"method": method, "seconds": seconds, "bytes": nbytes}))


def _fill(files: list[str]) -> None:
    buf = bytearray(16 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


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
    ap.add_argument("--threads", type=int, default=None, help="reader threads for gdsload (default: its own)")
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help=f"comma-separated, of {', '.join(CONDITIONS)}")
    ap.add_argument("--out", default="cpu-bench", help="where the checkpoint and results.json go")
    args = ap.parse_args(argv)
    if args.repeat < 1 or (args.threads is not None and args.threads < 1):
        ap.error(f"--repeat and --threads must be at least 1 (got {args.repeat} and {args.threads})")
    conditions = [c for c in args.conditions.split(",") if c]
    if not conditions or set(conditions) - set(CONDITIONS):
        ap.error(f"--conditions {args.conditions!r}: choose from {', '.join(CONDITIONS)}")
    if args.worker:
        _worker(args.worker[0], args.worker[1], args.threads)
        return

    from ..loader import parse_size
    from ..loader.prepare.synthetic import make_checkpoint, shape_for_size

    out = Path(args.out)
    model = Path(args.model) if args.model else out / "model"
    if not args.model and not (model / "gdsload.json").exists():
        print(f"building a {args.size} synthetic checkpoint in {model} ...", flush=True)
        make_checkpoint(model, shape_for_size(parse_size(args.size)), tp=1, max_file_bytes=512 << 20)
    if "tmpfs" in conditions and not os.path.isdir("/dev/shm"):
        print("no /dev/shm here: the tmpfs condition is skipped", flush=True)
        conditions.remove("tmpfs")
    runs = []
    for condition in conditions:
        room = Path(tempfile.mkdtemp(prefix="gdsload-cpu-bench-", dir="/dev/shm")) if condition == "tmpfs" else None
        try:
            where = model
            if room is not None:  # a fresh copy, removed below whatever happens
                where = room / model.name
                shutil.copytree(model, where)
            files = sorted(str(p) for p in where.glob("*.safetensors"))
            for i in range(args.repeat):
                order = METHODS[i % len(METHODS) :] + METHODS[: i % len(METHODS)]  # taking turns
                for method in order:
                    evicted = evict(files) if condition == "cold" else None
                    if condition == "warm":
                        _fill(files)
                    resident = resident_fraction(files)
                    r = _run(method, where, args.threads)
                    r.update(condition=condition, evicted_by=evicted, resident_before=resident, run=i)
                    runs.append(r)
        finally:
            if room is not None:
                shutil.rmtree(room, ignore_errors=True)
    summary = []
    print(
        f"\n{'method':14} {'condition':9} {'median GB/s':>11} {'min':>7} {'max':>7} {'call s':>7} {'process s':>9}"
        "  resident-before"
    )
    for condition in conditions:
        for method in METHODS:
            sel = [r for r in runs if r["method"] == method and r["condition"] == condition]
            rates = [r["bytes"] / r["seconds"] / 1e9 for r in sel]
            res = max(r["resident_before"] for r in sel)
            row = {
                "method": method,
                "condition": condition,
                "median_gbps": statistics.median(rates),
                "min_gbps": min(rates),
                "max_gbps": max(rates),
                "max_resident_before": res,
                "median_call_s": statistics.median(r["seconds"] for r in sel),
                "median_process_s": statistics.median(r["process_s"] for r in sel),
                "bytes": sel[0]["bytes"],
            }
            summary.append(row)
            print(
                f"{method:14} {condition:9} {row['median_gbps']:11.2f} {row['min_gbps']:7.2f} "
                f"{row['max_gbps']:7.2f} {row['median_call_s']:7.3f} {row['median_process_s']:9.3f}  {res:.2f}"
            )
    facts = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "threads": args.threads,
        "files": len(list(model.glob("*.safetensors"))),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"facts": facts, "summary": summary, "runs": runs}, indent=2))
    print(f"\nresults: {out / 'results.json'}")


if __name__ == "__main__":
    main()
