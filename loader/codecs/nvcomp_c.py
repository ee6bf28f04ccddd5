"""nvCOMP's C API through ctypes: the batched ANS decoder, the batched ANS encoder (:func:`ans_encode`, for
compressing without torch) and the CRC-32 of device bytes (:func:`device_crc32`, which the encoder records).

Why not nvCOMP's Python package, which the encoder uses: its ``Codec.decode`` takes one tensor's
stream at a time, reads the stream's header back to the host to size the output (a copy that
waits for every decode queued before it) and holds the GIL while it does. A load's reads are
kept in flight from Python, so they stall behind the decoder. The C API decodes any number of raw chunks, of any number
of tensors, in one asynchronous call; ctypes releases the GIL for the call, and nothing comes
back to the host until the batch's statuses are checked, once, after the stream has finished.

The chunks are what ``nvcompBatchedANSCompressAsync`` writes (nvCOMP's Python package with
``BitstreamKind.RAW``), each 16-byte aligned in device memory (``layout: chunks``,
:mod:`gdsload.loader.format.compression`).

ANS bitstreams carry no checksum, and a flipped byte usually decodes without an error into wrong
values. So every batch is checked on the device as well: right after its decode, on a stream of
its own (the next batch's decode need not wait for it), ``nvcompBatchedCRC32Async`` computes the
CRC-32 of each decoded tensor, and :meth:`AnsDecoder.check` compares them with the ``crc32`` the
file records (4 bytes per tensor come back to the host).
It runs on every load, not only with ``verify``.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import itertools
import os
import threading
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import CodecError
from ..format.checksums import CRC_PIECE_BYTES, combine_pieces, crc_piece_count, crc_pieces

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "AnsChunks",
    "AnsDecoder",
    "AnsSlots",
    "CRC_PIECE_BYTES",
    "CrcBatches",
    "ans_encode",
    "combine_pieces",
    "crc_pieces",
    "device_crc32",
    "library_unavailable",
    "nvcomp_version",
]

_MIN_VERSION = 6000
"""nvCOMP 6.0: the options struct bound below is its layout."""
_STATUS = {
    0: "success",
    10: "invalid value",
    11: "not supported",
    12: "cannot decompress",
    15: "output buffer too small",
    17: "alignment",
    18: "chunk size too large",
    20: "wrong input length",
    21: "batch size too large",
    1000: "CUDA error",
    10000: "internal error",
}


class _DecompressOpts(ctypes.Structure):
    # nvcompBatchedANSDecompressOpts_t (nvcomp/ans.h, 6.0). Zeroes but data_type are the defaults;
    # data_type NVCOMP_TYPE_BITS reads each chunk's type from its bitstream.
    _fields_ = [
        ("backend", ctypes.c_int),
        ("data_type", ctypes.c_int),
        ("max_sub_chunk_count", ctypes.c_uint8),
        ("states_per_lane", ctypes.c_uint8),
        ("skip_validate", ctypes.c_uint8),
        ("reserved", ctypes.c_char * 53),
    ]


class _CompressOpts(ctypes.Structure):
    # nvcompBatchedANSCompressOpts_t (nvcomp/ans.h, 6.0); type 0 is nvcomp_rANS, zeroes are the defaults.
    _fields_ = [
        ("type", ctypes.c_int),
        ("data_type", ctypes.c_int),
        ("max_sub_chunk_count", ctypes.c_uint8),
        ("states_per_lane", ctypes.c_uint8),
        ("histogram_reduction_log2", ctypes.c_uint8),
        ("reserved", ctypes.c_char * 53),
    ]


_ANS_TYPES = {"|u1": 1, "<f2": 10, "<f4": 11}
"""nvcompType_t of each ANS ``data_type`` parameter the files record (:mod:`gdsload.loader.codecs.ans`)."""


class _CRC32Spec(ctypes.Structure):
    # nvcompCRC32Spec_t (nvcomp/crc32.h, 6.0)
    _fields_ = [
        ("poly", ctypes.c_uint32),
        ("init", ctypes.c_uint32),
        ("ref_in", ctypes.c_bool),
        ("ref_out", ctypes.c_bool),
        ("xorout", ctypes.c_uint32),
        ("reserved", ctypes.c_char * 16),
    ]


class _CRC32KernelConf(ctypes.Structure):
    # nvcompCRC32KernelConf_t
    _fields_ = [
        ("kernel_kind", ctypes.c_int),
        ("bytes_per_read", ctypes.c_int32),
        ("blocks_per_msg", ctypes.c_int32),
        ("reserved", ctypes.c_char * 20),
    ]


class _CRC32Opts(ctypes.Structure):
    # nvcompBatchedCRC32Opts_t
    _fields_ = [("spec", _CRC32Spec), ("kernel_conf", _CRC32KernelConf), ("reserved", ctypes.c_char * 64)]


_CRC32_PKZIP = dict(poly=0x04C11DB7, init=0xFFFFFFFF, ref_in=True, ref_out=True, xorout=0xFFFFFFFF)
"""nvcompCRC32: the CRC-32 of zlib (``zlib.crc32``), which the encoder records."""

_CRC32_ONLY_SEGMENT = 0
_NVCOMP_TYPE_BITS = 0xFF
_LIB: tuple[ctypes.CDLL, int] | None = None
"""The library and its version (major * 1000 + minor * 100 + patch), once loaded."""
_LIB_LOCK = threading.Lock()


def _find_library() -> str:
    """libnvcomp from the nvidia-libnvcomp wheel (which nvidia-nvcomp depends on), else the system's."""
    import glob

    try:
        from nvidia import libnvcomp

        root = os.path.dirname(libnvcomp.__file__)
    except ImportError:
        return "libnvcomp.so"
    found = sorted(
        p
        for d in ("lib64", "lib")
        for p in glob.glob(os.path.join(root, d, "libnvcomp.so*"))
        if "_cpu" not in os.path.basename(p)
    )
    return found[-1] if found else "libnvcomp.so"


