"""Tensor cases shared by the test modules: every dtype, whole bit patterns, odd and empty shapes;
a safetensors file laid out unaligned; and modules shaped like an engine's for a given state dict.

A plain module rather than conftest helpers: the engine tier has a conftest of its own, and
``from conftest import ...`` would find whichever conftest was imported last.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

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


def _misaligned_file(path: Path) -> dict[str, torch.Tensor]:
    """A valid safetensors file whose header length and tensor offsets break natural alignment."""
    tensors = {
        "a.u8": torch.arange(3, dtype=torch.uint8),
        "b.f32": torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32),
        "c.bf16": torch.tensor([0.5, 7.0], dtype=torch.bfloat16),
        "d.i64": torch.tensor([-(2**40), 5], dtype=torch.int64),
    }
    header, off = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": {torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [off, off + n],
        }
        off += n
    raw = json.dumps(header).encode() + b" "  # odd header length: data starts unaligned too
    data = b"".join(
        t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes()
        for t in tensors.values()
    )
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return tensors
