"""Worker processes: one per served rank, each loading its rank and keeping the tensors resident.

A worker is never a fork of the server (the server runs threads and an event loop). It is either a
fork of the worker fork server, which has imported the worker's libraries and never touched CUDA, or
a fresh interpreter (spawn); ``--worker-start`` chooses, and ``auto`` forks where workers import
torch (:mod:`gdsload.server.forkserver`). It sees
only its own GPU: ``CUDA_VISIBLE_DEVICES`` is set in the worker before anything makes a CUDA
context (and, for spawn, in the environment it starts with), so CUDA (and cuFile) never opens a
context on any other device. A worker with no GPU loads into host memory.

Parent and worker talk over one duplex pipe of ``(kind, payload)`` messages.

worker -> parent: ``hello`` (pid, device, start-up marks), ``loading`` (files, byte totals), ``progress``
(bytes read so far, at most every :data:`PROGRESS_INTERVAL_S`), ``ready`` (the load report),
``failed`` (the typed error), ``reply`` (to a command).

parent -> worker: ``export`` (IPC document of the rank, see :mod:`gdsload.loader.handoff.ipc`),
``release`` (an engine is done with an export), ``unload`` (free everything and exit).

A worker whose load fails reports the error and exits with :data:`EXIT_LOAD_FAILED`; a worker
that loses its parent exits at once.

>>> handle = WorkerHandle.spawn(WorkerSpec(rank=0, model_dir="/models/m", backend="auto",
...                                        cuda_visible_devices="", gpu_explicit=False),
...                             start_method="forkserver")  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gdsload.loader.errors import ConfigError, GdsloadError

from . import forkserver
from .settings import configure_logging, parse_device_map

if TYPE_CHECKING:
    from gdsload.loader.plan import LoadPlan

__all__ = [
    "WorkerSpec",
    "WorkerHandle",
    "GpuUnavailableError",
    "RankNotReadyError",
    "WorkerStartError",
    "visible_gpus",
    "assign_devices",
    "error_doc",
    "worker_main",
    "EXIT_LOAD_FAILED",
    "PROGRESS_INTERVAL_S",
]

log = logging.getLogger(__name__)

EXIT_LOAD_FAILED = 3
"""Exit status of a worker whose load raised (the error was reported first)."""
EXIT_UNKNOWN = 255
"""What ``multiprocessing`` reports for a forked worker whose fork server died before it could tell the
status (workers themselves exit with 0, :data:`EXIT_LOAD_FAILED`, 1 on an uncaught error, or by a signal)."""
PROGRESS_INTERVAL_S = 0.2
"""Fewest seconds between two progress messages of one worker."""

_ENV_LOCK = threading.Lock()


class GpuUnavailableError(GdsloadError, RuntimeError):
    """A rank was mapped to a GPU explicitly, but its worker cannot use CUDA."""


class RankNotReadyError(GdsloadError, RuntimeError):
    """The rank has no loaded tensors (still loading, failed, or restarting)."""


class WorkerStartError(GdsloadError, RuntimeError):
    """A worker process cannot use its GPU because of how it was started (see the message for the fix)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker loads and where; picklable, sent to the child at spawn."""

    rank: int
    model_dir: str
    """Real path of the model directory."""
    backend: str
    cuda_visible_devices: str
    """The child's ``CUDA_VISIBLE_DEVICES``: one GPU (index or UUID), or ``""`` for a host-memory load."""
    gpu_explicit: bool
    """The GPU came from an explicit ``--device-map``: failing to use it is an error, not a CPU fallback."""
    generation: int = 0
    log_format: str = "text"
    log_level: str = "info"


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """GPUs this process may hand out, as ``CUDA_VISIBLE_DEVICES`` entries, found without initialising CUDA.

    The server's own ``CUDA_VISIBLE_DEVICES`` wins when set; otherwise the NVIDIA driver's
    ``/proc/driver/nvidia/gpus`` (or the ``/dev/nvidiaN`` nodes) are counted.

    >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})
    ['2', '3']
    """
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        out: list[str] = []
        for token in env["CUDA_VISIBLE_DEVICES"].split(","):
            token = token.strip()
            if not token or token.startswith("-"):
                break  # CUDA stops at the first invalid entry
            out.append(token)
        return out
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return [str(i) for i in range(sum(1 for _ in proc.iterdir()))]
    nodes = [p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]
    return [str(i) for i in range(len(nodes))]


