"""Loads inside vLLM: gdsload's load format against vLLM's own, timed by vLLM's model loader.

    python -m gdsload.bench.vllm_load --python .venv-engine/bin/python --size 1.3GB --rounds 5 --out vllm-out

Builds one synthetic Llama (``gdsload bench --make-model``'s generator, tp=1, bf16), its
``gdsload shard --tp 1`` copy (vllm layout) and that copy compressed with Zstd, then starts one vLLM
engine per run in a fresh process (``--python``: an interpreter with vLLM and gdsload; the engine
test tier builds one in ``.venv-engine``). Every run times, inside the engine, the loader's
``load_weights`` call (what vLLM logs as "Loading weights took") and the whole ``load_model``
(model construction and vLLM's weight post-processing included), the time from the engine
process's start to its first generated token (``first_token_s``: one prompt, one token), and the host
memory ``load_weights`` added: the process's resident-set high-water mark right after it, minus
its resident set right before.

Methods (each in a fresh process, the methods taking turns round after round):

- ``vllm:auto`` (the HF directory), ``vllm:sharded_state`` (gdsload's vllm-layout copy, which
  vLLM's own pre-sharded loader reads), ``vllm:fastsafetensors`` (the HF directory; runs only
  where vLLM's fastsafetensors loader runs: it needs a GPU);
- ``gdsload:sharded`` (the vllm-layout copy, read straight into the parameters), ``gdsload:hf``
  (the HF directory, through vLLM's ``load_weights``), ``gdsload:zstd`` (the compressed copy),
  ``gdsload:sidecar`` (the vllm-layout copy held by a running ``gdsload serve`` on loopback, the
  parameters adopting its memory), ``gdsload:sidecar-copy`` (the same, copied: ``{"adopt": false}``).

The engine runs on vLLM's CPU build here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine, and
so the loader, in the process that times it). Page cache: warm (a method's files are read again
right before each of its runs, and the resident fraction recorded as ``resident_before``). Results: ``results.json`` and a table printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

METHODS = (
    "vllm:auto",
    "vllm:sharded_state",
    "vllm:fastsafetensors",
    "gdsload:sharded",
    "gdsload:hf",
    "gdsload:zstd",
    "gdsload:sidecar",
    "gdsload:sidecar-copy",
)
TOKEN = "vllm-load-bench-token-3e7a"


# ------------------------------------------------------------------------------------ inside the engine


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


CHILD_START = time.perf_counter()
"""When this module was imported: in a child, the engine process's start (its interpreter's start-up
aside), the origin of ``first_token_s``."""


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine start with ``spec``'s model and load format; the loader's timings from inside vLLM."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.model_executor.model_loader import base_loader

    timings: dict[str, Any] = {}
    original_load_model = base_loader.BaseModelLoader.load_model

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        original_load_weights = self.load_weights

        def load_weights(*a: Any, **k: Any) -> Any:
            rss = _rss_kb()
            t = time.perf_counter()
            out = original_load_weights(*a, **k)
            timings["load_weights_s"] = time.perf_counter() - t
            timings["added_memory_bytes"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024
            return out

        self.load_weights = load_weights
        t = time.perf_counter()
        model = original_load_model(self, *args, **kwargs)
        timings["load_model_s"] = time.perf_counter() - t
        return model

    base_loader.BaseModelLoader.load_model = load_model
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if spec.get("extra") is not None:
        kwargs["model_loader_extra_config"] = spec["extra"]
    llm = LLM(
        model=spec["model"],
        load_format=spec["load_format"],
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        skip_tokenizer_init=True,
        seed=0,
        **kwargs,
    )
    from vllm import SamplingParams

    llm.generate(
        {"prompt_token_ids": [1, 2, 3, 4]},
        SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
        use_tqdm=False,
    )
    timings["first_token_s"] = time.perf_counter() - CHILD_START
    return timings


# ------------------------------------------------------------------------------------------- the driver


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "gdsload.server.cli", *args], check=True, stdout=subprocess.DEVNULL)


def prepare(work: Path, size: int) -> dict[str, Path]:
    """The HF directory, its vllm-layout shard and the shard's Zstd copy (reused when already there)."""
    from ..loader.prepare.synthetic import make_checkpoint

    dirs = {"hf": work / "hf", "sharded": work / "sharded", "zstd": work / "sharded-zstd"}
    if not (dirs["hf"] / "config.json").exists():
        make_checkpoint(dirs["hf"], size)
    if not (dirs["sharded"] / "gdsload.json").exists():
        _cli("shard", str(dirs["hf"]), str(dirs["sharded"]), "--tp", "1")
    if not (dirs["zstd"] / "gdsload.json").exists():
        _cli("compress", str(dirs["sharded"]), str(dirs["zstd"]), "--codec", "zstd")
    return dirs


def warm(model_dir: Path) -> float:
    """Read a model's files into the page cache; the fraction of their pages resident afterwards.

    Called before every run: a host that reclaims page cache between runs would otherwise hand
    one method a cold read and the next a warm one.
    """
    from ..loader.io.pagecache import resident_fraction

    files = sorted(str(f) for f in model_dir.glob("*.safetensors"))
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    return resident_fraction(files)


