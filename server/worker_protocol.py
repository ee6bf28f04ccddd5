"""What a sidecar and its worker processes share: the worker's spec, the messages, exit statuses, errors.

Parent and worker talk over one duplex pipe of ``(kind, payload)`` messages. The parent's side is
:class:`gdsload.server.workers.WorkerHandle`, the worker's :mod:`gdsload.server.worker_main`; both import
this module and neither the other (the parent starts the worker by name).

worker -> parent: ``hello`` (pid, device, start-up marks), ``loading`` (files, byte totals), ``progress``
(bytes read so far, at most every :data:`PROGRESS_INTERVAL_S`), ``ready`` (the load report),
``failed`` (the typed error), ``reply`` (to a command).

parent -> worker: ``export`` (IPC document of the rank, see :mod:`gdsload.loader.handoff.ipc`),
``release`` (an engine is done with an export), ``unload`` (free everything and exit).

A worker whose load fails reports the error and exits with :data:`EXIT_LOAD_FAILED`; a worker
that loses its parent exits at once. SIGTERM does not end a worker on its own while the server lives:
a SIGTERM to the whole process group (as Kubernetes and systemd send it) reaches the server too, which
stops its workers in order; once asked to unload, SIGTERM ends the worker at once.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from ..loader.errors import GdsloadError

__all__ = [
    "WorkerSpec",
    "GpuUnavailableError",
    "RankNotReadyError",
    "WorkerStartError",
    "error_doc",
    "describe_exit",
    "EXIT_LOAD_FAILED",
    "EXIT_UNKNOWN",
    "PROGRESS_INTERVAL_S",
    "SIGTERM_GRACE_S",
]

EXIT_LOAD_FAILED = 3
"""Exit status of a worker whose load raised (the error was reported first)."""
EXIT_UNKNOWN = 255
"""What ``multiprocessing`` reports for a forked worker whose fork server died before it could tell the
status (workers themselves exit with 0, :data:`EXIT_LOAD_FAILED`, 1 on an uncaught error, or by a signal)."""
PROGRESS_INTERVAL_S = 0.2
"""Fewest seconds between two progress messages of one worker."""
SIGTERM_GRACE_S = 15.0
"""Seconds (beyond the server's graceful shutdown and ``stop_timeout``) a worker that got SIGTERM while its
server lives waits to be stopped in order before it exits by itself (status 143)."""


class GpuUnavailableError(GdsloadError, RuntimeError):
    """A rank was mapped to a GPU explicitly, but its worker cannot use CUDA."""


class RankNotReadyError(GdsloadError, RuntimeError):
    """The rank has no loaded tensors (still loading, failed, or restarting)."""


class WorkerStartError(GdsloadError, RuntimeError):
    """A worker process cannot use its GPU because of how it was started (see the message for the fix)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker loads and where; picklable, sent to the child at spawn."""

    rank: int
    model_dir: str
    """Real path of the model directory."""
    backend: str
    cuda_visible_devices: str
    """The child's ``CUDA_VISIBLE_DEVICES``: one GPU (index or UUID), or ``""`` for a host-memory load."""
    gpu_explicit: bool
    """The GPU came from an explicit ``--device-map``: failing to use it is an error, not a CPU fallback."""
    generation: int = 0
    log_format: str = "text"
    log_level: str = "info"
    confine: tuple[str, ...] = ()
    """Directories every file the worker opens must stay in, checked at the open (the allowed roots, or the
    model directory itself)."""
    stop_timeout: float = 10.0
    """The server's ``stop_timeout``: a worker that got SIGTERM waits this long and more for the server to stop
    it in order (see :data:`SIGTERM_GRACE_S`)."""


def error_doc(exc: BaseException) -> dict[str, str]:
    """``{"type": ..., "message": ...}`` of an exception, as the status API shows it."""
    return {"type": type(exc).__name__, "message": str(exc) or repr(exc)}


def describe_exit(exitcode: int | None) -> str:
    """``-9`` -> ``'was killed by SIGKILL'``."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"
