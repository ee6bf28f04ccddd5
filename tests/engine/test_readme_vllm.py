"""The README's vLLM blocks run as written, in the engine environment (vLLM's CPU build next to gdsload).

The blocks run in order in one directory, as a reader would type them: the ones this machine runs anyway
(they make the models the vLLM blocks use), then ``vllm`` blocks with the engine environment first on PATH.
A ``server`` block (the sidecar) is started and left running; a ``vllm-server`` block is started, asked for
a completion on its port, and stopped before the next block. (The README's ``vllm-install`` block built
this environment: see ``engine_env``.)
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from engine_env import REPO, Engine
from readme_blocks import Runner, blocks


def _completion(port: int, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_the_readmes_vllm_blocks_run_as_written(engine: Engine, tmp_path: Path):
    env = {**engine.env(2), "PATH": str(engine.python.parent) + os.pathsep + os.environ.get("PATH", "")}
    runner = Runner(tmp_path, env, str(engine.python))
    ran = []
    try:
        for b in blocks(REPO / "README.md"):
            if b.where in ("here", "vllm"):
                runner.run(b)
            elif b.where == "server":
                runner.start(b, "/readyz")
            elif b.where == "vllm-server":
                sidecar = runner.background[:]
                port = runner.start(b, "/health", timeout=600)
                served = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30).read())
                answer = _completion(port, served["data"][0]["id"])
                assert answer["choices"][0]["text"], f"README block at {b}: an empty completion {answer}"
                mine = [p for p in runner.background if p not in sidecar]
                runner.background = mine  # stop this server, keep the sidecar
                runner.stop()
                runner.background = sidecar
            else:
                continue
            ran.append(b.where)
    finally:
        runner.stop()
    assert "vllm" in ran and ran.count("vllm-server") >= 2, ran


def test_the_bench_readmes_vllm_blocks_run_as_written(engine: Engine, tmp_path: Path):
    env = {**engine.env(2), "PATH": str(engine.python.parent) + os.pathsep + os.environ.get("PATH", "")}
    runner = Runner(tmp_path, env, str(engine.python))
    ran = [b for b in blocks(REPO / "bench" / "README.md") if b.where == "vllm"]
    assert ran
    for b in ran:
        out = runner.run(b, timeout=1200)
        assert " vllm " in out and "1/1" in out, out[-2000:]  # vLLM's own way ran, and was timed
