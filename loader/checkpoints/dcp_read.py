"""Reading gdsload DCP checkpoints back with ``dcp.load``, at any world size.

:class:`GdsloadReader` is DCP's ``StorageReader`` for directories :class:`~.dcp_write.GdsloadWriter` wrote. DCP's
load planner says which part of which stored chunk each rank's tensors need (resharding from the world size of the
save to this one); the reader decodes each stored chunk once, straight into its destination where one destination
takes all of it (contiguous, same dtype), else into scratch memory from which the parts are copied out. Every
chunk's checksums are checked as it is decoded.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .dcp_layout import DCP_KEY, METADATA_NAME, StoredAt, load_metadata
from .reader import Slot, TensorFile
from ..errors import CheckpointError, ConfigError

__all__ = ["GdsloadReader"]

log = logging.getLogger(__name__)

SCRATCH_BYTES = 1 << 30
"""Scratch memory for stored chunks that several destinations share, per round of reading."""


class GdsloadReader(StorageReader):
    """DCP storage that reads gdsload checkpoints (``dcp.load(state, storage_reader=GdsloadReader(path))``).

    ``metadata_classes``: classes a custom planner put into the metadata, allowed when it is unpickled (the
    metadata file is read with an allow-list, not plain pickle).

    >>> import torch.distributed.checkpoint as dcp
    >>> dcp.load(state, storage_reader=GdsloadReader("ckpt/step-1000"))  # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        metadata_classes: Iterable[type] = (),
        scratch_bytes: int = SCRATCH_BYTES,
    ):
        super().__init__()
        self.path = Path(path) if path is not None else None
        self.metadata_classes = tuple(metadata_classes)
        if not isinstance(scratch_bytes, int) or scratch_bytes <= 0:
            raise ConfigError(f"scratch_bytes={scratch_bytes!r} must be a positive number of bytes")
        self.scratch_bytes = scratch_bytes
        self.storage_data: dict[Any, StoredAt] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def _dir(self) -> Path:
        if self.path is None:
            raise ConfigError(
                "GdsloadReader has no directory: pass GdsloadReader(path) or dcp.load(..., checkpoint_id=path)"
            )
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = load_metadata(self._dir(), self.metadata_classes)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @property
    def checkpoint_id(self) -> str | None:
        return str(self.path) if self.path is not None else None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return (Path(checkpoint_id) / METADATA_NAME).is_file()

    def _where(self, item: ReadItem) -> StoredAt:
        at = self.storage_data.get(item.storage_index)
        if not isinstance(at, StoredAt):
            raise CheckpointError(
                f"{str(self._dir())!r}: the metadata has no place for {item.storage_index.fqn!r} "
                f"(chunk at {list(item.storage_index.offset or [])}); the checkpoint is damaged"
            )
        return at

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self._where(item).file, []).append(item)
        for name, items in by_file.items():
            path = self._dir() / name
            if not path.is_file():
                raise CheckpointError(
                    f"{str(path)!r}, which the checkpoint's metadata names, is missing; the "
                    "checkpoint is damaged (was the directory copied only in part?)"
                )
            with TensorFile(path, DCP_KEY, what="gdsload DCP data file") as tf:
                self._read_file(tf, items, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, tf: TensorFile, items: list[ReadItem], planner: LoadPlanner) -> None:
        by_entry: dict[str, list[ReadItem]] = {}
        for item in items:
            by_entry.setdefault(self._where(item).entry, []).append(item)
        jobs: list[tuple[Slot, torch.Tensor]] = []
        copies: list[tuple[torch.Tensor, list[ReadItem]]] = []
        direct: list[tuple[ReadItem, torch.Tensor]] = []
        pending = 0
        for entry, reqs in by_entry.items():
            slot = tf[entry]
            if reqs[0].type == LoadItemType.BYTE_IO:
                for req in reqs:
                    planner.load_bytes(req, io.BytesIO(tf.read_bytes(slot)))
                continue
            target = self._whole(slot, reqs, planner)
            if target is not None:
                jobs.append((slot, target))
                direct.append((reqs[0], target))
                continue
            device = {planner.resolve_tensor(r).device for r in reqs}
            scratch = torch.empty(slot.shape, dtype=slot.dtype, device=device.pop() if len(device) == 1 else "cpu")
            jobs.append((slot, scratch))
            copies.append((scratch, reqs))
            pending += slot.nbytes
            if pending >= self.scratch_bytes:
                self._run(tf, jobs, copies, direct, planner)
                jobs, copies, direct, pending = [], [], [], 0
        self._run(tf, jobs, copies, direct, planner)

    @staticmethod
    def _whole(slot: Slot, reqs: list[ReadItem], planner: LoadPlanner) -> torch.Tensor | None:
        """The destination that takes all of a stored chunk, where one does: read straight into it."""
        if len(reqs) != 1:
            return None
        req = reqs[0]
        if any(req.storage_offsets) or tuple(req.lengths) != slot.shape:
            return None
        target = planner.resolve_tensor(req).detach()
        if target.dtype != slot.dtype or not target.is_contiguous() or tuple(target.shape) != slot.shape:
            return None
        return target

    @staticmethod
    def _run(
        tf: TensorFile,
        jobs: list[tuple[Slot, torch.Tensor]],
        copies: list[tuple[torch.Tensor, list[ReadItem]]],
        direct: list[tuple[ReadItem, torch.Tensor]],
        planner: LoadPlanner,
    ) -> None:
        if not jobs:
            return
        tf.read(jobs)
        for req, target in direct:
            planner.commit_tensor(req, target)
        for scratch, reqs in copies:
            for req in reqs:
                src = narrow_tensor_by_index(scratch, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.shape != src.shape:
                    raise CheckpointError(
                        f"{tf.path!r}: {req.storage_index.fqn!r} needs {list(target.shape)} and "
                        f"the checkpoint gives {list(src.shape)}; the checkpoint is damaged"
                    )
                target.copy_(src)
                planner.commit_tensor(req, target)
