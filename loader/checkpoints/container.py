"""Training checkpoints: compressed, bit-exact drop-ins for ``torch.save`` / ``torch.load``.

``save_compressed_checkpoint(model, optimizer, path, algorithm)`` stores a model's state dict,
an optimizer's state dict and ``extras`` (epoch, RNG states, scheduler state, ...) in one
compressed safetensors file; ``load_compressed_checkpoint(path, device)`` returns
``{"model": ..., "optimizer": ..., "extras": ...}``, which ``Module.load_state_dict`` and
``Optimizer.load_state_dict`` accept, bit for bit (dtypes, shapes, values, ``step`` tensors,
Python scalar types).

**No pickle.** Every tensor gets a unique name (``model/<key>``, ``optim/state/<id>/<key>``,
``optim/param_groups/<i>/<key>``, ``extra/<key>/...``; ``#n`` is appended on a clash).
Everything else is a JSON *skeleton* in ``__metadata__["gdsload.checkpoint"]``: dicts
(``OrderedDict`` too, with a state dict's ``_metadata``; keys may be str, int, float, bool,
None or tuples), lists, tuples, None/bool/int/float/str (non-finite floats by their bits),
numpy arrays and scalars, and ``{"tensor": name}`` leaves; a table gives each tensor's dtype,
shape and the device it came from. Anything else raises :class:`CheckpointTypeError` naming
where it is. Tensors that are the same view of the same memory (tied weights) are stored once
and come back as one tensor, as with ``torch.load``.

**Container.** One ``.safetensors`` file (one file to copy, and ``os.replace`` swaps it for the
previous checkpoint atomically), readable by ``safetensors.safe_open`` and ``load_rank``::

    [u64 N][header JSON, space-padded: data starts at R, a multiple of 4096]
    [raw region: tensors under MIN_TENSOR_BYTES, typed, largest element size first]
    [stream region: each larger tensor as a 1-D U8 entry, in the order it was compressed]

A stream entry is the tensor's compressed stream (described in ``gdsload.compression``, see
:mod:`.compression`) or, when compression gains less than ``min_gain``, its raw bytes; the
skeleton's table retypes those on load.

**Pipeline** (save time ≈ max(compress, write)). safetensors needs the header first, and the
header holds every stored size, known only after compression. So the header is *reserved*: an
upper bound of its length is computed before anything is compressed (every large tensor
described as compressed with its worst-case sizes, checksum and chunk table; every stored size
at most the tensor's own size; every offset at most the data size), R is that bound rounded up
to 4096, and data is written from R on. The calling thread compresses tensor i+1 (nvCOMP on
the tensor's GPU; zstandard on the CPU) while a writer thread writes tensor i at its final
offset, through kvikio's ``CuFile.pwrite`` when kvikio imports, else ``pwrite``, with
``fdatasync`` every 256 MiB so the disk works during compression too. The queue between them
is bounded: at most four tensors' stored bytes (plus 4 MiB of coalesced small tensors) sit in
host memory. Last, the real header goes to offset 0, padded to R; then fsync and rename.
Everything is written to a temp file beside ``path``, one per save: a failure (ENOSPC, an
exception, KeyboardInterrupt) removes it, and a previous checkpoint at ``path`` stays untouched;
two saves to one path at once never mix (the last to finish wins). A save killed outright leaves
its hidden temp file (``.NAME.tmp-*``), which the next save of that name on the host removes.

**Loading** goes through the load pipeline (:func:`~gdsload.loader.pipeline.load.load_rank`): every
tensor gets memory of its own on its target device, and the pipeline reads each raw tensor
straight into it and decodes each compressed one into it (zstandard on the CPU, nvCOMP on the GPU,
reads of the next staging group overlapping the decode). Every returned tensor owns its memory, as
with ``torch.load``: no tensor keeps a whole-checkpoint buffer alive (an optimizer keeps its state
tensors after ``load_state_dict``), and APIs that assume a storage offset of 0 work
(``torch.set_rng_state`` crashes on a view into a larger buffer). The file is also an ordinary
input of :func:`.load_rank`, whose arena views suit inference weights better.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from ..codecs import default_params, encode_tensor, nvcomp_available
from ..codecs.registry import CPU_DEFAULT, GPU_DEFAULT, codec as codec_spec, codec_names
from ..prepare.compress import MIN_TENSOR_BYTES
from ..format.compression import CompressedEntry, parse_compression
from ..config import format_bytes
from ..dtypes import ITEMSIZE, to_torch
from ..errors import (
    BackendUnavailableError,
    CheckpointError,
    CheckpointTypeError,
    CheckpointWriteError,
    CodecError,
    ConfigError,
    GdsloadError,
)
from .writer import Appender as _Appender
from .writer import PosixSink as _PosixSink  # noqa: F401 (patched by tests)
from .writer import WritePipe as _Pipe
from .writer import header_json as _header_json
from .writer import host_bytes as _host_bytes
from .writer import kvikio_missing as _kvikio_missing
from .writer import open_sink as _open_sink
from .writer import with_compression as _with_compression
from .writer import write_failed as _write_failed
from .tree import Flattener, Leaf, Rebuilder, state_of
from ..format.atomic import atomic_output
from ..format.safetensors import DATA_ALIGNMENT, MAX_HEADER_BYTES, SafetensorsHeader, read_header
from ..format.writer import pwrite_all

__all__ = [
    "CHECKPOINT_KEY",
    "CHECKPOINT_VERSION",
    "ALGORITHMS",
    "WRITERS",
    "CheckpointError",
    "CheckpointTypeError",
    "CheckpointWriteError",
    "CheckpointReport",
    "save_compressed_checkpoint",
    "load_compressed_checkpoint",
]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "gdsload.checkpoint"
"""``__metadata__`` key of the skeleton (JSON)."""
CHECKPOINT_VERSION = 1
ALGORITHMS = ("ANS", "Zstd", "GDeflate", "none", "auto")
"""What ``algorithm`` may be (any case): a codec's name, ``none``, or ``auto`` (ANS where nvCOMP runs, else Zstd)."""
WRITERS = ("auto", "kvikio", "posix")
"""``auto``: kvikio when it imports and opens the file, else posix ``pwrite``."""

