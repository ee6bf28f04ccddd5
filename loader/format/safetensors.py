"""The safetensors format: a strict header parser and an aligned, atomic writer.

File layout (the safetensors specification)::

    [u64 little-endian N][N bytes of JSON header, may end in spaces][data section]

Every tensor's ``data_offsets`` are relative to the data section; the tensors must tile it
exactly (no holes, no overlap) and the file must end where the last tensor ends.

We parse headers ourselves because planning needs byte ranges and alignment facts before any
data is read. The writer adds two rules that keep files valid safetensors while making them
good for O_DIRECT and GPUDirect Storage: the header is padded with spaces so the data section
starts at a multiple of 4096, and tensors are ordered by element size (largest first) so each
one is naturally aligned.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import json
import logging
import math
import os
import stat
import struct
import time
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

from gdsload.loader.config import usable_cores
from gdsload.loader.dtypes import ITEMSIZE, SAFETENSORS_DTYPES, from_torch
from gdsload.loader.errors import FileUnreadableError, HeaderError, TruncatedFileError
from gdsload.loader.format import strict_json

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    import torch

__all__ = [
    "DATA_ALIGNMENT",
    "MAX_HEADER_BYTES",
    "TensorInfo",
    "SafetensorsHeader",
    "read_header",
    "parse_header",
    "open_regular",
    "TensorSpec",
    "AlignedWriter",
    "save_file",
    "tensor_bytes",
    "atomic_output",
    "pwrite_all",
    "create_locked",
    "remove_dead_leftovers",
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

    def __init__(self, path: str, header_len: int, file_size: int, tensors: tuple[TensorInfo, ...],
                 metadata: dict[str, str] | None = None, raw: bytes = b"") -> None:
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
        return (f"SafetensorsHeader(path={self.path!r}, header_len={self.header_len}, file_size={self.file_size}, "
                f"{len(self.tensors)} tensors)")

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
        raise FileUnreadableError(e.errno, f"{path!r} cannot be opened ({e.strerror or e}); check that it exists "
                                  "and this user may read it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileUnreadableError(errno.EINVAL, f"{path!r} is not a regular file; point gdsload at "
                                      "safetensors files")
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
    doc = strict_json.loads(raw, HeaderError, f"{path!r}: header", max_depth=None, strings=False,
                            invalid="is not valid UTF-8 JSON; the file is corrupt")
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
    return SafetensorsHeader(path=path, header_len=n, file_size=file_size, tensors=tuple(tensors), metadata=metadata,
                             raw=bytes(buf[: 8 + n]))


def _parse_metadata(path: str, meta: Any) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise HeaderError(f"{path!r}: '__metadata__' must map strings to strings, got {strict_json.brief(meta)}")
    for k, v in meta.items():
        _check_text(k, f"{path!r}: metadata key {k!r}", HeaderError)
        _check_text(v, f"{path!r}: metadata value of {k!r}", HeaderError)
    return meta


_SUB_BYTE_DTYPES = ("F4", "F6_E2M3", "F6_E3M2")
"""Dtypes recent safetensors writes for torch's packed FP4/FP6 types; not read here."""


