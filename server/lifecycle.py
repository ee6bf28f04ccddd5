"""Worker processes over their lives: started on a thread of their own, their messages, their exits (a
crash is restarted with backoff), and their stop (asked, then SIGTERM, then SIGKILL).

Nothing here waits on a worker on the supervisor's thread: a start runs on a thread and reports back;
a stopping worker is looked at again on every turn of the loop.

:class:`WorkerLifecycle` is a part of :class:`~gdsload.server.supervisor.Supervisor` (it shares its
lock, ranks and thread); it is not used on its own.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import WorkerError
from .leases import remote_error
from .settings import ServeConfig
from .start import start_worker_server
from .state import RankRecord, RankState, Retiring
from .worker_protocol import WorkerSpec
from .workers import WorkerHandle

__all__ = ["WorkerLifecycle", "KILL_GRACE_S"]

log = logging.getLogger("gdsload.server.supervisor")

KILL_GRACE_S = 2.0
"""Seconds between the SIGTERM to a worker that did not exit within ``stop_timeout`` and its SIGKILL."""


class WorkerLifecycle:
    """Starting, watching, restarting and stopping the supervisor's workers."""

    config: ServeConfig
    worker_start: str
    draining: threading.Event
    _lock: threading.Lock
    _ranks: dict[int, RankRecord]
    _stop: threading.Event
    _model: dict[str, Any] | None
    _generation: int
    _fork_server: dict[str, Any] | None
    _failures: Counter[int]
    _restarts: Counter[int]
    _retiring: list[Retiring]
    _starting: int
    _internal: queue.SimpleQueue[Callable[[], None]]

    if TYPE_CHECKING:  # the supervisor's

        def _post(self, fn: Callable[[], Any]) -> None: ...
        def _publish(self) -> None: ...

    def _start_wanted(self) -> None:
        """Start the workers of ranks that want one, once no old worker is still stopping (its GPU memory)."""
        if self._stop.is_set() or self.draining.is_set() or self._retiring:
            return
        with self._lock:
            wanted = [x for x in self._ranks.values() if x.start_wanted and x.handle is None]
            for x in wanted:
                x.start_wanted = False
        for x in wanted:
            self._spawn(x)

    def _spawn(self, x: RankRecord) -> None:
        """Start ``x``'s worker on a thread of its own: starting one may wait (a fork server still importing
        torch, a slow fork), and nothing on this thread may."""
        assert self._model is not None
        spec = WorkerSpec(
            rank=x.rank,
            model_dir=self._model["real_path"],
            backend=self.config.backend,
            cuda_visible_devices=x.cuda_visible_devices,
            gpu_explicit=x.gpu_explicit,
            confine=self.config.allow_roots or (self._model["real_path"],),
            generation=self._generation,
            log_format=self.config.log_format,
            log_level=self.config.log_level,
            stop_timeout=self.config.stop_timeout,
        )
        with self._lock:
            x.starting = True
            if x.error is not None:
                x.last_error = x.error
            x.state, x.error, x.error_reported, x.report = RankState.PENDING, None, False, None
            x.bytes_done, x.ready_at, x.loaded_at = 0, None, None
            x.entered_at = x.imported_at = x.cuda_ready_at = None
            x.started_at = time.time()  # asked for: a forked worker may be running (and importing) before it returns
            self._publish()
        self._starting += 1
        threading.Thread(
            target=self._start_worker, args=(x, spec), name=f"gdsload-start-rank{x.rank}", daemon=True
        ).start()

    def _start_worker(self, x: RankRecord, spec: WorkerSpec) -> None:
        try:
            handle = self._fork(spec) if self.worker_start == "forkserver" else None
            if handle is None:
                handle = WorkerHandle.spawn(spec, "spawn")
        except Exception as e:  # OSError mostly; reported to the loop, which counts a crash
            error = e
            self._post(lambda: self._start_failed(x, error))
            return
        self._post(lambda: self._started(x, handle))

    def _started(self, x: RankRecord, handle: WorkerHandle) -> None:
        self._starting -= 1
        with self._lock:
            x.starting = False
            current = self._ranks.get(x.rank) is x and not (self._stop.is_set() or self.draining.is_set())
            if current:
                x.handle, x.pid = handle, handle.pid
                self._publish()
        if not current:  # unloaded, reloaded or stopping meanwhile
            self._retire([handle])

    def _start_failed(self, x: RankRecord, e: Exception) -> None:
        self._starting -= 1
        with self._lock:
            x.starting = False
            if self._ranks.get(x.rank) is x:
                self._crashed(x, f"worker for rank {x.rank} could not be started ({type(e).__name__}: {e})")

    def _fork(self, spec: WorkerSpec) -> WorkerHandle | None:
        """Start the worker from the fork server; None (and spawn from now on) when the fork server fails."""
        try:
            start_worker_server(self.config)  # started early by `serve`; here for other callers, or anew
            return WorkerHandle.spawn(spec, "forkserver")
        except (OSError, EOFError) as e:  # it could not start, or it died while forking
            log.warning(
                "the worker fork server failed (%s: %s); starting workers with spawn from now on", type(e).__name__, e
            )
            with self._lock:
                self.worker_start = "spawn"
                self._fork_server = {"error": f"{type(e).__name__}: {e}"}
                self._publish()
            return None

    def _retire(self, handles: list[WorkerHandle]) -> None:
        """Ask workers to free their memory and exit; :meth:`_tend_retiring` kills those that do not in time."""
        now = time.monotonic()
        for h in handles:
            h.retired = True
            h.send("unload")
            self._retiring.append(
                Retiring(h, now + self.config.stop_timeout, now + self.config.stop_timeout + KILL_GRACE_S)
            )

    def _tend_retiring(self) -> None:
        """Reap the stopping workers that exited; SIGTERM those past ``stop_timeout``, SIGKILL after that."""
        now = time.monotonic()
        for r in list(self._retiring):
            h = r.handle
            h.receive()  # keep its pipe flowing, so it never blocks on a full one
            if not h.alive():
                self._retiring.remove(r)
                log.info("rank %d: worker pid %s stopped (%s)", h.spec.rank, h.pid, h.describe_exit())
                h.close()
            elif r.signalled < 2 and now >= r.kill_at:
                log.warning("rank %d: worker pid %s ignored SIGTERM; sending SIGKILL", h.spec.rank, h.pid)
                h.signal(signal.SIGKILL)
                r.signalled = 2
            elif r.signalled < 1 and now >= r.term_at:
                log.warning("rank %d: worker pid %s did not exit in time; sending SIGTERM", h.spec.rank, h.pid)
                h.signal(signal.SIGTERM)
                r.signalled = 1

    # ------------------------------------------------------------------ worker events

    def _rank_of(self, h: WorkerHandle) -> RankRecord | None:
        x = self._ranks.get(h.spec.rank)
        return x if x is not None and x.handle is h else None

    def _on_event(self, h: WorkerHandle, kind: str, payload: dict[str, Any]) -> None:
        note: str | None = None
        failure: str | None = None
        with self._lock:
            x = self._rank_of(h)
            if x is None:
                return
            if kind == "progress":
                x.bytes_done = max(x.bytes_done, int(payload["bytes_done"]))
                return
            if kind == "hello":
                x.pid, x.device, x.gpu = payload["pid"], payload["device"], payload["gpu"]
                x.entered_at = payload.get("entered_at")
                if payload.get("fork_server"):
                    self._fork_server = payload["fork_server"]
                x.imported_at, x.cuda_ready_at = payload.get("imported_at"), payload.get("cuda_ready_at")
            elif kind == "loading":
                x.state = RankState.LOADING
                x.files = list(payload["files"])
                x.stored_bytes, x.logical_bytes = int(payload["stored_bytes"]), int(payload["logical_bytes"])
            elif kind == "ready":
                report = payload["report"]
                x.state, x.report, x.error = RankState.READY, report, None
                x.stored_bytes, x.logical_bytes = report["stored_bytes"], report["logical_bytes"]
                x.bytes_done, x.ready_at, x.consecutive_crashes = report["stored_bytes"], time.time(), 0
                x.loaded_at = payload.get("loaded_at")
                note = (
                    f"rank {x.rank}: ready on {x.device}: {report['logical_bytes']} bytes in "
                    f"{report['seconds']:.3f} s ({report['gbps']:.2f} GB/s) backend={report['backend']}"
                )
            elif kind == "failed":
                x.state, x.error, x.error_reported = RankState.FAILED, payload["error"], True
                self._failures[x.rank] += 1
                failure = (
                    f"rank {x.rank} failed to load: {payload['error']['type']}: {payload['error']['message']}"
                    " (the rank stays failed until POST /v1/reload)"
                )
            elif kind == "reply":
                fut, lease = x.pending.pop(payload["id"], (None, None))
                if fut is not None and fut.cancelled():  # the asker stopped waiting: nobody maps this export
                    if payload["ok"] and lease is not None and x.handle is not None:
                        x.handle.send("release", lease=lease)
                elif fut is not None and not fut.done():
                    if payload["ok"]:
                        if lease is not None:
                            x.leases[lease] = (time.monotonic(), time.time())
                        fut.set_result(payload["value"])
                    else:
                        fut.set_exception(remote_error(x.rank, payload["error"]))
            else:
                log.error("rank %d: unknown message %r from the worker; ignored", x.rank, kind)
                return
            self._publish()
        if note:
            log.info("%s", note)
        if failure:
            log.error("%s", failure)

    def _reap(self, h: WorkerHandle) -> None:
        for kind, payload in h.receive():  # its last words may still be in the pipe
            self._on_event(h, kind, payload)
        pid, how = h.pid, h.describe_exit()
        h.close()
        with self._lock:
            x = self._rank_of(h)
            if x is None:
                return
            x.handle, x.pid = None, None
            self._fail_pending(x, f"the worker {how}")
            if x.error_reported:
                self._publish()
                log.info("rank %d: worker pid %s %s after its load failed; not restarted", x.rank, pid, how)
                return
            if self.draining.is_set() or self._stop.is_set():  # the server is stopping: an exit is no crash
                x.leases.clear()
                x.holders.clear()
                x.state = RankState.FAILED
                x.error = {"type": "WorkerStopped", "message": f"worker pid {pid} {how} while the server stops"}
                self._publish()
                log.info("rank %d: worker pid %s %s while the server stops; not restarted", x.rank, pid, how)
                return
            what = f"worker for rank {x.rank} (pid {pid}) {how}"
            if x.state is RankState.READY:
                what += "; its tensors are gone"
            if x.leases:
                what += f"; {len(x.leases)} IPC export(s) are void"
            self._crashed(x, what)

    def _crashed(self, x: RankRecord, what: str) -> None:
        """Mark ``x`` failed after an unplanned exit and schedule its restart; call with the lock held."""
        x.leases.clear()
        x.holders.clear()
        x.state = RankState.FAILED
        self._failures[x.rank] += 1
        x.consecutive_crashes += 1
        if x.consecutive_crashes > self.config.max_restarts:
            what += (
                f"; not restarted after {self.config.max_restarts} consecutive restart(s) — "
                "see the log, then POST /v1/reload"
            )
            x.next_restart_at = None
        else:
            delay = min(self.config.restart_backoff * 2 ** (x.consecutive_crashes - 1), self.config.restart_backoff_max)
            what += f"; restarting in {delay:.1f} s (restart {x.consecutive_crashes} of {self.config.max_restarts})"
            x.next_restart_at = time.monotonic() + delay
        x.error = {"type": "WorkerCrashedError", "message": what}
        self._publish()
        log.error("%s", what)

    def _restart_due(self) -> None:
        if self._stop.is_set() or self.draining.is_set():
            return
        now = time.monotonic()
        with self._lock:
            due = [
                x
                for x in self._ranks.values()
                if x.next_restart_at is not None and x.next_restart_at <= now and x.handle is None
            ]
            for x in due:
                x.next_restart_at = None
                x.start_wanted = True
                self._restarts[x.rank] += 1
        for x in due:
            log.info("rank %d: restarting its worker", x.rank)

    def _fail_pending(self, x: RankRecord, why: str) -> None:
        for fut, _ in x.pending.values():
            if not fut.done():
                fut.set_exception(WorkerError(f"rank {x.rank}: {why}"))
        x.pending.clear()
