"""Page-cache residency (mincore) and eviction: decides O_DIRECT, and keeps cold benchmarks honest."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable


__all__ = ["evict", "resident_fraction", "is_cold", "COLD_RESIDENCY", "RESIDENCY_SAMPLES", "MEMORY_FILESYSTEMS"]

COLD_RESIDENCY = 0.5
"""Files with less than this fraction of their pages cached count as cold: read with O_DIRECT."""
RESIDENCY_SAMPLES = 256
"""Windows of pages probed per file to estimate residency (a full ``mincore`` scan costs about 0.1 s
per 9 GB on tmpfs, a third of a load from there)."""

_libc = ctypes.CDLL(None, use_errno=True)  # the C library the process already has (find_library runs ldconfig)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_RESIDENT_BIT = bytes(b & 1 for b in range(256))
"""Each byte ``mincore`` writes, as its lowest bit (the page is resident; the other bits are reserved)."""


def evict(paths: Iterable[str]) -> str:
    """Drop the files from the page cache; returns how: ``drop_caches`` (as root) or ``fadvise``."""
    paths = list(paths)
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        how = "drop_caches"
    except OSError:
        how = "fadvise"
    for p in paths:  # also per file: drop_caches can be a no-op inside containers
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return how


def resident_fraction(paths: Iterable[str], *, samples: int | None = None, window_pages: int = 16) -> float:
    """Fraction of the files' pages that are in the page cache (``mincore``).

    With ``samples``, each file larger than ``samples * window_pages`` pages is probed at
    ``samples`` evenly spaced windows of ``window_pages`` pages instead of page by page: an
    estimate in microseconds, where the exact count takes time in proportion to the file's size.
    """
    page = mmap.PAGESIZE
    total = resident = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        pages = (size + page - 1) // page
        if samples is not None and pages > samples * window_pages:
            starts = [(k * pages // samples) for k in range(samples)]
            spans = [(s * page, min(window_pages, pages - s)) for s in starts]
        else:
            spans = [(0, pages)]
        seen = probed = 0
        fd = os.open(p, os.O_RDONLY)
        try:
            base = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)  # the mapping keeps the file
        if base in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap failed on {p!r}: {os.strerror(err)}")
        try:
            for offset, n in spans:
                vec = (ctypes.c_ubyte * n)()
                if _libc.mincore(base + offset, min(n * page, size - offset), vec) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"mincore failed on {p!r}: {os.strerror(err)}")
                seen += bytes(vec).translate(_RESIDENT_BIT).count(1)
                probed += n
        finally:
            _libc.munmap(base, size)
        # Each file weighs by its size, however few of its pages were probed.
        resident += pages * seen / probed
        total += pages
    return resident / total if total else 1.0


MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
"""File systems whose files live in memory: never cold, so :func:`is_cold` does not probe them."""


def is_cold(*paths: str) -> bool:
    """Whether too little of these files is cached for page-cache reads to pay (sampled ``mincore``,
    weighted by size: a small file that reading the headers pulled in does not make a rank warm).

    Files on a memory file system are never cold, and are not probed (about 8 ms per 9 GB, 4 % of a
    load from tmpfs).
    """
    from .iomode import mount_of  # here: importing it costs about half a millisecond

    if paths and all(mount_of(p)[1] in MEMORY_FILESYSTEMS for p in paths):
        return False
    return resident_fraction(paths, samples=RESIDENCY_SAMPLES) < COLD_RESIDENCY
