"""ANS compression on a GPU without torch: cupy holds the bytes, nvCOMP's C API compresses them.

For each file:

1. the load pipeline reads it into GPU memory (:func:`~gdsload.loader.pipeline.load.load_rank` on a
   :class:`~gdsload.loader.devices.CupyDevice`; a compressed source is decoded on the way);
2. every chunk of every tensor worth compressing goes to nvCOMP in one call per ANS data type
   (:func:`~gdsload.loader.codecs.nvcomp_c.ans_encode`), and the CRC-32 of those tensors in one more;
3. the file's data section is laid out on the GPU: compressed chunks at their stored offsets, the
   tensors that stay raw as they are (see :func:`encode_file`);
4. it goes to disk through a few pinned buffers: a piece is copied out, written by several threads
   at once and hashed, in file order, on the way (:func:`write_file`).

The GPU work of the next file runs while a file is written, and its digest (blake3 by default) is
computed on the way: fed in file order by one thread, hashed on every core.
"""

from __future__ import annotations

import collections
import errno
import functools
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..config import format_bytes
from ..errors import DeviceMemoryError

__all__ = [
    "torch_free_gpu",
    "encode_file",
    "encode_tensors",
    "write_file",
    "compress_files",
    "write_encoded",
    "EncodedFile",
    "DeviceTensor",
    "Job",
]

log = logging.getLogger(__name__)

WINDOW = 64 << 20
"""Bytes of a file copied out of GPU memory at a time, into one of ``RING`` pinned buffers."""
RING = 3
WRITE_THREADS = 4
"""Threads writing one file's pieces at once (tmpfs takes about 1.7 GB/s from one thread)."""
MAX_WRITING = 4
"""Files written at once, each by its own threads, while the GPU encodes the next."""


def torch_free_gpu(codec_name: str, device: Any) -> int | None:
    """The GPU index to compress ``codec_name`` on without torch, or None where this path does not
    apply (another codec, the CPU, no GPU, a load that cannot run without torch here: see
    :func:`~gdsload.loader.devices.torch_free_unavailable`, nvCOMP's C library older than 6.0): the
    torch path (:func:`gdsload.loader.prepare.compress.compress_file`) then runs and says what is missing.

    ``device`` is None (the first GPU), ``"cuda"``, ``"cuda:N"``, ``"cpu"`` or a torch device.
    """
    from ..codecs.registry import codec

    if codec_name != "ans" or codec(codec_name).layouts[0] != "chunks":  # the only layout written here
        return None
    kind, index = ("cuda", 0) if device is None else _parse_device(device)
    if kind != "cuda":
        return None
    from ..devices import torch_free_unavailable
    from ..pipeline.config import LoadConfig

    if torch_free_unavailable(LoadConfig.resolve().backend) is not None:  # kvikio, a GPU, the backend (cupy below)
        return None
    try:
        import cupy

        from ..codecs.nvcomp_c import nvcomp_version

        if index >= int(cupy.cuda.runtime.getDeviceCount()):
            return None
        nvcomp_version()  # loads the C library; CodecError when it is missing or too old
    except Exception:  # no driver, no nvCOMP: the torch path reports it
        return None
    return index


def _parse_device(device: Any) -> tuple[str, int]:
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        return kind, int(index) if index.isdigit() else 0
    return str(getattr(device, "type", device)), int(getattr(device, "index", None) or 0)


@dataclass
class EncodedFile:
    """A file ready to be written: its header, and its data section in GPU memory."""

    src: str | None
    """The file whose permissions ``dst`` takes (None: a new file's)."""
    dst: str
    header: bytes
    data: Any
    """The data section: a uint8 cupy array."""
    index: int
    stats: Any
    """The file's :class:`~gdsload.loader.prepare.stats.CompressStats` (its digest once written)."""


class DeviceTensor(NamedTuple):
    """A tensor's bytes in GPU memory, as :func:`encode_tensors` takes them."""

    name: str
    dtype: str
    """Its safetensors dtype (``"BF16"``)."""
    shape: tuple[int, ...]
    address: int
    nbytes: int


