"""The decode stage: compressed bytes land in staging buffers and decode into their places.

On a GPU, three device staging buffers take turns: while nvCOMP decodes group *i* from one (on
a decode thread, on its own stream), the backend reads groups *i+1* and *i+2* into the others.
Each buffer holds a third of ``staging_bytes`` (or one tensor, if a tensor is larger), so GPU
memory peaks at the tensors plus ``staging_bytes`` (or three times the largest compressed tensor).
With two buffers the reader waits for each group's decode before it can start the group after
next. On the CPU, Zstd frames are decoded by ``zstandard`` in a thread pool straight into place,
from one buffer. A tensor's place is its arena slot, or the caller's own target (``into``).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gdsload.loader.io import Backend
from gdsload.loader.codecs import GpuCodecs, check_crc32, cpu_decode, cuda_device_count, nvcomp_available
from gdsload.loader.codecs.registry import codec
from gdsload.loader.devices import Device, Stream
from gdsload.loader.errors import CodecError, DeviceMemoryError
from gdsload.loader.plan import CompressedTensor, Extent, LoadPlan, align_up

__all__ = ["DecodeStats", "load_compressed", "DEFAULT_STAGING", "STAGING_SLOTS"]

log = logging.getLogger(__name__)

DEFAULT_STAGING = 1 << 30
"""Staging for compressed bytes, all buffers together."""
STAGING_SLOTS = 3
"""Staging buffers the reads and the decoder take turns on; reads stay in flight in all but one."""
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


def _groups(tensors: tuple[CompressedTensor, ...], staging: int) -> list[list[tuple[CompressedTensor, int]]]:
    """Pack tensors (in file order) into groups of at most ``staging`` bytes; each with its staging offset."""
    groups: list[list[tuple[CompressedTensor, int]]] = []
    used = staging  # forces a new group first
    for t in tensors:
        n = align_up(t.entry.stored_bytes, _ALIGN)
        if used + n > staging and (not groups or groups[-1]):
            groups.append([])
            used = 0
        groups[-1].append((t, used))
        used += n
    return [g for g in groups if g]


def load_compressed(
    plan: LoadPlan,
    reader: Backend,
    dsts: list[Any],
    *,
    verify: bool,
    staging_bytes: int = DEFAULT_STAGING,
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
    biggest = max(align_up(t.entry.stored_bytes, _ALIGN) for t in plan.compressed)
    staging = max(staging_bytes // STAGING_SLOTS // _ALIGN * _ALIGN, _ALIGN, biggest)
    groups = _groups(plan.compressed, staging)
    paths = [f.path for f in plan.files]

    def place(t: CompressedTensor) -> Any:
        return dsts[t.buffer][t.offset : t.offset + t.entry.nbytes]

    def staged(group: list[tuple[CompressedTensor, int]]) -> list[Extent]:
        return [Extent(t.file_index, t.file_offset, t.entry.stored_bytes, off) for t, off in group]

    t0 = time.perf_counter()
    if device.kind == "cpu":
        buf = reader.allocate(staging)
        stats.staging_bytes = staging
        view = device.host_memoryview(buf)
        outs = [device.host_memoryview(d) for d in dsts]
        for group in groups:
            reader.read(staged(group), [buf], progress)
            d = time.perf_counter()
            for t, off in group:
                cpu_decode(t.entry, view[off : off + t.entry.stored_bytes],
                           outs[t.buffer][t.offset : t.offset + t.entry.nbytes], verify=verify,
                           path=paths[t.file_index], threads=threads)
            stats.decode_busy_seconds += time.perf_counter() - d
        # Reads and decodes take turns here: none of the decoding hides behind reads.
        stats.tail_seconds = stats.decode_busy_seconds
        stats.read_seconds = time.perf_counter() - t0 - stats.tail_seconds
        return stats

    reason = nvcomp_available()
    if reason is not None:
        raise CodecError(f"{paths[plan.compressed[0].file_index]!r} holds compressed tensors but nvCOMP cannot run: "
                         f"{reason}")
    if any(not codec(t.entry.codec).batch_decoder or t.entry.layout != "chunks" for t in plan.compressed):
        _warn_if_other_gpus(device)  # chunks of a batch decoder go through nvCOMP's C API, which leaves GPU 0 alone
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
        try:
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
        finally:
            stream.synchronize()
            codecs.close()

    def decode_groups(codecs: GpuCodecs, stream: Stream) -> None:
        while True:
            item = work.get()
            if item is None:
                return
            group, k = item
            d = time.perf_counter()
            try:
                if not errors:
                    with stream.activate():
                        codecs.decode_many([(t.entry, slots[k][off : off + t.entry.stored_bytes], place(t),
                                             paths[t.file_index]) for t, off in group])
                    stream.synchronize()
                    codecs.finish()
                    if verify:
                        for t, _ in group:
                            if t.entry.layout == "chunks" and not codecs.checked_on_device(t.entry):
                                check_crc32(t.entry, device.to_host(place(t)),
                                            f"{paths[t.file_index]!r}: tensor {t.entry.name!r}")
            except BaseException as e:
                errors.append(e)
            finally:
                stats.decode_busy_seconds += time.perf_counter() - d
                free[k].set()

    thread = threading.Thread(target=decoder, name="gdsload-decode", daemon=True)
    thread.start()
    try:
        _pipeline(
            len(groups), free,
            lambda i, k: reader.submit(staged(groups[i]), [slots[k]], progress),
            lambda i, k: work.put((groups[i], k)),
            errors,
        )
        stats.read_seconds = time.perf_counter() - t0
    finally:
        work.put(None)
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
