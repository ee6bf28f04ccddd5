"""Sidecar configuration: one frozen dataclass; ``GDSLOAD_*`` environment variables are parsed here only.

Precedence: command-line flag > environment variable > default.

| variable                      | flag                    | accepted values                                   | default     |
|-------------------------------|-------------------------|---------------------------------------------------|-------------|
| GDSLOAD_MODEL_DIR             | MODEL_DIR (argument)    | a model directory                                 | none        |
| GDSLOAD_RANKS                 | --ranks                 | ranks like ``0-7``, ``0,2,4``, ``0-3,6``          | all ranks   |
| GDSLOAD_TP                    | --tp                    | integer 1..4096: serve ranks ``0..N-1``           | all ranks   |
| GDSLOAD_DEVICE_MAP            | --device-map            | ``auto``, ``cpu``, or ``RANK:GPU`` pairs          | ``auto``    |
| GDSLOAD_BACKEND               | --backend               | ``auto`` or a reader backend name                 | ``auto``    |
| GDSLOAD_HOST                  | --host                  | an IP address or host name                        | 127.0.0.1   |
| GDSLOAD_PORT                  | --port                  | integer 0..65535 (0: any free port)               | 8471        |
| GDSLOAD_TOKEN                 | (env only)              | the bearer token                                  | none        |
| GDSLOAD_TOKEN_FILE            | --token-file            | a file holding the bearer token                   | none        |
| GDSLOAD_ALLOW_ROOT            | --allow-root (repeat)   | directories, ``:``-separated in the variable      | none        |
| GDSLOAD_ALLOWED_HOSTS         | --allowed-host (repeat) | host names or IPs, ``,``-separated; ``*``: any    | (2)         |
| GDSLOAD_LOG_FORMAT            | --log-format            | ``text``, ``json``                                | ``text``    |
| GDSLOAD_LOG_LEVEL             | --log-level             | ``debug`` .. ``critical``                         | ``info``    |
| GDSLOAD_RESTART_BACKOFF       | --restart-backoff       | seconds > 0, <= 3600: first restart delay         | 1.0         |
| GDSLOAD_RESTART_BACKOFF_MAX   | --restart-backoff-max   | seconds >= the first delay, <= 3600               | 30.0 (1)    |
| GDSLOAD_MAX_RESTARTS          | --max-restarts          | integer 0..1000 consecutive restarts per rank     | 5           |
| GDSLOAD_STOP_TIMEOUT          | --stop-timeout          | seconds 0.1..600 a worker gets to exit            | 10.0        |
| GDSLOAD_REQUEST_TIMEOUT       | --request-timeout       | seconds 0.1..600 to send headers, then body       | 10.0        |
| GDSLOAD_WORKER_START          | --worker-start          | ``auto``, ``forkserver``, ``spawn``               | ``auto``    |
| GDSLOAD_LEASE_GRACE           | --lease-grace           | seconds 0.1..3600 an unheld IPC lease lasts       | 3.0         |

(1) or the first delay, when only that is given and it is larger.
(2) the loopback names (``127.0.0.1``, ``localhost``, ``::1``) when the server binds loopback, else any.

The token comes from ``--token-file``, else ``GDSLOAD_TOKEN_FILE``, else ``GDSLOAD_TOKEN``.

>>> cfg = ServeConfig.resolve(model_dir="/models/llama-tp2", tp=2)  # doctest: +SKIP
>>> cfg.ranks
(0, 1)
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..loader.errors import ConfigError, GdsloadError

__all__ = [
    "ServeConfig",
    "PathNotAllowedError",
    "ENV_VARS",
    "MAX_LOCAL_RANKS",
    "TOKEN_ENV",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "parse_ranks",
    "parse_device_map",
    "confine_path",
    "configure_logging",
    "JsonFormatter",
]

log = logging.getLogger(__name__)

TOKEN_ENV = "GDSLOAD_TOKEN"
# Setting (or flag) name -> its environment variable. The only place these names are read.
ENV_VARS: dict[str, str] = {
    "model_dir": "GDSLOAD_MODEL_DIR",
    "ranks": "GDSLOAD_RANKS",
    "tp": "GDSLOAD_TP",
    "device_map": "GDSLOAD_DEVICE_MAP",
    "backend": "GDSLOAD_BACKEND",
    "host": "GDSLOAD_HOST",
    "port": "GDSLOAD_PORT",
    "token_file": "GDSLOAD_TOKEN_FILE",
    "allow_roots": "GDSLOAD_ALLOW_ROOT",
    "allowed_hosts": "GDSLOAD_ALLOWED_HOSTS",
    "log_format": "GDSLOAD_LOG_FORMAT",
    "log_level": "GDSLOAD_LOG_LEVEL",
    "restart_backoff": "GDSLOAD_RESTART_BACKOFF",
    "restart_backoff_max": "GDSLOAD_RESTART_BACKOFF_MAX",
    "max_restarts": "GDSLOAD_MAX_RESTARTS",
    "stop_timeout": "GDSLOAD_STOP_TIMEOUT",
    "request_timeout": "GDSLOAD_REQUEST_TIMEOUT",
    "worker_start": "GDSLOAD_WORKER_START",
    "lease_grace": "GDSLOAD_LEASE_GRACE",
}
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_MAX_RANK = 4095
MAX_LOCAL_RANKS = 16
"""Most ranks one host serves (one worker process each): more is a configuration error, not a load."""
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z"
)
_TOKEN_RE = re.compile(r"^[\x21-\x7e]+\Z")
MIN_TOKEN_LENGTH = 16
"""Shortest bearer token accepted: guessing one must be out of reach (``openssl rand -hex 32`` gives 64)."""


class PathNotAllowedError(GdsloadError, PermissionError):
    """A model path lies outside every ``--allow-root`` directory (after resolving ``..`` and symlinks)."""


def parse_ranks(value: str, *, what: str = "ranks") -> tuple[int, ...]:
    """``"0-3,6"`` -> ``(0, 1, 2, 3, 6)``; sorted, each rank once.

    >>> parse_ranks("0-3,6")
    (0, 1, 2, 3, 6)
    """
    out: list[int] = []
    for part in str(value).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m:
            raise ConfigError(f"{what}={value!r}: {part!r} is not a rank or range; write e.g. 0-7 or 0,2,4")
        lo = int(m[1])
        hi = int(m[2]) if m[2] is not None else lo
        if hi < lo or hi > _MAX_RANK:
            raise ConfigError(f"{what}={value!r}: range {part!r} must go upwards and stay within 0..{_MAX_RANK}")
        out.extend(range(lo, hi + 1))
    if len(set(out)) != len(out):
        raise ConfigError(f"{what}={value!r} names a rank twice; list each rank once")
    return tuple(sorted(out))


def parse_device_map(value: str) -> str | dict[int, int | None]:
    """``auto``, ``cpu``, or ``{rank: gpu index | None for cpu}`` from ``"0:0,1:1"`` / ``"0:2,1:cpu"``.

    GPU numbers index the GPUs this process sees (``CUDA_VISIBLE_DEVICES`` of the server, when set).

    >>> parse_device_map("0:1,1:cpu")
    {0: 1, 1: None}
    """
    text = str(value).strip().lower()
    if text in ("auto", "cpu"):
        return text
    out: dict[int, int | None] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+|cpu)\s*", part)
        if not m:
            raise ConfigError(
                f"device_map={value!r}: {part.strip()!r} is not RANK:GPU; use auto, cpu, or pairs like 0:0,1:1 (or 1:cpu)"
            )
        rank = int(m[1])
        if rank in out:
            raise ConfigError(f"device_map={value!r} maps rank {rank} twice")
        out[rank] = None if m[2] == "cpu" else int(m[2])
    return out


def confine_path(path: str, roots: Sequence[str]) -> str:
    """The real path of ``path`` (``..`` and symlinks resolved) when it lies inside one of ``roots``.

    ``roots`` are real paths. Raises :class:`PathNotAllowedError` otherwise.

    >>> confine_path("/models/llama/../llama-v2", ["/models"])  # doctest: +SKIP
    '/models/llama-v2'
    """
    if not roots:
        raise PathNotAllowedError(
            f"model path {path!r} is refused: no allowed roots are configured; start the server with "
            f"--allow-root DIR (or {ENV_VARS['allow_roots']}=DIR) to accept model paths under DIR"
        )
    if not os.path.isabs(path):
        raise PathNotAllowedError(f"model path {path!r} is not absolute; give the full path under one of {list(roots)}")
    real = os.path.realpath(path)
    for root in roots:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return real
    # Where a link leads is not named: it may be anything of the server's (its working directory, /proc/self/...).
    shown = (
        f"{path!r} is" if real == os.path.normpath(path) else f"{path!r} resolves (through a symlink or '..') to a path"
    )
    raise PathNotAllowedError(
        f"model path {shown} outside the allowed roots {list(roots)}; move the model under one of them "
        f"or add its directory with --allow-root"
    )


@dataclass(frozen=True)
class ServeConfig:
    """How ``gdsload serve`` runs. Build with :meth:`resolve` to apply flags and the environment."""

    model_dir: str | None = None
    """Model directory loaded at start (absolute path). None: start empty and wait for ``POST /v1/reload``."""
    ranks: tuple[int, ...] | None = None
    """Tensor-parallel ranks served on this host, one worker process each; None: every rank the model holds."""
    tp: int | None = None
    """The tensor-parallel size asked for with ``--tp`` (``ranks`` is then ``0..tp-1``): the model must have been
    sharded for it. None when ``--tp`` was not given."""
    device_map: str = "auto"
    """``auto``: the i-th served rank gets the i-th visible GPU, CPU when the host has none; ``cpu``: every rank
    loads into host memory; ``RANK:GPU,...``: explicit, a GPU that cannot be used is an error, not a fallback."""
    backend: str = "auto"
    """Reader backend passed to ``load_rank`` (``auto`` tries each in order)."""
    host: str = "127.0.0.1"
    """Address the HTTP API binds. Keep loopback unless a token is set and the network is trusted."""
    port: int = 8471
    """TCP port of the HTTP API; 0 binds any free port (the log names it)."""
    token: str | None = field(default=None, repr=False)
    """Bearer token for reload, unload and IPC endpoints; None: those endpoints answer 403."""
    token_source: str | None = None
    """Where the token came from (``GDSLOAD_TOKEN`` or ``file:PATH``), for the log; never the token itself."""
    allow_roots: tuple[str, ...] = ()
    """Real paths of the directories model paths must lie in; empty: reload accepts no path at all."""
    allowed_hosts: tuple[str, ...] = ()
    """Names the HTTP ``Host`` header may carry (``*``: any); empty: the loopback names when the server binds a
    loopback address (a web page cannot reach it by DNS rebinding), else any."""
    log_format: str = "text"
    """``text`` or ``json`` (one JSON object per line) for the server and its workers."""
    log_level: str = "info"
    """Lowest level logged: debug, info, warning, error, critical."""
    restart_backoff: float = 1.0
    """Seconds before restarting a crashed worker the first time; doubles with each consecutive crash."""
    restart_backoff_max: float = 30.0
    """Upper bound of the restart delay, in seconds."""
    max_restarts: int = 5
    """Consecutive crashes of one rank's worker that are restarted; the next one leaves the rank failed."""
    stop_timeout: float = 10.0
    """Seconds a worker gets to free its memory and exit on unload, reload or SIGTERM before it is killed."""
    request_timeout: float = 10.0
    """Seconds a client may take to send a request's headers, and then its body; slower ones are cut off."""
    worker_start: str = "auto"
    """How workers start: ``forkserver`` forks them from a helper that imported their libraries when the server
    started (no CUDA in it; see :mod:`gdsload.server.forkserver`); ``spawn`` starts a fresh interpreter each;
    ``auto``: forkserver where workers load with torch, spawn for GPU workers that load without it."""
    lease_grace: float = 3.0
    """Seconds an exported IPC lease stays outstanding without an engine holding it (``GET /v1/ipc/{rank}/hold``,
    which :class:`~gdsload.loader.handoff.sidecar_client.SidecarClient` opens as soon as it has the lease);
    then it is released, so an engine that died between the export and the hold blocks no unload."""

    def __post_init__(self) -> None:
        if self.model_dir is not None and (not isinstance(self.model_dir, str) or not os.path.isabs(self.model_dir)):
            raise ConfigError(f"model_dir={self.model_dir!r} must be an absolute path")
        if self.ranks is not None:
            if (
                not isinstance(self.ranks, tuple)
                or not self.ranks
                or any(type(r) is not int or not 0 <= r <= _MAX_RANK for r in self.ranks)
                or len(set(self.ranks)) != len(self.ranks)
            ):
                raise ConfigError(f"ranks={self.ranks!r} must be a non-empty tuple of distinct ranks in 0..{_MAX_RANK}")
            if len(self.ranks) > MAX_LOCAL_RANKS:
                raise ConfigError(
                    f"ranks={_short(self.ranks)} asks this host to serve {len(self.ranks)} ranks, one worker process "
                    f"each; one host serves at most {MAX_LOCAL_RANKS} — split the ranks across hosts with --ranks "
                    f"(e.g. 0-{MAX_LOCAL_RANKS - 1} here, the rest on the next)"
                )
        if self.tp is not None and (type(self.tp) is not int or self.ranks != tuple(range(self.tp))):
            raise ConfigError(f"tp={self.tp!r} must be an integer whose ranks 0..tp-1 are the ranks served")
        dm = parse_device_map(self.device_map)
        if isinstance(dm, dict) and self.ranks is not None:
            unmapped = sorted(set(self.ranks) - set(dm))
            if unmapped:
                raise ConfigError(
                    f"device_map={self.device_map!r} does not place ranks {unmapped}; add RANK:GPU (or RANK:cpu) for each"
                )
        from ..loader.io import backend_names, is_backend

        if self.backend != "auto" and not is_backend(self.backend):
            raise ConfigError(f"backend={self.backend!r} is not known; choose one of {['auto', *backend_names()]}")
        if not isinstance(self.host, str) or not _valid_host(self.host):
            raise ConfigError(f"host={self.host!r} is not an IP address or host name; e.g. 127.0.0.1 or ::1")
        if type(self.port) is not int or not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port!r} must be an integer in 0..65535 (0: any free port)")
        if self.token is not None and (not isinstance(self.token, str) or not _TOKEN_RE.match(self.token)):
            raise ConfigError(
                f"the token from {self.token_source or 'the configuration'} is empty or holds spaces or control "
                "characters; use printable ASCII without spaces (e.g. `openssl rand -hex 32`)"
            )
        if self.token is not None and len(self.token) < MIN_TOKEN_LENGTH:
            raise ConfigError(
                f"the token from {self.token_source or 'the configuration'} has {len(self.token)} characters; use at "
                f"least {MIN_TOKEN_LENGTH} (e.g. `openssl rand -hex 32`)"
            )
        for h in self.allowed_hosts:
            if not isinstance(h, str) or not h or (h != "*" and not _valid_host(h.strip("[]"))):
                raise ConfigError(f"allowed host {h!r} is not a host name or IP address (or '*': any host)")
        for root in self.allow_roots:
            if not os.path.isabs(root) or not os.path.isdir(root):
                raise ConfigError(f"allow_root {root!r} is not an existing directory; create it or fix the path")
        if self.allow_roots and self.model_dir is not None:
            try:
                confine_path(self.model_dir, self.allow_roots)
            except PathNotAllowedError as e:
                raise ConfigError(f"MODEL_DIR contradicts --allow-root: {e}") from None
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format={self.log_format!r} must be one of {LOG_FORMATS}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level={self.log_level!r} must be one of {LOG_LEVELS}")
        if not _is_number(self.restart_backoff) or not 0 < self.restart_backoff <= 3600:
            raise ConfigError(f"restart_backoff={self.restart_backoff!r} must be a number of seconds in (0, 3600]")
        if not _is_number(self.restart_backoff_max) or not self.restart_backoff <= self.restart_backoff_max <= 3600:
            raise ConfigError(
                f"restart_backoff_max={self.restart_backoff_max!r} must be seconds between restart_backoff "
                f"({self.restart_backoff!r}) and 3600"
            )
        if type(self.max_restarts) is not int or not 0 <= self.max_restarts <= 1000:
            raise ConfigError(f"max_restarts={self.max_restarts!r} must be an integer in 0..1000 (0: never restart)")
        if not _is_number(self.stop_timeout) or not 0.1 <= self.stop_timeout <= 600:
            raise ConfigError(f"stop_timeout={self.stop_timeout!r} must be a number of seconds in 0.1..600")
        if not _is_number(self.request_timeout) or not 0.1 <= self.request_timeout <= 600:
            raise ConfigError(f"request_timeout={self.request_timeout!r} must be a number of seconds in 0.1..600")
        if not _is_number(self.lease_grace) or not 0.1 <= self.lease_grace <= 3600:
            raise ConfigError(f"lease_grace={self.lease_grace!r} must be a number of seconds in 0.1..3600")
        from .forkserver import START_METHODS

        if self.worker_start not in START_METHODS:
            raise ConfigError(f"worker_start={self.worker_start!r} must be one of {START_METHODS}")

    @property
    def is_loopback(self) -> bool:
        """True when :attr:`host` is a loopback address (or ``localhost``)."""
        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def http_hosts(self) -> tuple[str, ...]:
        """The ``Host`` header values the API answers (``*``: any); see ``allowed_hosts``."""
        if self.allowed_hosts:
            return self.allowed_hosts
        try:
            loopback = ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = self.host == "localhost"
        return ("127.0.0.1", "localhost", "::1") if loopback else ("*",)

    def public_dict(self) -> dict[str, Any]:
        """Every setting except the token, for ``/v1/status`` and the start-up log."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "token"}
        out["ranks"] = list(self.ranks) if self.ranks is not None else None
        out["allow_roots"] = list(self.allow_roots)
        out["allowed_hosts"] = list(self.http_hosts())
        out["auth"] = "token" if self.token else "none"
        return out

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **flags: Any) -> ServeConfig:
        """Defaults, then ``GDSLOAD_*`` from ``env`` (default ``os.environ``), then flags that are not None.

        Flags: the names in :data:`ENV_VARS` (``tp``, ``token_file`` and ``allow_roots`` included);
        ``ranks`` is a string like ``"0-7"``; ``allow_roots`` a sequence of paths (empty means unset).
        """
        env = os.environ if env is None else env
        unknown = set(flags) - set(ENV_VARS)
        if unknown:
            raise TypeError(f"unknown serve option(s) {sorted(unknown)}; known: {sorted(ENV_VARS)}")
        given = {
            k: v for k, v in flags.items() if v is not None and not (k in ("allow_roots", "allowed_hosts") and not v)
        }
        raw: dict[str, Any] = {k: env[var] for k, var in ENV_VARS.items() if var in env and k not in given}
        if "ranks" in given or "tp" in given:  # one setting: a flag for either hides the environment's
            raw.pop("ranks", None)
            raw.pop("tp", None)
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}
        for key, value in {**raw, **given}.items():
            origin = "--" + key.replace("_", "-") if key in given else ENV_VARS[key]
            if key == "model_dir" and isinstance(value, str) and not value.strip():
                raise ConfigError(f"{origin} is empty; give the model directory, or unset it to start without a model")
            values[key] = _convert(key, value, origin)
            origins[key] = origin
        if "restart_backoff" in values and "restart_backoff_max" not in values:
            # A first delay above the default ceiling raises the ceiling with it, rather than blaming a setting
            # nobody gave.
            values["restart_backoff_max"] = max(cls.restart_backoff_max, values["restart_backoff"])

        if "ranks" in values and "tp" in values:
            raise ConfigError("give either --ranks or --tp (GDSLOAD_RANKS or GDSLOAD_TP), not both")
        if "tp" in values:
            values["ranks"] = tuple(range(values["tp"]))
        if "model_dir" in values:
            values["model_dir"] = os.path.abspath(values["model_dir"])
        if "allow_roots" in values:
            values["allow_roots"] = tuple(dict.fromkeys(os.path.realpath(r) for r in values["allow_roots"]))
        token_file = values.pop("token_file", None)
        if token_file is not None:
            values["token"] = _read_token_file(token_file)
            values["token_source"] = f"file:{os.path.abspath(token_file)}"
        elif TOKEN_ENV in env:
            values["token"] = env[TOKEN_ENV].strip()
            values["token_source"] = TOKEN_ENV
        try:
            return cls(**values)
        except ConfigError as e:  # name the flag or variable the value came from
            origin = next((o for k, o in origins.items() if str(e).startswith(f"{k}=")), None)
            if origin is None and "tp" in origins and str(e).startswith("ranks="):
                origin = origins["tp"]
            if origin is None:
                raise
            raise ConfigError(f"{origin}: {e}") from None


def _short(ranks: Sequence[int]) -> str:
    return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 4 else repr(ranks)


def _is_number(x: object) -> bool:
    return type(x) in (int, float) and x == x  # not NaN


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOSTNAME_RE.match(host))


def _convert(key: str, value: Any, origin: str) -> Any:
    """Turn a flag or environment value into the field's type; errors name where the value came from."""
    try:
        if key == "ranks":
            if isinstance(value, str):
                return parse_ranks(value, what=origin)
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{origin}={value!r} must be a string like '0-7' or a sequence of ranks")
            return tuple(value)
        if key in ("tp", "port", "max_restarts"):
            if isinstance(value, str):
                value = int(value.strip())
            if key == "tp" and (type(value) is not int or not 1 <= value <= _MAX_RANK + 1):
                raise ConfigError(f"{origin}={value!r} must be an integer in 1..{_MAX_RANK + 1}")
            return value
        if key in ("restart_backoff", "restart_backoff_max", "stop_timeout", "request_timeout", "lease_grace"):
            return float(value.strip()) if isinstance(value, str) else value
        if key == "allow_roots":
            parts = value.split(os.pathsep) if isinstance(value, str) else list(value)
            return tuple(p.strip() for p in parts if p.strip())
        if key == "allowed_hosts":
            parts = value.split(",") if isinstance(value, str) else list(value)
            return tuple(dict.fromkeys(p.strip().lower() for p in parts if p.strip()))
        if key in ("log_format", "log_level", "device_map", "backend", "host", "worker_start"):
            return value.strip().lower() if key != "host" else value.strip()
        return value
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{origin}={value!r} is not a valid {key.replace('_', ' ')} ({e})") from None


