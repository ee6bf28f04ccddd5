"""Progress of long commands on stderr: a rich bar on a terminal, a plain line every few seconds otherwise.

Log collectors (CI, ``kubectl logs``, systemd) get readable lines instead of redrawn bars:
``shard: 2.41 GB of 9.08 GB (26%), 1.21 GB/s, 5.5 s left``.

>>> with progress_bar("compress", total=10 << 30, enabled=True) as advance:  # doctest: +SKIP
...     advance(1 << 30)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..loader.config import format_bytes

__all__ = ["progress_bar"]

PLAIN_EVERY_S = 5.0
"""Seconds between plain progress lines."""


@contextmanager
def progress_bar(label: str, total: int, *, enabled: bool | None = None) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(nbytes)``; shows progress on stderr while the block runs.

    ``enabled``: True or False as the user asked (``--progress/--no-progress``); None shows it unless stderr is
    not a terminal *and* the work is small. On a terminal: a rich bar; elsewhere: a line every
    :data:`PLAIN_EVERY_S` seconds and one at the end.
    """
    if enabled is False:
        yield lambda n: None
        return
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with Progress(
            TextColumn(f"[bold]{label}[/]"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as bar:
            task = bar.add_task(label, total=total)
            yield lambda n: bar.advance(task, n)
        return
    start = last = time.monotonic()
    done = 0

    def line(final: bool = False) -> None:
        elapsed = max(time.monotonic() - start, 1e-9)
        rate = done / elapsed
        pct = f" ({100 * done / total:.0f}%)" if total else ""
        left = f", {(total - done) / rate:.1f} s left" if rate > 0 and total > done and not final else ""
        end = f" in {elapsed:.1f} s" if final else ""
        print(
            f"{label}: {format_bytes(done)} of {format_bytes(total)}{pct}, {format_bytes(rate)}/s{left}{end}",
            file=sys.stderr,
            flush=True,
        )

    def advance(n: int) -> None:
        nonlocal done, last
        done += n
        now = time.monotonic()
        if now - last >= PLAIN_EVERY_S:
            last = now
            line()

    yield advance
    if enabled or time.monotonic() - start >= 1.0:
        line(final=True)