def assign_devices(ranks: Sequence[int], device_map: str, visible: Sequence[str]) -> dict[int, tuple[str, bool]]:
    """``{rank: (CUDA_VISIBLE_DEVICES for its worker, explicit?)}``; ``""`` means a host-memory load.

    ``auto``: the i-th served rank gets ``visible[i]``, or the CPU when no GPU is visible at all.

    >>> assign_devices([4, 5], "auto", ["0", "1"])
    {4: ('0', False), 5: ('1', False)}
    """
    dm = parse_device_map(device_map)
    if dm == "cpu" or (dm == "auto" and not visible):
        return {r: ("", False) for r in ranks}
    if dm == "auto":
        if len(ranks) > len(visible):
            raise ConfigError(
                f"{len(ranks)} ranks to serve ({list(ranks)}) but only {len(visible)} GPU(s) visible "
                f"({list(visible)}); serve a subset per host with --ranks, or place ranks with --device-map"
            )
        return {r: (visible[i], False) for i, r in enumerate(ranks)}
    assert isinstance(dm, dict)
    out: dict[int, tuple[str, bool]] = {}
    for r in ranks:
        if r not in dm:
            raise ConfigError(f"--device-map {device_map!r} does not place rank {r}; add {r}:GPU or {r}:cpu")
        gpu = dm[r]
        if gpu is None:
            out[r] = ("", True)
        elif gpu >= len(visible):
            raise ConfigError(
                f"--device-map {device_map!r} puts rank {r} on GPU {gpu}, but this host shows "
                f"{len(visible)} GPU(s) ({list(visible)}); fix the map or CUDA_VISIBLE_DEVICES"
            )
        else:
            out[r] = (visible[gpu], True)
    return out


def error_doc(exc: BaseException) -> dict[str, str]:
    """``{"type": ..., "message": ...}`` of an exception, as the status API shows it."""
    return {"type": type(exc).__name__, "message": str(exc) or repr(exc)}


def _wait_all(handles: list[WorkerHandle], deadline: float) -> None:
    """Until every one of ``handles`` has exited or ``deadline`` (monotonic) has passed."""
    while True:
        running = [h for h in handles if h.alive()]
        left = deadline - time.monotonic()
        if not running or left <= 0:
            return
        select.select([h.sentinel for h in running], [], [], left)


