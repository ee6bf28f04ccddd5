"""What keeps slow, idle and hostile clients from holding the sidecar's HTTP server.

- :class:`GuardedH11Protocol`: uvicorn's h11 protocol with a deadline on each request's headers. uvicorn
  times out idle keep-alive connections, but not a connection that sent part of a request and stalls:
  here such a connection is closed ``request_timeout`` seconds after it opened (or after its previous
  response), however little it sent.
- The ASGI wrappers in :mod:`gdsload.server.app` then refuse a wrong ``Host`` and a missing or wrong token
  from the headers alone, before any body byte is read, and read a body (at most
  ``MAX_BODY_BYTES``) within ``request_timeout`` seconds more, answering 408 otherwise.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["GuardedH11Protocol", "guarded_protocol", "REQUEST_TIMEOUT_S"]

REQUEST_TIMEOUT_S = 10.0
"""Default of the server's ``request_timeout``: the longest a connection may take to send a request's headers
(from when it opened, or from its last response), and then again its body."""


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's headers do not arrive in time."""

    header_timeout: float = REQUEST_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None
    _armed_for: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._armed_for = self.cycle  # a request that starts later makes a new cycle
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is self._armed_for and not self.transport.is_closing():  # no new request came in time
            self.transport.close()


def guarded_protocol(timeout: float) -> type[GuardedH11Protocol]:
    """The protocol class with a header deadline of ``timeout`` seconds (what the server hands uvicorn)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": float(timeout)})
