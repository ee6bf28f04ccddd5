"""vLLM itself runs ``--load-format gdsload``: every case generates exactly what vLLM's own loader does.

Each case is one vLLM engine in a process of its own (see engine_env). Its greedy tokens and their
logprobs must equal, bit for bit, those of vLLM's ``auto`` loader on the source directory at the
same tensor-parallel size. Directories come from the ``gdsload`` command line, as a user makes them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors import safe_open

from engine_env import MAX_TOKENS, Engine
from sidecar_proc import Server
from tiny_models import PROMPTS

TOKEN = "engine-tier-token-8c1f4e2a"
_LOAD_LINE = re.compile(
    r"Loading weights took (\d+\.\d+) seconds \(gdsload, tp rank (\d+) of \d+\): "
    r"rank \d+: .*? backend=(\S+) io=(\S+)"
)


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]], what: str) -> None:
    assert len(got) == len(want) == len(PROMPTS)
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(w["tokens"]) == MAX_TOKENS, w
        assert g["tokens"] == w["tokens"], f"{what}: prompt {i}: tokens {g['tokens']} != vLLM's {w['tokens']}"
        assert g["logprobs"] == w["logprobs"], f"{what}: prompt {i}: logprobs differ from vLLM's own loader"


def load_lines(log: str) -> list[tuple[float, int, str, str]]:
    """The line each vLLM worker logs for a gdsload load, through vLLM's logger."""
    return [(float(m[1]), int(m[2]), m[3], m[4]) for m in _LOAD_LINE.finditer(log)]


def assert_logged(log: str, tp: int) -> None:
    lines = load_lines(log)
    assert sorted(r for _, r, _, _ in lines) == list(range(tp)), (
        f"expected one 'Loading weights took' line per rank in vLLM's log, found {lines}"
    )
    assert all(io in ("cpu", "mmap", "posix", "compat", "gds", "p2pdma", "ipc") for *_, io in lines), lines


# ----------------------------------------------------------------------------------------- HF directories


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_directory(engine: Engine, tiny: dict[str, Path], tp: int):
    got, log = engine.generate(tiny["llama"], "gdsload", tp)
    assert_same(got, engine.reference(tiny["llama"], tp), f"HF directory, tp={tp}")
    assert_logged(log, tp)


# ----------------------------------------------------------------------- pre-sharded (vllm layout), strict


@pytest.mark.parametrize(("kind", "tp"), [("llama", 1), ("llama", 2), ("qwen2", 2), ("mistral", 1), ("llama-kv1", 2)])
def test_sharded_strict_matches_and_vllm_sharded_state_accepts_it(engine: Engine, tiny, made, kind: str, tp: int):
    """``gdsload shard --tp N`` in strict mode (the default); vLLM's own sharded_state loader reads the same files."""
    out = made(kind, "--tp", str(tp))
    want = engine.reference(tiny[kind], tp)
    got, log = engine.generate(out, "gdsload", tp)
    assert_same(got, want, f"{kind} shard --tp {tp}, strict")
    assert_logged(log, tp)
    if (kind, tp) in (("llama", 1), ("llama", 2), ("llama-kv1", 2)):
        theirs, _ = engine.generate(out, "sharded_state", tp)
        assert_same(theirs, want, f"vLLM's sharded_state on {kind} shard --tp {tp}")


def test_zstd_compressed_shards(engine: Engine, tiny, made):
    out = made("llama", "--tp", "2", "--compress", "zstd")
    meta = json.loads((out / "gdsload.json").read_text())
    assert meta["tp_size"] == 2
    got, log = engine.generate(out, "gdsload", 2)
    assert_same(got, engine.reference(tiny["llama"], 2), "shard --tp 2 --compress zstd")
    assert_logged(log, 2)


# ------------------------------------------------------------------------------------------------- FP8


def test_fp8_per_channel(engine: Engine, made):
    """compressed-tensors FP8 (per-channel): the vllm layout, strict, equals vLLM's loader on the HF layout."""
    hf = made("llama", "--tp", "1", "--layout", "hf", "--quantize", "fp8:per-channel")
    sharded = made("llama", "--tp", "1", "--quantize", "fp8:per-channel")
    want = engine.reference(hf, 1)
    got, log = engine.generate(sharded, "gdsload", 1)
    assert_same(got, want, "shard --quantize fp8:per-channel, strict")
    assert_logged(log, 1)
    theirs, _ = engine.generate(sharded, "sharded_state", 1)
    assert_same(theirs, want, "vLLM's sharded_state on shard --quantize fp8:per-channel")


