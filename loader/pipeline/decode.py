"""The decode stage: compressed bytes are read to the device and decode into their places.

On a GPU, a decoder thread decodes group after group with nvCOMP, on its own stream, as the reader
finishes them; each group's CRC-32 check (ANS) runs beside the next decode and is read back a group
later. Where the bytes wait between read and decode:

- **in place** (:func:`in_place`, where it applies): the compressed files' tensors are read, in groups in
  file order, into the top of the arena and decode from there into the tensors' places below. Every read
  is queued at once and the decoder follows; a group never decodes over stored bytes still to decode, and
  the last groups, which would, are read into a spill buffer of their own.
- **staging buffers** (loads into the caller's tensors, or a spill larger than ``staging_bytes``): three
  device buffers take turns. While the decoder works on group *i* in one, the backend reads groups *i+1*
  and *i+2* into the others; a buffer takes the next reads as soon as its group is decoded. With two
  buffers the reader would wait for each group's decode before it could start the group after next.

Groups hold at most a third of ``staging_bytes``; a tensor stored in chunks (``layout: chunks``, what
``gdsload compress`` writes) that does not fit in what is left of a group is read and decoded a run of
chunks at a time, over as many groups as it takes, so GPU memory peaks at the tensors plus at most
``staging_bytes`` whatever their sizes (a ``layout: native`` tensor larger than a group makes every
staging buffer its size). On the CPU, Zstd frames are decoded by ``zstandard`` in a thread pool
straight into place, from one buffer holding whole tensors. A tensor's place is its arena slot, or
the caller's own target (``into``).
"""

from __future__ import annotations

import bisect
import collections
import logging
import operator
import queue
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..io import Backend
from ..devices import Device, Stream
from ..errors import CodecError, DeviceMemoryError
from .config import DEFAULT_STAGING_BYTES
from ..plan import CompressedTensor, Extent, LoadPlan, align_up

if TYPE_CHECKING:
    from ..codecs import GpuCodecs

__all__ = ["DecodeStats", "load_compressed", "DEFAULT_STAGING", "STAGING_SLOTS"]

log = logging.getLogger(__name__)

STAGING_SLOTS = 3
"""Staging buffers the reads and the decoder take turns on; reads stay in flight in all but one."""
DEFAULT_STAGING = DEFAULT_STAGING_BYTES
"""The same as :data:`gdsload.loader.pipeline.config.DEFAULT_STAGING_BYTES` (a load's ``staging_bytes``)."""
_ALIGN = 4096


class DecodeStats:
    """What the decode stage measured; filled in as it runs."""

    __slots__ = ("read_seconds", "tail_seconds", "decode_busy_seconds", "stored_bytes", "staging_bytes")

    def __init__(self, stored_bytes: int = 0) -> None:
        self.read_seconds = 0.0
        """Wall time until the last compressed byte was read."""
        self.tail_seconds = 0.0
        """Wall time after that until the last decode finished (the part not hidden behind reads)."""
        self.decode_busy_seconds = 0.0
        """Time the decoder spent decoding (mostly overlapped with reads)."""
        self.stored_bytes = stored_bytes
        self.staging_bytes = 0
        """GPU memory the stored bytes took besides the arena (spill or staging buffers)."""


class _Piece(NamedTuple):
    """What one tensor puts in a staging group: its stored chunks ``first:stop`` (``stop=None``: through
    the last; the whole tensor when ``first`` is 0 too), ``nbytes`` stored bytes from ``start``, relative to
    the tensor's stored bytes."""

    tensor: CompressedTensor
    start: int
    nbytes: int
    first: int = 0
    stop: int | None = None


def _splits(t: CompressedTensor, split: bool) -> bool:
    """Whether ``t`` may be read and decoded a run of chunks at a time (chunked layouts, on a GPU)."""
    return split and t.entry.layout == "chunks" and len(t.entry.chunks) > 1


def _unit(t: CompressedTensor, split: bool) -> int:
    """The most staging ``t`` needs at once: its largest chunk when it splits, else all of it."""
    if _splits(t, split):
        return align_up(max(t.entry.chunks), _ALIGN)
    return align_up(t.entry.stored_bytes, _ALIGN)


