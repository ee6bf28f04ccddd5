"""The file the torch.save drop-in and the DCP storage layer write: a compressed-safetensors container of tensors.

Every entry is a 1-D ``U8`` tensor: the tensor's compressed stream (described in ``gdsload.compression``) or its raw
bytes. ``__metadata__["gdsload.tensors"]`` gives each entry's real dtype, shape, byte-plane split and CRC-32 per
8 MiB segment; one more key says what the file is (``gdsload.object``: an object ``gdsload.save`` pickled;
``gdsload.dcp``: one rank's part of a DCP checkpoint). ``safetensors.safe_open`` and ``load_rank`` open these files
(they see bytes); :mod:`.reader` reads them back.

Written in one pass: room for the header is reserved first (an upper bound of it: every entry described with its
worst-case sizes), entries are appended as they are encoded while a thread writes the previous ones, then the real
header goes to offset 0. The file is written beside its name and renamed into place only when complete, so a
failure or a kill never leaves a partial file under the name.

``torch.load`` of such a file, when the name does not end in ``.safetensors``, reads its first bytes as a pickle:
with ``guard``, the header's length and its first metadata value are chosen so that this pickle stops with an error
that says to use ``gdsload.load`` (under ``weights_only=True``, torch's default) instead of returning anything.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .encode import FRAME, SEGMENT, Stored, encode_crcs
from .writer import (
    Appender,
    WritePipe,
    header_json,
    open_sink,
    reserved_start,
    with_compression,
    write_failed,
)
from ..codecs.registry import codec as codec_spec
from ..errors import CheckpointError, ConfigError, GdsloadError
from ..format.compression import CompressedEntry
from ..format.atomic import atomic_output
from ..format.safetensors import MAX_HEADER_BYTES
from ..format.writer import pwrite_all

__all__ = ["TENSORS_KEY", "FORMAT_VERSION", "GUARD_KEY", "Planned", "TensorFileWriter", "WriteStats"]

log = logging.getLogger(__name__)

TENSORS_KEY = "gdsload.tensors"
FORMAT_VERSION = 1
GUARD_KEY = "gdsload.torch_load"
_GUARD_TEXT = "this file was written by gdsload.save: load it with gdsload.load(path)"
# The pickle torch.load meets: a SHORT_BINSTRING (the text), an empty tuple, REDUCE (calling the text fails).
_GUARD = f"U{chr(len(_GUARD_TEXT))}{_GUARD_TEXT})R"
assert 32 <= len(_GUARD_TEXT) < 127 and chr(len(_GUARD_TEXT)) not in '"\\' and not set('"\\') & set(_GUARD_TEXT)
_GUARD_PREFIX = len('{"__metadata__":{"%s":"' % GUARD_KEY)
"""Where the guard's value starts in the header."""


class Planned(NamedTuple):
    """What the writer knows of an entry before it is encoded: enough to bound the header."""

    name: str
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    compressible: bool


class WriteStats(NamedTuple):
    stored_bytes: int
    file_bytes: int
    write_seconds: float
    writer: str


