"""The staging ring: reader threads ``preadv`` file chunks into their own host buffers and copy
them to the destination, each on its own CUDA stream, while reading the next chunk.

Work arrives in groups (:meth:`StagingRing.submit`): a whole rank for a plain load, one staging
group after another for a compressed one. The threads keep running across groups, so the next
group's reads start while the last chunks of the previous one are still in flight: the disk
never waits for a group boundary. Within a group, chunks are queued so that ``streams``
sequential streams move through the data side by side (:func:`stream_order`; by default one per
reader, as a reader per file would).

Each thread owns ``buffers`` pinned buffers of ``chunk`` bytes (plus two pages for O_DIRECT
alignment) and reuses one only after the copy out of it has finished (a CUDA event), so pinned
staging is bounded by ``threads * buffers * chunk``. O_DIRECT reads are rounded out to whole
pages and the lead discarded. With a CPU destination (used by the tests) the same bookkeeping
runs with plain page-aligned buffers and synchronous copies.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TruncatedFileError
from ..plan import Extent, align_up, split_extents, stream_order

__all__ = ["StagingRing", "RingFile", "PAGE", "stream_order"]

log = logging.getLogger(__name__)

PAGE = 4096
Progress = Callable[[int], None]


@dataclass(frozen=True)
class RingFile:
    fd: int
    direct: bool
    """Opened with O_DIRECT: reads must be page aligned in offset, length and buffer."""
    path: str


class _Group:
    """One submit: counts its chunks down; the waiter then waits for their copies."""

    def __init__(self, chunks: int):
        self.left = chunks
        self.error: BaseException | None = None
        self.events: list[Any] = []
        self._cond = threading.Condition()

    def finish(self, event: Any = None, error: BaseException | None = None) -> None:
        with self._cond:
            if event is not None:
                self.events.append(event)
            if error is not None and self.error is None:
                self.error = error
            self.left -= 1
            if self.left == 0:
                self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            while self.left:
                self._cond.wait()
        if self.error is not None:
            raise self.error
        for ev in self.events:
            ev.synchronize()


class StagingRing:
    def __init__(
        self,
        device: torch.device,
        files: Sequence[RingFile],
        *,
        threads: int,
        chunk: int,
        buffers: int = 2,
        streams: int | None = None,
    ):
        if threads < 1 or chunk < PAGE or buffers < 1 or (streams is not None and streams < 1):
            raise ValueError(f"bad ring shape: threads={threads} chunk={chunk} buffers={buffers} streams={streams}")
        self.streams = streams or threads
        self.device = device
        self.files = list(files)
        self.threads = threads
        self.chunk = chunk
        self.buffers = buffers
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []

    @property
    def staging_bytes(self) -> int:
        """Host staging the ring holds once all its threads run."""
        return self.threads * self.buffers * (self.chunk + 2 * PAGE)

    def submit(
        self, extents: Sequence[Extent], dsts: Sequence[torch.Tensor], progress: Progress | None = None
    ) -> Callable[[], None]:
        """Queue ``extents`` for copying into their buffers of ``dsts``; returns the function that waits for
        them (and raises the first error of this group)."""
        chunks = stream_order(
            split_extents([e for e in extents if e.length], self.chunk, interleave=False), self.streams
        )
        group = _Group(len(chunks))
        if chunks:
            self._start(len(chunks))
            for c in chunks:
                self._queue.put((c, dsts, group, progress))
        return group.wait

    def close(self) -> None:
        """Stop the threads (after the work queued so far) and drop their buffers."""
        for _ in self._workers:
            self._queue.put(None)
        for t in self._workers:
            t.join()
        self._workers = []

    def _start(self, wanted: int) -> None:
        # Threads start as work first needs them, each pinning its own buffers: a small load
        # does not pay for a full ring, and the pinning happens on many threads at once.
        while len(self._workers) < min(self.threads, wanted):
            t = threading.Thread(target=self._worker, name=f"gdsload-ring-{len(self._workers)}", daemon=True)
            t.start()
            self._workers.append(t)

    def _buffers(self, cuda: bool) -> list[tuple[torch.Tensor, memoryview, Any]]:
        out = []
        for _ in range(self.buffers):
            n = self.chunk + 2 * PAGE
            if cuda:
                # cudaHostAlloc memory is page aligned, as O_DIRECT needs.
                t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                keep: Any = None
            else:
                keep = mmap.mmap(-1, n)  # page aligned
                t = torch.frombuffer(keep, dtype=torch.uint8)
            assert t.data_ptr() % PAGE == 0, "staging buffers must be page aligned"
            out.append((t, memoryview(t.numpy()), keep))
        return out

    def _worker(self) -> None:
        cuda = self.device.type == "cuda"
        stream = None
        if cuda:
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(device=self.device)
        bufs: list[tuple[torch.Tensor, memoryview, Any]] | None = None
        events: list[Any] = [None] * self.buffers
        k = 0
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                c, dsts, group, progress = item
                if group.error is not None:  # the group failed: drain its chunks without reading
                    group.finish()
                    continue
                try:
                    if bufs is None:
                        bufs = self._buffers(cuda)
                    if events[k] is not None:
                        events[k].synchronize()  # the copy out of this buffer is done
                    buf, view, _ = bufs[k]
                    lead = self._pread(c, view)
                    src = buf[lead : lead + c.length]
                    out = dsts[c.buffer][c.offset : c.offset + c.length]
                    ev = None
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            out.copy_(src, non_blocking=True)
                            ev = torch.cuda.Event()
                            ev.record(stream)
                    else:
                        out.copy_(src)
                    events[k] = ev
                    k = (k + 1) % self.buffers
                    if progress is not None:
                        progress(c.length)
                    group.finish(ev)
                except BaseException as e:
                    group.finish(error=e)
        finally:
            if stream is not None:
                stream.synchronize()

    def _pread(self, c: Extent, buf: memoryview) -> int:
        """Read chunk ``c`` into ``buf``; returns where its first byte landed in ``buf``."""
        f = self.files[c.file_index]
        if f.direct:
            start = c.file_offset - c.file_offset % PAGE
            lead = c.file_offset - start
            want, length = lead + c.length, align_up(lead + c.length, PAGE)
        else:
            start, lead, want, length = c.file_offset, 0, c.length, c.length
        done = 0
        while done < want:
            n = os.preadv(f.fd, [buf[done:length]], start + done)
            if n == 0:
                raise TruncatedFileError(
                    f"{f.path!r}: end of file at byte {start + done} while reading {c.length} bytes at "
                    f"{c.file_offset}; the file shrank while it was being loaded"
                )
            done += n
        return lead