def _read_token_file(path: str) -> str:
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except FileNotFoundError:
        raise ConfigError(
            f"token file {path!r} does not exist; write the token into it (e.g. `openssl rand -hex 32 > {path}`)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"token file {path!r} cannot be read ({e})") from None
    if not token:
        raise ConfigError(
            f"token file {path!r} is empty; write the token into it (e.g. `openssl rand -hex 32 > {path}`)"
        )
    if stat.S_IMODE(st.st_mode) & 0o007:  # group access is how Kubernetes Secrets (fsGroup) are shared; others is not
        log.warning(
            "token file %r is accessible to every user (mode %o); chmod o-rwx it", path, stat.S_IMODE(st.st_mode)
        )
    return token


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message``, ``pid`` (and ``rank``, ``exc``).

    >>> logging.getLogger().handlers[0].setFormatter(JsonFormatter())  # doctest: +SKIP
    """

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        rank = getattr(record, "rank", None)
        if rank is not None:
            doc["rank"] = rank
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def configure_logging(log_format: str, log_level: str, *, rank: int | None = None) -> None:
    """Send every log record to stderr in ``text`` or ``json``; workers pass their ``rank``.

    >>> configure_logging("json", "info")  # doctest: +SKIP
    """
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        where = f" [rank {rank}]" if rank is not None else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s"))
    if rank is not None:
        handler.addFilter(_RankFilter(rank))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(log_level.upper())