def encode_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    index: int,
    min_gain: float,
    checksum: bool,
    min_tensor_bytes: int,
) -> EncodedFile:
    """Read ``src`` onto GPU ``index``, compress its tensors with ANS, and lay out ``dst``'s data on the GPU
    (:func:`encode_tensors`; the file keeps its metadata and its tensors' order)."""
    from ..devices import CupyDevice
    from ..format.compression import METADATA_KEY
    from ..format.safetensors import read_header
    from ..pipeline.load import load_rank

    src, dst = str(src), str(dst)
    header = read_header(src)
    dev = CupyDevice(index)
    loaded = load_rank(src, device=dev)
    try:
        slots = {s.name: s for s in loaded.slots}
        tensors = [
            DeviceTensor(t.name, s.dtype, tuple(s.shape), int(loaded.arenas[s.buffer].data.ptr) + s.offset, s.nbytes)
            for t in header.tensors
            for s in (slots[t.name],)
        ]
        metadata = {k: v for k, v in header.metadata.items() if k != METADATA_KEY}
        return encode_tensors(
            dev,
            tensors,
            metadata,
            dst,
            mode_from=src,
            min_gain=min_gain,
            checksum=checksum,
            min_tensor_bytes=min_tensor_bytes,
        )
    finally:
        loaded.close()


