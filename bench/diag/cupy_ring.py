# Diagnostic from session 10 (not installed with the package): a cold rank read the way fastsafetensors'
# nogds reader reads it, but from Python without torch: THREADS threads take O_DIRECT reads of MIB off one
# queue (queued as STREAMS sequential streams, gdsload.loader.plan.stream_order), each into the next of its
# two cudaHostAlloc buffers, and start that buffer's copy to the GPU on the buffer's own stream; a thread waits
# for a copy only when it reuses the buffer, two reads later. cupy's runtime calls release the GIL, so reads
# and copies of several threads overlap, and nothing takes torch's host-allocator lock per read.
# Question it answers: is the pinned ring's shortfall against fastsafetensors on a cold disk (this session's
# calls 1-2: the ring's 16 x 512 KiB reads kept 2-4 requests in flight at the disk, fastsafetensors about 6)
# Python's or torch's per-read cost, or the read pattern?
# Prints one JSON line {"bytes", "seconds", ...}; cold_shapes.py runs it as "cring:THREADSxMiB[@STREAMS]".
# Usage: python bench/diag/cupy_ring.py MODEL_DIR THREADS MIB [STREAMS]
import ctypes
import json
import os
import queue
import sys
import threading
import time

import cupy
from gdsload.loader.plan import Extent, split_extents, stream_order
from spans import data_spans

PAGE = 4096
model, threads, mib = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
streams = int(sys.argv[4]) if len(sys.argv) > 4 else threads
chunk = round(mib * 2**20) // PAGE * PAGE
spans = data_spans(model)
total = sum(n for _, _, n in spans)
cupy.cuda.Device(0).use()
arena = cupy.empty(total, dtype=cupy.uint8)
cupy.cuda.runtime.deviceSynchronize()
fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p, _, _ in spans]
extents, at = [], 0
for i, (_, off, n) in enumerate(spans):
    extents.append(Extent(i, off, n, at))
    at += n
work: queue.SimpleQueue = queue.SimpleQueue()
for c in stream_order(split_extents(extents, chunk, interleave=False, aligned=True), streams):
    work.put(c)
errors: list = []


def worker() -> None:
    cupy.cuda.Device(0).use()
    size = chunk + 2 * PAGE
    ptrs = [cupy.cuda.runtime.hostAlloc(size, 0) for _ in range(2)]  # page aligned, as O_DIRECT needs
    views = [memoryview((ctypes.c_char * size).from_address(p)).cast("B") for p in ptrs]
    copy_streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    events: list = [None, None]
    k = 0
    try:
        while True:
            try:
                c = work.get_nowait()
            except queue.Empty:
                break
            if events[k] is not None:
                events[k].synchronize()  # the copy out of this buffer (two reads ago) is done
            start = c.file_offset - c.file_offset % PAGE
            lead = c.file_offset - start
            want = lead + c.length
            length = -(-want // PAGE) * PAGE
            done = 0
            while done < want:
                got = os.preadv(fds[c.file_index], [views[k][done:length]], start + done)
                if got == 0:
                    raise EOFError(f"end of file in {spans[c.file_index][0]} at {start + done}")
                done += got
            cupy.cuda.runtime.memcpyAsync(arena.data.ptr + c.arena_offset, ptrs[k] + lead, c.length, 1,
                                          copy_streams[k].ptr)
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(copy_streams[k])
            events[k] = ev
            k ^= 1
        for ev in events:
            if ev is not None:
                ev.synchronize()
    except BaseException as e:  # noqa: BLE001 - reported in the JSON line
        errors.append(repr(e))
    finally:
        for p in ptrs:
            cupy.cuda.runtime.freeHost(p)


t = time.perf_counter()
pool = [threading.Thread(target=worker) for _ in range(threads)]
for th in pool:
    th.start()
for th in pool:
    th.join()
cupy.cuda.runtime.deviceSynchronize()
seconds = time.perf_counter() - t
ok = True
for (path, off, n), start in zip(spans, [e.arena_offset for e in extents]):  # each file's first and last MiB
    with open(path, "rb") as fh:
        for pos in (0, max(0, n - (1 << 20))):
            fh.seek(off + pos)
            want = fh.read(min(1 << 20, n - pos))
            ok &= bytes(arena[start + pos : start + pos + len(want)].get()) == want
print(json.dumps({"method": "cupy_ring", "bytes": total, "seconds": seconds, "threads": threads, "chunk": chunk,
                  "streams": streams, "bytes_match": ok, "errors": errors[:3], "direct_io": [True] * len(fds)}))
