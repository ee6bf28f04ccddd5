"""Zstd as standard frames, one per 256 KiB: nvCOMP decodes them on a GPU, ``zstandard`` on the CPU."""

from __future__ import annotations

from typing import Any

from .registry import CodecSpec, register_codec

CHUNK = 256 << 10
"""Decoded bytes per frame."""


def _params(dtype: str) -> dict[str, Any]:
    return {"level": 3}


register_codec(
    CodecSpec(
        "zstd",
        layouts=("chunks",),
        nvcomp_algorithm="Zstd",
        params=_params,
        chunk_bytes=CHUNK,
        cpu_encode=True,
        cpu_decode=True,
    )
)
