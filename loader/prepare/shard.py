"""``gdsload shard``: pre-shard a Hugging Face Llama-family checkpoint by tensor-parallel rank.

Two steps: :func:`plan_shard` reads config.json and every safetensors header, checks them
against the model's expected tensors and the TP size, and lays out every output file — without
reading any tensor data. :func:`execute_plan` then streams: each output tensor is built from
bounded row chunks of its source slices (each chunk read through a fresh ``safe_open``, so at
most one chunk of the source is ever mapped), optionally quantized to FP8, and handed to the
file writer. Peak memory is about the largest *output* tensor plus a few chunk-sized buffers,
whatever the model size.

Output (``OUT``): ``model-rank-{r}-part-{p}.safetensors`` (aligned, see :mod:`.format`), the
config/tokenizer/generation files (config.json gains a ``quantization_config`` with FP8), and
``gdsload.json`` written last, recording the sharding plan.

Atomicity and restarts — *resumable*: files are written (temp file, fsync, rename) into
``OUT/.gdsload-shard.partial/`` next to a ``state.json`` fingerprint of the command (source
files, sizes, mtimes, config and options). Only at the end are they moved into ``OUT`` and the
manifest written; ``OUT`` loads only once the partial directory is gone (one rename, after the
manifest), so a run stopped at any point leaves nothing that loads. After a kill (SIGKILL, Ctrl-C) rerunning the same command skips every
complete file (validated by header and fingerprint) and writes the rest; an error (bad input,
full disk) removes everything this run created. ``OUT`` must be empty, absent, a partial run of
the same command, or its finished output (then nothing is done).

>>> result = shard_checkpoint("/models/Llama-3-8B", "/models/llama3-tp2", tp=2)  # doctest: +SKIP
>>> print(result.summary())
sharded -> '/models/llama3-tp2': tp=2 layout=vllm, 4 files, 16.06 GB in 41.2 s
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from safetensors import SafetensorError

from gdsload.loader.config import format_bytes
from gdsload.loader.dtypes import ITEMSIZE, to_torch
from gdsload.loader.errors import ConfigError, FormatError, GdsloadError, ManifestError
from gdsload.loader.format.safetensors import AlignedWriter, TensorInfo, TensorSpec, atomic_output, read_header
from gdsload.loader.format.manifest import MANIFEST_NAME, Manifest, redigest, write_manifest
from gdsload.loader.prepare.quantize import QuantScheme, compute_scale, quantization_config, quantize_into
from gdsload.loader.prepare.shard_rules import (
    LAYOUTS,
    SourceCheckpointError,
    ModelSpec,
    OutTensor,
    ShardConfigError,
    UnsupportedModelError,
    check_tp,
    expected_tensors,
    padded_vocab,
    rank_tensors,
)

__all__ = [
    "ShardOptions",
    "ShardPlan",
    "PlannedFile",
    "ShardResult",
    "TensorFileWriter",
    "WriterFactory",
    "plan_shard",
    "execute_plan",
    "file_metadata",
    "FilesWriter",
    "shard_checkpoint",
    "SourceNotFoundError",
    "UnsupportedSourceError",
    "OutputExistsError",
    "ShardWriteError",
    "SourceReadError",
    "UnsupportedModelError",
    "ShardConfigError",
    "SourceCheckpointError",
    "PARTIAL_DIR",
    "FILE_PATTERN",
]

if TYPE_CHECKING:  # torch is imported where tensors are built: planning, and sharding on a GPU, need none of it
    import torch

log = logging.getLogger(__name__)
_T = TypeVar("_T")

FILE_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
"""Output file names: vLLM's ``sharded_state`` pattern, so vLLM finds them too."""

PARTIAL_DIR = ".gdsload-shard.partial"
"""Where an unfinished run keeps its complete files and its ``state.json`` (inside OUT). While it is there,
OUT does not load (:data:`gdsload.loader.format.discovery.UNFINISHED_MARKERS`)."""
FINISHED_DIR = ".gdsload-shard.finished"
"""The partial directory after the run: renamed in one step (OUT becomes loadable), then removed."""

_STATE = "state.json"
_FORMAT_VERSION = 1
_CHUNK_BYTES = 32 << 20
_SOURCE_DTYPES = ("BF16", "F16", "F32")
_IGNORED_SOURCE = ("*.rotary_emb.inv_freq",)
"""Source tensors vLLM skips too (buffers some old checkpoints carry)."""
_COPIED_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
    "chat_template.json", "*.tiktoken", "LICENSE*", "USE_POLICY.md", "NOTICE*",
)
"""Besides config.json (rewritten), these SRC files are copied to OUT."""
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf", ".h5", ".msgpack")


class SourceNotFoundError(GdsloadError, FileNotFoundError):
    """SRC, its config.json, or a shard file its index lists does not exist."""


class UnsupportedSourceError(GdsloadError, ValueError):
    """SRC holds weights in a format other than safetensors (pickle ``.bin``, GGUF, ...)."""


class OutputExistsError(GdsloadError, FileExistsError):
    """OUT holds something other than an unfinished or finished run of the same command."""


