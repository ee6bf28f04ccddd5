"""nvCOMP GDeflate (GPU only), as nvCOMP's own container."""

from __future__ import annotations

from typing import Any

from .registry import CodecSpec, register_codec

CHUNK = 64 << 10
"""GDeflate's largest chunk (nvCOMP aborts the process on a larger one)."""


def _params(dtype: str) -> dict[str, Any]:
    return {"algorithm_type": 1}


register_codec(
    CodecSpec(
        "gdeflate",
        layouts=("native",),
        nvcomp_algorithm="GDeflate",
        params=_params,
        chunk_bytes=CHUNK,
        self_checked=True,
    )
)
