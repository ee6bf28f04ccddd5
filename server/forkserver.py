"""Where worker processes come from: a fork server that has imported their libraries once.

A GPU worker needs a cold rank's reader (fastsafetensors' where installed, else kvikio and the numpy it
imports; kvikio also wherever GPUDirect Storage may run) and nvCOMP for a compressed rank (a cached
uncompressed rank needs neither); a worker that loads with torch needs torch. A fresh interpreter spends a
few hundred milliseconds (GPU) or 2-6 s (torch) importing them. With the
``forkserver`` start method, one helper process imports them as soon as ``serve`` starts, and each
worker is a fork of it: it starts in milliseconds, every rank at the same moment, and again at once
on reload and restart. With ``spawn`` each worker is a fresh interpreter that imports for itself.

The trade: a forked GPU worker still has to make its CUDA context (about 0.5 s), and it can only
start after the helper's imports; a spawned one makes its context on a thread while it imports, so
the import hides it. On two H200s, torch-free GPU workers were ready sooner spawned (1.33-1.47 s
against 1.87-2.17 s), while forked ones loaded all at once and reloaded sooner (0.93-0.96 s against
1.16-1.24 s). Where workers import torch, the
import dwarfs the context, and the fork server wins outright. ``auto`` (the default) picks by that:
:func:`resolve`.

Two rules keep the fork safe:

- nothing initialises CUDA before the fork (a child cannot use a context its parent made). The helper
  only imports, and none of these libraries initialises CUDA on import; :func:`preload` checks it
  afterwards, and a worker forked from a helper that did initialise CUDA refuses to load;
- each worker sees only its GPU: it sets its own ``CUDA_VISIBLE_DEVICES`` before it makes a context
  (the driver reads the variable then, not at import).

>>> start("forkserver", gpu=True)  # in the server, before its first worker  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import threading
import time
from typing import Any

__all__ = [
    "START_METHODS",
    "GPU_MODULES",
    "FST_MODULES",
    "KVIKIO_MODULES",
    "TORCH_MODULES",
    "STATE",
    "context",
    "resolve",
    "start",
    "preload",
    "gpu_modules",
    "preload_modules",
    "inherited_problem",
]

log = logging.getLogger(__name__)

START_METHODS = ("auto", "forkserver", "spawn")
"""How worker processes start: ``auto`` (see :func:`resolve`), forked from a helper with the libraries
imported, or a fresh interpreter."""

GPU_MODULES = (
    "nvidia.nvcomp",
    "gdsload.loader.devices",
    "gdsload.loader.pipeline.load",
    "gdsload.loader.pipeline.decode",
    "gdsload.server.workers",
    "gdsload.server.worker_main",
)
"""What every GPU worker on the torch-free path may import (a :class:`~gdsload.loader.devices.DriverDevice`
load); :func:`gpu_modules` adds the cold reader this host will use."""
FST_MODULES = ("fastsafetensors", "gdsload.loader.io.fst_reader")
"""fastsafetensors' reader, which reads a cold rank where it is installed and GPUDirect Storage is not possible."""
KVIKIO_MODULES = ("numpy", "kvikio")
"""kvikio, which reads a cold rank otherwise, and every read where GPUDirect Storage may run."""
TORCH_MODULES = (
    "numpy",
    "torch",
    "safetensors",
    "gdsload.loader.pipeline.load",
    "gdsload.loader.pipeline.decode",
    "gdsload.loader.io.cpu",
    "gdsload.server.workers",
    "gdsload.server.worker_main",
)
"""What a worker that loads with ``load_rank`` imports (host-memory ranks, or a backend only torch runs)."""

STATE: dict[str, Any] = {}
"""Filled by :func:`preload` in the helper, so every forked worker inherits it; empty in a spawned worker.

``modules``: name -> seconds to import, or the error; ``cuda_initialised``: True, False, or None
(no CUDA driver here); ``threads``: the helper's threads after its imports (numpy's OpenBLAS starts
some and rebuilds them in a fork; a library whose pool did not would hang its forks); ``seconds``:
the whole preload. Workers send it to the server, and ``/v1/status`` shows it.
"""

_CUDA_ERROR_NOT_INITIALIZED = 3


