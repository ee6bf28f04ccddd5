"""What the supervisor keeps per rank, and the documents ``/v1/status`` builds from it.

A rank is ``pending`` (worker starting) -> ``loading`` -> ``ready``, or ``failed``. ``/v1/status``
answers every detail to a request that carries the bearer token (pids, devices, files, error messages,
leases and their holders, the configuration); without the token it shows states, phases, byte counts
and timings only (:func:`public_status`), nothing that names a process, a path or a lease.

>>> public_status(supervisor.status())["ranks"]["0"]["state"]  # doctest: +SKIP
'ready'
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .workers import WorkerHandle

__all__ = ["RankState", "RankRecord", "Retiring", "rank_doc", "public_status", "PUBLIC_RANK_FIELDS"]


class RankState(str, enum.Enum):
    PENDING = "pending"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class RankRecord:
    """One served rank: its worker, its load's progress and report, its IPC leases."""

    rank: int
    cuda_visible_devices: str
    gpu_explicit: bool
    files: list[str] = field(default_factory=list)
    state: RankState = RankState.PENDING
    handle: WorkerHandle | None = None
    pid: int | None = None
    device: str | None = None
    gpu: dict[str, Any] | None = None
    stored_bytes: int = 0
    logical_bytes: int = 0
    bytes_done: int = 0
    report: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    last_error: dict[str, str] | None = None
    error_reported: bool = False
    """The worker reported its load error: its exit is expected and not restarted."""
    consecutive_crashes: int = 0
    next_restart_at: float | None = None
    started_at: float | None = None
    ready_at: float | None = None
    loaded_at: float | None = None
    """When the worker's load returned, ``time.time()`` taken in the worker (``ready_at`` is when this process
    read the message)."""
    entered_at: float | None = None
    """When the worker process reached its entry point (forked or interpreter started), taken in the worker."""
    imported_at: float | None = None
    """When the worker had imported its GPU library, taken in the worker (None for host-memory ranks)."""
    cuda_ready_at: float | None = None
    """When the worker's CUDA context was usable, taken in the worker (None for host-memory ranks)."""
    leases: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Outstanding IPC exports: lease -> when it was exported (``time.monotonic()``, ``time.time()``)."""
    holders: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Leases an engine holds (its hold connection is open): lease -> ``{"lease", "pid", "peer", "since"}``,
    what the engine said about itself and where it connected from."""
    pending: dict[str, tuple[Future[Any], str | None]] = field(default_factory=dict)
    start_wanted: bool = False
    """A worker is to be started (once no old worker is still stopping)."""
    starting: bool = False
    """A worker start is under way (on a thread of its own)."""


@dataclass
class Retiring:
    """A worker asked to stop: SIGTERM at ``term_at``, SIGKILL at ``kill_at`` (monotonic) if it has not exited."""

    handle: WorkerHandle
    term_at: float
    kill_at: float
    signalled: int = 0


def rank_doc(x: RankRecord, now: float, restarts: int, failures: int) -> dict[str, Any]:
    """Everything about one rank, as ``/v1/status`` answers it with the token (``now``: ``time.monotonic()``)."""
    report = x.report or {}
    files = report.get("files") or []
    return {
        "rank": x.rank,
        "state": x.state.value,
        "pid": x.pid,
        "device": x.device,
        "gpu": x.gpu,
        "cuda_visible_devices": x.cuda_visible_devices,
        "backend": report.get("backend"),
        "io_mode": ",".join(sorted({f["io_mode"] for f in files})) or None,
        "files": x.files,
        "logical_bytes": x.logical_bytes,
        "stored_bytes": x.stored_bytes,
        "bytes_done": x.bytes_done,
        "phases": report.get("phases", {}),
        "seconds": report.get("seconds"),
        "gbps": report.get("gbps"),
        "verified": report.get("verified"),
        "error": x.error,
        "last_error": x.last_error,
        "restarts": restarts,
        "failures": failures,
        "next_restart_in_s": max(0.0, x.next_restart_at - now) if x.next_restart_at is not None else None,
        "started_at": x.started_at,
        "ready_at": x.ready_at,
        "entered_at": x.entered_at,
        "imported_at": x.imported_at,
        "cuda_ready_at": x.cuda_ready_at,
        "loaded_at": x.loaded_at,
        "leases": len(x.leases),
        "held_by": sorted(x.holders.values(), key=lambda h: h["since"]),
        "lease_table": [
            {"lease": lease, "age_s": round(now - mono, 3), "exported_at": wall, "held_by": x.holders.get(lease)}
            for lease, (mono, wall) in sorted(x.leases.items(), key=lambda kv: kv[1][0])
        ],
        "report": x.report,
    }


PUBLIC_RANK_FIELDS = (
    "rank",
    "state",
    "device",
    "backend",
    "io_mode",
    "logical_bytes",
    "stored_bytes",
    "bytes_done",
    "phases",
    "seconds",
    "gbps",
    "verified",
    "restarts",
    "failures",
    "next_restart_in_s",
    "started_at",
    "entered_at",
    "imported_at",
    "cuda_ready_at",
    "loaded_at",
    "ready_at",
    "leases",
)
"""What ``/v1/status`` shows of a rank without the token (plus the type of its error)."""
_PUBLIC_FIELDS = (
    "version",
    "state",
    "ready",
    "generation",
    "load",
    "stopping_workers",
    "leases",
    "failures_total",
    "restarts_total",
    "worker_start",
)


def _error_type(error: dict[str, str] | None) -> dict[str, str] | None:
    return {"type": error["type"]} if error else None


def public_status(doc: dict[str, Any]) -> dict[str, Any]:
    """The part of a full ``/v1/status`` document anyone who reaches the port may read: states, phases, byte
    counts and timings; no pid, path, device identity, error message, lease or configuration."""
    out = {k: doc[k] for k in _PUBLIC_FIELDS}
    out["error"] = _error_type(doc["error"])
    out["process"] = {k: doc["process"][k] for k in ("started_at", "uptime_s", "time_to_ready_s")}
    out["ranks"] = {
        key: {**{k: r[k] for k in PUBLIC_RANK_FIELDS}, "error": _error_type(r["error"])}
        for key, r in doc["ranks"].items()
    }
    out["detail"] = "pids, paths, devices, error messages, leases and the configuration: send the bearer token"
    return out
