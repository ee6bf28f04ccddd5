"""nvCOMP GDeflate (GPU only), as nvCOMP's own container."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .registry import Codec, register_codec

CHUNK = 64 << 10
"""GDeflate's largest chunk (nvCOMP aborts the process on a larger one)."""


class GDeflate(Codec):
    name = "gdeflate"
    layouts = ("native",)
    chunk_bytes = CHUNK
    nvcomp_algorithm = "GDeflate"
    self_checked = True

    def params(self, dtype: str) -> dict[str, Any]:
        return {"algorithm_type": 1}

    def nvcomp_options(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return {"algorithm_type": params["algorithm_type"]} if "algorithm_type" in params else {}


register_codec(GDeflate())
