"""Shared fixtures: small real checkpoints written once per session, and marker handling."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gdsload.loader import save_file, write_manifest


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
            item.add_marker(pytest.mark.skip(reason=f"needs {mark.args[0] if mark.args else 2} CUDA devices, found {n}"))
        if "gds" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs real GPUDirect Storage (nvidia-fs or P2PDMA)"))


def all_dtypes() -> list[torch.dtype]:
    """Every torch dtype safetensors can store, in this torch build."""
    names = ["bool", "uint8", "int8", "float8_e4m3fn", "float8_e5m2", "int16", "uint16", "float16", "bfloat16",
             "int32", "uint32", "float32", "int64", "uint64", "float64"]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Deterministic values that use the dtype's whole bit pattern space."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def mixed_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """One tensor per dtype in odd shapes, plus 0-d and empty tensors."""
    out: dict[str, torch.Tensor] = {}
    for i, dt in enumerate(all_dtypes()):
        name = str(dt).removeprefix("torch.")
        out[f"{name}.odd"] = random_tensor((3, 5, 7), dt, seed + i)
        out[f"{name}.scalar"] = random_tensor((), dt, seed + 100 + i)
    out["empty.f32"] = torch.empty((0, 4), dtype=torch.float32)
    out["empty.bf16"] = torch.empty((5, 0), dtype=torch.bfloat16)
    out["weight.bf16"] = random_tensor((64, 33), torch.bfloat16, seed + 7)
    return out


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
