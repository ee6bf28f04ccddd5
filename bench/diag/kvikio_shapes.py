# Diagnostic from session 6 (not installed with the package): kvikio compat reads of a whole checkpoint dir into one device arena, in a fresh process,
# with threads, task size and bounce-buffer size from argv; first load and later loads.
# Usage (GPU machine): python bench/diag/kvikio_shapes.py DIR THREADS TASK_BYTES BOUNCE_BYTES [warm]
import json
import sys
import time

import cupy
import kvikio
import kvikio.defaults
from spans import kvikio_arena, warm_kvikio

d, thr, task, bounce = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
spans, total, arena = kvikio_arena(d, thr, task, bounce)
warm_s = None
if len(sys.argv) > 5:  # warm kvikio's threads, streams and bounce buffers before the clock
    warm_s = warm_kvikio(spans, arena, thr, task)
times = []
for rep in range(4):
    t = time.perf_counter()
    off = 0
    futs = []
    hs = []
    for p, start, n in spans:
        f = kvikio.CuFile(p, "r")
        hs.append(f)
        futs.append(f.pread(arena[off : off + n], n, start))
        off += n
    for fu in futs:
        fu.get()
    cupy.cuda.runtime.deviceSynchronize()
    times.append(time.perf_counter() - t)
    for f in hs:
        f.close()
g = [round(total / x / 1e9, 1) for x in times]
print(
    json.dumps(
        {
            "threads": thr,
            "task_k": task >> 10,
            "bounce_k": bounce >> 10,
            "warm_s": warm_s,
            "first": g[0],
            "later": g[1:],
        }
    ),
    flush=True,
)
