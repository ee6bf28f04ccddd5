"""How a server's workers start: whether they need torch, by which method, and the fork server's start.

The decision is made once, from the configuration and what is installed (nothing is imported): a GPU
rank loads without torch where :func:`~gdsload.loader.devices.torch_free_unavailable` allows it; host
ranks and backends that only torch runs load with torch. :func:`gdsload.server.forkserver.resolve`
turns that into ``forkserver`` or ``spawn`` for ``--worker-start auto``.
"""

from __future__ import annotations

from . import forkserver
from .settings import ServeConfig, parse_device_map
from .workers import visible_gpus

__all__ = ["worker_imports", "worker_start_method", "start_worker_server"]


def worker_imports(config: ServeConfig) -> tuple[bool, bool]:
    """``(gpu, torch)``: whether this host's workers may load on a GPU without torch, and whether some may
    load with torch (a host-memory rank, a backend the torch-free path does not run, or no kvikio)."""
    from ..loader.devices import torch_free_unavailable

    dm = parse_device_map(config.device_map)
    gpu = bool(visible_gpus()) and dm != "cpu" and not (isinstance(dm, dict) and all(g is None for g in dm.values()))
    torch_free = torch_free_unavailable(config.backend, probe=False) is None
    torch = not gpu or not torch_free or (isinstance(dm, dict) and any(g is None for g in dm.values()))
    return gpu, torch


def worker_start_method(config: ServeConfig) -> str:
    """``config.worker_start`` with ``auto`` resolved for this host (:func:`gdsload.server.forkserver.resolve`)."""
    return forkserver.resolve(config.worker_start, torch=worker_imports(config)[1])


def start_worker_server(config: ServeConfig) -> None:
    """Start the worker fork server, if this host's workers start by fork, preloading what they import.

    Called at start-up right after the socket is bound, so those imports overlap the server's own.
    """
    gpu, torch = worker_imports(config)
    if forkserver.resolve(config.worker_start, torch=torch) == "forkserver":
        forkserver.start("forkserver", gpu=gpu, torch=torch)