def encode_tensors(
    dev: Any,
    tensors: Sequence[DeviceTensor],
    metadata: dict[str, str],
    dst: str | os.PathLike[str],
    *,
    mode_from: str | None,
    min_gain: float,
    checksum: bool,
    min_tensor_bytes: int,
) -> EncodedFile:
    """Compress ``tensors`` (on ``dev``, a :class:`~gdsload.loader.devices.CupyDevice`) with ANS and lay out
    ``dst``'s data section on the GPU; returns it with its header, ready for :func:`write_file`.

    ``tensors`` are taken in the order a file's header lists them. Tensors smaller than
    ``min_tensor_bytes``, or that do not shrink by ``min_gain``, stay raw. The entries recorded are
    those :func:`gdsload.loader.codecs.encode_tensor` records. ``dst`` takes the permissions of
    ``mode_from`` once written (None: those of a new file). The tensors' memory is only read, and
    may be released once this returns.
    """
    from ..codecs import default_params
    from ..codecs.gpu import CupyStreamBytes
    from ..codecs.registry import codec
    from ..codecs.nvcomp_c import ans_encode, device_crc32
    from ..format.compression import FORMAT_VERSION, METADATA_KEY, CompressedEntry
    from ..format.writer import TensorSpec, aligned_header
    from .stats import CompressStats

    dst = str(dst)
    what = f"{dst!r}"
    ans = codec("ans")
    chunk_bytes, align = ans.chunk_bytes, ans.chunk_align
    cupy = dev.cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    on_stream = CupyStreamBytes(stream.ptr)
    held: list[Any] = []  # aligned copies of tensors the file left unaligned, alive until encoded
    try:
        where: dict[str, DeviceTensor] = {}
        for t in tensors:
            if t.address % align and t.nbytes >= min_tensor_bytes:  # nvCOMP's ANS wants 16-byte aligned chunks
                aligned = dev.empty(t.nbytes)
                cupy.cuda.runtime.memcpyAsync(aligned.data.ptr, t.address, t.nbytes, 3, stream.ptr)
                held.append(aligned)
                t = t._replace(address=int(aligned.data.ptr))
            where[t.name] = t
        stats = CompressStats(files=1)
        candidates = [t.name for t in tensors if t.nbytes >= max(min_tensor_bytes, 1)]
        # One encode per ANS data type, of every chunk of that type's tensors.
        by_type: dict[str, list[str]] = collections.defaultdict(list)
        for name in candidates:
            by_type[default_params("ans", where[name].dtype)["data_type"]].append(name)
        chunk_sizes: dict[str, np.ndarray] = {}
        chunk_at: dict[str, tuple[Any, int]] = {}  # name -> (slots, address of its first slot)
        for data_type, names in by_type.items():
            counts = [-(-where[n].nbytes // chunk_bytes) for n in names]
            offsets = [np.arange(c, dtype=np.int64) * chunk_bytes for c in counts]
            src_at = np.concatenate([where[n].address + o for n, o in zip(names, offsets)]).astype(np.uint64)
            src_len = np.concatenate(
                [np.minimum(chunk_bytes, where[n].nbytes - o) for n, o in zip(names, offsets)]
            ).astype(np.uint64)
            slots = ans_encode(src_at, src_len, data_type, on_stream, stream.ptr, what)
            first = 0
            for n, c in zip(names, counts):
                chunk_sizes[n] = slots.sizes[first : first + c]
                chunk_at[n] = (slots, slots.address + first * slots.slot_bytes)
                first += c
        from ..format import checksums

        # The compressed tensors' crc32, and the checksum table a writer records for the raw ones where the source
        # has none (a re-pack of a gdsload file keeps the source's table): one batch of CRCs on the GPU.
        table_needed = checksums.METADATA_KEY not in metadata
        summed = [t.name for t in tensors if t.nbytes and (table_needed or checksum and t.name in set(candidates))]
        crcs: dict[str, int | None] = dict.fromkeys(candidates)
        if summed:
            got = device_crc32([(where[n].address, where[n].nbytes) for n in summed], on_stream, stream.ptr, what)
            for i, n in enumerate(summed):
                crcs[n] = int(got[i]) if got is not None else _host_crc32(cupy, where[n].address, where[n].nbytes)
        if not checksum:
            crcs.update(dict.fromkeys(candidates))

        specs: list[TensorSpec] = []
        entries: dict[str, dict[str, Any]] = {}
        packed: dict[str, CompressedEntry] = {}
        for t in tensors:
            stats.tensors += 1
            stats.logical_bytes += t.nbytes
            if t.name in chunk_sizes:
                params = default_params("ans", t.dtype)
                entry = CompressedEntry(
                    t.name,
                    t.dtype,
                    t.shape,
                    t.nbytes,
                    "ans",
                    "chunks",
                    0,
                    params,
                    chunk_bytes,
                    tuple(chunk_sizes[t.name].tolist()),
                    crcs[t.name],
                    align,
                )
                starts, sizes, _, _ = entry.chunk_table()
                stored = int(starts[-1] + sizes[-1])
                if stored <= (1 - min_gain) * t.nbytes:
                    packed[t.name] = entry = entry._replace(stored_bytes=stored)
                    specs.append(TensorSpec(t.name, "U8", (stored,)))
                    entries[t.name] = entry.to_json()
                    stats.compressed += 1
                    stats.stored_bytes += stored
                    cur = stats.per_dtype.setdefault(t.dtype, [0, 0])
                    cur[0] += t.nbytes
                    cur[1] += stored
                    continue
            specs.append(TensorSpec(t.name, t.dtype, t.shape))
            stats.raw += 1
            stats.stored_bytes += t.nbytes
        metadata = dict(metadata)
        if entries:
            metadata[METADATA_KEY] = json.dumps({"version": FORMAT_VERSION, "tensors": entries}, separators=(",", ":"))
        if table_needed:  # as AlignedWriter records it: the raw tensors, in the order given
            metadata[checksums.METADATA_KEY] = checksums.render(
                {t.name: crcs.get(t.name) or 0 for t in tensors if t.name not in packed}
            )
        order, head, data_len = aligned_header(specs, metadata)

        data = dev.empty(data_len)
        cupy.cuda.runtime.memsetAsync(data.data.ptr, 0, data_len, stream.ptr)  # the gaps between chunks
        base, offset = int(data.data.ptr), 0
        memcpy = cupy.cuda.runtime.memcpyAsync  # kind 3: device to device
        for spec in order:
            t = where[spec.name]
            entry = packed.get(spec.name)
            if entry is None and t.nbytes:
                memcpy(base + offset, t.address, t.nbytes, 3, stream.ptr)
            elif entry is not None:
                slots, first_slot = chunk_at[spec.name]
                starts, sizes, _, _ = entry.chunk_table()
                for i, (at, n) in enumerate(zip(starts, sizes)):
                    memcpy(base + offset + at, first_slot + i * slots.slot_bytes, n, 3, stream.ptr)
            offset += spec.nbytes
        stream.synchronize()
    finally:
        held.clear()
    return EncodedFile(mode_from, dst, head, data, dev.index, stats)


def _host_crc32(cupy: Any, address: int, nbytes: int) -> int:
    """zlib's CRC-32 of device bytes, through a host copy (an nvCOMP without the CRC-32 call)."""
    import zlib

    host = np.empty(nbytes, np.uint8)
    cupy.cuda.runtime.memcpy(host.ctypes.data, address, nbytes, 2)
    return zlib.crc32(host)


def write_file(enc: EncodedFile, *, digest: bool | str, progress: Callable[[int], None] | None = None) -> str | None:
    """Write ``enc`` to its destination (atomically); returns its ``"<algorithm>:<hex>"`` with ``digest``.

    The data leaves the GPU ``WINDOW`` bytes at a time into pinned buffers; ``WRITE_THREADS`` threads
    write each window's pieces in place while this thread hashes it. ``progress`` gets the file's
    logical bytes, in proportion to the data written. A failed write raises ``OSError`` naming the file;
    nothing is left under its name.
    """
    import cupy

    from ..format.digests import digest_algorithm, hasher
    from ..format.atomic import atomic_output
    from ..format.writer import WRITE_PIECE, pwrite_all

    t0 = time.perf_counter()
    cupy.cuda.Device(enc.index).use()
    algorithm = digest_algorithm(digest)
    h = hasher(algorithm, enc.header) if algorithm else None
    total = int(enc.data.nbytes)
    logical, told = enc.stats.logical_bytes, 0
    stream = cupy.cuda.Stream(non_blocking=True)
    ring = [cupy.cuda.alloc_pinned_memory(WINDOW) for _ in range(RING)]
    views = [memoryview(np.frombuffer(mem, np.uint8, WINDOW)) for mem in ring]
    writing: list[list[Future[None]]] = [[] for _ in ring]
    out = atomic_output(enc.dst)
    try:
        with out as f, ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="gdsload-write") as pool:
            fd, start = f.fileno(), len(enc.header)
            _preallocate(fd, start + total)
            pwrite_all(fd, enc.header, 0)
            for i, at in enumerate(range(0, total, WINDOW)):
                n, k = min(WINDOW, total - at), i % RING
                for fut in writing[k]:  # the buffer's last window is on disk
                    fut.result()
                cupy.cuda.runtime.memcpyAsync(ring[k].ptr, int(enc.data.data.ptr) + at, n, 2, stream.ptr)
                stream.synchronize()
                view = views[k][:n]
                writing[k] = [
                    pool.submit(pwrite_all, fd, view[j : j + WRITE_PIECE], start + at + j)
                    for j in range(0, n, WRITE_PIECE)
                ]
                if h is not None:
                    h.update(view)
                if progress is not None and total:
                    now = logical * (at + n) // total
                    progress(now - told)
                    told = now
            for futures in writing:
                for fut in futures:
                    fut.result()
    except OSError as e:
        if str(enc.dst) in str(e):
            raise
        raise OSError(
            e.errno, f"writing it failed ({e.strerror or e}); nothing was written under that name", str(enc.dst)
        ) from e
    except (cupy.cuda.runtime.CUDARuntimeError, MemoryError) as e:  # pinning, or the copy out of the GPU
        raise OSError(
            errno.EIO,
            f"copying its data out of GPU {enc.index} failed ({type(e).__name__}: {e}); "
            "nothing was written under that name",
            str(enc.dst),
        ) from e
    if enc.src is not None:
        shutil.copymode(enc.src, enc.dst)  # private weights stay private
    log.info(
        "%s: %d bytes written%s in %.2f s",
        enc.dst,
        len(enc.header) + total,
        " and hashed" if h else "",
        time.perf_counter() - t0,
    )
    return h.text() if h is not None else None


def _preallocate(fd: int, nbytes: int) -> None:
    """Reserve the file's blocks in one call (``fallocate``), so the writes only copy; a file system
    without it (EOPNOTSUPP) is written as it is. Not ``os.posix_fallocate``: where the file system lacks
    the call, glibc emulates it by writing every block."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    if libc.fallocate(fd, 0, 0, nbytes) and ctypes.get_errno() == errno.ENOSPC:
        raise OSError(
            errno.ENOSPC,
            f"the file system has no room for its {nbytes} bytes; free space there or write elsewhere",
            None,
        )


class Job(NamedTuple):
    """One file for :func:`write_encoded`: what it is called in errors, the GPU memory its encoding takes at
    most, and the call that encodes it."""

    what: str
    need: int
    encode: Callable[[], EncodedFile]


def compress_files(
    pairs: Sequence[tuple[str | os.PathLike[str], str | os.PathLike[str]]],
    *,
    index: int,
    min_gain: float,
    checksum: bool,
    min_tensor_bytes: int,
    digest: bool | str,
    progress: Callable[[int], None] | None = None,
) -> list[Any]:
    """Compress each ``(src, dst)`` with ANS on GPU ``index`` without torch; the stats of each, in order.

    A file takes up to four times its logical size in GPU memory while it is encoded (what was read,
    aligned copies, the encoder's output and the laid-out file); see :func:`write_encoded`.
    """
    jobs = [
        Job(
            str(src),
            4 * _logical_bytes(src),
            functools.partial(
                encode_file,
                src,
                dst,
                index=index,
                min_gain=min_gain,
                checksum=checksum,
                min_tensor_bytes=min_tensor_bytes,
            ),
        )
        for src, dst in pairs
    ]
    sizes = [os.stat(src).st_size for src, _ in pairs]
    return write_encoded(jobs, sizes, index=index, digest=digest, progress=progress)


def write_encoded(
    jobs: Sequence[Job],
    sizes: Sequence[int],
    *,
    index: int,
    digest: bool | str,
    progress: Callable[[int], None] | None = None,
) -> list[Any]:
    """Encode each job on GPU ``index`` and write it; the stats of each (with its digest), in order.

    The largest job (by ``sizes``) goes first: its write, and its hash, take longest, and the others'
    run beside it. Up to ``MAX_WRITING`` files are written while the next is encoded, as GPU memory
    allows (a job's ``need``; then its compressed data until written). The first failure is raised once
    the files being written have stopped; a file whose write did not finish is not left under its name.
    """
    import cupy

    lock = threading.Lock()
    step = None
    if progress is not None:

        def step(n: int) -> None:
            with lock:
                progress(n)

    writing: collections.deque[tuple[EncodedFile, Future[str | None], float]] = collections.deque()
    results: list[Any] = []

    def finish_oldest() -> None:
        enc, fut, t0 = writing.popleft()
        written = fut.result()
        if written is not None:
            enc.stats.digests[str(enc.dst)] = written
        enc.stats.seconds = time.perf_counter() - t0
        enc.data = None  # the GPU copy goes as soon as the file is on disk
        results.append(enc.stats)

    by_size = sorted(range(len(jobs)), key=lambda i: -sizes[i])
    with ThreadPoolExecutor(MAX_WRITING, thread_name_prefix="gdsload-file") as writers:
        try:
            for job in (jobs[i] for i in by_size):
                cupy.get_default_memory_pool().free_all_blocks()
                while writing and (len(writing) >= MAX_WRITING or _free_bytes(cupy, index) < job.need):
                    finish_oldest()
                t0 = time.perf_counter()
                try:
                    enc = job.encode()
                except DeviceMemoryError:
                    raise
                except MemoryError as e:  # cupy's OutOfMemoryError
                    raise DeviceMemoryError(
                        f"{job.what!r}: compressing it takes up to {format_bytes(job.need)} on GPU {index}, and "
                        f"that cannot be allocated ({type(e).__name__}: {str(e)[:200]}); free memory on that GPU, "
                        "or write smaller files (`gdsload shard --max-file-size`)"
                    ) from None
                log.info(
                    "%s: read, compressed and laid out on GPU %d in %.2f s", job.what, index, time.perf_counter() - t0
                )
                writing.append((enc, writers.submit(write_file, enc, digest=digest, progress=step), t0))
            while writing:
                finish_oldest()
        except BaseException:
            for _, fut, _ in writing:
                fut.cancel()
            raise
    in_order: list[Any] = [None] * len(jobs)
    for i, stats in zip(by_size, results):
        in_order[i] = stats
    return in_order


def _logical_bytes(src: str | os.PathLike[str]) -> int:
    """Bytes ``src``'s tensors take decoded (a compressed source decodes to more than its size)."""
    from ..format.compression import parse_compression
    from ..format.safetensors import read_header

    header = read_header(src)
    packed = parse_compression(header)
    return sum(packed[t.name].nbytes if t.name in packed else t.nbytes for t in header.tensors)


def _free_bytes(cupy: Any, index: int) -> int:
    cupy.cuda.Device(index).use()
    return int(cupy.cuda.runtime.memGetInfo()[0])
