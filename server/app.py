"""The sidecar's HTTP API (FastAPI; OpenAPI at ``/docs``). A thin shell over :class:`Supervisor`.

| endpoint                        | token | answers                                                         |
|---------------------------------|-------|-----------------------------------------------------------------|
| ``GET /healthz``                | no    | 200 while the process lives and its supervisor runs, else 503   |
| ``GET /readyz``                 | no    | 200 when every served rank is loaded, else 503; per-rank states |
| ``GET /v1/status``              | no    | model, per-rank state, bytes, phases, GB/s, errors, time-to-ready |
| ``GET /metrics``                | no    | Prometheus text exposition                                      |
| ``POST /v1/reload``             | yes   | 202: load another model directory (under ``--allow-root``)      |
| ``POST /v1/unload``             | yes   | 200: stop the workers, free the memory                          |
| ``GET /v1/ipc/{rank}``          | yes   | the rank's IPC document (handle + tensor table) and a lease id  |
| ``POST /v1/ipc/{rank}/release`` | yes   | the engine is done with a lease                                 |
| ``GET /v1/ipc/{rank}/hold``     | yes   | streams while an engine holds a lease; released when it closes  |

``gdsload serve`` answers the probes before this application is built (:mod:`gdsload.server.probes`);
in-process, the lifespan starts the supervisor (returning at once: the workers load in the background)
and stops it at shutdown. The probes also answer ``HEAD``. Every error, of any status, is ``{"error": {"type": ..., "message": ...}}``: 400 bad
model or request (a body that is not JSON too), 401 missing or wrong token, 403 no token
configured or path outside the allowed roots, 404 unknown rank, lease or path, 405 method, 409
rank not ready or exports outstanding, 413 body too large, 422 body or path parameter of the
wrong shape, 500 a fault of the server, 503 worker gone; 408 a body not sent in time. The token is
checked from the headers before any body byte is read (and the ``Host`` before that).

>>> app = create_app(Supervisor(ServeConfig.resolve(model_dir="/models/m")))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ..loader.version import __version__
from ..loader.errors import GdsloadError

from .http_guard import REQUEST_TIMEOUT_S
from .metrics import make_registry, render
from .probes import answer_probe
from .probes import healthz as healthz_answer
from .probes import readyz as readyz_answer
from .settings import ENV_VARS, TOKEN_ENV
from .supervisor import ExportsOutstandingError, RankNotReadyError, Supervisor, WorkerError
from .worker_protocol import error_doc

__all__ = ["create_app", "UnauthorizedError", "TokenNotConfiguredError", "MAX_BODY_BYTES"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 10
"""Largest request body accepted; every body of this API is a few hundred bytes."""

_Scope = MutableMapping[str, Any]
_Message = MutableMapping[str, Any]
_ASGIApp = Callable[[_Scope, Callable[[], Awaitable[_Message]], Callable[[_Message], Awaitable[None]]], Awaitable[None]]


class UnauthorizedError(GdsloadError, PermissionError):
    """The request carries no bearer token, or the wrong one."""


class TokenNotConfiguredError(GdsloadError, PermissionError):
    """The endpoint needs a token and the server was started without one."""


def _http_status(exc: GdsloadError) -> int:
    if isinstance(exc, UnauthorizedError):
        return 401
    if isinstance(exc, PermissionError):
        return 403
    if isinstance(exc, (LookupError, FileNotFoundError)):
        return 404
    if isinstance(exc, (ExportsOutstandingError, RankNotReadyError)):
        return 409
    if isinstance(exc, WorkerError):
        return 503
    return 400


HOLD_POLL_S = 0.25
"""How often a hold stream checks that its lease is still outstanding (a forced reload voids it)."""


class _HoldResponse(Response):
    """The answer of ``GET /v1/ipc/{rank}/hold``: ``held`` at once, then nothing while the lease holds;
    ``released`` and the end when the sidecar voids it, ``stopping`` when the server shuts down. When
    the engine's connection closes (the engine exited, however it exited), the lease is released."""

    def __init__(self, supervisor: Supervisor, rank: int, lease: str):
        super().__init__(media_type="text/plain")
        self.supervisor, self.rank, self.lease = supervisor, rank, lease

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gone = asyncio.Event()

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        listener = asyncio.ensure_future(listen())
        sup = self.supervisor
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"cache-control", b"no-store")],
                }
            )
            await send({"type": "http.response.body", "body": b"held\n", "more_body": True})
            while (
                not gone.is_set()
                and sup.holds(self.rank, self.lease)
                and not sup.stopping
                and not sup.draining.is_set()
            ):
                try:
                    await asyncio.wait_for(gone.wait(), timeout=HOLD_POLL_S)
                except asyncio.TimeoutError:
                    pass
            if not gone.is_set():
                end = b"stopping\n" if sup.stopping or sup.draining.is_set() else b"released\n"
                await send({"type": "http.response.body", "body": end, "more_body": False})
        finally:
            listener.cancel()
            if sup.holds(self.rank, self.lease) and not (sup.stopping or sup.draining.is_set()):
                try:
                    await sup.release_async(self.rank, self.lease)
                    log.info("rank %d: lease %s released: its engine's connection closed", self.rank, self.lease)
                except GdsloadError as e:  # voided meanwhile, or the sidecar is stopping
                    log.debug("rank %d: lease %s not released on disconnect: %s", self.rank, self.lease, e)


