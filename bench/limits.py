"""Hardware limits measured in the same run as the loaders: what no loader can beat.

- ``raw_read_gbps``: parallel reads of the same files into host memory, no GPU (O_DIRECT when
  the files are cold and the file system allows it; the bench takes the best of a few thread
  counts, read sizes and orders, since disks differ in which they prefer);
- ``raw_read_together``: the same read, one process per group of files (a rank's), all starting
  at once: what a host's readers can take together, whichever GPUs the bytes go to next;
- ``h2d_gbps``: pinned host memory to the device; ``h2d_all_gbps``: to every listed device at once
  (what several GPUs of one host can take together: their links share the host's memory);
- ``read_during_h2d``: cached reads and pinned host-to-device copies running at the same time, each
  rate over the same window: what a loader that stages bytes through host memory can reach, where
  the two share the host's memory bandwidth (each then runs below its rate alone);
- ``decode_gbps``: nvCOMP decoding the largest compressed tensor of a directory.
"""

from __future__ import annotations

import json
import mmap
import os
import selectors
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["raw_read_gbps", "raw_read_together", "h2d_gbps", "h2d_all_gbps", "read_during_h2d", "decode_gbps"]


def raw_read_gbps(
    files: list[str],
    *,
    direct: bool,
    threads: int = 32,
    chunk: int = 16 << 20,
    interleave: bool = False,
    per_file: bool = False,
) -> float:
    """Read every byte of ``files`` with ``threads`` readers into reused aligned buffers.

    Reads go file after file, or with ``interleave`` round-robin across the files (as the
    ``pinned`` ring issues them), or with ``per_file`` one reader per file, front to back
    (``threads`` is then the number of files); which one a disk prefers differs between disks.
    """
    total, seconds = _raw_read(
        files, direct=direct, threads=threads, chunk=chunk, interleave=interleave, per_file=per_file
    )
    return total / seconds / 1e9


def _raw_read(
    files: list[str],
    *,
    direct: bool,
    threads: int,
    chunk: int,
    interleave: bool = False,
    per_file: bool = False,
    ready: Any = None,
    buffer: Any = None,
) -> tuple[int, float]:
    """Bytes read and seconds taken; ``ready`` (if given) is called once the files are open, just
    before the clock starts. Each reader reads into ``buffer(nbytes)`` (a writable, page-aligned
    memoryview of at least ``nbytes``), by default an anonymous ``mmap``."""
    by_file = [
        [(f, off, min(chunk, os.path.getsize(f) - off)) for off in range(0, os.path.getsize(f), chunk)] for f in files
    ]
    if per_file:
        queues = by_file
    elif interleave:
        queues = [[q[i] for i in range(max(map(len, by_file), default=0)) for q in by_file if i < len(q)]]
    else:
        queues = [[j for q in by_file for j in q]]
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds: dict[str, int] = {}
    try:
        for f in files:
            fds[f] = os.open(f, flags)
        return _read_jobs(
            fds,
            queues,
            direct=direct,
            threads=len(files) if per_file else threads,
            chunk=chunk,
            ready=ready,
            buffer=buffer or _mmap_buffer,
        )
    finally:
        for fd in fds.values():
            os.close(fd)


def _mmap_buffer(nbytes: int) -> memoryview:
    return memoryview(mmap.mmap(-1, nbytes))  # page aligned, as O_DIRECT requires


