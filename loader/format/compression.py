"""Compressed safetensors: the metadata that describes compressed tensors, and its validation.

A compressed file is still a valid safetensors file. Each compressed tensor is stored as a 1-D
``U8`` tensor under its own name; ``__metadata__["gdsload.compression"]`` is a JSON document::

    {"version": 1,
     "tensors": {
       "model.layers.0.mlp.up_proj.weight": {
          "dtype": "BF16", "shape": [14336, 4096], "nbytes": 117440512,
          "codec": "ans", "params": {"data_type": "<f2"},
          "layout": "chunks", "chunk_bytes": 262144, "chunk_align": 16,
          "chunks": "<base64 of little-endian uint32 compressed sizes>",
          "crc32": 1234567890},               # of the decoded bytes
       "model.norm.weight": {..., "codec": "zstd", "layout": "chunks",
          "chunk_bytes": 262144, "chunks": "..."}}}

``layout: chunks`` stores one independent compressed chunk per ``chunk_bytes`` of decoded data,
back to back; each starts at a multiple of ``chunk_align`` (default 1) within the tensor's stored
bytes, zero bytes filling the gaps. For Zstd the chunks are standard frames, which the CPU
``zstandard`` package decodes too; for ANS they are nvCOMP's raw batched-API chunks, 16-byte
aligned as its decoder requires. Either way one batched nvCOMP call decodes any number of
chunks, of any number of tensors, with no per-tensor header to read back first.
``layout: native`` (ANS, GDeflate; ANS files written before ANS took ``chunks``) is nvCOMP's
own container, which carries its chunk table and optional checksums. A reader that ignores the
metadata sees U8 tensors of the wrong shape and fails loudly rather than reading garbage.
"""

from __future__ import annotations

import base64
import itertools
import math
import operator
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

from ..dtypes import ITEMSIZE
from ..errors import CodecError
from . import strict_json
from .safetensors import SafetensorsHeader

__all__ = [
    "METADATA_KEY",
    "FORMAT_VERSION",
    "CODECS",
    "CHUNK_ALIGN",
    "register_stream_format",
    "add_codec_lookup",
    "CompressedEntry",
    "parse_compression",
    "encode_chunk_sizes",
]

METADATA_KEY = "gdsload.compression"
FORMAT_VERSION = 1
CODECS: dict[str, tuple[str, ...]] = {"ans": ("chunks", "native"), "gdeflate": ("native",), "zstd": ("chunks",)}
"""Codec name -> the layouts its streams may use; ``gdsload compress`` writes the first. These are format
version 1's own codecs; a codec another package registers (:mod:`gdsload.loader.codecs.registry`) adds itself."""
CHUNK_ALIGN: dict[str, int] = {"ans": 16}
MAX_TENSOR_BYTES = 1 << 62
"""Largest decoded size a compressed tensor may declare: the sizes of a rank's tensors add up to less than 2**63."""
MAX_CHUNK_BYTES = 1 << 30
"""Largest decoded chunk a file may declare (nvCOMP's own chunks are at most a few MiB)."""
MAX_CHUNK_ALIGN = 1 << 16
"""Alignment each chunk of a codec needs (``layout: chunks``), where it is more than one byte."""


_LOOKUPS: list[Callable[[str], None]] = []


def add_codec_lookup(lookup: Callable[[str], None]) -> None:
    """Call ``lookup(name)`` for a codec a file names that no one has registered yet, before refusing the file
    (the codec registry installs one that imports the codecs other packages declare)."""
    _LOOKUPS.append(lookup)


def register_stream_format(codec: str, layouts: tuple[str, ...], chunk_align: int = 1) -> None:
    """Let files use ``codec`` with ``layouts`` (what the codec registry calls for each codec it registers)."""
    CODECS[codec] = tuple(layouts)
    if chunk_align > 1:
        CHUNK_ALIGN[codec] = chunk_align


