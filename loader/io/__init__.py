"""Reader backends: one interface, a registry, lazy imports.

A backend moves a rank's file bytes into destination buffers on a :class:`~gdsload.loader.devices.Device`.
``probe`` says why it cannot run on this host (or None when it can); ``select_backend("auto", device)``
tries the ``auto`` candidates in order and logs why each one was skipped; a backend named explicitly either
runs or raises :class:`BackendUnavailableError` naming why and what to use instead.

Adding a backend is one module and one :func:`register_backend` call (or, from another package, an
entry point in the ``gdsload.backends`` group naming the class: ``name = "package.module:Class"``).
"""

from __future__ import annotations

import abc
import importlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from ..errors import BackendUnavailableError, ConfigError, TruncatedFileError

if TYPE_CHECKING:  # types only: the registry is read by processes that never load (a server's parent)
    from ..devices import Device
    from ..plan import Extent, LoadPlan

__all__ = [
    "Backend",
    "ReadOptions",
    "IO_MODES",
    "register_backend",
    "backend_names",
    "is_backend",
    "auto_order",
    "select_backend",
    "backend_class",
    "wait_preads",
    "extent_slice",
]

log = logging.getLogger(__name__)


class _Entry(NamedTuple):
    target: str
    """``"module:Class"``, imported on first use."""
    auto: int | None
    """Place in ``auto``'s order (lower first); None: only when named."""
    kinds: tuple[str, ...]
    """Device kinds it can load to, known without importing it (so ``auto`` skips it cheaply)."""


_REGISTRY: dict[str, _Entry] = {}
_ENTRY_POINTS_LOADED = False


def register_backend(
    name: str, target: str, *, auto: int | None = None, kinds: tuple[str, ...] = ("cpu", "cuda")
) -> None:
    """Make backend ``name`` known: ``target`` is ``"module:Class"``, imported on first use.

    ``auto`` is its place in ``backend="auto"``'s order (lower first; None: only when named);
    ``kinds`` the device kinds (``cpu``, ``cuda``) it can load to.

    >>> register_backend("mine", "my_package.reader:MyBackend", kinds=("cuda",))  # doctest: +SKIP
    """
    _REGISTRY[name] = _Entry(target, auto, tuple(kinds))


register_backend("cufile", "gdsload.loader.io.cufile:CuFileBackend", auto=0, kinds=("cuda",))
register_backend("pinned", "gdsload.loader.io.pinned:PinnedBackend", auto=1, kinds=("cuda",))
register_backend("fastsafetensors", "gdsload.loader.io.fastsafetensors:FastSafetensorsBackend", kinds=("cuda",))
register_backend("mmap", "gdsload.loader.io.mmap:MmapBackend", auto=2, kinds=("cpu",))
register_backend("cpu", "gdsload.loader.io.cpu:CpuBackend", auto=3, kinds=("cpu",))
# ``cufile`` comes first in ``auto`` only where it does better than staging through host memory (true
# GDS or P2PDMA; its auto_skip says so); ``fastsafetensors`` is never picked automatically (it is there
# for comparison and its users). On the CPU, ``mmap`` (the files' own pages, nothing copied) goes before
# ``cpu`` (reads into fresh memory), except into shared memory, which only an arena can be.


def _load_entry_points() -> None:
    """Backends other packages declare (entry point group ``gdsload.backends``), looked up once, when needed."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    from importlib.metadata import entry_points  # here: importing it costs tens of milliseconds

    for ep in entry_points(group="gdsload.backends"):
        if ep.name not in _REGISTRY:
            register_backend(ep.name, ep.value)


def backend_names() -> list[str]:
    """Every known backend name (``auto`` not included)."""
    _load_entry_points()
    return list(_REGISTRY)


def is_backend(name: str) -> bool:
    """Whether ``name`` is a known backend (entry points are looked up only for names not registered here)."""
    if name not in _REGISTRY:
        _load_entry_points()
    return name in _REGISTRY


def auto_order() -> list[str]:
    """The backends ``auto`` tries, in order (backends from entry points run only when named)."""
    ranked = [(e.auto, n) for n, e in _REGISTRY.items() if e.auto is not None]
    return [n for _, n in sorted(ranked)]


IO_MODES = ("gds", "p2pdma", "compat", "posix", "cpu", "mmap")
"""What the report may say ran for a file: true GDS DMA, P2PDMA, cuFile compat (bounce buffers),
POSIX reads staged through host memory to the GPU, plain reads into host memory, or the file's
own pages mapped (nothing read or copied)."""

Progress = Callable[[int], None]


class ReadOptions(NamedTuple):
    num_threads: int | None = None
    """Reader threads per rank; None: the backend's default."""
    chunk_bytes: int | None = None
    """Largest single read (pinned: staging buffer size; cufile: kvikio task size); None: the backend's default."""
    pinned_bytes: int = 1 << 30
    """Upper bound on pinned host staging memory."""