def _read_jobs(
    fds: dict[str, int],
    queues: list[list[tuple[str, int, int]]],
    *,
    direct: bool,
    threads: int,
    chunk: int,
    ready: Any,
    buffer: Any,
) -> tuple[int, float]:
    """``threads`` readers work through ``queues``: reader i takes jobs from queue i % len(queues), in order."""
    its, lock = [iter(q) for q in queues], threading.Lock()
    if ready is not None:
        ready()

    def worker(i: int) -> int:
        it = its[i % len(its)]
        view = buffer(-(-chunk // 4096) * 4096)
        done = 0
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return done
            f, off, n = job
            length = -(-n // 4096) * 4096 if direct else n
            got = os.preadv(fds[f], [view[:length]], off)
            done += min(got, n)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(worker, range(threads)))
    return total, time.perf_counter() - t


def raw_read_together(
    groups: list[list[str]], *, threads: int = 16, chunk: int = 16 << 20, timeout: float = 120.0
) -> dict[str, Any]:
    """Each group of files read buffered (no O_DIRECT) by its own process with ``threads`` readers,
    the processes released at one moment once all have opened their files.

    Returns the aggregate GB/s (all bytes over first start to last end) and each process's GB/s.
    Raises ``RuntimeError`` when a worker fails or is not ready within ``timeout``; no worker is
    left running.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "gdsload.bench.limits", "--read-worker", str(threads), str(chunk), *g],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for g in groups
    ]
    try:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:  # each says "ready" once its files are open
            for p in procs:
                sel.register(p.stdout, selectors.EVENT_READ, p)  # type: ignore[arg-type]
            waiting = set(procs)
            while waiting:
                events = sel.select(max(0.0, deadline - time.monotonic()))
                if not events:
                    raise RuntimeError(f"host-read worker failed: not ready after {timeout:.0f} s")
                for key, _ in events:
                    p = key.data
                    if p.stdout.readline().strip() != "ready":
                        p.kill()
                        raise RuntimeError(f"host-read worker failed: {_last_line(p.communicate()[1])}")
                    sel.unregister(p.stdout)
                    waiting.discard(p)
        try:
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
        except BrokenPipeError as e:
            raise RuntimeError(f"host-read worker failed: it exited before the start ({e})") from e
        rows = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()) + timeout)
            except subprocess.TimeoutExpired as e:
                raise RuntimeError(f"host-read worker failed: not done after {timeout:.0f} s") from e
            if p.returncode != 0:
                raise RuntimeError(f"host-read worker failed: {_last_line(err)}")
            rows.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    window = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    total = sum(r["bytes"] for r in rows)
    return {
        "processes": len(rows),
        "threads": threads,
        "chunk": chunk,
        "bytes": total,
        "aggregate_gbps": total / window / 1e9 if window > 0 else 0.0,
        "per_process_gbps": [
            r["bytes"] / (r["end"] - r["start"]) / 1e9 if r["end"] > r["start"] else 0.0 for r in rows
        ],
    }


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else "no output"


def _read_worker(threads: int, chunk: int, files: list[str]) -> None:
    """One process of :func:`raw_read_together`: open, say ready, wait for go, read, report."""
    marks: dict[str, float] = {}

    def ready() -> None:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":  # the parent gave up: do not read
            sys.exit(1)
        marks["start"] = time.time()

    total, _ = _raw_read(files, direct=False, threads=threads, chunk=chunk, ready=ready)
    print(json.dumps({"start": marks["start"], "end": time.time(), "bytes": total}), flush=True)


def h2d_gbps(device: str = "cuda", nbytes: int = 1 << 30, repeat: int = 5) -> float:
    """Pinned host-to-device copy rate (best of ``repeat``)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def h2d_all_gbps(devices: list[str], nbytes: int = 1 << 30, repeat: int = 5) -> float:
    """Pinned host-to-device copies to every device in ``devices`` at once: aggregate GB/s (best of ``repeat``).

    One thread per device, each with its own pinned buffer and stream; the clock runs from the
    moment all copies are released to the moment the last one is done.
    """
    import torch

    pairs = []
    for d in devices:
        dev = torch.device(d)
        pairs.append(
            (
                dev,
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
                torch.empty(nbytes, dtype=torch.uint8, device=dev),
                torch.cuda.Stream(device=dev),
            )
        )
    best = float("inf")
    for _ in range(repeat + 1):
        start = threading.Barrier(len(pairs) + 1, timeout=60)  # a thread that failed early breaks it

        def copy(dev: Any, src: Any, dst: Any, stream: Any) -> None:
            torch.cuda.set_device(dev)
            start.wait()
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()

        for dev, *_ in pairs:
            torch.cuda.synchronize(dev)
        with ThreadPoolExecutor(len(pairs)) as pool:
            futures = [pool.submit(copy, *p) for p in pairs]
            start.wait()
            t = time.perf_counter()
            for f in futures:
                f.result()
            best = min(best, time.perf_counter() - t)
    return nbytes * len(pairs) / best / 1e9


def read_during_h2d(
    files: list[str], device: str = "cuda", *, threads: int = 16, chunk: int = 2 << 20, piece: int = 64 << 20
) -> dict[str, float]:
    """Buffered reads of ``files`` (``threads`` readers, ``chunk`` bytes each) while one stream copies a pinned
    buffer to ``device`` in ``piece``-sized copies, over and over: ``{"read_gbps", "h2d_gbps"}``, both over the
    window the reads took (copies completed in it). The files should be cached or on tmpfs.
    """
    import torch

    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device(dev.type, torch.cuda.current_device())
    src = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(piece, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(device=dev)
    stop, started = threading.Event(), threading.Event()
    stamps: list[float] = []
    failed: list[BaseException] = []

    def copier() -> None:
        try:
            torch.cuda.set_device(dev)
            pending: list[Any] = []
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    dst.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    pending.append(ev)
                    if len(pending) > 2:  # two copies queued behind the one running: the link never waits
                        pending.pop(0).synchronize()
                        stamps.append(time.perf_counter())
                        started.set()
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            failed.append(e)
            started.set()

    raw_read_gbps(files, direct=False, threads=threads, chunk=chunk)  # fills the cache
    thread = threading.Thread(target=copier, daemon=True)
    thread.start()
    started.wait(60)
    try:
        t0 = time.perf_counter()
        total, seconds = _raw_read(files, direct=False, threads=threads, chunk=chunk)
        t1 = t0 + seconds
    finally:
        stop.set()
        thread.join(60)
    if failed:
        raise failed[0]
    inside = [t for t in stamps if t0 <= t <= t1]
    if len(inside) < 2:
        raise ValueError(
            f"the reads took {seconds * 1e3:.1f} ms, too short to time {piece}-byte copies against; give larger files"
        )
    return {"read_gbps": total / seconds / 1e9, "h2d_gbps": (len(inside) - 1) * piece / (inside[-1] - inside[0]) / 1e9}


def decode_gbps(model_dir: str | Path, device: str = "cuda", repeat: int = 5) -> float | None:
    """nvCOMP decode rate of the largest compressed tensor under ``model_dir`` (decoded GB/s)."""
    import torch

    from ..loader import read_header
    from ..loader.codecs import GpuCodecs
    from ..loader.format.compression import parse_compression
    from ..loader.devices import as_device

    best_entry, best_file = None, None
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        for e in parse_compression(read_header(f)).values():
            if best_entry is None or e.nbytes > best_entry.nbytes:
                best_entry, best_file = e, f
    if best_entry is None:
        return None
    h = read_header(best_file)
    t = h[best_entry.name]
    with open(best_file, "rb") as fh:
        fh.seek(h.data_offset + t.start)
        blob = torch.frombuffer(bytearray(fh.read(t.nbytes)), dtype=torch.uint8).to(device)
    out = torch.empty(best_entry.nbytes, dtype=torch.uint8, device=device)
    codecs = GpuCodecs(as_device(device))
    best = float("inf")
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        s = time.perf_counter()
        codecs.decode(best_entry, blob, out, path=str(best_file))
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - s)
    return best_entry.nbytes / best / 1e9


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--read-worker":
        _read_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    else:
        sys.exit(
            "usage: python -m gdsload.bench.limits --read-worker THREADS CHUNK FILE... (used by raw_read_together)"
        )
