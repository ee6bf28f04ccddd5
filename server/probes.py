"""The probes, answered by the process that starts first: ``/healthz`` and ``/readyz`` without the API's imports.

``gdsload serve`` runs :class:`ProbeFront` as its ASGI application. It answers the two probes itself,
from the supervisor's prebuilt state (no lock, no routing, no validation), from the moment the socket
is bound, and hands every other request to the API application (:func:`gdsload.server.app.create_app`)
once that is built — on a thread, after the server answers, while the workers start. Nothing a worker
does (its imports, its fork, its load, its pipe) runs on the event loop, so no probe waits for one.

The API application answers the same two paths identically (its routes document them in OpenAPI and
serve in-process clients); both use :func:`healthz` and :func:`readyz` here.

>>> front = ProbeFront(supervisor)             # doctest: +SKIP
>>> front.set_app(create_app(supervisor))      # later, from any thread  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .supervisor import Supervisor

__all__ = ["ProbeFront", "healthz", "readyz", "APP_WAIT_S"]

log = logging.getLogger(__name__)

_Scope = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_ASGIApp = Callable[[_Scope, _Receive, _Send], Awaitable[None]]

APP_WAIT_S = 30.0
"""Longest a request other than a probe waits for the API application to be built at start-up (then 503)."""


def healthz(supervisor: Supervisor) -> tuple[int, bytes]:
    """``(200 or 503, JSON body)`` of ``/healthz``: alive while the process lives and its supervisor runs."""
    uptime = round(time.time() - supervisor.process_start, 3)
    if supervisor.loop_error is not None:
        return 503, json.dumps({"status": "failed", "uptime_s": uptime, "error": supervisor.loop_error}).encode()
    return 200, b'{"status":"alive","uptime_s":%s}' % repr(uptime).encode()


def readyz(supervisor: Supervisor) -> tuple[int, bytes]:
    """``(200 or 503, JSON body)`` of ``/readyz``, prebuilt by the supervisor at its last state change."""
    return supervisor.readiness()


_PROBES = {"/healthz": healthz, "/readyz": readyz}


async def answer_probe(scope: _Scope, send: _Send, supervisor: Supervisor) -> bool:
    """Answer ``scope`` if it is a probe (``GET`` or ``HEAD`` of ``/healthz`` or ``/readyz``); False otherwise."""
    probe = _PROBES.get(scope["path"]) if scope["type"] == "http" else None
    if probe is None or scope["method"] not in ("GET", "HEAD"):
        return False
    code, body = probe(supervisor)
    await send(
        {
            "type": "http.response.start",
            "status": code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})
    return True


class ProbeFront:
    """ASGI application of ``gdsload serve``: the probes at once, the rest by the API application once built.

    ``on_shutdown`` runs (on a thread) when the server shuts down; the API application's own lifespan
    does not run here (the server starts and stops the supervisor itself).
    """

    def __init__(self, supervisor: Supervisor, on_shutdown: Callable[[], None] | None = None):
        self.supervisor = supervisor
        self.on_shutdown = on_shutdown
        self._app: _ASGIApp | None = None
        self._failed: str | None = None
        self._built = threading.Event()

    def set_app(self, app: _ASGIApp | None, error: str | None = None) -> None:
        """Hand over the API application (from any thread); ``error`` instead when it could not be built."""
        self._app, self._failed = app, error
        self._built.set()

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if await answer_probe(scope, send, self.supervisor):
            return
        app = self._app
        if app is None:
            app = await self._wait_for_app()
        if app is None:
            if scope["type"] == "http":
                await _unavailable(send, self._failed or "the server is still starting; try again in a moment")
            return
        await app(scope, receive, send)

    async def _wait_for_app(self) -> _ASGIApp | None:
        deadline = time.monotonic() + APP_WAIT_S
        while not self._built.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self._app

    async def _lifespan(self, receive: _Receive, send: _Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.on_shutdown is not None:
                    await asyncio.get_running_loop().run_in_executor(None, self.on_shutdown)
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _unavailable(send: _Send, message: str) -> None:
    body = json.dumps({"error": {"type": "ServerStarting", "message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
                (b"retry-after", b"1"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