class Backend(abc.ABC):
    """Moves file bytes into 1-D uint8 buffers of one device.

    Life cycle: ``open(plan)`` (open files, decide the I/O mode of each), any number of
    ``read(extents, dsts)`` calls (each returns when the bytes are in place), ``close()``. An
    extent lands in ``dsts[extent.buffer]`` at ``extent.offset``: the arena and the caller's
    targets for direct reads, a staging buffer for compressed bytes.
    """

    name: ClassVar[str]
    needs_torch: ClassVar[bool] = True
    """Whether it runs only on a torch device (:class:`~gdsload.loader.devices.TorchDevice`)."""
    maps_files: bool = False
    """Whether tensors of uncompressed files are views of the files' mappings (:meth:`file_buffers`), not read;
    a backend may decide it per load in :meth:`prepare` (the load reads it after that, when it plans)."""
    picked_by_auto: bool = False
    """Set by :func:`select_backend` when ``auto`` chose this backend: it may then do what serves the load
    best where a backend named explicitly does what its name says (``mmap`` reads a cold rank)."""
    on_chunk: Callable[[int, int, int], None] | None = None
    """Set by a load that checks what it reads on the CPU: a reader that supports it calls it with
    ``(buffer, offset, length)`` from the reading thread as each read into host memory finishes (the load's
    checksums are computed there, beside the reads). Readers that do not call it are checked after the read."""

    landed_on_wait: bool = False
    """Whether the waiter :meth:`submit` returns comes back only once its bytes are at their destination (the
    device's copies complete, not merely queued), for reads kept in flight together. Set per load by
    :meth:`open`. A load that checks its bytes on a GPU then reads in groups and checks each group as it lands
    (:func:`~gdsload.loader.plan.landing_groups`); otherwise it checks after the last read."""

    def __init__(self, device: Device | Any, options: ReadOptions):
        from ..devices import as_device

        self.device = as_device(device)
        self.options = options
        self.plan: LoadPlan | None = None

    @classmethod
    @abc.abstractmethod
    def probe(cls, device: Device) -> str | None:
        """Why this backend cannot load to ``device`` here, or None when it can."""

    @classmethod
    def auto_skip(cls, device: Device) -> str | None:
        """Why ``auto`` should prefer a later backend although this one can run (None: take it)."""
        return None

    def allocate(self, nbytes: int) -> Any:
        """A uint8 buffer of ``nbytes`` on the target device (the arena, or staging)."""
        return self.device.empty(nbytes)

    def prepare(self, paths: Sequence[str]) -> None:
        """Start, in the background, set-up that reading these files will need, while the load plans them
        (the staged reader pins its buffers then), or decide :attr:`maps_files` for them; by default nothing.
        ``open`` must not depend on it."""

    def open(self, plan: LoadPlan) -> None:
        """Prepare to read ``plan``'s files."""
        self.plan = plan

    @abc.abstractmethod
    def read(self, extents: Sequence[Extent], dsts: Sequence[Any], progress: Progress | None = None) -> None:
        """Copy every extent into its buffer; return once the bytes are there (device work synchronized)."""

    def submit(
        self, extents: Sequence[Extent], dsts: Sequence[Any], progress: Progress | None = None
    ) -> Callable[[], None]:
        """Start copying ``extents`` into their buffers; returns the function that waits for them.

        Backends that can keep reads in flight across calls (``pinned``, ``cufile``) override
        this, so the compressed pipeline keeps its next staging groups in flight while it waits for
        the oldest; by default the copy happens here and the waiter has nothing left to do.
        """
        self.read(extents, dsts, progress)
        return lambda: None

    @abc.abstractmethod
    def io_modes(self) -> list[str]:
        """The I/O mode that really ran, per file of the plan (see ``IO_MODES``)."""

    def direct_io(self) -> list[bool]:
        """Whether each file was read with O_DIRECT (bypassing the page cache)."""
        assert self.plan is not None
        return [False] * len(self.plan.files)

    def file_readers(self) -> list[str]:
        """What moved each file's bytes, for the report (``FileReport.reader``); by default the backend's name."""
        assert self.plan is not None
        return [self.name] * len(self.plan.files)

    def file_buffers(self) -> list[Any]:
        """For a mapping backend, the buffers of ``plan.mapped``'s files, in that order."""
        return []

    def close(self) -> None:
        """Close files and release buffers the backend holds beyond the arena."""


