"""Reader backends: one interface, a name table, lazy imports.

A backend moves a rank's file bytes into its arena. ``probe`` says why it cannot run on this
host (or None when it can); ``select_backend("auto", device)`` tries them in order and logs
why each one was skipped; a backend named explicitly either runs or raises
:class:`BackendUnavailableError` naming why and what to use instead.
"""

from __future__ import annotations

import abc
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import BackendUnavailableError, ConfigError
from ..plan import LoadPlan

__all__ = ["Backend", "ReadOptions", "BACKENDS", "AUTO_ORDER", "IO_MODES", "select_backend", "backend_class"]

log = logging.getLogger(__name__)

# name -> "module:Class", imported only when asked for.
BACKENDS: dict[str, str] = {
    "cpu": "gdsload.loader.backends.cpu:CpuBackend",
}
AUTO_ORDER: tuple[str, ...] = ("cpu",)
IO_MODES = ("gds", "p2pdma", "compat", "posix", "cpu")
"""What the report may say ran for a file: true GDS DMA, P2PDMA, cuFile compat (bounce buffers),
POSIX reads staged through host memory to the GPU, or plain reads into host memory."""

Progress = Callable[[int], None]


@dataclass(frozen=True)
class ReadOptions:
    num_threads: int
    """Reader threads per rank."""
    chunk_bytes: int
    """Largest single read."""


class Backend(abc.ABC):
    """Moves the bytes of a :class:`LoadPlan` into an arena on ``device``."""

    name: ClassVar[str]

    def __init__(self, device: torch.device, options: ReadOptions):
        self.device = device
        self.options = options

    @classmethod
    @abc.abstractmethod
    def probe(cls, device: torch.device) -> str | None:
        """Why this backend cannot load to ``device`` here, or None when it can."""

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 arena of ``nbytes`` on the target device."""

    @abc.abstractmethod
    def read(self, plan: LoadPlan, arena: torch.Tensor, progress: Progress | None = None) -> list[str]:
        """Fill ``arena`` with every extent of ``plan``; return the I/O mode that ran, per file."""

    def close(self) -> None:
        """Release buffers the backend holds beyond the arena."""


def backend_class(name: str) -> type[Backend]:
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ConfigError(f"backend {name!r} is not known; choose one of {['auto', *BACKENDS]}") from None
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def select_backend(name: str, device: torch.device, options: ReadOptions) -> Backend:
    """Instantiate the backend ``name`` (or the first one that can run, for ``"auto"``)."""
    if name != "auto":
        cls = backend_class(name)
        reason = cls.probe(device)
        if reason is not None:
            raise BackendUnavailableError(
                f"backend {name!r} cannot load to {str(device)!r} here: {reason}; "
                "use backend='auto' to pick one that can"
            )
        return cls(device, options)
    skipped = []
    for candidate in AUTO_ORDER:
        try:
            cls = backend_class(candidate)
            reason = cls.probe(device)
        except ImportError as e:
            reason = f"cannot import it ({e})"
        if reason is None:
            return cls(device, options)
        log.info("backend %s skipped: %s", candidate, reason)
        skipped.append(f"{candidate}: {reason}")
    raise BackendUnavailableError(f"no backend can load to {str(device)!r} here ({'; '.join(skipped)})")
