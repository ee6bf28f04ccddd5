"""Engine restarts from a warm sidecar: a transformers model adopting the sidecar's memory, against a copy and a read.

    python -m gdsload.bench.restart /dev/shm/llama --device cuda --rounds 3 --out restart-out

Starts ``gdsload serve MODEL_DIR`` on loopback (the rank on ``--device``), waits for ``/readyz``,
then starts one engine per run, each a fresh Python process that builds the model
(``transformers.LlamaForCausalLM`` from the directory's ``config.json``, parameters on the meta
device), gives it its weights and generates one token greedily. Methods, taking turns round after
round:

- ``adopted``: :func:`~gdsload.loader.adapters.inject_from_sidecar` — the parameters become the
  sidecar's memory (CUDA IPC; copy-on-write shared memory on CPU), the engine holds the lease;
- ``copied``: the same with ``adopt=False`` — the tensors copied into memory of the engine's own;
- ``gdsload``: a fresh read of the files (``load_rank`` to the device, parameters bound to its arena);
- ``safetensors``: a fresh read with ``safetensors.torch.load_file(device=...)``, then bound.

Each run records, from the engine process: ``weights_s`` (the call that gives the model its
weights), ``start_to_token_s`` (from the process's first statement to its first token: imports,
CUDA context and model construction included; ``marks`` has the time since that statement at the
end of each step: ``imports``, ``context``, ``model_built``, ``weights``) and the prompt's logits, which must be bit-identical
across methods. The bench adds ``wall_s`` (from starting the process to its answer) and, on a
GPU, the device memory in use in total (``nvidia-smi``) with the sidecar alone, while the engine
runs, and after it exits, and what the engine process itself holds. Results: ``results.json`` and a
table printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

METHODS = ("adopted", "copied", "gdsload", "safetensors")
TOKEN = "restart-bench-token-5d1c"

# The engine: a fresh process per run. argv: method, model dir, device, sidecar URL, token.
ENGINE = r"""
import time
START = time.perf_counter()
import hashlib, json, os, sys
method, model_dir, device, url, token = sys.argv[1:6]
import torch, transformers
from gdsload.loader.adapters import inject_from_sidecar, inject_module, meta_init
marks = {"imports": time.perf_counter() - START}
if device.startswith("cuda"):
    torch.cuda.init(); torch.empty(1, device=device); torch.cuda.synchronize()
marks["context"] = time.perf_counter() - START
config = transformers.LlamaConfig(**json.load(open(os.path.join(model_dir, "config.json"))))
with meta_init(dtype=torch.bfloat16):
    model = transformers.LlamaForCausalLM(config).eval()
marks["model_built"] = time.perf_counter() - START
t0 = time.perf_counter()
if method in ("adopted", "copied"):
    report = inject_from_sidecar(model, url, token=token, adopt=method == "adopted")
elif method == "gdsload":
    from gdsload.loader import load_rank
    report = inject_module(model, load_rank(model_dir, 0, device=device))
else:
    import glob, safetensors.torch
    tensors = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        tensors.update(safetensors.torch.load_file(f, device=device))
    report = inject_module(model, tensors)
if device.startswith("cuda"):
    torch.cuda.synchronize()
weights_s = time.perf_counter() - t0
marks["weights"] = time.perf_counter() - START
with torch.no_grad():
    ids = torch.tensor([[1, 306, 4658, 278, 6593, 310, 2834, 338]], device=device) % config.vocab_size
    logits = model(ids).logits[0, -1].float()
    token_id = int(logits.argmax())
if device.startswith("cuda"):
    torch.cuda.synchronize()