class CompressedEntry(NamedTuple):
    """What a compressed tensor decodes to, and how."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    codec: str
    layout: str
    stored_bytes: int
    params: Mapping[str, Any] = MappingProxyType({})
    chunk_bytes: int = 0
    chunks: Sequence[int] = ()
    """Compressed size of each chunk (``layout == "chunks"``); in a parsed file's entries a read-only
    ``memoryview`` of the uint32 sizes the file records (nothing is copied)."""
    crc32: int | None = None
    chunk_align: int = 1
    """Each chunk starts at a multiple of this within the stored bytes (``layout == "chunks"``)."""

    def chunk_offsets(self, first: int = 0, stop: int | None = None, base: int = 0) -> Iterator[int]:
        """Where chunks ``first:stop`` (``stop=None``: through the last) start in the stored bytes, ``base`` plus
        their distance from chunk ``first``'s start."""
        stop = len(self.chunks) if stop is None else min(stop, len(self.chunks))
        if stop <= first:
            return iter(())
        return itertools.accumulate(_padded(self.chunks[first : stop - 1], self.chunk_align), initial=base)

    def decoded_lengths(self) -> array[int]:
        """What each chunk decodes to: ``chunk_bytes``, but the last, which holds what is left."""
        n, step = len(self.chunks), self.chunk_bytes
        lengths = array("Q", (step,)) * n
        if n:
            lengths[-1] = self.nbytes - (n - 1) * step
        return lengths

    def chunk_table(self) -> tuple[array[int], Sequence[int], range, array[int]]:
        """Stored offsets, stored sizes, decoded offsets and decoded sizes of the chunks."""
        n, step = len(self.chunks), self.chunk_bytes
        return array("q", self.chunk_offsets()), self.chunks, range(0, n * step, step), self.decoded_lengths()

    def chunk_spans(self) -> list[tuple[int, int, int, int]]:
        """``(stored_offset, stored_len, decoded_offset, decoded_len)`` per chunk."""
        return list(zip(*self.chunk_table()))

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "codec": self.codec,
            "layout": self.layout,
            "params": dict(self.params),
        }
        if self.layout == "chunks":
            doc["chunk_bytes"] = self.chunk_bytes
            if self.chunk_align != 1:
                doc["chunk_align"] = self.chunk_align
            doc["chunks"] = encode_chunk_sizes(self.chunks)
        if self.crc32 is not None:
            doc["crc32"] = self.crc32
        return doc


def _padded(sizes: Sequence[int], align: int) -> Iterable[int]:
    """Each of ``sizes`` rounded up to a multiple of ``align`` (a power of two): the room a chunk takes before
    the next one starts. In C loops (``map``): a file's tens of thousands of chunks in a millisecond or two."""
    if align == 1:
        return sizes
    return map(operator.and_, map(operator.add, sizes, itertools.repeat(align - 1)), itertools.repeat(-align))


_U32 = "I" if array("I").itemsize == 4 else "L"


def encode_chunk_sizes(sizes: Iterable[int]) -> str:
    """The ``chunks`` field: base64 of the sizes as little-endian uint32."""
    raw = array(_U32, sizes)
    if sys.byteorder != "little":
        raw.byteswap()
    return base64.b64encode(raw.tobytes()).decode("ascii")


def _uint32s(raw: bytes) -> Sequence[int]:
    """The little-endian uint32 ``raw`` as a read-only sequence of ints, without a copy where the host is
    little-endian."""
    if sys.byteorder == "little":
        return memoryview(raw).cast(_U32)
    swapped = array(_U32, raw)
    swapped.byteswap()
    return memoryview(swapped).toreadonly()


def _chunk_bytes(text: Any, where: str) -> bytes:
    """The raw little-endian uint32 sizes of a ``chunks`` field."""
    if not isinstance(text, str):
        raise CodecError(f"{where}: 'chunks' must be a base64 string, got {strict_json.brief(text)}")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise CodecError(f"{where}: 'chunks' is not base64") from None
    if len(raw) % 4:
        raise CodecError(f"{where}: 'chunks' holds {len(raw)} bytes, not a whole number of uint32 sizes")
    return raw


def _chunk_sizes(raw: bytes, align: int, stored: int, where: str) -> Sequence[int]:
    """A tensor's chunk sizes (``raw``, the bytes of its ``chunks`` field), checked to add up to its ``stored``
    bytes, each chunk but the last padded to ``align``."""
    sizes = _uint32s(raw)
    got = sum(_padded(sizes[:-1], align)) + (sizes[-1] if len(sizes) else 0)
    if got != stored:
        raise CodecError(f"{where}: chunk sizes add up to {got} but {stored} bytes are stored")
    return sizes