_ZSTD_THREADS = max(1, min(8, os.cpu_count() or 1))


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class CheckpointReport:
    """What :func:`save_compressed_checkpoint` wrote and how long each part took."""

    path: str
    algorithm: str
    """Codec of the large tensors: ``ans``, ``zstd``, ``gdeflate`` or ``none``."""
    writer: str
    """What wrote the data section: ``kvikio`` (``CuFile.pwrite``; from host buffers kvikio writes
    with POSIX calls in its thread pool, not GDS DMA) or ``posix`` (``pwrite``)."""
    tensors: int
    """Tensors stored (shared views counted once)."""
    compressed: int
    """Tensors stored compressed; the rest are small, or gained less than ``min_gain``."""
    logical_bytes: int
    stored_bytes: int
    """Bytes of the data section."""
    file_bytes: int
    compress_seconds: float
    """Calling thread: compressing, and copying stored bytes to host memory."""
    write_seconds: float
    """Writer thread: writes and periodic ``fdatasync``; plus the header write and the final fsync."""
    total_seconds: float
    """Wall time of the whole call; with the pipeline, close to max(compress, write)."""

    @property
    def ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def gbps(self) -> float:
        """Logical GB (1e9 bytes) saved per second of wall time."""
        return self.logical_bytes / self.total_seconds / 1e9 if self.total_seconds > 0 else 0.0

    @property
    def compress_gbps(self) -> float:
        return self.logical_bytes / self.compress_seconds / 1e9 if self.compress_seconds > 0 else 0.0

    @property
    def write_gbps(self) -> float:
        """Stored GB written per second of writer time."""
        return self.stored_bytes / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0

    def summary(self) -> str:
        """``checkpoint 'c.safetensors': 1.20 GB -> 0.95 GB (ratio 1.26) in 0.812 s (1.48 GB/s); ...``"""
        return (
            f"checkpoint {self.path!r}: {format_bytes(self.logical_bytes)} -> {format_bytes(self.stored_bytes)} "
            f"(ratio {self.ratio:.2f}) in {self.total_seconds:.3f} s ({self.gbps:.2f} GB/s); "
            f"compress {self.compress_seconds:.3f} s, write {self.write_seconds:.3f} s; "
            f"algorithm={self.algorithm} writer={self.writer} tensors={self.tensors} compressed={self.compressed}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "ratio": self.ratio,
            "gbps": self.gbps,
            "compress_gbps": self.compress_gbps,
            "write_gbps": self.write_gbps,
        }


