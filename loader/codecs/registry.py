"""The codecs, by name: each one an object that says what its streams look like and how it encodes and decodes them.

A codec is one module that defines a :class:`Codec` subclass and registers an instance with :func:`register_codec`
(the modules of :data:`BUILTIN` are imported on first use; other packages declare theirs in the entry point group
``gdsload.codecs`` as ``name = "package.module"``, imported when the name is first asked for). Registering also
tells the format layer which stream layouts files may use for the codec.

A codec has up to two sides:

- the CPU side, :meth:`Codec.encode_chunk` and :meth:`Codec.decode_chunk`: one chunk of at most
  :attr:`Codec.chunk_bytes` decoded bytes each, called from many threads at once;
- the GPU side, :attr:`Codec.nvcomp_algorithm`: nvCOMP's name for the same streams, with the options
  :meth:`Codec.nvcomp_options` gives it (:class:`gdsload.loader.codecs.gpu.GpuCodecs` runs them).

A codec with a CPU side compresses and loads on every host; one with only a GPU side needs nvCOMP and a GPU.

>>> codec("zstd").cpu_decode, codec("ans").cpu_decode
(True, False)
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping
from typing import Any

from ..errors import CodecError
from ..format.compression import add_codec_lookup, register_stream_format

__all__ = ["Codec", "register_codec", "codec", "codec_names", "GPU_DEFAULT", "CPU_DEFAULT", "BUILTIN"]

BUILTIN = ("gdsload.loader.codecs.ans", "gdsload.loader.codecs.zstd", "gdsload.loader.codecs.gdeflate")
GPU_DEFAULT = "ans"
"""What ``auto`` compresses with where nvCOMP runs."""
CPU_DEFAULT = "zstd"
"""What ``auto`` compresses with elsewhere (it must encode and decode on the CPU)."""


class Codec:
    """One codec. Subclass it, set :attr:`name` and the attributes that differ from the defaults, implement the
    sides the codec has, and register an instance with :func:`register_codec`."""

    name: str = ""
    layouts: tuple[str, ...] = ("chunks",)
    """Stream layouts files may use: ``chunks`` (each chunk of :attr:`chunk_bytes` decoded bytes compressed on its
    own, their sizes in the file's metadata) or ``native`` (nvCOMP's own container); ``gdsload compress`` writes the
    first. A codec with a CPU side writes ``chunks``."""
    chunk_bytes: int = 256 << 10
    """Decoded bytes per chunk (for ``native``, nvCOMP's chunk size)."""
    chunk_align: int = 1
    """Alignment each chunk needs within a tensor's stored bytes (``chunks`` layout)."""
    nvcomp_algorithm: str | None = None
    """nvCOMP's name for these streams (``ANS``, ``Zstd``, ``GDeflate``); None: no GPU side."""
    batch_decoder: bool = False
    """Whether its ``chunks`` decode through nvCOMP's C API in one call per staging group (no GIL held, GPU 0 left
    alone); others go through nvCOMP's Python package, one call per tensor."""
    self_checked: bool = False
    """Whether its ``native`` streams carry checksums of their own (no crc32 needed beside them)."""

    def params(self, dtype: str) -> dict[str, Any]:
        """Encoder parameters for a tensor of safetensors dtype ``dtype`` (recorded in the file beside it)."""
        return {}

    def nvcomp_options(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Keyword options of ``nvidia.nvcomp.Codec`` for streams written with ``params``."""
        return {}

    def encode_chunk(self, data: memoryview, params: Mapping[str, Any]) -> bytes:
        """One compressed chunk of ``data`` (at most :attr:`chunk_bytes`), on the CPU; thread-safe."""
        raise CodecError(f"codec {self.name!r} compresses on a GPU only (nvCOMP)")

    def decode_chunk(self, data: memoryview, nbytes: int, params: Mapping[str, Any]) -> bytes:
        """The ``nbytes`` decoded bytes of one chunk, on the CPU; thread-safe. Raise on a damaged chunk (any
        exception: the caller names the file, the tensor and the chunk)."""
        raise CodecError(f"codec {self.name!r} decodes on a GPU only (nvCOMP)")

    @property
    def cpu_encode(self) -> bool:
        """Whether the CPU compresses it (only such codecs are written on hosts without a GPU)."""
        return type(self).encode_chunk is not Codec.encode_chunk

    @property
    def cpu_decode(self) -> bool:
        """Whether the CPU decodes it (only such codecs load on CPU-only hosts)."""
        return type(self).decode_chunk is not Codec.decode_chunk

    @property
    def gpu(self) -> bool:
        """Whether nvCOMP encodes and decodes it on a GPU."""
        return self.nvcomp_algorithm is not None

    def replace(self, **changes: Any) -> Codec:
        """A copy with some attributes changed (``codec("ans").replace(layouts=("native", "chunks"))``)."""
        made = copy.copy(self)
        for key, value in changes.items():
            if not hasattr(Codec, key):
                raise AttributeError(f"a codec has no attribute {key!r}")
            setattr(made, key, value)
        return made

    def __repr__(self) -> str:
        sides = [s for s, on in (("cpu", self.cpu_decode), ("gpu", self.gpu)) if on]
        return f"<codec {self.name!r} layouts={self.layouts} on {'+'.join(sides) or 'nothing'}>"


_CODECS: dict[str, Codec] = {}
_LOADED = False
_ENTRY_POINTS_LOADED = False


def register_codec(made: Codec) -> None:
    """Make the codec ``made`` known by its name; files may then use its layouts."""
    if not isinstance(made, Codec):
        raise TypeError(f"register_codec takes a Codec instance, not {type(made).__name__}")
    if not made.name or not made.layouts:
        raise ValueError(f"{type(made).__name__}: a codec needs a name and at least one layout")
    if "native" in made.layouts and not made.gpu:
        raise ValueError(f"codec {made.name!r}: the 'native' layout is nvCOMP's container; set nvcomp_algorithm")
    if made.cpu_encode and made.chunk_align > 1:
        raise ValueError(f"codec {made.name!r}: its CPU encoder packs chunks end to end; chunk_align must be 1")
    _CODECS[made.name] = made
    register_stream_format(made.name, made.layouts, made.chunk_align)


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


def codec(name: str) -> Codec:
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
