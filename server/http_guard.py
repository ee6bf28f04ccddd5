"""What keeps slow, idle and hostile clients from holding the sidecar's HTTP server.

uvicorn closes a keep-alive connection that stays idle after a response, but not one that sends part of
a request's headers and stalls (nor one that opens and sends nothing): it has no setting for that.
Here each connection gets a deadline for its next request's headers, built on public interfaces only:

- :class:`GuardedProtocol` is the HTTP protocol class handed to uvicorn (its ``http`` setting takes a
  class): it wraps, by composition, the h11 protocol uvicorn would use, passing every ``asyncio.Protocol``
  call through, and closes the connection ``request_timeout`` seconds after it opened unless a request
  arrives first;
- :class:`HeaderDeadline`, a small ASGI layer in front of the application, tells that connection when a
  request's headers have arrived (the application is called: no deadline while it answers) and when its
  response is complete (the deadline runs again for the next request).

The ASGI wrappers in :mod:`gdsload.server.app` then refuse a wrong ``Host`` and a missing or wrong token
from the headers alone, before any body byte is read, and read a body (at most ``MAX_BODY_BYTES``)
within ``request_timeout`` seconds more, answering 408 otherwise.

>>> deadlines = Deadlines(10.0)                                        # doctest: +SKIP
>>> uvicorn.Config(HeaderDeadline(app, deadlines), http=deadlines.protocol(), proxy_headers=False)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["Deadlines", "GuardedProtocol", "HeaderDeadline", "REQUEST_TIMEOUT_S"]

REQUEST_TIMEOUT_S = 10.0
"""Default of the server's ``request_timeout``: the longest a connection may take to send a request's headers
(from when it opened, or from its last response), and then again its body."""

_Scope = MutableMapping[str, Any]


def _key(address: Any) -> tuple[str, int] | None:
    """A connection's peer, as the transport and the ASGI scope (``client``) both give it."""
    if isinstance(address, (tuple, list)) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None


class Deadlines:
    """The open connections of one server, by peer address, each with its header deadline.

    Run the server without proxy headers (``proxy_headers=False``): the ASGI scope's ``client`` must be
    the connection's own peer, which is also what the hold endpoint reports.
    """

    def __init__(self, timeout: float = REQUEST_TIMEOUT_S):
        self.timeout = float(timeout)
        self.open: dict[tuple[str, int], GuardedProtocol] = {}

    def protocol(self) -> type[GuardedProtocol]:
        """The protocol class to hand uvicorn (``uvicorn.Config(http=...)``)."""
        return type("GuardedProtocol", (GuardedProtocol,), {"deadlines": self})


class GuardedProtocol(asyncio.Protocol):
    """uvicorn's h11 protocol, wrapped: the connection is closed if a request's headers are late."""

    deadlines: Deadlines

    def __init__(self, **kwargs: Any):
        from uvicorn.protocols.http.h11_impl import H11Protocol  # the protocol uvicorn's `http="h11"` names

        self._inner = H11Protocol(**kwargs)
        self._transport: asyncio.Transport | None = None
        self._peer: tuple[str, int] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.requests = 0
        """Requests whose headers arrived on this connection (the latest one owns the deadline)."""

    # -- asyncio.Protocol, passed through
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Any transport with a transport's methods: uvloop's (uvicorn's loop where uvloop is installed, as it is
        # next to vLLM) does not subclass asyncio.Transport.
        self._transport = transport  # type: ignore[assignment]
        self._peer = _key(transport.get_extra_info("peername"))
        if self._peer is not None:
            self.deadlines.open[self._peer] = self
        self.arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if self._peer is not None and self.deadlines.open.get(self._peer) is self:
            del self.deadlines.open[self._peer]
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # -- the deadline
    def arm(self) -> None:
        """The next request's headers are due within the timeout."""
        self.disarm()
        if self._transport is not None and not self._transport.is_closing():
            self._timer = asyncio.get_running_loop().call_later(self.deadlines.timeout, self._late)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()


class HeaderDeadline:
    """ASGI layer: no header deadline while a request is answered; the next one starts with its response's end."""

    def __init__(self, app: Callable[..., Awaitable[None]], deadlines: Deadlines):
        self.app = app
        self.deadlines = deadlines

    async def __call__(
        self, scope: _Scope, receive: Callable[..., Awaitable[Any]], send: Callable[..., Awaitable[None]]
    ) -> None:
        peer = _key(scope.get("client")) if scope["type"] == "http" else None
        guard = self.deadlines.open.get(peer) if peer is not None else None
        if guard is None:
            await self.app(scope, receive, send)
            return
        guard.disarm()  # the headers are here
        guard.requests += 1
        mine, answered = guard.requests, False

        async def send_then_arm(message: MutableMapping[str, Any]) -> None:
            nonlocal answered
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
                if guard.requests == mine:  # the connection's next request has not begun yet
                    guard.arm()

        try:
            await self.app(scope, receive, send_then_arm)
        finally:
            if not answered and guard.requests == mine:  # an error uvicorn answers itself: the deadline runs again
                guard.arm()
