# Diagnostic from session 9 (not installed with the package): copy a checkpoint's data from tmpfs to the
# GPU without a bounce buffer, by registering the file's mmapped pages with the CUDA driver, and time it.
# Question it answers: the bounce-buffer path (pread into pinned memory, then DMA) moves every byte through
# host memory three times and is bounded near 50 GB/s on the H200 hosts (RESULTS.md, sixth session);
# registering the page cache itself needs one pass, but registering 4 KiB tmpfs pages ran 10-12 GB/s.
# Is registration fast enough when the tmpfs holds the file in 2 MiB pages (huge=always)?
# Prints one JSON line per load. Modes:
#   kvikio   kvikio compat reads (16 threads x 4 MiB, 4 MiB bounce buffers): the bounce-buffer baseline
#   register T MIB   every file is mapped once; T threads take MIB pieces of the mappings, register each
#            (cuMemHostRegister, read-only), copy it to the arena on their own stream, and unregister
#            the piece before last once its copy is done
#   defer T MIB      the same, but every piece stays registered until all copies are done; the load's time
#            stops there and the unregistering after it is timed on its own ("unregister_after")
#   hybrid T MIB F   session 10: both at once, in one process: the last fraction F of the bytes goes the
#            "defer" way (T registering threads), the rest through kvikio's bounce buffers. The two are
#            bounded by different things (the driver's registration, host memory), and share the link
#   collapse MIB     madvise(MADV_COLLAPSE) over each file's mapping in MIB pieces: makes a tmpfs file's
#            pages huge in place (kernel >= 6.1); then prints how much of the mapping is PMD-mapped
# With GDSLOAD_DIAG_START_AT=<epoch seconds> set, the load starts at that time (after CUDA and the arena are
# ready), so that processes on several GPUs load at once; every row has its wall-clock start and end.
# Usage: python bench/diag/register_tmpfs.py MODEL_DIR kvikio|register T MIB|defer T MIB|hybrid T MIB F|collapse MIB
import ctypes
import json
import mmap
import os
import queue
import sys
import threading
import time

from spans import data_spans