def extent_slice(dsts: Sequence[Any], e: Extent) -> Any:
    """The part of ``e``'s destination buffer that ``e`` fills."""
    return dsts[e.buffer][e.offset : e.offset + e.length]


def backend_class(name: str) -> type[Backend]:
    if not is_backend(name):
        raise ConfigError(f"backend {name!r} is not known; choose one of {['auto', *_REGISTRY]}")
    module, attr = _REGISTRY[name].target.split(":")
    return getattr(importlib.import_module(module), attr)


def _unavailable(cls: type[Backend], device: Device) -> str | None:
    if cls.needs_torch and not device.uses_torch:
        return f"it runs on torch devices, and {device} is driven without torch"
    return cls.probe(device)


def select_backend(name: str, device: Device | Any, options: ReadOptions) -> Backend:
    """Instantiate the backend ``name`` (or the first one that can run, for ``"auto"``) for ``device``
    (a :class:`~gdsload.loader.devices.Device`, or a torch device)."""
    from ..devices import as_device

    device = as_device(device)
    if name != "auto":
        cls = backend_class(name)
        reason = _unavailable(cls, device)
        if reason is not None:
            raise BackendUnavailableError(
                f"backend {name!r} cannot load to {str(device)!r} here: {reason}; "
                "use backend='auto' to pick one that can"
            )
        return cls(device, options)
    skipped = []
    for candidate in auto_order():
        if device.kind not in _REGISTRY[candidate].kinds:
            reason = f"it does not load to {device.kind} devices"
            log.debug("backend %s skipped: %s", candidate, reason)
            skipped.append(f"{candidate}: {reason}")
            continue
        try:
            cls = backend_class(candidate)
            # auto_skip first: it can rule a backend out more cheaply than probing it (cufile without GDS).
            reason = cls.auto_skip(device) or _unavailable(cls, device)
        except ImportError as e:
            reason = f"cannot import it ({e})"
        if reason is None:
            backend = cls(device, options)
            backend.picked_by_auto = True
            return backend
        log.info("backend %s skipped: %s", candidate, reason)
        skipped.append(f"{candidate}: {reason}")
    raise BackendUnavailableError(f"no backend can load to {str(device)!r} here ({'; '.join(skipped)})")


def wait_preads(plan: LoadPlan, futures: Sequence[tuple[Extent, object]], progress: Progress | None) -> None:
    """Wait for kvikio ``pread`` futures, one per extent; a short read means the file shrank. Every read is
    waited for, even after one failed (they write into the load's buffers until done); then the first error
    is raised."""
    first: Exception | None = None
    for e, fut in futures:
        try:
            got = fut.get()  # type: ignore[attr-defined]
        except Exception as err:
            first = first or err
            continue
        if got != e.length:
            first = first or TruncatedFileError(
                f"{plan.files[e.file_index].path!r}: read {got} of {e.length} bytes at "
                f"{e.file_offset}; the file shrank while it was being loaded"
            )
        elif progress is not None and first is None:
            progress(e.length)
    if first is not None:
        raise first
