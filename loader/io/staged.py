"""The staged reader (``_staged.c``), from Python: cached files into GPU memory through small pinned buffers.

Reader threads in C ``pread`` file chunks into their own pinned buffers and copy each to the device on their
own CUDA stream while reading the next chunk; see the C file's header for the design. It is what the
``pinned`` and ``cufile`` readers use for files in the page cache or on tmpfs when it is built (the install
builds it where a C compiler is present); without it they use kvikio's reader, and their reports say which
ran (``file_readers()``).

>>> eng = StagedPool(device_index=0, threads=16, chunk=2 << 20, buffers=3)  # doctest: +SKIP
>>> wait = eng.submit([(fd, 0, nbytes, dst_address)], ["/models/m/model.safetensors"])  # doctest: +SKIP
>>> wait()  # doctest: +SKIP
>>> eng.close()  # doctest: +SKIP

``device_index=None`` copies into host memory instead (the same threads and buffers; the tests use it).
"""

from __future__ import annotations

import atexit
import ctypes
import errno as _errno
import importlib.util
import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..config import parse_bool
from ..devices import PrimaryContext, cuda_error_name
from ..errors import BackendUnavailableError, FileUnreadableError, GdsloadError, TruncatedFileError

__all__ = [
    "StagedPool",
    "StagedReader",
    "StagedReaderError",
    "StagedRangeError",
    "unavailable",
    "library_path",
    "shared_pool",
    "prepare",
    "release",
    "DEFAULT_THREADS",
    "DEFAULT_CHUNK",
    "DEFAULT_BUFFERS",
]

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
POLL_MS = 50
"""How often a waiter reports progress while a ticket runs."""
DEFAULT_THREADS = 16
DEFAULT_CHUNK = 2 << 20
DEFAULT_BUFFERS = 2
"""The pool's default shape: 16 readers, two 2 MiB buffers each (64 MiB of pinned staging). From tmpfs on an
H200 this shape was the fastest of those tried (``bench/RESULTS.md``)."""


class StagedReaderError(GdsloadError, RuntimeError):
    """The pool could not start, or the CUDA driver failed a copy."""


class StagedRangeError(GdsloadError, ValueError):
    """A range given to the pool is not a range of a file (negative, past 2**63 - 1, or too many chunks)."""


class _Ticket:
    """One submit's reads: the pool's ticket until it has been waited for, then its outcome (kept, so that a
    second wait, or a wait after :meth:`StagedPool.close`, gives the same answer without touching freed memory)."""

    __slots__ = ("handle", "lock", "error", "done_bytes")

    def __init__(self, handle: int) -> None:
        self.handle: int | None = handle
        """The pool's ticket; None once its outcome is known (the pool frees it then)."""
        self.lock = threading.RLock()
        self.error: _Error | None = None
        self.done_bytes = 0


class _Extent(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_int),
        ("tag", ctypes.c_int),
        ("offset", ctypes.c_longlong),
        ("length", ctypes.c_longlong),
        ("dst", ctypes.c_ulonglong),
    ]


class _Error(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("detail", ctypes.c_int), ("tag", ctypes.c_int), ("offset", ctypes.c_longlong)]


_OK, _EOF, _READ, _CUDA, _NOMEM, _INVALID = range(6)
MAX_OFFSET = 2**63 - 1
"""No byte of a range may lie past this file offset (the largest ``off_t``)."""
_lib: ctypes.CDLL | None = None
_why: str | None = None
_lock = threading.Lock()


def library_path() -> str | None:
    """Where the built staged reader is, or None when the install did not build it."""
    spec = importlib.util.find_spec("gdsload.loader.io._staged")
    return spec.origin if spec is not None and spec.origin and spec.origin.endswith(".so") else None


