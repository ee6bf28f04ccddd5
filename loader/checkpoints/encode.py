"""One tensor's stored bytes in a checkpoint file: compressed where the tensor lives, checksummed, and back.

- A CUDA tensor is compressed on its own GPU with nvCOMP (ANS with the float ``data_type`` of its dtype, or Zstd),
  so only the compressed bytes cross to the host; where nvCOMP is missing it is copied over and treated as a CPU
  tensor.
- A CPU tensor is compressed with Zstd on every core: 256 KiB frames (what nvCOMP and ``zstandard`` both decode),
  compressed by a pool of threads (``zstandard`` lets go of the GIL). With ``planes``, each frame of a
  floating-point tensor is first split into byte planes (every element's first byte, then every second byte, ...):
  sign and exponent bytes, alike from one number to the next, then sit together, and Zstd finds more to gain.
- Every tensor, compressed or stored raw, carries a CRC-32 per 8 MiB segment of its own bytes, checked on load
  (segments let loads check in parallel, each right after its bytes arrive).

A split tensor's stream is declared as what it decodes to: bytes (``U8``), not the tensor's dtype, so a reader that
knows nothing of planes (``load_rank``) returns those bytes and never a wrongly typed tensor.
"""

from __future__ import annotations

import base64
import logging
import threading
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .writer import Frames
from ..codecs import codec, encode_tensor, nvcomp_available
from ..config import usable_cores
from ..dtypes import from_torch
from ..errors import CheckpointError, CodecError, ConfigError, IntegrityError
from ..format.compression import CompressedEntry
from ..format.writer import tensor_bytes
from ..prepare.compress import MIN_TENSOR_BYTES

__all__ = [
    "CODECS",
    "SEGMENT",
    "FRAME",
    "ZSTD_LEVEL",
    "Stored",
    "resolve_codec",
    "encode",
    "planes_for",
    "segment_crcs",
    "check_segments",
    "gpu_crcs",
    "encode_crcs",
    "decode_crcs",
    "unsplit",
    "unsplit_frame",
    "gpu_codec_for",
    "pool",
    "dtype_name",
    "torch_dtype",
]

log = logging.getLogger(__name__)

