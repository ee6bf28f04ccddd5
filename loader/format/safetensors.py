"""The safetensors format, read side: a strict header parser.

File layout (the safetensors specification)::

    [u64 little-endian N][N bytes of JSON header, may end in spaces][data section]

Every tensor's ``data_offsets`` are relative to the data section; the tensors must tile it
exactly (no holes, no overlap) and the file must end where the last tensor ends.

We parse headers ourselves because planning needs byte ranges and alignment facts before any
data is read. Writing lives in :mod:`gdsload.loader.format.writer` (the aligned writer) and
:mod:`gdsload.loader.format.atomic` (files that appear whole or not at all).
"""

from __future__ import annotations

import errno
import math
import os
import stat
import struct
from typing import Any, BinaryIO, NamedTuple

from ..dtypes import ITEMSIZE, SAFETENSORS_DTYPES
from ..errors import FileUnreadableError, HeaderError, TruncatedFileError
from . import strict_json


__all__ = [
    "DATA_ALIGNMENT",
    "MAX_HEADER_BYTES",
    "TensorInfo",
    "SafetensorsHeader",
    "read_header",
    "parse_header",
    "open_regular",
    "check_text",
]

DATA_ALIGNMENT = 4096
"""The data section of files gdsload writes starts at a multiple of this many bytes."""

MAX_HEADER_BYTES = 100_000_000
"""Largest header accepted (the reference implementation's limit)."""

_TENSOR_KEYS = {"dtype", "shape", "data_offsets"}