def _load() -> ctypes.CDLL | None:
    global _lib, _why
    with _lock:
        if _lib is None and _why is None:
            path = library_path()
            if path is None:
                _why = "the staged reader was not built (the install found no C compiler); reinstall gdsload with one"
                return None
            try:
                lib = ctypes.CDLL(path, use_errno=True)
            except OSError as e:
                _why = f"the staged reader at {path} does not load ({e})"
                return None
            V = ctypes.c_void_p
            lib.gdsl_open.argtypes = [V, ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
            lib.gdsl_open.restype = V
            lib.gdsl_submit.argtypes = [V, ctypes.POINTER(_Extent), ctypes.c_long]
            lib.gdsl_submit.restype = V
            lib.gdsl_wait.argtypes = [V, V, ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(_Error)]
            lib.gdsl_wait.restype = ctypes.c_int
            lib.gdsl_close.argtypes = [V]
            lib.gdsl_close.restype = None
            lib.gdsl_start.argtypes = [V]
            lib.gdsl_start.restype = ctypes.c_int
            _lib = lib
        return _lib


def unavailable() -> str | None:
    """Why the staged reader cannot be used here, or None when it can (``GDSLOAD_STAGED=0`` turns it off)."""
    switch = os.environ.get("GDSLOAD_STAGED", "").strip()
    if switch and not parse_bool(switch, "GDSLOAD_STAGED"):
        return "GDSLOAD_STAGED turns the staged reader off"
    return None if _load() is not None else _why


class StagedPool:
    """``threads`` readers with ``buffers`` staging buffers of ``chunk`` bytes each, copying to CUDA device
    ``device_index`` (None: into host memory). Threads start, and pin their buffers, with the first submit."""

    def __init__(self, device_index: int | None, *, threads: int, chunk: int, buffers: int = 3):
        lib = _load()
        if lib is None:
            raise StagedReaderError(_why or "the staged reader is unavailable")
        if threads < 1 or buffers < 1 or chunk < 4096:
            raise ValueError(f"bad pool shape: threads={threads} chunk={chunk} buffers={buffers}")
        self._lib = lib
        self.threads, self.chunk, self.buffers = threads, chunk, buffers
        try:
            self._cuda = PrimaryContext(device_index) if device_index is not None else None
        except BackendUnavailableError as e:
            raise StagedReaderError(str(e)) from None
        handle = lib.gdsl_open(self._cuda.handle if self._cuda else None, threads, chunk, buffers)
        if not handle:
            if self._cuda:
                self._cuda.release()
            raise StagedReaderError(
                "the staged reader did not start (the CUDA driver lacks a function it needs, or memory is short)"
            )
        self._handle: int | None = handle
        self._state = threading.Lock()
        """Guards ``_handle``, ``_closing`` and ``_tickets``."""
        self._closing = False
        self._tickets: set[_Ticket] = set()
        """Tickets submitted whose outcome nobody has collected yet."""

    def start(self) -> None:
        """Start the threads now: they pin their staging while the caller goes on (a submit starts them otherwise)."""
        with self._state:
            if self._handle is None or self._closing:
                raise StagedReaderError("the staged reader is closed")
            if self._lib.gdsl_start(self._handle):
                raise StagedReaderError("the staged reader could not start a reader thread")

    @property
    def staging_bytes(self) -> int:
        """Host staging (pinned, on a GPU) the pool holds once all its threads run."""
        return self.threads * self.buffers * self.chunk

    def submit(
        self, items: Sequence[tuple[int, int, int, int]], paths: Sequence[str], progress: Progress | None = None
    ) -> Callable[[], None]:
        """Queue ``(fd, file_offset, length, dst_address)`` ranges (``paths[i]`` names item i in errors); returns the
        function that waits until every byte is at its destination, calling ``progress`` with the bytes done.

        A range must lie inside its file: one past the end of a regular file is a :class:`TruncatedFileError` here,
        one that is negative or reaches past 2**63 - 1 a :class:`StagedRangeError`. The waiter may be called more
        than once, and after :meth:`close`: it gives the same outcome each time.
        """
        _check_ranges(items, paths)
        arr = (_Extent * len(items))(*(_Extent(fd, i, off, n, dst) for i, (fd, off, n, dst) in enumerate(items)))
        ticket: _Ticket | None = None
        if items:
            with self._state:
                if self._handle is None or self._closing:
                    raise StagedReaderError("the staged reader is closed; reads cannot be queued on it")
                handle = self._lib.gdsl_submit(self._handle, arr, len(items))
                if not handle:
                    code = ctypes.get_errno()
                    if code in (_errno.EINVAL, _errno.EOVERFLOW):
                        raise StagedRangeError(
                            f"the staged reader refused {len(items)} range(s) of {', '.join(map(repr, paths[:3]))}: "
                            f"{os.strerror(code)} (a range is negative, ends past byte 2**63 - 1, or needs more than "
                            f"2**26 chunks of {self.chunk} bytes)"
                        )
                    raise StagedReaderError(
                        "the staged reader could not queue the reads (out of memory, or no thread starts)"
                    )
                ticket = _Ticket(handle)
                self._tickets.add(ticket)
        lengths = [n for _, _, n, _ in items]

        def wait() -> None:
            if ticket is None:
                return
            reported = self._collect(ticket, progress)
            if progress is not None and ticket.done_bytes > reported:
                progress(ticket.done_bytes - reported)
            if ticket.error is not None and ticket.error.code != _OK:
                raise self._error(ticket.error, paths, lengths, items)

        return wait

    def _collect(self, ticket: _Ticket, progress: Progress | None) -> int:
        """Wait for ``ticket`` until its outcome is known (once: later calls find it kept); returns the bytes
        reported to ``progress`` meanwhile."""
        done, err, reported = ctypes.c_longlong(), _Error(), 0
        with ticket.lock:
            while ticket.error is None:
                handle = self._handle
                if handle is None:  # forgotten without a close (the process forked, or is exiting)
                    ticket.error = _Error(_INVALID, 0, -1, 0)
                    break
                finished = self._lib.gdsl_wait(
                    handle, ticket.handle, POLL_MS if progress else -1, ctypes.byref(done), ctypes.byref(err)
                )
                ticket.done_bytes = done.value
                if finished:
                    ticket.handle = None  # freed by the pool
                    ticket.error = _Error(err.code, err.detail, err.tag, err.offset)
                    with self._state:
                        self._tickets.discard(ticket)
                    break
                if progress is not None and done.value > reported:
                    progress(done.value - reported)  # may close the pool: the loop checks the outcome again
                    reported = done.value
        return reported

    def _error(
        self, err: _Error, paths: Sequence[str], lengths: Sequence[int], items: Sequence[tuple[int, int, int, int]]
    ) -> Exception:
        path = paths[err.tag] if 0 <= err.tag < len(paths) else "?"
        if err.code == _EOF:
            _, off, n, _ = items[err.tag]
            return TruncatedFileError(
                f"{path!r} ends at byte {err.offset}, inside the range {off}-{off + n} it "
                "should hold; the file shrank while it was being loaded — re-copy it"
            )
        if err.code == _READ:
            return FileUnreadableError(
                err.detail,
                f"reading {path!r} at byte {err.offset}: "
                f"{os.strerror(err.detail)} ({_errno.errorcode.get(err.detail, '?')})",
            )
        if err.code == _CUDA:
            where = f" copying {path!r} at byte {err.offset}" if err.tag >= 0 else " setting up its threads"
            return StagedReaderError(f"CUDA failed{where}: {cuda_error_name(err.detail)}")
        if err.code == _INVALID:
            return StagedReaderError(
                f"the reads of {path!r} were not waited for before the staged reader was "
                "dropped (the process forked or is exiting); load again"
            )
        return StagedReaderError("the staged reader's threads could not allocate their staging buffers")

    def close(self) -> None:
        """Finish what was queued, stop the threads and free their buffers. The outcome of every ticket not yet
        waited for is kept: its waiter still answers (with the reads' error, if any)."""
        with self._state:
            if self._closing:
                return
            self._closing = True
            pending = list(self._tickets)
        for ticket in pending:
            self._collect(ticket, None)
        with self._state:
            handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.gdsl_close(handle)
        if self._cuda is not None:
            self._cuda.release()
            self._cuda = None

    def __enter__(self) -> StagedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class StagedReader:
    """One load's reads of some files of its plan into a device's buffers through the staged reader, for a reader
    backend.

    It uses the process's shared pool of its shape (:func:`shared_pool`).
    """

    def __init__(
        self,
        device: Any,
        plan: Any,
        *,
        threads: int | None = None,
        chunk: int | None = None,
        buffers: int | None = None,
    ):
        self.device = device
        self.plan = plan
        index = (device.index or 0) if device.kind == "cuda" else None
        self.pool = _pool_for(index, threads, chunk, buffers)

    def submit(
        self, extents: Sequence[Any], dsts: Sequence[Any], progress: Progress | None = None
    ) -> Callable[[], None]:
        """Start copying ``extents`` (:class:`~gdsload.loader.plan.Extent`) into ``dsts``; returns the waiter."""
        extents = [e for e in extents if e.length]
        bases = [self.device.address(d) for d in dsts]
        for e in extents:  # the pool writes raw addresses: an extent must fit its buffer
            if e.offset < 0 or e.offset + e.length > self.device.nbytes(dsts[e.buffer]):
                raise ValueError(f"extent {e} does not fit its buffer of {self.device.nbytes(dsts[e.buffer])} bytes")
        items = [(self.plan.fds[e.file_index], e.file_offset, e.length, bases[e.buffer] + e.offset) for e in extents]
        return self.pool.submit(items, [self.plan.files[e.file_index].path for e in extents], progress)

    def close(self) -> None:
        """Nothing to free: the pool stays for the process's next load (:func:`release` frees it)."""
        self.pool = None  # type: ignore[assignment]


def _check_ranges(items: Sequence[tuple[int, int, int, int]], paths: Sequence[str]) -> None:
    """Refuse ranges that cannot be ranges of their files, before the pool sees them."""
    sizes: dict[int, int | None] = {}
    for i, (fd, off, n, _) in enumerate(items):
        path = paths[i] if i < len(paths) else "?"
        if type(off) is not int or type(n) is not int or off < 0 or n < 0 or off > MAX_OFFSET - n:
            raise StagedRangeError(
                f"{path!r}: range of {n!r} bytes at offset {off!r} is not a range of a file "
                "(negative, or ending past byte 2**63 - 1)"
            )
        if fd not in sizes:
            try:
                st = os.fstat(fd)
            except OSError as e:
                raise FileUnreadableError(
                    e.errno, f"{path!r}: its descriptor {fd} cannot be used ({e.strerror or e})"
                ) from None
            sizes[fd] = st.st_size if stat.S_ISREG(st.st_mode) else None
        size = sizes[fd]
        if size is not None and off + n > size:
            raise TruncatedFileError(
                f"{path!r} ends at byte {size}, inside the range {off}-{off + n} it should "
                "hold; the file shrank while it was being loaded — re-copy it"
            )


_shared: dict[tuple[int | None, int, int, int], StagedPool] = {}
_shared_lock = threading.Lock()


def shared_pool(device_index: int | None, *, threads: int, chunk: int, buffers: int) -> StagedPool:
    """The process's pool of this shape for this device, made on first use and kept.

    Its threads and pinned buffers serve every later load in the process, so a load pays neither their
    set-up nor their tear-down (freeing pinned memory is slow). Loads running at
    once share it, each waiting for its own reads. :func:`release` frees them; a forked child starts
    without them (the parent's threads do not exist there).
    """
    key = (device_index, threads, chunk, buffers)
    with _shared_lock:
        eng = _shared.get(key)
        if eng is None:
            eng = _shared[key] = StagedPool(device_index, threads=threads, chunk=chunk, buffers=buffers)
        return eng


def _pool_for(index: int | None, threads: int | None, chunk: int | None, buffers: int | None = None) -> StagedPool:
    """The shared pool a load of these options uses (None: the default shape), the same for ``prepare``
    and :class:`StagedReader`, so that the pool started ahead is the one that reads."""
    return shared_pool(
        index, threads=threads or DEFAULT_THREADS, chunk=chunk or DEFAULT_CHUNK, buffers=buffers or DEFAULT_BUFFERS
    )


def prepare(device: Any, paths: Sequence[str], *, threads: int | None = None, chunk: int | None = None) -> None:
    """Start the shared pool that :class:`StagedReader` will use for ``paths`` on ``device``, when it will
    read them (a CUDA device, the pool built and on, the files cached): its threads pin their staging while
    the caller plans the load. A failure here is left for the reader to meet and report."""
    if device.kind != "cuda" or not paths or unavailable() is not None:
        return
    from .pagecache import is_cold

    if is_cold(*paths):
        return
    try:
        _pool_for(device.index or 0, threads, chunk).start()
    except (StagedReaderError, OSError) as e:
        log.debug("staged reader not started ahead of the load: %s", e)


def release() -> None:
    """Stop the process's shared pools and give their pinned staging back to the driver."""
    with _shared_lock:
        pools = list(_shared.values())
        _shared.clear()
    for eng in pools:
        eng.close()


def _abandon() -> None:
    """Forget the shared pools without touching them: at exit the OS frees them (no CUDA call then), and in a
    forked child their threads do not exist."""
    for eng in _shared.values():
        eng._handle = None
        eng._cuda = None
        eng._closing = True
        eng._state = threading.Lock()  # a lock another thread held at the fork stays held in the child
        for ticket in eng._tickets:
            ticket.lock = threading.RLock()
    _shared.clear()


atexit.register(_abandon)
os.register_at_fork(after_in_child=_abandon)
