# Diagnostic from session 6 (not installed with the package): where a fresh process's first kvikio load loses time against later loads.
# argv: dir variant; variants: none | warm | warm-sleep | dma | warm-dma. Reads in 64 MiB preads, completion timeline.
# Usage (GPU machine): python bench/diag/kvikio_first_load.py DIR none|warm|warm-sleep|dma|warm-dma
import json
import sys
import time

import cupy
import kvikio
import kvikio.defaults
from spans import kvikio_arena, warm_kvikio

d, variant = sys.argv[1], sys.argv[2]
THR, TASK = 16, 4 << 20
spans, total, arena = kvikio_arena(d, THR, TASK, TASK)
pre = {}
if "warm" in variant:
    pre["warm_s"] = warm_kvikio(spans, arena, THR, TASK)
if "dma" in variant:
    src = cupy.cuda.alloc_pinned_memory(256 << 20)
    t = time.perf_counter()
    k = 0
    while time.perf_counter() - t < 0.2:
        cupy.cuda.runtime.memcpy(arena.data.ptr, src.ptr, 256 << 20, 1)
        k += 1
    pre["dma_gbps"] = round(k * (256 << 20) / (time.perf_counter() - t) / 1e9, 1)
if "sleep" in variant:
    time.sleep(0.5)


def load():
    t = time.perf_counter()
    futs = []
    hs = []
    off = 0
    piece = 64 << 20
    for p, start, n in spans:
        f = kvikio.CuFile(p, "r")
        hs.append(f)
        for o in range(0, n, piece):
            m = min(piece, n - o)
            futs.append((m, f.pread(arena[off + o : off + o + m], m, start + o)))
        off += n
    t_sub = time.perf_counter() - t
    pending = list(futs)
    done_bytes = 0
    marks = {}
    while pending:
        still = []
        for m, fu in pending:
            if fu.done():
                fu.get()
                done_bytes += m
            else:
                still.append((m, fu))
        pending = still
        for q in (0.1, 0.5, 0.9):
            if q not in marks and done_bytes >= q * total:
                marks[q] = round(time.perf_counter() - t, 4)
        if pending:
            time.sleep(0.0002)
    cupy.cuda.runtime.deviceSynchronize()
    s = time.perf_counter() - t
    for f in hs:
        f.close()
    return {
        "s": round(s, 4),
        "gbps": round(total / s / 1e9, 1),
        "submit_s": round(t_sub, 4),
        "t10": marks.get(0.1),
        "t50": marks.get(0.5),
        "t90": marks.get(0.9),
        "mid_gbps": round(0.4 * total / (marks[0.9] - marks[0.5]) / 1e9, 1),
    }


first = load()
later = [load() for _ in range(2)]
print(
    json.dumps(
        {
            "variant": variant,
            **pre,
            "first": first,
            "later": [x["gbps"] for x in later],
            "later_t10": [x["t10"] for x in later],
        }
    ),
    flush=True,
)
