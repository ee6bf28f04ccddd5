"""Tensor-parallel cold start on one host: every rank in its own process, on its own GPU, at once.

    python -m gdsload.bench.multi_gpu /dev/shm/tp2 --single /dev/shm/plain \\
        --compressed /dev/shm/tp2-ans --repeat 2 --out tp2.json

Rows, each load in fresh processes:

- ``single``: one process, one GPU, the whole unsharded checkpoint (``--single``): the one-GPU
  figure the others scale against;
- ``group``: METHOD on the tensor-parallel checkpoint, ``world`` processes as ``torchrun`` starts
  them (every GPU visible, rank R on ``cuda:R``) in a ``gloo`` process group. After a barrier each
  process loads its own rank's files. Aggregate GB/s = every rank's bytes / (last end - first
  start). Peers' own process-group modes (fastsafetensors, InstantTensor) share one file list
  among the ranks and hand every rank every tensor; shards differ per rank, so each rank runs the
  peer on its own files and the group only lines the ranks up. ``world=1`` is rank 0 alone;
- ``serve``: ``gdsload serve --tp N`` (one worker per GPU, each seeing only its own), time to
  ``/readyz`` 200 and the ranks' load window from ``/v1/status``;
- ``limits``: reference rates from the same run: a parallel read of every rank's files
  into host memory by Python threads (no GPU; loaders in C++ threads can read faster, so it is no
  ceiling), pinned copies to one GPU, and pinned copies to all ``tp`` GPUs at once (which no loader
  staging through host memory can beat; GPU runs only).

While every process still holds its tensors, ``nvidia-smi`` says which processes hold memory on
which GPU (``gpu_processes``, by GPU UUID): a process listed on a GPU other than its rank's carries
a CUDA context there. ``--device cpu`` runs the same rows with the CPU backend (the CI smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["gpu_processes", "main", "run_group", "run_serve", "run_single"]

GROUP_METHODS = ("gdsload:pinned", "fastsafetensors", "instanttensor")


def gpu_processes() -> dict[int, dict[str, int]] | None:
    """``{pid: {GPU UUID: MiB}}`` of every process ``nvidia-smi`` lists; None without nvidia-smi.

    UUIDs as torch prints them (``str(torch.cuda.get_device_properties(i).uuid)``, no ``GPU-``
    prefix), so they compare with what a process or the sidecar reports whatever
    ``CUDA_VISIBLE_DEVICES`` renumbered. A process appears on a GPU when it has a CUDA context (and
    memory) there. In a container whose PID namespace hides host PIDs, nvidia-smi may list none: an
    empty dict then proves nothing.
    """
    try:
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    out: dict[int, dict[str, int]] = {}
    for line in apps.strip().splitlines():
        pid, uuid, mib = (x.strip() for x in line.split(","))
        if pid.isdigit():
            out.setdefault(int(pid), {})[uuid.removeprefix("GPU-")] = int(mib) if mib.isdigit() else -1
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_files(model_dir: str, rank: int) -> list[str]:
    from ..loader import discover

    return list(discover(model_dir, rank).files)


# ---------------------------------------------------------------------------------------------- group


def _group_worker(method: str, model_dir: str, device_kind: str) -> None:
    """One rank of a ``group`` row (run as ``--worker``); rank 0 prints the row's JSON."""
    import torch
    import torch.distributed as dist

    from .methods import load, prepare

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = "cpu"
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    device = prepare(method, device)
    files = _rank_files(model_dir, rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist.barrier()
    t0 = time.time()
    keep, nbytes, extra = load(method, model_dir, device, rank=rank, files=files)
    t1 = time.time()
    mem = None
    if device.startswith("cuda"):
        mem = {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}
    dist.barrier()  # every rank holds its tensors now
    smi = gpu_processes() if rank == 0 and device.startswith("cuda") else None
    uuid = str(torch.cuda.get_device_properties(device).uuid) if device.startswith("cuda") else None
    mine = {
        "rank": rank,
        "pid": os.getpid(),
        "device": device,
        "uuid": uuid,
        "start": t0,
        "end": t1,
        "bytes": nbytes,
        "torch_memory": mem,
        "extra": {k: v for k, v in extra.items() if k in ("backend", "io_modes")},
    }
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, mine)
    dist.barrier()
    del keep
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"ranks": rows, "gpu_processes": smi}))


