# Diagnostic from session 7 (not installed with the package): cold loads of one checkpoint in fresh
# processes, our torch-free path with several (threads x read size) shapes against fastsafetensors,
# taking turns; the page cache is emptied before every load and its residency checked.
# Usage (GPU machine, root): python bench/diag/cold_shapes.py MODEL_DIR ROUNDS [THREADSxMiB[/PIECE_MiB] ...]
# (PIECE: bytes each kvikio task reads in order, CuFileBackend.COLD_PIECE; session 7, call 4)
import json
import os
import subprocess
import sys
from pathlib import Path

from gdsload.loader.pagecache import evict, resident_fraction

model, rounds = sys.argv[1], int(sys.argv[2])
shapes = sys.argv[3:] or ["4x16", "8x16", "16x16", "16x4", "32x16"]
files = sorted(str(p) for p in Path(model).glob("*.safetensors"))
variants = [("fastsafetensors", None)] + [("gdsload:bare", s) for s in shapes]
for i in range(rounds):
    for method, shape in variants[i % len(variants):] + variants[: i % len(variants)]:
        env = dict(os.environ)
        cmd = [sys.executable, "-m", "gdsload.bench.methods", method, model, "cuda"]
        if shape:
            shape_, _, piece = shape.partition("/")
            threads, mib = shape_.split("x")
            env.update(GDSLOAD_NUM_THREADS=threads, GDSLOAD_CHUNK_BYTES=f"{mib}MiB")
            if piece:
                cmd = [sys.executable, "-c",
                       "import runpy, sys; from gdsload.loader.backends.cufile import CuFileBackend as C; "
                       f"C.COLD_PIECE = {int(piece)} << 20; sys.argv = sys.argv[:1] + {[method, model, 'cuda']!r}; "
                       "runpy.run_module('gdsload.bench.methods', run_name='__main__')"]
        how = evict(files)
        resident = resident_fraction(files)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        row = {"round": i, "method": method, "shape": shape, "evicted_by": how, "resident_before": round(resident, 4)}
        try:
            x = json.loads(p.stdout.strip().splitlines()[-1])
            row.update(gbps=round(x["bytes"] / x["seconds"] / 1e9, 3), seconds=round(x["seconds"], 3),
                       direct_io=x.get("direct_io"), io_modes=x.get("io_modes"))
        except (ValueError, IndexError, KeyError):
            row["error"] = p.stderr[-500:]
        print(json.dumps(row), flush=True)