MADV_COLLAPSE = 25
CU_MEMHOSTREGISTER_READ_ONLY = 0x08
PAGE = 4096
HUGE = 2 << 20
MAP_FIXED = 0x10

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def map_file(path: str) -> tuple[int, int]:
    """Map ``path`` read-only at a 2 MiB-aligned address (so 2 MiB pages of the file can be PMD-mapped)."""
    size = os.path.getsize(path)
    fail = ctypes.c_void_p(-1).value
    room = libc.mmap(None, size + HUGE, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if room in (None, fail):
        raise OSError(ctypes.get_errno(), "mmap")
    aligned = (room + HUGE - 1) // HUGE * HUGE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(aligned, size, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
    finally:
        os.close(fd)
    if addr in (None, fail):
        raise OSError(ctypes.get_errno(), f"mmap {path}")
    if aligned > room:  # give back the reservation around the file's mapping
        libc.munmap(room, aligned - room)
    libc.munmap(aligned + size, room + size + HUGE - (aligned + size))
    return addr, size


def pmd_mapped_kb(addr: int) -> dict:
    """The smaps counters of the mapping at ``addr`` that say how much of it is mapped in 2 MiB pages."""
    out, inside = {}, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head in ("Rss:", "FilePmdMapped:", "ShmemPmdMapped:"):
                out[head[:-1]] = int(line.split()[1])
    return out


def mount_of(path: str) -> str:
    best = ("", "")
    with open("/proc/mounts") as fh:
        for line in fh:
            _dev, mnt, fs, opts = line.split()[:4]
            if path.startswith(mnt) and len(mnt) > len(best[0]):
                best = (mnt, f"{fs} {opts}")
    return best[1]


def wait_for_start(info: dict) -> None:
    """Sleep until GDSLOAD_DIAG_START_AT (epoch seconds), when set; note the wall-clock start."""
    at = os.environ.get("GDSLOAD_DIAG_START_AT")
    if at:
        late = time.time() - float(at)
        info["late_s"] = round(late, 3)  # > 0: this process was not ready when the others started
        if late < 0:
            time.sleep(-late)
    info["wall_start"] = round(time.time(), 4)


def main() -> None:
    model, mode = sys.argv[1], sys.argv[2]
    spans = data_spans(model)
    total = sum(n for _, _, n in spans)
    info = {"dir": model, "mode": mode, "args": sys.argv[3:], "bytes": total, "mount": mount_of(os.path.abspath(model))}
    if mode == "collapse":
        piece = int(float(sys.argv[3]) * 2**20)
        t = time.perf_counter()
        fails = 0
        for path, _, _ in spans:
            addr, size = map_file(path)
            for off in range(0, size // (2 << 20) * (2 << 20), piece):
                n = min(piece, size // (2 << 20) * (2 << 20) - off)
                if libc.madvise(addr + off, n, MADV_COLLAPSE) != 0:
                    fails += 1
                    info.setdefault("errno", os.strerror(ctypes.get_errno()))
            info.setdefault("smaps_first_file", pmd_mapped_kb(addr))
            libc.munmap(addr, size)
        info.update(seconds=round(time.perf_counter() - t, 3), failed_pieces=fails)
        print(json.dumps(info))
        return

    if mode not in ("kvikio", "register", "defer", "hybrid"):
        raise SystemExit(f"unknown mode {mode!r}")
    import cupy

    cupy.cuda.Device(0).use()
    arena = cupy.empty(total, dtype=cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
    kvikio_cut = total  # bytes [0, kvikio_cut) of the arena come through kvikio, the rest by registering
    if mode == "hybrid":
        kvikio_cut = int(total * (1 - float(sys.argv[5]))) // PAGE * PAGE
    elif mode in ("register", "defer"):
        kvikio_cut = 0
    files, futs = [], []
    if kvikio_cut:
        import kvikio
        import kvikio.defaults

        kvikio.defaults.set({"num_threads": 16, "task_size": 4 << 20, "bounce_buffer_size": 4 << 20,
                             "compat_mode": kvikio.CompatMode.ON})
        files = [kvikio.CuFile(p, "r") for p, _, _ in spans]
    if mode in ("register", "defer", "hybrid"):
        threads, piece = int(sys.argv[3]), int(float(sys.argv[4]) * 2**20)
        cuda = ctypes.CDLL("libcuda.so.1")  # ctypes releases the GIL: registrations of several threads overlap
        cuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        cuda.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    wait_for_start(info)
    t = time.perf_counter()
    at = 0
    for f, (_, off, n) in zip(files, spans):  # kvikio's share: every file's bytes below the cut
        take = max(0, min(n, kvikio_cut - at))
        if take:
            futs.append(f.pread(arena[at : at + take], take, off))
        at += n
    if kvikio_cut < total:
        spent = {"register": 0.0, "unregister": 0.0, "map": 0.0}
        lock = threading.Lock()
        t0 = time.perf_counter()
        maps = [map_file(p) for p, _, _ in spans]
        spent["map"] = time.perf_counter() - t0
        work: queue.Queue = queue.Queue()
        at = 0
        for (addr, _), (_, off, n) in zip(maps, spans):
            first = off + max(0, kvikio_cut - at)  # the file's first byte past the cut
            lo = first // PAGE * PAGE  # registered ranges start on a page; the copy skips the lead
            for p in range(lo, off + n, piece):
                start, end = max(p, first), min(p + piece, off + n)
                work.put((addr + p, min(p + piece, off + n) - p, addr + start, at + start - off, end - start))
            at += n
        errors: list = []
        deferred: list = []  # registered addresses left for after the load ("defer", "hybrid")

        def worker() -> None:
            cupy.cuda.Device(0).use()
            stream = cupy.cuda.Stream(non_blocking=True)
            held: list = []  # (registered address, event after its copy)
            mine = {"register": 0.0, "unregister": 0.0}
            while True:
                try:
                    base, span, src, dst_off, n = work.get_nowait()
                except queue.Empty:
                    break
                t0 = time.perf_counter()
                rc = cuda.cuMemHostRegister_v2(base, span, CU_MEMHOSTREGISTER_READ_ONLY)
                mine["register"] += time.perf_counter() - t0
                if rc != 0:
                    errors.append(f"cuMemHostRegister rc={rc}")
                    break
                cupy.cuda.runtime.memcpyAsync(arena.data.ptr + dst_off, src, n, 1, stream.ptr)
                ev = cupy.cuda.Event(disable_timing=True)
                ev.record(stream)
                held.append((base, ev))
                while mode == "register" and len(held) > 2:  # two stay registered: the one copying, the one before
                    b, e = held.pop(0)
                    e.synchronize()
                    t0 = time.perf_counter()
                    cuda.cuMemHostUnregister(b)
                    mine["unregister"] += time.perf_counter() - t0
            for _, e in held:
                e.synchronize()
            if mode == "register":
                t0 = time.perf_counter()
                for b, _ in held:
                    cuda.cuMemHostUnregister(b)
                mine["unregister"] += time.perf_counter() - t0
            else:
                deferred.extend(b for b, _ in held)
            with lock:
                for k, v in mine.items():
                    spent[k] += v

        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
    for fu in futs:
        fu.get()
    cupy.cuda.runtime.deviceSynchronize()
    seconds = time.perf_counter() - t
    info["wall_end"] = round(time.time(), 4)
    if kvikio_cut < total:
        t0 = time.perf_counter()
        for b in deferred:
            cuda.cuMemHostUnregister(b)
        info["unregister_after"] = round(time.perf_counter() - t0, 3)
        if errors:
            info["errors"] = errors[:3]
        info["smaps_first_file"] = pmd_mapped_kb(maps[0][0])
        info["thread_seconds"] = {k: round(v, 3) for k, v in spent.items()}
        info["registered_bytes"] = total - kvikio_cut
        for addr, size in maps:
            libc.munmap(addr, size)
    for f in files:
        f.close()
    # Check the bytes: the arena's first MiB (kvikio's share in "hybrid") and last MiB against the files.
    path, off, n = spans[-1]
    with open(path, "rb") as fh:
        fh.seek(off + n - (1 << 20))
        want = fh.read(1 << 20)
    info["tail_matches"] = bytes(arena[total - (1 << 20) :].get()) == want
    path, off, n = spans[0]
    with open(path, "rb") as fh:
        fh.seek(off)
        want = fh.read(min(n, 1 << 20))
    info["head_matches"] = bytes(arena[: len(want)].get()) == want
    info.update(seconds=round(seconds, 4), gbps=round(total / seconds / 1e9, 2))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
