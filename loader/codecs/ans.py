"""nvCOMP ANS with a dtype-aware symbol type: the default codec (GPU only, decoded through nvCOMP's C API)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .registry import Codec, register_codec

CHUNK = 256 << 10
"""Decoded bytes per chunk: larger chunks than nvCOMP's default 64 KiB compress bf16 weights better and decode
about as fast."""


def data_type(dtype: str) -> str:
    """nvCOMP ANS symbol type for a safetensors dtype: ``<f2`` for 16-bit floats, ``<f4`` for fp32,
    bytes for the rest (fp8 gains nothing from ``|f1`` over ``|u1``)."""
    return {"BF16": "<f2", "F16": "<f2", "F32": "<f4"}.get(dtype, "|u1")


class Ans(Codec):
    name = "ans"
    layouts = ("chunks", "native")
    chunk_bytes = CHUNK
    chunk_align = 16
    nvcomp_algorithm = "ANS"
    batch_decoder = True
    self_checked = True

    def params(self, dtype: str) -> dict[str, Any]:
        return {"data_type": data_type(dtype)}

    def nvcomp_options(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return {"data_type": params["data_type"]} if "data_type" in params else {}


register_codec(Ans())