class ReloadRequest(BaseModel):
    """Body of ``POST /v1/reload``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_dir: str = Field(
        min_length=1,
        max_length=4096,
        description="Absolute path of the model directory to serve; must lie under an --allow-root "
        "directory once symlinks and '..' are resolved.",
    )
    ranks: list[Annotated[StrictInt, Field(ge=0, le=4095)]] | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="Ranks to serve; default: the --ranks/--tp of the server, else every rank of the model.",
    )
    wait_s: float = Field(
        default=0.0,
        ge=0,
        le=600,
        strict=True,
        description="Seconds to wait for outstanding IPC exports to be released before refusing.",
    )
    force: StrictBool = Field(
        default=False, description="Reload even while IPC exports are outstanding (their memory becomes invalid)."
    )

    @field_validator("model_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if "\x00" in v or not os.path.isabs(v):
            raise ValueError("must be an absolute path without NUL characters")
        return v


class UnloadRequest(BaseModel):
    """Body of ``POST /v1/unload`` (optional)."""

    model_config = ConfigDict(extra="forbid")

    wait_s: float = Field(
        default=0.0,
        ge=0,
        le=600,
        strict=True,
        description="Seconds to wait for outstanding IPC exports to be released before refusing.",
    )
    force: StrictBool = Field(default=False, description="Unload even while IPC exports are outstanding.")


class ReleaseRequest(BaseModel):
    """Body of ``POST /v1/ipc/{rank}/release``."""

    model_config = ConfigDict(extra="forbid")

    lease: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{32}$",
        description="The lease id returned by GET /v1/ipc/{rank}; omitted: every outstanding "
        "lease of the rank (one engine per rank).",
    )


async def _send_error(
    send: Callable[[_Message], Awaitable[None]],
    status: int,
    kind: str,
    message: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = JSONResponse({"error": {"type": kind, "message": message}}).body
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _BodyLimit:
    """ASGI wrapper: the whole request body read here, at most ``limit`` bytes within ``timeout`` seconds
    (413 beyond the size, before reading, when the length is declared; 408 past the time), then replayed."""

    def __init__(self, app: _ASGIApp, limit: int, timeout: float = REQUEST_TIMEOUT_S):
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(
        self, scope: _Scope, receive: Callable[[], Awaitable[_Message]], send: Callable[[_Message], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and (not value.isdigit() or int(value) > self.limit):
                await self._too_large(send)
                return
        buffered: list[_Message] = []
        seen = 0
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left, 0.001))
            except asyncio.TimeoutError:
                await _send_error(
                    send,
                    408,
                    "RequestTimeout",
                    f"the request body did not arrive within {self.timeout:g} s; send it at once",
                )
                return
            buffered.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.limit:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> _Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Callable[[_Message], Awaitable[None]]) -> None:
        await _send_error(send, 413, "RequestTooLarge", f"request bodies are limited to {self.limit} bytes")


class _HostCheck:
    """ASGI wrapper: Starlette's ``TrustedHostMiddleware`` refuses requests whose ``Host`` names a host not allowed
    (DNS rebinding), answered with 400 in this API's error shape.

    The probes answer whatever the ``Host``: they tell nothing a page could misuse, and kubelets send pod IPs.
    """

    def __init__(self, app: _ASGIApp, allowed: tuple[str, ...]):
        self.app = app
        self.allowed = sorted({_host_pattern(h) for h in allowed})
        self.trusted = TrustedHostMiddleware(self._admitted, allowed_hosts=self.allowed, www_redirect=False)

    async def _admitted(
        self, scope: _Scope, receive: Callable[[], Awaitable[_Message]], send: Callable[[_Message], Awaitable[None]]
    ) -> None:
        scope["gdsload.host_allowed"] = True
        await self.app(scope, receive, send)

    async def __call__(
        self, scope: _Scope, receive: Callable[[], Awaitable[_Message]], send: Callable[[_Message], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http" or scope["path"] in ("/healthz", "/readyz"):
            await self.app(scope, receive, send)
            return

        async def admitted_only(message: _Message) -> None:  # the middleware's own refusal is answered below
            if scope.get("gdsload.host_allowed"):
                await send(message)

        await self.trusted(scope, receive, admitted_only)
        if not scope.get("gdsload.host_allowed"):
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            await _send_error(
                send,
                400,
                "HostNotAllowed",
                f"Host {host!r} is not one this server answers ({', '.join(self.allowed)}); "
                "start it with --allowed-host NAME to add one",
            )


def _host_pattern(host: str) -> str:
    """An allowed host as ``TrustedHostMiddleware`` compares it: lower case, IPv6 literals in brackets."""
    host = host.strip("[]").lower()
    return f"[{host}]" if ":" in host else host


class _TokenFirst:
    """ASGI wrapper: for the endpoints that need the token, check it from the headers before a body byte is read."""

    def __init__(self, app: _ASGIApp, protected: list[tuple[set[str], Any]], token: str | None):
        self.app = app
        self.protected = protected
        self.token = token

    async def __call__(
        self, scope: _Scope, receive: Callable[[], Awaitable[_Message]], send: Callable[[_Message], Awaitable[None]]
    ) -> None:
        if scope["type"] == "http" and any(
            scope["method"] in methods and regex.match(scope["path"]) for methods, regex in self.protected
        ):
            try:
                _check_token(self.token, _authorization(scope))
            except GdsloadError as e:
                await _send_error(
                    send,
                    _http_status(e),
                    type(e).__name__,
                    str(e),
                    [(b"www-authenticate", b'Bearer realm="gdsload"')] if isinstance(e, UnauthorizedError) else None,
                )
                return
        await self.app(scope, receive, send)


def _authorization(scope: _Scope) -> str | None:
    """The bearer token of a request's ``Authorization`` header, or None."""
    value = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
    if value is None:
        return None
    kind, _, credentials = value.partition(" ")
    return credentials.strip() if kind.lower() == "bearer" and credentials.strip() else None