def _lib() -> tuple[ctypes.CDLL, int]:
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            path = _find_library()
            try:
                lib = ctypes.CDLL(path, ctypes.RTLD_LOCAL)
            except OSError as e:
                raise CodecError(
                    f"cannot load nvCOMP's library {path!r} ({e}); install gdsload[cu12] or gdsload[cu13]"
                ) from None
            props = (ctypes.c_uint32 * 2)()
            try:
                lib.nvcompGetProperties(props)
            except AttributeError:  # nvCOMP before 3.0 has no such call
                props[0] = 0
            if props[0] < _MIN_VERSION:
                found = _semver(props[0]) if props[0] else "from before 3.0"
                raise CodecError(
                    f"nvCOMP {found} at {path!r} is older than 6.0, whose C API decodes "
                    "`layout: chunks` ANS tensors; pip install 'nvidia-nvcomp-cu13>=6' (or -cu12)"
                )
            size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
            lib.nvcompBatchedANSDecompressGetTempSize.argtypes = [
                size_t,
                size_t,
                _DecompressOpts,
                ctypes.POINTER(size_t),
                size_t,
                ptr,
            ]
            lib.nvcompBatchedANSDecompressAsync.argtypes = [
                ptr,
                ptr,
                ptr,
                ptr,
                size_t,
                ptr,
                size_t,
                ptr,
                _DecompressOpts,
                ptr,
                ptr,
            ]
            lib.nvcompBatchedANSCompressGetTempSize.argtypes = [
                size_t,
                size_t,
                _CompressOpts,
                ctypes.POINTER(size_t),
                size_t,
                ptr,
            ]
            lib.nvcompBatchedANSCompressGetMaxOutputChunkSize.argtypes = [size_t, _CompressOpts, ctypes.POINTER(size_t)]
            lib.nvcompBatchedANSCompressAsync.argtypes = [
                ptr,
                ptr,
                size_t,
                size_t,
                ptr,
                size_t,
                ptr,
                ptr,
                _CompressOpts,
                ptr,
                ptr,
            ]
            if hasattr(lib, "nvcompBatchedCRC32Async"):
                lib.nvcompBatchedCRC32Async.argtypes = [ptr, ptr, size_t, ptr, _CRC32Opts, ctypes.c_int, ptr, ptr]
                lib.nvcompBatchedCRC32GetHeuristicConf.argtypes = [
                    ptr,
                    size_t,
                    ctypes.POINTER(_CRC32KernelConf),
                    size_t,
                    ptr,
                ]
            _LIB = lib, props[0]
        return _LIB


