"""``gdsload shard`` against vLLM's own way of writing per-rank files (``save_sharded_state``), per layout.

vLLM's way, as its ``save_sharded_state`` example does it: start the engine on the Hugging Face
checkpoint with the layout (every worker reads the checkpoint, builds its model, loads, profiles
and warms up), then ``save_sharded_state`` writes each worker's state dict. gdsload's way: the
``gdsload shard`` command, in the interpreter that has vLLM (the layout is traced from vLLM's model
code, then each rank's regions of the source are read and written, files in parallel).

Each run is a fresh process (the whole command: imports included); the stopwatch is the wall time
of that process, and memory is the peak of the summed resident memory of it and every process it
started (sampled every 20 ms). Methods take turns; each layout runs ``--rounds`` times. A method
that fails is recorded with the last line of its error. Each run's rank-0 tensor names are counted: vLLM saves
its state dict after its kernels' post-processing, which on some platforms repacks or drops parameters, so
its files may not hold what its own ``sharded_state`` loader asks for.

    gdsload bench shard --vllm-python .venv-engine/bin/python --size 2GB --experts 8 \\
        --layouts tp2,tp2-ep,pp2 --rounds 2 --out /tmp/shard-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Layout", "Run", "parse_layouts", "run_once", "main"]

_VLLM_SAVE = r"""
import sys
from vllm import LLM
src, out, tp, pp, ep = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if __name__ == "__main__":
    kw = {"distributed_executor_backend": "mp"} if pp > 1 else {}
    llm = LLM(model=src, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep > 1,
              dtype="bfloat16", enforce_eager=True, max_model_len=128, skip_tokenizer_init=True, seed=0, **kw)
    llm.llm_engine.engine_core.save_sharded_state(path=out)
"""


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def name(self) -> str:
        return f"tp{self.tp}" + (f"-pp{self.pp}" if self.pp > 1 else "") + ("-ep" if self.ep > 1 else "")

    @property
    def workers(self) -> int:
        return self.tp * self.pp


def parse_layouts(text: str) -> list[Layout]:
    """``"tp2,tp2-ep,pp2,tp2-pp2"`` -> layouts (``-ep``: experts over the tensor-parallel ranks)."""
    out = []
    for item in text.split(","):
        tp = pp = 1
        ep = False
        for piece in item.strip().split("-"):
            if piece.startswith("tp"):
                tp = int(piece[2:])
            elif piece.startswith("pp"):
                pp = int(piece[2:])
            elif piece == "ep":
                ep = True
            else:
                raise SystemExit(f"layout {item!r}: {piece!r} is not tpN, ppN or ep")
        out.append(Layout(tp, pp, tp if ep else 1))
    return out


@dataclass
class Run:
    method: str
    layout: str
    round: int
    ok: bool
    seconds: float
    peak_rss: int
    """Peak of the summed RSS of the process and its descendants, bytes."""
    out_bytes: int
    error: str = ""
    rank0_tensors: int = 0
    """Tensors in rank 0's files."""


def _tree_rss(proc: Any) -> int:
    import psutil

    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_once(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, float, int]:
    """Run ``cmd``; returns (exit code, wall seconds, peak summed RSS of its process tree)."""
    import psutil

    start = time.perf_counter()
    with open(log, "wb") as f:
        popen = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    proc = psutil.Process(popen.pid)
    peak = 0
    while popen.poll() is None:
        peak = max(peak, _tree_rss(proc))
        time.sleep(0.02)
    return popen.returncode, time.perf_counter() - start, peak


def _env(layout: Layout) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")}
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    if layout.workers > 1:
        cores = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(layout.workers))
    return env


def _command(method: str, python: str, src: Path, out: Path, layout: Layout, script: Path) -> list[str]:
    if method == "gdsload":
        return [
            python,
            "-m",
            "gdsload.server.cli",
            "shard",
            str(src),
            str(out),
            "--tp",
            str(layout.tp),
            "--pp",
            str(layout.pp),
            "--ep",
            str(layout.ep),
            "--no-progress",
        ]
    return [python, str(script), str(src), str(out), str(layout.tp), str(layout.pp), str(layout.ep)]


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.safetensors")) if path.exists() else 0


