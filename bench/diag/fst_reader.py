# Diagnostic from session 12 (not installed with the package): a cold rank read by fastsafetensors' own native reader
# (the C++ nogds_file_reader its loader uses: its threads, its one cudaHostAlloc bounce block, O_DIRECT) but driven
# from here, into one cupy arena, without fastsafetensors' loader, torch or DLPack around it.
# Question it answers: is fastsafetensors' lead on a cold disk (sessions 7-10) its native reader, or something around
# it? If this matches fastsafetensors, a gdsload reader built on that native reader (or one like it) would too.
# Prints one JSON line {"bytes", "seconds", ...}; cold_shapes.py runs it as "fst:THREADSxMiB" (MiB: bounce per thread
# as fastsafetensors sizes it: bbuf_size_kb is the whole block, 16 MiB by default, shared by THREADS threads).
# Usage: python bench/diag/fst_reader.py MODEL_DIR THREADS BOUNCE_MIB
import json
import os
import sys
import time

import cupy
from fastsafetensors import cpp as fstcpp
from fastsafetensors.common import get_device_numa_node
from spans import data_spans

model, threads, mib = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
cupy.cuda.Device(0).use()
cupy.empty(1)
fstcpp.load_library_functions("")
spans = data_spans(model)
total = sum(n for _, _, n in spans)
arena = cupy.empty(total, dtype=cupy.uint8)
cupy.cuda.runtime.deviceSynchronize()
numa = get_device_numa_node(0)
reader = fstcpp.nogds_file_reader(False, round(mib * 1024), threads, True, 0, -1 if numa is None else numa)
gbuf = fstcpp.gds_device_buffer(arena.data.ptr, total, True)
fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p, _, _ in spans]
t = time.perf_counter()
reqs, at = [], 0
for fd, (_, off, n) in zip(fds, spans):
    reqs.append(reader.submit_read(fd, gbuf, off, n, at))
    at += n
failed = [r for r in reqs if reader.wait_read(r) == 0]
cupy.cuda.runtime.deviceSynchronize()
seconds = time.perf_counter() - t
ok, at = not failed, 0
for path, off, n in spans:  # each file's first and last MiB
    with open(path, "rb") as fh:
        for pos in (0, max(0, n - (1 << 20))):
            fh.seek(off + pos)
            want = fh.read(min(1 << 20, n - pos))
            ok &= bytes(arena[at + pos : at + pos + len(want)].get()) == want
    at += n
print(json.dumps({"method": "fst_reader", "bytes": total, "seconds": seconds, "threads": threads, "bounce_mib": mib,
                  "numa_node": numa, "failed": failed, "bytes_match": ok, "direct_io": [True] * len(fds)}))
