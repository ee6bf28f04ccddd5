"""Reader backends: one interface, a name table, lazy imports.

A backend moves a rank's file bytes into its arena. ``probe`` says why it cannot run on this
host (or None when it can); ``select_backend("auto", device)`` tries them in order and logs
why each one was skipped; a backend named explicitly either runs or raises
:class:`BackendUnavailableError` naming why and what to use instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import abc
import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar


from ..errors import BackendUnavailableError, ConfigError, TruncatedFileError
from ..plan import Extent, LoadPlan

if TYPE_CHECKING:
    import torch

__all__ = ["Backend", "ReadOptions", "BACKENDS", "AUTO_ORDER", "BARE_BACKENDS", "IO_MODES", "select_backend", "backend_class",
           "wait_preads", "is_cupy", "device_address", "dst_bytes"]

log = logging.getLogger(__name__)

# name -> "module:Class", imported only when asked for.
BACKENDS: dict[str, str] = {
    "cufile": "gdsload.loader.backends.cufile:CuFileBackend",
    "pinned": "gdsload.loader.backends.pinned:PinnedBackend",
    "fastsafetensors": "gdsload.loader.backends.fastsafetensors:FastSafetensorsBackend",
    "cpu": "gdsload.loader.backends.cpu:CpuBackend",
}
AUTO_ORDER: tuple[str, ...] = ("cufile", "pinned", "cpu")
"""``auto`` tries these in order. ``cufile`` is first only where it can do better than our own
pipeline (true GDS or P2PDMA); ``fastsafetensors`` is never picked automatically (it is there for
comparison and its users)."""
BARE_BACKENDS: tuple[str, ...] = ("auto", "cufile")
"""The ``backend`` values the torch-free sidecar path (:mod:`gdsload.loader.bare`) runs; it reads with kvikio."""
IO_MODES = ("gds", "p2pdma", "compat", "posix", "cpu")
"""What the report may say ran for a file: true GDS DMA, P2PDMA, cuFile compat (bounce buffers),
POSIX reads staged through host memory to the GPU, or plain reads into host memory."""

Progress = Callable[[int], None]


@dataclass(frozen=True)
class ReadOptions:
    num_threads: int | None = None
    """Reader threads per rank; None: the backend's default."""
    chunk_bytes: int | None = None
    """Largest single read (pinned: staging buffer size; cufile: kvikio task size); None: the backend's default."""
    pinned_bytes: int = 1 << 30
    """Upper bound on pinned host staging memory."""


class Backend(abc.ABC):
    """Moves file bytes into a uint8 buffer on ``device``.

    Life cycle: ``open(plan)`` (open files, decide the I/O mode of each), any number of
    ``read(extents, dst)`` calls (each returns when the bytes are in ``dst``), ``close()``.
    An extent's ``arena_offset`` is its offset in ``dst``: the arena for direct reads, a
    staging buffer for compressed bytes.
    """

    name: ClassVar[str]

    def __init__(self, device: torch.device, options: ReadOptions):
        self.device = device
        self.options = options
        self.plan: LoadPlan | None = None

    @classmethod
    @abc.abstractmethod
    def probe(cls, device: torch.device) -> str | None:
        """Why this backend cannot load to ``device`` here, or None when it can."""

    @classmethod
    def auto_skip(cls, device: torch.device) -> str | None:
        """Why ``auto`` should prefer a later backend although this one can run (None: take it)."""
        return None

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` on the target device (the arena, or staging)."""
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def open(self, plan: LoadPlan) -> None:
        """Prepare to read ``plan``'s files."""
        self.plan = plan

    @abc.abstractmethod
    def read(self, extents: Sequence[Extent], dst: torch.Tensor, progress: Progress | None = None) -> None:
        """Copy every extent into ``dst``; return once the bytes are there (device work synchronized)."""

    def submit(self, extents: Sequence[Extent], dst: torch.Tensor, progress: Progress | None = None
               ) -> Callable[[], None]:
        """Start copying ``extents`` into ``dst``; returns the function that waits for them.

        Backends that can keep reads in flight across calls (``pinned``, ``cufile``) override
        this, so the compressed pipeline keeps its next staging groups in flight while it waits for
        the oldest; by default the copy happens here and the waiter has nothing left to do.
        """
        self.read(extents, dst, progress)
        return lambda: None

    @abc.abstractmethod
    def io_modes(self) -> list[str]:
        """The I/O mode that really ran, per file of the plan (see ``IO_MODES``)."""

    def direct_io(self) -> list[bool]:
        """Whether each file was read with O_DIRECT (bypassing the page cache)."""
        assert self.plan is not None
        return [False] * len(self.plan.files)

    def close(self) -> None:
        """Close files and release buffers the backend holds beyond the arena."""


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
            reason = cls.probe(device) or cls.auto_skip(device)
        except ImportError as e:
            reason = f"cannot import it ({e})"
        if reason is None:
            return cls(device, options)
        log.info("backend %s skipped: %s", candidate, reason)
        skipped.append(f"{candidate}: {reason}")
    raise BackendUnavailableError(f"no backend can load to {str(device)!r} here ({'; '.join(skipped)})")


def is_cupy(a: object) -> bool:
    """Whether ``a`` is a cupy array (the torch-free path's buffers) rather than a torch tensor."""
    return type(a).__module__.startswith("cupy")


def device_address(a: object) -> int:
    """Address of a 1-D device buffer: a torch tensor or a cupy array."""
    return a.data.ptr if is_cupy(a) else a.data_ptr()  # type: ignore[attr-defined]


def dst_bytes(a: object) -> int:
    """Size in bytes of a 1-D uint8 buffer: a torch tensor or a cupy array."""
    return int(a.nbytes)  # type: ignore[attr-defined]


def wait_preads(plan: LoadPlan, futures: Sequence[tuple[Extent, object]], progress: Progress | None) -> None:
    """Wait for kvikio ``pread`` futures, one per extent; a short read means the file shrank."""
    for e, fut in futures:
        got = fut.get()  # type: ignore[attr-defined]
        if got != e.length:
            raise TruncatedFileError(
                f"{plan.files[e.file_index].path!r}: read {got} of {e.length} bytes at "
                f"{e.file_offset}; the file shrank while it was being loaded"
            )
        if progress is not None:
            progress(e.length)
