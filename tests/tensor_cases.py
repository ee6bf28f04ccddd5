"""Tensor cases shared by the test modules: every dtype, whole bit patterns, odd and empty shapes;
and modules shaped like an engine's for a given state dict.

A plain module rather than conftest helpers: the engine tier has a conftest of its own, and
``from conftest import ...`` would find whichever conftest was imported last.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def all_dtypes() -> list[torch.dtype]:
    """Every torch dtype safetensors can store, in this torch build."""
    names = [
        "bool",
        "uint8",
        "int8",
        "float8_e4m3fn",
        "float8_e5m2",
        "int16",
        "uint16",
        "float16",
        "bfloat16",
        "int32",
        "uint32",
        "float32",
        "int64",
        "uint64",
        "float64",
    ]
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


def engine_shaped(state: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose state dict has ``state``'s names, shapes and dtypes, its parameters empty: what an
    engine builds before its loader fills it."""
    model = nn.Module()
    for name, t in state.items():
        *path, leaf = name.split(".")
        m = model
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, nn.Module())
            m = getattr(m, p)
        m.register_parameter(leaf, nn.Parameter(torch.empty_like(t), requires_grad=False))
    return model