def _worst_entries(planned: Sequence[Planned], data_max: int) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    comp: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    entries = []
    for p in planned:
        entries.append((p.name, "U8", [p.nbytes], data_max, data_max))
        meta[p.name] = {
            "dtype": p.dtype,
            "shape": list(p.shape),
            "crc32": encode_crcs([0] * -(-p.nbytes // SEGMENT)),
            "planes": 8,
        }
        if p.compressible:
            worst = ""
            for name, params in (("ans", {"data_type": "<f4"}), ("zstd", {"level": 22})):
                spec = codec_spec(name)
                chunks = (min(p.nbytes, 0xFFFFFFFF),) * -(-p.nbytes // spec.chunk_bytes)
                doc = CompressedEntry(
                    p.name,
                    "U8",
                    (p.nbytes,),
                    p.nbytes,
                    name,
                    "chunks",
                    p.nbytes,
                    params,
                    spec.chunk_bytes,
                    chunks,
                    None,
                    spec.chunk_align,
                ).to_json()
                if len(json.dumps(doc)) > len(json.dumps(worst)):
                    worst = doc
            comp[p.name] = worst
    return comp, meta, entries


def _metadata(kind: Mapping[str, str], meta: Mapping[str, Any], guard: str | None) -> dict[str, str]:
    out = {GUARD_KEY: guard} if guard is not None else {}
    out.update(kind)
    out[TENSORS_KEY] = json.dumps(
        {"version": FORMAT_VERSION, "segment": SEGMENT, "frame": FRAME, "tensors": meta}, separators=(",", ":")
    )
    return out


class TensorFileWriter:
    """Writes one tensor file at ``path``: :meth:`add` each planned entry (in any order), then leave the block.

    >>> with TensorFileWriter(path, planned, {"gdsload.dcp": "{}"}) as w:  # doctest: +SKIP
    ...     w.add("a", encode(t, "zstd", name="a"), dtype=t.dtype, shape=t.shape)
    """

    def __init__(
        self,
        path: str | Path,
        planned: Sequence[Planned],
        kind: Mapping[str, str],
        *,
        writer: str = "auto",
        guard: bool = False,
    ):
        self.path = Path(path)
        self._planned = {p.name: p for p in planned}
        if len(self._planned) != len(planned):
            raise ConfigError(f"{str(path)!r}: entry names repeat")
        self._kind = dict(kind)
        self._writer = writer
        comp, meta, entries = _worst_entries(planned, sum(p.nbytes for p in planned))
        bound = len(header_json(with_compression(_metadata(kind, meta, _GUARD if guard else None), comp), entries))
        self._guard: str | None = None
        if guard:  # the header's length N = 256 L + 0x58 and its text up to the guard is L - 3 bytes long
            length = max(_GUARD_PREFIX + 3, -(-(bound - 91 - _GUARD_PREFIX) // 255))
            self._guard = " " * (length - 3 - _GUARD_PREFIX) + _GUARD
            self.reserved = 8 + 256 * length + 0x58
        else:
            self.reserved = reserved_start(bound)
        if self.reserved - 8 > MAX_HEADER_BYTES:
            raise ConfigError(
                f"{str(path)!r}: the header would need {self.reserved - 8} bytes, over safetensors' "
                f"{MAX_HEADER_BYTES}-byte limit; save fewer, larger tensors per file"
            )
        self._comp: dict[str, dict[str, Any]] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._entries: list[tuple[str, str, list[int], int, int]] = []
        self._out: atomic_output | None = None
        self.stats: WriteStats | None = None

    def __enter__(self) -> TensorFileWriter:
        self._t0 = time.perf_counter()
        self._out = atomic_output(self.path)
        try:
            f = self._out.__enter__()
        except OSError as e:
            raise write_failed(self.path, e) from e
        try:
            self._fd = f.fileno()
            self._sink = open_sink(self._writer, self._out.tmp, self._fd)
            self._pipe = WritePipe(self._sink, self._fd, self.path)
            self._app = Appender(self._pipe, self.reserved)
        except BaseException as e:
            self._out.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def add(self, name: str, stored: Stored, meta: dict[str, Any]) -> None:
        """Append entry ``name`` (planned) with its stored bytes and the metadata :meth:`Stored.meta` made."""
        if name not in self._planned or name in self._meta:
            raise CheckpointError(
                f"{str(self.path)!r}: entry {name!r} is not planned or was added twice; a gdsload bug"
            )
        start = self._app.add(stored.data) - self.reserved
        size = int(stored.data.nbytes)
        self._entries.append((name, "U8", [size], start, start + size))
        self._meta[name] = meta
        if stored.entry is not None:
            self._comp[name] = stored.entry._replace(name=name).to_json()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._out is not None
        try:
            if exc_type is None:
                missing = sorted(set(self._planned) - set(self._meta))
                if missing:
                    raise CheckpointError(
                        f"{str(self.path)!r}: entries {missing[:5]} were planned but never added; a gdsload bug"
                    )
                self._app.flush()
                self._pipe.finish()
                t = time.perf_counter()
                self._write_header()
                busy = self._pipe.busy + time.perf_counter() - t
            else:
                self._pipe.abort()
        except BaseException as e:
            self._pipe.abort()
            self._sink.close()
            self._out.__exit__(type(e), e, e.__traceback__)
            if isinstance(e, OSError) and not isinstance(e, GdsloadError):
                raise write_failed(self.path, e) from e
            raise
        self._sink.close()
        try:
            self._out.__exit__(exc_type, exc, tb)  # fsync and rename, or remove the temporary file
        except OSError as e:
            if isinstance(e, GdsloadError):
                raise
            raise write_failed(self.path, e) from e
        if exc_type is None:
            self.stats = WriteStats(self._app.offset - self.reserved, self._app.offset, busy, self._sink.name)

    def _write_header(self) -> None:
        header = header_json(
            with_compression(_metadata(self._kind, self._meta, self._guard), self._comp), self._entries
        )
        room = self.reserved - 8
        if len(header) > room:  # cannot happen: the bound describes every field at its largest
            raise CheckpointError(
                f"{str(self.path)!r}: header of {len(header)} bytes outgrew its reserved {room}; a gdsload bug"
            )
        pwrite_all(self._fd, struct.pack("<Q", room) + header + b" " * (room - len(header)), 0)
