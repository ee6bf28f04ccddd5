"""The codecs, by name: what each one is, as the rest of the loader needs to know it.

A codec is one module that builds a :class:`CodecSpec` and calls :func:`register_codec` (the
modules of :data:`BUILTIN` are imported on first use; other packages declare theirs in the entry
point group ``gdsload.codecs`` as ``name = "package.module"``, imported when the name is first asked
for). Registering also tells the format layer which stream layouts files may use for the codec.

>>> codec("zstd").cpu_decode
True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from ..errors import CodecError
from ..format.compression import add_codec_lookup, register_stream_format

__all__ = ["CodecSpec", "register_codec", "codec", "codec_names", "GPU_DEFAULT", "CPU_DEFAULT", "BUILTIN"]

BUILTIN = ("gdsload.loader.codecs.ans", "gdsload.loader.codecs.zstd", "gdsload.loader.codecs.gdeflate")
GPU_DEFAULT = "ans"
"""What ``auto`` compresses with where nvCOMP runs."""
CPU_DEFAULT = "zstd"
"""What ``auto`` compresses with elsewhere (it must encode and decode on the CPU)."""


class CodecSpec(NamedTuple):
    name: str
    layouts: tuple[str, ...]
    """Stream layouts files may use (``chunks``, ``native``); ``gdsload compress`` writes the first."""
    nvcomp_algorithm: str
    """nvCOMP's name for it (``ANS``, ``Zstd``, ``GDeflate``)."""
    params: Callable[[str], dict[str, Any]]
    """Encoder parameters for a tensor of safetensors dtype ``dtype``."""
    chunk_bytes: int = 0
    """Decoded bytes per chunk (``chunks`` layout; for ``native``, nvCOMP's chunk size)."""
    chunk_align: int = 1
    """Alignment each chunk needs within a tensor's stored bytes (``chunks`` layout)."""
    cpu_encode: bool = False
    cpu_decode: bool = False
    """Whether the CPU can compress / decode it (``zstandard``): only such codecs load on CPU-only hosts."""
    batch_decoder: bool = False
    """Whether its ``chunks`` decode through nvCOMP's C API in one call per staging group (no GIL held,
    GPU 0 left alone); others go through nvCOMP's Python package, one call per tensor."""
    self_checked: bool = False
    """Whether its ``native`` streams carry checksums of their own (no crc32 needed beside them)."""
    extra: Mapping[str, Any] = MappingProxyType({})


_CODECS: dict[str, CodecSpec] = {}
_LOADED = False
_ENTRY_POINTS_LOADED = False


def register_codec(spec: CodecSpec) -> None:
    """Make ``spec`` known by its name; files may then use its layouts."""
    _CODECS[spec.name] = spec
    register_stream_format(spec.name, spec.layouts, spec.chunk_align)


def _load(*, entry_points: bool = False) -> None:
    """Register the built-in codecs; with ``entry_points``, also those other packages declare (group
    ``gdsload.codecs``). Scanning installed packages' metadata costs milliseconds, so a load looks
    there only for a name the built-ins do not have."""
    global _LOADED, _ENTRY_POINTS_LOADED
    if not _LOADED:
        _LOADED = True
        for module in BUILTIN:
            importlib.import_module(module)
    if entry_points and not _ENTRY_POINTS_LOADED:
        _ENTRY_POINTS_LOADED = True
        from importlib.metadata import entry_points as declared

        for ep in declared(group="gdsload.codecs"):
            if ep.name not in _CODECS:
                importlib.import_module(ep.value)


def _lookup(name: str) -> None:
    """A file names a codec not registered yet: look for it among the built-ins and the entry points."""
    _load()
    if name not in _CODECS:
        _load(entry_points=True)


add_codec_lookup(_lookup)


def codec(name: str) -> CodecSpec:
    """The codec called ``name``; :class:`CodecError` naming the known ones otherwise."""
    _load()
    if name not in _CODECS:
        _load(entry_points=True)
    try:
        return _CODECS[name]
    except KeyError:
        raise CodecError(f"codec {name!r} is not known; known codecs: {', '.join(sorted(_CODECS))}") from None


def codec_names() -> list[str]:
    """Every known codec, those from entry points included."""
    _load(entry_points=True)
    return sorted(_CODECS)