def _parse_tensor(path: str, name: str, entry: Any) -> TensorInfo:
    where = f"{path!r}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise HeaderError(f"{where}: entry must be an object with dtype, shape, data_offsets; got "
                          f"{strict_json.brief(entry)}")
    missing = sorted(_TENSOR_KEYS - set(entry))
    if missing:  # other keys are ignored, as safetensors ignores them
        raise HeaderError(f"{where}: entry lacks {missing}; it needs dtype, shape and data_offsets")
    _check_text(name, f"{where}: the name", HeaderError)
    if len(entry) > len(_TENSOR_KEYS):  # keys of other writers: bounded and valid Unicode, as safetensors wants
        strict_json.check_value({k: v for k, v in entry.items() if k not in _TENSOR_KEYS}, HeaderError,
                                f"{where}: entry", depth=2)
    dtype = entry["dtype"]
    if dtype in _SUB_BYTE_DTYPES:
        raise HeaderError(f"{where}: dtype {dtype} packs elements into fractions of a byte (FP4/FP6); gdsload "
                          "does not read those yet: store them as U8 blocks (as MXFP4/NVFP4 checkpoints usually do)")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise HeaderError(
            f"{where}: unknown dtype {dtype!r}; expected one of {', '.join(SAFETENSORS_DTYPES)}"
        )
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
        # 2**63: a dimension must fit the int64 every framework keeps sizes in (even with another dimension 0)
        raise HeaderError(f"{where}: shape must be a list of integers in [0, 2**63), got {strict_json.brief(shape)}")
    count = 1
    for d in shape:  # counted as safetensors counts (left to right, in 64 bits): an overflow on the way is refused
        count *= d
        if count >= 2**63:
            raise HeaderError(f"{where}: shape {strict_json.brief(shape)} has 2**63 elements or more (counted left "
                              "to right); no file holds such a tensor")
    if count * ITEMSIZE[dtype] * 8 >= 2**64:
        raise HeaderError(f"{where}: shape {strict_json.brief(shape)} x {dtype} is 2**61 bytes or more; no file "
                          "holds such a tensor")
    offsets = entry["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and 0 <= o < 2**63 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end < 2**63, got "
                          f"{strict_json.brief(offsets)}")
    begin, end = offsets
    expected = count * ITEMSIZE[dtype]
    if end - begin != expected:
        raise HeaderError(
            f"{where}: data_offsets {offsets} span {end - begin} bytes but shape {shape} x {dtype} "
            f"needs {expected}; the header lies about this tensor"
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), start=begin, end=end)


# --------------------------------------------------------------------------- writing


