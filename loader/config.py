"""Sizes and booleans as people write them, parsed one way everywhere (``16MiB``, ``5GB``, ``yes``), the
cores this process may use, and Python's garbage collector held off while a load runs.

The load options themselves are :class:`gdsload.loader.pipeline.config.LoadConfig`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import threading
from collections.abc import Iterator

from .errors import ConfigError

__all__ = ["parse_size", "format_bytes", "parse_bool", "usable_cores", "gc_paused"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)


def parse_size(value: str | int, *, what: str = "size") -> int:
    """``"16MiB"`` -> 16777216; plain integers are bytes. Decimal (MB) and binary (MiB) units."""
    if type(value) is int and value >= 0:
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    unit = m[2].lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(
            f"{what} {value!r} is not a size; write bytes or a number with a unit like 16MiB, 5GiB, 500MB"
        )
    from fractions import Fraction  # here: a load that parses no size never imports it

    return int(Fraction(m[1]) * _UNITS[unit])  # exact: 2.01GB is 2010000000 bytes, not one byte fewer


def format_bytes(n: float) -> str:
    """1073741824 -> '1.07 GB' (decimal units, as throughput is quoted in GB/s)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def parse_bool(value: str, what: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{what}={value!r} is not a boolean; use 0/1, true/false or yes/no")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity on Linux, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_PAUSES = 0
_RESUME = False
_FORKS = 0
"""Forks into this process: a block entered before the last one is not counted in ``_PAUSES`` here."""
_PAUSE_LOCK = threading.Lock()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector for the block; it is on again afterwards if it was before.

    A load makes thousands of small objects without cycles (headers, extents, placements, tensor views). In a
    process that has imported torch (which holds a great many objects), they set off full collections that find
    nothing and cost tens of milliseconds each.
    Blocks may nest and run on several threads at once: the last one out turns the collector back on. The
    collector is the process's: other threads' objects wait for it too while a block runs. A child forked
    inside a block starts with the collector as it was before the first block.
    """
    global _PAUSES, _RESUME
    entered = None  # the fork count when this block was counted
    try:
        with _PAUSE_LOCK:
            if _PAUSES == 0:
                _RESUME = gc.isenabled()
                gc.disable()
            _PAUSES += 1
            entered = _FORKS
        yield
    finally:
        if entered == _FORKS:
            with _PAUSE_LOCK:
                _PAUSES -= 1
                if _PAUSES == 0 and _RESUME:
                    gc.enable()


def _unpause_in_child() -> None:
    """A forked child starts with no block counted: the parent's other threads are not there to end theirs, and
    a block the forking thread is in ends uncounted."""
    global _PAUSES, _PAUSE_LOCK, _FORKS
    _PAUSE_LOCK = threading.Lock()
    _FORKS += 1
    if _PAUSES:
        _PAUSES = 0
        if _RESUME:
            gc.enable()


os.register_at_fork(after_in_child=_unpause_in_child)