class TensorInfo(NamedTuple):
    """One tensor's entry in a safetensors header; offsets are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SafetensorsHeader:
    """A validated header: every tensor's byte range is known to lie inside the file."""

    __slots__ = ("path", "header_len", "file_size", "tensors", "metadata", "raw")

    def __init__(
        self,
        path: str,
        header_len: int,
        file_size: int,
        tensors: tuple[TensorInfo, ...],
        metadata: dict[str, str] | None = None,
        raw: bytes = b"",
    ) -> None:
        self.path = path
        self.header_len = header_len
        """Bytes of the JSON header (after the 8-byte length)."""
        self.file_size = file_size
        self.tensors = tensors
        self.metadata: dict[str, str] = {} if metadata is None else metadata
        """The header's ``__metadata__``."""
        self.raw = raw
        """The file's first ``data_offset`` bytes as they were parsed (length and JSON), when known: what a
        whole-file digest of the loaded bytes starts with."""

    def __repr__(self) -> str:
        return (
            f"SafetensorsHeader(path={self.path!r}, header_len={self.header_len}, file_size={self.file_size}, "
            f"{len(self.tensors)} tensors)"
        )

    @property
    def data_offset(self) -> int:
        """Absolute file offset of the data section."""
        return 8 + self.header_len

    @property
    def data_len(self) -> int:
        return self.file_size - self.data_offset

    @property
    def data_aligned(self) -> bool:
        """True when the data section starts on a 4096-byte boundary (O_DIRECT/GDS friendly)."""
        return self.data_offset % DATA_ALIGNMENT == 0

    def misaligned(self) -> list[TensorInfo]:
        """Tensors whose offset in the data section is not a multiple of their element size.

        gdsload's arena holds the data section from an aligned base, so these are the tensors it
        moves to an aligned slot after the read (``Placement.copy_from``)."""
        return [t for t in self.tensors if t.start % t.itemsize]

    def __getitem__(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


def read_header(path: str | os.PathLike[str], *, file: BinaryIO | None = None) -> SafetensorsHeader:
    """Read and validate the header of a safetensors file.

    Raises :class:`HeaderError` / :class:`TruncatedFileError` (both ``ValueError``) naming the
    file, the tensor and the value at fault; nothing is read beyond the header. With ``file`` (an
    open binary file of ``path``), the header comes from it: a caller that then reads the data
    through the same file reads the file the header describes, even if ``path`` is replaced
    meanwhile.

    >>> hdr = read_header("model.safetensors")  # doctest: +SKIP
    >>> hdr["lm_head.weight"].shape
    (32000, 4096)
    """
    path = os.fspath(path)
    if file is None:
        with os.fdopen(open_regular(path), "rb") as f:
            return read_header(path, file=f)
    file_size = os.fstat(file.fileno()).st_size
    file.seek(0)
    prefix = file.read(8)
    if len(prefix) < 8:
        raise TruncatedFileError(
            f"{path!r}: {file_size} bytes is too short for a safetensors file (needs an 8-byte "
            "header length first); the file is truncated or not safetensors"
        )
    (n,) = struct.unpack("<Q", prefix)
    _check_header_len(path, n, file_size)
    raw = file.read(n)
    return parse_header(prefix + raw, file_size, path=path)


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path``; :class:`FileUnreadableError` naming it otherwise.

    Opened without blocking (a FIFO under a model's name would wait for a writer forever) and checked to be a
    regular file before anything is read from it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise FileUnreadableError(
            e.errno, f"{path!r} cannot be opened ({e.strerror or e}); check that it exists and this user may read it"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileUnreadableError(
                errno.EINVAL, f"{path!r} is not a regular file; point gdsload at safetensors files"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_header_len(path: str, n: int, file_size: int) -> None:
    if n > MAX_HEADER_BYTES:
        raise HeaderError(
            f"{path!r}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit; "
            "the file is corrupt or not safetensors"
        )
    if 8 + n > file_size:
        raise TruncatedFileError(
            f"{path!r}: header length {n} runs past the end of the {file_size}-byte file; "
            "the file is truncated (re-copy or re-download it)"
        )


def parse_header(buf: bytes, file_size: int, *, path: str = "<bytes>") -> SafetensorsHeader:
    """Validate ``buf`` (the 8-byte length plus the header) for a file of ``file_size`` bytes."""
    if len(buf) < 8:
        raise TruncatedFileError(f"{path!r}: {len(buf)} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", buf[:8])
    _check_header_len(path, n, file_size)
    if len(buf) < 8 + n:
        raise TruncatedFileError(f"{path!r}: header is {len(buf) - 8} bytes, its length field says {n}")
    raw = bytes(buf[8 : 8 + n])
    if not raw.lstrip(b" \t\r\n").startswith(b"{"):  # JSON whitespace may lead, as safetensors accepts
        raise HeaderError(f"{path!r}: header must be a JSON object starting with '{{', got {raw[:16]!r}")
    # Nesting is bounded where entries may hold keys of other writers (_parse_tensor); the known fields are flat.
    doc = strict_json.loads(
        raw,
        HeaderError,
        f"{path!r}: header",
        max_depth=None,
        strings=False,
        invalid="is not valid UTF-8 JSON; the file is corrupt",
    )
    if not isinstance(doc, dict):
        raise HeaderError(f"{path!r}: header must be a JSON object, got {type(doc).__name__}")

    metadata = _parse_metadata(path, doc.pop("__metadata__", None))
    data_len = file_size - 8 - n
    tensors = sorted(
        (_parse_tensor(path, name, entry) for name, entry in doc.items()),
        key=lambda t: (t.start, t.end),
    )
    cursor = 0
    for t in tensors:
        if t.start != cursor:
            what = "overlaps the previous tensor" if t.start < cursor else "leaves a hole after the previous tensor"
            raise HeaderError(
                f"{path!r}: tensor {t.name!r} starts at data offset {t.start}, expected {cursor}: it {what}; "
                "safetensors requires tensors to tile the data section exactly"
            )
        if t.end > data_len:
            raise TruncatedFileError(
                f"{path!r}: tensor {t.name!r} ends at data offset {t.end} but the data section holds only "
                f"{data_len} bytes; the file is truncated"
            )
        cursor = t.end
    if cursor != data_len:
        raise HeaderError(
            f"{path!r}: data section is {data_len} bytes but the tensors cover {cursor}; "
            "the file has trailing bytes or a header that lies"
        )
    return SafetensorsHeader(
        path=path, header_len=n, file_size=file_size, tensors=tuple(tensors), metadata=metadata, raw=bytes(buf[: 8 + n])
    )


def _parse_metadata(path: str, meta: Any) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise HeaderError(f"{path!r}: '__metadata__' must map strings to strings, got {strict_json.brief(meta)}")
    for k, v in meta.items():
        check_text(k, f"{path!r}: metadata key {k!r}", HeaderError)
        check_text(v, f"{path!r}: metadata value of {k!r}", HeaderError)
    return meta


_SUB_BYTE_DTYPES = ("F4", "F6_E2M3", "F6_E3M2")
"""Dtypes recent safetensors writes for torch's packed FP4/FP6 types; not read here."""


def _parse_tensor(path: str, name: str, entry: Any) -> TensorInfo:
    where = f"{path!r}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise HeaderError(
            f"{where}: entry must be an object with dtype, shape, data_offsets; got {strict_json.brief(entry)}"
        )
    missing = sorted(_TENSOR_KEYS - set(entry))
    if missing:  # other keys are ignored, as safetensors ignores them
        raise HeaderError(f"{where}: entry lacks {missing}; it needs dtype, shape and data_offsets")
    check_text(name, f"{where}: the name", HeaderError)
    if len(entry) > len(_TENSOR_KEYS):  # keys of other writers: bounded and valid Unicode, as safetensors wants
        strict_json.check_value(
            {k: v for k, v in entry.items() if k not in _TENSOR_KEYS}, HeaderError, f"{where}: entry", depth=2
        )
    dtype = entry["dtype"]
    if dtype in _SUB_BYTE_DTYPES:
        raise HeaderError(
            f"{where}: dtype {dtype} packs elements into fractions of a byte (FP4/FP6); gdsload "
            "does not read those yet: store them as U8 blocks (as MXFP4/NVFP4 checkpoints usually do)"
        )
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise HeaderError(f"{where}: unknown dtype {dtype!r}; expected one of {', '.join(SAFETENSORS_DTYPES)}")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
        # 2**63: a dimension must fit the int64 every framework keeps sizes in (even with another dimension 0)
        raise HeaderError(f"{where}: shape must be a list of integers in [0, 2**63), got {strict_json.brief(shape)}")
    count = 1
    for d in shape:  # counted as safetensors counts (left to right, in 64 bits): an overflow on the way is refused
        count *= d
        if count >= 2**63:
            raise HeaderError(
                f"{where}: shape {strict_json.brief(shape)} has 2**63 elements or more (counted left "
                "to right); no file holds such a tensor"
            )
    if count * ITEMSIZE[dtype] * 8 >= 2**64:
        raise HeaderError(
            f"{where}: shape {strict_json.brief(shape)} x {dtype} is 2**61 bytes or more; no file holds such a tensor"
        )
    offsets = entry["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and 0 <= o < 2**63 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderError(
            f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end < 2**63, got "
            f"{strict_json.brief(offsets)}"
        )
    begin, end = offsets
    expected = count * ITEMSIZE[dtype]
    if end - begin != expected:
        raise HeaderError(
            f"{where}: data_offsets {offsets} span {end - begin} bytes but shape {shape} x {dtype} "
            f"needs {expected}; the header lies about this tensor"
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), start=begin, end=end)


def check_text(text: str, what: str, error: type[ValueError] = ValueError) -> None:
    """Refuse text that is not valid Unicode (lone surrogates): safetensors cannot read such a header."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise error(
            f"{what} is not valid Unicode (it holds a lone surrogate); safetensors cannot read such a header: rename it"
        ) from None
