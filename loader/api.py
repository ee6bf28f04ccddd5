"""``load_rank``: discover -> plan -> read -> decode -> verify -> publish, for one rank."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable

from .backends import ReadOptions, select_backend
from .config import LoadConfig
from .decode import load_compressed
from .discovery import RankFiles, discover
from .dtypes import to_torch
from .errors import ConfigError, IntegrityError
from .manifest import file_digest
from .plan import FilePlan, LoadPlan, Placement, plan_rank
from .result import FileReport, LoadReport, LoadResult

if TYPE_CHECKING:
    import torch

__all__ = ["load_rank", "file_report", "verify_digests"]

log = logging.getLogger(__name__)


def load_rank(
    path: str | os.PathLike[str],
    rank: int = 0,
    *,
    device: str | torch.device = "cpu",
    backend: str | None = None,
    num_threads: int | None = None,
    chunk_bytes: int | None = None,
    verify: bool | None = None,
    pinned_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[LoadPlan], None] | None = None,
) -> LoadResult:
    """Load every tensor of tensor-parallel rank ``rank`` from ``path`` onto ``device``.

    ``path`` is a model directory (``gdsload.json``, vLLM ``model-rank-R-part-P``, TRT-LLM
    ``rankR`` or plain ``*.safetensors``) or one ``.safetensors`` file. Options left as None
    come from ``GDSLOAD_*`` environment variables, then defaults (see :class:`LoadConfig`).
    ``progress`` is called with the byte count of each finished read; ``on_plan`` once with the
    rank's :class:`~gdsload.loader.plan.LoadPlan` (files, sizes, tensors), before any data is read
    (its time counts in the report's ``plan`` phase).

    >>> result = load_rank("/models/llama-tp2", rank=1, device="cpu")  # doctest: +SKIP
    >>> result.tensors["model.embed_tokens.weight"].shape
    torch.Size([16032, 4096])
    >>> print(result.report.summary())
    rank 1: 8.03 GB in 3.912 s (2.05 GB/s) backend=cpu io=cpu files=2
    """
    import torch

    cfg = LoadConfig.resolve(backend=backend, num_threads=num_threads, chunk_bytes=chunk_bytes, verify=verify,
                             pinned_bytes=pinned_bytes)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r} is not a torch device ({e}); use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    phases: dict[str, float] = {}

    t = time.perf_counter()
    rank_files = discover(path, rank)
    phases["discover"] = _lap(t)

    t = time.perf_counter()
    plan = plan_rank(rank_files)
    if on_plan is not None:
        on_plan(plan)
    reader = select_backend(cfg.backend, dev, ReadOptions(cfg.num_threads, cfg.chunk_bytes, cfg.pinned_bytes))
    try:
        arena = reader.allocate(plan.arena_bytes)
        reader.open(plan)
        phases["plan"] = _lap(t)

        t = time.perf_counter()
        reader.read(plan.extents, arena, progress)
        stats = load_compressed(plan, reader, arena, verify=cfg.verify, progress=progress,
                                threads=cfg.num_threads or 4)
        _sync(dev)
        phases["read"] = _lap(t) - stats.tail_seconds
        io_modes, direct = reader.io_modes(), reader.direct_io()
    finally:
        reader.close()

    t = time.perf_counter()
    tensors = {p.name: _materialize(arena, p) for p in plan.placements}
    _sync(dev)
    phases["decode"] = _lap(t) + stats.tail_seconds

    t = time.perf_counter()
    verified = cfg.verify and verify_digests(rank_files, plan, arena)
    phases["verify"] = _lap(t)

    report = LoadReport(
        rank=rank,
        device=str(dev),
        backend=reader.name,
        source=rank_files.source,
        files=[file_report(f, mode, d) for f, mode, d in zip(plan.files, io_modes, direct)],
        phases=phases,
        verified=verified,
        decode_busy_seconds=stats.decode_busy_seconds,
        staging_bytes=stats.staging_bytes,
    )
    log.info("%s", report.summary())
    return LoadResult(tensors=tensors, arenas=[arena], report=report)


def _lap(start: float) -> float:
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _materialize(arena: torch.Tensor, p: Placement) -> torch.Tensor:
    import torch

    dtype = to_torch(p.dtype)
    if p.nbytes == 0:
        return torch.empty(p.shape, dtype=dtype, device=arena.device)
    dst = arena[p.arena_offset : p.arena_offset + p.nbytes]
    if p.copy_from is not None:
        dst.copy_(arena[p.copy_from : p.copy_from + p.nbytes])
    return dst.view(dtype).view(p.shape)


def file_report(f: FilePlan, io_mode: str, direct_io: bool) -> FileReport:
    """What the load report says about one file."""
    return FileReport(
        path=f.path,
        io_mode=io_mode,
        stored_bytes=f.stored_bytes,
        logical_bytes=f.logical_bytes,
        tensors=len(f.header.tensors),
        copied_tensors=f.copied,
        data_aligned=f.header.data_aligned,
        direct_io=direct_io,
        compressed_tensors=f.compressed,
    )


def verify_digests(rank_files: RankFiles, plan: LoadPlan, arena: Any) -> bool:
    """Check every file against the manifest digest; False when there is nothing to check against.

    A CPU torch arena that mirrors a file's data section is hashed from memory; any other arena
    (CUDA torch tensor, cupy array) has its files hashed from disk.
    """
    entries = [rank_files.manifest_entry(f.path) for f in plan.files]
    if not all(e is not None and e.digest for e in entries):
        log.warning("verify requested but %s has no digests for rank %d; nothing verified",
                    rank_files.root, rank_files.rank)
        return False
    for f, entry in zip(plan.files, entries):
        assert entry is not None and entry.digest is not None
        if getattr(arena.device, "type", None) == "cpu" and f.mirror_offset >= 0:
            # The arena mirrors the data section: hash the header from disk and the data from memory.
            h = hashlib.sha256()
            with open(f.path, "rb") as fh:
                h.update(fh.read(f.header.data_offset))
            h.update(arena[f.mirror_offset : f.mirror_offset + f.stored_bytes].numpy())
            got = "sha256:" + h.hexdigest()
        else:
            got = file_digest(f.path)
        if got != entry.digest:
            raise IntegrityError(
                f"{f.path!r}: sha256 digest {got!r} does not match the manifest's {entry.digest!r}; "
                "the file is corrupt or was replaced — re-copy it or rewrite the manifest"
            )
    return True
