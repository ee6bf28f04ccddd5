"""``load_rank``: the one load pipeline — plan → set up → read → decode → place → verify → tear down.

Every load runs through it: ``load_rank`` with torch (CPU or GPU), the sidecar's torch-free GPU
workers (a :class:`~gdsload.loader.devices.DriverDevice`), engine adapters reading straight into an
engine's parameters (``into``), and training-checkpoint loads. What differs is only the
:class:`~gdsload.loader.devices.Device` and the reader backend the call picks.

The report's phases (:data:`~gdsload.loader.pipeline.result.PHASES`) are laps of one clock started on
entry, so they add up to the call's wall time.

>>> result = load_rank("/models/llama-tp2", rank=1, device="cuda")  # doctest: +SKIP
>>> print(result.report.summary())  # doctest: +SKIP
rank 1: 8.03 GB in 0.410 s (19.59 GB/s) backend=pinned io=posix files=2
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..io import ReadOptions, select_backend
from .config import LoadConfig
from ..devices import Device, as_device
from ..format.compression import add_codec_lookup
from ..format.discovery import RankFiles, discover
from ..dtypes import from_torch
from ..config import format_bytes, gc_paused
from ..errors import ConfigError, DeviceMemoryError
from ..plan import Extent, FilePlan, LoadPlan, landing_groups, plan_rank
from .result import PHASES, FileReport, LoadReport, LoadResult, Slot

if TYPE_CHECKING:
    import torch

__all__ = ["load_rank", "file_report", "verify_digests"]

log = logging.getLogger(__name__)


def _codec_lookup(name: str) -> None:
    """A file names a codec not registered yet: the codec registry looks for it among the built-ins and
    other packages' entry points. Imported only then: a load of built-in codecs' files does not need it."""
    from ..codecs.registry import codec_names

    codec_names()  # registers every codec it can find; the file's is checked against them afterwards


add_codec_lookup(_codec_lookup)


class _Clock:
    """Laps of one clock: every moment from the start to the last lap belongs to exactly one phase."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str, *, hand_to: str | None = None, handed: float = 0.0) -> None:
        """End ``phase`` now; ``handed`` seconds of it are counted in ``hand_to`` instead."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + (now - self.last) - handed
        if hand_to is not None:
            self.phases[hand_to] = self.phases.get(hand_to, 0.0) + handed
        self.last = now


@gc_paused()  # a load's many small objects hold no cycles: collections during it would find nothing
def load_rank(
    path: str | os.PathLike[str],
    rank: int = 0,
    *,
    device: str | torch.device | Device = "cpu",
    backend: str | None = None,
    num_threads: int | None = None,
    chunk_bytes: int | None = None,
    verify: bool | None = None,
    pinned_bytes: int | None = None,
    staging_bytes: int | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    only: Collection[str] | None = None,
    opened: Mapping[str, int] | None = None,
    confine: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[LoadPlan], None] | None = None,
) -> LoadResult:
    """Load tensor-parallel rank ``rank`` of ``path`` onto ``device``.

    ``path`` is a model directory (``gdsload.json``, vLLM ``model-rank-R-part-P``, TRT-LLM
    ``rankR`` or plain ``*.safetensors``) or one ``.safetensors`` file. ``device`` is a torch
    device (``"cpu"``, ``"cuda:1"``) or a :class:`~gdsload.loader.devices.Device`
    (``DriverDevice(0)`` loads without torch). Options left as None come from ``GDSLOAD_*``
    environment variables, then defaults (see :class:`LoadConfig`).

    Every tensor is checked against the checksum its file records, on the bytes that were loaded
    (:mod:`~gdsload.loader.pipeline.verify`); ``verify=True`` also checks each file's manifest digest over
    the loaded bytes and fails on anything it cannot check, ``verify=False`` turns the checks off.
    ``result.report.verification`` says what was checked, and how.

    ``into`` maps tensor names to contiguous tensors of the same dtype and shape on ``device``
    (an engine's parameters): those are read, or decoded, straight into them, and take no arena
    memory; ``result.tensors`` then holds them themselves. ``only`` loads just the named tensors.
    ``opened`` maps some of the rank's file paths to descriptors the caller holds open (the file
    whose header it read), used instead of opening those paths again. ``progress`` is called with the
    byte count of each finished read; ``confine`` keeps every file open inside those directories (a
    symlink swapped in after a path was checked is refused at the open); ``on_plan`` once with the rank's
    :class:`~gdsload.loader.plan.LoadPlan`, before any data is read.

    >>> result = load_rank("/models/llama-tp2", rank=1, device="cpu")  # doctest: +SKIP
    >>> result.tensors["model.embed_tokens.weight"].shape  # doctest: +SKIP
    torch.Size([16032, 4096])
    """
    clock = _Clock()
    cfg = LoadConfig.resolve(
        backend=backend,
        num_threads=num_threads,
        chunk_bytes=chunk_bytes,
        verify=verify,
        pinned_bytes=pinned_bytes,
        staging_bytes=staging_bytes,
    )
    dev = as_device(device)
    clock.lap("import")  # a torch device's first use imports torch: the interpreter's cost, kept apart
    target_bufs, target_specs = _targets(into, dev)
    reader = select_backend(cfg.backend, dev, ReadOptions(cfg.num_threads, cfg.chunk_bytes, cfg.pinned_bytes))
    clock.lap("setup")
    rank_files = discover(path, rank)
    reader.prepare(rank_files.files)  # e.g. the staged reader pins its buffers while the headers are read
    plan = plan_rank(
        rank_files, targets=target_specs, only=only, map_files=reader.maps_files, opened=opened, confine=confine
    )
    verifier: Any = None

    def new_verifier() -> Any:
        from .verify import Verifier  # imported by the loads that check or count (none with verify off)

        return Verifier(plan, rank_files, cfg.verify)

    try:
        if on_plan is not None:
            on_plan(plan)
        clock.lap("plan")

        dev.activate()
        arena = _allocate(reader, plan, plan.arena_bytes)
        reader.open(plan)
        mapped = reader.file_buffers()
        dsts = [arena, *(target_bufs[name] for name in plan.targets), *mapped]
        groups: list[list[Extent]] = []
        # Files that record nothing to check (a Hugging Face download) are read as with verify off; what was
        # left unchecked is counted after the reads.
        checking = cfg.verify is True or (cfg.verify is None and (bool(plan.compressed) or _records_checksums(plan)))
        if checking and dev.kind != "cpu" and reader.landed_on_wait and not plan.compressed:
            groups = landing_groups(plan.extents)  # each checked as it lands (the checks set up once all are queued)
        elif checking:
            verifier = new_verifier()
            if dev.kind == "cpu":
                verifier.attach(dev, dsts)
                reader.on_chunk = verifier.on_chunk  # each read's bytes are checked by the thread that read them
            else:
                verifier.warm_up(dev)  # nvCOMP's CRC kernel checks them: its library loads during the reads
        clock.lap("setup")

        if groups:

            def checks() -> Any:
                v = new_verifier()
                v.warm_up(dev)
                v.attach_device(dev, dsts)
                return v

            verifier = _read_in_groups(reader, groups, dsts, progress, checks)
        else:
            # The compressed files' raw tensors are read with their compressed ones, where any are loaded (the
            # decode stage).
            reader.read(
                plan.extents if not plan.compressed else [e for f in plan.files if not f.compressed for e in f.extents],
                dsts,
                progress,
            )
        reader.on_chunk = None  # the decode stage reads into staging buffers of its own
        tail, busy, staged = 0.0, 0.0, 0
        if plan.compressed:  # the codecs are imported by the loads that need them
            from .decode import load_compressed

            stats = load_compressed(
                plan,
                reader,
                dsts,
                verify=cfg.verify is not False,
                staging_bytes=cfg.staging_bytes,
                progress=progress,
                threads=cfg.num_threads or 4,
            )
            tail, busy, staged = stats.tail_seconds, stats.decode_busy_seconds, stats.staging_bytes
        dev.synchronize()
        clock.lap("read", hand_to="decode", handed=tail)
        io_modes, direct, readers = reader.io_modes(), reader.direct_io(), reader.file_readers()

        for p in plan.placements:
            if p.copy_from is not None and p.nbytes:  # a misaligned tensor moves to its aligned place
                dev.copy(arena[p.offset : p.offset + p.nbytes], arena[p.copy_from : p.copy_from + p.nbytes])
        dev.synchronize()
        slots = [Slot(p.name, p.dtype, tuple(p.shape), p.offset, p.nbytes, p.buffer) for p in plan.placements]
        tensors: dict[str, Any] = {}
        if dev.uses_torch:
            targets = len(plan.targets)
            viewed = [s for s in slots if not 0 < s.buffer <= targets]
            tensors = dict(
                zip(
                    (s.name for s in viewed),
                    dev.views(dsts, [(s.buffer, s.offset, s.nbytes, s.dtype, s.shape) for s in viewed]),
                )
            )
            if targets:  # the caller's own destinations, in the plan's order
                tensors = {
                    s.name: into[s.name] if 0 < s.buffer <= targets else tensors[s.name]  # type: ignore[index]
                    for s in slots
                }
        clock.lap("place")

        if verifier is None and cfg.verify is not False:  # nothing recorded: the report says what went unchecked
            verifier = new_verifier()
        outcome = verifier.finish(dev, dsts, cfg.num_threads or 4) if verifier is not None else None
        clock.lap("verify")
    except BaseException:
        if verifier is not None:
            verifier.abandon()
        reader.close()
        plan.close()
        raise
    reader.close()
    plan.close()
    clock.lap("teardown")

    report = LoadReport(
        rank=rank,
        device=str(dev),
        backend=reader.name,
        source=rank_files.source,
        files=[
            file_report(f, mode, d, read_by)._replace(
                checked_tensors=outcome.checked[i] if outcome else 0, checked_by=outcome.how[i] if outcome else ""
            )
            for i, (f, mode, d, read_by) in enumerate(zip(plan.files, io_modes, direct, readers))
        ],
        phases={k: clock.phases.get(k, 0.0) for k in PHASES},
        verified=outcome.verified if outcome else False,
        verification=outcome.summary if outcome else {"mode": "off"},
        decode_busy_seconds=busy,
        staging_bytes=staged,
        direct_tensors=len(plan.targets),
    )
    log.info("%s%s", report.summary(), "" if dev.uses_torch else " (without torch)")
    return LoadResult(tensors=tensors, arenas=[arena, *mapped], report=report, slots=slots, device=dev)


def _records_checksums(plan: LoadPlan) -> bool:
    """Whether any file of the plan records checksums of its tensors (files gdsload wrote do)."""
    from ..format.checksums import METADATA_KEY

    return any(METADATA_KEY in f.header.metadata for f in plan.files)


def _read_in_groups(
    reader: Any,
    groups: Sequence[Sequence[Extent]],
    dsts: Sequence[Any],
    progress: Callable[[int], None] | None,
    checks: Callable[[], Any],
) -> Any:
    """Read ``groups`` of extents, all in flight at once; once they are queued, set up the ``checks()`` (their
    imports and set-up run while the first groups are read), and as each group lands (in order), hand it to
    their ``on_landed``. Returns the checks. Every group queued is waited for, even after a failure: its reads
    write into ``dsts`` until then."""
    waits: list[Callable[[], None]] = []
    error: BaseException | None = None
    checker: Any = None
    try:
        for g in groups:
            waits.append(reader.submit(g, dsts, progress))
        checker = checks()
    except BaseException as e:
        error = e
    for g, wait in zip(groups, waits):
        try:
            wait()
            if error is None:
                checker.on_landed(g)
        except BaseException as e:
            error = error or e
    if error is not None:
        if checker is not None:
            checker.abandon()
        raise error
    return checker


def _allocate(reader: Any, plan: LoadPlan, nbytes: int) -> Any:
    try:
        return reader.allocate(nbytes)
    except (MemoryError, RuntimeError, OverflowError, TypeError) as e:  # out of memory, or a size torch cannot take
        files = ", ".join(repr(f.path) for f in plan.files[:3]) + (", ..." if len(plan.files) > 3 else "")
        raise DeviceMemoryError(
            f"rank {plan.rank} needs {format_bytes(nbytes)} on {reader.device} for {files} and that cannot be "
            f"allocated ({type(e).__name__}: {str(e)[:200]}); free memory on the device, load fewer ranks at once, "
            "or check the files' sizes (a damaged header can claim far more than the file holds)"
        ) from None


def _targets(
    into: Mapping[str, Any] | None, dev: Device
) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[int, ...]]]]:
    """The caller's destinations as byte buffers, and the dtype and shape each must hold."""
    if not into:
        return {}, {}
    if not dev.uses_torch:
        raise ConfigError(f"into= takes torch tensors; {dev} is driven without torch")
    bufs: dict[str, Any] = {}
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, t in into.items():
        where = f"into[{name!r}]"
        if not hasattr(t, "is_contiguous"):
            raise ConfigError(f"{where} must be a torch tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ConfigError(
                f"{where} is not contiguous (strides {tuple(t.stride())}); pass contiguous "
                "storage, or leave the name out and copy the loaded tensor"
            )
        if t.device.type != dev.kind or (dev.index is not None and t.device.index not in (None, dev.index)):
            raise ConfigError(
                f"{where} is on {str(t.device)!r}, but the load goes to {dev}; give destinations on the load's device"
            )
        specs[name] = (from_torch(t.dtype), tuple(t.shape))
        bufs[name] = dev.bytes_of(t)
    return bufs, specs


def file_report(f: FilePlan, io_mode: str, direct_io: bool, reader: str = "") -> FileReport:
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
        reader=reader,
    )


def verify_digests(rank_files: RankFiles, plan: LoadPlan, arena: Any, device: Device) -> bool:
    """Check every file of a finished load against its manifest digest, computed over the loaded bytes (the header
    as parsed, the data section as the arena holds it); False when some file cannot be checked that way.

    :func:`load_rank` does this itself with ``verify=True`` (:mod:`gdsload.loader.pipeline.verify`); no path is
    read again, so a file replaced after it was loaded does not pass.
    """
    from .verify import Verifier

    v = Verifier(plan, rank_files, True)
    done = v._digests(device, [arena])
    return all(done)
