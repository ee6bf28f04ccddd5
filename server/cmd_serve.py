"""``gdsload serve``: the sidecar command. Parses flags, then hands over to the supervisor and uvicorn.

>>> # gdsload serve /models/llama-tp2 --tp 2 --allow-root /models --port 8471   # doctest: +SKIP
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from types import FrameType
from typing import Any

import click

from ..loader.errors import GdsloadError

from .forkserver import START_METHODS
from .settings import ENV_VARS, LOG_FORMATS, LOG_LEVELS, TOKEN_ENV, ServeConfig, configure_logging

__all__ = ["serve", "run_server", "EXIT_BAD_TARGET"]

log = logging.getLogger(__name__)

EXIT_BAD_TARGET = 2
"""Exit status of ``serve`` when its model cannot be served (the one log line before it says why and the fix)."""


def _env(name: str) -> str:
    return f"env {ENV_VARS[name]}"


@click.command("serve")
@click.argument("model_dir", required=False)
@click.option(
    "--ranks", default=None, help=f"Ranks this host serves, e.g. 0-7 or 0,2,4 (default: all); {_env('ranks')}."
)
@click.option(
    "--tp",
    "--tensor-parallel-size",
    "tp",
    type=int,
    default=None,
    help=f"Serve ranks 0..N-1 (every rank of the layout: tp x pp); {_env('tp')}.",
)
@click.option(
    "--device-map",
    default=None,
    help=f"auto (i-th rank -> i-th visible GPU, CPU without GPUs), cpu, or RANK:GPU pairs like 0:0,1:1; "
    f"{_env('device_map')}.",
)
@click.option("--backend", default=None, help=f"Reader backend, auto by default; {_env('backend')}.")
@click.option("--host", default=None, help=f"Address to bind (default 127.0.0.1); {_env('host')}.")
@click.option("--port", type=int, default=None, help=f"Port (default 8471, 0: any free port); {_env('port')}.")
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help=f"File holding the bearer token for reload/unload/IPC; {_env('token_file')}, or the token in {TOKEN_ENV}.",
)
@click.option(
    "--allow-root",
    "allow_roots",
    multiple=True,
    type=click.Path(file_okay=False),
    help=f"Directory model paths must lie in (repeatable); {_env('allow_roots')} (':'-separated).",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help=f"A Host header the API answers (repeatable; '*': any); default: the loopback names when bound to "
    f"loopback, else any; {_env('allowed_hosts')} (','-separated).",
)
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS, case_sensitive=False),
    default=None,
    help=f"text or json; {_env('log_format')}.",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default=None,
    help=f"Default info; {_env('log_level')}.",
)
@click.option(
    "--restart-backoff",
    type=float,
    default=None,
    help=f"Seconds before the first restart of a crashed worker (default 1, doubling); {_env('restart_backoff')}.",
)
@click.option(
    "--restart-backoff-max",
    type=float,
    default=None,
    help=f"Longest restart delay in seconds (default 30, or the first delay when that is larger); "
    f"{_env('restart_backoff_max')}.",
)
@click.option(
    "--max-restarts",
    type=int,
    default=None,
    help=f"Consecutive crashes restarted per rank (default 5); {_env('max_restarts')}.",
)
@click.option(
    "--stop-timeout",
    type=float,
    default=None,
    help=f"Seconds a worker gets to exit on unload/SIGTERM before it is killed (default 10); {_env('stop_timeout')}.",
)
@click.option(
    "--request-timeout",
    type=float,
    default=None,
    help=f"Seconds a client may take to send a request's headers, then its body (default 10); "
    f"{_env('request_timeout')}.",
)
@click.option(
    "--lease-grace",
    type=float,
    default=None,
    help=f"Seconds an IPC lease no engine holds stays outstanding (default 3); {_env('lease_grace')}.",
)
@click.option(
    "--worker-start",
    type=click.Choice(START_METHODS, case_sensitive=False),
    default=None,
    help=f"forkserver: fork workers from a helper that imported their libraries at start; spawn: a fresh "
    f"interpreter per worker; auto (default): forkserver where workers import torch, else spawn; "
    f"{_env('worker_start')}.",
)
def serve(
    model_dir: str | None,
    ranks: str | None,
    tp: int | None,
    device_map: str | None,
    backend: str | None,
    host: str | None,
    port: int | None,
    token_file: str | None,
    allow_roots: tuple[str, ...],
    allowed_hosts: tuple[str, ...],
    log_format: str | None,
    log_level: str | None,
    restart_backoff: float | None,
    restart_backoff_max: float | None,
    max_restarts: int | None,
    stop_timeout: float | None,
    request_timeout: float | None,
    lease_grace: float | None,
    worker_start: str | None,
) -> None:
    """Serve MODEL_DIR (or GDSLOAD_MODEL_DIR): one worker process per local rank, and an HTTP API for health,
    readiness, status, metrics, reload/unload and IPC hand-off (OpenAPI at /docs). Every flag is also a
    GDSLOAD_* variable; flags win."""
    try:
        config = ServeConfig.resolve(
            model_dir=model_dir,
            ranks=ranks,
            tp=tp,
            device_map=device_map,
            backend=backend,
            host=host,
            port=port,
            token_file=token_file,
            allow_roots=allow_roots,
            allowed_hosts=allowed_hosts,
            log_format=log_format,
            log_level=log_level,
            restart_backoff=restart_backoff,
            restart_backoff_max=restart_backoff_max,
            max_restarts=max_restarts,
            stop_timeout=stop_timeout,
            request_timeout=request_timeout,
            lease_grace=lease_grace,
            worker_start=worker_start,
        )
    except GdsloadError as e:
        raise click.UsageError(str(e)) from None
    run_server(config)


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port} ({e}); pick another --port or --host") from None
    sock.set_inheritable(False)
    return sock


def _exit_quietly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def run_server(config: ServeConfig) -> None:
    """Check the model, bind, answer the probes, then start the workers; serve until SIGTERM/SIGINT, then stop
    the workers (they free their memory).

    The order is what an orchestrator needs: a bad target exits before anything starts; the probes are
    answered from the moment the port is bound (:class:`~gdsload.server.probes.ProbeFront`), and the
    fork server, the workers and the rest of the API start behind them, on a thread.

    >>> run_server(ServeConfig.resolve(model_dir="/models/llama-tp2"))  # doctest: +SKIP
    """
    configure_logging(config.log_format, config.log_level)
    target = None
    if config.model_dir is not None:  # before anything starts: a bad target is a failed start, not a failed state
        from .target import check_target

        try:
            target = check_target(config.model_dir, config)
        except GdsloadError as e:
            log.error("cannot serve %s: %s: %s", config.model_dir, type(e).__name__, e)
            raise SystemExit(EXIT_BAD_TARGET) from None
    sock = _bind(config.host, config.port)

    import uvicorn

    from .http_guard import Deadlines, HeaderDeadline
    from .probes import ProbeFront
    from .supervisor import Supervisor

    supervisor = Supervisor(config, target)
    front = ProbeFront(supervisor, on_shutdown=supervisor.stop)
    # uvicorn handles SIGTERM gracefully, then re-raises it with the handler it found: make that a clean exit.
    signal.signal(signal.SIGTERM, _exit_quietly)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            supervisor.draining.set()  # held leases end now, so the connections drain at once
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:  # the probes answer: now the rest may start
                threading.Thread(
                    target=_start_behind, args=(config, supervisor, front), name="gdsload-start", daemon=True
                ).start()

    deadlines = Deadlines(config.request_timeout)  # slow and idle clients: see gdsload.server.http_guard
    server = _Server(
        uvicorn.Config(
            HeaderDeadline(front, deadlines),
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
            server_header=False,
            http=deadlines.protocol(),
            proxy_headers=False,
        )
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    # Logged at any --log-level: with --port 0 this line is the only place the port is named.
    level = max(logging.INFO, logging.getLogger().getEffectiveLevel())
    log.log(level, "listening on http://%s:%d (API docs at /docs) config %s", shown, port, config.public_dict())
    try:
        server.run(sockets=[sock])
    finally:
        supervisor.stop()
        sock.close()
        log.info("stopped")


def _start_behind(config: ServeConfig, supervisor: Any, front: Any) -> None:
    """What starts once the probes answer: the fork server, the workers, then the API application."""
    from .start import start_worker_server

    try:
        start_worker_server(config)
        supervisor.start()  # returns at once: the supervisor's thread starts the workers
        if not config.is_loopback and config.token is None:
            log.warning(
                "listening on %s without a token: anyone who reaches it reads status; set %s", config.host, TOKEN_ENV
            )
        if config.token is None:
            log.info(
                "no token configured: /v1/reload, /v1/unload and /v1/ipc answer 403 (set %s or --token-file)", TOKEN_ENV
            )
        from .app import create_app

        app = create_app(supervisor)
        app.middleware_stack = app.build_middleware_stack()  # now, rather than in the first request
        front.set_app(app)
    except Exception as e:  # the probes go on answering; other requests get 503 naming this
        log.exception("the server could not finish starting")
        front.set_app(None, error=f"the server could not finish starting ({type(e).__name__}: {e}); see its log")


if __name__ == "__main__":
    serve(prog_name="gdsload serve")
