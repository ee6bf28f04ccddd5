# Diagnostic from session 6 (not installed with the package): does reading tmpfs into pinned buffers compete with H2D DMA for host memory bandwidth?
# Each scenario runs its workers together for DUR seconds and reports GB/s per worker kind.
# Usage (GPU machine): python bench/diag/host_memory.py /dev/shm/plain/model-00001-of-00004.safetensors
import json
import os
import sys
import threading
import time

import cupy
import numpy as np

path = sys.argv[1]
DUR = 2.0


def pinned(n):
    m = cupy.cuda.alloc_pinned_memory(n)
    a = np.frombuffer(m, np.uint8, n)
    a[::4096] = 1
    return a, m


def reader(bufsz, nthreads, idx, out, stop, go):
    buf, m = pinned(bufsz)
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    off = (idx * (size // nthreads)) // bufsz * bufsz
    n = 0
    go.wait()
    while not stop.is_set():
        if off + bufsz > size:
            off = 0
        n += os.preadv(fd, [buf], off)
        off += bufsz
    out.append(n)
    os.close(fd)


def h2d(dev, out, stop, go, chunk=256 << 20):
    cupy.cuda.Device(dev).use()
    src, m = pinned(chunk)
    dst = cupy.empty(chunk, cupy.uint8)
    s = cupy.cuda.Stream(non_blocking=True)
    n = 0
    go.wait()
    while not stop.is_set():
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, chunk, 1, s.ptr)
        s.synchronize()
        n += chunk
    out.append(n)


def memcpy(out, stop, go, n=256 << 20):
    a = np.ones(n, np.uint8)
    b = np.empty(n, np.uint8)
    b[:] = 0
    k = 0
    go.wait()
    while not stop.is_set():
        np.copyto(b, a)
        k += n
    out.append(k)


def run(name, kinds):
    stop, go = threading.Event(), threading.Event()
    res = {}
    ths = []
    for kind, count, fn, args in kinds:
        res[kind] = []
        for i in range(count):
            ths.append(threading.Thread(target=fn, args=(*args(i, count), res[kind], stop, go)))
    for t in ths:
        t.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    go.set()
    time.sleep(DUR)
    stop.set()
    for t in ths:
        t.join()
    dt = time.perf_counter() - t0
    r = {k: round(sum(v) / dt / 1e9, 1) for k, v in res.items()}
    print(json.dumps({"scenario": name, **r}), flush=True)


cupy.cuda.Device(0).use()
cupy.empty(1)
G = cupy.cuda.runtime.getDeviceCount()


def R(sz, t=16):
    return ("read", t, reader, lambda i, n: (sz, n, i))


H = ("h2d", G, h2d, lambda i, n: (i,))


def M(t):
    return ("memcpy", t, memcpy, lambda i, n: ())


print(json.dumps({"gpus": G}))
run("h2d", [H])
for t in (4, 8, 16):
    run(f"memcpy{t}", [M(t)])
run("memcpy8+h2d", [M(8), H])
for t in (16, 32):
    run(f"read{t}x4096K", [R(4 << 20, t)])
    run(f"read{t}x4096K+h2d", [R(4 << 20, t), H])
run("read16x1024K+h2d", [R(1 << 20), H])