# --------------------------------------------------------------------------- the file layout


def _reserve(
    raw: list[tuple[str, str, list[int], int, int]],
    stream: list[Leaf],
    codec: str | None,
    checksum: bool,
    metadata: Mapping[str, str],
) -> int:
    """Where the data section starts: an upper bound of the header, rounded up to 4096.

    The bound describes every stream tensor as compressed (a superset of the real entries), with
    its logical size as stored size (a kept stream is smaller, a raw one equal), the largest
    possible offsets, a full crc32 and its exact chunk count; every number in the real header
    has at most as many digits, and every string is the same.
    """
    data_max = (raw[-1][4] if raw else 0) + sum(leaf.nbytes for leaf in stream)
    worst: dict[str, dict[str, Any]] = {}
    for leaf in stream:
        assert codec is not None
        spec = codec_spec(codec)
        layout = spec.layouts[0]
        chunk = spec.chunk_bytes if layout == "chunks" else 0
        # Each chunk's size is a uint32; its base64 length depends only on the count of chunks.
        chunks = (min(leaf.nbytes, 0xFFFFFFFF),) * -(-leaf.nbytes // chunk) if chunk else ()
        worst[leaf.name] = CompressedEntry(
            leaf.name,
            leaf.dtype,
            tuple(leaf.tensor.shape),
            leaf.nbytes,
            codec,
            layout,
            leaf.nbytes,
            default_params(codec, leaf.dtype),
            chunk,
            chunks,
            0xFFFFFFFF if checksum else None,
            spec.chunk_align if chunk else 1,
        ).to_json()
    entries = [*raw, *((leaf.name, "U8", [leaf.nbytes], data_max, data_max) for leaf in stream)]
    bound = len(_header_json(_with_compression(metadata, worst), entries))
    reserved = -(-(8 + bound) // DATA_ALIGNMENT) * DATA_ALIGNMENT
    if reserved - 8 > MAX_HEADER_BYTES:
        raise ConfigError(
            f"the checkpoint header would need {reserved - 8} bytes, over safetensors' {MAX_HEADER_BYTES}-byte "
            "limit; store large non-tensor values in extras as tensors or numpy arrays"
        )
    return reserved


# --------------------------------------------------------------------------- the writer side


# --------------------------------------------------------------------------- save


def _codec_of(algorithm: str) -> str | None:
    names = codec_names()
    if not isinstance(algorithm, str) or algorithm.lower() not in (*names, "none", "auto"):
        shown = sorted((codec_spec(n).nvcomp_algorithm for n in names), key=lambda n: (n != "ANS", n != "Zstd", n))
        raise ConfigError(
            f"algorithm={algorithm!r} is not one of {', '.join(map(repr, [*shown, 'none', 'auto']))} (case-insensitive)"
        )
    name = algorithm.lower()
    if name == "none":
        return None
    if name != "auto":
        return name
    reason = nvcomp_available()
    log.info(
        "algorithm auto: %s",
        f"{GPU_DEFAULT} (nvCOMP on the GPU)" if reason is None else f"{CPU_DEFAULT} on the CPU ({reason})",
    )
    return GPU_DEFAULT if reason is None else CPU_DEFAULT


def _staging_device(codec: str | None, algorithm: str, stream: list[Leaf]) -> torch.device | None:
    """The GPU that compresses CPU tensors for a GPU-only codec (None: none needed); raises if there is none."""
    if codec is None or codec_spec(codec).cpu_encode or not stream:
        return None
    reason = nvcomp_available()
    if reason is not None:
        first = stream[0]
        raise CodecError(
            f"algorithm={algorithm!r} compresses on a GPU only (nvCOMP), and here {reason}: {first.where} "
            f"({format_bytes(first.nbytes)}) would need it; save with algorithm='Zstd' (compresses on the CPU, "
            "loads on any host), or run on a CUDA host"
        )
    on_cpu = [leaf for leaf in stream if not leaf.tensor.is_cuda]
    if not on_cpu:
        return None
    dev = torch.device("cuda", torch.cuda.current_device())
    log.info(
        "%d CPU tensors (%s) are copied to %s to be compressed with %s",
        len(on_cpu),
        format_bytes(sum(leaf.nbytes for leaf in on_cpu)),
        dev,
        codec,
    )
    return dev


def save_compressed_checkpoint(
    model_or_state: torch.nn.Module | Mapping[str, Any] | None,
    optimizer: torch.optim.Optimizer | Mapping[str, Any] | None,
    path: str | os.PathLike[str],
    algorithm: str = "auto",
    *,
    extras: Mapping[str, Any] | None = None,
    min_gain: float = 0.02,
    writer: str = "auto",
    codec: str | None = None,
) -> CheckpointReport:
    """Save model, optimizer and ``extras`` state to one compressed ``.safetensors`` file, atomically.

    ``model_or_state``: a module or its state dict (or None); ``optimizer``: an optimizer or its
    state dict (or None); ``extras``: a dict of JSON-like values, tensors and numpy arrays (epoch,
    RNG states, a scheduler's state dict). ``codec`` (or ``algorithm``, its older name): ``"ANS"`` (nvCOMP, on the GPU: CUDA
    tensors on their own GPU, CPU tensors copied to the current GPU; loads need a GPU),
    ``"Zstd"`` (nvCOMP on CUDA tensors, zstandard on CPU tensors; loads anywhere),
    ``"GDeflate"``, ``"none"``, or ``"auto"`` (ANS where nvCOMP runs, else Zstd). Tensors under
    64 KiB, or that shrink by less than ``min_gain``, are stored raw. ``writer``: ``"auto"``,
    ``"kvikio"`` or ``"posix"`` (see :data:`WRITERS`); the file is the same either way.

    Raises :class:`CheckpointTypeError` for a value that cannot be stored, :class:`ConfigError`
    for bad options, :class:`CodecError` when the algorithm cannot run here, and
    :class:`CheckpointWriteError` when writing fails — all before or without touching ``path``.

    >>> report = save_compressed_checkpoint(model, opt, "step-1000.safetensors", "Zstd",
    ...                                     extras={"step": 1000, "rng": torch.get_rng_state()})  # doctest: +SKIP
    >>> print(report.summary())  # doctest: +SKIP
    checkpoint 'step-1000.safetensors': 1.48 GB -> 1.21 GB (ratio 1.22) in 0.902 s (1.64 GB/s); ...
    """
    t_start = time.perf_counter()
    dst = Path(path)
    if dst.suffix != ".safetensors":
        raise ConfigError(
            f"path {str(path)!r} must end in '.safetensors' (the file is a safetensors file, and load_rank finds "
            f"files by that suffix); e.g. {str(dst.with_suffix('.safetensors'))!r}"
        )
    if dst.is_dir():
        raise ConfigError(
            f"path {str(path)!r} is a directory; name a file in it, e.g. {str(dst / 'checkpoint.safetensors')!r}"
        )
    if codec is not None and str(algorithm).lower() not in ("auto", str(codec).lower()):
        raise ConfigError(f"codec={codec!r} and algorithm={algorithm!r} name two codecs; pass codec= alone")
    algorithm = codec if codec is not None else algorithm
    codec = _codec_of(algorithm)
    if not isinstance(min_gain, (int, float)) or not 0 <= min_gain < 1:
        raise ConfigError(f"min_gain={min_gain!r} must be a number in [0, 1)")
    if writer not in WRITERS:
        raise ConfigError(f"writer={writer!r} is not one of {WRITERS}")
    if writer == "kvikio" and (why := _kvikio_missing()) is not None:
        raise BackendUnavailableError(
            f"writer='kvikio' but kvikio does not import ({why}); install gdsload[cu12] or gdsload[cu13], "
            "or use writer='posix'"
        )

    if extras is not None and not isinstance(extras, Mapping):
        raise CheckpointTypeError(f"extras must be a dict or None, got {type(extras).__qualname__}")
    flat = Flattener()
    tree = {
        "model": flat.node(state_of(model_or_state, torch.nn.Module, "model_or_state"), ["model"], "model"),
        "optimizer": flat.node(state_of(optimizer, torch.optim.Optimizer, "optimizer"), ["optim"], "optimizer"),
        "extras": flat.node(extras, ["extra"], "extras"),
    }
    leaves = flat.leaves
    stream = [leaf for leaf in leaves if codec is not None and leaf.nbytes >= MIN_TENSOR_BYTES]
    streamed = {id(leaf) for leaf in stream}
    raw_leaves = sorted((leaf for leaf in leaves if id(leaf) not in streamed), key=lambda leaf: -ITEMSIZE[leaf.dtype])
    staging = _staging_device(codec, algorithm, stream)
    cpu_codec = codec is not None and codec_spec(codec).cpu_encode
    zstd_on_gpu = cpu_codec and any(leaf.tensor.is_cuda for leaf in stream) and nvcomp_available() is None
    # Streams in nvCOMP's own container carry their own checksums; the others get a crc32.
    checksum = codec is not None and not (codec_spec(codec).layouts[0] == "native" and codec_spec(codec).self_checked)

    raw_entries: list[tuple[str, str, list[int], int, int]] = []
    cursor = 0
    for leaf in raw_leaves:
        raw_entries.append((leaf.name, leaf.dtype, list(leaf.tensor.shape), cursor, cursor + leaf.nbytes))
        cursor += leaf.nbytes
    skeleton = {
        "version": CHECKPOINT_VERSION,
        "torch": torch.__version__,
        "tree": tree,
        "tensors": {
            leaf.name: {"dtype": leaf.dtype, "shape": list(leaf.tensor.shape), "device": str(leaf.tensor.device)}
            for leaf in leaves
        },
    }
    metadata = {"format": "pt", CHECKPOINT_KEY: json.dumps(skeleton, separators=(",", ":"))}
    reserved = _reserve(raw_entries, stream, codec, checksum, metadata)

    compress_s = write_s = 0.0
    comp: dict[str, dict[str, Any]] = {}
    stream_entries: list[tuple[str, str, list[int], int, int]] = []
    out = atomic_output(dst)
    try:
        with out as f:
            fd = f.fileno()
            sink = _open_sink(writer, out.tmp, fd)
            try:
                pipe = _Pipe(sink, fd, dst)
                try:
                    app = _Appender(pipe, reserved)
                    for leaf in raw_leaves:
                        t = time.perf_counter()
                        data = _host_bytes(leaf.tensor)
                        compress_s += time.perf_counter() - t
                        app.add(data)
                    for leaf in stream:
                        t = time.perf_counter()
                        data = _compress(leaf, codec, staging, zstd_on_gpu, checksum, min_gain, comp)
                        compress_s += time.perf_counter() - t
                        start = app.add(data) - reserved
                        stream_entries.append((leaf.name, "U8", [int(data.nbytes)], start, start + int(data.nbytes)))
                    app.flush()
                    pipe.finish()
                except BaseException:
                    pipe.abort()
                    raise
            finally:
                sink.close()
            write_s += pipe.busy
            t = time.perf_counter()
            header = _header_json(_with_compression(metadata, comp), [*raw_entries, *stream_entries])
            if 8 + len(header) > reserved:  # cannot happen: _reserve bounds every field
                raise CheckpointError(
                    f"header of {len(header)} bytes outgrew its reserved {reserved - 8}; a gdsload bug"
                )
            pwrite_all(fd, struct.pack("<Q", reserved - 8) + header + b" " * (reserved - 8 - len(header)), 0)
            os.fsync(fd)
            write_s += time.perf_counter() - t
    except OSError as e:
        if isinstance(e, GdsloadError):
            raise
        raise _write_failed(dst, e) from e

    logical = sum(leaf.nbytes for leaf in leaves)
    stored = app.offset - reserved
    report = CheckpointReport(
        path=str(dst),
        algorithm=codec or "none",
        writer=sink.name,
        tensors=len(leaves),
        compressed=len(comp),
        logical_bytes=logical,
        stored_bytes=stored,
        file_bytes=app.offset,
        compress_seconds=compress_s,
        write_seconds=write_s,
        total_seconds=time.perf_counter() - t_start,
    )
    log.info("%s", report.summary())
    return report


def _compress(
    leaf: Leaf,
    codec: str | None,
    staging: torch.device | None,
    zstd_on_gpu: bool,
    checksum: bool,
    min_gain: float,
    comp: dict[str, dict[str, Any]],
) -> np.ndarray:
    """A stream tensor's stored bytes: compressed when that gains ``min_gain`` (entry into ``comp``), else raw."""
    assert codec is not None
    t = leaf.tensor
    if codec_spec(codec).cpu_encode and t.is_cuda and not zstd_on_gpu:
        t = t.cpu()
    elif not codec_spec(codec).cpu_encode and not t.is_cuda:
        t = t.to(staging)
    entry, blob = encode_tensor(
        leaf.name,
        t,
        leaf.dtype,
        codec,
        params=default_params(codec, leaf.dtype),
        checksum=checksum,
        threads=_ZSTD_THREADS,
    )
    if blob.size <= (1 - min_gain) * leaf.nbytes:
        comp[leaf.name] = entry.to_json()
        return blob
    log.debug("%s: %s gains %.1f%% only; stored raw", leaf.where, codec, 100 * (1 - blob.size / leaf.nbytes))
    return _host_bytes(leaf.tensor)


# --------------------------------------------------------------------------- load


def _skeleton(header: SafetensorsHeader) -> dict[str, Any]:
    path = header.path
    raw = header.metadata.get(CHECKPOINT_KEY)
    if raw is None:
        raise CheckpointError(
            f"{path!r} is a safetensors file but not a gdsload training checkpoint (no __metadata__"
            f"[{CHECKPOINT_KEY!r}]); load its tensors with load_rank() or safetensors.torch.load_file()"
        )
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path!r}: __metadata__[{CHECKPOINT_KEY!r}] is not JSON ({e}); the file is corrupt"
        ) from None
    if not isinstance(doc, dict) or doc.get("version") != CHECKPOINT_VERSION:
        version = doc.get("version") if isinstance(doc, dict) else doc
        raise CheckpointError(
            f"{path!r}: checkpoint format version {version!r} is not {CHECKPOINT_VERSION}; upgrade gdsload"
        )
    tree, table = doc.get("tree"), doc.get("tensors")
    if not isinstance(tree, dict) or not isinstance(table, dict):
        raise CheckpointError(f"{path!r}: the checkpoint skeleton has no 'tree' or 'tensors'; the file is corrupt")
    for name, spec in table.items():
        ok = (
            isinstance(spec, dict)
            and isinstance(spec.get("dtype"), str)
            and spec["dtype"] in ITEMSIZE
            and isinstance(spec.get("shape"), list)
            and all(type(d) is int and d >= 0 for d in spec["shape"])
            and isinstance(spec.get("device"), str)
        )
        if not ok:
            raise CheckpointError(f"{path!r}: skeleton entry for tensor {name!r} is malformed: {spec!r:.200}")
    return doc


