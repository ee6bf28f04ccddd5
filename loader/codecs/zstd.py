"""Zstd as standard frames, one per 256 KiB, each with its own checksum: nvCOMP decodes them on a GPU,
``zstandard`` on the CPU."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from .registry import Codec, register_codec

CHUNK = 256 << 10
"""Decoded bytes per frame."""
LEVEL = 3

_LOCAL = threading.local()  # zstandard's (de)compressor objects are not thread-safe: one of each per thread


def _compressor(level: int) -> Any:
    made = getattr(_LOCAL, "compressor", None)
    if made is None or made[0] != level:
        import zstandard

        made = _LOCAL.compressor = (
            level,
            zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True),
        )
    return made[1]


def _decompressor() -> Any:
    made = getattr(_LOCAL, "decompressor", None)
    if made is None:
        import zstandard

        made = _LOCAL.decompressor = zstandard.ZstdDecompressor()
    return made


class Zstd(Codec):
    name = "zstd"
    layouts = ("chunks",)
    chunk_bytes = CHUNK
    nvcomp_algorithm = "Zstd"

    def params(self, dtype: str) -> dict[str, Any]:
        return {"level": LEVEL}

    def encode_chunk(self, data: memoryview, params: Mapping[str, Any]) -> bytes:
        return _compressor(int(params.get("level", LEVEL))).compress(data)

    def decode_chunk(self, data: memoryview, nbytes: int, params: Mapping[str, Any]) -> bytes:
        return _decompressor().decompress(data, max_output_size=nbytes)


register_codec(Zstd())
