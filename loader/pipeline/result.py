"""What a load hands back: tensors (views into the rank's arena, or the caller's own) and a timing report."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, NamedTuple

from ..config import format_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["PHASES", "FileReport", "LoadReport", "Slot", "LoadResult"]

PHASES = ("import", "plan", "setup", "read", "decode", "place", "verify", "teardown")
"""The laps of a load, in order. ``import`` is the first use of the device's libraries in this process (torch's
import for a torch device): the interpreter's cost, not the load's, so GB/s leave it out."""
"""The phases of a load, in order; they add up to its wall time from the call to the return.

``plan``: find the files, parse and check every header, lay out the arena; ``setup``: pick the
reader, allocate the arena, open the files; ``read``: until the last byte is read; ``decode``:
the decoding left after the last read; ``place``: misaligned tensors moved to aligned places,
tensors made; ``verify``: digests and checksums (when asked for); ``teardown``: files closed,
reader buffers released."""


class FileReport(NamedTuple):
    path: str
    io_mode: str
    """The I/O mode that really ran for this file: gds, p2pdma, compat, posix or cpu."""
    stored_bytes: int
    logical_bytes: int
    tensors: int
    copied_tensors: int
    """Misaligned tensors that had to be copied instead of viewed."""
    data_aligned: bool
    """Data section starts on a 4096-byte boundary (O_DIRECT/GDS friendly)."""
    direct_io: bool = False
    """Read with O_DIRECT (bypassing the page cache)."""
    compressed_tensors: int = 0
    reader: str = ""
    """What moved the file's bytes: ``staged`` (gdsload's staged reader), ``kvikio``, ``ring`` (Python threads),
    ``fastsafetensors`` (its reader), ``cufile``, or the backend's name for backends with one way to read."""
    checked_tensors: int = 0
    """Tensors of this file whose loaded bytes were checked (see ``checked_by``)."""
    checked_by: str = ""
    """What checked them, e.g. ``crc32 (cuda:0, nvCOMP)`` or ``crc32 of decoded bytes``; empty: nothing."""


class LoadReport:
    """How one rank's load went: its files, and the wall time of each phase (:data:`PHASES`)."""

    FIELDS = (
        "rank",
        "device",
        "backend",
        "source",
        "files",
        "phases",
        "verified",
        "decode_busy_seconds",
        "staging_bytes",
        "direct_tensors",
        "verification",
    )
    """The constructor's arguments, which are also the report's attributes."""

    def __init__(
        self,
        rank: int,
        device: str,
        backend: str,
        source: str,
        files: list[FileReport],
        phases: dict[str, float] | None = None,
        verified: bool = False,
        decode_busy_seconds: float = 0.0,
        staging_bytes: int = 0,
        direct_tensors: int = 0,
        verification: dict[str, Any] | None = None,
    ) -> None:
        self.rank = rank
        self.device = device
        self.backend = backend
        self.source = source
        """How the rank's files were found (``manifest``, ``vllm``, ``trtllm``, ``plain``, ...)."""
        self.files = files
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0) if phases is None else phases
        self.verified = verified
        """Every tensor of the load was checked against what its file records (``verification`` says how)."""
        self.verification: dict[str, Any] = {"mode": "off"} if verification is None else verification
        """What the verify phase checked and how: its mode, tensors checked and not, and on what."""
        self.decode_busy_seconds = decode_busy_seconds
        """Time spent decoding compressed tensors, most of it hidden behind reads."""
        self.staging_bytes = staging_bytes
        """Staging memory used for compressed bytes (on the target device)."""
        self.direct_tensors = direct_tensors
        """Tensors read (or decoded) straight into the caller's own destinations (``into``)."""

    def __repr__(self) -> str:
        return f"LoadReport({self.summary()})"

    @property
    def logical_bytes(self) -> int:
        return sum(f.logical_bytes for f in self.files)

    @property
    def stored_bytes(self) -> int:
        return sum(f.stored_bytes for f in self.files)

    @property
    def seconds(self) -> float:
        """Wall time of the whole call (the phases add up to it)."""
        return sum(self.phases.values())

    @property
    def load_seconds(self) -> float:
        """The load's own time: the whole call less the ``import`` phase."""
        return self.seconds - self.phases.get("import", 0.0)

    @property
    def gbps(self) -> float:
        """Logical GB (1e9 bytes) per second of the load's own time (:attr:`load_seconds`)."""
        return self.logical_bytes / self.load_seconds / 1e9 if self.load_seconds > 0 else 0.0

    @property
    def io_modes(self) -> str:
        counts = Counter(f.io_mode for f in self.files)
        return ",".join(sorted(counts))

    @property
    def readers(self) -> str:
        return ",".join(sorted({f.reader for f in self.files if f.reader}))

    def summary(self) -> str:
        """``rank 0: 1.07 GB in 0.512 s (2.09 GB/s) backend=cpu io=cpu files=4``"""
        imported = self.phases.get("import", 0.0)
        after = f" (+{imported:.3f} s importing the device's libraries first)" if imported >= 0.001 else ""
        line = (
            f"rank {self.rank}: {format_bytes(self.logical_bytes)} in {self.load_seconds:.3f} s ({self.gbps:.2f} GB/s)"
            f"{after} backend={self.backend} io={self.io_modes} files={len(self.files)}"
        )
        if self.readers and self.readers != self.backend:
            line += f" reader={self.readers}"
        copied = sum(f.copied_tensors for f in self.files)
        if copied:
            line += f" copied={copied}"
        if self.direct_tensors:
            line += f" direct={self.direct_tensors}"
        if self.stored_bytes and self.stored_bytes != self.logical_bytes:
            line += f" ratio={self.logical_bytes / self.stored_bytes:.2f}"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "device": self.device,
            "backend": self.backend,
            "source": self.source,
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "seconds": self.seconds,
            "load_seconds": self.load_seconds,
            "gbps": self.gbps,
            "phases": dict(self.phases),
            "verified": self.verified,
            "verification": dict(self.verification),
            "decode_busy_seconds": self.decode_busy_seconds,
            "staging_bytes": self.staging_bytes,
            "direct_tensors": self.direct_tensors,
            "compression_ratio": self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0,
            "files": [f._asdict() for f in self.files],
        }


class Slot(NamedTuple):
    """Where one tensor of a result lives: ``offset`` into the arena (``buffer`` 0) or a caller's target."""

    name: str
    dtype: str
    """safetensors dtype name (``BF16``, ``F32``, ...)."""
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    buffer: int = 0


class LoadResult:
    """The tensors of one rank and how they got there.

    ``tensors`` are views into ``arenas`` (one per rank) or the caller's own destinations
    (``into``); on a device driven without torch there are no tensors, and ``slots`` say where
    each one lies in the arena. Keep the result (or the tensors) alive while they are used;
    :meth:`close` drops every reference the result holds.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        arenas: list[Any],
        report: LoadReport,
        slots: list[Slot] | None = None,
        device: Any = None,
    ) -> None:
        self.tensors = tensors
        self.arenas = arenas
        self.report = report
        self.slots: list[Slot] = [] if slots is None else slots
        self.device = device
        """The :class:`~gdsload.loader.devices.Device` the rank was loaded to."""

    def __repr__(self) -> str:
        return f"LoadResult({len(self.tensors)} tensors, {len(self.slots)} slots, {self.report!r})"

    @property
    def arena(self) -> Any:
        """The rank's arena buffer (None once closed)."""
        return self.arenas[0] if self.arenas else None

    def close(self) -> None:
        self.tensors = {}
        self.arenas = []
        self.slots = []

    def __enter__(self) -> LoadResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
