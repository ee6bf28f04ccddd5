# Diagnostic from session 10 (not installed with the package): load_rank_bare on one GPU (rank 0 of DIR) or on
# two (ranks 0 and 1 of DIR, one process per GPU), every process starting its load at one wall-clock time after
# its CUDA context and imports are ready; rows carry the load's phases, the decoder's busy time and the staging.
# STAGING_MIB sets load_compressed's staging size (per buffer until session 11, all buffers together since). Variants take turns, round after round.
# Usage: python bench/diag/pairs_bare.py drive ROUNDS OUT.jsonl VARIANT...   VARIANT = single:DIR | pair:DIR[:STAGING_MIB]
#        (python bench/diag/pairs_bare.py worker DIR RANK START_AT [STAGING_MIB] is one process of it)
import json
import os
import subprocess
import sys
import time

if sys.argv[1] == "worker":
    d, r, at = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    import cupy
    cupy.cuda.Device(0).use()
    cupy.empty(1)
    import gdsload.loader.decode as dec
    import kvikio  # noqa: F401 - imported before the start, as a sidecar worker has
    import nvidia.nvcomp  # noqa: F401
    from gdsload.loader.bare import load_rank_bare
    if len(sys.argv) > 5:
        dec.load_compressed.__kwdefaults__["staging_bytes"] = int(sys.argv[5]) << 20
    late = time.time() - at
    while time.time() < at:
        time.sleep(0.0005)
    s = time.time()
    res = load_rank_bare(d, r, device_index=0)
    cupy.cuda.runtime.deviceSynchronize()
    e = time.time()
    rep = res.report
    print(json.dumps({"rank": r, "start": s, "end": e, "late": round(late, 3), "bytes": rep.logical_bytes,
                      "stored": rep.stored_bytes,
                      "phases": {k: round(v, 4) for k, v in rep.phases.items()},
                      "decode_busy": round(rep.decode_busy_seconds, 4), "staging": rep.staging_bytes}))
    sys.exit(0)

rounds, out, variants = int(sys.argv[2]), sys.argv[3], sys.argv[4:]
with open(out, "w") as fh:
    for rnd in range(rounds):
        k = rnd % len(variants)
        for v in variants[k:] + variants[:k]:
            kind, d, *rest = v.split(":")
            ranks = [0] if kind == "single" else [0, 1]
            at = time.time() + 3.5
            procs = [subprocess.Popen([sys.executable, __file__, "worker", d, str(r), str(at), *rest], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": str(r)})
                     for r in ranks]
            res = [p.communicate(timeout=60) for p in procs]
            rows = [json.loads(line) for o, _ in res for line in o.splitlines() if line.startswith("{")]
            rec = {"round": rnd, "variant": v, "rows": rows, "err": " | ".join(e[-300:] for _, e in res) if len(rows) < len(ranks) else ""}
            if len(rows) == len(ranks):
                window = max(r["end"] for r in rows) - min(r["start"] for r in rows)
                rec["gbps"] = round(sum(r["bytes"] for r in rows) / window / 1e9, 2)
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            print(rnd, v, rec.get("gbps"), [(round(r["end"] - r["start"], 3), r["phases"].get("read"), r["phases"].get("decode"), r["decode_busy"], r["late"]) for r in rows], rec["err"][-300:], flush=True)
