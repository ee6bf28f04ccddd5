# Diagnostic from session 6 (not installed with the package): serve --tp 2 start-up marks per worker, taking turns
# with one-GPU fresh loads of the whole model.
# Usage (GPU machine, 2 GPUs): python bench/diag/serve_startup.py TP2_DIR TP1_DIR ROUNDS
import json
import subprocess
import sys

from gdsload.bench.ttr import time_to_ready

tp2, plain, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(rounds):
    r = time_to_ready(tp2, ["--tp", "2"])
    keys = (
        "time_to_ready_s",
        "spawned_after_s",
        "imported_after_s",
        "cuda_ready_after_s",
        "worker_overhead_s",
        "load_seconds",
        "load_window_s",
        "loads_overlap_s",
        "aggregate_gbps",
        "ready_message_lag_s",
    )
    print(json.dumps({"row": "serve", "round": i, **{k: r.get(k) for k in keys}}), flush=True)
    for m in ("gdsload:pinned", "gdsload:bare"):
        p = subprocess.run(
            [sys.executable, "-m", "gdsload.bench.methods", m, plain, "cuda"], capture_output=True, text=True
        )
        try:
            x = json.loads(p.stdout.strip().splitlines()[-1])
            print(
                json.dumps({"row": "single", "round": i, "method": m, "gbps": x["bytes"] / x["seconds"] / 1e9}),
                flush=True,
            )
        except Exception:
            print(m, "failed", p.stderr[-300:], flush=True)