class WorkerHandle:
    """The parent's end of one worker: the process, its pipe, and the spec it was started with.

    A forked worker is the fork server's child, not ours: ``multiprocessing`` learns of its exit from
    the fork server, and would call every such worker dead (status 255) if the fork server died. So its
    liveness, and the signals that stop it, go through a pidfd of the worker itself where Linux has them.
    """

    def __init__(self, spec: WorkerSpec, process: multiprocessing.process.BaseProcess, conn: Connection,
                 start_method: str = "spawn"):
        self.spec = spec
        self.process = process
        self.conn: Connection | None = conn
        self.retired = False
        """Set when the parent stops the worker on purpose (unload, reload, shutdown): its exit is no crash."""
        self._pidfd: int | None = None
        if start_method == "forkserver" and process.pid is not None:
            try:
                self._pidfd = os.pidfd_open(process.pid)
            except (AttributeError, OSError):  # Linux < 5.3, or the worker is gone already
                pass

    @classmethod
    def spawn(cls, spec: WorkerSpec, start_method: str = "spawn") -> WorkerHandle:
        """Start a worker process for ``spec`` with its own ``CUDA_VISIBLE_DEVICES``.

        ``start_method``: ``forkserver`` or ``spawn`` (``auto`` is resolved before this, by the supervisor).
        """
        ctx = forkserver.context(start_method)
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(target=worker_main, args=(spec, child_conn), name=f"gdsload-rank{spec.rank}",
                              daemon=True)
        # A spawned interpreter inherits os.environ as it is at start(): set the variable there so it is in
        # force before anything in the child can initialise CUDA (a forked worker sets it in worker_main,
        # before it makes its context). The lock keeps concurrent starts apart.
        with _ENV_LOCK:
            before = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
            try:
                process.start()
            finally:
                if before is None:
                    del os.environ["CUDA_VISIBLE_DEVICES"]
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = before
        child_conn.close()
        log.info("rank %d: started worker pid %s by %s (CUDA_VISIBLE_DEVICES=%r)", spec.rank, process.pid,
                 start_method, spec.cuda_visible_devices)
        return cls(spec, process, parent_conn, start_method)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        """Readable once the worker has exited."""
        return self._pidfd if self._pidfd is not None else self.process.sentinel

    def alive(self) -> bool:
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]
        return self.process.exitcode is None

    def exitcode(self) -> int | None:
        """The exit status once the worker has exited (negative: killed by that signal); None while it runs.

        A forked worker's status comes from the fork server; :data:`EXIT_UNKNOWN` when that is gone.
        """
        if self.alive():
            return None
        self.process.join(1.0)
        return self.process.exitcode

    def describe_exit(self) -> str:
        """How the worker ended, for logs and errors (it must have exited)."""
        code = self.exitcode()
        if self._pidfd is not None and code == EXIT_UNKNOWN:
            return "exited; its exit status is unknown (the fork server that started it is gone)"
        return describe_exit(code)

    def _signal(self, sig: int) -> None:
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.process.pid, sig)  # type: ignore[arg-type]
        except (ProcessLookupError, OSError):  # exited meanwhile
            pass

    def send(self, kind: str, **payload: Any) -> bool:
        """Send a command; False when the worker can no longer receive it."""
        if self.conn is None:
            return False
        try:
            self.conn.send((kind, payload))
            return True
        except (OSError, EOFError, ValueError):
            return False

    def receive(self) -> list[tuple[str, dict[str, Any]]]:
        """Every message waiting in the pipe, without blocking; closes the pipe on end-of-file."""
        out: list[tuple[str, dict[str, Any]]] = []
        while self.conn is not None:
            try:
                if not self.conn.poll():
                    break
                out.append(self.conn.recv())
            except (EOFError, OSError):
                self.conn.close()
                self.conn = None
        return out

    @staticmethod
    def kill_after(handles: list[WorkerHandle], deadline: float, grace: float = 2.0) -> None:
        """Wait for the processes until ``deadline`` (monotonic), then SIGTERM every one still running,
        then SIGKILL those still running ``grace`` seconds later: all at once, so N stuck workers take as
        long to stop as one."""
        for sig, why in ((signal.SIGTERM, "did not exit in time"), (signal.SIGKILL, "ignored SIGTERM")):
            _wait_all(handles, deadline)
            survivors = [h for h in handles if h.alive()]
            for h in survivors:
                log.warning("rank %d: worker pid %s %s; sending %s", h.spec.rank, h.pid, why, sig.name)
                h._signal(sig)
            deadline = time.monotonic() + grace
        _wait_all(handles, deadline)

    def close(self) -> None:
        """Release the pipe, the pidfd and the process object (the process must have exited)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self._pidfd is not None and not self.alive():
            os.close(self._pidfd)
            self._pidfd = None
        if self.process.exitcode is not None:
            self.process.close()


def describe_exit(exitcode: int | None) -> str:
    """``-9`` -> ``'was killed by SIGKILL'``."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


# ----------------------------------------------------------------------------------------------
# The child side.