CODECS = ("auto", "ans", "zstd", "none")
"""What ``codec`` may be: ``auto`` (ANS on GPUs where nvCOMP runs, Zstd on the CPU), ``ans`` (ANS for CUDA
tensors; loads need a GPU), ``zstd`` (Zstd everywhere: nvCOMP's on GPUs; loads anywhere), ``none``."""
SEGMENT = 8 << 20
"""Bytes of a tensor per stored CRC-32."""
FRAME = 256 << 10
"""Decoded bytes per Zstd frame (and per byte-plane split): the ``zstd`` codec's chunk."""
ZSTD_LEVEL = 1
"""Zstd's level for CPU tensors: on float state, higher levels gain little and take twice as long."""
_SPLIT = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """The threads that compress, decompress, read and checksum: two per core this process may run on, so the
    cores stay busy while some threads wait for the disk (the codecs and reads let go of the GIL)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(2 * usable_cores(), thread_name_prefix="gdsload-ckpt")
        return _POOL


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: how the files name a tensor's dtype (any torch dtype)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: Any, where: str) -> torch.dtype:
    """The torch dtype a file names, or :class:`CheckpointError` naming ``where``."""
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise CheckpointError(
            f"{where}: dtype {name!r} is not a dtype of torch {torch.__version__}; the file is "
            "corrupt, or was written by a newer torch"
        )
    return value


def resolve_codec(codec: str) -> str:
    """``codec`` checked against :data:`CODECS` (any case), lower-cased."""
    name = codec.lower() if isinstance(codec, str) else codec
    if name not in CODECS:
        raise ConfigError(f"codec={codec!r} is not one of {', '.join(map(repr, CODECS))}")
    return name


def planes_for(dtype: torch.dtype, enabled: bool) -> int:
    """Byte planes a tensor of ``dtype`` is split into before Zstd (1: none)."""
    return _SPLIT.get(dtype, 1) if enabled else 1


@dataclass
class Stored:
    """A tensor as it goes into a file."""

    data: np.ndarray | Frames
    """The stored bytes (host memory): one uint8 array, or compressed frames written one after the other."""
    nbytes: int
    """The tensor's own bytes."""
    crc32: list[int]
    """CRC-32 of each :data:`SEGMENT` of the tensor's own bytes."""
    entry: CompressedEntry | None = None
    """How ``data`` decodes (its name is set by the writer); None: ``data`` is the tensor's bytes."""
    planes: int = 1
    """Byte planes per decoded frame (1: the decoded bytes are the tensor's)."""
    seconds: float = 0.0
    """Time the calling thread spent making it."""

    def meta(
        self,
        tensor: torch.Tensor | None = None,
        *,
        dtype: torch.dtype | None = None,
        shape: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """The JSON a file keeps for it: dtype, shape, checksums, planes."""
        dt = tensor.dtype if tensor is not None else dtype
        sh = list(tensor.shape) if tensor is not None else list(shape) if shape is not None else [self.nbytes]
        doc: dict[str, Any] = {
            "dtype": dtype_name(dt) if dt is not None else "uint8",
            "shape": sh,
            "crc32": encode_crcs(self.crc32),
        }
        if self.planes > 1:
            doc["planes"] = self.planes
        return doc


def encode_crcs(crcs: Iterable[int]) -> str:
    """Checksums as base64 of little-endian uint32."""
    return base64.b64encode(np.asarray(list(crcs), dtype="<u4").tobytes()).decode("ascii")


def decode_crcs(text: Any, nbytes: int, where: str) -> list[int]:
    """The checksums a file records for ``nbytes`` bytes (one per :data:`SEGMENT`), validated."""
    try:
        raw = base64.b64decode(str(text).encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise CheckpointError(f"{where}: 'crc32' is not base64; the file is corrupt") from None
    want = -(-nbytes // SEGMENT)
    if len(raw) != 4 * want:
        raise CheckpointError(
            f"{where}: {len(raw) // 4} checksums recorded for {nbytes} bytes, expected {want}; the file is corrupt"
        )
    return np.frombuffer(raw, dtype="<u4").tolist()


def segment_crcs(data: np.ndarray | memoryview) -> list[int]:
    """CRC-32 of each :data:`SEGMENT` of host bytes, on the pool's threads."""
    view = memoryview(data).cast("B")
    starts = range(0, len(view), SEGMENT)
    if len(starts) <= 1:
        return [zlib.crc32(view)] if len(view) else []
    return list(pool().map(lambda s: zlib.crc32(view[s : s + SEGMENT]), starts))


def check_segments(got: Sequence[int], want: Sequence[int], first: int, where: str) -> None:
    """:class:`IntegrityError` naming the first segment (counting from ``first``) whose checksum differs."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            at = (first + i) * SEGMENT
            raise IntegrityError(
                f"{where}: bytes {at}..{at + SEGMENT - 1} have CRC-32 {g:#010x} where the file "
                f"records {w:#010x}; the file is corrupt (restore it from a copy, or load an older "
                "checkpoint)"
            )


_CRC_CODECS: dict[int, Any] = {}


def gpu_crcs(raw: torch.Tensor, where: str) -> list[int]:
    """CRC-32 of each segment of a CUDA uint8 tensor, computed on its GPU (on the default stream)."""
    from ..codecs import GpuCodecs
    from ..devices import as_device

    index = raw.device.index if raw.device.index is not None else torch.cuda.current_device()
    with _POOL_LOCK:
        codecs = _CRC_CODECS.get(index)
        if codecs is None:
            codecs = _CRC_CODECS[index] = GpuCodecs(as_device(torch.device("cuda", index)), encode=True)
    base, n = raw.data_ptr(), raw.numel()
    spans = [(base + s, min(SEGMENT, n - s)) for s in range(0, n, SEGMENT)]
    with torch.cuda.device(raw.device):
        got = codecs.crcs(spans, where)  # every segment in one batch
        if got is None:  # nvCOMP's C library or its CRC-32 call is missing: of host copies
            return [codecs.crc32(raw[s : s + SEGMENT], where) for s in range(0, n, SEGMENT)]
        return [int(c) for c in got]


def _split(piece: np.ndarray, planes: int) -> np.ndarray:
    return piece.reshape(-1, planes).T.copy() if planes > 1 else piece


def _encode_cpu(name: str, data: np.ndarray, planes: int, level: int, min_gain: float) -> Stored:
    n = data.size
    zstd, params = codec("zstd"), {"level": level}

    def frame(start: int) -> bytes:
        return zstd.encode_chunk(_split(data[start : start + FRAME], planes), params)

    work = pool()
    crcs = [work.submit(zlib.crc32, data[s : s + SEGMENT]) for s in range(0, n, SEGMENT)]
    frames = list(work.map(frame, range(0, n, FRAME)))
    sums = [f.result() for f in crcs]
    stored = sum(len(f) for f in frames)
    if stored > (1 - min_gain) * n:
        log.debug("%s: Zstd gains %.1f%% only; stored raw", name, 100 * (1 - stored / n))
        return Stored(data, n, sums)
    sizes = tuple(len(f) for f in frames)
    entry = CompressedEntry(name, "U8", (n,), n, "zstd", "chunks", stored, {"level": level}, FRAME, sizes)
    return Stored(Frames(frames), n, sums, entry, planes)


def to_host(blob: torch.Tensor) -> np.ndarray:
    """Device bytes copied to new host memory (the copy waits)."""
    return blob.cpu().numpy()


def _encode_gpu(
    name: str, t: torch.Tensor, raw: torch.Tensor, codec: str, min_gain: float, host: Callable[[torch.Tensor], Any]
) -> Stored:
    try:
        dtype = from_torch(t.dtype)
        src = t
    except TypeError:  # a dtype safetensors has no name for: compressed as bytes
        dtype, src = "U8", raw
    n = raw.numel()
    sums = gpu_crcs(raw, name)
    entry, blob = encode_tensor(name, src, dtype, codec, checksum=False, keep_on_device=True)
    if blob.numel() > (1 - min_gain) * n:
        log.debug("%s: %s gains %.1f%% only; stored raw", name, codec, 100 * (1 - blob.numel() / n))
        return Stored(host(raw), n, sums)
    return Stored(host(blob), n, sums, entry._replace(dtype="U8", shape=(n,)))


def gpu_codec_for(codec: str) -> str | None:
    """The nvCOMP codec that compresses a CUDA tensor on its GPU for ``codec``, or None (copied to the host:
    nvCOMP is missing and ``codec`` allows Zstd on the CPU)."""
    if codec == "none":
        return None
    why = nvcomp_available()
    if why is None:
        return "zstd" if codec == "zstd" else "ans"
    if codec == "ans":
        raise CodecError(
            f"codec='ans' compresses CUDA tensors on their GPU with nvCOMP, and here {why}; "
            "use codec='zstd' (the CPU compresses after the copy), or install gdsload[cu12] / [cu13]"
        )
    return None


def encode(
    t: torch.Tensor,
    codec: str,
    *,
    name: str,
    planes: bool = True,
    min_gain: float = 0.02,
    level: int = ZSTD_LEVEL,
    host: Callable[[torch.Tensor], Any] = to_host,
) -> Stored:
    """``t``'s bytes as a file stores them, compressed with ``codec`` (see :data:`CODECS`) where that gains
    ``min_gain`` and the tensor is at least 64 KiB.

    A CUDA tensor compressed on its GPU leaves it through ``host`` (its stored bytes, a CUDA uint8 tensor, in; host
    memory the file writer takes out: a uint8 array or :class:`Frames`); by default a copy to new memory.

    >>> s = encode(torch.zeros(1 << 20), "zstd", name="w")
    >>> s.entry.codec, s.nbytes, s.data.nbytes < 1 << 12
    ('zstd', 4194304, True)
    """
    import time

    start = time.perf_counter()
    t = t.detach()
    t = t.resolve_conj() if t.is_conj() else t
    t = t.resolve_neg() if t.is_neg() else t
    n = t.numel() * t.element_size()
    if codec == "none" or n < MIN_TENSOR_BYTES:
        data = np.frombuffer(tensor_bytes(t), dtype=np.uint8) if n else np.empty(0, np.uint8)
        out = Stored(data, n, segment_crcs(data))
    else:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        gpu = gpu_codec_for(codec) if raw.is_cuda else None
        if gpu is not None:
            out = _encode_gpu(name, t, raw, gpu, min_gain, host)
        else:
            data = raw.cpu().numpy() if raw.is_cuda else raw.numpy()
            out = _encode_cpu(name, data, planes_for(t.dtype, planes), level, min_gain)
    out.seconds = time.perf_counter() - start
    return out


def unsplit(src: torch.Tensor, dst: torch.Tensor, planes: int) -> None:
    """Undo the byte-plane split: ``src`` (decoded frames of planes) into ``dst`` (the tensor's bytes); both
    1-D uint8 of one size, on one device."""
    n = src.numel()
    full = n // FRAME
    if full:
        dst[: full * FRAME].view(full, FRAME // planes, planes).copy_(
            src[: full * FRAME].view(full, planes, FRAME // planes).transpose(1, 2)
        )
    rest = n - full * FRAME
    if rest:
        dst[full * FRAME :].view(rest // planes, planes).copy_(src[full * FRAME :].view(planes, rest // planes).t())


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def unsplit_frame(frame: bytes, out: np.ndarray, planes: int) -> None:
    """One decoded frame of byte planes into ``out`` (a view of the tensor's bytes as long as the frame)."""
    src = np.frombuffer(frame, dtype=np.uint8)
    if planes == 1:
        out[:] = src
        return
    # Each element rebuilt from its bytes, highest plane first, in place: no strided byte copies.
    rows, words = src.reshape(planes, -1), out.view(_UINT[planes])
    words[:] = rows[planes - 1]
    for i in range(planes - 2, -1, -1):
        words <<= 8
        words |= rows[i]