def run_group(method: str, model_dir: str, world: int, device: str = "cuda", timeout: float = 300.0) -> dict[str, Any]:
    """Start ``world`` rank processes of ``method`` on ``model_dir`` and collect their row."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world)}
    procs = []
    for r in range(world):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "gdsload.bench.multi_gpu", "--worker", method, model_dir, "--device", device],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {"method": method, "world": world, "error": f"not done after {timeout:.0f} s"}
        outs.append((p.returncode, out, err))
    bad = [(rc, err) for rc, _, err in outs if rc != 0]
    if bad:
        return {"method": method, "world": world, "error": bad[0][1].strip().splitlines()[-3:]}
    doc = json.loads(outs[0][1].strip().splitlines()[-1])
    if doc["gpu_processes"] is not None:  # JSON turned the integer keys into strings
        doc["gpu_processes"] = {int(pid): gpus for pid, gpus in doc["gpu_processes"].items()}
    ranks = doc["ranks"]
    window = max(r["end"] for r in ranks) - min(r["start"] for r in ranks)
    total = sum(r["bytes"] for r in ranks)
    return {
        "row": "group",
        "method": method,
        "world": world,
        "bytes": total,
        "window_s": window,
        "aggregate_gbps": total / window / 1e9,
        "per_rank_gbps": {r["rank"]: r["bytes"] / (r["end"] - r["start"]) / 1e9 for r in ranks},
        "contexts": _contexts({r["pid"]: r["uuid"] for r in ranks if r["uuid"]}, doc["gpu_processes"]),
        **doc,
    }


def _contexts(own: dict[int, str], smi: dict[int, dict[str, int]] | None) -> dict[str, Any] | None:
    """For each process of a row (pid -> its own GPU's UUID): the GPUs nvidia-smi lists it on, and
    those that are not its own (each a CUDA context it should not hold)."""
    if smi is None or not own:
        return None
    seen = {str(pid): sorted(smi.get(pid, {})) for pid in own}
    return {
        "gpus_by_pid": seen,
        "listed": sum(1 for g in seen.values() if g),
        "foreign": {
            pid: [g for g in gpus if g != own[int(pid)]]
            for pid, gpus in seen.items()
            if any(g != own[int(pid)] for g in gpus)
        },
        "mib_by_pid": {str(pid): smi.get(pid, {}) for pid in own},
    }


# ---------------------------------------------------------------------------------------------- limits


def _limits_worker(model_dir: str, tp: int, device: str) -> None:
    """The ``limits`` row (run as ``--limits``, so that no CUDA context stays in the parent)."""
    from ..loader import discover

    from .limits import h2d_all_gbps, h2d_gbps, raw_read_gbps, raw_read_together

    per_rank = [discover(model_dir, r).files for r in range(tp)]
    files = [f for fs in per_rank for f in fs]
    row: dict[str, Any] = {
        "row": "limits",
        "tp": tp,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "files": len(files),
        "bytes": sum(os.path.getsize(f) for f in files),
    }
    for threads in (16, 32):
        row[f"raw_read_gbps_{threads}_threads"] = raw_read_gbps(files, direct=False, threads=threads)
    # The same bytes read by one process per rank at once (16 threads each): does the host's
    # read side scale with the number of loaders? Each reader reuses its own buffer: at 16 MiB the
    # reads write to DRAM; 4 MiB buffers (the loaders' bounce size) can stay in the CPU's cache.
    row["raw_read_rank_processes"] = raw_read_together(per_rank, threads=16)
    row["raw_read_gbps_16_threads_4mib"] = raw_read_gbps(files, direct=False, threads=16, chunk=4 << 20)
    row["raw_read_rank_processes_4mib"] = raw_read_together(per_rank, threads=16, chunk=4 << 20)
    if device == "cuda":
        row["h2d_one_gpu_gbps"] = h2d_gbps("cuda:0")
        row["h2d_all_gpus_gbps"] = h2d_all_gbps([f"cuda:{i}" for i in range(tp)])
    print(json.dumps(row))


def run_limits(model_dir: str, tp: int, device: str = "cuda", timeout: float = 300.0) -> dict[str, Any]:
    try:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "gdsload.bench.multi_gpu",
                model_dir,
                "--limits",
                "--tp",
                str(tp),
                "--device",
                device,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"row": "limits", "error": f"not done after {timeout:.0f} s"}
    if p.returncode != 0:
        return {"row": "limits", "error": p.stderr.strip().splitlines()[-3:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- single, serve


def run_single(method: str, model_dir: str, device: str = "cuda", timeout: float = 300.0) -> dict[str, Any]:
    """The whole checkpoint on one GPU, in a fresh process (:mod:`gdsload.bench.methods`)."""
    dev = "cuda:0" if device == "cuda" else device
    try:
        p = subprocess.run(
            [sys.executable, "-m", "gdsload.bench.methods", method, model_dir, dev],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"row": "single", "method": method, "error": [f"timed out after {timeout:g} s"]}
    if p.returncode != 0:
        return {"row": "single", "method": method, "error": p.stderr.strip().splitlines()[-3:]}
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return {"row": "single", "gbps": r["bytes"] / r["seconds"] / 1e9, **r}


def run_serve(model_dir: str, tp: int, device: str = "cuda", timeout: float = 300.0) -> dict[str, Any]:
    """``gdsload serve --tp N``: time to ready, the ranks' load window, which GPUs each worker holds."""
    from .ttr import time_to_ready

    args = ["--tp", str(tp)] + (["--device-map", "cpu"] if device == "cpu" else [])

    def inspect(status: dict[str, Any]) -> dict[str, Any]:
        ranks = status["ranks"]
        own = {d["pid"]: d["gpu"]["uuid"] for d in ranks.values() if d.get("pid") and (d.get("gpu") or {}).get("uuid")}
        return {
            "gpus": {
                r: {
                    "cuda_visible_devices": d.get("cuda_visible_devices"),
                    "device": d.get("device"),
                    "uuid": (d.get("gpu") or {}).get("uuid"),
                }
                for r, d in ranks.items()
            },
            "contexts": _contexts(own, gpu_processes()),
        }

    r = time_to_ready(model_dir, args, timeout=timeout, while_ready=inspect)
    return {"row": "serve", "tp": tp, "dir": model_dir, **r}


# ---------------------------------------------------------------------------------------------- main


def _summary(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    single = [
        r["gbps"]
        for r in rows
        if r.get("row") == "single" and r.get("method", "").startswith("gdsload:") and "gbps" in r
    ]
    base = statistics.median(single) if single else None
    for r in rows:
        if "error" in r:
            out.append(f"{r.get('row')} {r.get('method', r.get('dir'))}: ERROR {r['error']}")
        elif r["row"] == "limits":
            h2d = (
                f"; pinned H2D one GPU {r['h2d_one_gpu_gbps']:.1f}, all GPUs at once {r['h2d_all_gpus_gbps']:.1f} GB/s"
                if "h2d_one_gpu_gbps" in r
                else ""
            )
            together, small = r.get("raw_read_rank_processes") or {}, r.get("raw_read_rank_processes_4mib") or {}
            ranks = (
                f"; {together['processes']} processes at once {together['aggregate_gbps']:.1f} GB/s together"
                f" (4 MiB reads: one process {r['raw_read_gbps_16_threads_4mib']:.1f}, "
                f"{small['processes']} at once {small['aggregate_gbps']:.1f})"
                if together and small
                else ""
            )
            out.append(
                f"limits  raw read {r['raw_read_gbps_16_threads']:.1f} (16 thr) / "
                f"{r['raw_read_gbps_32_threads']:.1f} (32 thr) GB/s{ranks}{h2d}"
            )
        elif r["row"] == "single":
            out.append(f"single  {r['method']:18} {r['gbps']:6.2f} GB/s (one GPU, whole checkpoint)")
        elif r["row"] == "group":
            scale = f" = {r['aggregate_gbps'] / base:.2f} x single" if base else ""
            ctx = r.get("contexts") or {}
            label = r["method"] + (":compressed" if r.get("compressed") else "")
            out.append(
                f"group   {label:18} world={r['world']} {r['aggregate_gbps']:6.2f} GB/s{scale}; "
                f"per rank {', '.join(f'{v:.1f}' for v in r['per_rank_gbps'].values())}; "
                f"foreign contexts {ctx.get('foreign') if ctx else 'n/a'}"
            )
        else:
            agg = r.get("aggregate_gbps") or 0
            scale = f" = {agg / base:.2f} x single" if base else ""
            ctx = (r.get("while_ready") or {}).get("contexts") or {}
            out.append(
                f"serve   tp={r['tp']} {Path(r['dir']).name:12} ready {r['time_to_ready_s']:.2f} s, loads "
                f"{r['load_window_s']:.2f} s window ({r.get('loads_overlap_s') or 0:.2f} s all at once), "
                f"{agg:.2f} GB/s{scale}; CUDA ready after "
                f"{'/'.join(f'{v:.2f}' for v in (r.get('cuda_ready_after_s') or {}).values()) or 'n/a'} s; "
                f"foreign contexts {ctx.get('foreign') if ctx else 'n/a'}"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", help="the tensor-parallel checkpoint")
    ap.add_argument("--worker", metavar="METHOD", help=argparse.SUPPRESS)
    ap.add_argument("--limits", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--single", help="the same checkpoint unsharded (tp=1), for the one-GPU row")
    ap.add_argument("--compressed", help="a compressed copy of the tensor-parallel checkpoint")
    ap.add_argument("--methods", default=",".join(GROUP_METHODS))
    ap.add_argument("--tp", type=int, default=None, help="ranks (default: the checkpoint's)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--no-serve", action="store_true", help="skip the gdsload serve rows")
    ap.add_argument("--out", default=None, help="write every row here as JSON")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    if args.worker:
        _group_worker(args.worker, args.model_dir, args.device)
        return 0
    from ..loader import discover

    from . import stop_on_sigterm

    stop_on_sigterm()  # the serve and group children are stopped on the way out
    tp = args.tp or discover(args.model_dir, 0).tp_size
    if args.limits:
        _limits_worker(args.model_dir, tp, args.device)
        return 0
    methods = args.methods.split(",")
    if args.device == "cpu":
        methods = ["gdsload:cpu" if m.startswith("gdsload:") else m for m in methods]
    rows: list[dict[str, Any]] = []

    def add(r: dict[str, Any]) -> None:
        rows.append(r)
        print(json.dumps(r, default=str)[:600], flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"tp": tp, "rows": rows}, indent=1, default=str))

    add(run_limits(args.model_dir, tp, args.device, args.timeout))
    for i in range(args.repeat):
        if args.single:
            for m in methods:
                add({**run_single(m, args.single, args.device, args.timeout), "run": i})
        worlds = sorted({1, tp})  # tp=1 runs world 1 once
        for m in methods:
            for world in worlds:
                add({**run_group(m, args.model_dir, world, args.device, args.timeout), "run": i})
        if args.compressed:
            m = "gdsload:cpu" if args.device == "cpu" else "gdsload:pinned"
            for world in worlds:
                add({**run_group(m, args.compressed, world, args.device, args.timeout), "run": i, "compressed": True})
        if not args.no_serve:
            for d in filter(None, (args.model_dir, args.compressed)):
                add({**run_serve(d, tp, args.device, args.timeout), "run": i})
    print("\n".join(_summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