def parse_compression(header: SafetensorsHeader) -> dict[str, CompressedEntry]:
    """The compressed tensors of a file, validated against its header; {} for plain files.

    Raises :class:`CodecError` naming the file, the tensor and the field when the metadata
    lies (unknown codec, sizes that disagree with the stored bytes, shapes that disagree with
    ``nbytes``).
    """
    raw = header.metadata.get(METADATA_KEY)
    if raw is None:
        return {}
    path = header.path
    doc = strict_json.loads(raw, CodecError, f"{path!r}: __metadata__[{METADATA_KEY!r}]")
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION or not isinstance(doc.get("tensors"), dict):
        version = strict_json.brief(doc.get("version") if isinstance(doc, dict) else doc)
        raise CodecError(
            f"{path!r}: compression metadata version {version} is not {FORMAT_VERSION}; upgrade gdsload or re-run "
            "`gdsload compress`"
        )
    stored = {t.name: t for t in header.tensors}
    out: dict[str, CompressedEntry] = {}
    for name, e in doc["tensors"].items():
        where = f"{path!r}: compressed tensor {name!r}"
        if name not in stored:
            raise CodecError(f"{where} is described in the metadata but not stored in the file")
        t = stored[name]
        if t.dtype != "U8" or len(t.shape) != 1:
            raise CodecError(f"{where} must be stored as 1-D U8, found {t.dtype}{list(t.shape)}")
        if not isinstance(e, dict) or not isinstance(e.get("shape"), list):
            raise CodecError(f"{where}: metadata entry {strict_json.brief(e)} must be an object with a shape list")
        try:
            dtype, shape, nbytes, codec = e["dtype"], tuple(e["shape"]), e["nbytes"], e["codec"]
            if isinstance(codec, str) and codec not in CODECS:
                for lookup in _LOOKUPS:
                    lookup(codec)
            # No layout: the codec's oldest one (the last listed).
            layout, params = e.get("layout", CODECS.get(codec, ("",))[-1]), e.get("params") or {}
        except (KeyError, TypeError) as err:
            raise CodecError(f"{where}: metadata entry is missing {err}") from None
        if type(nbytes) is not int or not 0 <= nbytes < MAX_TENSOR_BYTES or not isinstance(params, dict):
            raise CodecError(
                f"{where}: nbytes {strict_json.brief(nbytes)} must be an integer in [0, 2**62) and "
                f"params {strict_json.brief(params)} an object"
            )
        params = dict(params)
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise CodecError(f"{where}: unknown dtype {strict_json.brief(dtype)}")
        if not all(type(d) is int and 0 <= d < 2**63 for d in shape) or math.prod(shape) * ITEMSIZE[dtype] != nbytes:
            raise CodecError(
                f"{where}: shape {strict_json.brief(list(shape))} x {dtype} is not the recorded {nbytes} bytes"
            )
        if (
            not isinstance(codec, str)
            or not isinstance(layout, str)
            or codec not in CODECS
            or layout not in CODECS[codec]
        ):
            raise CodecError(
                f"{where}: codec {strict_json.brief(codec)} with layout {strict_json.brief(layout)} is "
                f"not one of {CODECS}"
            )
        chunk_bytes, align, chunks = 0, 1, ()
        if layout == "chunks":
            chunk_bytes, align = e.get("chunk_bytes"), e.get("chunk_align", 1)
            if type(chunk_bytes) is not int or not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
                raise CodecError(
                    f"{where}: chunk_bytes {strict_json.brief(chunk_bytes)} must be a positive integer "
                    f"up to {MAX_CHUNK_BYTES}"
                )
            need = CHUNK_ALIGN.get(codec, 1)
            if type(align) is not int or not 0 < align <= MAX_CHUNK_ALIGN or align & (align - 1) or align % need:
                raise CodecError(
                    f"{where}: chunk_align {strict_json.brief(align)} must be a power of two up to "
                    f"{MAX_CHUNK_ALIGN} and a multiple of {need}"
                )
            sizes = _chunk_bytes(e.get("chunks", ""), where)
            if len(sizes) // 4 != -(-nbytes // chunk_bytes):
                raise CodecError(
                    f"{where}: {len(sizes) // 4} chunks cannot hold {nbytes} bytes in chunks of {chunk_bytes}"
                )
            chunks = _chunk_sizes(sizes, align, t.nbytes, where)
        crc = e.get("crc32")
        if crc is not None and (type(crc) is not int or not 0 <= crc < 2**32):
            raise CodecError(f"{where}: crc32 {strict_json.brief(crc)} is not a 32-bit unsigned integer")
        out[name] = CompressedEntry(
            name, dtype, shape, nbytes, codec, layout, t.nbytes, params, chunk_bytes, chunks, crc, align
        )
    return out
