"""Micro-benchmark of the ways bytes can move from a file into GPU memory without GDS.

Measures, on one file, in one process, each configuration after a warm-up:
- ``h2d``: the pinned host-to-device ceiling (no file at all);
- ``ring``: T threads ``preadv`` into their own pinned buffers, each thread copying its
  buffer to the device on its own stream while it reads the next (double buffering);
- ``register``: the file is mmapped, pieces are registered with ``cudaHostRegister``
  (read-only) and copied straight from the page cache, then unregistered;
- ``hybrid``: ring and register workers pulling pieces from one queue;
- ``kvikio``: ``CuFile.pread`` into the device buffer (compat mode where there is no GDS);
- cold variants (page cache dropped first) of ``ring`` with and without O_DIRECT.

    python -m gdsload.bench.h2d_paths --file /dev/shm/h2d.bin --size 8GiB --out results.json

It informs the design of the ``pinned`` backend; it is not the product's benchmark
(``gdsload bench`` is).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import queue
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

HOST_REGISTER_READ_ONLY = 8


def _fill(path: str, size: int) -> None:
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def _drop_caches(path: str) -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def h2d(dst: torch.Tensor, streams: int) -> float:
    buf = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    ss = [torch.cuda.Stream() for _ in range(streams)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = dst.numel() // buf.numel()
    for i in range(n):
        with torch.cuda.stream(ss[i % streams]):
            dst[i * buf.numel() : (i + 1) * buf.numel()].copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    return n * buf.numel() / (time.perf_counter() - t) / 1e9


def _ring_worker(fd: int, dst: torch.Tensor, chunk: int, next_offset) -> None:  # type: ignore[no-untyped-def]
    """One reader thread: preadv into one of two pinned buffers while the other is copied to the device."""
    size = dst.numel()
    stream = torch.cuda.Stream()
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    events: list[torch.cuda.Event | None] = [None, None]
    mvs = [memoryview(b.numpy()) for b in bufs]
    k = 0
    while (off := next_offset()) is not None:
        if events[k] is not None:
            events[k].synchronize()
        n = min(chunk, size - off)
        got = os.preadv(fd, [mvs[k][:n]], off)
        assert got == n, (got, n)
        with torch.cuda.stream(stream):
            dst[off : off + n].copy_(bufs[k][:n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        events[k] = ev
        k ^= 1
    stream.synchronize()


def ring(path: str, dst: torch.Tensor, threads: int, chunk: int, direct: bool = False) -> float:
    size = dst.numel()
    chunks = list(range(0, size, chunk))
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    it = iter(chunks)
    lock = threading.Lock()

    def next_offset() -> int | None:
        with lock:
            return next(it, None)

    torch.cuda.synchronize()
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: _ring_worker(fd, dst, chunk, next_offset), range(threads)))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    os.close(fd)
    return size / dt / 1e9


def _register_worker(mm_addr: int, src_all: torch.Tensor, dst: torch.Tensor, pieces: queue.Queue, piece: int) -> None:
    cudart = torch.cuda.cudart()
    stream = torch.cuda.Stream()
    prev = None
    while True:
        try:
            off = pieces.get_nowait()
        except queue.Empty:
            break
        n = min(piece, dst.numel() - off)
        err = cudart.cudaHostRegister(mm_addr + off, n, HOST_REGISTER_READ_ONLY)
        assert int(err) == 0, err
        with torch.cuda.stream(stream):
            dst[off : off + n].copy_(src_all[off : off + n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        if prev is not None:
            prev[0].synchronize()
            cudart.cudaHostUnregister(prev[1])
        prev = (ev, mm_addr + off)
    if prev is not None:
        prev[0].synchronize()
        cudart.cudaHostUnregister(prev[1])


def register(path: str, dst: torch.Tensor, threads: int, piece: int, ring_threads: int = 0, chunk: int = 0) -> float:
    size = dst.numel()
    f = open(path, "rb")
    mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    arr = np.frombuffer(mm, dtype=np.uint8)
    addr = arr.ctypes.data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src_all = torch.from_numpy(arr)
    pieces: queue.Queue = queue.Queue()
    for off in range(0, size, piece):
        pieces.put(off)
    fd = os.open(path, os.O_RDONLY)

    def next_piece() -> int | None:  # ring workers pull from the registration queue too
        try:
            return pieces.get_nowait()
        except queue.Empty:
            return None

    torch.cuda.synchronize()
    t = time.perf_counter()
    with ThreadPoolExecutor(threads + ring_threads) as pool:
        futs = [pool.submit(_register_worker, addr, src_all, dst, pieces, piece) for _ in range(threads)]
        futs += [pool.submit(_ring_worker, fd, dst, piece, next_piece) for _ in range(ring_threads)]
        for fu in futs:
            fu.result()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del src_all, arr
    mm.close()
    f.close()
    os.close(fd)
    return size / dt / 1e9


def kvikio_read(path: str, dst: torch.Tensor, threads: int, task: int) -> float:
    import kvikio
    import kvikio.defaults

    with kvikio.defaults.set({"num_threads": threads, "task_size": task}):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with kvikio.CuFile(path, "r") as f:
            f.pread(dst, dst.numel(), 0).get()
        torch.cuda.synchronize()
        return dst.numel() / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="/dev/shm/h2d.bin")
    ap.add_argument("--size", type=lambda s: int(float(s.rstrip("GiB")) * (1 << 30)), default=8 << 30)
    ap.add_argument("--cold-file", default=None, help="a file on real disk for the cold runs")
    ap.add_argument("--cold-size", type=lambda s: int(float(s.rstrip("GiB")) * (1 << 30)), default=4 << 30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    results: list[dict] = []

    def rec(name: str, fn, **kw):
        try:
            fn(**kw)  # warm-up (and page-cache fill)
            vals = [fn(**kw) for _ in range(2)]
            r = {"name": name, **{k: v for k, v in kw.items() if isinstance(v, (int, str, bool))},
                 "gbps": max(vals), "all": vals}
        except Exception as e:  # record and continue: one failing path must not hide the others
            r = {"name": name, **{k: v for k, v in kw.items() if isinstance(v, (int, str, bool))}, "error": repr(e)}
        print(json.dumps(r), flush=True)
        results.append(r)

    _fill(args.file, args.size)
    dst = torch.empty(args.size, dtype=torch.uint8, device="cuda")
    MiB = 1 << 20
    rec("h2d", h2d, dst=dst, streams=1)
    rec("h2d", h2d, dst=dst, streams=4)
    for threads in (8, 16, 32):
        for chunk in (16 * MiB, 64 * MiB):
            rec("ring", ring, path=args.file, dst=dst, threads=threads, chunk=chunk)
    for threads in (1, 4, 8, 16):
        for piece in (64 * MiB, 256 * MiB):
            rec("register", register, path=args.file, dst=dst, threads=threads, piece=piece)
    for reg_threads, ring_threads in ((4, 16), (8, 16), (8, 8)):
        rec("hybrid", register, path=args.file, dst=dst, threads=reg_threads, piece=64 * MiB,
            ring_threads=ring_threads)
    for threads in (16, 32, 64):
        for task in (4 * MiB, 16 * MiB):
            rec("kvikio", kvikio_read, path=args.file, dst=dst, threads=threads, task=task)

    if args.cold_file:
        _fill(args.cold_file, args.cold_size)
        cdst = dst[: args.cold_size]
        for direct in (False, True):
            for threads in (8, 32):
                vals = []
                for _ in range(2):
                    _drop_caches(args.cold_file)
                    vals.append(ring(args.cold_file, cdst, threads, 16 * MiB, direct=direct))
                r = {"name": "cold-ring", "direct": direct, "threads": threads, "gbps": max(vals), "all": vals}
                print(json.dumps(r), flush=True)
                results.append(r)
        for threads in (16, 64):
            vals = []
            for _ in range(2):
                _drop_caches(args.cold_file)
                vals.append(kvikio_read(args.cold_file, cdst, threads, 16 * MiB))
            r = {"name": "cold-kvikio", "threads": threads, "gbps": max(vals), "all": vals}
            print(json.dumps(r), flush=True)
            results.append(r)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "size": args.size, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