def _check_token(token: str | None, given: str | None) -> None:
    if token is None:
        raise TokenNotConfiguredError(
            f"this endpoint needs a bearer token and the server has none; restart it with {TOKEN_ENV}=... "
            f"or --token-file FILE ({ENV_VARS['token_file']}=FILE)"
        )
    if given is None or not hmac.compare_digest(given.encode(), token.encode()):
        raise UnauthorizedError("missing or wrong bearer token; send the header 'Authorization: Bearer TOKEN'")


_bearer = HTTPBearer(auto_error=False, description=f"The token from {TOKEN_ENV} or --token-file.")


def _require_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """The route-level check (it documents the scheme in OpenAPI); ``_TokenFirst`` has already run it."""
    _check_token(request.app.state.supervisor.config.token, credentials.credentials if credentials else None)


def _validation_message(exc: RequestValidationError) -> str:
    """One line naming each invalid field of a request and why, e.g. ``body.model_dir: Field required``."""
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "the request is invalid"


def _needs_token(request: Request) -> bool:
    route = request.scope.get("route")
    return any(getattr(d, "dependency", None) is _require_token for d in getattr(route, "dependencies", ()))


class _ProbesFastPath:
    """ASGI wrapper: answer ``/healthz`` and ``/readyz`` from the supervisor's state without routing or validation
    (:mod:`gdsload.server.probes`, which ``gdsload serve`` also runs in front of this application).

    Orchestrators, autoscalers and load balancers poll them hard; the routes of the same names document
    them in OpenAPI and answer identically.
    """

    def __init__(self, app: _ASGIApp, supervisor: Supervisor):
        self.app = app
        self.supervisor = supervisor

    async def __call__(
        self, scope: _Scope, receive: Callable[[], Awaitable[_Message]], send: Callable[[_Message], Awaitable[None]]
    ) -> None:
        if not await answer_probe(scope, send, self.supervisor):
            await self.app(scope, receive, send)