print(json.dumps({
    "method": method, "pid": os.getpid(), "weights_s": weights_s, "start_to_token_s": time.perf_counter() - START,
    "adopted": report.adopted, "copied": report.copied, "loaded": len(report.loaded), "bytes": report.bytes,
    "token": token_id, "logits_sha256": hashlib.sha256(logits.cpu().numpy().tobytes()).hexdigest(),
    "allocated_bytes": torch.cuda.memory_allocated() if device.startswith("cuda") else None, "marks": marks,
}), flush=True)
sys.stdin.read()  # keep the weights (and the lease) until told to exit
"""


def _smi(*args: str) -> str | None:
    """``nvidia-smi`` with ``args``: its output, or None where it is missing, fails or hangs."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    return out.stdout if out.returncode == 0 else None


def _first_gpu() -> str:
    """nvidia-smi's name for the GPU this process's ``cuda:0`` is (``CUDA_VISIBLE_DEVICES``' first entry)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def gpu_used_bytes() -> int | None:
    """Device memory in use on the GPU ``cuda:0`` is, every process together (``nvidia-smi``); None without it."""
    out = _smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", _first_gpu())
    return int(out.strip()) << 20 if out is not None and out.strip().isdigit() else None


def process_gpu_bytes(pid: int) -> int | None:
    """Device memory that process ``pid`` holds (``nvidia-smi --query-compute-apps``); None where not listed."""
    out = _smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits") or ""
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1]) << 20
    return None


def _settled_gpu_bytes(before_exit: int | None, timeout: float = 10.0) -> int | None:
    """Device memory in use once an engine's exit has returned its memory (it falls, then stays)."""
    deadline, last = time.monotonic() + timeout, gpu_used_bytes()
    while last is not None and before_exit is not None and time.monotonic() < deadline:
        time.sleep(0.2)
        now = gpu_used_bytes()
        if now == last and now is not None and now < before_exit:
            break
        last = now
    return last


