"""IPC exports and their leases, the part of the supervisor an engine talks to.

An export (``GET /v1/ipc/{rank}``) asks the rank's worker for its IPC document and records a lease; the
memory stays valid until the lease is released (``POST /v1/ipc/{rank}/release``), or voided by a reload,
an unload or the worker's crash. An engine holds its lease with ``GET /v1/ipc/{rank}/hold``, whose
connection stays open for as long as it uses the memory; a lease nobody holds is released
``lease_grace`` seconds after its export. No export waits for a worker longer than :data:`EXPORT_TIMEOUT_S`.

:class:`LeaseOperations` is a part of :class:`~gdsload.server.supervisor.Supervisor` (it shares its lock,
ranks and thread); it is not used on its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, TypeVar

from ..loader.errors import GdsloadError

from .errors import ExportsOutstandingError, UnknownLeaseError, UnknownRankError, WorkerError
from .settings import ServeConfig
from .state import RankRecord, RankState
from .worker_protocol import RankNotReadyError
from .workers import WorkerHandle

__all__ = ["LeaseOperations", "EXPORT_TIMEOUT_S", "remote_error"]

log = logging.getLogger("gdsload.server.supervisor")

EXPORT_TIMEOUT_S = 10.0
"""Longest wait for a worker's export (its IPC handle and tensor table): a worker that does not answer in time
(stopped, stuck) gets a 503, not a request that holds a connection for minutes."""

T = TypeVar("T")


class LeaseOperations:
    """The supervisor's exports, releases, holds and lease expiry."""

    config: ServeConfig
    _lock: threading.Lock
    _ranks: dict[int, RankRecord]
    _stop: threading.Event
    _model: dict[str, Any] | None
    _generation: int

    if TYPE_CHECKING:  # the supervisor's

        def _call(self, fn: Callable[[], T]) -> T: ...
        async def call_async(self, fn: Callable[[], T]) -> T: ...
        def _publish(self) -> None: ...

    def outstanding_leases(self) -> dict[int, int]:
        """``{rank: IPC exports not yet released}`` for ranks that have any."""
        with self._lock:
            return {r: len(x.leases) for r, x in self._ranks.items() if x.leases}

    def export(self, rank: int) -> dict[str, Any]:
        """The IPC document of ``rank`` (see :func:`gdsload.loader.handoff.ipc.export_rank`) plus a ``lease`` id.

        The exported memory stays valid until the lease is released or the model is unloaded. Waits at
        most :data:`EXPORT_TIMEOUT_S` for the worker.
        """
        lease = uuid.uuid4().hex
        reply: Future[dict[str, Any]] = self._call(lambda: self._command(rank, "export", lease))
        try:
            doc = reply.result(timeout=EXPORT_TIMEOUT_S)
        except FutureTimeout:
            reply.cancel()  # a late answer is dropped, and its lease released
            raise WorkerError(
                f"rank {rank}: the worker did not answer the export within {EXPORT_TIMEOUT_S:.0f} s "
                "(stopped or stuck); see /v1/status"
            ) from None
        return self._exported(doc, lease)

    async def export_async(self, rank: int) -> dict[str, Any]:
        """:meth:`export` for an event loop: no thread waits on the worker."""
        lease = uuid.uuid4().hex
        reply: Future[dict[str, Any]] = await self.call_async(lambda: self._command(rank, "export", lease))
        try:
            doc = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(reply)), EXPORT_TIMEOUT_S)
        except asyncio.TimeoutError:
            reply.cancel()
            raise WorkerError(
                f"rank {rank}: the worker did not answer the export within {EXPORT_TIMEOUT_S:.0f} s "
                "(stopped or stuck); see /v1/status"
            ) from None
        return self._exported(doc, lease)

    def _exported(self, doc: dict[str, Any], lease: str) -> dict[str, Any]:
        with self._lock:
            model = self._model["path"] if self._model else None
            generation = self._generation
        return {**doc, "lease": lease, "generation": generation, "model": model}

    def release(self, rank: int, lease: str | None = None) -> dict[str, Any]:
        """Mark an IPC export of ``rank`` as done with; ``lease=None`` releases every lease of the rank
        that no engine holds (:meth:`hold`)."""
        return self._call(lambda: self._release(rank, lease))

    async def release_async(self, rank: int, lease: str | None = None) -> dict[str, Any]:
        """:meth:`release` for an event loop."""
        return await self.call_async(lambda: self._release(rank, lease))

    def hold(self, rank: int, lease: str, *, pid: int | None, peer: str | None) -> None:
        """Record that an engine holds ``lease`` of ``rank`` for as long as it lives (``GET
        /v1/ipc/{rank}/hold``, whose connection stays open: the lease is released when it closes)."""
        with self._lock:
            x = self._ranks.get(rank)
            if x is None:
                raise UnknownRankError(f"rank {rank} is not served here; served ranks: {sorted(self._ranks)}")
            if lease not in x.leases:
                raise UnknownLeaseError(
                    f"lease {lease!r} is not outstanding on rank {rank}; it was released "
                    "already, or a worker restart or reload voided it"
                )
            if lease in x.holders:
                raise ExportsOutstandingError(
                    f"lease {lease!r} of rank {rank} is already held (by engine pid "
                    f"{x.holders[lease]['pid']}); each engine holds the lease it mapped with"
                )
            x.holders[lease] = {"lease": lease, "pid": pid, "peer": peer, "since": time.time()}
            self._publish()
        log.info("rank %d: lease %s held by engine pid %s (%s) until its connection closes", rank, lease, pid, peer)

    def holds(self, rank: int, lease: str) -> bool:
        """Whether ``lease`` of ``rank`` is still outstanding (a reload, unload or worker crash voids it)."""
        with self._lock:
            x = self._ranks.get(rank)
            return x is not None and lease in x.leases

    def _expire_leases(self) -> None:
        """Release every lease no engine has held within ``lease_grace`` seconds of its export (the engine died
        between the export and the hold, or does not hold): it would block unloads for nothing."""
        now, grace = time.monotonic(), self.config.lease_grace
        expired: list[tuple[int, str, WorkerHandle | None]] = []
        with self._lock:
            for x in self._ranks.values():
                for lease, (mono, _) in list(x.leases.items()):
                    if lease not in x.holders and now - mono >= grace:
                        del x.leases[lease]
                        expired.append((x.rank, lease, x.handle))
            if expired:
                self._publish()
        for rank, lease, handle in expired:
            log.info("rank %d: lease %s released: no engine held it within %.1f s of its export", rank, lease, grace)
            if handle is not None:
                handle.send("release", lease=lease)

    def _command(self, rank: int, kind: str, lease: str) -> Future[Any]:
        with self._lock:
            x = self._ranks.get(rank)
            if x is None:
                raise UnknownRankError(f"rank {rank} is not served here; served ranks: {sorted(self._ranks)}")
            if x.state is not RankState.READY or x.handle is None:
                raise RankNotReadyError(
                    f"rank {rank} is {x.state.value}; poll /readyz until it answers 200, then ask again"
                )
            request_id = uuid.uuid4().hex
            fut: Future[Any] = Future()
            x.pending[request_id] = (fut, lease)
            handle = x.handle
        if not handle.send(kind, id=request_id, lease=lease):
            with self._lock:
                x.pending.pop(request_id, None)
            raise WorkerError(f"rank {rank}: the worker cannot be reached (it is exiting); try again after /readyz")
        return fut

    def _release(self, rank: int, lease: str | None) -> dict[str, Any]:
        with self._lock:
            x = self._ranks.get(rank)
            if x is None:
                raise UnknownRankError(f"rank {rank} is not served here; served ranks: {sorted(self._ranks)}")
            if lease is not None and lease not in x.leases:
                raise UnknownLeaseError(
                    f"lease {lease!r} is not outstanding on rank {rank} ({len(x.leases)} are); it was released "
                    "already, or a worker restart or reload voided it"
                )
            # Without a lease: every lease no running engine holds (a held one goes with its engine).
            released = [lease] if lease is not None else sorted(set(x.leases) - set(x.holders))
            for one in released:
                x.leases.pop(one, None)
                x.holders.pop(one, None)
            left, handle = len(x.leases), x.handle
            self._publish()
        if handle is not None:
            for one in released:
                handle.send("release", lease=one)
        return {"released": released, "rank": rank, "outstanding": left}

    def _await_leases(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while self.outstanding_leases() and time.monotonic() < deadline and not self._stop.is_set():
            self._stop.wait(0.05)
        if self._stop.is_set():  # shutting down: do not hold up the exit for the rest of wait_s
            raise WorkerError("the sidecar is shutting down")


def remote_error(rank: int, doc: dict[str, str]) -> GdsloadError:
    if doc.get("type") == "RankNotReadyError":
        return RankNotReadyError(doc["message"])
    return WorkerError(f"rank {rank}: {doc.get('type')}: {doc.get('message')}")
