"""Tune the GPU backends' threads and chunk sizes on one machine (warm page cache or tmpfs).

Builds (once) a synthetic Llama-shaped bf16 checkpoint of ``--size`` in ``--dir``, then loads it
in this process with every configuration of the grid, after a warm-up, best of ``--repeat``:

    python -m gdsload.bench.tune_pinned --dir /dev/shm/tune --size 8GB --out tune.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import time

import torch

from gdsload.loader import load_rank, parse_size
from gdsload.loader.io.pinned import PinnedBackend
from gdsload.loader.prepare.synthetic import make_checkpoint, shape_for_size


def _load(d: str, **kw) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = load_rank(d, 0, device="cuda", **kw)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n = res.report.logical_bytes
    res.close()
    del res
    gc.collect()
    return n / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="8GB")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from pathlib import Path

    if not (Path(args.dir) / "gdsload.json").exists():
        t = time.perf_counter()
        make_checkpoint(args.dir, shape_for_size(parse_size(args.size)), tp=1, max_file_bytes=2500 << 20)
        print(f"built {args.dir} in {time.perf_counter() - t:.1f} s", flush=True)
    results = []

    def rec(**kw):
        buffers = kw.pop("buffers", None)
        if buffers:
            PinnedBackend.BUFFERS_PER_THREAD = buffers
        try:
            _load(args.dir, **kw)
            best = max(_load(args.dir, **kw) for _ in range(args.repeat))
            r = {**kw, "buffers": buffers, "gbps": round(best, 2)}
        except Exception as e:
            r = {**kw, "buffers": buffers, "error": repr(e)}
        finally:
            PinnedBackend.BUFFERS_PER_THREAD = 2
        print(json.dumps(r), flush=True)
        results.append(r)

    MiB = 1 << 20
    for threads, chunk, buffers in itertools.product((12, 16, 24), (1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB), (2, 3)):
        rec(backend="pinned", num_threads=threads, chunk_bytes=chunk, buffers=buffers)
    for threads, task in itertools.product((16, 24, 32), (1 * MiB, 2 * MiB, 4 * MiB)):
        rec(backend="cufile", num_threads=threads, chunk_bytes=task)
    rec(backend="fastsafetensors")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