def run_engine(
    method: str,
    model_dir: Path,
    device: str,
    url: str,
    env: dict[str, str],
    *,
    token: str = TOKEN,
    while_running: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """One engine process: its answer, the wall time to it, and device memory during and after.

    ``while_running(answer)`` is called while the engine still runs (holding its weights and lease).
    The engine's log goes to a temporary file (a pipe nobody reads could fill and stall it).
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE, method, str(model_dir), device, url, token],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
        try:
            return _answer(proc, method, device, t0, log, while_running)
        except subprocess.TimeoutExpired as e:
            return {"method": method, "error": f"the engine did not exit within {e.timeout} s"}
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def _answer(
    proc: subprocess.Popen[str],
    method: str,
    device: str,
    t0: float,
    log: Any,
    while_running: Callable[[dict[str, Any]], None] | None,
) -> dict[str, Any]:
    line = proc.stdout.readline() if proc.stdout else ""
    wall = time.perf_counter() - t0
    if not line:
        proc.wait(60)
        log.seek(0)
        return {"method": method, "error": f"exit {proc.returncode}: {log.read()[-2000:]}"}
    got = json.loads(line)
    got["wall_s"] = wall
    got["gpu_used_during"] = gpu_used_bytes() if device.startswith("cuda") else None
    got["engine_gpu_bytes"] = process_gpu_bytes(proc.pid) if device.startswith("cuda") else None
    if while_running is not None:
        while_running(got)
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(120)
    got["gpu_used_after"] = _settled_gpu_bytes(got["gpu_used_during"]) if device.startswith("cuda") else None
    return got


def _serve(model_dir: Path, device: str, work: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    import httpx

    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "serve.log", "wb")
    env = {**os.environ, "GDSLOAD_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "gdsload.server.cmd_serve", str(model_dir), "--host", "127.0.0.1", "--port", "0"]
    if device == "cpu":
        args += ["--device-map", "cpu"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline, url = time.monotonic() + 300, None
    while time.monotonic() < deadline and proc.poll() is None:
        text = (work / "serve.log").read_text(errors="replace")
        if url is None and (m := re.search(r"listening on (http://[^\s\"]+:\d+)", text)):
            url = m[1]
        if url is not None:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    return proc, url, time.perf_counter() - t0
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"gdsload serve did not become ready; its log:\n{(work / 'serve.log').read_text()[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="a tp=1 Llama directory with config.json (gdsload bench --make-model)")
    ap.add_argument("--device", default="cuda", help="cuda (the sidecar's GPU 0) or cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {','.join(METHODS)}")
    ap.add_argument("--out", type=Path, default=Path("restart-out"))
    a = ap.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if not methods:
        ap.error(f"--methods names none; choose from {','.join(METHODS)}")
    if unknown or a.rounds < 1 or a.device not in ("cuda", "cpu") or not (a.model / "config.json").is_file():
        ap.error(
            f"methods {unknown} unknown (choose from {METHODS})"
            if unknown
            else "--rounds must be at least 1"
            if a.rounds < 1
            else "--device must be cuda or cpu"
            if a.device not in ("cuda", "cpu")
            else f"{a.model} has no config.json"
        )
    device = "cuda:0" if a.device == "cuda" else "cpu"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    baseline = gpu_used_bytes() if a.device == "cuda" else None
    server, url, ready_s = _serve(a.model, a.device, a.out)
    runs: list[dict[str, Any]] = []
    try:
        with_sidecar = gpu_used_bytes() if a.device == "cuda" else None
        for round_ in range(a.rounds):
            shift = round_ % len(methods)  # each method starts a round in turn
            for method in methods[shift:] + methods[:shift]:
                r = run_engine(method, a.model, device, url, env)
                r["round"] = round_
                runs.append(r)
                shown = {
                    k: r.get(k)
                    for k in (
                        "round",
                        "method",
                        "weights_s",
                        "start_to_token_s",
                        "adopted",
                        "copied",
                        "gpu_used_during",
                    )
                    if r.get(k) is not None
                }
                print(json.dumps(shown if "error" not in r else {**shown, "error": r["error"][-300:]}), flush=True)
    finally:
        server.terminate()
        server.wait(60)
    ok = [r for r in runs if "error" not in r]
    shas = {r["logits_sha256"] for r in ok}
    result = {
        "model": str(a.model),
        "device": a.device,
        "rounds": a.rounds,
        "sidecar_ready_s": ready_s,
        "gpu_used_baseline": baseline,
        "gpu_used_with_sidecar": with_sidecar,
        "runs": runs,
        "logits_identical": len(shas) == 1,
        "failed": len(runs) - len(ok),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    gb = 1e9
    memory = (
        ""
        if baseline is None or with_sidecar is None
        else f"; device memory in use: {baseline / gb:.2f} GB before, {with_sidecar / gb:.2f} GB with the sidecar's rank"
    )
    print(f"sidecar ready in {ready_s:.2f} s{memory}; logits identical across methods: {result['logits_identical']}")
    print(
        f"{'method':<12} {'weights_s':>22} {'start→token s':>14} {'GPU in use during':>18} {'after':>8} "
        f"{'engine holds':>13} adopted/copied"
    )
    for method in methods:
        mine = [r for r in ok if r["method"] == method]
        if not mine:
            print(f"{method:<12} failed: {next(r['error'] for r in runs if r['method'] == method)[:200]}")
            continue
        w = sorted(r["weights_s"] for r in mine)

        def med(key: str, scale: float = 1.0) -> str:
            vals = [r[key] for r in mine if r.get(key) is not None]
            return f"{statistics.median(vals) / scale:.2f}" if vals else "–"

        print(
            f"{method:<12} {statistics.median(w):>8.3f} ({w[0]:.3f}–{w[-1]:.3f}) {med('start_to_token_s'):>14} "
            f"{med('gpu_used_during', gb):>15} GB {med('gpu_used_after', gb):>8} {med('engine_gpu_bytes', gb):>10} GB"
            f" {mine[0]['adopted']}/{mine[0]['copied']} of {mine[0]['loaded']}"
        )
    return 0 if ok and not result["failed"] and result["logits_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
