"""The README stays true: CI runs its test command, the demo command names a real subcommand, and every code
block of it (and of bench/README.md) runs as written (see ``readme_blocks``; the blocks that need vLLM run in the
engine tier, those that need a GPU on a GPU host)."""

from __future__ import annotations

import re
import os
import sys
from pathlib import Path

import pytest

from readme_blocks import WHERE, Runner, blocks

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    return [b.code.strip() for b in blocks(ROOT / "README.md") if b.where == "setup"]


def test_ci_runs_the_readme_test_command():
    demo, tests = _commands()
    assert "pytest" in tests and "torch==2.13.0" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_demo_command_pins_cpu_torch_and_runs_demo():
    demo, _ = _commands()
    assert "torch==2.13.0" in demo and demo.endswith("gdsload demo")


def test_every_env_var_in_the_code_is_documented():
    code = "\n".join(p.read_text() for p in (ROOT / "loader").rglob("*.py"))
    code += "\n".join(p.read_text() for p in (ROOT / "server").rglob("*.py"))
    used = set(re.findall(r"GDSLOAD_[A-Z_]+", code))
    readme = (ROOT / "README.md").read_text()
    documented = set(re.findall(r"GDSLOAD_[A-Z_]+", readme))  # whole names: GDSLOAD_TOKEN_FILE is not GDSLOAD_TOKEN
    assert used and used <= documented, sorted(used - documented)


@pytest.mark.parametrize("doc", ["README.md", "bench/README.md"])
def test_every_code_block_says_where_it_runs(doc):
    found = blocks(ROOT / doc)
    assert found, doc
    for b in found:
        assert b.lang in ("sh", "python") and b.where in WHERE, (
            f"{doc}: block at {b}: fence must be ```sh or ```python, followed by one of {WHERE}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("doc", ["README.md", "bench/README.md"])
def test_code_blocks_run_as_written(doc, tmp_path):
    """The blocks this machine can run, in order, in one directory: what a reader types, with this environment's
    ``gdsload`` on PATH. Sidecar blocks are started, waited for (``/readyz`` 200), and stopped at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    runner = Runner(tmp_path, env, sys.executable)
    ran = 0
    try:
        for b in blocks(ROOT / doc):
            if b.where == "here":
                runner.run(b)
                ran += 1
            elif b.where == "server":
                runner.start(b, "/readyz")
                ran += 1
    finally:
        runner.stop()
    assert ran, f"{doc} has no block this machine runs"


@pytest.mark.gpu
def test_gpu_code_blocks_run_as_written(tmp_path):
    """On a GPU host: the blocks marked ``gpu`` (bench/README.md's: the figures of RESULTS.md), in order."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    runner = Runner(tmp_path, env, sys.executable)
    ran = [
        runner.run(b, timeout=3600)
        for doc in ("README.md", "bench/README.md")
        for b in blocks(ROOT / doc)
        if b.where == "gpu"
    ]
    assert ran
