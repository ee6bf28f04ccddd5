# Diagnostic from session 7 (not installed with the package): cold loads of one checkpoint in fresh
# processes, our torch-free path with several (threads x read size) shapes against fastsafetensors,
# taking turns; the page cache is emptied before every load and its residency checked.
# Usage (GPU machine, root): python bench/diag/cold_shapes.py MODEL_DIR ROUNDS [THREADSxMiB[/PIECE_MiB] ...]
# (MiB may be a fraction: 16x0.5 reads 512 KiB at a time)
# (PIECE: bytes each kvikio task reads in order, CuFileBackend.COLD_PIECE; session 7, call 4)
# A shape "raw:KIND:THREADSxMiB[:perfile]" is no loader but raw_direct.py: O_DIRECT reads into host memory
# with buffers of KIND (4k, thp, cuda; session 8).
# A shape "THREADSxMiB:ring" loads with the pinned backend's Python ring instead of kvikio: each reader reads
# its next chunk while the last one copies to the GPU (session 9).
# A shape "THREADSxMiB:buffered" reads without O_DIRECT (through the page cache, with the kernel's read-ahead,
# as Run:ai's streamer does by default; session 9). "peer:METHOD" runs another loader of gdsload.bench.methods
# (e.g. peer:runai) in the turns too. "THREADSxMiB@STREAMS" queues the reads as STREAMS sequential streams
# (CuFileBackend.COLD_STREAMS): 16x0.5@4 keeps four neighbouring 512 KiB reads in flight per stream, as
# fastsafetensors does (session 9); with ":ring", "@STREAMS" sets the ring's streams (PinnedBackend.RING_STREAMS,
# session 10).
# A shape "cring:THREADSxMiB[@STREAMS]" is no loader but cupy_ring.py: fastsafetensors' way of reading, from
# Python without torch (session 10).
# "THREADSxMiB:kvikio" keeps kvikio as the cold reader where fastsafetensors' native reader would take it (session
# 12; the loader's default since then, so plain "4x2" shapes read through that reader when it is installed).
# A shape "fst:THREADSxMiB" is no loader but fst_reader.py: fastsafetensors' native reader driven into one arena
# (session 12; MiB: its whole bounce block).
# Each row also has what the disk saw during the load (/proc/diskstats of the file's device: requests,
# their mean size, mean requests in flight; session 7, call 7).
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from gdsload.loader.pagecache import evict, resident_fraction

model, rounds = sys.argv[1], int(sys.argv[2])
shapes = sys.argv[3:] or ["4x16", "8x16", "16x16", "16x4", "32x16"]
files = sorted(str(p) for p in Path(model).glob("*.safetensors"))
dev = os.stat(files[0]).st_dev
major, minor = os.major(dev), os.minor(dev)


def diskstats() -> dict[str, list[int]]:
    """/proc/diskstats fields (reads, merged, sectors, ms reading, ..., weighted ms) of the model's device,
    or, when its files sit on a device-less file system (overlay), of every whole disk by name."""
    out: dict[str, list[int]] = {}
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            fields = [int(x) for x in parts[3:14]]
            if int(parts[0]) == major and int(parts[1]) == minor:
                return {parts[2]: fields}
            if re.fullmatch(r"(vd|sd|xvd)[a-z]+|nvme\d+n\d+", parts[2]):
                out[parts[2]] = fields
    return out


def disk_seen(before: dict[str, list[int]], after: dict[str, list[int]], seconds: float) -> dict:
    """What the busiest disk saw between ``before`` and ``after``."""
    deltas = {n: [a - b for a, b in zip(after[n], before[n])] for n in after if n in before}
    if not deltas:
        return {}
    name, d = max(deltas.items(), key=lambda kv: kv[1][2])
    reads, merged, sectors, ms_reading, weighted_ms = d[0], d[1], d[2], d[3], d[10]
    return {"disk": name, "disk_reads": reads, "disk_merged": merged,
            "disk_mib_per_read": round(sectors * 512 / max(reads, 1) / 2**20, 3),
            "disk_in_flight": round(weighted_ms / 1000 / seconds, 2) if seconds else None,
            "disk_ms_per_read": round(ms_reading / max(reads, 1), 2)}


