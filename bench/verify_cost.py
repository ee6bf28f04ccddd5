"""What the load's checks cost: the same load with ``verify`` off and at its default, in fresh processes, turns.

Each run is ``python -m gdsload.bench.methods METHOD DIR DEVICE`` (its stopwatch: the loader's first import to
the last tensor on the device), once with ``GDSLOAD_VERIFY=0`` and once without it (every recorded checksum
checked); the two take turns, the first of each round alternating, round after round. Prints a Markdown table:
per model directory, the median and the range of each, the median overhead, and the load's own verify phase.

    python -m gdsload.bench.verify_cost /dev/shm/llama8b /dev/shm/llama8b-ans --device cuda:0 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

MODES = {"off": "0", "default": None}


def run_once(method: str, model_dir: str, device: str, verify: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("GDSLOAD_VERIFY", None)
    if verify is not None:
        env["GDSLOAD_VERIFY"] = verify
    p = subprocess.run(
        [sys.executable, "-m", "gdsload.bench.methods", method, model_dir, device],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if p.returncode:
        raise SystemExit(f"{method} {model_dir} (GDSLOAD_VERIFY={verify}) failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(dirs: list[str], method: str, device: str, rounds: int) -> dict[str, dict[str, list[dict[str, Any]]]]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {d: {m: [] for m in MODES} for d in dirs}
    for r in range(rounds):
        for d in dirs:
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                runs[d][mode].append(run_once(method, d, device, MODES[mode]))
    return runs


def table(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    lines = [
        "| model | GB | verify off: s (median, range) | default: s (median, range) | overhead (medians) | "
        "verify phase, default (median s) | verified |",
        "|---|---|---|---|---|---|---|",
    ]
    for d, by_mode in runs.items():
        off = [x["seconds"] for x in by_mode["off"]]
        on = [x["seconds"] for x in by_mode["default"]]
        phase = [x.get("phases", {}).get("verify", 0.0) for x in by_mode["default"]]
        verified = {bool(x.get("verified")) for x in by_mode["default"]}
        gb = by_mode["default"][0]["bytes"] / 1e9
        m_off, m_on = statistics.median(off), statistics.median(on)
        lines.append(
            f"| {Path(d).name} | {gb:.2f} | {m_off:.3f} ({min(off):.3f}–{max(off):.3f}) | "
            f"{m_on:.3f} ({min(on):.3f}–{max(on):.3f}) | {100 * (m_on - m_off) / m_off:+.1f} % | "
            f"{statistics.median(phase):.4f} | {', '.join(map(str, sorted(verified)))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="model directories (e.g. a plain and an ANS copy on /dev/shm)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--method", default="gdsload:auto", help="a gdsload method of gdsload.bench.methods")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write every run as JSON here")
    args = ap.parse_args(argv)
    runs = measure(args.dirs, args.method, args.device, args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    print(table(runs))


if __name__ == "__main__":
    main()