class ShardWriteError(GdsloadError, OSError):
    """Writing OUT failed (no space left, permissions, I/O error); nothing partial is left behind."""


class SourceReadError(GdsloadError, OSError):
    """A source file became unreadable (or changed) after planning."""


@dataclass(frozen=True)
class ShardOptions:
    """What ``gdsload shard`` produces."""

    tp: int
    """Tensor-parallel size: one set of files per rank 0..tp-1."""
    layout: str = "vllm"
    """``vllm``: vLLM's fused per-rank parameters (``qkv_proj``, ``gate_up_proj``); ``hf``: HF names, per-rank slices."""
    quantize: str | None = None
    """None, or ``fp8`` / ``fp8:per-tensor`` / ``fp8:per-channel`` for the linear-layer weights."""
    max_file_bytes: int = 5 << 30
    """Start a new part file before one would exceed this (a single larger tensor gets its own file)."""
    digest: bool | str = True
    """Record each file's digest in gdsload.json (computed as the files are written): True or ``"blake3"``,
    ``"sha256"``, or False for none."""
    compress: str | None = None
    """The codec the files end up compressed with (``gdsload shard --compress``), or None. Part of the
    command, so a run with it never resumes from one without; the compressing itself is done by the
    caller (a :class:`FilesWriter` that compresses, or :func:`~gdsload.loader.prepare.compress.compress_dir`
    on the output)."""

    def __post_init__(self) -> None:
        if type(self.tp) is not int or self.tp < 1:
            raise ConfigError(f"tp={self.tp!r} must be a positive integer")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout={self.layout!r} is not known; choose one of {', '.join(LAYOUTS)}")
        if self.quantize is not None:
            QuantScheme.parse(self.quantize)
        if type(self.max_file_bytes) is not int or self.max_file_bytes < 1:
            raise ConfigError(f"max_file_bytes={self.max_file_bytes!r} must be a positive number of bytes")
        from gdsload.loader.format.digests import require

        require(self.digest)  # a ConfigError naming the choices, or the package to install, before any file
        if self.compress is not None:
            from gdsload.loader.codecs.registry import codec_names

            if self.compress not in codec_names():
                raise ConfigError(f"compress={self.compress!r} is not one of {', '.join(codec_names())}")

    @property
    def scheme(self) -> QuantScheme | None:
        return QuantScheme.parse(self.quantize) if self.quantize is not None else None

    def describe(self) -> dict[str, Any]:
        scheme = self.scheme
        described: dict[str, Any] = {"tp": self.tp, "layout": self.layout,
                                     "quantize": str(scheme) if scheme else None, "max_file_bytes": self.max_file_bytes}
        if self.compress is not None:  # absent otherwise: the fingerprint of an uncompressed sharding is unchanged
            described["compress"] = self.compress
        return described


class TensorFileWriter(Protocol):
    """What :func:`execute_plan` writes one file through (:class:`~.format.AlignedWriter` by default).

    ``order`` is the sequence in which ``write`` must be called. A writer that transforms each
    tensor before storing it (a compressor) implements this same interface.
    """

    order: list[TensorSpec]

    def __enter__(self) -> TensorFileWriter: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any: ...

    def write(self, name: str, tensor: torch.Tensor) -> None: ...


WriterFactory = Callable[[Path, Sequence[TensorSpec], Mapping[str, str]], TensorFileWriter]


class FilesWriter(Protocol):
    """Writes a plan's files all at once, instead of tensor by tensor through torch (e.g. built and
    compressed on a GPU: :class:`gdsload.loader.prepare.gpu_shard.GpuShardWriter`)."""

    def write(self, todo: Sequence[tuple[PlannedFile, Path]], progress: Callable[[int], None] | None) -> dict[str, str]:
        """Write each planned file at its path (atomically, with :func:`file_metadata`); returns the
        ``"<algorithm>:<hex>"`` of those hashed on the way, by relpath. ``progress`` gets logical bytes."""
        ...

    def manifest_extra(self, paths: Sequence[Path]) -> dict[str, Any]:
        """What gdsload.json records beyond the plan, given every file of the output."""
        ...


# --------------------------------------------------------------------------- the source


@dataclass(frozen=True)
class _Located:
    path: str
    info: TensorInfo