class _Channel:
    """The worker's end of the pipe: sends from any thread; a vanished parent ends the process."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, kind: str, **payload: Any) -> None:
        with self._lock:
            try:
                self._conn.send((kind, payload))
            except (OSError, EOFError):
                _exit_orphaned()

    def recv(self) -> tuple[str, dict[str, Any]]:
        return self._conn.recv()


def _exit_orphaned() -> None:
    log.warning("the server process is gone; exiting")
    logging.shutdown()
    os._exit(0)


class _Progress:
    """The ``progress`` callback of ``load_rank``: counts bytes, sends at most every ``interval`` seconds."""

    def __init__(self, channel: _Channel, interval: float = PROGRESS_INTERVAL_S):
        self._channel = channel
        self._interval = interval
        self._lock = threading.Lock()
        self._last = 0.0
        self.done = 0

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if now - self._last < self._interval:
                return
            self._last = now
            done = self.done
        self._channel.send("progress", bytes_done=done)


class _Worker:
    def __init__(self, spec: WorkerSpec, channel: _Channel, entered_at: float):
        self.spec = spec
        self.channel = channel
        self.entered_at = entered_at
        self._lock = threading.Lock()
        self._result: Any = None  # LoadResult once loaded
        self._leases: set[str] = set()
        self._unload = threading.Event()

    def run(self) -> None:
        threading.Thread(target=self._serve_commands, name="gdsload-commands", daemon=True).start()
        try:
            result = self._load()
        except Exception as e:  # the process boundary: every load error goes to the parent, typed
            if isinstance(e, GdsloadError):
                log.error("load failed: %s: %s", type(e).__name__, e)
            else:
                log.exception("load failed")
            self.channel.send("failed", error=error_doc(e))
            logging.shutdown()
            os._exit(EXIT_LOAD_FAILED)
        loaded_at = time.time()  # taken here: the parent may read the message later
        with self._lock:
            self._result = result
        self.channel.send("ready", report=result.report.to_dict(), loaded_at=loaded_at)
        self._unload.wait()
        self._free()
        # Everything worth freeing by hand is freed; skip the interpreter's teardown of torch (slow, and CUDA
        # teardown order at exit is fragile). The process's exit releases what is left, the CUDA context included.
        logging.shutdown()
        os._exit(0)

    def _load(self) -> Any:
        problem = forkserver.inherited_problem()
        if problem is not None and self.spec.cuda_visible_devices:
            raise WorkerStartError(f"rank {self.spec.rank}: {problem}")
        device, bare = self._device()
        # Start-up marks taken here (the server reports them): the worker's entry point ran, its GPU
        # library was imported, then its CUDA context was usable (made on a thread from the entry on).
        marks: dict[str, float] = {"entered_at": self.entered_at}
        target: Any = device
        if bare:
            import cupy

            from gdsload.loader.devices import CupyDevice

            marks["imported_at"] = time.time()
            target = CupyDevice(0)
            target.activate()
            cupy.empty(1, dtype=cupy.uint8)  # the CUDA context now, so the load's timings are the load's
            marks["cuda_ready_at"] = time.time()
            gpu = target.facts()
        elif device.startswith("cuda"):
            import torch

            marks["imported_at"] = time.time()
            torch.cuda.init()
            torch.zeros(1, device=device)
            marks["cuda_ready_at"] = time.time()
            gpu = _torch_gpu_facts()
        else:
            gpu = None
        self.channel.send("hello", pid=os.getpid(), device=device, gpu=gpu, fork_server=forkserver.STATE or None,
                          **marks)

        def loading(plan: LoadPlan) -> None:  # called once the headers are parsed, before any data is read
            self.channel.send(
                "loading",
                files=[os.path.relpath(f.path, self.spec.model_dir) for f in plan.files],
                stored_bytes=sum(f.stored_bytes for f in plan.files),
                logical_bytes=sum(f.logical_bytes for f in plan.files),
            )

        from gdsload.loader.pipeline.load import load_rank

        return load_rank(self.spec.model_dir, self.spec.rank, device=target, backend=self.spec.backend,
                         progress=_Progress(self.channel), on_plan=loading)

    def _device(self) -> tuple[str, bool]:
        """Where this rank loads, and whether it loads without torch (a ``CupyDevice``).

        A GPU rank loads without torch when cupy and kvikio can (``import torch`` alone takes
        seconds, longer than the load); otherwise, and for CPU ranks, with torch.
        """
        if not self.spec.cuda_visible_devices:
            return "cpu", False
        from gdsload.loader.devices import torch_free_unavailable

        why = torch_free_unavailable(self.spec.backend)
        if why is None:
            return "cuda:0", True
        log.info("loading with torch: %s", why)
        import torch

        if torch.cuda.is_available():
            return "cuda:0", False
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "CUDA reports no usable device")
        if self.spec.gpu_explicit:
            raise GpuUnavailableError(
                f"rank {self.spec.rank} is mapped to GPU {self.spec.cuda_visible_devices!r} by --device-map, but "
                f"{why} (torch {torch.__version__}); install a CUDA build of torch, or map the rank to cpu"
            )
        log.warning("GPU %r assigned but %s; loading into host memory", self.spec.cuda_visible_devices, why)
        return "cpu", False

    def _serve_commands(self) -> None:
        while True:
            try:
                kind, payload = self.channel.recv()
            except (EOFError, OSError):
                _exit_orphaned()
                return
            if kind == "unload":
                with self._lock:
                    loaded = self._result is not None
                if not loaded:  # still loading: nothing worth freeing by hand, the exit frees it all
                    log.info("unload requested while loading; exiting")
                    logging.shutdown()
                    os._exit(0)
                self._unload.set()
                return
            if kind == "export":
                self._export(payload["id"], payload["lease"])
            elif kind == "release":
                self._leases.discard(payload["lease"])
                log.info("lease %s released (%d outstanding)", payload["lease"], len(self._leases))
            else:
                log.error("unknown command %r from the server; ignored", kind)

    def _export(self, request_id: str, lease: str) -> None:
        from gdsload.loader.handoff.ipc import export_rank

        with self._lock:
            result = self._result
        if result is None:
            err = RankNotReadyError(f"rank {self.spec.rank} has not finished loading; poll /readyz first")
            self.channel.send("reply", id=request_id, ok=False, error=error_doc(err))
            return
        try:
            doc = export_rank(result, rank=self.spec.rank)
        except Exception as e:  # reported to the caller, typed
            log.exception("export failed")
            self.channel.send("reply", id=request_id, ok=False, error=error_doc(e))
            return
        self._leases.add(lease)
        log.info("exported as lease %s (%d outstanding)", lease, len(self._leases))
        self.channel.send("reply", id=request_id, ok=True, value=doc)

    def _free(self) -> None:
        with self._lock:
            result, self._result = self._result, None
        nbytes = result.report.logical_bytes
        if self._leases:
            log.warning("unloading with %d export(s) not released: %s", len(self._leases), sorted(self._leases))
        result.close()
        del result
        if "torch" in sys.modules:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        log.info("unloaded; freed %d bytes", nbytes)


def _torch_gpu_facts() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "uuid": str(props.uuid), "total_memory": props.total_memory}


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process: load ``spec.rank``, report, keep the tensors until told to unload."""
    entered_at = time.time()
    # Before any CUDA context: a forked worker inherited the fork server's environment (as it was when
    # the fork server started: anything a worker needs from the server's environment must be set here),
    # and the driver reads the variable when it initialises. A spawned worker was started with it set.
    os.environ["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server stops us in order
    if spec.cuda_visible_devices and forkserver.inherited_problem() is None:
        _start_cuda_context()
    configure_logging(spec.log_format, spec.log_level, rank=spec.rank)
    if forkserver.STATE:
        log.debug("forked from the worker fork server (its imports: %s)", forkserver.STATE)
    _Worker(spec, _Channel(conn), entered_at).run()


def _start_cuda_context() -> None:
    """Create the GPU's primary CUDA context on a thread while this process imports its libraries.

    Both take a good part of a second on a fresh process; the driver call releases the GIL, so they
    overlap. cupy, kvikio and torch then find the primary context made and retain it. Where the
    driver library is missing, nothing happens here and the load reports the problem later.
    """

    def run() -> None:
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0:
            cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)  # kept for the process's life, as torch does

    threading.Thread(target=run, name="gdsload-cuda-context", daemon=True).start()