def preload(names: tuple[str, ...]) -> None:
    """Import ``names`` (each failure recorded, none raised), then check that CUDA is still uninitialised.

    Runs in the fork server, through the one-line modules ``preload_gpu`` and ``preload_torch``;
    a library that is missing here is imported (and its absence reported) by the worker itself.
    The fork server also ignores SIGTERM from here on: a SIGTERM to the whole process group (Kubernetes,
    systemd, ``kill -- -PGID``) reaches it with the server, and it must outlive the server's orderly stop
    of its workers; it leaves when the server closes its end of multiprocessing's pipe to it.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    t0 = time.perf_counter()
    modules: dict[str, Any] = STATE.setdefault("modules", {})
    for name in names:
        if name in modules:
            continue
        t = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or a CUDA library that fails to load: the worker will say
            modules[name] = f"{type(e).__name__}: {e}"
        else:
            modules[name] = round(time.perf_counter() - t, 4)
    STATE["cuda_initialised"] = _cuda_initialised()
    STATE["threads"] = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
    STATE["seconds"] = round(STATE.get("seconds", 0.0) + time.perf_counter() - t0, 4)


def gpu_modules() -> tuple[str, ...]:
    """The GPU worker's preload list on this host: :data:`GPU_MODULES` and the cold reader a load will pick
    (fastsafetensors' where it is installed and GPUDirect Storage is not possible, else kvikio); neither
    library is imported to decide."""
    import importlib.util

    from ..loader.io.cufile import _gds_possible

    gds = _gds_possible()
    fst = importlib.util.find_spec("fastsafetensors") is not None
    return GPU_MODULES + (FST_MODULES if fst else ()) + (KVIKIO_MODULES if gds or not fst else ())


def _cuda_initialised() -> bool | None:
    """Whether ``cuInit`` has run in this process (None: no CUDA driver). Asking does not initialise it."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int()
    return cuda.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED


def inherited_problem() -> str | None:
    """Why this worker cannot use CUDA after its fork (None when it can, or when it was spawned)."""
    if STATE.get("cuda_initialised"):
        return (
            "the worker fork server initialised CUDA while importing "
            f"{sorted(n for n, v in STATE['modules'].items() if not isinstance(v, str))}, so its forks "
            "cannot use the GPU; start workers with --worker-start spawn (GDSLOAD_WORKER_START=spawn) and "
            "report the library versions"
        )
    return None


def preload_modules(gpu: bool, torch: bool) -> list[str]:
    """The fork server's preload list: the modules whose import runs :func:`preload` for each kind of worker."""
    out = []
    if gpu:
        out.append("gdsload.server.preload_gpu")
    if torch:
        out.append("gdsload.server.preload_torch")
    return out


def resolve(method: str, *, torch: bool) -> str:
    """``auto`` -> ``forkserver`` where some worker loads with torch, else ``spawn``; other methods as given.

    >>> resolve("auto", torch=False)
    'spawn'
    """
    if method == "auto":
        return "forkserver" if torch else "spawn"
    return method


def context(method: str) -> multiprocessing.context.BaseContext:
    """The ``multiprocessing`` context that starts workers by ``method``: ``forkserver`` or ``spawn``."""
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"worker start method {method!r} is not 'forkserver' or 'spawn'")
    return multiprocessing.get_context(method)


def start(method: str, *, gpu: bool, torch: bool = False) -> None:
    """Start the fork server now (``method`` resolved; no-op for ``spawn``), so its imports overlap the
    server's own start-up.

    ``gpu``: preload the GPU worker's libraries; ``torch``: preload torch. The helper is started once
    per process and keeps the list it started with (a worker imports what it lacks itself); should it
    die, the next worker start launches a new one with the latest list. Returns at once: the helper
    imports in the background, and the first worker start waits for it (a helper that hangs in its
    imports would hold that start; the worker's imports are the same ones a spawned worker makes).
    """
    if method != "forkserver":
        return
    ctx = context(method)
    ctx.set_forkserver_preload(preload_modules(gpu, torch))
    t = time.perf_counter()
    multiprocessing.forkserver.ensure_running()
    log.debug("worker fork server started in %.3f s (preload: gpu=%s torch=%s)", time.perf_counter() - t, gpu, torch)
