"""gdsload.bench: cold-start and peer benchmarks. Depends on the loader; never imported by it."""

from __future__ import annotations

import signal
import threading

__all__ = ["stop_on_sigterm"]


def stop_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, a batch scheduler, Kubernetes) end the bench as Ctrl-C does.

    Python's default SIGTERM ends the process without running ``finally`` blocks, which would
    leave the bench's tmpfs copies on disk and its ``gdsload serve`` children running. Raising
    ``SystemExit`` instead unwinds through them. No effect outside the main thread.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit)


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
