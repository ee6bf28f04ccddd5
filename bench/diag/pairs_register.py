# Diagnostic from session 10 (not installed with the package): register_tmpfs.py's variants on one GPU (the whole
# model) and on two (one rank each, both processes starting their load at one wall-clock time), taking turns.
# RANKn_DIR holds rank n's files only (symlinks into the tp=2 checkpoint do). Aggregate GB/s of a pair: both
# ranks' bytes / (last end - first start). NGPU=1 runs the one-GPU variants only.
# Usage (from the repository root): python bench/diag/pairs_register.py SINGLE_DIR RANK0_DIR RANK1_DIR ROUNDS OUT.jsonl
import json
import os
import subprocess
import sys
import time

single, r0, r1, rounds, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "register_tmpfs.py")
singles = [["kvikio"], ["defer", "1", "1024"], ["hybrid", "1", "1024", "0.3"], ["hybrid", "1", "1024", "0.45"],
           ["hybrid", "2", "512", "0.4"]]
pairs = [["kvikio"], ["defer", "1", "1024"], ["hybrid", "1", "1024", "0.5"], ["hybrid", "1", "1024", "0.7"]]
gpus = int(os.environ.get("NGPU", "2"))
with open(out, "w") as fh:
    for rnd in range(rounds):
        variants = [("single", v) for v in singles] + ([("pair", v) for v in pairs] if gpus > 1 else [])
        k = rnd % len(variants)
        for kind, v in variants[k:] + variants[:k]:
            if kind == "single":
                p = subprocess.run([sys.executable, script, single, *v], capture_output=True, text=True, timeout=60)
                rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
                rec = {"round": rnd, "kind": kind, "variant": " ".join(v), "rows": rows, "err": p.stderr[-400:] if not rows else ""}
                rec["gbps"] = rows[0]["gbps"] if rows else None
            else:
                at = time.time() + 4
                procs = [subprocess.Popen([sys.executable, script, d, *v], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env={**os.environ, "CUDA_VISIBLE_DEVICES": str(i), "GDSLOAD_DIAG_START_AT": str(at)})
                         for i, d in enumerate((r0, r1))]
                res = [p.communicate(timeout=60) for p in procs]
                rows = [json.loads(line) for o, _ in res for line in o.splitlines() if line.startswith("{")]
                rec = {"round": rnd, "kind": kind, "variant": " ".join(v), "rows": rows,
                       "err": " | ".join(e[-300:] for _, e in res) if len(rows) < 2 else ""}
                if len(rows) == 2:
                    window = max(r["wall_end"] for r in rows) - min(r["wall_start"] for r in rows)
                    rec["gbps"] = round(sum(r["bytes"] for r in rows) / window / 1e9, 2)
                    rec["per_rank"] = [r["gbps"] for r in rows]
                    rec["late"] = [r.get("late_s") for r in rows]
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            r = rec["rows"]
            print(rnd, kind, rec["variant"], rec.get("gbps"), rec.get("per_rank", ""),
                  [x.get("thread_seconds", {}).get("register") for x in r], [x.get("unregister_after") for x in r],
                  [x.get("tail_matches") and x.get("head_matches") for x in r], rec["err"][-200:], flush=True)
