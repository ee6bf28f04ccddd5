"""gdsload: model weights into GPU memory fast; training state saved and loaded compressed.

The library is :mod:`gdsload.loader`, the sidecar :mod:`gdsload.server`. Here, as drop-ins for
``torch.save`` / ``torch.load`` (imported on first use, so ``import gdsload`` costs nothing):

>>> import gdsload
>>> gdsload.save({"model": model.state_dict(), "step": 1000}, "step-1000.pt")  # doctest: +SKIP
>>> state = gdsload.load("step-1000.pt", map_location="cpu")  # doctest: +SKIP

This file is installed as ``gdsload/__init__.py`` (pyproject maps the package ``gdsload`` here).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["save", "load"]

_LAZY = {"save": "gdsload.loader.checkpoints.dropin", "load": "gdsload.loader.checkpoints.dropin"}

if TYPE_CHECKING:  # pragma: no cover
    from gdsload.loader.checkpoints.dropin import load, save


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
