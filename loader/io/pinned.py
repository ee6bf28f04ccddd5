"""``pinned``: the fast path for hosts without GPUDirect Storage.

Files are read into small pinned host buffers and copied to the GPU asynchronously, all of a
rank's files read by one pool of threads, staging bounded by ``ReadOptions.pinned_bytes``. The reader is
chosen per file from its page-cache residency (``mincore``):

- **cached files** (page cache or tmpfs) go through gdsload's staged reader
  (:mod:`gdsload.loader.io.staged`, C): 16 threads ``pread`` 2 MiB chunks into two pinned buffers
  each and copy them to the device on their own streams, the threads and buffers kept for the
  process's next load. It reads as fast as kvikio's reader, and a load skips kvikio's import
  and set-up; where it was not built (no C compiler at install), or with
  ``GDSLOAD_STAGED=0``, kvikio's C++ POSIX reader reads them (compatibility mode forced on, 16
  threads, 4 MiB tasks), and without kvikio the Python ring below, whose per-chunk overhead
  (event record and host-allocator locking in ``Tensor.copy_``) caps it below the other two.
- **cold ranks** (the rank's files cold by size, each accepting O_DIRECT, and a kvikio with the
  ``auto_direct_io_read`` setting, as 26.10 has) go through the same kvikio reader reading with
  O_DIRECT in ``cufile``'s cold shape: 4 threads, 2 MiB reads cut at aligned file offsets, queued
  as one sequential stream per thread (see ``cufile``'s module doc); on a virtio disk this beat the
  ring below, taking turns in fresh processes.
- **cold ranks, when fastsafetensors is installed**: its native reader does every read, as in
  ``cufile`` (see :mod:`gdsload.loader.io.fst_reader`; ``CuFileBackend.COLD_READER``), and no other
  reader is set up.
- otherwise our own ring reads the cold files (and, without kvikio, the cached ones too): reader
  threads ``preadv`` (O_DIRECT for cold files: 4 KiB-rounded, lead discarded) into their own
  double-buffered pinned buffers, and start the host-to-device copy on their stream while reading
  the next chunk. Four readers beat 32 on a virtio disk; the chunks are queued as one stream per
  reader.

The report says ``posix`` for all of them (POSIX reads staged through host memory), flags O_DIRECT, and
names the reader that read each file (``FileReport.reader``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..devices import Device
from .iomode import cufile_io_mode, gds_filesystem, kvikio_state, o_direct_supported
from .kvikio_env import settings_to_apply, user_settings, value_in_force
from .pagecache import COLD_RESIDENCY, is_cold
from ..plan import Extent, LoadPlan, direct_read_order, fd_path
from . import Backend, Progress, extent_slice, wait_preads
from .cufile import MIN_DIRECT_TASK, CuFileBackend, has_direct_switch, kvikio_reads_direct
from .fst_reader import make_fst_reader
from .staged import StagedReaderError, StagedReader
from .staged import prepare as staged_prepare
from .staged import unavailable as staged_unavailable

__all__ = ["PinnedBackend", "COLD_RESIDENCY"]

log = logging.getLogger(__name__)


def _kvikio() -> Any | None:
    try:
        import kvikio
        import kvikio.defaults

        return kvikio
    except Exception:  # not installed, or its CUDA libraries do not load
        return None


class PinnedBackend(Backend):
    name = "pinned"
    KVIKIO_THREADS = 16
    KVIKIO_TASK = 4 << 20
    RING_THREADS_COLD = 4
    """Ring readers when every file the ring serves is read with O_DIRECT (cold)."""
    RING_THREADS_CACHED = 16
    """Ring readers when it also serves cached files (no kvikio): memory copies want more threads (16 was the
    fastest count tried from tmpfs)."""
    RING_STREAMS: int | None = None
    """Sequential streams the ring keeps going (None: one per reader; see ``ring.stream_order``)."""
    RING_CHUNK = 16 << 20
    KVIKIO_COLD_TASK = CuFileBackend.COLD_TASK
    """kvikio's O_DIRECT read size for a cold rank: ``cufile``'s (see its module doc)."""
    BUFFERS_PER_THREAD = 2

    @classmethod
    def probe(cls, device: Device) -> str | None:
        if device.kind != "cuda":
            return f"it loads to CUDA devices, not {str(device)!r}"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device (CPU build of torch, or no driver)"
        return None

    def prepare(self, paths: Sequence[str]) -> None:
        staged_prepare(self.device, paths, threads=self.options.num_threads, chunk=self.options.chunk_bytes)

    def open(self, plan: LoadPlan) -> None:
        super().open(plan)
        # kvikio's settings are process-wide, so it reads a rank with O_DIRECT as a whole: when the
        # rank is cold (by size: a small file pulled in by the header reads does not count).
        rank_cold = bool(plan.files) and is_cold(*plan.open_paths)
        self._fds: list[int] = []
        self._direct: list[bool] = []
        self._own_fds: list[int] = []
        self._staged: StagedReader | None = None
        self._ran: list[set[str]] = [set() for _ in plan.files]
        for f, fd in zip(plan.files, plan.fds):
            fd, direct = self._open(f.path, fd, cold=rank_cold or is_cold(fd_path(fd)))
            self._fds.append(fd)
            self._direct.append(direct)
        self._fd_direct = list(self._direct)  # how the ring's descriptors were opened
        self._fst = None
        fst_why = None
        if rank_cold and all(self._direct) and CuFileBackend.COLD_READER == "fastsafetensors":
            # fastsafetensors' reader does every read of a cold rank (see cufile): no other reader is set up
            self._fst, fst_why = make_fst_reader(
                [f.path for f in plan.files],
                lambda: self.device.index or 0,
                open_paths=[fd_path(fd) for fd in plan.fds],
            )
        staged_why = staged_unavailable() if not all(self._direct) else "no cached files"
        if staged_why is None:
            try:
                self._staged = StagedReader(
                    self.device, plan, threads=self.options.num_threads, chunk=self.options.chunk_bytes
                )
            except StagedReaderError as e:
                staged_why = str(e)
        # kvikio only where it reads something: cold files, or cached ones without the staged reader.
        self._kv = _kvikio() if self._fst is None and (any(self._direct) or staged_why is not None) else None
        self._kv_switch = self._kv is not None and has_direct_switch(self._kv)
        self.kvikio_direct = (
            self._kv_switch and rank_cold and all(self._direct) and self._kvikio_task(direct=True) >= MIN_DIRECT_TASK
        )
        self._reader_of = (
            [
                ("kvikio" if self.kvikio_direct else "ring")
                if d
                else "staged"
                if staged_why is None
                else "kvikio"
                if self._kv is not None
                else "ring"
                for d in self._direct
            ]
            if self._fst is None
            else ["fastsafetensors"] * len(plan.files)
        )
        if staged_why is not None and not all(self._direct):
            log.debug(
                "pinned: cached files through %s: %s", "kvikio" if self._kv is not None else "the ring", staged_why
            )
        if fst_why is not None:
            log.info("pinned: cold reads through %s: %s", "kvikio" if self.kvikio_direct else "the ring", fst_why)
        self._cufiles: dict[int, Any] = {}
        self._kv_settings: Any = None
        if "kvikio" in self._reader_of:
            # kvikio's settings are process-wide; they hold from open to close. Setting them per
            # read would rebuild its thread pool and bounce buffers (cudaFreeHost synchronizes
            # the device) for every staging group of a compressed load.
            self._kv_settings = self._kvikio_settings()
            for i, f in enumerate(plan.files):  # one by one: close() closes those opened before a failure
                if self._reader_of[i] == "kvikio":
                    self._cufiles[i] = self._kv.CuFile(fd_path(plan.fds[i]), "r")
            if self.kvikio_direct:  # report what kvikio says it does, not only what we asked for
                self._direct = [d and kvikio_reads_direct(self._cufiles[i]) for i, d in enumerate(self._direct)]
        self._ring = self._make_ring() if "ring" in self._reader_of else None
        # The staged reader's tickets are done when their copies have completed, and keep the pool busy across
        # submits (the ring and kvikio's direct reads order a whole rank's reads themselves).
        self.landed_on_wait = self.device.kind == "cuda" and all(r == "staged" for r in self._reader_of)

    def _make_ring(self) -> Any:
        """The Python ring, for the files no other reader reads; imported only then."""
        from .ring import PAGE, RingFile, StagingRing

        assert self.plan is not None
        chunk = self.options.chunk_bytes or self.RING_CHUNK
        threads = self.ring_threads()
        per_thread = self.BUFFERS_PER_THREAD * (chunk + 2 * PAGE)
        budget = (
            self.options.pinned_bytes
            - (self._kvikio_threads() * self._kvikio_task() if self._cufiles else 0)
            - (self._staged.pool.staging_bytes if self._staged is not None else 0)
        )
        ring_threads = max(1, min(threads, budget // per_thread))
        if ring_threads < threads:
            log.info(
                "pinned: %d ring threads instead of %d to keep pinned staging within %d bytes",
                ring_threads,
                threads,
                self.options.pinned_bytes,
            )
        return StagingRing(
            self.device.device,
            [RingFile(fd, d, f.path) for fd, d, f in zip(self._fds, self._fd_direct, self.plan.files)],
            threads=ring_threads,
            chunk=chunk,
            buffers=self.BUFFERS_PER_THREAD,
            streams=self.RING_STREAMS,
        )

    def ring_threads(self) -> int:
        """Readers the ring wants (before the pinned budget): as asked, else per what it serves."""
        cached_in_ring = any(e == "ring" and not d for e, d in zip(self._reader_of, self._direct))
        return self.options.num_threads or (self.RING_THREADS_CACHED if cached_in_ring else self.RING_THREADS_COLD)

    def _open(self, path: str, fd: int, *, cold: bool) -> tuple[int, bool]:
        """The descriptor to read ``path`` through: the plan's, or (cold) the same file reopened with O_DIRECT."""
        if cold:
            try:
                direct = os.open(fd_path(fd), os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as e:  # tmpfs and some network file systems refuse O_DIRECT
                log.debug("pinned: O_DIRECT refused for %s (%s); reading through the page cache", path, e)
            else:
                self._own_fds.append(direct)
                return direct, True
        return fd, False

    kvikio_direct = False
    """Set by :meth:`open`: kvikio reads this (all cold) rank with O_DIRECT."""

    def _kvikio_threads(self) -> int:
        return self.options.num_threads or (self.RING_THREADS_COLD if self.kvikio_direct else self.KVIKIO_THREADS)

    def _kvikio_task(self, direct: bool | None = None) -> int:
        direct = self.kvikio_direct if direct is None else direct
        return self.options.chunk_bytes or (self.KVIKIO_COLD_TASK if direct else self.KVIKIO_TASK)

    def _kvikio_wanted(self, compat_on: Any = "ON") -> dict[str, Any]:
        """The kvikio settings this load wants (POSIX reads through pinned bounce buffers: compat mode on),
        before the user's ``KVIKIO_*`` variables take theirs back (:mod:`~gdsload.loader.io.kvikio_env`)."""
        task = self._kvikio_task()
        settings = {
            "compat_mode": compat_on,
            "num_threads": self._kvikio_threads(),
            "task_size": task,
            "bounce_buffer_size": task,
        }
        if self._kv_switch:
            settings["auto_direct_io_read"] = self.kvikio_direct
        return settings

    def _kvikio_settings(self) -> Any:
        kv = self._kv
        wanted = self._kvikio_wanted(kv.CompatMode.ON)
        held = kv.defaults.set(settings_to_apply(wanted))
        self._kv_shape = (int(value_in_force(kv, wanted, "task_size")), int(value_in_force(kv, wanted, "num_threads")))
        return held

    def submit(
        self, extents: Sequence[Extent], dsts: Sequence[Any], progress: Progress | None = None
    ) -> Callable[[], None]:
        assert self.plan is not None
        self.device.activate()
        if self._fst is not None:  # a cold rank: every read, whole or a compressed load's group (see cufile)
            for e in extents:
                self._ran[e.file_index].add("fastsafetensors")
            return self._fst.submit(extents, [(d.data_ptr(), d.nbytes) for d in dsts], progress)
        kv_extents = [e for e in extents if self._reader_of[e.file_index] == "kvikio" and e.length]
        if self.kvikio_direct:  # one task per read, queued as one sequential stream per thread
            kv_extents = direct_read_order(kv_extents, *self._kv_shape)  # kvikio's task size and threads
        for e in extents:
            self._ran[e.file_index].add(self._reader_of[e.file_index])
        staged = [e for e in extents if self._reader_of[e.file_index] == "staged"]
        staged_wait = self._staged.submit(staged, dsts, progress) if self._staged is not None and staged else None
        ring = [e for e in extents if self._reader_of[e.file_index] == "ring"]
        ring_wait = self._ring.submit(ring, dsts, progress) if self._ring is not None and ring else None
        futures = [
            (e, self._cufiles[e.file_index].pread(extent_slice(dsts, e), e.length, e.file_offset)) for e in kv_extents
        ]

        def wait() -> None:
            assert self.plan is not None
            # Every reader writes into dst until its own waiter returns: wait for all, even when one failed.
            try:
                if staged_wait is not None:
                    staged_wait()
            finally:
                try:
                    if ring_wait is not None:
                        ring_wait()
                finally:
                    wait_preads(self.plan, futures, progress)

        return wait

    def read(self, extents: Sequence[Extent], dsts: Sequence[Any], progress: Progress | None = None) -> None:
        self.submit(extents, dsts, progress)()
        if self._fst is not None:
            self.device.synchronize()

    def io_modes(self) -> list[str]:
        assert self.plan is not None
        modes = ["posix"] * len(self.plan.files)
        if "kvikio" in self._reader_of and "compat_mode" in user_settings():
            # The user's KVIKIO_COMPAT_MODE held, not ours: kvikio may hand its files to cuFile.
            state = kvikio_state()
            if not state.compat_preferred:
                modes = [
                    cufile_io_mode(state, o_direct_supported(f.path), gds_fs=gds_filesystem(f.path))
                    if e == "kvikio"
                    else m
                    for f, e, m in zip(self.plan.files, self._reader_of, modes)
                ]
        return modes

    def direct_io(self) -> list[bool]:
        return list(self._direct)

    def readers(self) -> list[str]:
        """Per file: ``staged`` (our staged reader), ``kvikio`` (its C++ POSIX reader) or ``ring`` (our Python
        threads); whole reads of a cold rank go through fastsafetensors' reader when :meth:`open` made one
        (``fastsafetensors`` in the report)."""
        return list(self._reader_of)

    def file_readers(self) -> list[str]:
        """What read each file in this load, ``+``-joined where both whole reads and staging groups ran."""
        return ["+".join(sorted(r)) or e for r, e in zip(self._ran, self._reader_of)]

    def close(self) -> None:
        if getattr(self, "_staged", None) is not None:
            self._staged.close()
            self._staged = None
        if getattr(self, "_fst", None) is not None:
            self._fst.close()
            self._fst = None
        if getattr(self, "_ring", None) is not None:
            self._ring.close()
            self._ring = None
        # kvikio keeps its bounce buffers (threads x task size, 64 MiB by default) in a process-wide
        # pool for the next load; freeing them here could pull them from under another user of kvikio.
        for f in getattr(self, "_cufiles", {}).values():
            f.close()
        self._cufiles = {}
        if getattr(self, "_kv_settings", None) is not None:
            self._kv_settings.__exit__(None, None, None)  # kvikio's settings as they were before open
            self._kv_settings = None
        for fd in getattr(self, "_own_fds", []):  # the O_DIRECT ones; the plan closes its own
            os.close(fd)
        self._own_fds = []
        self._fds = []
        if torch.cuda.is_available():
            # Give the ring's pinned staging back to the driver, not to torch's host cache.
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()