def _chunk_ends(starts: Sequence[int], sizes: Sequence[int]) -> array[int]:
    """Where each chunk's stored bytes end, from a :meth:`chunk_table`'s offsets and sizes."""
    return array("q", map(operator.add, starts, sizes))


def _chunk_run(t: CompressedTensor, starts: Sequence[int], ends: Sequence[int], first: int, limit: int) -> _Piece:
    """The run of ``t``'s chunks from ``first`` on whose stored bytes end by ``limit`` (offsets within the
    tensor's stored bytes, from its :meth:`chunk_table`), at least one chunk."""
    stop = max(first + 1, bisect.bisect_right(ends, limit))
    start, end = starts[first], ends[stop - 1]
    return _Piece(t, start, end - start, first, None if stop == len(ends) else stop)


def _groups(
    tensors: tuple[CompressedTensor, ...], staging: int, *, split: bool = False
) -> list[list[tuple[_Piece, int]]]:
    """Pack tensors (in file order) into groups of at most ``staging`` bytes, each piece with its staging
    offset (a 4 KiB boundary). With ``split``, a chunked tensor that does not fit in what is left of a
    group fills it with its first chunks and goes on in the next groups; otherwise it starts a group of
    its own (every tensor fits in an empty group: ``staging`` is at least :func:`_unit`)."""
    groups: list[list[tuple[_Piece, int]]] = []
    used = staging  # forces a new group first

    def room_for(n: int) -> None:
        nonlocal used
        if used + n > staging and (not groups or groups[-1]):
            groups.append([])
            used = 0

    for t in tensors:
        n = align_up(t.entry.stored_bytes, _ALIGN)
        if used + n <= staging or not _splits(t, split):
            room_for(n)
            groups[-1].append((_Piece(t, 0, t.entry.stored_bytes), used))
            used += n
            continue
        starts, sizes, _, _ = t.entry.chunk_table()
        ends = _chunk_ends(starts, sizes)
        first = 0
        while first < len(sizes):
            room_for(align_up(sizes[first], _ALIGN))
            piece = _chunk_run(t, starts, ends, first, starts[first] + staging - used)  # what fits in the room left
            groups[-1].append((piece, used))
            used += align_up(piece.nbytes, _ALIGN)
            first = len(sizes) if piece.stop is None else piece.stop
    return [g for g in groups if g]


def _extents(group: list[tuple[_Piece, int]]) -> list[Extent]:
    """The reads that fill a group's staging, one per piece."""
    return [Extent(p.tensor.file_index, p.tensor.file_offset + p.start, p.nbytes, off) for p, off in group]


class _Run:
    """A group of the in-place schedule: tensors, and runs of a tensor's chunks, of the rank's compressed files
    in file order, read into the arena's top (or the spill buffer) where they decode from. Its bytes lie from
    stream offset ``start`` to ``end``: the compressed files' tensors one after the other, each from a multiple
    of :data:`_STREAM_ALIGN`."""

    __slots__ = ("start", "end", "pieces", "copies", "out_end")

    def __init__(self, start: int):
        self.start = self.end = start
        self.pieces: list[tuple[_Piece, int]] = []
        """Compressed pieces and the stream offset of each."""
        self.copies: list[tuple[Extent, int]] = []
        """Tensors stored raw (the extent that would read one into its slot) and the stream offset of each."""
        self.out_end = 0
        """The end of the highest arena range this group decodes or copies into."""

    def add(self, start: int, nbytes: int, out_end: int) -> None:
        self.end = max(self.end, start + nbytes)
        self.out_end = max(self.out_end, out_end)

    def reads(self, at: int) -> list[Extent]:
        """Its reads, into a buffer where its first byte (stream offset ``start``) lies at ``at``."""
        shift = at - self.start
        return [
            *(Extent(p.tensor.file_index, p.tensor.file_offset + p.start, p.nbytes, s + shift) for p, s in self.pieces),
            *(Extent(e.file_index, e.file_offset, e.length, s + shift) for e, s in self.copies),
        ]


class _InPlace(NamedTuple):
    """Where the in-place schedule puts each group: groups before ``split`` in the arena (stream offset ``s``
    at arena offset ``base + s``), the rest in a spill buffer of ``spill`` bytes (at ``s - spill_from``)."""

    runs: list[_Run]
    base: int
    split: int
    spill: int
    spill_from: int


