"""The decode stage: compressed bytes land in staging buffers and decode into their places.

On a GPU, three device staging buffers take turns: while nvCOMP decodes group *i* from one (on
a decode thread, on its own stream), the backend reads groups *i+1* and *i+2* into the others. A
buffer takes the next reads as soon as its group is decoded; the group's CRC-32 check (ANS) runs on
beside the next decode, and is read back a group later.
Each buffer holds a third of ``staging_bytes``; a tensor stored in chunks (``layout: chunks``, what
``gdsload compress`` writes) that does not fit in what is left of a group is read and decoded a run
of chunks at a time, over as many groups as it takes, so GPU memory peaks at the tensors plus
``staging_bytes`` whatever their sizes (a ``layout: native`` tensor larger than a buffer makes every
buffer its size). With two buffers the reader would wait for each group's decode before it could
start the group after next. On the CPU, Zstd frames are decoded by ``zstandard`` in a thread pool
straight into place, from one buffer holding whole tensors. A tensor's place is its arena slot, or
the caller's own target (``into``).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from gdsload.loader.io import Backend
from gdsload.loader.devices import Device, Stream
from gdsload.loader.errors import CodecError, DeviceMemoryError
from gdsload.loader.pipeline.config import DEFAULT_STAGING_BYTES
from gdsload.loader.plan import CompressedTensor, Extent, LoadPlan, align_up

if TYPE_CHECKING:
    from gdsload.loader.codecs import GpuCodecs

__all__ = ["DecodeStats", "load_compressed", "DEFAULT_STAGING", "STAGING_SLOTS"]

log = logging.getLogger(__name__)

STAGING_SLOTS = 3
"""Staging buffers the reads and the decoder take turns on; reads stay in flight in all but one."""
DEFAULT_STAGING = DEFAULT_STAGING_BYTES
"""The same as :data:`gdsload.loader.pipeline.config.DEFAULT_STAGING_BYTES` (a load's ``staging_bytes``)."""
_ALIGN = 4096


@dataclass
class DecodeStats:
    read_seconds: float = 0.0
    """Wall time until the last compressed byte was read."""
    tail_seconds: float = 0.0
    """Wall time after that until the last decode finished (the part not hidden behind reads)."""
    decode_busy_seconds: float = 0.0
    """Time the decoder spent decoding (mostly overlapped with reads)."""
    stored_bytes: int = 0
    staging_bytes: int = 0


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


def _groups(tensors: tuple[CompressedTensor, ...], staging: int, *, split: bool = False
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
        ends = starts + sizes
        first = 0
        while first < len(sizes):
            room_for(align_up(int(sizes[first]), _ALIGN))
            # the most chunks from ``first`` on whose stored bytes fit in the room left
            stop = int(np.searchsorted(ends, starts[first] + staging - used, side="right"))
            start, end = int(starts[first]), int(ends[stop - 1])
            groups[-1].append((_Piece(t, start, end - start, first, None if stop == len(sizes) else stop), used))
            used += align_up(end - start, _ALIGN)
            first = stop
    return [g for g in groups if g]


def _extents(group: list[tuple[_Piece, int]]) -> list[Extent]:
    """The reads that fill a group's staging, one per piece."""
    return [Extent(p.tensor.file_index, p.tensor.file_offset + p.start, p.nbytes, off) for p, off in group]


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
    """Read and decode every compressed tensor of ``plan`` into its place in ``dsts``.

    ``dsts`` are the load's buffers on ``reader.device``: the arena first, then the caller's targets
    (``plan.targets``); staging comes from ``reader.allocate``.
    """
    stats = DecodeStats(stored_bytes=sum(t.entry.stored_bytes for t in plan.compressed))
    if not plan.compressed:
        return stats
    device = reader.device
    split = device.kind != "cpu"  # the GPU decoders take runs of chunks; the CPU's takes whole tensors
    biggest = max(_unit(t, split) for t in plan.compressed)
    staging = max(staging_bytes // STAGING_SLOTS // _ALIGN * _ALIGN, _ALIGN, biggest)
    groups = _groups(plan.compressed, staging, split=split)
    paths = [f.path for f in plan.files]

    def place(t: CompressedTensor) -> Any:
        return dsts[t.buffer][t.offset : t.offset + t.entry.nbytes]

    t0 = time.perf_counter()
    if device.kind == "cpu":
        from gdsload.loader.codecs import cpu_decode

        buf = reader.allocate(staging)
        stats.staging_bytes = staging
        view = device.host_memoryview(buf)
        outs = [device.host_memoryview(d) for d in dsts]
        for group in groups:
            reader.read(_extents(group), [buf], progress)
            d = time.perf_counter()
            for p, off in group:
                t = p.tensor
                cpu_decode(t.entry, view[off : off + t.entry.stored_bytes],
                           outs[t.buffer][t.offset : t.offset + t.entry.nbytes], verify=verify,
                           path=paths[t.file_index], threads=threads)
            stats.decode_busy_seconds += time.perf_counter() - d
        # Reads and decodes take turns here: none of the decoding hides behind reads.
        stats.tail_seconds = stats.decode_busy_seconds
        stats.read_seconds = time.perf_counter() - t0 - stats.tail_seconds
        return stats

    try:
        slots = [reader.allocate(staging) for _ in range(min(STAGING_SLOTS, len(groups)))]
    except (MemoryError, RuntimeError) as e:
        raise DeviceMemoryError(f"{paths[0]!r}: {STAGING_SLOTS} staging buffers of {staging} bytes cannot be allocated on "
                                f"{device} ({type(e).__name__}: {str(e)[:200]}); free memory on the device") from None
    stats.staging_bytes = staging * len(slots)
    free = [threading.Event() for _ in slots]
    for ev in free:
        ev.set()
    work: queue.Queue = queue.Queue()
    errors: list[BaseException] = []

    def decoder() -> None:
        # Started once the first groups' reads are under way: the codecs (and nvCOMP) are imported here
        # while the reader fills staging, instead of before its first read.
        try:
            from gdsload.loader.codecs import GpuCodecs, nvcomp_available
            from gdsload.loader.codecs.registry import codec

            # A batch decoder's chunks go through nvCOMP's C API alone, which also leaves GPU 0 alone.
            c_api_only = all(codec(t.entry.codec).batch_decoder and t.entry.layout == "chunks" for t in plan.compressed)
            reason = nvcomp_available(library_only=c_api_only)
            if reason is not None:
                raise CodecError(f"{paths[plan.compressed[0].file_index]!r} holds compressed tensors but nvCOMP "
                                 f"cannot run: {reason}")
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
        from gdsload.loader.codecs import DecodeJob, check_crc32

        while True:
            item = work.get()
            if item is None:
                return
            group, k = item
            d = time.perf_counter()
            released = False  # the slot is handed back once: the reader clears it again when it refills it
            try:
                if not errors:
                    jobs = [DecodeJob(p.tensor.entry, slots[k][off : off + p.nbytes], place(p.tensor),
                                      paths[p.tensor.file_index], p.first, p.stop) for p, off in group]
                    with stream.activate():
                        codecs.decode_many(jobs)
                    stream.synchronize()
                    # Decoded: the slot takes the next reads while this group's CRC-32 check runs on.
                    free[k].set()
                    released = True
                    codecs.finish(but_last=True)
                    if verify:
                        for j in jobs:
                            if j.ends and j.entry.layout == "chunks" and not codecs.checked_on_device(j.entry):
                                check_crc32(j.entry, device.to_host(j.dst), f"{j.path!r}: tensor {j.entry.name!r}")
            except BaseException as e:
                errors.append(e)
            finally:
                stats.decode_busy_seconds += time.perf_counter() - d
                if not released:
                    free[k].set()

    thread = threading.Thread(target=decoder, name="gdsload-decode", daemon=True)

    def submit(i: int, k: int) -> Callable[[], None]:
        wait = reader.submit(_extents(groups[i]), [slots[k]], progress)
        if i == len(slots) - 1:
            # The decoder sets up while the first groups are read. It starts once they are all queued:
            # its imports hold the GIL, and would hold up the submits for up to a switch interval (5 ms).
            thread.start()
        return wait

    try:
        _pipeline(len(groups), free, submit, lambda i, k: work.put((groups[i], k)), errors)
        stats.read_seconds = time.perf_counter() - t0
    finally:
        work.put(None)
        if thread.ident is not None:
            thread.join()
    stats.tail_seconds = time.perf_counter() - t0 - stats.read_seconds
    if errors:
        raise errors[0]
    return stats


_WARNED: set[int] = set()


def _warn_if_other_gpus(device: Device) -> None:
    """Say once per device when nvCOMP's Python package will also open a context on GPU 0 (nvCOMP 6.0)."""
    index = device.index
    if not index or index in _WARNED:
        return
    from gdsload.loader.codecs import cuda_device_count

    visible = cuda_device_count()
    if visible > 1:
        _WARNED.add(index)
        log.warning("decoding compressed tensors on GPU %d in a process that sees %d GPUs: nvCOMP's decode also "
                    "opens a CUDA context on GPU 0 (about 0.5 GiB there, and slower decodes). Give each process "
                    "only its own GPU (CUDA_VISIBLE_DEVICES), or load through `gdsload serve`, whose workers "
                    "see one GPU each", index, visible)


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
    once the decoder has finished with it. Every submitted read is waited for before this
    returns or raises: reads in flight write into staging until they are done.
    """
    slots = len(free)
    pending: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()

    def oldest_to_decoder() -> None:
        j, wait = pending.popleft()
        wait()  # raises only once that group's reads are over
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
