"""The rank state machine: one worker per served rank, restarts with backoff, reload, unload, IPC leases.

Each rank is ``pending`` (worker starting) -> ``loading`` -> ``ready``, or ``failed``:

- a load that raises reports its typed error; the rank stays ``failed`` (a retry needs ``POST /v1/reload``);
- a worker that dies (crash, OOM kill, ``kill -9``) turns its rank ``failed`` and is restarted after
  ``restart_backoff`` seconds, doubling per consecutive crash up to ``restart_backoff_max``; after
  ``max_restarts`` consecutive crashes it stays ``failed``. The other ranks keep their tensors.

One thread (the supervisor loop) owns the worker processes and their pipes: it reads worker
messages, notices deaths through the process sentinels, restarts, and runs the operations the
HTTP handlers post to it (reload, unload, export, release) one at a time; it never waits on a
worker (a start runs on a thread of its own, a stop is looked at on every turn). Readers of the
state (``/readyz``, ``/v1/status``, ``/metrics``) only take a short lock; ``/readyz`` answers from
a body prebuilt at every state change. Workers over their lives are :mod:`gdsload.server.lifecycle`,
IPC exports and leases :mod:`gdsload.server.leases`, the rank records and status documents
:mod:`gdsload.server.state`.

>>> sup = Supervisor(ServeConfig.resolve(model_dir="/models/llama-tp2"))  # doctest: +SKIP
>>> sup.start(); sup.readiness()[0]                                        # doctest: +SKIP
503
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import wait as wait_for
from typing import Any, TypeVar

from ..loader.version import __version__
from ..loader.errors import GdsloadError

from .errors import ExportsOutstandingError, UnknownLeaseError, UnknownRankError, WorkerError
from .leases import EXPORT_TIMEOUT_S, LeaseOperations
from .lifecycle import KILL_GRACE_S, WorkerLifecycle
from .settings import ServeConfig
from .state import RankRecord, RankState, Retiring, public_status, rank_doc
from .start import worker_start_method
from .target import ModelUnreadableError, Target, check_target
from .worker_protocol import RankNotReadyError, error_doc

__all__ = [
    "Supervisor",
    "RankState",
    "WorkerError",
    "UnknownRankError",
    "UnknownLeaseError",
    "ExportsOutstandingError",
    "ModelUnreadableError",
    "RankNotReadyError",
    "process_start_time",
    "EXPORT_TIMEOUT_S",
]

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
"""Longest wait for the supervisor's thread to run an operation (it never waits on a worker itself)."""

T = TypeVar("T")