class TensorSpec(NamedTuple):
    """What the writer needs to lay a tensor out before its bytes exist."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name=name, dtype=from_torch(tensor.dtype), shape=tuple(tensor.shape))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor (copied to CPU and made contiguous if needed)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class atomic_output:
    """Write to a temporary file beside ``path``; fsync and rename on success, delete on failure.

    A killed or failing writer never leaves a partial file under the final name. Each writer has
    its own temporary file (``.NAME.tmp-RANDOM``, locked while it writes), so two writers of one
    name never mix their bytes: the last rename wins. A writer killed outright (SIGKILL, SIGTERM
    without a handler, power loss) leaves its temporary file; the next write of that name removes
    the ones no writer holds locked any more.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.tmp = Path()
        """The temporary file, named when the block is entered."""
        self.file: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        stem = f".{self.path.name}.tmp-"
        remove_dead_leftovers(self.path.parent, stem)
        self.tmp, fd = create_locked(stem, self.path.parent)
        self.file = os.fdopen(fd, "wb")
        return self.file

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self.file is not None
        try:
            try:
                if exc_type is None:
                    self.file.flush()
                    os.fsync(self.file.fileno())
            finally:
                self.file.close()
            if exc_type is None:
                os.replace(self.tmp, self.path)
        except OSError as e:  # e.g. the disk filled at the last flush: nothing stays behind
            self.tmp.unlink(missing_ok=True)
            raise OSError(e.errno, f"{self.path}: could not finish writing it ({e.strerror}); nothing was written "
                          "under that name") from e
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            return
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _check_text(text: str, what: str, error: type[ValueError] = ValueError) -> None:
    """Refuse text that is not valid Unicode (lone surrogates): safetensors cannot read such a header."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"{what} is not valid Unicode (it holds a lone surrogate); safetensors cannot read such a "
                    "header: rename it") from None


LEFTOVER_MIN_AGE_S = 10.0
"""An entry still under its creating name this long was left by a writer killed in the instant between making
and locking it (a live writer spends microseconds there); it is removed too."""


def _creating_stem(stem: str) -> str:
    return stem.rstrip("-.") + ".creating-"


def create_locked(stem: str, parent: Path, *, directory: bool = False) -> tuple[Path, int]:
    """Create ``parent/STEM RANDOM`` (a new file, or a directory) and hold an exclusive ``flock`` on it.

    Returns the path and the locked descriptor; closing the descriptor (or the process ending, however it
    ends) releases the lock, which is how :func:`remove_dead_leftovers` tells a live writer's temporary
    from a killed one's, across processes and PID namespaces. The entry is made under another name,
    locked, then renamed: nothing named ``STEM*`` is ever unlocked while its writer lives.
    """
    import secrets  # here: a load never creates files, and the module imports hmac

    while True:
        token = secrets.token_hex(3)
        making, path = parent / f"{_creating_stem(stem)}{token}", parent / f"{stem}{token}"
        if path.exists():
            continue
        try:
            if directory:
                making.mkdir()
                fd = os.open(making, os.O_RDONLY | os.O_DIRECTORY)
            else:
                fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without flock: the leftover will look live, and stay
            pass
        try:
            os.rename(making, path)
        except BaseException:
            os.close(fd)
            (making.rmdir if directory else making.unlink)()
            raise
        return path, fd


def remove_dead_leftovers(parent: Path, stem: str) -> None:
    """Best effort: delete ``parent``'s entries named ``STEM*`` (made by :func:`create_locked`) that no process
    holds locked any more (their writer was killed), and entries left under their creating name."""
    import glob
    import shutil

    try:
        leftovers = list(parent.glob(f"{glob.escape(stem)}*"))
        making = list(parent.glob(f"{glob.escape(_creating_stem(stem))}*"))
    except OSError:
        return
    now = time.time()
    for item in leftovers + [m for m in making if _older(m, now)]:
        try:
            if item.is_symlink():
                continue
            fd = os.open(item, os.O_RDONLY | (os.O_DIRECTORY if item.is_dir() else 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live writer holds it
            if item.is_dir():
                shutil.rmtree(item)
            else:
                item.unlink()
        except OSError:  # held, not ours to delete, or gone meanwhile: leave it
            pass
        finally:
            os.close(fd)


def _older(item: Path, now: float) -> bool:
    try:
        return now - item.lstat().st_mtime > LEFTOVER_MIN_AGE_S
    except OSError:
        return False


WRITE_PIECE = 16 << 20
""":class:`AlignedWriter` writes a tensor in pieces of this many bytes, several at once."""
WRITE_IN_FLIGHT = 64 << 20
"""Bytes :class:`AlignedWriter` holds for writing at most (more waits): a writer fed tensor after
tensor keeps at most this much of them alive beyond the caller's own."""


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write every byte of the buffer ``data`` at ``offset`` of ``fd`` (``pwrite`` may write fewer at once)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset + done}")
        done += n


