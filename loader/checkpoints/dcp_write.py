"""gdsload as the storage of PyTorch's distributed checkpoints: ``dcp.save`` / ``dcp.async_save`` write compressed,
crash-safe files.

:class:`GdsloadWriter` is a DCP ``StorageWriter``: each rank writes its items into one tensor file
(:mod:`.tensorfile`; CUDA tensors compressed on their GPU before the copy to the host, CPU tensors with Zstd on
every core, a checksum per tensor), written beside its name and renamed; the coordinator renames the metadata into
place last (:mod:`.dcp_layout`), so a save killed at any point leaves the previous checkpoint in the directory
loadable. DCP's planner decides what each rank writes (FSDP2 / DTensor shards, replicated tensors once, other
objects as bytes), so any state dict DCP takes is saved, and :class:`~.dcp_read.GdsloadReader` reads it back at
any world size.

It is also DCP's ``AsyncStager``: with ``dcp.async_save``, :meth:`GdsloadWriter.stage` runs in the training loop
and takes a snapshot (CUDA tensors compressed on their GPU and only the compressed bytes copied to page-locked host
memory, which the next save reuses; CPU tensors copied, or compressed at once past ``staging_limit``), then the save
runs in DCP's background thread from that snapshot while training goes on. :attr:`GdsloadWriter.last_stage` reports
the stall and the host memory held.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .dcp_layout import (
    DCP_KEY,
    METADATA_NAME,
    StoredAt,
    data_file,
    dump_metadata,
    previous_save,
    remove_unused,
)
from .encode import Stored, dtype_name, encode, gpu_codec_for, resolve_codec, to_host
from .writer import Frames
from .tensorfile import Planned, TensorFileWriter
from ..config import format_bytes
from ..errors import CheckpointError, ConfigError
from ..format.atomic import atomic_output

__all__ = ["GdsloadWriter", "StageReport", "SaveStats"]

log = logging.getLogger(__name__)


PINNED_BLOCK = 64 << 20
"""``async_save`` takes page-locked host memory in blocks of at most this size from torch's pinned-memory cache:
powers of two, which the cache hands back whole to the next save instead of allocating and locking new memory."""


class _PinnedBlocks:
    """Page-locked host memory that :meth:`GdsloadWriter.stage` copies CUDA tensors' stored bytes into, each copy
    queued without waiting for the one before (:meth:`wait` waits for them all). Blocks are filled one after the
    other, each :data:`PINNED_BLOCK` bytes or, near the end, the power of two that holds what is left of
    ``upto`` (the most the stored bytes can take); an item that spans two blocks is written as :class:`Frames`."""

    def __init__(self, upto: int) -> None:
        self.blocks: list[torch.Tensor] = []
        self._left = upto
        self._used = 0
        self._devices: set[torch.device] = set()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    def __call__(self, src: torch.Tensor) -> np.ndarray | Frames:
        self._devices.add(src.device)
        parts: list[np.ndarray] = []
        done, n = 0, src.numel()
        while done < n:
            if not self.blocks or self._used == self.blocks[-1].numel():
                size = min(PINNED_BLOCK, 1 << (max(self._left, n - done, 1) - 1).bit_length())
                self.blocks.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
                self._used = 0
            k = min(n - done, self.blocks[-1].numel() - self._used)
            dst = self.blocks[-1][self._used : self._used + k]
            dst.copy_(src[done : done + k], non_blocking=True)
            parts.append(dst.numpy())
            done, self._used, self._left = done + k, self._used + k, self._left - k
        if len(parts) == 1:
            return parts[0]
        return Frames(parts) if parts else np.empty(0, np.uint8)

    def wait(self) -> None:
        for device in self._devices:
            torch.cuda.current_stream(device).synchronize()


@dataclasses.dataclass(frozen=True)
class StageReport:
    """What :meth:`GdsloadWriter.stage` did while the training loop waited."""

    seconds: float
    """The stall: the loop waited this long."""
    host_bytes: int
    """Bytes the snapshot holds in host memory until the background save has written them (released item by
    item)."""
    logical_bytes: int
    gpu_compressed: int
    """Logical bytes compressed on GPUs during the stall (only their compressed bytes were copied)."""
    copied: int
    """Logical bytes copied as they are, to be compressed in the background."""
    cpu_compressed: int
    """Logical bytes compressed on the CPU during the stall (past ``staging_limit``)."""
    pinned_bytes: int = 0
    """Page-locked host memory that holds CUDA tensors' stored bytes (part of ``host_bytes``, in whole blocks
    of at most :data:`PINNED_BLOCK`): back to torch's pinned-memory cache, for the next save, block by block as
    the background save writes them."""

    def summary(self) -> str:
        return (
            f"stage: {self.seconds:.3f} s stall; {format_bytes(self.logical_bytes)} of state held as "
            f"{format_bytes(self.host_bytes)} of host memory (compressed on GPUs {format_bytes(self.gpu_compressed)}, "
            f"copied {format_bytes(self.copied)}, compressed on the CPU {format_bytes(self.cpu_compressed)}; "
            f"{format_bytes(self.pinned_bytes)} page-locked)"
        )


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """What this rank's last write wrote (:attr:`GdsloadWriter.last_write`)."""

    file: str
    items: int
    logical_bytes: int
    stored_bytes: int
    encode_seconds: float
    write_seconds: float
    seconds: float
    staged: bool

    @property
    def ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclasses.dataclass
