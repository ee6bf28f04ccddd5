# Diagnostic from session 7 (not installed with the package): `serve` with workers forked from the
# preloaded fork server against spawned ones, taking turns; each run also reloads the same model.
# Then a fresh one-GPU load of the whole model per round, for the ratio.
# Usage (GPU machine): python bench/diag/worker_start.py TP_DIR TP ONE_GPU_DIR ROUNDS
import json
import subprocess
import sys

from gdsload.bench.ttr import time_to_ready

tp_dir, tp, plain, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
keys = ("time_to_ready_s", "spawned_after_s", "entered_after_s", "imported_after_s", "cuda_ready_after_s",
        "load_seconds", "load_window_s", "loads_overlap_s", "aggregate_gbps")
for i in range(rounds):
    for method in ("forkserver", "spawn") if i % 2 == 0 else ("spawn", "forkserver"):
        r = time_to_ready(tp_dir, ["--tp", tp, "--worker-start", method], reload=True, timeout=120)
        if "error" in r:
            print(json.dumps({"row": "serve", "round": i, "worker_start": method, "error": r["error"]}), flush=True)
            continue
        reload = r.get("reload") or {}
        print(json.dumps({"row": "serve", "round": i, "worker_start": method, **{k: r.get(k) for k in keys},
                          "reload": {k: reload.get(k) for k in ("reload_to_ready_s", "error", *keys[1:])}}),
              flush=True)
    p = subprocess.run([sys.executable, "-m", "gdsload.bench.methods", "gdsload:bare", plain, "cuda"],
                       capture_output=True, text=True)
    try:
        x = json.loads(p.stdout.strip().splitlines()[-1])
        print(json.dumps({"row": "single", "round": i, "gbps": x["bytes"] / x["seconds"] / 1e9}), flush=True)
    except (ValueError, IndexError, KeyError):
        print(json.dumps({"row": "single", "round": i, "error": p.stderr[-500:]}), flush=True)
