"""Training checkpoints: compressed, checksummed, written atomically.

- :mod:`.dropin`: :func:`save` / :func:`load`, drop-ins for ``torch.save`` / ``torch.load`` (``gdsload.save``);
- :mod:`.dcp_write`, :mod:`.dcp_read`: :class:`GdsloadWriter` / :class:`GdsloadReader`, gdsload as the storage of
  PyTorch's distributed checkpoints (``dcp.save``, ``dcp.async_save``, ``dcp.load`` with resharding);
- :mod:`.container`: :func:`save_compressed_checkpoint` and :func:`load_compressed_checkpoint` (model, optimizer and
  extras in one file, no pickle);
- :mod:`.encode`, :mod:`.tensorfile`, :mod:`.reader`, :mod:`.writer`: a tensor's stored bytes, the file, reading it.

Names are imported on first use: ``torch.distributed`` only for the DCP classes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "save",
    "load",
    "SaveReport",
    "GdsloadWriter",
    "GdsloadReader",
    "StageReport",
    "save_compressed_checkpoint",
    "load_compressed_checkpoint",
    "CheckpointReport",
]

_LAZY = {
    "save": "dropin",
    "load": "dropin",
    "SaveReport": "dropin",
    "GdsloadWriter": "dcp_write",
    "StageReport": "dcp_write",
    "GdsloadReader": "dcp_read",
    "save_compressed_checkpoint": "container",
    "load_compressed_checkpoint": "container",
    "CheckpointReport": "container",
}

if TYPE_CHECKING:  # pragma: no cover
    from .container import (
        CheckpointReport,
        load_compressed_checkpoint,
        save_compressed_checkpoint,
    )
    from .dcp_read import GdsloadReader
    from .dcp_write import GdsloadWriter, StageReport
    from .dropin import SaveReport, load, save


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
