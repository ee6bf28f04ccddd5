"""The safetensors format, write side: an aligned writer whose files every safetensors reader opens.

Two rules keep the files valid safetensors while making them good for O_DIRECT and GPUDirect Storage: the
header is padded with spaces so the data section starts at a multiple of 4096
(:data:`~gdsload.loader.format.safetensors.DATA_ALIGNMENT`), and tensors are ordered by element size (largest
first) so each one is naturally aligned. Every file appears atomically (:mod:`gdsload.loader.format.atomic`).
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import math
import os
import struct
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

from ..config import usable_cores
from ..dtypes import ITEMSIZE, from_torch
from . import strict_json
from .atomic import atomic_output
from .safetensors import DATA_ALIGNMENT, check_text

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    import torch

__all__ = [
    "TensorSpec",
    "AlignedWriter",
    "aligned_header",
    "save_file",
    "tensor_bytes",
    "pwrite_all",
    "WRITE_PIECE",
    "WRITE_IN_FLIGHT",
    "CHECKSUMS_KEY",
]


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


def aligned_header(
    specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None, alignment: int = DATA_ALIGNMENT
) -> tuple[list[TensorSpec], bytes, int]:
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
        check_text(s.name, f"tensor name {s.name!r}")
        if s.name == "__metadata__":
            raise ValueError("a tensor cannot be named '__metadata__': safetensors keeps that key for metadata")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must map str to str (safetensors stores only strings)")
    for k, v in (metadata or {}).items():
        check_text(k, f"metadata key {k!r}")
        check_text(v, f"metadata value of {k!r}")
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
        from .digests import hasher, require  # here: loading a file hashes nothing

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
        from . import checksums as sums

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
            raise ValueError(
                f"tensor {name!r}: declared {spec.dtype}{list(spec.shape)}, got {got.dtype}{list(got.shape)}"
            )
        view = tensor_bytes(tensor)
        self._submit(name, view, self._at, checksum=name in self._crc_names)
        self._at += len(view)
        self._next += 1
        self._settle(WRITE_IN_FLIGHT)

    def _submit(self, name: str | None, view: memoryview, offset: int, *, checksum: bool = False) -> None:
        assert self._f is not None and self._pool is not None
        fd = self._f.fileno()
        futures = [
            self._pool.submit(pwrite_all, fd, view[i : i + WRITE_PIECE], offset + i)
            for i in range(0, len(view), WRITE_PIECE)
        ]
        if checksum:
            assert name is not None
            futures.append(self._pool.submit(self._checksum, name, view))
        if self._hasher is not None and len(view):
            assert self._hash is not None
            futures.append(self._hasher.submit(self._hash.update, view))
        self._pending.append((name, len(view), futures))
        self._pending_bytes += len(view)

    def _checksum(self, name: str, view: memoryview) -> None:
        from .checksums import crc32

        self._crcs[name] = crc32(view)

    @property
    def _table(self) -> bool:
        return CHECKSUMS_KEY in self._metadata

    def _finish_header(self) -> None:
        """Write the header, its checksums now known, in the room left for it (its length does not depend on them)."""
        if not self._table:
            return
        from .checksums import render

        assert self._f is not None
        table = {n: self._crcs[n] for n in _table_names(self._metadata)}
        _, header, _ = aligned_header(
            [TensorSpec(s.name, s.dtype, s.shape) for s in self.order],
            {**self._metadata, CHECKSUMS_KEY: render(table)},
            self._alignment,
        )
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
                    from .digests import file_digest

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