def _file_state(out: Path, rank: int) -> dict[str, dict[str, Any]]:
    dtypes = {"BF16": "bfloat16", "F32": "float32", "F8_E4M3": "float8_e4m3fn", "F16": "float16"}
    state: dict[str, dict[str, Any]] = {}
    for path in sorted(out.glob(f"model-rank-{rank}-part-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                state[name] = {"shape": list(s.get_shape()), "dtype": dtypes[s.get_dtype()]}
    return state


@pytest.mark.parametrize(("quant", "tp"), [("fp8", 1), ("fp8", 2), ("fp8:per-channel", 2)])
def test_fp8_files_hold_exactly_vllms_state_dict(engine: Engine, made, quant: str, tp: int):
    """vLLM's CPU build cannot run FP8 per-tensor (no ``static_scaled_fp8_quant`` kernel), for its own loader
    too; the files are compared, name by name, with the state dict vLLM builds for that quantization."""
    out = made("llama", "--tp", str(tp), "--quantize", quant)
    theirs = engine.state_dict(out, tp)
    assert sorted(theirs) == list(range(tp))
    for rank in range(tp):
        ours = _file_state(out, rank)
        assert set(ours) == set(theirs[rank]), (
            sorted(set(theirs[rank]) - set(ours)),
            sorted(set(ours) - set(theirs[rank])),
        )
        diff = {n: (ours[n], theirs[rank][n]) for n in ours if ours[n] != theirs[rank][n]}
        assert not diff, f"rank {rank}: shapes or dtypes differ from vLLM's: {diff}"


# ----------------------------------------------------------------------------------- the sidecar hand-off


_ADOPTED = re.compile(r"inject vllm into \S+: (\d+) tensors.*? adopted=(\d+) copied=(\d+)")


def _released_after_exit(srv: Server, timeout: float = 10.0) -> dict[str, Any]:
    """The ranks' leases once the engine process is gone (its held connections close with it)."""
    deadline = time.monotonic() + timeout
    while True:
        leases = {r: v.get("leases") for r, v in srv.status()["ranks"].items()}
        if not any(leases.values()) or time.monotonic() > deadline:
            return leases
        time.sleep(0.05)


@pytest.mark.parametrize(("tp", "token_kind"), [(1, "token"), (2, "token_file")])
def test_sidecar_hand_off(engine: Engine, tiny, made, tmp_path: Path, tp: int, token_kind: str):
    """vLLM adopts the sidecar's memory as its parameters (every tensor, none copied), generates what
    its own loader gives, holds the lease while it runs and gives it back when it exits; a second
    engine adopts the same memory again, nothing reloaded."""
    out = made("llama", "--tp", str(tp))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    srv = Server(
        [str(out), "--tp", str(tp), "--device-map", "cpu", "--token-file", str(token_file)], tmp_path / "serve.log"
    )
    try:
        srv.poll_ready(timeout=120)
        generation = srv.status()["generation"]
        extra = {"sidecar_url": srv.url, token_kind: TOKEN if token_kind == "token" else str(token_file)}
        for start in ("first", "second")[: 3 - tp]:  # tp=1 starts the engine twice
            got, log = engine.generate(out, "gdsload", tp, extra)
            assert_same(got, engine.reference(tiny["llama"], tp), f"sidecar hand-off, tp={tp}, {start} start")
            assert {(backend, io) for *_, backend, io in load_lines(log)} == {("sidecar", "ipc")}, load_lines(log)
            adopted = [tuple(map(int, m.groups())) for m in _ADOPTED.finditer(log)]
            assert len(adopted) == tp and all(n == a and c == 0 for n, a, c in adopted), adopted
            leases = _released_after_exit(srv)
            assert not any(leases.values()), f"the engine's leases outlived it: {leases}"
            assert srv.status()["generation"] == generation
        got, log = engine.generate(out, "gdsload", tp, {**extra, "adopt": False})
        assert_same(got, engine.reference(tiny["llama"], tp), f"sidecar hand-off, tp={tp}, copied")
        copied = [tuple(map(int, m.groups())) for m in _ADOPTED.finditer(log)]
        assert len(copied) == tp and all(a == 0 and c == n for n, a, c in copied), copied
    finally:
        srv.close()


# ------------------------------------------------------------------------------------------- vllm serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return {"tokens": [int(t.removeprefix("token_id:")) for t in lp["tokens"]], "logprobs": lp["token_logprobs"]}


def test_vllm_serve_answers_completions(engine: Engine, tiny, made, tmp_path: Path):
    """``vllm serve DIR --load-format gdsload`` on loopback: /v1/completions as from vLLM's own loader."""
    out = made("llama", "--tp", "1")
    port = _free_port()
    log_path = tmp_path / "vllm-serve.log"
    cmd = [
        str(engine.python.with_name("vllm")),
        "serve",
        str(out),
        "--load-format",
        "gdsload",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--gpu-memory-utilization",
        "0.5",
        "--seed",
        "0",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=engine.env(1))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"vllm serve not healthy in 300 s:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.5)
        got = [_complete(url, str(out), p) for p in PROMPTS]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert_same(got, engine.reference(tiny["llama"], 1), "vllm serve --load-format gdsload")
    assert_logged(log_path.read_text(errors="replace"), 1)


# ------------------------------------------------------------------------------- two nodes, vLLM's own launcher


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for proc, log in zip(procs, logs):
            assert proc.poll() is None, f"a vLLM node exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"vLLM not healthy in {timeout:.0f} s:\n{logs[0].read_text()[-4000:]}"
        time.sleep(0.5)


@pytest.mark.parametrize("from_sidecar", [False, True], ids=["files", "sidecar"])
def test_two_nodes_through_vllms_launcher_each_load_their_rank(
    engine: Engine, tiny, made, tmp_path: Path, from_sidecar: bool
):
    """``vllm serve --nnodes 2 --node-rank 0|1 --master-addr 127.0.0.1`` (the second ``--headless``), tp=2 across
    the two nodes on loopback: each node's worker loads its own rank — from the files, or from its own node's
    ``gdsload serve --ranks N`` — and the completions equal vLLM's own loader's at tp=2."""
    out = made("llama", "--tp", "2")
    port, master = _free_port(), _free_port()
    sidecars: list[Server] = []
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    try:
        extras: list[list[str]] = [[], []]
        if from_sidecar:
            for n in range(2):
                srv = Server(
                    [str(out), "--ranks", str(n), "--device-map", "cpu"], tmp_path / f"sidecar{n}.log", token=TOKEN
                )
                sidecars.append(srv)
                srv.poll_ready(timeout=120)
                extras[n] = ["--model-loader-extra-config", json.dumps({"sidecar_url": srv.url, "token": TOKEN})]
        for n in range(2):
            cmd = [
                str(engine.python.with_name("vllm")),
                "serve",
                str(out),
                "--tensor-parallel-size",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(master),
                "--load-format",
                "gdsload",
                "--max-model-len",
                "256",
                "--enforce-eager",
                "--dtype",
                "bfloat16",
                "--seed",
                "0",
                *extras[n],
            ]
            cmd += ["--host", "127.0.0.1", "--port", str(port)] if n == 0 else ["--headless"]
            env = {**engine.env(1), "VLLM_CPU_OMP_THREADS_BIND": str(n % (os.cpu_count() or 1))}
            with open(logs[n], "wb") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, procs, logs)
        got = [_complete(url, str(out), p) for p in PROMPTS]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for srv in sidecars:
            srv.close()
    assert_same(
        got,
        engine.reference(tiny["llama"], 2),
        f"two vLLM nodes, --load-format gdsload ({'sidecar' if from_sidecar else 'files'})",
    )
    for n, log in enumerate(logs):
        lines = load_lines(log.read_text(errors="replace"))
        assert [r for _, r, _, _ in lines] == [n], f"node {n} must load rank {n} only: {lines}"
        # From the files, host memory: a rank in the page cache is mapped (io=mmap), a cold one read (io=cpu).
        assert {(b, io) for *_, b, io in lines} <= (
            {("sidecar", "ipc")} if from_sidecar else {("cpu", "cpu"), ("mmap", "mmap"), ("mmap", "cpu")}
        ), lines