def process_start_time() -> float:
    """Wall-clock time this process started (from ``/proc``; the import time where that is missing)."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(after_name[19])  # field 22 of stat(5); fields after the name start at 3
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


class Supervisor(LeaseOperations, WorkerLifecycle):
    """Runs the workers of the served ranks and keeps their state for the HTTP API."""

    def __init__(self, config: ServeConfig, target: Target | None = None):
        self.config = config
        self._target = target
        """The model to serve at start, checked already (``gdsload serve`` checks it before it binds its port);
        None: ``config.model_dir`` is checked when the supervisor starts."""
        self.worker_start = worker_start_method(config)
        """How this server starts its workers (``config.worker_start`` with ``auto`` resolved)."""
        self._fork_server: dict[str, Any] | None = None  # the fork server's imports, as its latest fork told
        self.process_start = process_start_time()
        self._lock = threading.Lock()
        self._ranks: dict[int, RankRecord] = {}
        self._model: dict[str, Any] | None = None
        self._model_error: dict[str, str] | None = None
        self.loop_error: dict[str, str] | None = None
        """Set when the supervisor loop died: nothing loads or restarts any more (``/healthz`` fails)."""
        self._generation = 0
        self._gen_started_mono = time.monotonic()
        self._gen_started_wall = time.time()
        self._gen_ready_s: float | None = None
        self._first_ready_wall: float | None = None
        self._failures: Counter[int] = Counter()
        self._restarts: Counter[int] = Counter()
        self._actions: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._internal: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._retiring: list[Retiring] = []
        self._starting = 0
        """Worker starts under way (each on a thread of its own); only the supervisor's thread counts them."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stop = threading.Event()
        self.draining = threading.Event()
        """Set when the server begins to shut down (before its HTTP connections drain): held leases end."""
        self._thread: threading.Thread | None = None
        self._readyz: tuple[int, bytes] = (503, b"")
        with self._lock:
            if target is not None:  # every rank pending from the first request on
                self._install(target)
            elif config.model_dir is not None:  # shown from the first request on, before discovery has run
                self._model = {
                    "path": config.model_dir,
                    "real_path": os.path.realpath(config.model_dir),
                    "source": None,
                    "tp_size": None,
                }
            self._publish()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the supervisor's thread, which starts the configured model's workers; returns at once.

        Nothing here waits for a worker (its start included: a fork server may still be importing
        torch), so a caller on an event loop is never held up; the loads run in the workers.
        """
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="gdsload-supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.config.model_dir is not None:
            try:
                self._initial_load(self.config.model_dir)
            except Exception as e:
                self._failed(e)
                self._stop.set()  # the loop starts only to stop the workers
        self._loop()

    def stop(self) -> None:
        """Stop every worker (each frees its memory, or is killed after ``stop_timeout``); idempotent."""
        thread = self._thread
        if thread is None or self._stop.is_set() and not thread.is_alive():
            return
        self._stop.set()
        self._wake()
        limit = self.config.stop_timeout + KILL_GRACE_S + 20
        thread.join(limit)
        if thread.is_alive():
            log.error("the supervisor loop did not stop within %.0f s", limit)

    # ------------------------------------------------------------------ readers

    def readiness(self) -> tuple[int, bytes]:
        """``(200 or 503, JSON body)`` for ``/readyz``, prebuilt at the last state change."""
        return self._readyz

    def status(self, detail: bool = True) -> dict[str, Any]:
        """The state for ``/v1/status`` (and ``/metrics``): all of it, or (``detail=False``) what a request without
        the token sees (:func:`gdsload.server.state.public_status`)."""
        doc = self._status()
        return doc if detail else public_status(doc)

    def _status(self) -> dict[str, Any]:
        now_wall, now = time.time(), time.monotonic()
        with self._lock:
            ranks = {
                str(r): rank_doc(x, now, self._restarts[r], self._failures[r]) for r, x in sorted(self._ranks.items())
            }
            ready = self._is_ready()
            if ready:
                state = "ready"
            elif self._model is None and self._model_error is None:
                state = "unloaded"
            elif self._model_error is not None or any(x.state is RankState.FAILED for x in self._ranks.values()):
                state = "failed"
            else:
                state = "loading"
            return {
                "version": __version__,
                "state": state,
                "ready": ready,
                "model": dict(self._model) if self._model else None,
                "error": self._model_error,
                "generation": self._generation,
                "process": {
                    "pid": os.getpid(),
                    "started_at": self.process_start,
                    "uptime_s": now_wall - self.process_start,
                    "time_to_ready_s": (
                        self._first_ready_wall - self.process_start if self._first_ready_wall is not None else None
                    ),
                },
                "load": {
                    "started_at": self._gen_started_wall,
                    "time_to_ready_s": self._gen_ready_s,
                },
                "ranks": ranks,
                "stopping_workers": len(self._retiring),
                "leases": sum(len(x.leases) for x in self._ranks.values()),
                "failures_total": {str(r): n for r, n in sorted(self._failures.items())},
                "restarts_total": {str(r): n for r, n in sorted(self._restarts.items())},
                "worker_start": self.worker_start,
                "fork_server": self._fork_server,
                "config": self.config.public_dict(),
            }

    # ------------------------------------------------------------------ operations

    def reload(
        self, model_dir: str, ranks: Sequence[int] | None = None, *, wait_s: float = 0.0, force: bool = False
    ) -> dict[str, Any]:
        """Replace the served model by ``model_dir`` (which must lie under an allowed root).

        The new directory is checked (confinement, discovery, device placement) before anything is
        stopped: a bad target raises and the current model stays. Waits up to ``wait_s`` for IPC
        leases to be released, then raises :class:`ExportsOutstandingError` unless ``force``.

        >>> sup.reload("/models/llama-v2")  # doctest: +SKIP
        {'generation': 2, 'model': '/models/llama-v2', 'ranks': [0, 1]}
        """
        target = self.check_target(model_dir, ranks)
        self._await_leases(wait_s)
        return self.switch(target, force=force)

    def unload(self, *, wait_s: float = 0.0, force: bool = False) -> dict[str, Any]:
        """Stop every worker and free the model's memory; the same lease rules as :meth:`reload`."""
        self._await_leases(wait_s)
        return self.switch(None, force=force)

    def check_target(self, model_dir: str, ranks: Sequence[int] | None = None) -> Target:
        """The first half of :meth:`reload`: ``model_dir`` checked (confinement, discovery, headers, device
        placement; see :func:`gdsload.server.target.check_target`)."""
        return check_target(model_dir, self.config, ranks, strict=True)

    def switch(self, target: Target | None, *, force: bool = False) -> dict[str, Any]:
        """The second half of :meth:`reload` (``target`` from :meth:`check_target`), or an unload (None)."""
        return self._call(lambda: self._switch(target, force))

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def switch_async(self, target: Target | None, *, force: bool = False) -> dict[str, Any]:
        """:meth:`switch` for an event loop: returns once the old workers are asked to stop (they exit, or are
        killed, within ``stop_timeout`` seconds more; the new ones start then)."""
        return await self.call_async(lambda: self._switch(target, force))

    # ------------------------------------------------------------------ the loop

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except OSError:
            pass

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        if self._thread is None or self._stop.is_set():
            raise WorkerError("the sidecar is not running (starting or shutting down); try again")
        fut: Future[T] = Future()
        self._actions.put((fn, fut))
        self._wake()
        return fut

    def _post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the supervisor's thread (what a helper thread reports); runs at shutdown too."""
        self._internal.put(fn)
        self._wake()

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the supervisor loop and return its result (or raise its error)."""
        fut = self._submit(fn)
        try:
            return fut.result(timeout=CALL_TIMEOUT_S)
        except FutureTimeout:
            fut.cancel()
            raise WorkerError(
                f"the supervisor did not run the operation within {CALL_TIMEOUT_S:.0f} s; see the log"
            ) from None

    async def call_async(self, fn: Callable[[], T]) -> T:
        """:meth:`_call` for an event loop: the loop waits, no thread does."""
        fut = self._submit(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise WorkerError(
                f"the supervisor did not run the operation within {CALL_TIMEOUT_S:.0f} s; see the log"
            ) from None

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    handles = [x.handle for x in self._ranks.values() if x.handle is not None]
                retiring = list(self._retiring)
                waitables: list[Any] = [self._wake_r]
                for h in handles + [r.handle for r in retiring]:
                    waitables.append(h.sentinel)
                    if h.conn is not None:
                        waitables.append(h.conn)
                ready = wait_for(waitables, timeout=self._next_timeout())
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                self._run_internal()
                self._run_actions()
                for h in handles:
                    if h.retired:
                        continue
                    if h.conn is not None and h.conn in ready:
                        for kind, payload in h.receive():
                            self._on_event(h, kind, payload)
                    if h.sentinel in ready:
                        self._reap(h)
                self._tend_retiring()
                self._restart_due()
                self._start_wanted()
                self._expire_leases()
        except Exception as e:
            self._failed(e)
        finally:
            self._stop.set()
            self._shutdown()

    def _failed(self, e: Exception) -> None:
        """A bug stopped the supervisor: nothing loads or restarts any more, so ``/healthz`` fails from now on
        (an orchestrator then restarts the process)."""
        log.error("the supervisor loop failed; stopping the workers", exc_info=e)
        with self._lock:
            self.loop_error = self._model_error = {
                "type": "SupervisorFailed",
                "message": f"the supervisor loop failed ({type(e).__name__}: {e}); restart the sidecar",
            }
            self._publish()

    def _run_internal(self) -> None:
        while True:
            try:
                fn = self._internal.get_nowait()
            except queue.Empty:
                return
            fn()

    def _run_actions(self) -> None:
        while True:
            try:
                fn, fut = self._actions.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except Exception as e:  # handed to the caller, who raises it
                fut.set_exception(e)

    def _next_timeout(self) -> float:
        now = time.monotonic()
        grace = self.config.lease_grace
        with self._lock:
            due = [x.next_restart_at for x in self._ranks.values() if x.next_restart_at is not None]
            due += [
                mono + grace
                for x in self._ranks.values()
                for lease, (mono, _) in x.leases.items()
                if lease not in x.holders
            ]
        due += [r.kill_at if r.signalled else r.term_at for r in self._retiring]
        if self._retiring:
            due.append(now + 0.25)  # a forked worker's exit shows on its pidfd; the rest are polled
        return max(0.0, min(due) - now) if due else 5.0

    def _shutdown(self) -> None:
        with self._lock:
            handles = [x.handle for x in self._ranks.values() if x.handle is not None]
            leases = {r: len(x.leases) for r, x in self._ranks.items() if x.leases}
            for x in self._ranks.values():
                self._fail_pending(x, "the sidecar is shutting down")
                x.handle = None
        if leases:
            log.warning("shutting down with IPC exports not released: %s", leases)
        while True:  # anything posted meanwhile is refused, not left hanging
            try:
                _, fut = self._actions.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(WorkerError("the sidecar is shutting down"))
        self._retire(handles)
        # Until every worker has exited (or been killed), and every worker start under way has come back.
        deadline = time.monotonic() + self.config.stop_timeout + KILL_GRACE_S + 15
        while (self._retiring or self._starting) and time.monotonic() < deadline:
            waitables: list[Any] = [self._wake_r]
            for r in self._retiring:
                waitables.append(r.handle.sentinel)
                if r.handle.conn is not None:
                    waitables.append(r.handle.conn)
            if wait_for(waitables, timeout=min(0.25, self._next_timeout())):
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            self._run_internal()
            self._tend_retiring()
        if self._retiring or self._starting:
            log.error(
                "%d worker(s) did not stop and %d start(s) did not come back by the shutdown's deadline",
                len(self._retiring),
                self._starting,
            )
        log.info("all workers stopped")

    def _initial_load(self, path: str) -> None:
        target = self._target
        if target is not None:  # installed by __init__: start its workers
            log.info(
                "generation %d: serving %s (%s layout, tp=%d), ranks %s",
                self._generation,
                target.path,
                target.source,
                target.tp_size,
                sorted(target.devices),
            )
            with self._lock:
                for x in self._ranks.values():
                    x.start_wanted = True
            self._start_wanted()
            return
        if target is None:
            try:
                target = check_target(path, self.config)
            except GdsloadError as e:  # typed, naming the fix
                log.error("cannot serve %r: %s: %s", path, type(e).__name__, e)
                with self._lock:
                    self._model_error = error_doc(e)
                    self._model = {"path": path, "real_path": os.path.realpath(path), "source": None, "tp_size": None}
                    for r in self.config.ranks or ():
                        self._ranks[r] = RankRecord(r, "", False, state=RankState.FAILED, error=error_doc(e))
                    self._publish()
                return
        self._switch(target, force=True)

    def _switch(self, plan: Target | None, force: bool) -> dict[str, Any]:
        """Install ``plan`` as the next generation (None: unload); runs on the loop (or in ``start``, before it)."""
        with self._lock:
            leases = {r: sorted(x.leases) for r, x in self._ranks.items() if x.leases}
            if leases and not force:
                held = sorted({h["pid"] for x in self._ranks.values() for h in x.holders.values()}, key=str)
                who = (
                    f"; engine pid(s) {held} hold theirs while they run (their parameters are this memory): "
                    "stop those engines"
                    if held
                    else ""
                )
                raise ExportsOutstandingError(
                    f"IPC exports are still outstanding ({ {r: len(v) for r, v in leases.items()} } by rank; "
                    f"leases {sum(leases.values(), [])}){who}; the engine must POST /v1/ipc/RANK/release first — "
                    "or pass wait_s to wait for it, or force=true to invalidate them"
                )
            old = [x.handle for x in self._ranks.values() if x.handle is not None]
            for x in self._ranks.values():
                self._fail_pending(x, "the model was unloaded")
            previous = self._model["path"] if self._model else None
            self._install(plan)
        if leases:
            log.warning("invalidating IPC exports %s (force)", leases)
        self._retire(old)  # they free their memory and exit; the new workers start once they have
        if plan is None:
            log.info("unloaded %s", previous)
            return {"unloaded": previous, "generation": self._generation}
        log.info(
            "generation %d: serving %s (%s layout, tp=%d), ranks %s",
            self._generation,
            plan.path,
            plan.source,
            plan.tp_size,
            sorted(plan.devices),
        )
        with self._lock:
            for x in self._ranks.values():
                x.start_wanted = True
        return {"generation": self._generation, "model": plan.path, "ranks": sorted(plan.devices)}

    def _install(self, plan: Target | None) -> None:
        """Make ``plan`` the next generation, every rank pending (None: nothing served); call with the lock held."""
        self._generation += 1
        self._gen_started_mono, self._gen_started_wall = time.monotonic(), time.time()
        self._gen_ready_s = None
        self._model_error = None
        if plan is None:
            self._model, self._ranks = None, {}
        else:
            self._model = {
                "path": plan.path,
                "real_path": plan.real_path,
                "source": plan.source,
                "tp_size": plan.tp_size,
            }
            self._ranks = {}
            for r, (cvd, explicit) in plan.devices.items():
                self._ranks[r] = RankRecord(
                    r, cvd, explicit, files=[os.path.relpath(f, plan.real_path) for f in plan.files.get(r, ())]
                )
        self._publish()

    # ------------------------------------------------------------------ derived state (lock held)

    def _is_ready(self) -> bool:
        return (
            self._model is not None
            and self._model_error is None
            and bool(self._ranks)
            and all(x.state is RankState.READY for x in self._ranks.values())
        )

    def _publish(self) -> None:
        """Rebuild the ``/readyz`` answer; call with the lock held after every state change."""
        ready = self._is_ready()
        if ready and self._gen_ready_s is None:
            self._gen_ready_s = time.monotonic() - self._gen_started_mono
            first = self._first_ready_wall is None
            if first:
                self._first_ready_wall = time.time()
            log.info(
                "all %d rank(s) ready in %.3f s%s",
                len(self._ranks),
                self._gen_ready_s,
                f" ({self._first_ready_wall - self.process_start:.3f} s after process start)" if first else "",
            )
        states = {str(r): x.state.value for r, x in sorted(self._ranks.items())}
        # For anyone who reaches the port: states and reasons, no path (the model's is in /v1/status, with the token).
        body: dict[str, Any] = {"ready": ready, "generation": self._generation, "ranks": states}
        if not ready:
            if self._model_error is not None:
                body["reason"] = f"{self._model_error['type']}; see the log, or /v1/status with the token"
            elif self._model is None:
                body["reason"] = "no model loaded; POST /v1/reload"
            elif not self._ranks:
                body["reason"] = "starting"
            else:
                failed = [x for _, x in sorted(self._ranks.items()) if x.state is RankState.FAILED]
                waiting = [r for r, s in states.items() if s != RankState.READY.value]
                body["reason"] = (
                    f"rank(s) {', '.join(str(x.rank) for x in failed)} failed "
                    f"({', '.join(sorted({x.error['type'] for x in failed if x.error}))}); see /v1/status"
                    if failed
                    else f"waiting for rank(s) {', '.join(waiting)}"
                )
        self._readyz = (200 if ready else 503, json.dumps(body, separators=(",", ":")).encode())
