"""Training checkpoints: compressed save/load of a transformer + AdamW against ``torch.save``.

Trains a small transformer for a few AdamW steps on the GPU, then saves model + optimizer with
each algorithm, reloads, checks every tensor bit for bit, and reports the ratio and the time of
each part: compressing (GPU, and copying the stored bytes to the host), writing, and the whole
call, which the compress‖write pipeline keeps near max(compress, write). ``torch.save`` /
``torch.load`` of the same state are timed as the baseline:

    python -m gdsload.bench.ckpt_bench --dir /root/ckpt --layers 12 --out ckpt.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from gdsload.loader.checkpoints.container import load_compressed_checkpoint, save_compressed_checkpoint


def _same(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.detach().cpu().reshape(-1).view(torch.uint8),
                           b.detach().cpu().reshape(-1).view(torch.uint8)), where  # bit for bit
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="where the checkpoints are written (a disk, for honest write times)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--algorithms", default="ANS,Zstd")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out_dir = Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    layer = torch.nn.TransformerEncoderLayer(args.width, args.width // 64, 4 * args.width, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(args.steps):
        x = torch.randn(8, 256, args.width, device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for s in opt.state_dict()["state"].values() for v in s.values()
                  if isinstance(v, torch.Tensor))
    rows = []

    p = out_dir / "torch.pt"
    t = time.perf_counter()
    torch.save(state, p)
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    save_s = time.perf_counter() - t
    _drop(p)
    t = time.perf_counter()
    back = torch.load(p, map_location="cuda")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    _same(back, state, "torch")
    rows.append({"algorithm": "torch.save", "bytes": nbytes, "file_bytes": p.stat().st_size, "ratio": 1.0,
                 "save_seconds": save_s, "load_seconds_cold": load_s})
    print(json.dumps(rows[-1]), flush=True)
    p.unlink()

    for algo in args.algorithms.split(","):
        p = out_dir / f"ckpt-{algo.lower()}.safetensors"
        save_compressed_checkpoint(model, opt, p, algo)  # warm-up: codecs, kernels
        r = save_compressed_checkpoint(model, opt, p, algo)
        _drop(p)
        t = time.perf_counter()
        back = load_compressed_checkpoint(p, "cuda")
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t
        _same(back["model"], state["model"], f"{algo} model")
        _same(back["optimizer"], state["optimizer"], f"{algo} optimizer")
        rows.append({"algorithm": algo, "writer": r.writer, "bytes": r.logical_bytes, "file_bytes": r.file_bytes,
                     "ratio": r.ratio, "tensors": r.tensors, "compressed": r.compressed,
                     "compress_seconds": r.compress_seconds, "write_seconds": r.write_seconds,
                     "save_seconds": r.total_seconds, "load_seconds_cold": load_s, "bit_exact": True})
        print(json.dumps(rows[-1]), flush=True)
        p.unlink()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "layers": args.layers,
                                              "width": args.width, "steps": args.steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
