"""Peak resident memory of ``gdsload shard`` on a checkpoint far larger than any one tensor.

Builds a synthetic Hugging Face Llama checkpoint (``model-0000k-of-0000n.safetensors``, index,
config.json; bf16 N(0, 0.02) values, written one tensor at a time), then runs the ``gdsload
shard`` command in a fresh process and reads that process's peak RSS from the kernel
(``wait4`` rusage ``ru_maxrss``: the high-water mark, not a sample). A second fresh process that
only imports the same modules gives the baseline (Python + torch + safetensors).

The bound checked: ``peak <= baseline + 1.25 x largest tensor + 256 MiB`` — the writer holds one
output tensor (at most the largest source tensor, plus vocabulary padding), and reads its
sources in 32 MiB chunks, each through its own mapping, so the model size never enters.

    python -m gdsload.bench.shard_rss --size 2GB --tp 2 --out /tmp/shard-rss
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

_MiB = 1 << 20
_IMPORTS = "import torch, safetensors, rich, click; import gdsload.loader.prepare.shard, gdsload.server.cmd_shard"
_SHARD = "from gdsload.server.cmd_shard import shard; shard(prog_name='gdsload shard')"


def build_source(path: Path, size: int, max_file_bytes: int = 1 << 30) -> dict[str, int]:
    """Write a synthetic HF checkpoint of about ``size`` bytes; returns its facts."""
    import torch

    from gdsload.loader.format.safetensors import AlignedWriter, TensorSpec
    from gdsload.loader.prepare.synthetic import file_groups, shape_for_size, tensor_shapes

    shape = shape_for_size(size)
    entries = [(name, s) for name, s, _ in tensor_shapes(shape)]
    groups = file_groups(entries, max_file_bytes)
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    gen = torch.Generator().manual_seed(0)
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        shapes = dict(group)
        with AlignedWriter(path / fname, [TensorSpec(n, "BF16", s) for n, s in group], {"format": "pt"}) as w:
            for spec in w.order:
                t = torch.randn(shapes[spec.name], generator=gen).mul_(0.02).to(torch.bfloat16)
                if t.dim() == 1:
                    t.add_(1.0)
                w.write(spec.name, t)
                del t
        weight_map.update({n: fname for n, _ in group})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(shape.config_json(), indent=2))
    return {"bytes": sum(math.prod(s) * 2 for _, s in entries),
            "largest_tensor_bytes": max(math.prod(s) * 2 for _, s in entries),
            "tensors": len(entries), "files": len(groups), "layers": shape.layers, "hidden": shape.hidden}


def _peak_rss(args: list[str]) -> tuple[int, float, str]:
    """Run a child that reports its own peak RSS (``VmHWM``, the kernel's high-water mark) on exit."""
    t = time.perf_counter()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate()
    seconds = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{args[2][:60]!r} failed ({p.returncode}):\n{err}")
    peak = int(out.strip().splitlines()[-1].split("PEAK_RSS=")[1])
    return peak, seconds, out


def _measured(code: str) -> str:
    """Python that runs ``code`` and prints the process's own peak RSS (VmHWM) when it ends."""
    return (
        "import sys\n"
        f"sys.argv[0] = 'gdsload shard'\n"
        "try:\n"
        f"    {code}\n"
        "except SystemExit as e:\n"
        "    if e.code not in (0, None): raise\n"
        "finally:\n"
        "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
        "    print(f'PEAK_RSS={int(hwm) * 1024}', flush=True)\n"
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GB", help="synthetic checkpoint size (default 2GB)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layout", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--quantize", default=None, help="e.g. fp8 or fp8:per-channel")
    ap.add_argument("--out", default="shard-rss", help="work directory: src/ (the checkpoint), sharded/ and "
                    "results.json go here; other files in it are left alone")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the shards (else they are removed)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)

    from gdsload.loader import format_bytes, parse_size

    work = Path(args.out)
    src, dst = work / "src", work / "sharded"
    shutil.rmtree(dst, ignore_errors=True)
    facts_path = work / "src-facts.json"
    if facts_path.exists() and (src / "config.json").exists():
        source = json.loads(facts_path.read_text())
    else:
        shutil.rmtree(src, ignore_errors=True)
        print(f"building a {args.size} synthetic HF checkpoint in {src} ...", file=sys.stderr, flush=True)
        source = build_source(src, parse_size(args.size))
        facts_path.write_text(json.dumps(source))
    baseline, _, _ = _peak_rss([sys.executable, "-c", _measured(_IMPORTS)])
    cmd = [str(src), str(dst), "--tp", str(args.tp), "--layout", args.layout, "--no-progress"]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    code = f"sys.argv[1:] = {cmd!r}\n    {_SHARD}"
    peak, seconds, _ = _peak_rss([sys.executable, "-c", _measured(code)])
    out_bytes = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    bound = baseline + int(1.25 * source["largest_tensor_bytes"]) + 256 * _MiB
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "command": f"gdsload shard {' '.join(cmd)}",
        "source": source, "output_bytes": out_bytes, "seconds": round(seconds, 2),
        "baseline_rss_bytes": baseline, "peak_rss_bytes": peak, "peak_above_baseline_bytes": peak - baseline,
        "bound_bytes": bound, "within_bound": peak <= bound,
    }
    if not args.keep:  # only what this run made: the directory may hold the user's other files
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)
        facts_path.unlink(missing_ok=True)
    (work / "results.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"checkpoint {format_bytes(source['bytes'])} (largest tensor {format_bytes(source['largest_tensor_bytes'])}), "
              f"tp={args.tp} layout={args.layout} quantize={args.quantize}: {seconds:.1f} s; peak RSS "
              f"{format_bytes(peak)} = baseline {format_bytes(baseline)} + {format_bytes(peak - baseline)}; "
              f"bound {format_bytes(bound)}: {'ok' if result['within_bound'] else 'EXCEEDED'}")
    return result


if __name__ == "__main__":
    main()
