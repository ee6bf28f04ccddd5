"""Streaming a checkpoint file: a writer thread behind a bounded queue, small pieces gathered, the header last.

A checkpoint's header (safetensors: it comes first) holds every stored size, known only once the tensors are
compressed; so callers reserve room for it, append stored bytes from that offset on while the next tensor
compresses (:class:`Appender` hands them to the :class:`WritePipe` thread), then write the real header at offset 0.
Used by :mod:`.container`, :mod:`.dropin` and the DCP storage writer.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import format_bytes
from ..errors import BackendUnavailableError, CheckpointWriteError
from ..format.compression import FORMAT_VERSION, METADATA_KEY
from ..format.safetensors import DATA_ALIGNMENT
from ..format.writer import pwrite_all, tensor_bytes

__all__ = [
    "QUEUE_DEPTH",
    "header_json",
    "with_compression",
    "reserved_start",
    "PosixSink",
    "KvikioSink",
    "kvikio_missing",
    "open_sink",
    "write_failed",
    "WritePipe",
    "Appender",
    "host_bytes",
    "Frames",
]

log = logging.getLogger(__name__)

QUEUE_DEPTH = 2
"""Stored tensors waiting for the writer; with one being written and one being compressed,
at most four are in host memory at once."""
SMALL_WRITE = 64 << 10
"""Pieces smaller than this are gathered into one write of up to ``COALESCE_BYTES``."""
COALESCE_BYTES = 4 << 20
SYNC_BYTES = 256 << 20


def header_json(metadata: Mapping[str, str], entries: Iterable[tuple[str, str, list[int], int, int]]) -> bytes:
    doc: dict[str, Any] = {"__metadata__": dict(metadata)}
    for name, dtype, shape, start, end in entries:
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def with_compression(metadata: Mapping[str, str], entries: Mapping[str, dict[str, Any]]) -> dict[str, str]:
    out = dict(metadata)
    if entries:
        out[METADATA_KEY] = json.dumps({"version": FORMAT_VERSION, "tensors": dict(entries)}, separators=(",", ":"))
    return out


_IOV = 512
"""Buffers per pwritev call (the system allows at least 1024)."""


class Frames:
    """Stored bytes as a run of buffers (compressed frames), written with pwritev and never joined in memory."""

    def __init__(self, parts: Sequence[bytes]):
        self.parts = list(parts)
        self.nbytes = sum(len(p) for p in self.parts)

    def joined(self) -> np.ndarray:
        return np.frombuffer(b"".join(self.parts), dtype=np.uint8)


def pwritev_all(fd: int, parts: Sequence[bytes], offset: int) -> None:
    """Write ``parts`` one after the other at ``offset`` (pwritev, which may write fewer bytes than asked)."""
    i = 0
    while i < len(parts):
        batch = parts[i : i + _IOV]
        n = os.pwritev(fd, batch, offset)
        want = sum(len(b) for b in batch)
        if n == want:
            offset, i = offset + n, i + len(batch)
            continue
        for b in batch:  # a short write: finish the batch piece by piece from where it stopped
            if n >= len(b):
                n -= len(b)
            else:
                pwrite_all(fd, memoryview(b)[n:], offset + n)
                n = 0
            offset += len(b)
        i += len(batch)


class PosixSink:
    name = "posix"

    def __init__(self, fd: int):
        self.fd = fd

    def write(self, data: np.ndarray | Frames, offset: int) -> None:
        if isinstance(data, Frames):
            pwritev_all(self.fd, data.parts, offset)
        else:
            pwrite_all(self.fd, data, offset)

    def close(self) -> None:
        pass


class KvikioSink:
    name = "kvikio"

    def __init__(self, path: Path):
        import kvikio

        self._file = kvikio.CuFile(path, "r+")  # the temp file exists; "w" would also do (it is empty)

    def write(self, data: np.ndarray | Frames, offset: int) -> None:
        if isinstance(data, Frames):
            data = data.joined()
        n = self._file.pwrite(data, data.nbytes, offset).get()
        if n != data.nbytes:
            raise OSError(errno.EIO, f"kvikio wrote {n} of {data.nbytes} bytes at offset {offset}")

    def close(self) -> None:
        self._file.close()


def kvikio_missing() -> str | None:
    try:
        import kvikio  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        return f"{type(e).__name__}: {e}"
    return None


def open_sink(writer: str, tmp: Path, fd: int) -> PosixSink | KvikioSink:
    if writer != "posix":
        try:
            return KvikioSink(tmp)
        except Exception as e:  # not installed, or cuFile could not open the file here
            if writer == "kvikio":
                raise BackendUnavailableError(
                    f"writer='kvikio' cannot open {str(tmp)!r} ({type(e).__name__}: {e}); "
                    "install gdsload[cu12] or gdsload[cu13], or use writer='posix'"
                ) from None
            log.debug("writer auto: kvikio is not usable (%s: %s); writing with pwrite", type(e).__name__, e)
    return PosixSink(fd)


def write_failed(path: Path, e: BaseException, done: int | None = None) -> CheckpointWriteError:
    while isinstance(e, OSError) and isinstance(e.__cause__, OSError):
        e = e.__cause__  # the system's own words, not a wrapper's sentence (atomic_output rephrases)
    code = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
    text = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
    fix = {
        errno.ENOSPC: "free space or save elsewhere",
        errno.EDQUOT: "free space or save elsewhere",
        errno.EACCES: "save where you may write",
    }.get(code, "check the path, its file system and permissions")
    if code == errno.ENOENT:
        fix = (
            "create its directory first"
            if not path.parent.is_dir()
            else "its temporary file vanished while saving: did another process remove it?"
        )
    after = "" if done is None else f" after {format_bytes(done)} of data"
    return CheckpointWriteError(
        code,
        f"writing checkpoint {str(path)!r} failed{after}: {text}; nothing was written under that name and a "
        f"previous checkpoint there is intact — {fix}",
    )


class WritePipe:
    """The writer thread: takes ``(offset, bytes)`` from a bounded queue and writes them."""

    def __init__(self, sink: PosixSink | KvikioSink, fd: int, path: Path):
        self._sink, self._fd, self._path = sink, fd, path
        self._queue: queue.Queue[tuple[int, np.ndarray | Frames] | None] = queue.Queue(maxsize=QUEUE_DEPTH)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.busy = 0.0
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="gdsload-checkpoint-writer", daemon=True)
        self._thread.start()

    def put(self, offset: int, data: np.ndarray | Frames) -> None:
        if self.error is not None:
            raise write_failed(self._path, self.error, self.written) from self.error
        self._queue.put((offset, data))

    def _run(self) -> None:
        unsynced = 0
        while (item := self._queue.get()) is not None:
            if self.error is not None or self._stop.is_set():
                continue  # keep draining so the producer never blocks
            offset, data = item
            t = time.perf_counter()
            try:
                self._sink.write(data, offset)
                self.written += data.nbytes
                unsynced += data.nbytes
                if unsynced >= SYNC_BYTES:
                    os.fdatasync(self._fd)
                    unsynced = 0
            except BaseException as e:  # reported to the producer at its next put, or at finish
                self.error = e
            self.busy += time.perf_counter() - t

    def finish(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise write_failed(self._path, self.error, self.written) from self.error

    def abort(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join()


class Appender:
    """Hands stored bytes to the writer at consecutive offsets, gathering small pieces."""

    def __init__(self, pipe: WritePipe, offset: int):
        self.offset = offset
        self._pipe = pipe
        self._pending: list[np.ndarray] = []
        self._pending_at = offset
        self._pending_bytes = 0

    def add(self, data: np.ndarray | Frames) -> int:
        """Queue ``data`` at the next offset; returns that offset."""
        start, n = self.offset, data.nbytes
        if n >= SMALL_WRITE:
            self.flush()
            self._pipe.put(start, data)
        elif n:
            if not self._pending:
                self._pending_at = start
            self._pending.append(data.joined() if isinstance(data, Frames) else data)
            self._pending_bytes += n
            if self._pending_bytes >= COALESCE_BYTES:
                self.flush()
        self.offset += n
        return start

    def flush(self) -> None:
        if self._pending:
            self._pipe.put(self._pending_at, np.concatenate(self._pending))
            self._pending, self._pending_bytes = [], 0


def host_bytes(t: torch.Tensor) -> np.ndarray:
    return np.frombuffer(tensor_bytes(t), dtype=np.uint8)


def reserved_start(bound: int) -> int:
    """Where the data section starts for a header of at most ``bound`` bytes: after the 8-byte length, rounded up
    to a multiple of 4096 (so raw tensors can be read with O_DIRECT)."""
    return -(-(8 + bound) // DATA_ALIGNMENT) * DATA_ALIGNMENT