def aligned_header(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None,
                   alignment: int = DATA_ALIGNMENT) -> tuple[list[TensorSpec], bytes, int]:
    """The layout of an aligned safetensors file: the order of its tensors (by element size, largest
    first, stable for equal sizes, so each is naturally aligned), its header (space-padded so data
    starts at a multiple of ``alignment``) and the length of its data section. ``ValueError`` for
    repeated or unsafe names and unknown dtypes, ``TypeError`` for metadata that is not str to str."""
    specs = list(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"tensor names must be unique; repeated: {dup}")
    for s in specs:
        if s.dtype not in ITEMSIZE:
            raise ValueError(f"tensor {s.name!r}: unknown dtype {s.dtype!r}")
        _check_text(s.name, f"tensor name {s.name!r}")
        if s.name == "__metadata__":
            raise ValueError("a tensor cannot be named '__metadata__': safetensors keeps that key for metadata")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must map str to str (safetensors stores only strings)")
    for k, v in (metadata or {}).items():
        _check_text(k, f"metadata key {k!r}")
        _check_text(v, f"metadata value of {k!r}")
    order = sorted(specs, key=lambda s: -ITEMSIZE[s.dtype])
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for s in order:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    padded = -(-(8 + len(raw)) // alignment) * alignment - 8
    return order, struct.pack("<Q", padded) + raw + b" " * (padded - len(raw)), offset


class AlignedWriter:
    """Lays out tensors for an aligned safetensors file and streams them in, one at a time.

    Tensors are ordered by element size, largest first (stable for equal sizes), so each is
    naturally aligned; the header is space-padded so data starts at a multiple of 4096.
    ``order`` is the sequence in which :meth:`write` expects tensors.

    Every offset is known from the header, so :meth:`write` hands the tensor's bytes to ``threads``
    threads that write its pieces in place at once (``pwrite``) and returns; at most
    ``WRITE_IN_FLIGHT`` bytes wait (the writer keeps them alive), and leaving the ``with`` block
    waits for every write.

    With ``checksums`` (the default) the CRC-32 of each tensor stored raw is computed from the bytes handed to
    :meth:`write`, beside its writes, and recorded in the header's ``__metadata__``
    (:mod:`~gdsload.loader.format.checksums`): the header is laid out with zeros in their place, and written
    once every tensor is, with the checksums filled in. Tensors the metadata describes as compressed get no entry (their
    decoded bytes carry a ``crc32`` of their own), unless the metadata given already records theirs.
    With ``digest`` (True: blake3; or ``"sha256"``) ``digest`` holds the whole file's ``"<algorithm>:<hex>"``
    once the block has ended: hashed on the way when there are no checksums to fill in, else from the finished
    file before it is renamed into place (the header changes last). A failed write raises ``OSError`` naming
    the file and the tensor (its ``tensor`` attribute), at the next :meth:`write` or at the block's end.

    >>> specs = [TensorSpec("w", "BF16", (4, 4)), TensorSpec("b", "F32", (4,))]
    >>> with AlignedWriter("out.safetensors", specs) as w:  # doctest: +SKIP
    ...     for spec in w.order:
    ...         w.write(spec.name, tensors[spec.name])
    >>> w.digest  # doctest: +SKIP
    'blake3:6437b3a...'
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        specs: Iterable[TensorSpec],
        metadata: Mapping[str, str] | None = None,
        *,
        alignment: int = DATA_ALIGNMENT,
        digest: bool | str = True,
        threads: int | None = None,
        checksums: bool = True,
    ):
        if threads is not None and threads < 1:
            raise ValueError(f"threads={threads!r} must be at least 1")
        specs = list(specs)
        metadata = dict(metadata or {})
        self._metadata, self._alignment = metadata, alignment
        self._crcs: dict[str, int] = {}
        """Checksums of the table: known ones (kept from the metadata given), then those computed while writing."""
        self._crc_names: set[str] = set()
        """Tensors whose CRC-32 is computed from the bytes :meth:`write` gets."""
        if checksums:
            self._plan_checksums(specs, metadata)
        else:
            metadata.pop(CHECKSUMS_KEY, None)  # a table of other bytes would make every load fail
        self.order, self.header, self.data_len = aligned_header(specs, metadata or None, alignment)
        self.digest: str | None = None
        """``"<algorithm>:<hex>"`` of the whole file once the ``with`` block ended without error (with ``digest``)."""
        from gdsload.loader.format.digests import hasher, require  # here: loading a file hashes nothing

        algorithm = require(digest)  # its package imported now: a writer that cannot hash fails before writing
        self._algorithm = algorithm
        # A header that records checksums is written last: then the file is hashed once finished.
        self._hash = hasher(algorithm) if algorithm and CHECKSUMS_KEY not in metadata else None
        self._threads = threads or min(8, usable_cores())
        self._out = atomic_output(path)
        self._next = 0
        self._at = len(self.header)
        self._f: BinaryIO | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._hasher: ThreadPoolExecutor | None = None
        self._pending: collections.deque[tuple[str | None, int, list[Future[None]]]] = collections.deque()
        """Writes not yet waited for, oldest first: (tensor name or None for the header, bytes, futures)."""
        self._pending_bytes = 0

    def _plan_checksums(self, specs: list[TensorSpec], metadata: dict[str, str]) -> None:
        """Put a table of zeros for the tensors to checksum into ``metadata`` (filled in at the end)."""
        from gdsload.loader.format import checksums as sums

        sums.require()
        names = [s.name for s in specs]
        packed = _compressed_names(metadata)
        inherited: dict[str, int] = {}
        if CHECKSUMS_KEY in metadata:  # a re-pack of a file that records them: its decoded bytes are the same
            try:
                inherited = sums.parse_checksums_text(metadata[CHECKSUMS_KEY], set(names), "the metadata given")
            except ValueError as e:
                log.warning("%s; the table is not kept", e)
        self._crc_names = {n for n in names if n not in packed}
        self._crcs = {n: inherited[n] for n in names if n in packed and n in inherited}
        # In the order of the table given (a re-pack of intact data records it as it was, byte for byte), then
        # in the order of the specs.
        ordered = [n for n in inherited if n in self._crc_names or n in self._crcs]
        ordered += [n for n in names if n in self._crc_names and n not in inherited]
        metadata[CHECKSUMS_KEY] = sums.placeholder(ordered)

    def __enter__(self) -> AlignedWriter:
        from concurrent.futures import ThreadPoolExecutor

        self._f = self._out.__enter__()
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="gdsload-write")
        if self._hash is not None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="gdsload-hash")
        try:
            if not self._table:  # else the header is written once, last, with its checksums
                self._submit(None, memoryview(self.header), 0)
                self._settle(None)
        except BaseException:  # __exit__ does not run when __enter__ raises
            self._stop()
            self._out.__exit__(*sys.exc_info())
            raise
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor; it must be ``order[i].name`` with the declared dtype and shape.

        Returns once its writes are queued (or, past ``WRITE_IN_FLIGHT`` pending bytes, once older ones
        are done): the tensor's memory must not change until the ``with`` block ends.
        """
        assert self._f is not None, "use AlignedWriter as a context manager"
        if self._next >= len(self.order):
            raise ValueError(f"tensor {name!r}: all {len(self.order)} declared tensors are already written")
        spec = self.order[self._next]
        if name != spec.name:
            raise ValueError(f"expected tensor {spec.name!r} next (see AlignedWriter.order), got {name!r}")
        got = TensorSpec.of(name, tensor)
        if got != spec:
            raise ValueError(f"tensor {name!r}: declared {spec.dtype}{list(spec.shape)}, got {got.dtype}{list(got.shape)}")
        view = tensor_bytes(tensor)
        self._submit(name, view, self._at, checksum=name in self._crc_names)
        self._at += len(view)
        self._next += 1
        self._settle(WRITE_IN_FLIGHT)

    def _submit(self, name: str | None, view: memoryview, offset: int, *, checksum: bool = False) -> None:
        assert self._f is not None and self._pool is not None
        fd = self._f.fileno()
        futures = [self._pool.submit(pwrite_all, fd, view[i : i + WRITE_PIECE], offset + i)
                   for i in range(0, len(view), WRITE_PIECE)]
        if checksum:
            assert name is not None
            futures.append(self._pool.submit(self._checksum, name, view))
        if self._hasher is not None and len(view):
            assert self._hash is not None
            futures.append(self._hasher.submit(self._hash.update, view))
        self._pending.append((name, len(view), futures))
        self._pending_bytes += len(view)

    def _checksum(self, name: str, view: memoryview) -> None:
        from gdsload.loader.format.checksums import crc32

        self._crcs[name] = crc32(view)

    @property
    def _table(self) -> bool:
        return CHECKSUMS_KEY in self._metadata

    def _finish_header(self) -> None:
        """Write the header, its checksums now known, in the room left for it (its length does not depend on them)."""
        if not self._table:
            return
        from gdsload.loader.format.checksums import render

        assert self._f is not None
        table = {n: self._crcs[n] for n in _table_names(self._metadata)}
        _, header, _ = aligned_header([TensorSpec(s.name, s.dtype, s.shape) for s in self.order],
                                      {**self._metadata, CHECKSUMS_KEY: render(table)}, self._alignment)
        if len(header) != len(self.header):  # cannot happen: the table's length does not depend on its values
            raise AssertionError(f"{self._out.path}: the header changed length when its checksums were filled in")
        try:
            pwrite_all(self._f.fileno(), header, 0)
        except OSError as e:
            err = OSError(e.errno, f"{self._out.path}: writing the header failed ({e.strerror or e})")
            err.tensor = None  # type: ignore[attr-defined]
            raise err from e
        self.header = header

    def _settle(self, limit: int | None) -> None:
        """Wait for the oldest writes until at most ``limit`` bytes are pending (None: all of them);
        raise the first failure as an ``OSError`` naming the file and the tensor."""
        while self._pending and (limit is None or self._pending_bytes > limit):
            name, n, futures = self._pending.popleft()
            self._pending_bytes -= n
            for fut in futures:
                try:
                    fut.result()
                except OSError as e:
                    what = "the header" if name is None else f"tensor {name!r}"
                    err = OSError(e.errno, f"{self._out.path}: writing {what} failed ({e.strerror or e})")
                    err.tensor = name  # type: ignore[attr-defined]
                    raise err from e

    def _stop(self) -> None:
        """Let every queued write finish (they hold the file open) and end the threads."""
        for pool in (self._pool, self._hasher):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        self._pending_bytes = 0

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            try:
                self._settle(None)
            except BaseException:
                self._stop()
                self._out.__exit__(*sys.exc_info())
                raise
        self._stop()
        if exc_type is None and self._next != len(self.order):
            missing = [s.name for s in self.order[self._next :]]
            self._out.__exit__(ValueError, None, None)
            raise ValueError(f"{self._out.path}: {len(missing)} declared tensors were never written: {missing[:5]}")
        digest = None
        if exc_type is None:
            try:
                self._finish_header()
                if self._algorithm and self._hash is None:  # the finished file, before it takes its name
                    from gdsload.loader.format.digests import file_digest

                    digest = file_digest(self._out.tmp, self._algorithm)
            except BaseException:
                self._out.__exit__(*sys.exc_info())
                raise
        self._out.__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.digest = self._hash.text() if self._hash is not None else digest


CHECKSUMS_KEY = "gdsload.checksums"
"""The ``__metadata__`` key of the per-tensor checksums (:mod:`gdsload.loader.format.checksums`)."""


def _compressed_names(metadata: Mapping[str, str]) -> set[str]:
    """Tensors the metadata's ``gdsload.compression`` document describes as compressed (none when it has none)."""
    raw = metadata.get("gdsload.compression")
    if raw is None:
        return set()
    doc = strict_json.loads(raw, ValueError, "the metadata's 'gdsload.compression'")
    tensors = doc.get("tensors") if isinstance(doc, dict) else None
    return set(tensors) if isinstance(tensors, dict) else set()


def _table_names(metadata: Mapping[str, str]) -> list[str]:
    """The tensor names of the checksum table in ``metadata``, in its order."""
    return list(json.loads(metadata[CHECKSUMS_KEY])["tensors"])


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` as an aligned safetensors file, atomically.

    A drop-in for ``safetensors.torch.save_file`` whose output any safetensors reader opens.

    >>> save_file({"w": torch.ones(2, 2, dtype=torch.bfloat16)}, "w.safetensors")  # doctest: +SKIP
    """
    specs = [TensorSpec.of(name, t) for name, t in tensors.items()]
    with AlignedWriter(path, specs, metadata) as w:
        for spec in w.order:
            w.write(spec.name, tensors[spec.name])
