"""``cufile``: kvikio ``CuFile.pread`` straight into the device arena.

With nvidia-fs (or P2PDMA) this is true GPUDirect Storage: storage DMAs into HBM. Without it,
kvikio (or cuFile) bounces through host memory; the report then says ``compat`` or ``posix``,
never ``gds``. Reads are submitted for every file at once and split by kvikio's thread pool
into ``task_size`` pieces; file offsets of files gdsload writes are 4 KiB aligned.

Cold files under kvikio's POSIX (compat) mode: when the rank's files are cold in the page cache
(weighted by size) and every one accepts O_DIRECT, kvikio reads them with O_DIRECT (its
``auto_direct_io_read``) into page-aligned bounce buffers: 4 threads, 2 MiB reads cut at
2 MiB-aligned file offsets, queued as one sequential stream per thread
(:func:`~gdsload.loader.plan.stream_order`). Few bytes in flight (4 x 2 MiB) suit a virtio disk
best: with 16 MiB reads, many more requests waited at the disk, each for longer, and loads were slower.
Buffered reads would copy every byte through the page cache once more and read ahead into it.
When fastsafetensors is installed, its native reader does all of such a cold rank's reads instead of
kvikio (``COLD_READER``; :mod:`gdsload.loader.io.fst_reader`): the whole reads into the arena, and a
compressed load's groups, queued while the decoder runs; kvikio is then not imported. It reads a cold
rank faster than kvikio's shape above.

It reads into any CUDA :class:`~gdsload.loader.devices.Device`: torch's memory, or the CUDA driver's for the
workers that load without torch (the only reader there, so ``auto`` takes it even without GDS). A cached
rank on a host without GDS never imports kvikio.
Without GDS, a rank whose files are cached is read by the staged reader
(:mod:`gdsload.loader.io.staged`) where it is built, as the ``pinned`` backend reads it; the report
then says ``posix`` and ``reader=staged``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..devices import Device
from ..errors import BackendUnavailableError
from .iomode import (
    KvikioState,
    cufile_io_mode,
    gds_filesystem,
    kvikio_state,
    nvidia_fs_loaded,
    o_direct_supported,
    p2pdma_configured,
)
from .kvikio_env import settings_to_apply, value_in_force
from .pagecache import is_cold
from ..plan import Extent, LoadPlan, direct_read_order, fd_path
from . import Backend, Progress, extent_slice, wait_preads
from .fst_reader import make_fst_reader
from .staged import StagedReaderError, StagedReader
from .staged import prepare as staged_prepare
from .staged import unavailable as staged_unavailable

__all__ = ["CuFileBackend", "has_direct_switch", "kvikio_reads_direct", "MIN_DIRECT_TASK"]

log = logging.getLogger(__name__)


class CuFileBackend(Backend):
    name = "cufile"
    needs_torch = False
    DEFAULT_THREADS = 16
    DEFAULT_TASK = 4 << 20
    COLD_THREADS = 4
    """Threads for cold files read with O_DIRECT (see the module doc)."""
    COLD_TASK = 2 << 20
    """Size of one O_DIRECT read of a cold file (kvikio's bounce buffer; see the module doc)."""
    COLD_PIECE: int | None = None
    """Bytes one kvikio task (so one thread) reads in order, ``COLD_TASK`` at a time; None: one read per task.
    fastsafetensors reads that way; with 8-16 threads and 128 MiB-1 GiB pieces it gained nothing over the
    default, so the default stays None."""
    COLD_STREAMS: int | None = None
    """Sequential streams the cold reads are queued as; None: one per thread. With more threads than
    streams, each stream has several neighbouring reads in flight, as fastsafetensors reads. With 8-16
    threads and 4 streams it gained nothing over the default."""
    COLD_READER = "fastsafetensors"
    """Who reads a cold rank with O_DIRECT: ``fastsafetensors`` (its native reader, where installed; else
    kvikio) or ``kvikio``."""
    cold_direct = False
    """Set by :meth:`open`: this load reads cold files with O_DIRECT (kvikio's POSIX path, or ``cold_reader``)."""
    cold_reader: Any = None
    """Set by :meth:`open`: fastsafetensors' reader for this cold rank's :meth:`read` calls, or None."""
    staged: Any = None
    """Set by :meth:`open`: the staged reader, reading every file of a cached rank without GDS, or None."""

    @classmethod
    def probe(cls, device: Device) -> str | None:
        if device.kind != "cuda":
            return f"it loads to CUDA devices, not {str(device)!r}"
        if not _gds_possible() and staged_unavailable() is None:
            # A cached rank is read by the staged reader and never imports kvikio (nor numpy, in a process
            # without it); a cold one imports it at open, which reports a broken install.
            if importlib.util.find_spec("kvikio") is None:
                return "kvikio is not installed; install gdsload[cu12] or gdsload[cu13]"
            return None
        state = kvikio_state()
        if not state.importable:
            return f"kvikio is not importable ({state.error}); install gdsload[cu12] or gdsload[cu13]"
        return None

    @classmethod
    def auto_skip(cls, device: Device) -> str | None:
        """Why ``auto`` prefers another backend even though this one can run."""
        if not device.uses_torch:
            return None  # without torch, kvikio is the only reader (GDS or its compat mode)
        if not _gds_possible():
            # Known without importing kvikio or opening the cuFile driver.
            return (
                "no GPUDirect Storage here (no nvidia-fs module, and cufile.json does not turn on P2PDMA); "
                "it would bounce through host memory"
            )
        state = kvikio_state()
        if state.compat_preferred or not state.gds_available:
            return (
                "no GPUDirect Storage here (kvikio compat mode "
                f"{'on' if state.compat_preferred else 'off'}, cuFile is_gds_available={state.gds_available}); "
                "it would bounce through host memory"
            )
        return None

    def prepare(self, paths: Sequence[str]) -> None:
        if not _gds_possible():  # no GDS: a cached rank goes through the staged reader
            staged_prepare(self.device, paths, threads=self.options.num_threads, chunk=self.options.chunk_bytes)

    def open(self, plan: LoadPlan) -> None:
        super().open(plan)
        self.device.activate()
        self._ran: list[set[str]] = [set() for _ in plan.files]
        self._files = []
        self._settings = None
        self.cold_reader = None
        self.staged = None
        self.cold_direct = False
        self.landed_on_wait = False  # the staged reader's tickets are done once their copies have completed
        why = staged_unavailable()
        gds = _gds_possible()
        cold = bool(plan.files) and is_cold(*plan.open_paths)
        if not gds and cold and self._open_cold_reader(plan):
            return
        if why is None and not gds and not cold:
            # No GPUDirect Storage and the files cached: kvikio would bounce them through host memory; the staged
            # reader does that faster (see loader/io/staged.py), and the report says so. kvikio is not imported.
            try:
                self.staged = StagedReader(
                    self.device, plan, threads=self.options.num_threads, chunk=self.options.chunk_bytes
                )
            except StagedReaderError as e:
                why = str(e)
            else:
                self._modes = ["posix"] * len(plan.files)
                self._direct = [False] * len(plan.files)
                self.landed_on_wait = self.device.kind == "cuda"
                return
        try:
            import kvikio
            import kvikio.defaults
        except Exception as e:  # installed but broken: say so, as the probe would have
            raise BackendUnavailableError(
                f"{self.name}: kvikio cannot be imported ({type(e).__name__}: {e}); "
                "reinstall gdsload[cu12] or gdsload[cu13]"
            ) from None
        self._state: KvikioState = kvikio_state()
        direct_ok = [o_direct_supported(f.path) for f in plan.files]
        self._modes = [
            cufile_io_mode(self._state, ok, gds_fs=gds_filesystem(f.path)) for ok, f in zip(direct_ok, plan.files)
        ]
        # Only kvikio's own POSIX path takes this switch; with cuFile (GDS, or cuFile's own compat
        # mode) kvikio hands the reads to cuFile.
        has_switch = has_direct_switch(kvikio)
        self.cold_direct = (
            has_switch
            and bool(plan.files)
            and all(m == "posix" for m in self._modes)
            and all(direct_ok)
            and self._task(cold=True) >= MIN_DIRECT_TASK
            and cold
        )
        why = "the rank is cold" if self.cold_direct else why
        if why is None and not all(m in ("posix", "compat") for m in self._modes):
            why = "GPUDirect Storage serves some of the files"
        if why is None:
            # Bounce buffers either way (a cold rank without O_DIRECT, or kvikio's compat mode where GDS could
            # run): the staged reader reads through the page cache faster, as above.
            try:
                self.staged = StagedReader(
                    self.device, plan, threads=self.options.num_threads, chunk=self.options.chunk_bytes
                )
            except StagedReaderError as e:
                why = str(e)
        if self.staged is not None:
            self._modes = ["posix"] * len(plan.files)
            self._direct = [False] * len(plan.files)
            self.landed_on_wait = self.device.kind == "cuda"
            return
        if why is not None and not self.cold_direct:
            log.debug("%s: reads through kvikio: %s", self.name, why)
        settings = self._kvikio_settings()
        if not has_switch:
            settings.pop("auto_direct_io_read", None)
        # Process-wide kvikio settings, held from open to close (per read, kvikio would rebuild its
        # thread pool for every staging group of a compressed load); a KVIKIO_* variable the user set wins.
        self._settings = kvikio.defaults.set(settings_to_apply(settings))
        self._cold_shape = (
            int(value_in_force(kvikio, settings, "task_size")),
            int(value_in_force(kvikio, settings, "num_threads")),
        )
        for fd in plan.fds:  # one by one: close() closes those opened before a failure
            self._files.append(kvikio.CuFile(fd_path(fd), "r"))  # the file the plan's header came from
        self._direct = [
            m in ("gds", "p2pdma") or (self.cold_direct and kvikio_reads_direct(cf))
            for m, cf in zip(self._modes, self._files)
        ]

    def _open_cold_reader(self, plan: LoadPlan) -> bool:
        """For a cold rank on a host without GDS: fastsafetensors' reader for every read, where it is installed,
        starts here and every file accepts O_DIRECT. Then kvikio is not imported (with numpy, 0.2-0.3 s in a
        process without torch); otherwise (False) kvikio reads the rank, with the reason logged."""
        if self.COLD_READER != "fastsafetensors" or not all(o_direct_supported(f.path) for f in plan.files):
            return False
        self.cold_reader, why = make_fst_reader(
            [f.path for f in plan.files], lambda: self.device.index or 0, open_paths=[fd_path(fd) for fd in plan.fds]
        )
        if self.cold_reader is None:
            log.info("%s: cold reads through kvikio: %s", self.name, why)
            return False
        self.cold_direct = True
        self._modes = ["posix"] * len(plan.files)  # POSIX reads staged through host memory, as kvikio's would be
        self._direct = [True] * len(plan.files)
        return True

    def _task(self, *, cold: bool) -> int:
        return self.options.chunk_bytes or (self.COLD_TASK if cold else self.DEFAULT_TASK)

    def _kvikio_settings(self) -> dict[str, Any]:
        """The kvikio settings this load wants, before the user's ``KVIKIO_*`` variables take theirs back
        (:func:`~gdsload.loader.io.kvikio_env.settings_to_apply`)."""
        cold = self.cold_direct
        threads = self.options.num_threads or (self.COLD_THREADS if cold else self.DEFAULT_THREADS)
        if not cold:
            # One bounce buffer per task, as the pinned backend sizes them (kvikio's default is 16 MiB each).
            task = self._task(cold=False)
            return {"num_threads": threads, "task_size": task, "bounce_buffer_size": task, "auto_direct_io_read": False}
        read = self._task(cold=True)
        piece = max(read, (self.COLD_PIECE or read) // read * read)
        return {"num_threads": threads, "task_size": piece, "bounce_buffer_size": read, "auto_direct_io_read": True}

    def submit(
        self, extents: Sequence[Extent], dsts: Sequence[Any], progress: Progress | None = None
    ) -> Callable[[], None]:
        assert self.plan is not None
        self.device.activate()
        if self.cold_reader is not None:
            for e in extents:
                self._ran[e.file_index].add("fastsafetensors")
            return self.cold_reader.submit(
                extents, [(self.device.address(d), self.device.nbytes(d)) for d in dsts], progress
            )
        reader = "staged" if self.staged is not None else "kvikio"
        for e in extents:
            self._ran[e.file_index].add(reader)
        if self.staged is not None:
            return self.staged.submit(extents, dsts, progress)
        if self.cold_direct:  # one task per read, queued as one sequential stream per thread
            task, threads = self._cold_shape  # kvikio's own: the user's KVIKIO_* where set
            reads = direct_read_order(extents, task, self.COLD_STREAMS or threads)
        else:
            reads = [e for e in extents if e.length]
        futures = [(e, self._files[e.file_index].pread(extent_slice(dsts, e), e.length, e.file_offset)) for e in reads]

        def wait() -> None:
            # A kvikio read is done when its bytes are in place (its bounce-buffer copies synchronized by
            # kvikio, cuFile reads synchronous), so waiting needs no device-wide synchronize: that would
            # also wait for the decoder's kernels on their own streams.
            assert self.plan is not None
            wait_preads(self.plan, futures, progress)

        return wait

    def read(self, extents: Sequence[Extent], dsts: Sequence[Any], progress: Progress | None = None) -> None:
        self.submit(extents, dsts, progress)()
        self.device.synchronize()

    def io_modes(self) -> list[str]:
        return list(self._modes)

    def direct_io(self) -> list[bool]:
        return list(self._direct)

    def file_readers(self) -> list[str]:
        """What read each file: ``staged``, ``kvikio`` (cuFile under it, with GDS) or ``fastsafetensors``."""
        return ["+".join(sorted(r)) or ("staged" if self.staged is not None else "kvikio") for r in self._ran]

    def close(self) -> None:
        if getattr(self, "staged", None) is not None:
            self.staged.close()
            self.staged = None
        if getattr(self, "cold_reader", None) is not None:
            self.cold_reader.close()
            self.cold_reader = None
        for f in getattr(self, "_files", []):
            f.close()
        self._files = []
        if getattr(self, "_settings", None) is not None:
            self._settings.__exit__(None, None, None)  # kvikio's settings as they were before open
            self._settings = None


def _gds_possible() -> bool:
    """Whether this host could read with GPUDirect Storage (nvidia-fs loaded, or P2PDMA in cufile.json),
    known without importing kvikio."""
    return nvidia_fs_loaded() or p2pdma_configured()


def kvikio_reads_direct(f: Any) -> bool:
    """Whether kvikio reads this open file with O_DIRECT (``CuFile.is_direct_io_supported``, where it exists)."""
    check = getattr(f, "is_direct_io_supported", None)
    return bool(check()) if check is not None else False


MIN_DIRECT_TASK = 8192
"""kvikio reads O_DIRECT only through bounce buffers of at least two pages; smaller tasks stay buffered."""


def has_direct_switch(kvikio: Any) -> bool:
    """Whether this kvikio has the ``auto_direct_io_read`` setting (26.10 has it; older ones may not)."""
    try:
        kvikio.defaults.get("auto_direct_io_read")
    except Exception:  # older kvikio: an unknown setting name
        return False
    return True