def _rank0_tensors(path: Path) -> int:
    from ..loader.format.safetensors import read_header

    files = [p for p in path.glob("*.safetensors") if p.name.startswith(("model-rank-0-", "model-pp-0-tp-0-"))]
    return sum(len(read_header(p).tensors) for p in files)


def _last_error(log: Path) -> str:
    """The last line of ``log`` that names an error (else its last line)."""
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if "Error" in line or "error" in line]
    last = lines[-1] if lines else (text.strip().splitlines() or [""])[-1]
    return last.strip()[-300:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gdsload bench shard", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--vllm-python",
        default=sys.executable,
        help="An interpreter with vLLM and gdsload installed (default: this one).",
    )
    parser.add_argument("--source", type=Path, help="A Hugging Face checkpoint (default: a synthetic Mixtral).")
    parser.add_argument("--size", default="1GB", help="Size of the synthetic checkpoint (e.g. 2GB).")
    parser.add_argument("--experts", type=int, default=8, help="Experts of the synthetic Mixtral (0: a Llama).")
    parser.add_argument("--layouts", default="tp2,tp2-ep,pp2", help="Comma-separated layouts: tpN[-ppN][-ep].")
    parser.add_argument(
        "--methods",
        default=None,
        help="gdsload and/or vllm (save_sharded_state); default: both where vLLM is installed.",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("shard-bench-out"))
    args = parser.parse_args(argv)

    from ..loader.config import parse_size
    from ..loader.prepare.synthetic import make_hf_checkpoint, shape_for_size

    args.out.mkdir(parents=True, exist_ok=True)
    src = args.source
    if src is None:
        src = args.out / "source"
        if not (src / "config.json").exists():
            shape = shape_for_size(parse_size(args.size), experts=args.experts)
            print(f"writing a synthetic {'Mixtral' if args.experts else 'Llama'} of {args.size} to {src}", flush=True)
            make_hf_checkpoint(src, shape, max_file_bytes=1 << 30)
    src_bytes = _size(src)
    script = args.out / "vllm_save_sharded_state.py"
    script.write_text(_VLLM_SAVE)
    has_vllm = subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True).returncode == 0
    methods = args.methods.split(",") if args.methods else (["gdsload", "vllm"] if has_vllm else ["gdsload"])
    runs: list[Run] = []
    for layout in parse_layouts(args.layouts):
        for rnd in range(args.rounds):
            for method in methods if rnd % 2 == 0 else methods[::-1]:  # taking turns
                out = args.out / f"{method}-{layout.name}"
                shutil.rmtree(out, ignore_errors=True)
                if method == "vllm":
                    out.mkdir(parents=True)
                log = args.out / f"{method}-{layout.name}-{rnd}.log"
                code, seconds, peak = run_once(
                    _command(method, args.vllm_python, src, out, layout, script), _env(layout), log
                )
                run = Run(
                    method,
                    layout.name,
                    rnd,
                    code == 0,
                    seconds,
                    peak,
                    _size(out),
                    "" if code == 0 else _last_error(log),
                    _rank0_tensors(out),
                )
                runs.append(run)
                print(json.dumps(asdict(run)), flush=True)
    summary: dict[str, Any] = {
        "source": str(src),
        "source_bytes": src_bytes,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "runs": [asdict(r) for r in runs],
        "table": [],
    }
    for layout in parse_layouts(args.layouts):
        for method in methods:
            mine = [r for r in runs if r.method == method and r.layout == layout.name]
            ok = [r for r in mine if r.ok]
            row = {
                "layout": layout.name,
                "method": method,
                "ok": f"{len(ok)}/{len(mine)}",
                "seconds": [round(r.seconds, 1) for r in ok],
                "median_s": round(statistics.median(r.seconds for r in ok), 1) if ok else None,
                "peak_rss_gb": round(max(r.peak_rss for r in ok) / 1e9, 2) if ok else None,
                "rank0_tensors": ok[0].rank0_tensors if ok else None,
                "error": next((r.error for r in mine if not r.ok), ""),
            }
            summary["table"].append(row)
            print(
                f"{layout.name:10} {method:8} {row['ok']:5} median {row['median_s']} s, peak RSS "
                f"{row['peak_rss_gb']} GB, rank 0 holds {row['rank0_tensors']} tensors {row['error'][:120]}"
            )
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