def _spec(method: str, dirs: dict[str, Path], sidecar: dict[str, str] | None) -> dict[str, Any]:
    if method.startswith("vllm:"):
        fmt = method.split(":", 1)[1]
        return {"model": str(dirs["sharded" if fmt == "sharded_state" else "hf"]), "load_format": fmt}
    which = method.split(":", 1)[1]
    from_sidecar = which.startswith("sidecar")
    spec: dict[str, Any] = {"model": str(dirs["sharded" if from_sidecar else which]), "load_format": "gdsload"}
    if from_sidecar:
        spec["extra"] = {**(sidecar or {}), **({"adopt": False} if which == "sidecar-copy" else {})}
    return spec


def run_one(python: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")}
    env.update({"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"})
    start = time.perf_counter()
    p = subprocess.run(
        [python, "-m", "gdsload.bench.vllm_load", "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    for line in p.stdout.splitlines():
        if line.startswith("VLLM_LOAD "):
            return {**json.loads(line[len("VLLM_LOAD ") :]), "process_s": time.perf_counter() - start}
    tail = [ln for ln in (p.stdout + p.stderr).splitlines() if "Error" in ln or "error" in ln][-3:]
    return {"error": " | ".join(tail) or f"exit {p.returncode}"}


def _start_sidecar(model: Path, work: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    import urllib.request

    token = work / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    log = open(work / "sidecar.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gdsload.server.cmd_serve",
            str(model),
            "--device-map",
            "cpu",
            "--token-file",
            str(token),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    url = None
    while time.monotonic() < deadline:
        text = (work / "sidecar.log").read_text(errors="replace")
        if url is None and "listening on http://" in text:
            url = text.split("listening on ", 1)[1].split()[0].strip('"')
        if url is not None:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        return proc, {"sidecar_url": url, "token_file": str(token)}
            except OSError:
                pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"gdsload serve did not become ready:\n{(work / 'sidecar.log').read_text()[-2000:]}")


def _summary(runs: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    vals = [r[key] for r in runs if key in r]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--python", help="An interpreter with vLLM and gdsload (e.g. .venv-engine/bin/python).")
    ap.add_argument("--size", default="1.3GB", help="Model size (default 1.3GB).")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--work", default=None, help="Where the model copies go (kept, reused); default a temp dir.")
    ap.add_argument("--out", default="vllm-load-out")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    if args.child:
        print("VLLM_LOAD " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    if not args.python:
        ap.error("--python is required: an interpreter with vLLM and gdsload installed")
    from ..loader import parse_size
    from ..loader.config import format_bytes

    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    work = Path(args.work or tempfile.mkdtemp(prefix="gdsload-vllm-load-"))
    work.mkdir(parents=True, exist_ok=True)
    dirs = prepare(work, parse_size(args.size))
    model_bytes = sum(f.stat().st_size for f in dirs["sharded"].glob("*.safetensors"))
    sidecar_proc, sidecar = (None, None)
    if any(m.startswith("gdsload:sidecar") for m in methods):
        sidecar_proc, sidecar = _start_sidecar(dirs["sharded"], work)
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    try:
        for r in range(args.rounds):
            for m in methods[r % len(methods) :] + methods[: r % len(methods)]:  # taking turns
                spec = _spec(m, dirs, sidecar)
                resident = warm(Path(spec["model"]))
                res = {**run_one(args.python, spec, args.timeout), "resident_before": resident}
                results[m].append(res)
                print(f"round {r + 1} {m}: {res}", flush=True)
    finally:
        if sidecar_proc is not None:
            sidecar_proc.terminate()
            sidecar_proc.wait(30)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "model_bytes": model_bytes,
        "size": args.size,
        "rounds": args.rounds,
        "python": args.python,
        "cpus": os.cpu_count(),
        "methods": {
            m: {
                "load_weights_s": _summary(rs, "load_weights_s"),
                "load_model_s": _summary(rs, "load_model_s"),
                "process_s": _summary(rs, "process_s"),
                "first_token_s": _summary(rs, "first_token_s"),
                "added_memory_bytes": _summary(rs, "added_memory_bytes"),
                "errors": [r["error"] for r in rs if "error" in r],
                "runs": rs,
            }
            for m, rs in results.items()
        },
    }
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    print(f"\nmodel {format_bytes(model_bytes)}, {args.rounds} rounds, warm page cache; medians (min-max)")
    print(
        f"{'method':24s} {'load_weights s':>22s} {'load_model s':>22s} {'first token s':>22s} {'process s':>22s} "
        f"{'memory added':>14s}"
    )
    for m, d in doc["methods"].items():
        if d["load_weights_s"] is None:
            print(f"{m:24s} did not run: {d['errors'][0] if d['errors'] else '?'}")
            continue
        lw, lm, ps, mem = d["load_weights_s"], d["load_model_s"], d["process_s"], d["added_memory_bytes"]
        ft = d["first_token_s"] or {"median": float("nan"), "min": float("nan"), "max": float("nan")}
        print(
            f"{m:24s} {lw['median']:8.3f} ({lw['min']:.3f}-{lw['max']:.3f}) {lm['median']:8.3f} "
            f"({lm['min']:.3f}-{lm['max']:.3f}) {ft['median']:8.3f} ({ft['min']:.3f}-{ft['max']:.3f}) "
            f"{ps['median']:8.3f} ({ps['min']:.3f}-{ps['max']:.3f}) {format_bytes(int(mem['median'])):>14s}"
        )


if __name__ == "__main__":
    main()
