"""Training checkpoints: the training loop's stall, the save's total time, bytes written and the restore, per method.

A training state of fp32 master weights and AdamW's two moments (``--size`` in all; real AdamW steps on random
gradients make the moments) is written once as a plain safetensors file; then each method runs in a fresh process
(methods take turns, ``--rounds`` times): load the state onto ``--device`` (not timed), save it to ``--dir``, drop
the written files from the page cache, restore them onto the device, check every tensor bit for bit.

- ``torch.save``: ``torch.save`` + fsync; restore ``torch.load(map_location=device)``;
- ``dcp`` / ``dcp-async``: ``dcp.save`` / ``dcp.async_save`` with DCP's ``FileSystemWriter``; restore ``dcp.load``;
- ``dcp-zstd`` / ``dcp-zstd-async``: the same with DCP's ``ZStandard`` extension;
- ``gdsload-dcp`` / ``gdsload-dcp-async``: ``dcp.save`` / ``dcp.async_save`` through ``GdsloadWriter``, restore
  through ``GdsloadReader``;
- ``gdsload``: ``gdsload.save`` / ``gdsload.load``; ``container``: ``save_compressed_checkpoint``.

``stall`` is how long the training loop waits (the whole save, or until ``async_save`` returns); for the
``async_save`` methods, ``next save's stall`` is that of a second save of the same state right after the first, in
the same process (a training job saves again and again, and reuses what its first save set up); ``save`` until the
checkpoint is complete on disk; ``restore`` the load into memory on the device (DCP methods into tensors allocated
before the clock starts, as a training job has them). One command on a GPU host::

    python -m gdsload.bench.ckpt_bench run --size 6GB --device cuda --dir /mnt/disk/ckpt-bench --rounds 3 \\
        --out ckpt-gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

METHODS = (
    "torch.save",
    "dcp",
    "dcp-async",
    "dcp-zstd",
    "dcp-zstd-async",
    "gdsload-dcp",
    "gdsload-dcp-async",
    "gdsload",
    "container",
)
_SIDE = 4096


# --------------------------------------------------------------------------- the state


def prepare(size: int, out: Path, steps: int = 3) -> Path:
    """Write a training state of about ``size`` bytes (weights and AdamW moments) to ``out/state.safetensors``."""
    import torch
    from safetensors.torch import save_file

    params = max(1, size // 12)  # 4 bytes of weight and 8 of moments per parameter
    shapes: list[tuple[int, ...]] = []
    while params > 0:
        rows = max(1, min(_SIDE, params // _SIDE - 1))
        shapes += [(rows, _SIDE), (_SIDE,)]  # a matrix, and a norm's weight beside it
        params -= rows * _SIDE + _SIDE
    g = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    opt = torch.optim.AdamW(weights, lr=1e-4, weight_decay=0.1)
    for _ in range(steps):
        for w in weights:  # gradients of changing scale per tensor, so the moments are not all alike
            w.grad = torch.randn(w.shape, generator=g) * 10 ** -torch.empty(1).uniform_(2, 4, generator=g).item()
        opt.step()
    flat = {f"model/w{i}": w.detach() for i, w in enumerate(weights)}
    for i, w in enumerate(weights):
        for key, value in opt.state[w].items():
            flat[f"optim/{i}/{key}"] = value
    out.mkdir(parents=True, exist_ok=True)
    save_file(flat, out / "state.safetensors")
    (out / "state.json").write_text(
        json.dumps(
            {
                "size": size,
                "tensors": len(weights),
                "steps": steps,
                "bytes": sum(t.numel() * t.element_size() for t in flat.values()),
            }
        )
    )
    return out / "state.safetensors"


def load_state(path: Path, device: str) -> dict[str, Any]:
    """The state as a training job holds it: ``{"model": {...}, "optim": optimizer.state_dict()-like}``."""
    from safetensors.torch import load_file

    flat = load_file(path, device=device)
    model = {k.split("/")[1]: v for k, v in flat.items() if k.startswith("model/")}
    state: dict[int, dict[str, Any]] = {}
    for k, v in flat.items():
        if k.startswith("optim/"):
            _, i, key = k.split("/")
            state.setdefault(int(i), {})[key] = v
    groups = [
        {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False, "params": sorted(state)}
    ]
    return {"model": model, "optim": {"state": dict(sorted(state.items())), "param_groups": groups}}


def _template(state: Any) -> Any:
    import torch

    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: _template(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_template(v) for v in state]
    return state


def _same(a: Any, b: Any, where: str) -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# --------------------------------------------------------------------------- one method, in this process


def _drop_cache(root: Path) -> int:
    total = 0
    for p in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        total += p.stat().st_size
    return total


def run_one(method: str, state_path: Path, out: Path, device: str) -> dict[str, Any]:
    """Save and restore ``state_path``'s state with ``method``; the figures as a dict."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    import gdsload
    from ..loader.checkpoints import GdsloadReader, GdsloadWriter
    from ..loader.checkpoints.container import load_compressed_checkpoint, save_compressed_checkpoint

    warnings.simplefilter("ignore")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    state = load_state(state_path, device)
    sync()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    target = out / ("ckpt.safetensors" if method == "container" else "ckpt.pt")
    zstd = []
    if "zstd" in method:
        from torch.distributed.checkpoint._extension import ZStandard

        zstd = [ZStandard()]
    writer: Any = None
    if method.startswith("dcp"):
        writer = FileSystemWriter(out, _extensions=zstd)
    elif method.startswith("gdsload-dcp"):
        writer = GdsloadWriter(out)
    t0 = time.perf_counter()
    if method == "torch.save":
        with open(target, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        stall = time.perf_counter() - t0
    elif method == "gdsload":
        gdsload.save(state, target)
        stall = time.perf_counter() - t0
    elif method == "container":
        save_compressed_checkpoint(state["model"], state["optim"], target, "auto")
        stall = time.perf_counter() - t0
    elif method.endswith("-async"):
        future = dcp.async_save(state, storage_writer=writer)
        stall = time.perf_counter() - t0
        future.result()
    else:
        dcp.save(state, storage_writer=writer)
        stall = time.perf_counter() - t0
    save_s = time.perf_counter() - t0
    next_stall = None
    if method.endswith("-async"):
        # A training job saves again and again: from the second save on, what was set up once is there.
        again = out.with_name(out.name + "-next")
        shutil.rmtree(again, ignore_errors=True)
        other = GdsloadWriter(again) if method.startswith("gdsload") else FileSystemWriter(again, _extensions=zstd)
        t1 = time.perf_counter()
        future = dcp.async_save(state, storage_writer=other)
        next_stall = time.perf_counter() - t1
        future.result()
        shutil.rmtree(again)
    written = _drop_cache(out)

    template = _template(state) if method.startswith(("dcp", "gdsload-dcp")) else None
    sync()
    t0 = time.perf_counter()
    if method == "torch.save":
        back = torch.load(target, map_location=device, weights_only=True)
    elif method == "gdsload":
        back = gdsload.load(target, map_location=device)
    elif method == "container":
        got = load_compressed_checkpoint(target, device)
        back = {"model": got["model"], "optim": got["optimizer"]}
    else:
        dcp.load(template, storage_reader=GdsloadReader(out) if method.startswith("gdsload") else FileSystemReader(out))
        back = template
    sync()
    restore = time.perf_counter() - t0
    _same(state, back, "state")
    logical = sum(t.numel() * t.element_size() for t in state["model"].values())
    logical += sum(v.numel() * v.element_size() for s in state["optim"]["state"].values() for v in s.values())
    row = {
        "method": method,
        "stall_s": stall,
        "next_stall_s": next_stall,
        "save_s": save_s,
        "restore_s": restore,
        "logical_bytes": logical,
        "written_bytes": written,
        "ratio": logical / written,
        "bit_exact": True,
    }
    if isinstance(writer, GdsloadWriter) and writer.last_stage is not None:
        row["staged_host_bytes"] = writer.last_stage.host_bytes
    return row


# --------------------------------------------------------------------------- rounds of fresh processes


def run(state_path: Path, root: Path, methods: list[str], rounds: int, device: str) -> dict[str, Any]:
    rows = []
    for r in range(rounds):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        for method in order:
            cmd = [
                sys.executable,
                "-m",
                "gdsload.bench.ckpt_bench",
                "one",
                "--method",
                method,
                "--state",
                str(state_path),
                "--dir",
                str(root / "out"),
                "--device",
                device,
            ]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"{method} failed (round {r + 1}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
            row = json.loads(p.stdout.strip().splitlines()[-1])
            row["round"] = r + 1
            rows.append(row)
            print(json.dumps(row), flush=True)
    shutil.rmtree(root / "out", ignore_errors=True)
    summary = []
    for method in methods:
        mine = [x for x in rows if x["method"] == method]
        entry: dict[str, Any] = {
            "method": method,
            "written_bytes": mine[-1]["written_bytes"],
            "ratio": mine[-1]["ratio"],
        }
        for key in ("stall_s", "next_stall_s", "save_s", "restore_s"):
            vals = [x[key] for x in mine if x.get(key) is not None]
            entry[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
        summary.append(entry)
    return {"device": device, "rounds": rounds, "rows": rows, "summary": summary}


def table(doc: dict[str, Any]) -> str:
    """The summary as a markdown table: median (min–max) seconds."""

    def cell(d: dict[str, float] | None) -> str:
        return f"{d['median']:.2f} ({d['min']:.2f}–{d['max']:.2f})" if d else "–"

    lines = [
        "| method | stall s | next save's stall s | save s | restore s | written GB | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in doc["summary"]:
        lines.append(
            f"| {e['method']} | {cell(e['stall_s'])} | {cell(e.get('next_stall_s'))} | {cell(e['save_s'])} | "
            f"{cell(e['restore_s'])} | {e['written_bytes'] / 1e9:.3f} | {e['ratio']:.3f} |"
        )
    return "\n".join(lines)


def _size(text: str) -> int:
    from ..loader import parse_size

    return parse_size(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="prepare the state (unless --state) and time every method")
    r.add_argument("--size", type=_size, default=_size("2GB"), help="state bytes (weights and moments)")
    r.add_argument("--state", type=Path, default=None, help="a state.safetensors `prepare` wrote")
    r.add_argument("--dir", type=Path, required=True, help="where checkpoints are written (a real disk)")
    r.add_argument("--device", default="cpu")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--methods", default=",".join(METHODS))
    r.add_argument("--out", type=Path, default=None)
    p = sub.add_parser("prepare", help="only write the state")
    p.add_argument("--size", type=_size, required=True)
    p.add_argument("--dir", type=Path, required=True)
    o = sub.add_parser("one", help="one method in this process (what `run` starts)")
    o.add_argument("--method", choices=METHODS, required=True)
    o.add_argument("--state", type=Path, required=True)
    o.add_argument("--dir", type=Path, required=True)
    o.add_argument("--device", default="cpu")
    s = sub.add_parser("smoke", help="every method once on a tiny state, in a temporary directory")
    s.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args(argv)
    if args.command == "prepare":
        print(prepare(args.size, args.dir))
    elif args.command == "one":
        print(json.dumps(run_one(args.method, args.state, args.dir, args.device)))
    elif args.command == "smoke":
        with tempfile.TemporaryDirectory() as tmp:
            state = prepare(4 << 20, Path(tmp) / "state", steps=1)
            doc = run(state, Path(tmp), args.methods.split(","), 1, "cpu")
        print(table(doc))
    else:
        methods = args.methods.split(",")
        unknown = sorted(set(methods) - set(METHODS))
        if unknown:
            raise SystemExit(f"--methods: {unknown} are not among {list(METHODS)}")
        state = args.state or prepare(args.size, args.dir / "state")
        doc = run(state, args.dir, methods, args.rounds, args.device)
        doc["state"] = json.loads((state.parent / "state.json").read_text())
        doc["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(table(doc))
        if args.out:
            args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
