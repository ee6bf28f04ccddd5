"""SIGTERM for one-shot commands: end them as Ctrl-C does, so their clean-up runs.

Python's default SIGTERM ends the process without running ``finally`` blocks or ``with`` exits:
a ``gdsload compress`` or ``shard`` stopped by ``timeout``, a batch scheduler or Kubernetes would
leave its half-written output, and the bench its tmpfs copies and ``gdsload serve`` children.
``gdsload serve`` handles SIGTERM itself (an orderly stop of its workers), so it does not use this.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["stop_on_sigterm"]


def stop_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit(143)`` in the main thread (no effect from another thread)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit)


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
