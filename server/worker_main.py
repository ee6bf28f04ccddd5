"""The worker process itself: load one rank, report to the server, keep the tensors until told to unload.

The server's side of the same pipe is :class:`gdsload.server.workers.WorkerHandle`; the messages are
listed there. This module is what a worker imports besides its loading libraries, so it imports no
more of the server than the worker needs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ..loader.errors import GdsloadError

from . import forkserver
from .settings import configure_logging
from .worker_protocol import (
    EXIT_LOAD_FAILED,
    PROGRESS_INTERVAL_S,
    SIGTERM_GRACE_S,
    GpuUnavailableError,
    RankNotReadyError,
    WorkerSpec,
    WorkerStartError,
    error_doc,
)

if TYPE_CHECKING:
    from ..loader.plan import LoadPlan

__all__ = ["worker_main"]

log = logging.getLogger("gdsload.server.workers")


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
        self.stop_requested = threading.Event()
        """Set when the server asks this worker to unload: from then on SIGTERM ends it at once."""
        self._sigterm_at: float | None = None

    def on_sigterm(self, signum: int, frame: object) -> None:
        """SIGTERM: at once when the server asked this worker to stop; otherwise leave the order to the server (a
        group SIGTERM reached it too), and exit by itself only if it has not stopped this worker in time."""
        if self.stop_requested.is_set():
            logging.shutdown()
            os._exit(128 + signum)
        if self._sigterm_at is None:
            self._sigterm_at = time.monotonic()
            grace = self.spec.stop_timeout + SIGTERM_GRACE_S
            log.info("SIGTERM: the server stops this worker (exiting by itself in %.0f s otherwise)", grace)
            timer = threading.Timer(grace, self._exit_unstopped, args=(signum,))
            timer.daemon = True
            timer.start()

    def _exit_unstopped(self, signum: int) -> None:
        log.warning(
            "SIGTERM %.0f s ago and the server has not stopped this worker; exiting",
            time.monotonic() - (self._sigterm_at or 0.0),
        )
        logging.shutdown()
        os._exit(128 + signum)

    def run(self) -> None:
        threading.Thread(target=self._serve_commands, name="gdsload-commands", daemon=True).start()
        try:
            result = self._load()
        except Exception as e:  # the process boundary: every load error goes to the parent, typed
            if isinstance(e, GdsloadError):  # the server logs it as an error, with its rank
                log.info("load failed: %s: %s", type(e).__name__, e)
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
            from ..loader.devices import DriverDevice

            marks["imported_at"] = time.time()
            target = DriverDevice(0)
            target.activate()  # the CUDA context now, so the load's timings are the load's
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
            import torch

            from ..loader.devices import TorchDevice

            target = TorchDevice(torch.device("cpu"), shared=True)  # handed over without a move (export_rank)
            gpu = None
        self.channel.send(
            "hello", pid=os.getpid(), device=device, gpu=gpu, fork_server=forkserver.STATE or None, **marks
        )

        def loading(plan: LoadPlan) -> None:  # called once the headers are parsed, before any data is read
            self.channel.send(
                "loading",
                files=[os.path.relpath(f.path, self.spec.model_dir) for f in plan.files],
                stored_bytes=sum(f.stored_bytes for f in plan.files),
                logical_bytes=sum(f.logical_bytes for f in plan.files),
            )

        from ..loader.pipeline.load import load_rank

        return load_rank(
            self.spec.model_dir,
            self.spec.rank,
            device=target,
            backend=self.spec.backend,
            confine=self.spec.confine or None,
            progress=_Progress(self.channel),
            on_plan=loading,
        )

    def _device(self) -> tuple[str, bool]:
        """Where this rank loads, and whether it loads without torch (a ``DriverDevice``).

        A GPU rank loads without torch when the CUDA driver and kvikio can (``import torch`` alone takes
        seconds, longer than the load); otherwise, and for CPU ranks, with torch.
        """
        if not self.spec.cuda_visible_devices:
            return "cpu", False
        from ..loader.devices import torch_free_unavailable

        why = torch_free_unavailable(self.spec.backend)
        if why is None:
            return "cuda:0", True
        log.info("loading with torch: %s", why)
        import torch

        if torch.cuda.is_available():
            return "cuda:0", False
        why = "this torch build has no CUDA support" if torch.version.cuda is None else "CUDA reports no usable device"
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
                self.stop_requested.set()
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
        from ..loader.handoff.ipc import export_rank

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
        from ..loader.devices import start_primary_context

        start_primary_context(0)
    configure_logging(spec.log_format, spec.log_level, rank=spec.rank)
    if forkserver.STATE:
        log.debug("forked from the worker fork server (its imports: %s)", forkserver.STATE)
    worker = _Worker(spec, _Channel(conn), entered_at)
    signal.signal(signal.SIGTERM, worker.on_sigterm)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})  # blocked by a spawning server
    worker.run()