def _semver(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


def library_unavailable() -> str | None:
    """Why nvCOMP's C library cannot be used here (not found, or older than 6.0), or None when it can."""
    try:
        _lib()
    except CodecError as e:
        return str(e)
    return None


def nvcomp_version() -> str:
    """The loaded libnvcomp's version, e.g. ``6.0.0``."""
    return _semver(_lib()[1])


def _u64(values: Any = ()) -> array[int]:
    return array("Q", values)


class AnsChunks(NamedTuple):
    """A batch of chunks to decode: device addresses and sizes, one entry per chunk (uint64 arrays, as nvCOMP
    takes them), and for error messages which tensor each chunk belongs to.

    Built with the standard library's ``array`` and C-level iterators, without numpy: a load that decodes
    on a GPU without torch imports no numpy (some 0.2-0.3 s in a fresh process)."""

    src: array[int]
    src_bytes: array[int]
    dst: array[int]
    dst_bytes: array[int]
    counts: Sequence[int]
    """How many chunks of each tensor, in the order of ``names``."""
    names: Sequence[str]
    """``path: tensor`` of each tensor, for messages."""
    first_chunk: Sequence[int]
    """Per tensor, the index within it of its first chunk here (for messages)."""
    crc_dst: array[int]
    crc_bytes: array[int]
    crc_expected: array[int]
    crc_owner: Sequence[int]
    """Per tensor that records a ``crc32``: its decoded bytes (address, length), the CRC-32 the file
    records, and its index into ``names``."""
    decoded_bytes: int
    """The sum of ``dst_bytes``."""

    @classmethod
    def build(cls, jobs: Sequence[tuple[Any, int, int, str, int, int | None]]) -> AnsChunks:
        """From ``(entry, src_address, dst_address, where, first, stop)`` per tensor, ``entry`` a
        ``layout: chunks`` :class:`~gdsload.loader.format.compression.CompressedEntry`: its chunks
        ``first:stop`` (``stop=None``: through the last), stored from ``src_address`` on, decode into
        the tensor at ``dst_address``. A tensor's CRC-32 is checked with its last chunk."""
        src, src_bytes, dst, dst_bytes = _u64(), _u64(), _u64(), _u64()
        counts, decoded = [], 0
        for entry, s, d, _, first, stop in jobs:
            n, step = len(entry.chunks), entry.chunk_bytes
            stop = n if stop is None else min(stop, n)
            k = max(stop - first, 0)
            counts.append(k)
            if not k:
                continue
            src.extend(entry.chunk_offsets(first, stop, s))
            src_bytes.extend(entry.chunks[first:stop])
            dst.extend(range(d + first * step, d + stop * step, step))
            dst_bytes.extend(entry.decoded_lengths()[first:stop])
            decoded += min(stop * step, entry.nbytes) - first * step
        checked = [
            (i, dst, entry.nbytes, entry.crc32)
            for i, (entry, _, dst, _, _, stop) in enumerate(jobs)
            if entry.crc32 is not None and entry.nbytes and (stop is None or stop >= len(entry.chunks))
        ]
        return cls(
            src,
            src_bytes,
            dst,
            dst_bytes,
            counts,
            [j[3] for j in jobs],
            [j[4] for j in jobs],
            crc_dst=_u64(c[1] for c in checked),
            crc_bytes=_u64(c[2] for c in checked),
            crc_expected=array("I", (c[3] for c in checked)),
            crc_owner=[c[0] for c in checked],
            decoded_bytes=decoded,
        )

    def owner(self, i: int) -> tuple[int, int]:
        """The index into ``names`` of chunk ``i``'s tensor, and the chunk's index within that tensor."""
        ends = list(itertools.accumulate(self.counts))
        t = bisect.bisect_right(ends, i)
        first = self.first_chunk[t] if self.first_chunk else 0
        return t, i - (ends[t] - self.counts[t]) + first


class _Batch:
    """A launched batch: its chunks, the device table nvCOMP writes its results into, and where the
    CRC-32 part of that table starts (``crcs`` tensors checked; 0: none)."""

    __slots__ = ("chunks", "tables", "crc_at", "crcs", "checked")

    def __init__(self, chunks: AnsChunks, tables: tuple[Any, int, int], crc_at: int) -> None:
        self.chunks, self.tables, self.crc_at = chunks, tables, crc_at
        self.crcs = 0
        self.checked: Any = None
        """Event recorded on the check stream after the batch's CRC-32 kernel (None without one)."""


class AnsDecoder:
    """Decodes :class:`AnsChunks` on one CUDA stream of one device; one per thread.

    ``device`` makes device arrays and events of the caller's kind (see
    :mod:`gdsload.loader.codecs`): ``empty(nbytes)`` returns ``(array, address)``, ``put(array, host)``
    copies host bytes in on the stream, ``get(array, nbytes)`` copies bytes out once the stream is
    synchronized; ``side_stream()``, ``record(stream)``, ``wait(stream, event)`` and ``wait_event(event)``
    order the check stream after the decode.

    The CRC-32 of a batch runs on a stream of its own, after that batch's decode: once the decode
    stream is synchronized the sources may be reused (a loader's staging buffer takes the next
    reads) while the check still runs, beside the next batch's decode. :meth:`check` reads the
    results. nvCOMP's scratch stays allocated between batches; each batch not yet checked has its
    own table, and checked ones are reused.
    """

    def __init__(self, stream: int, device: Any):
        self._lib = _lib()[0]
        self.stream = stream
        self._device = device
        self._opts = _DecompressOpts(data_type=_NVCOMP_TYPE_BITS)
        self.checks_crc32 = hasattr(self._lib, "nvcompBatchedCRC32Async")
        """Whether decoded tensors are checked against their ``crc32`` on the device (nvCOMP has the call)."""
        self._check_stream = device.side_stream() if self.checks_crc32 else None
        self._temp: tuple[Any, int, int] | None = None
        self._pending: collections.deque[_Batch] = collections.deque()
        self._spare: list[tuple[Any, int, int]] = []
        """Tables of checked batches, for the next launches."""

    def _buffer(self, held: tuple[Any, int, int] | None, nbytes: int) -> tuple[Any, int, int]:
        if held is not None and held[2] >= nbytes:
            return held
        array, address = self._device.empty(max(nbytes, 1))
        return array, address, max(nbytes, 1)

    def _table(self, nbytes: int) -> tuple[Any, int, int]:
        for i, t in enumerate(self._spare):
            if t[2] >= nbytes:
                return self._spare.pop(i)
        return self._buffer(None, nbytes)

    def launch(self, chunks: AnsChunks) -> None:
        """Queue the decode of ``chunks`` on the stream, and its CRC-32 check after it on the check stream.

        Runs without the GIL (ctypes). The sources must stay put until the stream has finished, the
        destinations until :meth:`check` has checked the batch.
        """
        n = len(chunks.src)
        if not n:
            return
        # One table: compressed pointers, compressed sizes, output sizes, output pointers, then
        # room for the actual sizes (uint64) and statuses (int32) nvCOMP writes back; then, for
        # the CRC-32 check, each checked tensor's address and size, and room for its CRC-32.
        m = len(chunks.crc_dst) if self.checks_crc32 else 0
        crc_at = 8 * 5 * n + 4 * n + (4 * n) % 8
        host = bytearray().join([chunks.src, chunks.src_bytes, chunks.dst_bytes, chunks.dst])
        if m:
            host += bytes(crc_at - len(host))
            host += chunks.crc_dst
            host += chunks.crc_bytes
        tables = self._table(crc_at + 16 * m + 4 * m)
        table, base, _ = tables
        self._device.put(table, host)
        size_t = ctypes.c_size_t
        temp_bytes = size_t(0)
        status = self._lib.nvcompBatchedANSDecompressGetTempSize(
            n, max(chunks.dst_bytes), self._opts, ctypes.byref(temp_bytes), chunks.decoded_bytes, self.stream
        )
        if status:
            self._spare.append(tables)
        _raise_on(status, "sizing the decoder's scratch", chunks.names[0])
        self._temp = self._buffer(self._temp, temp_bytes.value)
        status = self._lib.nvcompBatchedANSDecompressAsync(
            base,
            base + 8 * n,
            base + 16 * n,
            base + 32 * n,
            n,
            self._temp[1],
            self._temp[2],
            base + 24 * n,
            self._opts,
            base + 40 * n,
            self.stream,
        )
        if status:
            self._spare.append(tables)
        _raise_on(status, f"launching the decode of {n} chunks", chunks.names[0])
        batch = _Batch(chunks, tables, crc_at)
        self._pending.append(batch)  # from here on, check() or close() waits for what was queued
        if m:
            check = self._check_stream
            self._device.wait(check, self._device.record(self.stream))
            conf = _CRC32KernelConf()
            # Given the largest message, the heuristic needs no device data and does not synchronize.
            status = self._lib.nvcompBatchedCRC32GetHeuristicConf(
                None, m, ctypes.byref(conf), max(chunks.crc_bytes), check
            )
            _raise_on(status, "choosing the CRC-32 kernel", chunks.names[0])
            opts = _CRC32Opts(spec=_CRC32Spec(**_CRC32_PKZIP), kernel_conf=conf)
            status = self._lib.nvcompBatchedCRC32Async(
                base + crc_at, base + crc_at + 8 * m, m, base + crc_at + 16 * m, opts, _CRC32_ONLY_SEGMENT, None, check
            )
            _raise_on(status, f"launching the CRC-32 of {m} decoded tensors", chunks.names[0])
            batch.crcs, batch.checked = m, self._device.record(check)

    def check(self, keep: int = 0) -> None:
        """Raise :class:`CodecError` naming the tensor if a chunk of a launched batch failed to decode or
        a decoded tensor does not match its ``crc32``; every batch but the newest ``keep`` is checked, once.

        Call once the stream is synchronized; it waits for the batches' CRC-32 kernels.
        """
        while len(self._pending) > keep:
            self._check(self._pending.popleft())

    def _check(self, batch: _Batch) -> None:
        chunks, crc_at, m = batch.chunks, batch.crc_at, batch.crcs
        n = len(chunks.src)
        if batch.checked is not None:
            self._device.wait_event(batch.checked)
        back = self._device.get(batch.tables[0], crc_at + 20 * m if m else 8 * 5 * n + 4 * n)
        self._spare.append(batch.tables)
        _check_results(chunks, back, crc_at, m)

    def close(self) -> None:
        """Wait for the check kernels still running and drop the device buffers (the stream must have
        finished with them)."""
        for batch in self._pending:
            if batch.checked is not None:
                self._device.wait_event(batch.checked)
        self._pending.clear()
        self._temp = None
        self._spare = []


def _check_results(chunks: AnsChunks, table: Any, crc_at: int, m: int) -> None:
    """Raise :class:`CodecError` naming the first tensor of ``chunks`` whose chunk nvCOMP failed to decode (a
    status, or a size not the expected) or whose decoded bytes do not have the CRC-32 the file records; from
    the batch's table as it came back to the host (the ``m`` CRC-32 results from ``crc_at`` on)."""
    n = len(chunks.src)
    back = memoryview(table).cast("B")
    actual, statuses = back[32 * n : 40 * n], back[40 * n : 44 * n]
    # Byte for byte first (the common case, at memcmp speed); chunk by chunk only to name what failed.
    if statuses.tobytes() != bytes(4 * n) or actual.tobytes() != chunks.dst_bytes.tobytes():
        codes, sizes = statuses.cast("i"), actual.cast("Q")
        bad = [i for i in range(n) if codes[i] or sizes[i] != chunks.dst_bytes[i]]
        i = bad[0]
        owner, index = chunks.owner(i)
        code = codes[i]
        why = (
            f"status {code} ({_STATUS.get(code, 'unknown')})"
            if code
            else f"{sizes[i]} bytes decoded where {chunks.dst_bytes[i]} were expected"
        )
        raise CodecError(
            f"{chunks.names[owner]}: chunk {index} does not decode ({why}; "
            f"{len(bad)} bad chunk(s) in this batch); the file is corrupt"
        )
    if m:
        got = back[crc_at + 16 * m : crc_at + 20 * m].cast("I")
        wrong = [i for i in range(m) if got[i] != chunks.crc_expected[i]]
        if wrong:
            i = wrong[0]
            raise CodecError(
                f"{chunks.names[chunks.crc_owner[i]]}: decoded bytes have CRC-32 {got[i]:#010x} "
                f"where the file records {chunks.crc_expected[i]:#010x} ({len(wrong)} tensor(s) "
                "of this batch); the file is corrupt"
            )


class AnsSlots(NamedTuple):
    """What :func:`ans_encode` made: chunk *i*'s compressed bytes are the first ``sizes[i]`` bytes at
    ``address + i * slot_bytes`` of the device array ``array``."""

    array: Any
    address: int
    slot_bytes: int
    sizes: np.ndarray


def ans_encode(
    src: np.ndarray, src_bytes: np.ndarray, data_type: str, device: Any, stream: int, where: str
) -> AnsSlots:
    """Compress the device chunks at addresses ``src``, ``src_bytes`` bytes each (uint64 arrays), with ANS
    in one call, into fixed-size slots of a new device array (``device`` as for :class:`AnsDecoder`), on
    ``stream``; waits for it.

    ``data_type`` is the ANS parameter a file records (``"<f2"``, ``"<f4"``, ``"|u1"``); the chunks are
    16-byte aligned and hold whole elements of it. The bitstreams are those nvCOMP's Python codec
    writes with ``BitstreamKind.RAW``: what :class:`AnsDecoder` decodes.
    """
    import numpy as np

    lib = _lib()[0]
    n = len(src)
    if data_type not in _ANS_TYPES:
        raise CodecError(f"{where}: ANS data_type {data_type!r} is not one of {sorted(_ANS_TYPES)}")
    if not n:
        return AnsSlots(None, 0, 0, np.zeros(0, np.uint64))
    opts = _CompressOpts(data_type=_ANS_TYPES[data_type])
    size_t = ctypes.c_size_t
    src, src_bytes = np.asarray(src, np.uint64), np.asarray(src_bytes, np.uint64)
    largest, total = int(src_bytes.max()), int(src_bytes.sum())
    slot = size_t(0)
    _raise_on(
        lib.nvcompBatchedANSCompressGetMaxOutputChunkSize(largest, opts, ctypes.byref(slot)),
        "sizing the compressed chunks",
        where,
    )
    slot_bytes = -(-slot.value // 256) * 256  # every slot as aligned as the array (cudaMalloc: 256 bytes)
    temp = size_t(0)
    _raise_on(
        lib.nvcompBatchedANSCompressGetTempSize(n, largest, opts, ctypes.byref(temp), total, stream),
        "sizing the encoder's scratch",
        where,
    )
    slots, base = device.empty(n * slot_bytes)
    # nvCOMP leaves some bytes of a chunk's bitstream unwritten: zeroed first, the same data always compresses
    # to the same bytes, whatever the memory held before.
    device.zero(slots)
    scratch, scratch_at = device.empty(max(temp.value, 1))
    # One table: input pointers, input sizes, output pointers, then room for the output sizes and statuses.
    table, at = device.empty(36 * n)
    dst = base + np.arange(n, dtype=np.uint64) * np.uint64(slot_bytes)
    device.put(table, np.concatenate([src, src_bytes, dst]).view(np.uint8))
    _raise_on(
        lib.nvcompBatchedANSCompressAsync(
            at, at + 8 * n, largest, n, scratch_at, temp.value, at + 16 * n, at + 24 * n, opts, at + 32 * n, stream
        ),
        f"launching the compression of {n} chunks",
        where,
    )
    device.sync()
    back = np.frombuffer(device.get(table, 36 * n), np.uint8)
    sizes = back[24 * n : 32 * n].view(np.uint64).copy()
    statuses = back[32 * n : 36 * n].view(np.int32)
    bad = np.flatnonzero(statuses)
    if len(bad):
        code = int(statuses[bad[0]])
        raise CodecError(
            f"{where}: nvCOMP could not compress chunk {int(bad[0])} of the batch: status {code} "
            f"({_STATUS.get(code, 'unknown')}; {len(bad)} chunk(s) failed)"
        )
    del scratch
    return AnsSlots(slots, base, slot_bytes, sizes)


class CrcBatches:
    """CRC-32s of device byte ranges, launched batch by batch on one stream as their bytes become ready (each
    batch one asynchronous call), read back once at the end (:meth:`results`).

    ``device`` as for :class:`AnsDecoder`. Long ranges are checked in pieces of ``piece`` bytes
    (:data:`~gdsload.loader.format.checksums.CRC_PIECE_BYTES`) whose CRCs are combined on the host, where
    ISA-L can combine them (the ``isal`` package); otherwise each range is one piece. A range's bytes must be
    in place before its batch is launched (or be written earlier on the same stream).

    ``table``: ``(array, address, nbytes)`` of device memory allocated beforehand (:meth:`table_bytes` says how
    much the ranges need), where the batches' tables go one after another; a device allocation between
    two launches would keep other streams' copies from running beside them. Without it (or once it is full)
    each batch allocates its own.
    """

    def __init__(
        self,
        device: Any,
        stream: int,
        where: str,
        *,
        piece: int = CRC_PIECE_BYTES,
        table: tuple[Any, int, int] | None = None,
    ):
        from ..format.checksums import crc32_combiner

        self._device, self.stream, self.where = device, stream, where
        self._combine = crc32_combiner()
        self._piece = piece if self._combine is not None else 0
        self._table, self._used = table, 0
        self._batches: list[tuple[Any, int, list[int], list[int]]] = []
        """Per launched batch: its table (kept until read back), its piece count, pieces' sizes, ranges' counts."""

    @staticmethod
    def available() -> bool:
        """Whether this nvCOMP has the CRC-32 call."""
        return hasattr(_lib()[0], "nvcompBatchedCRC32Async")

    @staticmethod
    def table_bytes(sizes: Sequence[int], batches: int, piece: int = CRC_PIECE_BYTES) -> int:
        """Device bytes the tables of ranges of ``sizes`` take, launched in up to ``batches`` batches."""
        return 20 * sum(crc_piece_count(n, piece) for n in sizes) + 8 * batches

    def launch(self, spans: Sequence[tuple[int, int]]) -> None:
        """Queue the CRC-32 of each range ``(address, nbytes)`` on the stream; returns at once."""
        if not spans:
            return
        lib = _lib()[0]
        addresses, sizes, counts = crc_pieces(spans, self._piece)
        m = len(sizes)
        nbytes = 20 * m + (4 * m) % 8  # the next batch's table starts 8-byte aligned
        if self._table is not None and self._used + nbytes <= self._table[2]:
            table, base = self._table[0][self._used : self._used + nbytes], self._table[1] + self._used
            self._used += nbytes
        else:
            table, base = self._device.empty(nbytes)
        self._device.put(table, bytearray(_u64(addresses)) + _u64(sizes))
        conf = _CRC32KernelConf()
        _raise_on(
            lib.nvcompBatchedCRC32GetHeuristicConf(None, m, ctypes.byref(conf), max(sizes), self.stream),
            "choosing the CRC-32 kernel",
            self.where,
        )
        opts = _CRC32Opts(spec=_CRC32Spec(**_CRC32_PKZIP), kernel_conf=conf)
        _raise_on(
            lib.nvcompBatchedCRC32Async(
                base, base + 8 * m, m, base + 16 * m, opts, _CRC32_ONLY_SEGMENT, None, self.stream
            ),
            f"computing the CRC-32 of {len(spans)} range(s) in {m} piece(s)",
            self.where,
        )
        self._batches.append((table, m, sizes, counts))

    def results(self) -> list[int]:
        """Wait for the stream; each launched range's CRC-32, in launch order."""
        self._device.sync()
        out: list[int] = []
        for table, m, sizes, counts in self._batches:
            crcs = memoryview(self._device.get(table, 20 * m)).cast("B")[16 * m :].cast("I").tolist()
            out.extend(crcs if m == len(counts) else combine_pieces(crcs, sizes, counts, self._combine))
        self._batches.clear()
        return out


def device_crc32(
    spans: Sequence[tuple[int, int]], device: Any, stream: int, where: str, *, piece: int = CRC_PIECE_BYTES
) -> list[int] | None:
    """zlib's CRC-32 of each device byte range ``(address, nbytes)``, computed on the GPU on ``stream`` in one
    batch (:class:`CrcBatches`); None when this nvCOMP has no CRC-32 call. Waits for the stream: the results are
    on the host when it returns, one per range."""
    if not CrcBatches.available():
        return None
    batches = CrcBatches(device, stream, where, piece=piece)
    batches.launch(spans)
    return batches.results()


def _raise_on(status: int, what: str, where: str) -> None:
    if status:
        raise CodecError(f"{where}: nvCOMP failed {what}: status {status} ({_STATUS.get(status, 'unknown')})")
