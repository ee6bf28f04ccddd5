"""Worker processes: one per served rank, each loading its rank and keeping the tensors resident.

A worker is never a fork of the server (the server runs threads and an event loop). It is either a
fork of the worker fork server, which has imported the worker's libraries and never touched CUDA, or
a fresh interpreter (spawn); ``--worker-start`` chooses, and ``auto`` forks where workers import
torch (:mod:`gdsload.server.forkserver`). It sees
only its own GPU: ``CUDA_VISIBLE_DEVICES`` is set in the worker before anything makes a CUDA
context (and, for spawn, in the environment it starts with), so CUDA (and cuFile) never opens a
context on any other device. A worker with no GPU loads into host memory.

The messages, the spec and the exit statuses both sides share are in
:mod:`gdsload.server.worker_protocol`; this module is the parent's side (:class:`WorkerHandle`), the worker's
side is :mod:`gdsload.server.worker_main`.

>>> handle = WorkerHandle.spawn(WorkerSpec(rank=0, model_dir="/models/m", backend="auto",
...                                        cuda_visible_devices="", gpu_explicit=False),
...                             start_method="forkserver")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.resource_tracker
import os
import re
import select
import signal
import threading
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..loader.errors import ConfigError

from . import forkserver
from .settings import parse_device_map
from .worker_protocol import EXIT_UNKNOWN, WorkerSpec, describe_exit


__all__ = ["WorkerHandle", "visible_gpus", "assign_devices"]

log = logging.getLogger(__name__)

_ENV_LOCK = threading.Lock()
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """GPUs this process may hand out, as ``CUDA_VISIBLE_DEVICES`` entries, found without initialising CUDA.

    The server's own ``CUDA_VISIBLE_DEVICES`` wins when set; otherwise the NVIDIA driver's
    ``/proc/driver/nvidia/gpus`` (or the ``/dev/nvidiaN`` nodes) are counted.

    >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})
    ['2', '3']
    """
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        out: list[str] = []
        for token in env["CUDA_VISIBLE_DEVICES"].split(","):
            token = token.strip()
            if not token or token.startswith("-"):
                break  # CUDA stops at the first invalid entry
            out.append(token)
        return out
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return [str(i) for i in range(sum(1 for _ in proc.iterdir()))]
    nodes = [p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]
    return [str(i) for i in range(len(nodes))]


def assign_devices(ranks: Sequence[int], device_map: str, visible: Sequence[str]) -> dict[int, tuple[str, bool]]:
    """``{rank: (CUDA_VISIBLE_DEVICES for its worker, explicit?)}``; ``""`` means a host-memory load.

    ``auto``: the i-th served rank gets ``visible[i]``, or the CPU when no GPU is visible at all.

    >>> assign_devices([4, 5], "auto", ["0", "1"])
    {4: ('0', False), 5: ('1', False)}
    """
    dm = parse_device_map(device_map)
    if dm == "cpu" or (dm == "auto" and not visible):
        return {r: ("", False) for r in ranks}
    if dm == "auto":
        if len(ranks) > len(visible):
            raise ConfigError(
                f"{len(ranks)} ranks to serve ({list(ranks)}) but only {len(visible)} GPU(s) visible "
                f"({list(visible)}); serve a subset per host with --ranks, or place ranks with --device-map"
            )
        return {r: (visible[i], False) for i, r in enumerate(ranks)}
    assert isinstance(dm, dict)
    out: dict[int, tuple[str, bool]] = {}
    for r in ranks:
        if r not in dm:
            raise ConfigError(f"--device-map {device_map!r} does not place rank {r}; add {r}:GPU or {r}:cpu")
        gpu = dm[r]
        if gpu is None:
            out[r] = ("", True)
        elif gpu >= len(visible):
            raise ConfigError(
                f"--device-map {device_map!r} puts rank {r} on GPU {gpu}, but this host shows "
                f"{len(visible)} GPU(s) ({list(visible)}); fix the map or CUDA_VISIBLE_DEVICES"
            )
        else:
            out[r] = (visible[gpu], True)
    return out


class WorkerHandle:
    """The parent's end of one worker: the process, its pipe, and the spec it was started with.

    A forked worker is the fork server's child, not ours: ``multiprocessing`` learns of its exit from
    the fork server, and would call every such worker dead (status 255) if the fork server died. So its
    liveness, and the signals that stop it, go through a pidfd of the worker itself where Linux has them.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        process: multiprocessing.process.BaseProcess,
        conn: Connection,
        start_method: str = "spawn",
    ):
        self.spec = spec
        self.process = process
        self.conn: Connection | None = conn
        self.retired = False
        """Set when the parent stops the worker on purpose (unload, reload, shutdown): its exit is no crash."""
        self._pidfd: int | None = None
        if start_method == "forkserver" and process.pid is not None:
            try:
                self._pidfd = os.pidfd_open(process.pid)
            except (AttributeError, OSError):  # Linux < 5.3, or the worker is gone already
                pass

    @classmethod
    def spawn(cls, spec: WorkerSpec, start_method: str = "spawn") -> WorkerHandle:
        """Start a worker process for ``spec`` with its own ``CUDA_VISIBLE_DEVICES``.

        ``start_method``: ``forkserver`` or ``spawn`` (``auto`` is resolved before this, by the supervisor).
        """
        ctx = forkserver.context(start_method)
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        from .worker_main import worker_main

        process = ctx.Process(target=worker_main, args=(spec, child_conn), name=f"gdsload-rank{spec.rank}", daemon=True)
        # A spawned interpreter inherits os.environ as it is at start(): set the variable there so it is in
        # force before anything in the child can initialise CUDA (a forked worker sets it in worker_main,
        # before it makes its context). The lock keeps concurrent starts apart.
        with _ENV_LOCK:
            before = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
            # A spawned interpreter starts with SIGTERM and SIGINT blocked (the mask survives exec) until
            # worker_main has its handlers: a group SIGTERM during its start-up waits for them instead of
            # killing it. (A forked worker inherits the fork server's ignoring of both.)
            mask = None
            if start_method == "spawn":
                # Started first: starting it unblocks both signals in this thread again.
                multiprocessing.resource_tracker.ensure_running()
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
            try:
                process.start()
            finally:
                if mask is not None:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                if before is None:
                    del os.environ["CUDA_VISIBLE_DEVICES"]
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = before
        child_conn.close()
        log.info(
            "rank %d: started worker pid %s by %s (CUDA_VISIBLE_DEVICES=%r)",
            spec.rank,
            process.pid,
            start_method,
            spec.cuda_visible_devices,
        )
        return cls(spec, process, parent_conn, start_method)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        """Readable once the worker has exited."""
        return self._pidfd if self._pidfd is not None else self.process.sentinel

    def alive(self) -> bool:
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]
        return self.process.exitcode is None

    def exitcode(self) -> int | None:
        """The exit status once the worker has exited (negative: killed by that signal); None while it runs.

        A forked worker's status comes from the fork server; :data:`EXIT_UNKNOWN` when that is gone.
        """
        if self.alive():
            return None
        self.process.join(1.0)
        return self.process.exitcode

    def describe_exit(self) -> str:
        """How the worker ended, for logs and errors (it must have exited)."""
        code = self.exitcode()
        if self._pidfd is not None and code == EXIT_UNKNOWN:
            return "exited; its exit status is unknown (the fork server that started it is gone)"
        return describe_exit(code)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the worker (through its pidfd where there is one); nothing if it has exited."""
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.process.pid, sig)  # type: ignore[arg-type]
        except (ProcessLookupError, OSError):  # exited meanwhile
            pass

    def send(self, kind: str, **payload: Any) -> bool:
        """Send a command without waiting; False when the worker cannot take it now (it exited, or its pipe is
        full because it stopped reading: a stopped or stuck worker never blocks the sender)."""
        if self.conn is None:
            return False
        try:
            if not select.select([], [self.conn.fileno()], [], 0)[1]:
                log.warning(
                    "rank %d: worker pid %s is not reading its commands; %r not sent", self.spec.rank, self.pid, kind
                )
                return False
            self.conn.send((kind, payload))  # commands are small: a writable pipe takes one whole
            return True
        except (OSError, EOFError, ValueError):
            return False

    def receive(self) -> list[tuple[str, dict[str, Any]]]:
        """Every message waiting in the pipe, without blocking; closes the pipe on end-of-file."""
        out: list[tuple[str, dict[str, Any]]] = []
        while self.conn is not None:
            try:
                if not self.conn.poll():
                    break
                out.append(self.conn.recv())
            except (EOFError, OSError):
                self.conn.close()
                self.conn = None
        return out

    def close(self) -> None:
        """Release the pipe, the pidfd and the process object (the process must have exited)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self._pidfd is not None and not self.alive():
            os.close(self._pidfd)
            self._pidfd = None
        if self.process.exitcode is not None:
            self.process.close()
