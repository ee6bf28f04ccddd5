"""Shared fixtures: small real checkpoints written once per session, and marker handling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gdsload.loader import save_file, write_manifest
from tensor_cases import mixed_tensors


def _cuda_count() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = _cuda_count()
    for item in items:
        if "gpu" in item.keywords and n == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; run `pytest -m gpu` on the GPU machine"))
        mark = item.get_closest_marker("multi_gpu")
        if mark is not None and n < (mark.args[0] if mark.args else 2):
            item.add_marker(
                pytest.mark.skip(reason=f"needs {mark.args[0] if mark.args else 2} CUDA devices, found {n}")
            )
        if "gds" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs real GPUDirect Storage (nvidia-fs or P2PDMA)"))


@pytest.fixture(scope="session")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tp=2, two parts per rank, mixed dtypes, with a manifest (digests included)."""
    root = tmp_path_factory.mktemp("sharded")
    ranks: dict[int, list[str]] = {}
    for rank in range(2):
        for part in range(2):
            tensors = {f"r{rank}.p{part}.{k}": v for k, v in mixed_tensors(seed=rank * 10 + part).items()}
            name = f"model-rank-{rank}-part-{part}.safetensors"
            save_file(tensors, root / name, {"rank": str(rank), "part": str(part)})
            ranks.setdefault(rank, []).append(name)
    write_manifest(root, ranks, tp_size=2, layout="vllm")
    return root
