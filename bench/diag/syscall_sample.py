# Diagnostic from session 8 (not installed with the package): what reads a loader issues, seen from
# outside. Runs one cold load (a bench.methods method, or raw_direct.py) in a child process and samples
# /proc/PID/task/*/syscall every ~0.3 ms: for each thread caught in a read syscall it records the call,
# the descriptor, the size asked for, the file offset and the buffer address. Prints one JSON summary:
# read sizes, how many threads sat in a read at once, whether each descriptor was read front to back,
# how many distinct buffers were used. (Needs root or ptrace rights over the child; Linux x86_64.)
# Usage (GPU machine, root): python bench/diag/syscall_sample.py MODEL_DIR METHOD [THREADSxMiB]
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gdsload.loader.pagecache import evict

SYSCALLS = {0: "read", 17: "pread64", 19: "readv", 295: "preadv", 327: "preadv2", 426: "io_uring_enter",
            209: "io_submit", 208: "io_getevents"}
model, method = sys.argv[1], sys.argv[2]
env = dict(os.environ)
if len(sys.argv) > 3:
    threads, mib = sys.argv[3].split("x")
    env.update(GDSLOAD_NUM_THREADS=threads, GDSLOAD_CHUNK_BYTES=f"{round(float(mib) * 1024)}KiB")
files = sorted(str(p) for p in Path(model).glob("*.safetensors"))
evict(files)
if method.startswith("raw:"):
    _, kind, shape, *order = method.split(":")
    t, m = shape.split("x")
    cmd = [sys.executable, str(Path(__file__).with_name("raw_direct.py")), model, kind, t, m, *order]
else:
    cmd = [sys.executable, "-m", "gdsload.bench.methods", method, model, "cuda"]
p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
task_dir = f"/proc/{p.pid}/task"
samples: list[tuple[float, int, str, int, int, int, int]] = []  # (t, tid, call, fd, size, offset, buf)
concurrency: list[int] = []
fd_targets: dict[int, str] = {}
fd_direct: dict[str, bool] = {}  # path -> opened with O_DIRECT (from /proc/PID/fdinfo)
t0 = time.perf_counter()
while p.poll() is None:
    now = time.perf_counter() - t0
    in_read = 0
    try:
        tids = os.listdir(task_dir)
    except OSError:
        break
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/syscall") as f:
                parts = f.read().split()
        except OSError:
            continue
        if not parts or parts[0] in ("running", "-1"):
            continue
        nr = int(parts[0])
        if nr not in SYSCALLS:
            continue
        args = [int(a, 16) for a in parts[1:7]]
        in_read += 1
        fd = args[0]
        if nr in (0, 17, 19, 295, 327) and not fd_targets.get(fd, "").endswith(".safetensors"):
            try:  # descriptors are reused: the child opened other files before the checkpoint's
                fd_targets[fd] = os.readlink(f"/proc/{p.pid}/fd/{fd}")
                with open(f"/proc/{p.pid}/fdinfo/{fd}") as info:
                    flags = int(next(x for x in info if x.startswith("flags:")).split()[1], 8)
                fd_direct[fd_targets[fd]] = bool(flags & os.O_DIRECT)
            except (OSError, StopIteration):
                pass
        # pread64(fd, buf, count, offset); preadv/preadv2(fd, iov, iovcnt, pos_l, pos_h[, flags])
        size, buf = (args[2], args[1]) if nr in (0, 17) else (-1, args[1])
        if nr in (19, 295, 327):  # the first iovec (base, len), read from the child's memory
            try:
                with open(f"/proc/{p.pid}/mem", "rb") as mem:
                    mem.seek(args[1])
                    raw = mem.read(16)
                buf, size = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")
            except (OSError, ValueError, OverflowError):
                pass
        offset = args[3] if nr in (17, 295, 327) else -1
        samples.append((now, int(tid), SYSCALLS[nr], fd, size, offset, buf))
    concurrency.append(in_read)
    time.sleep(0.0003)
out, err = p.communicate()
reads = [s for s in samples if s[2] in ("pread64", "read", "preadv", "preadv2")
         and fd_targets.get(s[3], "").endswith(".safetensors")]
by_call = collections.Counter(s[2] for s in samples)
sizes = collections.Counter(s[4] for s in reads)
busy = [c for c in concurrency if c]
per_fd: dict[int, list[int]] = collections.defaultdict(list)
for s in reads:
    if s[5] >= 0 and (not per_fd[s[3]] or per_fd[s[3]][-1] != s[5]):
        per_fd[s[3]].append(s[5])
order = {fd_targets.get(fd, str(fd)).rsplit("/", 1)[-1]: {
    "distinct_offsets": len(offs), "ascending": sum(b > a for a, b in zip(offs, offs[1:])),
    "descending": sum(b < a for a, b in zip(offs, offs[1:])), "first_offsets_mib": [o >> 20 for o in offs[:12]]}
    for fd, offs in per_fd.items()}
for fd in per_fd:
    order[fd_targets.get(fd, str(fd)).rsplit("/", 1)[-1]]["o_direct"] = fd_direct.get(fd_targets.get(fd, ""))
threads_reading = collections.Counter(s[1] for s in reads)
try:
    result = json.loads(out.strip().splitlines()[-1])
    gbps = round(result["bytes"] / result["seconds"] / 1e9, 3)
except (ValueError, IndexError, KeyError):
    gbps, result = None, {"error": err[-400:]}
print(json.dumps({
    "method": method, "shape": sys.argv[3] if len(sys.argv) > 3 else None, "gbps": gbps,
    "samples": len(concurrency), "calls_seen": dict(by_call),
    "read_sizes_kib": {str(k >> 10): v for k, v in sizes.most_common(6)},
    "threads_in_read_median": statistics.median(busy) if busy else 0, "threads_in_read_max": max(busy, default=0),
    "reading_threads": len(threads_reading), "distinct_buffers": len({s[6] for s in reads}),
    "buffer_low_bits_kib": sorted({(s[6] % (2 << 20)) >> 10 for s in reads})[:8],
    "per_file": order}))