def create_app(supervisor: Supervisor) -> FastAPI:
    """The FastAPI application of one sidecar; its lifespan starts and stops ``supervisor``.

    >>> uvicorn.run(create_app(Supervisor(config)), host="127.0.0.1", port=8471)  # doctest: +SKIP
    """
    registry = make_registry(supervisor)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        supervisor.start()  # returns once the workers are started: they load in the background, the API answers
        try:
            yield
        finally:
            await run_in_threadpool(supervisor.stop)

    app = FastAPI(
        title="gdsload sidecar",
        version=__version__,
        description="Loads a model's tensor-parallel ranks (one worker process per rank) and reports liveness, "
        "readiness and per-phase load timings; hands the loaded tensors to a local engine by IPC.",
        lifespan=lifespan,
        docs_url=None,  # FastAPI's pages load their scripts from a CDN: /docs below needs nothing from outside
        redoc_url=None,  # not served, and named nowhere: /docs and /openapi.json describe the API
    )
    app.state.supervisor = supervisor
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    protected = [Depends(_require_token)]

    @app.exception_handler(GdsloadError)
    async def _typed_error(request: Request, exc: GdsloadError) -> JSONResponse:
        code = _http_status(exc)
        if code >= 500:
            log.error("%s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        headers = {"WWW-Authenticate": 'Bearer realm="gdsload"'} if code == 401 else None
        return JSONResponse({"error": error_doc(exc)}, status_code=code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        if _needs_token(request):  # the body is parsed before the dependencies run: check the token first
            try:
                _require_token(request, await _bearer(request))
            except GdsloadError as denied:
                return await _typed_error(request, denied)
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            return JSONResponse(
                {
                    "error": {
                        "type": "MalformedJson",
                        "message": "the request body is not valid JSON: " + _validation_message(exc),
                    }
                },
                status_code=400,
            )
        return JSONResponse({"error": {"type": "InvalidRequest", "message": _validation_message(exc)}}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HttpError")
        return JSONResponse(
            {"error": {"type": kind, "message": f"{request.method} {request.url.path}: {exc.detail}"}},
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def _server_fault(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises the exception after this answer, and uvicorn logs it with its traceback.
        return JSONResponse(
            {"error": {"type": "InternalError", "message": f"{type(exc).__name__}: {exc}; see the server's log"}},
            status_code=500,
        )

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return Response(api_page(app.openapi()), media_type="text/html")

    # HEAD of either probe is answered like GET, without a body, by the probes' fast path.
    @app.get(
        "/healthz",
        tags=["probes"],
        summary="Liveness: 200 while the process lives and its supervisor runs",
        responses={
            200: _json("Alive: status, uptime_s"),
            503: _json("The supervisor loop died (status, uptime_s, error): restart the process"),
        },
    )
    async def healthz() -> Response:
        code, body = healthz_answer(supervisor)
        return Response(body, status_code=code, media_type="application/json")

    @app.get(
        "/readyz",
        tags=["probes"],
        summary="Readiness: 200 only when every served rank is loaded",
        responses={
            200: _json("Every rank is ready: ready, generation, per-rank states"),
            503: _json("Not ready: ready, generation, per-rank states and the reason"),
        },
    )
    async def readyz() -> Response:
        code, body = readyz_answer(supervisor)
        return Response(body, status_code=code, media_type="application/json")

    @app.get(
        "/v1/status",
        tags=["status"],
        summary="Per-rank state, bytes, phase timings, GB/s; details with the token",
        responses={401: {"description": "A bearer token was sent, and it is not the server's"}},
    )
    async def status(request: Request) -> JSONResponse:
        """Per rank: ``state`` (pending/loading/ready/failed), ``backend``, ``io_mode``,
        ``logical_bytes``/``stored_bytes``/``bytes_done``, ``phases`` (seconds), ``gbps``, the error's type,
        ``restarts``; ``process.time_to_ready_s`` counts from process start to the first readiness. With the
        bearer token also the model's path, pids, devices, files, error messages, the leases with their age
        and holders, and the configuration; without it, nothing that names a process, a path or a lease."""
        given = _authorization(request.scope)
        if given is not None:
            _check_token(supervisor.config.token, given)  # a wrong token is refused, not quietly downgraded
        return JSONResponse(supervisor.status(detail=given is not None))

    @app.get(
        "/metrics",
        tags=["status"],
        summary="Prometheus metrics",
        response_class=PlainTextResponse,
        responses={
            200: {
                "description": "The Prometheus text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    async def metrics() -> Response:
        body, content_type = render(registry)
        return Response(body, media_type=content_type)

    async def wait_for_leases(wait_s: float) -> None:
        # On the event loop, not a worker thread: requests that wait hold no thread the release they wait
        # for would need.
        deadline = time.monotonic() + wait_s
        while supervisor.outstanding_leases() and time.monotonic() < deadline and not supervisor.stopping:
            await asyncio.sleep(0.05)

    @app.post(
        "/v1/reload",
        tags=["control"],
        status_code=202,
        dependencies=protected,
        responses=_TOKEN_ERRORS,
        summary="Serve another model directory (e.g. a new version)",
    )
    async def reload(body: ReloadRequest) -> dict[str, Any]:
        """Checks the new directory first (allowed root, discovery, device placement): a bad target answers
        4xx and the current model stays. Then stops the current workers and starts the new ones; poll
        ``/readyz`` for the result."""
        target = await run_in_threadpool(supervisor.check_target, body.model_dir, body.ranks)  # reads headers
        await wait_for_leases(body.wait_s)
        return await supervisor.switch_async(target, force=body.force)

    @app.post(
        "/v1/unload",
        tags=["control"],
        dependencies=protected,
        responses=_TOKEN_ERRORS,
        summary="Stop the workers and free memory",
    )
    async def unload(body: UnloadRequest | None = None) -> dict[str, Any]:
        """Answers once the workers are asked to stop; they free their memory and exit within
        ``--stop-timeout`` seconds, or are killed (``/v1/status`` counts those still stopping)."""
        body = body or UnloadRequest()
        await wait_for_leases(body.wait_s)
        return await supervisor.switch_async(None, force=body.force)

    @app.get(
        "/v1/ipc/{rank}",
        tags=["hand-off"],
        dependencies=protected,
        responses=_TOKEN_ERRORS,
        summary="IPC document of a rank for a local engine process",
    )
    async def ipc_export(rank: Annotated[int, Path(ge=0, le=4095)]) -> dict[str, Any]:
        """The arena's IPC handle (CUDA IPC, or shared memory for host-memory ranks) and the tensor table
        (name, dtype, shape, offset, nbytes), for :func:`gdsload.loader.handoff.ipc.import_rank`. The memory stays
        valid until the returned ``lease`` is released or the model is unloaded."""
        return await supervisor.export_async(rank)

    @app.post(
        "/v1/ipc/{rank}/release",
        tags=["hand-off"],
        dependencies=protected,
        responses=_TOKEN_ERRORS,
        summary="The engine is done with an exported rank",
    )
    async def ipc_release(
        rank: Annotated[int, Path(ge=0, le=4095)], body: ReleaseRequest | None = None
    ) -> dict[str, Any]:
        return await supervisor.release_async(rank, (body or ReleaseRequest()).lease)

    @app.get(
        "/v1/ipc/{rank}/hold",
        tags=["hand-off"],
        dependencies=protected,
        response_class=PlainTextResponse,
        responses={
            **_TOKEN_ERRORS,
            200: {
                "description": "``held``, then nothing until the lease ends (``released`` or ``stopping``)",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
        },
        summary="Hold an exported rank for as long as the engine process lives",
    )
    async def ipc_hold(
        request: Request,
        rank: Annotated[int, Path(ge=0, le=4095)],
        lease: Annotated[str, Query(pattern=r"^[0-9a-f]{32}$", description="The lease of GET /v1/ipc/{rank}.")],
        pid: Annotated[
            int | None, Query(ge=1, le=2**22, description="The engine's process id, for /v1/status.")
        ] = None,
    ) -> Response:
        """For an engine whose parameters adopted the exported memory: the answer is ``held``, then the
        connection stays open; the lease is released when it closes (the engine exited), and a reload or
        unload is refused meanwhile unless forced. ``released`` ends the answer if the sidecar voids the
        lease first. ``/v1/status`` lists holders per rank (``held_by``: lease, pid, peer, since)."""
        client = request.scope.get("client")
        supervisor.hold(rank, lease, pid=pid, peer=f"{client[0]}:{client[1]}" if client else None)
        return _HoldResponse(supervisor, rank, lease)

    protected_routes = [
        (set(r.methods or ()), r.path_regex)
        for r in app.routes
        if any(getattr(d, "dependency", None) is _require_token for d in getattr(r, "dependencies", ()))
    ]
    # Added innermost first: the probes, then the Host, then the token, then the body (size and time).
    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES, timeout=supervisor.config.request_timeout)
    app.add_middleware(_TokenFirst, protected=protected_routes, token=supervisor.config.token)
    app.add_middleware(_HostCheck, allowed=supervisor.config.http_hosts())
    app.add_middleware(_ProbesFastPath, supervisor=supervisor)  # added last: runs first
    return app


_TOKEN_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "A bad request or model (a body that is not JSON, a Host not answered)"},
    401: {"description": "Missing or wrong bearer token"},
    403: {"description": "No token configured, or a path outside the allowed roots"},
    404: {"description": "Unknown rank, lease or path"},
    409: {"description": "Rank not ready, or IPC exports outstanding"},
    503: {"description": "The worker is gone or did not answer in time"},
}


def _json(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}


_ERROR_SCHEMA = {
    "title": "Error",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        }
    },
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's OpenAPI document, with every error answer in this API's shape (``{"error": {"type", "message"}}``,
    FastAPI's own 422 included) and the probes' own bodies left as they are."""
    if app.openapi_schema:
        return app.openapi_schema
    spec = FastAPI.openapi(app)
    spec.setdefault("components", {}).setdefault("schemas", {})["Error"] = _ERROR_SCHEMA
    for path, item in spec.get("paths", {}).items():
        for op in item.values():
            for code, answer in op.get("responses", {}).items():
                if code.isdigit() and int(code) >= 400 and path not in ("/healthz", "/readyz"):
                    answer["content"] = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for name in ("HTTPValidationError", "ValidationError"):
        spec["components"]["schemas"].pop(name, None)
    app.openapi_schema = spec
    return spec


def api_page(spec: dict[str, Any]) -> str:
    """The API described from its OpenAPI document as one self-contained HTML page (no scripts, no CDN)."""
    import html

    rows = []
    for path, item in spec.get("paths", {}).items():
        for method, op in item.items():
            token = "yes" if op.get("security") else "no"
            rows.append(
                f"<tr><td><code>{html.escape(method.upper())} {html.escape(path)}</code></td>"
                f"<td>{token}</td><td>{html.escape(op.get('summary', ''))}"
                f"<br><small>{html.escape((op.get('description') or '').strip())}</small></td></tr>"
            )
    title = html.escape(f"{spec.get('info', {}).get('title', '')} {spec.get('info', {}).get('version', '')}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>body{{font-family:"
        "sans-serif;margin:2em}td{vertical-align:top;padding:4px 12px;border-top:1px solid #ddd}</style></head>"
        f"<body><h1>{title}</h1><p>{html.escape(spec.get('info', {}).get('description', ''))}</p>"
        "<p>Machine-readable: <a href='/openapi.json'>/openapi.json</a>. Token endpoints want "
        "<code>Authorization: Bearer TOKEN</code>.</p><table><tr><th>endpoint</th><th>token</th><th>what</th></tr>"
        + "".join(rows)
        + "</table></body></html>"
    )