variants = [("fastsafetensors", None)] + [
    (s[5:], None) if s.startswith("peer:") else
    ("raw" if s.startswith("raw:") else "cupy_ring" if s.startswith("cring:") else "fst_reader" if s.startswith("fst:")
     else "gdsload:bare", s) for s in shapes]
for i in range(rounds):
    for method, shape in variants[i % len(variants):] + variants[: i % len(variants)]:
        env = dict(os.environ)
        cmd = [sys.executable, "-m", "gdsload.bench.methods", method, model, "cuda"]
        if method == "raw":
            _, kind, shape_, *order = shape.split(":")
            threads, mib = shape_.split("x")
            cmd = [sys.executable, str(Path(__file__).with_name("raw_direct.py")), model, kind, threads, mib, *order]
        elif method == "cupy_ring":
            shape_, _, streams = shape[6:].partition("@")
            threads, mib = shape_.split("x")
            cmd = [sys.executable, str(Path(__file__).with_name("cupy_ring.py")), model, threads, mib,
                   *([streams] if streams else [])]
        elif method == "fst_reader":
            threads, mib = shape[4:].split("x")
            cmd = [sys.executable, str(Path(__file__).with_name("fst_reader.py")), model, threads, mib]
        elif shape:
            shape_, _, piece = shape.partition("/")
            shape_, _, how_ = shape_.partition(":")
            shape_, _, streams = shape_.partition("@")
            threads, mib = shape_.split("x")
            env.update(GDSLOAD_NUM_THREADS=threads, GDSLOAD_CHUNK_BYTES=f"{round(float(mib) * 1024)}KiB")
            patches = []
            if how_ == "buffered":  # the cufile backend then sees the rank as cached: kvikio reads through the page cache
                patches.append("c.is_cold = lambda *a: False")
            if how_ == "kvikio":  # kvikio reads the cold rank even where fastsafetensors' reader could (session 12)
                patches.append("c.CuFileBackend.COLD_READER = 'kvikio'")
            if how_ == "ring":  # the pinned backend's own O_DIRECT ring: reads go on while their copies run
                method = "gdsload:pinned"
                patches.append("import gdsload.loader.backends.pinned as p; p.has_direct_switch = lambda kv: False")
            if piece:
                patches.append(f"c.CuFileBackend.COLD_PIECE = {int(piece)} << 20")
            if streams and how_ == "ring":  # the ring's own stream count (session 10)
                patches.append(f"p.PinnedBackend.RING_STREAMS = {int(streams)}")
            elif streams:
                patches.append(f"c.CuFileBackend.COLD_STREAMS = {int(streams)}")
            if patches:
                cmd = [sys.executable, "-c",
                       ("import runpy, sys; import gdsload.loader.backends.cufile as c; " + "; ".join(patches)
                        + f"; sys.argv = sys.argv[:1] + {[method, model, 'cuda']!r}; "
                        "runpy.run_module('gdsload.bench.methods', run_name='__main__')")]
        how = evict(files)
        resident = resident_fraction(files)
        before, t0 = diskstats(), time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        seen = disk_seen(before, diskstats(), time.perf_counter() - t0)
        row = {"round": i, "method": method, "shape": shape, "evicted_by": how, "resident_before": round(resident, 4),
               **seen}
        try:
            x = json.loads(p.stdout.strip().splitlines()[-1])
            row.update(gbps=round(x["bytes"] / x["seconds"] / 1e9, 3), seconds=round(x["seconds"], 3),
                       direct_io=x.get("direct_io"), io_modes=x.get("io_modes"))
        except (ValueError, IndexError, KeyError):
            row["error"] = p.stderr[-500:]
        print(json.dumps(row), flush=True)
