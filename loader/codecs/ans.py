"""nvCOMP ANS with a dtype-aware symbol type: the default codec (GPU only, decoded through nvCOMP's C API)."""

from __future__ import annotations

from typing import Any

from .registry import CodecSpec, register_codec

CHUNK = 256 << 10
"""Decoded bytes per chunk. 256 KiB gives 1.50x on N(0, 0.02) bf16 against 1.46x at nvCOMP's
default 64 KiB, decoding about as fast."""


def data_type(dtype: str) -> str:
    """nvCOMP ANS symbol type for a safetensors dtype: ``<f2`` for 16-bit floats, ``<f4`` for fp32,
    bytes for the rest (fp8 gains nothing from ``|f1`` over ``|u1``)."""
    return {"BF16": "<f2", "F16": "<f2", "F32": "<f4"}.get(dtype, "|u1")


def _params(dtype: str) -> dict[str, Any]:
    return {"data_type": data_type(dtype)}


register_codec(
    CodecSpec(
        "ans",
        layouts=("chunks", "native"),
        nvcomp_algorithm="ANS",
        params=_params,
        chunk_bytes=CHUNK,
        chunk_align=16,
        batch_decoder=True,
        self_checked=True,
    )
)