def _device_arg(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r} is not a torch device ({e}); use e.g. 'cpu' or 'cuda:0'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r}: checkpoints load to 'cpu' or 'cuda[:N]'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but this host has no CUDA device; use device='cpu'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _saved_device(saved: str, path: str, name: str) -> torch.device:
    try:
        dev = torch.device(saved)
    except RuntimeError:
        raise CheckpointError(
            f"{path!r}: tensor {name!r} has the device {saved!r} in the skeleton; the file is corrupt"
        ) from None
    if dev.type not in ("cpu", "cuda"):  # saving takes only these: anything else (meta: no data) is damage
        raise CheckpointError(
            f"{path!r}: tensor {name!r} has the device {saved!r} in the skeleton, which a save "
            "never writes; the file is corrupt"
        )
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = dev.index or 0
        if index >= count:
            raise CheckpointError(
                f"{path!r}: tensor {name!r} was saved from {saved!r} and this host has {count} CUDA device(s); "
                "pass device='cpu' or device='cuda:0' to choose where tensors go (like torch.load's map_location)"
            )
        dev = torch.device("cuda", index)
    return dev


def load_compressed_checkpoint(
    path: str | os.PathLike[str],
    device: str | torch.device | None = None,
    *,
    verify: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_compressed_checkpoint`.

    Returns ``{"model": state_dict | None, "optimizer": state_dict | None, "extras": dict}``,
    bit-identical to what was saved; every tensor owns its memory, as with ``torch.load``.
    ``device=None`` puts each tensor back on the device it was saved from (like ``torch.load``);
    a device puts them all there (like ``map_location``; CPU ``step`` counters then land there
    too, which optimizers accept). ANS and GDeflate decode on a GPU (for a CPU target, then
    copied over); Zstd decodes on the GPU for CUDA targets when nvCOMP is there, else on the
    CPU. ``verify`` checks the stored checksums while decoding.

    >>> ckpt = load_compressed_checkpoint("step-1000.safetensors", "cuda")  # doctest: +SKIP
    >>> model.load_state_dict(ckpt["model"]); opt.load_state_dict(ckpt["optimizer"])  # doctest: +SKIP
    >>> torch.set_rng_state(ckpt["extras"]["rng"])  # doctest: +SKIP
    """
    t_start = time.perf_counter()
    # One open for header and data: a trainer may replace the file meanwhile (saves rename into place).
    with open(path, "rb") as f:
        return _load_open(f, os.fspath(path), device, verify, t_start)


def _load_open(
    f: BinaryIO, path: str, device: str | torch.device | None, verify: bool, t_start: float
) -> dict[str, Any]:
    from ..pipeline.load import load_rank

    header = read_header(path, file=f)
    where = header.path
    doc = _skeleton(header)
    table: dict[str, dict[str, Any]] = doc["tensors"]
    stored = {t.name: t for t in header.tensors}
    for name in table:
        if name not in stored:
            raise CheckpointError(
                f"{where!r}: the skeleton names tensor {name!r}, which the file lacks; the file is corrupt"
            )
    dev = None if device is None else _device_arg(device)
    targets = {name: dev or _saved_device(spec["device"], where, name) for name, spec in table.items()}
    comp = parse_compression(header)
    gpu_ok = nvcomp_available() is None
    gpu_only = sorted({comp[n].codec for n in table if n in comp and not codec_spec(comp[n].codec).cpu_decode})
    if gpu_only and not gpu_ok:
        raise CodecError(
            f"{where!r} holds tensors compressed with {gpu_only}, which only a GPU decodes (nvCOMP), and here "
            f"{nvcomp_available()}; load it on a CUDA host, or save checkpoints with algorithm='Zstd' for CPU hosts"
        )

    # Each tensor gets memory of its own, of its final dtype and shape, and the load pipeline reads (or
    # decodes) straight into it. A tensor loads on its target device, except that ANS and GDeflate decode
    # on a GPU (then move to a CPU target) and Zstd decodes on the CPU where nvCOMP is missing.
    groups: dict[torch.device, dict[str, torch.Tensor]] = {}
    outs: dict[str, torch.Tensor] = {}
    for name, spec in table.items():
        target = targets[name]
        e = comp.get(name)
        load_on = target
        if e is not None and not codec_spec(e.codec).cpu_decode and target.type == "cpu":
            load_on = torch.device("cuda", torch.cuda.current_device())
        elif e is not None and target.type == "cuda" and not gpu_ok:
            load_on = torch.device("cpu")
        out = torch.empty(tuple(spec["shape"]), dtype=to_torch(spec["dtype"]), device=load_on)
        outs[name] = out
        t = stored[name]
        want = (e.dtype, tuple(e.shape)) if e is not None else (t.dtype, tuple(t.shape))
        if want == (spec["dtype"], tuple(spec["shape"])):
            groups.setdefault(load_on, {})[name] = out
        elif e is None and t.dtype == "U8" and len(t.shape) == 1 and t.nbytes == out.numel() * out.element_size():
            groups.setdefault(load_on, {})[name] = out.reshape(-1).view(torch.uint8)  # a raw stream entry
        else:
            raise CheckpointError(
                f"{where!r}: tensor {name!r} is stored as {want[0]}{list(want[1])} but the skeleton says "
                f"{spec['dtype']}{list(spec['shape'])}; the file is corrupt"
            )
    opened = {str(Path(where).resolve()): f.fileno()}  # the data comes from the file whose header was read
    for load_on, into in groups.items():
        result = load_rank(where, device=load_on, into=into, only=set(into), verify=verify, opened=opened)
        result.close()
    tensors = {name: out if out.device == targets[name] else out.to(targets[name]) for name, out in outs.items()}
    for d in {t.device for t in tensors.values() if t.device.type == "cuda"}:
        torch.cuda.synchronize(d)
    rebuild = Rebuilder(tensors, where)
    tree = doc["tree"]
    out = {
        "model": rebuild.build(tree.get("model"), "model"),
        "optimizer": rebuild.build(tree.get("optimizer"), "optimizer"),
        "extras": rebuild.build(tree.get("extras"), "extras") or {},
    }
    seconds = time.perf_counter() - t_start
    logical = sum(math.prod(s["shape"]) * ITEMSIZE[s["dtype"]] for s in table.values())
    log.info(
        "checkpoint %r: %s loaded in %.3f s (%.2f GB/s), %d tensors",
        where,
        format_bytes(logical),
        seconds,
        logical / seconds / 1e9 if seconds > 0 else 0.0,
        len(tensors),
    )
    return out