class _Batch:
    """One snapshot: each write item's bytes, by index, and the state dict objects it was made for."""

    items: dict[MetadataIndex, Stored | torch.Tensor | bytes]
    aliases: set[int]
    report: StageReport | None = None
    keep: list[Any] = dataclasses.field(default_factory=list)


def _item_bytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    return int(torch.Size(item.tensor_data.chunk.sizes).numel()) * item.tensor_data.properties.dtype.itemsize


def _entry_name(index: MetadataIndex) -> str:
    return index.fqn if not index.offset else f"{index.fqn}@{','.join(map(str, index.offset))}"


class GdsloadWriter(StorageWriter, AsyncStager):
    """DCP storage that writes gdsload's compressed tensor files.

    ``path``: the checkpoint directory (or pass ``checkpoint_id`` to ``dcp.save``). ``codec``: ``"auto"`` (ANS on
    GPUs where nvCOMP runs, Zstd on the CPU), ``"zstd"`` (Zstd everywhere; loads on any host), ``"ans"``,
    ``"none"``. ``planes``: split floating-point tensors into byte planes before Zstd. ``staging_limit``: bytes of
    CPU tensors ``async_save`` copies as they are before it compresses the rest during the stall (None: no
    limit). One directory takes one save at a time; ``dcp.async_save`` callers wait for the previous future.

    >>> import torch.distributed.checkpoint as dcp
    >>> dcp.save(state, storage_writer=GdsloadWriter("ckpt/step-1000"))  # doctest: +SKIP
    >>> future = dcp.async_save(state, storage_writer=GdsloadWriter("ckpt/step-2000"))  # doctest: +SKIP
    """

    _synchronize_after_execute = False

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        codec: str = "auto",
        planes: bool = True,
        min_gain: float = 0.02,
        writer: str = "auto",
        staging_limit: int | None = None,
    ):
        super().__init__()
        self.path = Path(path) if path is not None else None
        self.codec = resolve_codec(codec)
        if not isinstance(min_gain, (int, float)) or not 0 <= min_gain < 1:
            raise ConfigError(f"min_gain={min_gain!r} must be a number in [0, 1)")
        if staging_limit is not None and (not isinstance(staging_limit, int) or staging_limit < 0):
            raise ConfigError(f"staging_limit={staging_limit!r} must be a number of bytes >= 0, or None")
        self.planes, self.min_gain, self.writer, self.staging_limit = planes, min_gain, writer, staging_limit
        self.save_id = uuid.uuid4().hex[:12]
        self.rank = 0
        self.is_coordinator = True
        self.last_stage: StageReport | None = None
        self.last_write: SaveStats | None = None
        self._batches: list[_Batch] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = uuid.uuid4().hex[:12]

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ConfigError(
                "GdsloadWriter needs use_collectives=True (the coordinator writes the one metadata "
                "file that makes a save complete)"
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self.save_id = uuid.uuid4().hex[:12]  # every save writes files of new names (DCP resets only given an id)

    def _dir(self) -> Path:
        if self.path is None:
            raise ConfigError(
                "GdsloadWriter has no directory: pass GdsloadWriter(path) or dcp.save(..., checkpoint_id=path)"
            )
        return self.path

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._dir().mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator's save id names every rank's file, so one save's files are told apart from another's.
        return [dataclasses.replace(p, storage_data=data_file(i, self.save_id)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        t0 = time.perf_counter()
        name = plan.storage_data
        if not isinstance(name, str):
            raise CheckpointError(
                f"the save plan carries {name!r} where GdsloadWriter's file name should be; was "
                "prepare_global_plan skipped?"
            )
        batch = self._take_batch(plan, planner)
        byte_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        blobs: dict[MetadataIndex, bytes] = {}
        for item in byte_items:
            got = batch.items.get(item.index) if batch is not None else None
            if got is None:  # the live object: a plain save (an async one snapshots every object)
                data = planner.resolve_data(item)
                got = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            assert isinstance(got, bytes)
            blobs[item.index] = got
        tensor_items = sorted((i for i in plan.items if i.type != WriteItemType.BYTE_IO), key=_item_bytes, reverse=True)
        planned = [
            Planned(_entry_name(i.index), len(blobs[i.index]), "uint8", (len(blobs[i.index]),), False)
            for i in byte_items
        ]
        planned += [
            Planned(
                _entry_name(i.index),
                _item_bytes(i),
                dtype_name(i.tensor_data.properties.dtype),
                tuple(i.tensor_data.chunk.sizes),
                self.codec != "none",
            )
            for i in tensor_items
        ]
        kind = {DCP_KEY: json.dumps({"version": 1, "rank": self.rank, "save_id": name.split(".")[1]})}
        results: list[WriteResult] = []
        logical = 0
        encode_s = 0.0
        with TensorFileWriter(self._dir() / name, planned, kind, writer=self.writer) as w:
            for item in byte_items:
                data = blobs[item.index]
                s = encode(
                    torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8),
                    "none",
                    name=_entry_name(item.index),
                )
                w.add(_entry_name(item.index), s, s.meta())
                results.append(WriteResult(item.index, s.data.nbytes, StoredAt(name, _entry_name(item.index))))
            for item in tensor_items:
                entry = _entry_name(item.index)
                staged = batch.items.pop(item.index, None) if batch is not None else None
                if batch is not None and staged is None:
                    raise CheckpointError(
                        f"write item {entry!r} is not in the async_save snapshot; GdsloadWriter "
                        "snapshots what DCP's DefaultSavePlanner plans: save with that planner, "
                        "or pass async_stager=DefaultStager(...) to dcp.async_save"
                    )
                assert item.tensor_data is not None
                dtype, shape = item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes)
                if isinstance(staged, Stored):
                    s = staged
                else:
                    t = staged if isinstance(staged, torch.Tensor) else planner.resolve_data(item)
                    if not isinstance(t, torch.Tensor) or (t.dtype, tuple(t.shape)) != (dtype, shape):
                        raise CheckpointError(
                            f"write item {entry!r} resolved to {type(t).__name__} "
                            f"{getattr(t, 'dtype', '')}{list(getattr(t, 'shape', []))}, the plan "
                            f"says {dtype}{list(shape)}"
                        )
                    s = encode(t, self.codec, name=entry, planes=self.planes, min_gain=self.min_gain)
                encode_s += s.seconds
                logical += s.nbytes
                w.add(entry, s, s.meta(dtype=dtype, shape=shape))
                results.append(WriteResult(item.index, s.data.nbytes, StoredAt(name, entry)))
        assert w.stats is not None
        self.last_write = SaveStats(
            name,
            len(results),
            logical,
            w.stats.stored_bytes,
            encode_s,
            w.stats.write_seconds,
            time.perf_counter() - t0,
            batch is not None,
        )
        log.info(
            "rank %d wrote %s: %d items, %s -> %s in %.3f s%s",
            self.rank,
            name,
            len(results),
            format_bytes(logical),
            format_bytes(w.stats.stored_bytes),
            self.last_write.seconds,
            " (from the async snapshot)" if batch is not None else "",
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        directory = self._dir()
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = self.storage_meta()
        previous, before = previous_save(directory)
        with atomic_output(directory / METADATA_NAME) as f:
            f.write(dump_metadata(metadata))
        keep = {s.file for s in metadata.storage_data.values()}
        gone = remove_unused(directory, keep, previous - keep, before)
        log.info(
            "checkpoint %s complete: %d files%s",
            directory,
            len(keep),
            f"; deleted {len(gone)} files of earlier saves" if gone else "",
        )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path) if self.path is not None else None, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | None:
        return str(self.path) if self.path is not None else None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in str(checkpoint_id)

    # ------------------------------------------------------------------ AsyncStager

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Snapshot ``state_dict`` for ``dcp.async_save`` (called by it in the training loop): returns a state dict
        of the same structure that the background save writes from the snapshot."""
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        t0 = time.perf_counter()
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict, None, True)
        items: dict[MetadataIndex, Stored | torch.Tensor | bytes] = {}
        resolved = [(item, planner.resolve_data(item)) for item in planner.create_local_plan().items]
        cuda = [d for i, d in resolved if i.type != WriteItemType.BYTE_IO and d.is_cuda]
        gpu = gpu_codec_for(self.codec) if cuda else None  # None: CUDA tensors are copied as they are
        pinned = _PinnedBlocks(sum(d.numel() * d.element_size() for d in cuda) if gpu is not None else 0)
        held = logical = on_gpu = copied = on_cpu = 0
        for item, data in resolved:
            if item.type == WriteItemType.BYTE_IO:
                items[item.index] = data.getvalue()
                held += len(items[item.index])
                continue
            t = data.detach()
            n = t.numel() * t.element_size()
            logical += n
            on_its_gpu = t.is_cuda and gpu is not None
            past_limit = self.staging_limit is not None and copied + n > self.staging_limit
            if on_its_gpu or past_limit:
                s = encode(
                    t,
                    self.codec,
                    name=_entry_name(item.index),
                    planes=self.planes,
                    min_gain=self.min_gain,
                    host=pinned if on_its_gpu else to_host,
                )
                items[item.index] = s
                held += s.data.nbytes
                if on_its_gpu:
                    on_gpu += n
                else:
                    on_cpu += n
            else:
                copy = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
                copy.copy_(t)
                items[item.index] = copy
                held += n
                copied += n
        pinned.wait()  # the copies out of the GPUs: training may change the tensors once this returns
        batch = _Batch(items, set())
        staged = self._alias(state_dict, batch)
        batch.report = StageReport(time.perf_counter() - t0, held, logical, on_gpu, copied, on_cpu, pinned.nbytes)
        with self._lock:
            self._batches.append(batch)
        self.last_stage = batch.report
        log.info("%s", batch.report.summary())
        return staged

    def _alias(self, obj: Any, batch: _Batch) -> Any:
        """The state dict's structure anew, each tensor a new alias (a detached view) the batch knows by identity."""
        if isinstance(obj, torch.Tensor):
            try:
                alias = obj.detach()
            except (RuntimeError, NotImplementedError):  # a tensor type without detach: saved from the snapshot alone
                return obj
            batch.aliases.add(id(alias))
            batch.keep.append(alias)
            return alias
        if isinstance(obj, dict):
            return (
                type(obj)((k, self._alias(v, batch)) for k, v in obj.items())
                if type(obj) is not dict
                else {k: self._alias(v, batch) for k, v in obj.items()}
            )
        if isinstance(obj, list):
            return [self._alias(v, batch) for v in obj]
        if isinstance(obj, tuple) and type(obj) is tuple:
            return tuple(self._alias(v, batch) for v in obj)
        return obj

    def _take_batch(self, plan: SavePlan, planner: SavePlanner) -> _Batch | None:
        """The snapshot this save writes from (matched through the planner's state dict), or None (a plain save)."""
        state = getattr(planner, "state_dict", None)
        with self._lock:
            if not self._batches:
                return None
            found = None
            if isinstance(state, dict):
                ids = {id(v) for v in state.values()}
                found = next((b for b in self._batches if b.aliases & ids), None)
                if found is None and any(isinstance(v, torch.Tensor) for v in state.values()):
                    return None  # a plain save of live tensors while a snapshot waits for its own save
            if found is None:
                found = self._batches[0]
            self._batches.remove(found)
            return found

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the snapshot is taken."""

    def __getstate__(self) -> dict[str, Any]:
        raise CheckpointError(
            "GdsloadWriter keeps async_save's snapshot in this process and cannot be sent to another: use "
            "dcp.async_save's default thread executor (async_checkpointer_type=AsyncCheckpointerType.THREAD)"
        )

    def close(self) -> None:
        """Drop snapshots no save has taken (a failed ``async_save``)."""
        with self._lock:
            self._batches.clear()
