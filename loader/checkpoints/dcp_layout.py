"""How a gdsload DCP checkpoint lies in its directory, and its metadata file read back without unsafe pickle.

A checkpoint directory holds ``gdsload.metadata`` (DCP's :class:`Metadata`, pickled) and one tensor file per rank
and save, ``r{rank}.{save_id}.safetensors`` (:mod:`.tensorfile`). Every save uses new data-file names, writes each
file beside its name and renames it into place, and renames the metadata into place last: until that rename, the
directory's metadata still names the previous save's files, which are untouched, so a save killed at any point
leaves the previous checkpoint loadable. After it, the previous save's files are deleted, and so are files no
metadata names that are older than the previous metadata (left by saves killed before their end).

The metadata is unpickled with an allow-list (DCP's metadata classes, torch dtypes and sizes, :class:`StoredAt`),
so a metadata file cannot run code; more classes (a custom planner's data) are allowed by name.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..format.atomic import remove_dead_leftovers

__all__ = [
    "METADATA_NAME",
    "DCP_KEY",
    "StoredAt",
    "data_file",
    "load_metadata",
    "dump_metadata",
    "previous_save",
    "remove_unused",
]

log = logging.getLogger(__name__)

METADATA_NAME = "gdsload.metadata"
DCP_KEY = "gdsload.dcp"
"""Metadata key of a DCP data file (its rank and save)."""
_DATA = re.compile(r"^r(\d+)\.([0-9a-f]{12})\.safetensors$")
_TEMP = re.compile(r"^(\.r\d+\.[0-9a-f]{12}\.safetensors\.tmp-)[0-9a-f]+$")

_METADATA_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}


@dataclass(frozen=True)
class StoredAt:
    """Where a DCP write item is stored: the data file (relative to the directory) and its entry there."""

    file: str
    entry: str


def data_file(rank: int, save_id: str) -> str:
    """``r3.0123456789ab.safetensors``: rank 3's file of save ``0123456789ab``."""
    return f"r{rank}.{save_id}.safetensors"


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, allowed: Iterable[type], path: str):
        super().__init__(file)
        self._extra = {(c.__module__, c.__qualname__): c for c in allowed}
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return super().find_class(module, name)
        if (module, name) == (__name__, "StoredAt"):
            return StoredAt
        if (module, name) in self._extra:
            return self._extra[(module, name)]
        raise CheckpointError(
            f"{self._path!r} names {module}.{name}, which a gdsload checkpoint's metadata does not hold by itself "
            f"(a custom planner's data?); if you trust the checkpoint, pass GdsloadReader(..., "
            f"metadata_classes=[{name}])"
        )


def load_metadata(directory: Path, allowed: Iterable[type] = ()) -> Any:
    """The :class:`Metadata` of the checkpoint in ``directory``."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = directory / METADATA_NAME
    try:
        with open(path, "rb") as f:
            md = _Unpickler(f, allowed, str(path)).load()
    except FileNotFoundError:
        hint = ""
        if (directory / ".metadata").exists():
            hint = "; it holds a checkpoint DCP's own FileSystemWriter wrote: read it with FileSystemReader"
        elif not directory.is_dir():
            hint = "; the directory does not exist"
        raise CheckpointError(f"no gdsload checkpoint in {str(directory)!r} (no {METADATA_NAME}){hint}") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(
            f"{str(path)!r} is not a gdsload checkpoint's metadata ({type(e).__name__}: {e}); the file is damaged"
        ) from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{str(path)!r} holds a {type(md).__name__}, not DCP's Metadata; the file is damaged")
    return md


def dump_metadata(md: Any) -> bytes:
    return pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)


def previous_save(directory: Path) -> tuple[set[str], float | None]:
    """The data files the directory's metadata names now, and when that metadata was written (None: no metadata)."""
    path = directory / METADATA_NAME
    try:
        when = path.stat().st_mtime
        md = load_metadata(directory)
    except (OSError, CheckpointError):
        return set(), None
    return {s.file for s in md.storage_data.values() if isinstance(s, StoredAt)}, when


def remove_unused(directory: Path, keep: set[str], previous: set[str], before: float | None) -> list[str]:
    """Delete data files of ``directory`` that are not in ``keep``: those the previous metadata named, and others
    (of saves killed before their end) written before that metadata; also temporary files no live writer holds.
    Returns the names deleted. A save still running beside this one keeps its newer files; files of other names
    are never touched."""
    gone = []
    stems = set()
    try:
        names = os.listdir(directory)
    except OSError:
        return gone
    for name in names:
        if _DATA.match(name) and name not in keep:
            try:
                old = name in previous or (before is not None and (directory / name).stat().st_mtime < before)
                if old:
                    (directory / name).unlink()
                    gone.append(name)
            except OSError as e:
                log.warning("could not delete the unused checkpoint file %s: %s", directory / name, e)
        elif (m := _TEMP.match(name)) is not None:
            stems.add(m.group(1))
    for stem in stems:
        remove_dead_leftovers(directory, stem)
    return gone