_MIN_RUN = 64 << 20
"""The smallest group the in-place schedule makes, but for the last: the groups get smaller towards the end of
the rank (a quarter of what is left), so that little is left to decode after the last read. Not smaller: a
group costs the decoder about a millisecond besides its decode, and 64 MiB takes about as long to read."""
_STREAM_ALIGN = 256
"""Each tensor's stored bytes start at a multiple of this in the in-place stream, or of its chunks' alignment
where that is more (nvCOMP's ANS chunks need 16 bytes)."""


def _stream_runs(plan: LoadPlan, files: list[int], group_bytes: int, align: int) -> list[_Run]:
    """Cut the compressed files of ``plan`` (``files``, every tensor of each going to the arena) into groups
    of whole tensors and runs of chunks, in file order, at most ``group_bytes`` each, smaller towards the end
    (see :data:`_MIN_RUN`); a tensor that cannot be split is a group of its own where it does not fit. Each
    tensor starts at a multiple of ``align`` in the stream."""
    items: list[Any] = sorted(
        [*(e for i in files for e in plan.files[i].extents), *plan.compressed],
        key=lambda x: (x.file_index, x.file_offset),
    )
    total = sum(align_up(x.length if isinstance(x, Extent) else x.entry.stored_bytes, align) for x in items)
    runs: list[_Run] = []
    at = 0  # the stream offset of the next tensor

    def room(start: int) -> int:
        """Bytes the group starting at stream offset ``start`` may hold."""
        return min(group_bytes, max(_MIN_RUN, (total - start) // 4))

    def group_for(start: int, nbytes: int) -> _Run:
        """The group that takes ``nbytes`` from ``start`` on: the last, or a new one where they do not fit."""
        if not runs or (runs[-1].pieces or runs[-1].copies) and start + nbytes - runs[-1].start > room(runs[-1].start):
            runs.append(_Run(start))
        return runs[-1]

    for x in items:
        at = align_up(at, align)
        if isinstance(x, Extent):  # stored raw: copied from the stream into its slot
            r = group_for(at, x.length)
            r.copies.append((x, at))
            r.add(at, x.length, x.offset + x.length)
            at += x.length
            continue
        t: CompressedTensor = x
        n = t.entry.stored_bytes
        if not _splits(t, True) or (runs and at + n - runs[-1].start <= room(runs[-1].start)):
            r = group_for(at, n)
            r.pieces.append((_Piece(t, 0, n), at))
            r.add(at, n, t.offset + t.entry.nbytes)
            at += n
            continue
        starts, sizes, dec_at, dec_len = t.entry.chunk_table()
        ends = _chunk_ends(starts, sizes)
        first = 0
        while first < len(sizes):
            r = group_for(at + starts[first], sizes[first])
            piece = _chunk_run(t, starts, ends, first, r.start + room(r.start) - at)  # what ends within its room
            stop = len(sizes) if piece.stop is None else piece.stop
            r.pieces.append((piece, at + piece.start))
            r.add(at + piece.start, piece.nbytes, t.offset + dec_at[stop - 1] + dec_len[stop - 1])
            first = stop
        at += n
    return runs


def in_place(plan: LoadPlan, staging_bytes: int) -> _InPlace | None:
    """The in-place schedule of ``plan`` on a GPU, or None where it does not apply.

    The compressed files' tensors are read, one after the other in file order, into the top of the arena, where
    nothing has been decoded yet; each group decodes from there into the tensors' places below it, and
    never into the stored bytes of itself or of a later group (its decoded data ends below where its own
    stored bytes start). Reads so never wait for the decoder, and staging takes no memory of its own. The
    last groups, whose decoded data would reach over their own stored bytes, go to a spill buffer instead:
    about the size of the last group for files compressed evenly.

    None where a compressed tensor goes to the caller's buffers (``into``), and where the spill would exceed
    ``staging_bytes``: those loads go through staging buffers.
    """
    if any(t.buffer for t in plan.compressed) or any(e.buffer for f in plan.files if f.compressed for e in f.extents):
        return None
    files = [i for i, f in enumerate(plan.files) if f.compressed]
    # Stored bytes keep their chunks' alignment in the arena and the spill buffer, whose starts are multiples of it.
    align = max(_STREAM_ALIGN, *(t.entry.chunk_align for t in plan.compressed))
    page = max(_ALIGN, align)
    runs = _stream_runs(plan, files, max(staging_bytes // STAGING_SLOTS // _ALIGN * _ALIGN, _ALIGN), align)
    if not runs:
        return None
    # The arena below the stored bytes must stay clear of what the uncompressed files read into it. Above it lie
    # the slots of tensors a foreign file holds misaligned: the load copies them there after the decode stage.
    floor = max(
        (e.offset + e.length for f in plan.files if not f.compressed for e in f.extents if e.buffer == 0), default=0
    )
    top = plan.arena_bytes
    need = 0  # the lowest base that keeps every group so far clear of its own and later stored bytes
    best: tuple[int, int] = (0, 0)  # (groups in the arena, base)
    for k in range(len(runs) + 1):
        end = runs[k].start if k < len(runs) else runs[-1].end
        base = (top - end) // page * page
        if base < max(floor, need):
            break
        best = (k, base)
        if k < len(runs):
            need = max(need, runs[k].out_end - runs[k].start)
    split, base = best
    if split == len(runs):
        return _InPlace(runs, base, split, 0, 0)
    spill_from = runs[split].start // page * page
    spill = align_up(runs[-1].end - spill_from, page)
    if spill > staging_bytes:
        return None
    return _InPlace(runs, base, split, spill, spill_from)


def load_compressed(
    plan: LoadPlan,
    reader: Backend,
    dsts: list[Any],
    *,
    verify: bool,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    progress: Callable[[int], None] | None = None,
    threads: int = 4,
) -> DecodeStats:
    """Read and decode every compressed tensor of ``plan`` into its place in ``dsts``, and read the tensors
    its compressed files store raw (the load reads the other files).

    ``dsts`` are the load's buffers on ``reader.device``: the arena first, then the caller's targets
    (``plan.targets``); staging comes from ``reader.allocate``. On a GPU the stored bytes go to the top of the
    arena where they can (:func:`in_place`), else through staging buffers.
    """
    stats = DecodeStats(stored_bytes=sum(t.entry.stored_bytes for t in plan.compressed))
    if not plan.compressed:
        return stats
    t0 = time.perf_counter()
    if reader.device.kind == "cpu":
        _decode_on_cpu(
            plan,
            reader,
            dsts,
            stats,
            verify=verify,
            staging_bytes=staging_bytes,
            progress=progress,
            threads=threads,
            t0=t0,
        )
        return stats
    layout = in_place(plan, staging_bytes) if IN_PLACE else None
    if layout is not None:
        groups, nslots = _in_place_groups(plan, reader, dsts, layout, stats)
    else:
        groups, nslots = _staged_groups(plan, reader, dsts, staging_bytes, stats, progress)
    _run_groups(plan, reader, groups, nslots, stats, verify=verify, progress=progress, t0=t0)
    return stats


class _Group(NamedTuple):
    """A group as the GPU decoder's schedule takes it: its reads into ``dsts``, and ``jobs()``, what decodes
    from where once they are done (its :class:`~gdsload.loader.codecs.DecodeJob` list, and the ``(dst, src)``
    device copies of its raw tensors)."""

    reads: list[Extent]
    dsts: list[Any]
    jobs: Callable[[], tuple[list[Any], list[tuple[Any, Any]]]]


def _place(dsts: list[Any], t: CompressedTensor) -> Any:
    return dsts[t.buffer][t.offset : t.offset + t.entry.nbytes]


def _staging(reader: Backend, nbytes: int, path: str, what: str) -> Any:
    try:
        return reader.allocate(nbytes)
    except (MemoryError, RuntimeError) as e:
        raise DeviceMemoryError(
            f"{path!r}: {what} cannot be allocated on {reader.device} ({type(e).__name__}: "
            f"{str(e)[:200]}); free memory on the device"
        ) from None


def _read_raw(plan: LoadPlan, reader: Backend, dsts: list[Any], progress: Callable[[int], None] | None) -> None:
    """Read the tensors the compressed files store raw straight into their places (the staging schedules)."""
    raw = [e for f in plan.files if f.compressed for e in f.extents]
    if raw:
        reader.read(raw, dsts, progress)


def _buffer_bytes(plan: LoadPlan, staging_bytes: int, split: bool) -> int:
    """The size of each staging buffer: a third of ``staging_bytes``, or what the largest tensor needs at once."""
    return max(staging_bytes // STAGING_SLOTS // _ALIGN * _ALIGN, _ALIGN, max(_unit(t, split) for t in plan.compressed))


def _decode_on_cpu(
    plan: LoadPlan,
    reader: Backend,
    dsts: list[Any],
    stats: DecodeStats,
    *,
    verify: bool,
    staging_bytes: int,
    progress: Callable[[int], None] | None,
    threads: int,
    t0: float,
) -> None:
    """Zstd on the CPU: whole tensors read into one buffer, then decoded straight into place, in turns."""
    from ..codecs import cpu_decode

    device = reader.device
    _read_raw(plan, reader, dsts, progress)
    staging = _buffer_bytes(plan, staging_bytes, False)
    buf = reader.allocate(staging)
    stats.staging_bytes = staging
    view = device.host_memoryview(buf)
    outs = [device.host_memoryview(d) for d in dsts]
    for group in _groups(plan.compressed, staging):
        reader.read(_extents(group), [buf], progress)
        d = time.perf_counter()
        for p, off in group:
            t = p.tensor
            cpu_decode(
                t.entry,
                view[off : off + t.entry.stored_bytes],
                outs[t.buffer][t.offset : t.offset + t.entry.nbytes],
                verify=verify,
                path=plan.files[t.file_index].path,
                threads=threads,
            )
        stats.decode_busy_seconds += time.perf_counter() - d
    # Reads and decodes take turns here: none of the decoding hides behind reads.
    stats.tail_seconds = stats.decode_busy_seconds
    stats.read_seconds = time.perf_counter() - t0 - stats.tail_seconds


def _in_place_groups(
    plan: LoadPlan, reader: Backend, dsts: list[Any], layout: _InPlace, stats: DecodeStats
) -> tuple[list[_Group], int]:
    """The groups of the in-place schedule, each in a buffer of its own (none is reused: every read is queued
    at once), the spill buffer allocated."""
    arena = dsts[0]
    spill = (
        _staging(reader, layout.spill, plan.files[0].path, f"{layout.spill} bytes of staging") if layout.spill else None
    )
    stats.staging_bytes = layout.spill
    paths = [f.path for f in plan.files]

    def where(k: int, s: int) -> tuple[Any, int]:
        """The buffer group ``k`` lies in, and where stream offset ``s`` is in it."""
        return (arena, layout.base + s) if k < layout.split else (spill, s - layout.spill_from)

    def group(k: int) -> _Group:
        r = layout.runs[k]
        buf, at = where(k, r.start)

        def jobs() -> tuple[list[Any], list[tuple[Any, Any]]]:
            from ..codecs import DecodeJob

            out = [
                DecodeJob(
                    p.tensor.entry,
                    buf[o : o + p.nbytes],
                    _place(dsts, p.tensor),
                    paths[p.tensor.file_index],
                    p.first,
                    p.stop,
                )
                for p, o in ((p, where(k, s)[1]) for p, s in r.pieces)
            ]
            copies = [
                (dsts[e.buffer][e.offset : e.offset + e.length], buf[o : o + e.length])
                for e, o in ((e, where(k, s)[1]) for e, s in r.copies)
            ]
            return out, copies

        return _Group(r.reads(at), [buf], jobs)

    return [group(k) for k in range(len(layout.runs))], len(layout.runs)


def _staged_groups(
    plan: LoadPlan,
    reader: Backend,
    dsts: list[Any],
    staging_bytes: int,
    stats: DecodeStats,
    progress: Callable[[int], None] | None,
) -> tuple[list[_Group], int]:
    """The groups of the staging schedule, group ``i`` in staging buffer ``i % 3``, the buffers allocated and
    the compressed files' raw tensors read."""
    _read_raw(plan, reader, dsts, progress)
    paths = [f.path for f in plan.files]
    staging = _buffer_bytes(plan, staging_bytes, True)
    groups = _groups(plan.compressed, staging, split=True)
    nslots = min(STAGING_SLOTS, len(groups))
    slots = [
        _staging(reader, staging, paths[0], f"{STAGING_SLOTS} staging buffers of {staging} bytes")
        for _ in range(nslots)
    ]
    stats.staging_bytes = staging * nslots

    def group(i: int) -> _Group:
        pieces, slot = groups[i], slots[i % nslots]

        def jobs() -> tuple[list[Any], list[tuple[Any, Any]]]:
            from ..codecs import DecodeJob

            return [
                DecodeJob(
                    p.tensor.entry,
                    slot[off : off + p.nbytes],
                    _place(dsts, p.tensor),
                    paths[p.tensor.file_index],
                    p.first,
                    p.stop,
                )
                for p, off in pieces
            ], []

        return _Group(_extents(pieces), [slot], jobs)

    return [group(i) for i in range(len(groups))], nslots


IN_PLACE = True
"""Whether GPU loads use the in-place schedule where it applies (:func:`in_place`); staging buffers otherwise."""


def _run_groups(
    plan: LoadPlan,
    reader: Backend,
    groups: list[_Group],
    nslots: int,
    stats: DecodeStats,
    *,
    verify: bool,
    progress: Callable[[int], None] | None,
    t0: float,
) -> None:
    """Read ``groups`` and decode each on a GPU decoder thread once read. Group ``i`` reads into buffer
    ``i % nslots`` (see :func:`_pipeline`), which it may take only once the decoder is done with the group
    before it there: staging buffers take turns (three), while in place every group has its own place
    (``nslots`` is the number of groups), so every read is queued at once."""
    device = reader.device
    paths = [f.path for f in plan.files]
    free = [threading.Event() for _ in range(nslots)]
    for ev in free:
        ev.set()
    work: queue.Queue = queue.Queue()
    errors: list[BaseException] = []

    def decoder() -> None:
        # Started once the first groups' reads are under way: the codecs (and nvCOMP) are imported here
        # while the reader fills staging, instead of before its first read.
        try:
            from ..codecs import GpuCodecs, nvcomp_available
            from ..codecs.registry import codec

            cpu_only = next((t for t in plan.compressed if not codec(t.entry.codec).gpu), None)
            if cpu_only is not None:
                raise CodecError(
                    f"{paths[cpu_only.file_index]!r}: tensor {cpu_only.entry.name!r} is compressed with "
                    f"{cpu_only.entry.codec!r}, which decodes on the CPU only; load it with device='cpu', or "
                    "compress the model with a codec nvCOMP decodes (ans, zstd)"
                )
            # A batch decoder's chunks go through nvCOMP's C API alone, which also leaves GPU 0 alone.
            c_api_only = all(codec(t.entry.codec).batch_decoder and t.entry.layout == "chunks" for t in plan.compressed)
            reason = nvcomp_available(library_only=c_api_only)
            if reason is not None:
                raise CodecError(
                    f"{paths[plan.compressed[0].file_index]!r} holds compressed tensors but nvCOMP cannot run: {reason}"
                )
            if not c_api_only:
                _warn_if_other_gpus(device)
            stream = device.stream()
            codecs = GpuCodecs(device, stream.handle, verify=verify)
        except BaseException as e:  # no decoder: say why, and let the reader stop instead of waiting on slots
            errors.append(e)
            for ev in free:
                ev.set()
            while work.get() is not None:
                pass
            return
        try:
            decode_groups(codecs, stream)
            if not errors:
                codecs.finish()  # the last group's CRC-32 check
        except BaseException as e:
            errors.append(e)
        finally:
            stream.synchronize()
            codecs.close()

    def decode_groups(codecs: GpuCodecs, stream: Stream) -> None:
        while True:
            item = work.get()
            if item is None:
                return
            i, k = item
            d = time.perf_counter()
            released = False  # the slot is handed back once: the reader clears it again when it refills it
            try:
                if not errors:
                    jobs, copies = groups[i].jobs()
                    with stream.activate():
                        codecs.decode_many(jobs)
                    for dst, src in copies:  # on the decoder's stream: before a later group's decode overwrites src
                        codecs.copy(dst, src)
                    stream.synchronize()
                    # Decoded: the slot takes the next reads while this group's CRC-32 check runs on.
                    free[k].set()
                    released = True
                    codecs.finish(but_last=True)
                    if verify:
                        for j in jobs:
                            if j.ends and j.entry.layout == "chunks" and not codecs.checked_on_device(j.entry):
                                _check_decoded(codecs, device, j)
            except BaseException as e:
                errors.append(e)
            finally:
                stats.decode_busy_seconds += time.perf_counter() - d
                if not released:
                    free[k].set()

    thread = threading.Thread(target=decoder, name="gdsload-decode", daemon=True)

    def submit(i: int, k: int) -> Callable[[], None]:
        wait = reader.submit(groups[i].reads, groups[i].dsts, progress)
        if i == nslots - 1:
            # The decoder sets up while the first groups are read. It starts once they are all queued:
            # its imports hold the GIL, and would hold up the submits for up to a switch interval (5 ms).
            try:
                thread.start()
            except BaseException:
                wait()  # not yet among the reads _pipeline waits for
                raise
        return wait

    try:
        _pipeline(len(groups), free, submit, lambda i, k: work.put((i, k)), errors)
        stats.read_seconds = time.perf_counter() - t0
    finally:
        work.put(None)
        if thread.ident is not None:
            thread.join()
    stats.tail_seconds = time.perf_counter() - t0 - stats.read_seconds
    if errors:
        raise errors[0]


def _check_decoded(codecs: GpuCodecs, device: Device, job: Any) -> None:
    """Check a decoded tensor's ``crc32`` on the GPU (nvCOMP's CRC kernel), or from a host copy without it."""
    from ..codecs import check_crc32

    entry, where = job.entry, f"{job.path!r}: tensor {job.entry.name!r}"
    if entry.crc32 is None or not entry.nbytes:
        return
    got = codecs.crcs([(device.address(job.dst), entry.nbytes)], where)
    if got is None:
        check_crc32(entry, device.to_host(job.dst), where)
    elif got[0] != entry.crc32:
        raise CodecError(
            f"{where}: decoded bytes have CRC-32 {got[0]:#010x} where the file records "
            f"{entry.crc32:#010x}; the file is corrupt"
        )


_WARNED: set[int] = set()


def _warn_if_other_gpus(device: Device) -> None:
    """Say once per device when nvCOMP's Python package will also open a context on GPU 0 (nvCOMP 6.0)."""
    index = device.index
    if not index or index in _WARNED:
        return
    from ..codecs import cuda_device_count

    visible = cuda_device_count()
    if visible > 1:
        _WARNED.add(index)
        log.warning(
            "decoding compressed tensors on GPU %d in a process that sees %d GPUs: nvCOMP's decode also "
            "opens a CUDA context on GPU 0 (about 0.5 GiB there, and slower decodes). Give each process "
            "only its own GPU (CUDA_VISIBLE_DEVICES), or load through `gdsload serve`, whose workers "
            "see one GPU each",
            index,
            visible,
        )


def _pipeline(
    n: int,
    free: list[threading.Event],
    submit: Callable[[int, int], Callable[[], None]],
    hand_off: Callable[[int, int], None],
    errors: list[BaseException],
) -> None:
    """Read ``n`` groups through ``len(free)`` staging slots, keeping the reader busy across groups.

    ``submit(i, k)`` starts reading group ``i`` into slot ``k`` and returns its waiter;
    ``hand_off(i, k)`` gives the read group to the decoder, which sets ``free[k]`` when done with
    the slot (and appends to ``errors`` when decoding fails). Up to ``len(free) - 1`` groups stay
    in flight while the oldest is waited for (with two slots: group ``i + 1`` is submitted before
    group ``i`` is waited for), so reads never drain at a group boundary; a slot is reused only
    once the decoder has finished with it. With a slot per group (``len(free) == n``, the in-place
    schedule), every group is submitted before the first is waited for, and a decode error can stop
    no read. Every submitted read is waited for before this returns or raises: reads in flight write
    into their buffers until they are done.
    """
    slots = len(free)
    pending: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()

    def oldest_to_decoder() -> None:
        j, wait = pending.popleft()
        wait()  # raises only once that group's reads are over (every backend's waiter waits for all of them)
        hand_off(j, j % slots)

    try:
        for i in range(n):
            k = i % slots
            free[k].wait()
            if errors:
                return
            free[k].clear()
            pending.append((i, submit(i, k)))
            while len(pending) >= slots:
                oldest_to_decoder()
        while pending and not errors:
            oldest_to_decoder()
    finally:
        for _, wait in pending:
            try:
                wait()
            except BaseException:
                pass  # the error being raised already says what went wrong