class _Source:
    """A Hugging Face checkpoint directory: config.json plus safetensors files, read lazily."""

    def __init__(self, root: Path):
        self.root = root
        if not root.is_dir():
            what = "is a file, not a model directory" if root.exists() else "does not exist"
            raise SourceNotFoundError(f"source {str(root)!r} {what}; pass the directory holding config.json and *.safetensors")
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise SourceNotFoundError(
                f"{str(root)!r} has no config.json; gdsload shard needs the Hugging Face model directory "
                "(config.json, *.safetensors, tokenizer files)"
            )
        self.config_bytes = cfg_path.read_bytes()
        try:
            self.config: dict[str, Any] = json.loads(self.config_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UnsupportedModelError(f"{str(cfg_path)!r} is not valid JSON ({e})") from None
        if not isinstance(self.config, dict):
            raise UnsupportedModelError(f"{str(cfg_path)!r} must hold a JSON object")
        self.files = sorted(p for p in root.iterdir() if p.suffix == ".safetensors" and p.is_file()
                            and not p.name.startswith("."))
        if not self.files:
            pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
            if pickles:
                raise UnsupportedSourceError(
                    f"{str(root)!r} holds weights as {', '.join(map(repr, pickles[:3]))}, not safetensors; "
                    "gdsload shard reads only safetensors (it never unpickles). Convert first, e.g. "
                    "`AutoModelForCausalLM.from_pretrained(SRC).save_pretrained(DST, safe_serialization=True)`"
                )
            raise SourceNotFoundError(f"no *.safetensors files under {str(root)!r}")
        indexed = self._check_index()
        if indexed is not None:  # the index names the weights; other files (e.g. Mistral's consolidated.safetensors) are not
            self.files = [p for p in self.files if p.name in indexed]
        self.tensors: dict[str, _Located] = {}
        for path in self.files:
            for info in read_header(path).tensors:
                if info.name in self.tensors:
                    raise SourceCheckpointError(
                        f"tensor {info.name!r} is in both {self.tensors[info.name].path!r} and {str(path)!r}; "
                        "remove the stray file from the source directory"
                    )
                self.tensors[info.name] = _Located(str(path), info)

    def _check_index(self) -> set[str] | None:
        """The file names ``model.safetensors.index.json`` maps tensors to (None without an index)."""
        index = self.root / "model.safetensors.index.json"
        if not index.is_file():
            return None
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise SourceCheckpointError(f"{str(index)!r} is not a valid safetensors index ({e!r})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v and "/" not in v for k, v in weight_map.items()):
            raise SourceCheckpointError(
                f"{str(index)!r}: 'weight_map' must map tensor names to file names in the same directory; "
                "the index is damaged — fetch it again"
            )
        for name, fname in weight_map.items():
            if not (self.root / fname).is_file():
                raise SourceNotFoundError(
                    f"{str(index)!r} maps tensor {name!r} to {fname!r}, but that file is missing from "
                    f"{str(self.root)!r}; the download is incomplete — fetch the missing shard"
                )
        return set(weight_map.values())

    def fingerprint_parts(self) -> dict[str, Any]:
        files = []
        for p in self.files:
            st = p.stat()
            files.append([p.name, st.st_size, st.st_mtime_ns])
        return {"config_sha256": hashlib.sha256(self.config_bytes).hexdigest(), "files": files}

    # ---- reading

    def dtype(self, name: str) -> str:
        return self.tensors[name].info.dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].info.shape

    def _row_chunks(self, name: str, rows: int) -> Iterator[tuple[int, int]]:
        shape = self.shape(name)
        row_bytes = max(1, math.prod(shape[1:]) * ITEMSIZE[self.dtype(name)])
        step = max(1, _CHUNK_BYTES // row_bytes)
        for i in range(0, rows, step):
            yield i, min(rows, i + step)

    def _with_chunk(self, name: str, r0: int, r1: int, cols: tuple[int, int] | None,
                    fn: Callable[[torch.Tensor], _T]) -> _T:
        """``fn(view)`` on source rows ``[r0, r1)`` (and columns ``cols``). The view lives on a
        mapping opened for this call only, dropped when it returns: the process never holds
        more than one chunk of a source file mapped (``fn`` must not return the view)."""
        from safetensors import safe_open

        with safe_open(self.tensors[name].path, framework="pt") as f:
            sl = f.get_slice(name)
            view = sl[r0:r1] if cols is None else sl[r0:r1, cols[0] : cols[1]]
            try:
                return fn(view)
            finally:
                del view, sl

    def read_into(
        self,
        dst: torch.Tensor,
        name: str,
        dim: int | None,
        start: int,
        stop: int,
        store: Callable[[torch.Tensor, torch.Tensor, int, int], None] | None = None,
    ) -> None:
        """Copy rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of source ``name`` into
        ``dst``, chunk by chunk. ``store(dst_rows, chunk, row0, row1)`` replaces the plain copy
        (source row numbers given), e.g. to quantize on the way."""
        shape = self.shape(name)
        if dim == 0 or dim is None or len(shape) == 1:
            lo, hi = (start, stop) if dim == 0 else (0, shape[0])
            cols = None
        else:
            lo, hi, cols = 0, shape[0], (start, stop)
        for i, j in self._row_chunks(name, hi - lo):
            rows = dst.narrow(0, i, j - i)
            if store is None:
                self._with_chunk(name, lo + i, lo + j, cols, rows.copy_)
            else:
                self._with_chunk(name, lo + i, lo + j, cols,
                                 lambda v, r0=lo + i, r1=lo + j: store(rows, v, r0, r1))

    def amax(self, name: str, per_row: bool) -> torch.Tensor:
        """Absolute maximum of the whole tensor (0-d) or of each row ([rows]), in fp32.

        Uses ``aminmax`` (a reduction: no temporary the size of the chunk)."""

        import torch

        def chunk_amax(v: torch.Tensor) -> torch.Tensor:
            lo, hi = v.aminmax(dim=1) if per_row and v.dim() == 2 else v.aminmax()
            return torch.maximum(hi.float(), lo.float().neg()).reshape(-1)

        parts = [self._with_chunk(name, i, j, None, chunk_amax) for i, j in self._row_chunks(name, self.shape(name)[0])]
        joined = torch.cat(parts)
        return joined if per_row else joined.max()


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class PlannedFile:
    """One output file: its rank, part, name and the tensors it holds (model order)."""

    rank: int
    part: int
    relpath: str
    tensors: tuple[OutTensor, ...]
    specs: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


@dataclass
class ShardPlan:
    """Everything :func:`execute_plan` needs; built by :func:`plan_shard` without reading tensor data."""

    source: Path
    options: ShardOptions
    spec: ModelSpec
    files: list[PlannedFile]
    fingerprint: str
    _src: _Source = field(repr=False)

    @property
    def total_bytes(self) -> int:
        """Logical bytes of every output tensor, summed over ranks (the progress total)."""
        return sum(f.nbytes for f in self.files)

    @property
    def ranks(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for f in self.files:
            out.setdefault(f.rank, []).append(f.relpath)
        return out

    def aux_files(self) -> list[str]:
        """Names of the non-weight files OUT gets (config.json first)."""
        names = ["config.json"]
        for p in sorted(self.source.iterdir()):
            if p.is_file() and p.name != "config.json" and any(fnmatch.fnmatch(p.name, g) for g in _COPIED_FILES):
                names.append(p.name)
        return names

    def output_config(self) -> dict[str, Any]:
        config = dict(self._src.config)
        scheme = self.options.scheme
        if scheme is not None:
            config["quantization_config"] = quantization_config(scheme, ignored=["lm_head"])
        return config

    def manifest_extra(self) -> dict[str, Any]:
        """The ``shard`` block of gdsload.json: command, model facts and the per-tensor plan."""
        s = self.spec
        tensors: dict[str, Any] = {}
        for f in self.files:
            for t in f.tensors:
                entry = tensors.get(t.name)
                if entry is None:
                    entry = tensors[t.name] = {"op": t.op, "split": t.split, "dim": t.dim,
                                               "sources": list(t.sources), "ranks": [], "pad": []}
                    if t.scale_of:
                        entry["scale_of"] = t.scale_of
                    if t.op == "fill":
                        entry["fill"] = t.fill
                    if t.meta:
                        entry.update(t.meta)
                index = {src: k for k, src in enumerate(entry["sources"])}
                entry["ranks"].append([[index[p.source], p.start, p.stop] for p in t.pieces])
                entry["pad"].append(t.pad)
        for entry in tensors.values():
            if not any(entry["pad"]):
                del entry["pad"]
        return {
            "shard": {
                "format_version": _FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "source": str(self.source),
                "architecture": s.architecture,
                **self.options.describe(),
                "vocab_size": s.vocab,
                "padded_vocab_size": padded_vocab(s.vocab),
                "num_attention_heads": s.heads,
                "num_key_value_heads": s.kv_heads,
                "kv_head_replicas": max(1, self.options.tp // s.kv_heads),
                "tie_word_embeddings": s.tie_embeddings,
                "tensors": tensors,
            }
        }


def _check_source(src: _Source, spec: ModelSpec, where: str) -> None:
    expected = expected_tensors(spec)
    have = set(src.tensors)
    missing = [n for n in expected if n not in have]
    if missing:
        loc = f"{len(missing)} tensor{'s' if len(missing) > 1 else ''} ({', '.join(map(repr, missing[:4]))}" + \
              (", ..." if len(missing) > 4 else "") + ")"
        raise SourceCheckpointError(
            f"{str(src.root)!r} lacks {loc} that {where!r} implies ({spec.architecture}, "
            f"{spec.layers} layers, tie_word_embeddings={spec.tie_embeddings}); the checkpoint is incomplete "
            "or config.json does not belong to it"
        )
    ignorable = {"lm_head.weight"} if spec.tie_embeddings else set()
    extra = sorted(n for n in have - set(expected)
                   if n not in ignorable and not any(fnmatch.fnmatch(n, g) for g in _IGNORED_SOURCE))
    if extra:
        raise SourceCheckpointError(
            f"{str(src.root)!r} holds {len(extra)} tensor(s) a {spec.architecture} with this config.json does not have, "
            f"e.g. {extra[0]!r} in {src.tensors[extra[0]].path!r}; is config.json the right one for these weights?"
        )
    for name, shape in expected.items():
        loc = src.tensors[name]
        if loc.info.shape != shape:
            raise SourceCheckpointError(
                f"{loc.path!r}: tensor {name!r} has shape {list(loc.info.shape)}, but {where!r} implies {list(shape)} "
                f"(hidden_size={spec.hidden}, heads={spec.heads}, kv_heads={spec.kv_heads}, head_dim={spec.head_dim}, "
                f"intermediate_size={spec.intermediate}, vocab_size={spec.vocab}); config.json does not match the weights"
            )
        if loc.info.dtype not in _SOURCE_DTYPES:
            raise SourceCheckpointError(
                f"{loc.path!r}: tensor {name!r} has dtype {loc.info.dtype}; gdsload shard takes unquantized "
                f"{'/'.join(_SOURCE_DTYPES)} weights"
            )


def _out_dtype(t: OutTensor, src: _Source) -> str:
    if t.op == "fp8":
        return "F8_E4M3"
    if t.op == "fp8_scale":
        return "F32"
    if t.op == "fill":
        # None: the model's dtype, which vLLM takes as its default dtype while it builds the model.
        return t.dtype or src.dtype("model.embed_tokens.weight")
    dtypes = {src.dtype(p.source) for p in t.pieces}
    if len(dtypes) > 1:
        raise SourceCheckpointError(
            f"output tensor {t.name!r} fuses sources of different dtypes {sorted(dtypes)} "
            f"({', '.join(t.sources)}); re-save the checkpoint in one dtype"
        )
    return dtypes.pop()


def plan_shard(src: str | os.PathLike[str], options: ShardOptions) -> ShardPlan:
    """Validate ``src`` against ``options`` and lay out every output file; reads only headers.

    Raises :class:`UnsupportedModelError`, :class:`ShardConfigError`, :class:`SourceCheckpointError`,
    :class:`SourceNotFoundError` or :class:`UnsupportedSourceError` naming the file and the fix.

    >>> plan = plan_shard("/models/Llama-3-8B", ShardOptions(tp=4, quantize="fp8"))  # doctest: +SKIP
    >>> plan.ranks[3]
    ['model-rank-3-part-0.safetensors']
    """
    source = _Source(Path(src).resolve())
    where = str(source.root / "config.json")
    spec = ModelSpec.from_config(source.config, where=where)
    check_tp(spec, options.tp, where=where)
    _check_source(source, spec, where)
    fp = hashlib.sha256(json.dumps(
        {"version": _FORMAT_VERSION, "source": str(source.root), **source.fingerprint_parts(), **options.describe()},
        sort_keys=True).encode()).hexdigest()
    files: list[PlannedFile] = []
    for rank in range(options.tp):
        groups: list[list[tuple[OutTensor, TensorSpec]]] = [[]]
        size = 0
        for t in rank_tensors(spec, options.tp, rank, options.layout, options.scheme):
            ts = TensorSpec(t.name, _out_dtype(t, source), t.shape)
            if groups[-1] and size + ts.nbytes > options.max_file_bytes:
                groups.append([])
                size = 0
            groups[-1].append((t, ts))
            size += ts.nbytes
        for part, group in enumerate(groups):
            files.append(PlannedFile(rank, part, FILE_PATTERN.format(rank=rank, part=part),
                                     tuple(t for t, _ in group), tuple(s for _, s in group)))
    return ShardPlan(source=source.root, options=options, spec=spec, files=files, fingerprint=fp, _src=source)


# --------------------------------------------------------------------------- building tensors


class _Builder:
    """Builds output tensors from the source; FP8 scales are computed once per source tensor."""

    def __init__(self, src: _Source, scheme: QuantScheme | None):
        import torch

        self.src = src
        self.scheme = scheme
        self._scales: dict[str, torch.Tensor] = {}
        self._work = torch.empty(0, dtype=torch.float32)

    def _quantize_store(self, scale: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor, int, int], None]:
        import torch

        def store(dst: torch.Tensor, chunk: torch.Tensor, r0: int, r1: int) -> None:
            if self._work.numel() < chunk.numel():
                self._work = torch.empty(chunk.numel(), dtype=torch.float32)
            quantize_into(dst, chunk, scale if scale.dim() == 0 else scale[r0:r1], self._work)

        return store

    def scale(self, source: str) -> torch.Tensor:
        """fp32 scale of a whole source weight: 0-d, or [rows, 1] per channel."""
        import torch

        assert self.scheme is not None
        if source not in self._scales:
            amax = self.src.amax(source, self.scheme.per_channel)
            if not bool(torch.isfinite(amax).all()):
                raise SourceCheckpointError(
                    f"tensor {source!r} in {self.src.tensors[source].path!r} holds inf or NaN values; fp8 scales "
                    "from it would zero every other weight. Fix the source weights, or shard without --quantize"
                )
            self._scales[source] = compute_scale(amax, self.scheme)
        return self._scales[source]

    def build(self, t: OutTensor, spec: TensorSpec) -> torch.Tensor:
        import torch

        dtype = to_torch(spec.dtype)
        if t.op == "fill":
            return torch.full(t.shape, t.fill, dtype=dtype)
        if t.op == "fp8_scale":
            return self._scale_tensor(t)
        out = torch.empty(t.shape, dtype=dtype)
        if t.pad:
            out.narrow(0, out.shape[0] - t.pad, t.pad).zero_()
        offset = 0
        for p in t.pieces:
            dst = out if t.dim is None else out.narrow(t.dim, offset, p.length)
            store = self._quantize_store(self.scale(p.source)) if t.op == "fp8" else None
            self.src.read_into(dst, p.source, t.dim, p.start, p.stop, store)
            offset += p.length
        return out

    def _scale_tensor(self, t: OutTensor) -> torch.Tensor:
        import torch

        scales = [self.scale(p.source) for p in t.pieces]
        if not self.scheme or not self.scheme.per_channel:
            stacked = torch.stack(scales)
            return stacked.reshape(t.shape)
        rows = [s[p.start : p.stop] if t.dim == 0 else s for s, p in zip(scales, t.pieces)]
        return torch.cat(rows).reshape(t.shape)


# --------------------------------------------------------------------------- output directory


@dataclass
class ShardResult:
    """What a run did."""

    out: str
    tp: int
    layout: str
    quantize: str | None
    files: dict[int, list[str]]
    total_bytes: int
    written_bytes: int
    resumed_files: int
    seconds: float
    already_complete: bool = False

    def summary(self) -> str:
        """One line, e.g. ``sharded -> '/models/llama3-tp2': tp=2 layout=vllm, 2 files, 16.06 GB in 41.2 s``."""
        n = sum(len(v) for v in self.files.values())
        q = f" quantize={self.quantize}" if self.quantize else ""
        if self.already_complete:
            return f"{self.out!r} already holds this sharding (tp={self.tp} layout={self.layout}{q}); nothing to do"
        extra = f" (resumed: {self.resumed_files} file(s) kept from an interrupted run)" if self.resumed_files else ""
        return (f"sharded -> {self.out!r}: tp={self.tp} layout={self.layout}{q}, {n} files, "
                f"{format_bytes(self.total_bytes)} in {self.seconds:.1f} s{extra}")


def file_metadata(plan: ShardPlan, f: PlannedFile) -> dict[str, str]:
    """The ``__metadata__`` of a planned file: what marks it as this plan's (see :func:`_is_complete`)."""
    return {"format": "pt", "gdsload.fingerprint": plan.fingerprint, "gdsload.rank": str(f.rank),
            "gdsload.part": str(f.part), "gdsload.layout": plan.options.layout}


def _is_complete(path: Path, plan: ShardPlan, f: PlannedFile) -> bool:
    """True when ``path`` is a whole file of this exact plan (valid header, size, names, fingerprint)."""
    if not path.is_file():
        return False
    try:
        header = read_header(path)
    except (FormatError, OSError) as e:
        log.info("rewriting %s: %s", path, e)
        return False
    meta = header.metadata
    if meta.get("gdsload.fingerprint") != plan.fingerprint or meta.get("gdsload.rank") != str(f.rank) \
            or meta.get("gdsload.part") != str(f.part):
        return False
    return {t.name for t in header.tensors} == {s.name for s in f.specs}


def _read_state(partial: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((partial / _STATE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    keys = ("source", "tp", "layout", "quantize", "max_file_bytes", "compress")
    diffs = [f"{k}={old.get(k)!r} (now {new.get(k)!r})" for k in keys if old.get(k) != new.get(k)]
    return ", ".join(diffs) or "the source files changed since (sizes or modification times differ)"


def _prepare_out(out: Path, plan: ShardPlan) -> tuple[bool, bool]:
    """Check OUT may receive this plan; returns ``(created_out, already_complete)``."""
    state_now = {"fingerprint": plan.fingerprint, "source": str(plan.source), **plan.options.describe()}
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"output {str(out)!r} is a file; give a directory path for OUT")
    if not out.exists():
        out.mkdir(parents=True)
        return True, False
    entries = {p.name for p in out.iterdir()}
    if MANIFEST_NAME in entries:
        try:
            shard = Manifest.read(out).extra.get("shard", {})
        except ManifestError:
            shard = {}
        if shard.get("fingerprint") == plan.fingerprint:
            damaged = [f.relpath for f in plan.files if not _is_complete(out / f.relpath, plan, f)]
            if not damaged:
                return False, True
            raise OutputExistsError(
                f"{str(out)!r} holds this command's output, but {', '.join(map(repr, damaged[:3]))} "
                "is missing or damaged; delete the directory and rerun"
            )
        made_by = _differences(shard, state_now) if shard else "it was not written by `gdsload shard`"
        raise OutputExistsError(
            f"{str(out)!r} already holds a sharded checkpoint ({MANIFEST_NAME}) that differs from this command: "
            f"{made_by}; choose another OUT or delete it first"
        )
    ours = {f.relpath for f in plan.files} | set(plan.aux_files()) | {PARTIAL_DIR, FINISHED_DIR}
    partial = out / PARTIAL_DIR
    if PARTIAL_DIR in entries:
        state = _read_state(partial)
        if state is None and not any(partial.glob("*.safetensors")):
            state = state_now  # killed before it wrote its state: nothing to keep, take it over
        if state is None or state.get("fingerprint") != plan.fingerprint:
            why = _differences(state, state_now) if state else "its state.json is unreadable"
            raise OutputExistsError(
                f"{str(out)!r} holds an unfinished `gdsload shard` run of a different command: {why}. "
                f"Rerun that command to finish it, or delete {str(out)!r} (or its {PARTIAL_DIR}/) to start over"
            )
        # A run killed while it wrote its manifest leaves the manifest's temporary file: ours, remove it.
        for stale in [*out.glob(f".{MANIFEST_NAME}.tmp-*"), *out.glob(f".{MANIFEST_NAME}.tmp.creating-*")]:
            stale.unlink(missing_ok=True)
            entries.discard(stale.name)
        stray = sorted(entries - ours)
    else:
        stray = sorted(entries - {FINISHED_DIR})
    if stray:
        raise OutputExistsError(
            f"output directory {str(out)!r} is not empty (holds {', '.join(map(repr, stray[:4]))}"
            f"{', ...' if len(stray) > 4 else ''}) and is not an unfinished run of this command; "
            "choose an empty or new directory, or delete its contents"
        )
    return False, False


@contextmanager
def _locked(partial: Path) -> Iterator[None]:
    fd = os.open(partial / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputExistsError(
                f"another `gdsload shard` is writing {str(partial.parent)!r} right now; wait for it or pick another OUT"
            ) from None
        yield
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(e: OSError, path: Path, what: str) -> ShardWriteError:
    code = e.errno if e.errno is not None else errno.EIO
    reason = e.strerror or str(e)
    fix = ("free space on that filesystem or choose an OUT with room" if code in (errno.ENOSPC, errno.EDQUOT)
           else "check the directory's permissions and the filesystem")
    err = ShardWriteError(code, f"writing {str(path)!r} ({what}) failed: {reason} [errno {code}]; "
                                f"nothing partial was kept — {fix}, then rerun")
    err.filename = str(path)
    return err


def _remove_outputs(out: Path, plan: ShardPlan, created: bool) -> None:
    """Undo this run: the partial directory, files moved into OUT, OUT itself if we made it."""
    shutil.rmtree(out / PARTIAL_DIR, ignore_errors=True)
    shutil.rmtree(out / FINISHED_DIR, ignore_errors=True)
    for name in [f.relpath for f in plan.files] + plan.aux_files() + [MANIFEST_NAME]:
        (out / name).unlink(missing_ok=True)
    for stale in [*out.glob(f".{MANIFEST_NAME}.tmp-*"), *out.glob(f".{MANIFEST_NAME}.tmp.creating-*")]:
        stale.unlink(missing_ok=True)
    if created:
        try:
            out.rmdir()
        except OSError:
            pass


def execute_plan(
    plan: ShardPlan,
    out: str | os.PathLike[str],
    *,
    progress: Callable[[int], None] | None = None,
    writer_factory: WriterFactory = AlignedWriter,
    files_writer: FilesWriter | None = None,
) -> ShardResult:
    """Write ``plan`` into ``out`` (see the module docstring for atomicity and resuming).

    ``progress`` is called with the byte count of each tensor written (and of each file kept
    from an interrupted run). ``writer_factory(path, specs, metadata)`` opens one output file;
    swap it to transform tensors on their way to disk. ``files_writer`` replaces both the tensor
    building and the writer: it gets every file still to write at once.

    >>> plan = plan_shard("/models/Llama-3-8B", ShardOptions(tp=2))  # doctest: +SKIP
    >>> execute_plan(plan, "/models/llama3-tp2", progress=bar.advance).summary()
    """
    t0 = time.perf_counter()
    out = Path(out).resolve()
    created, complete = _prepare_out(out, plan)
    result = ShardResult(out=str(out), tp=plan.options.tp, layout=plan.options.layout,
                         quantize=str(plan.options.scheme) if plan.options.scheme else None,
                         files=plan.ranks, total_bytes=plan.total_bytes, written_bytes=0, resumed_files=0,
                         seconds=0.0, already_complete=complete)
    if complete:
        if (out / PARTIAL_DIR).exists():  # killed after its manifest, before its last rename
            _publish(out, out / PARTIAL_DIR)
        shutil.rmtree(out / FINISHED_DIR, ignore_errors=True)
        if redigest(out, plan.options.digest):  # the same files, the digests this run asks for
            log.info("%s: the manifest's digests rewritten (%s)", out, plan.options.digest)
        log.info("%s", result.summary())
        return result
    partial = out / PARTIAL_DIR
    partial.mkdir(exist_ok=True)
    with _locked(partial):
        try:
            _run(plan, out, partial, result, progress, writer_factory, files_writer)
        except (KeyboardInterrupt, SystemExit):
            log.warning("interrupted: complete files are kept in %s; rerun the same command to resume", partial)
            raise
        except BaseException as e:
            _remove_outputs(out, plan, created)
            if isinstance(e, OSError) and not isinstance(e, GdsloadError):
                raise _write_error(e, Path(e.filename or out), "the output") from e
            raise
    result.seconds = time.perf_counter() - t0
    log.info("%s", result.summary())
    return result


def _run(
    plan: ShardPlan,
    out: Path,
    partial: Path,
    result: ShardResult,
    progress: Callable[[int], None] | None,
    writer_factory: WriterFactory,
    files_writer: FilesWriter | None,
) -> None:
    state = {"fingerprint": plan.fingerprint, "source": str(plan.source), **plan.options.describe()}
    try:
        with atomic_output(partial / _STATE) as fh:
            fh.write(json.dumps(state, indent=2).encode())
    except OSError as e:
        raise _write_error(e, partial / _STATE, "the run's state file") from e
    for stale in partial.glob(".*.tmp-*"):
        log.info("removing %s left by an interrupted run", stale)
        stale.unlink()
    todo: list[tuple[PlannedFile, Path]] = []
    for f in plan.files:
        staged, final = partial / f.relpath, out / f.relpath
        if _is_complete(staged, plan, f) or _is_complete(final, plan, f):
            result.resumed_files += 1
            log.info("keeping %s from an interrupted run", f.relpath)
            if progress is not None:
                progress(f.nbytes)
            continue
        todo.append((f, staged))
    # Files written by this run -> the digest computed as they were written; files kept from a run before
    # are read to hash.
    if files_writer is not None:
        try:
            digests = files_writer.write(todo, progress)
        except OSError as e:
            if isinstance(e, GdsloadError):
                raise
            raise _write_error(e, Path(e.filename or partial), "the output") from e
        result.written_bytes += sum(f.nbytes for f, _ in todo)
    else:
        digests = {}
        builder = _Builder(plan._src, plan.options.scheme)
        if writer_factory is AlignedWriter and plan.options.digest is not True:
            writer_factory = functools.partial(AlignedWriter, digest=plan.options.digest)
        for f, staged in todo:
            digest = _write_file(staged, plan, f, builder, result, progress, writer_factory)
            if digest is not None:
                digests[f.relpath] = digest
    _stage_aux(plan, partial)
    # While the partial directory is in OUT, OUT does not load (discovery refuses it): the files move in
    # one by one and the manifest comes last, then the partial directory goes in one rename.
    for name in [f.relpath for f in plan.files] + plan.aux_files():
        if (partial / name).exists():
            os.replace(partial / name, out / name)
    _fsync_dir(out)
    extra = plan.manifest_extra()
    if files_writer is not None:
        extra.update(files_writer.manifest_extra([out / f.relpath for f in plan.files]))
    try:
        write_manifest(out, plan.ranks, tp_size=plan.options.tp, layout=plan.options.layout,
                       extra=extra, digest=plan.options.digest, digests=digests)
    except OSError as e:
        raise _write_error(e, out / MANIFEST_NAME, "the manifest") from e
    _publish(out, partial)


def _publish(out: Path, partial: Path) -> None:
    """The step that makes OUT loadable: the partial directory renamed away, then removed."""
    done = out / FINISHED_DIR
    shutil.rmtree(done, ignore_errors=True)
    os.rename(partial, done)
    _fsync_dir(out)
    shutil.rmtree(done, ignore_errors=True)


def _write_file(
    path: Path,
    plan: ShardPlan,
    f: PlannedFile,
    builder: _Builder,
    result: ShardResult,
    progress: Callable[[int], None] | None,
    writer_factory: WriterFactory,
) -> str | None:
    """Write one planned file; returns the digest its writer computed on the way, if it did."""
    by_name = {t.name: t for t in f.tensors}
    current = "the header"
    try:
        with writer_factory(path, list(f.specs), file_metadata(plan, f)) as w:
            for spec in w.order:
                current = f"tensor {spec.name!r}"
                tensor = _build(builder, by_name[spec.name], spec)
                w.write(spec.name, tensor)
                del tensor
                result.written_bytes += spec.nbytes
                if progress is not None:
                    progress(spec.nbytes)
    except OSError as e:
        if isinstance(e, GdsloadError):
            raise
        failed = getattr(e, "tensor", None)  # AlignedWriter's writes finish later than write() returns
        raise _write_error(e, path, f"tensor {failed!r}" if failed else current) from e
    log.info("wrote %s (%s, %d tensors)", f.relpath, format_bytes(f.nbytes), len(f.specs))
    return getattr(w, "digest", None)


def _build(builder: _Builder, t: OutTensor, spec: TensorSpec) -> torch.Tensor:
    try:
        return builder.build(t, spec)
    except (OSError, SafetensorError) as e:
        code = getattr(e, "errno", None) or errno.EIO
        raise SourceReadError(
            code, f"reading {', '.join(map(repr, t.sources))} for output tensor {t.name!r} failed ({e}); "
                  "the source changed or became unreadable since planning — restore it and rerun"
        ) from e


def _stage_aux(plan: ShardPlan, partial: Path) -> None:
    for name in plan.aux_files():
        dst = partial / name
        try:
            with atomic_output(dst) as fh:
                if name == "config.json":
                    fh.write((json.dumps(plan.output_config(), indent=2) + "\n").encode())
                else:
                    with open(plan.source / name, "rb") as src:
                        shutil.copyfileobj(src, fh, 8 << 20)
        except OSError as e:
            raise _write_error(e, dst, f"copy of {name}") from e


def shard_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tp: int,
    layout: str = "vllm",
    quantize: str | None = None,
    max_file_bytes: int = 5 << 30,
    digest: bool | str = True,
    progress: Callable[[int], None] | None = None,
    writer_factory: WriterFactory = AlignedWriter,
) -> ShardResult:
    """Shard the Hugging Face checkpoint ``src`` into ``out`` for ``tp`` ranks: plan, then write.

    >>> shard_checkpoint("/models/Qwen2-7B", "/models/qwen2-tp4-fp8", tp=4, quantize="fp8")  # doctest: +SKIP
    """
    options = ShardOptions(tp=tp, layout=layout, quantize=quantize, max_file_bytes=max_file_bytes, digest=digest)
    return execute_plan(plan_shard(src, options), out, progress=progress, writer_factory=writer_factory)
