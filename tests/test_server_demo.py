"""The ``demo`` command (the README's first command) and a smoke run of the /readyz load benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")}


def test_demo_serves_polls_reports_and_stops(tmp_path: Path):
    p = subprocess.run([sys.executable, "-m", "gdsload.server.cmd_demo", "--workdir", str(tmp_path / "demo"),
                        "--size", "8MiB", "--timeout", "90"], capture_output=True, text=True, timeout=150, env=_env())
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "/readyz 200  0=ready 1=ready" in out
    assert "rank 0: " in out and "rank 1: " in out and out.count("verified=True") == 2  # digests checked by workers
    assert "backend=cpu io=cpu" in out and "time to ready:" in out
    assert "server stopped cleanly on SIGTERM (exit status 0)" in out
    assert (tmp_path / "demo" / "gdsload.json").exists()


def test_readyz_benchmark_smoke(tmp_path: Path):
    p = subprocess.run([sys.executable, "-m", "gdsload.bench.readyz_load", "--size", "8MiB", "--tp", "1", "--repeat",
                        "1", "--rate", "200", "--connections", "2", "--settle", "0.2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=150, env=_env())
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((tmp_path / "results.json").read_text())
    assert sorted(r["condition"] for r in doc["runs"]) == ["idle", "polled"]
    polled = next(r for r in doc["runs"] if r["condition"] == "polled")
    assert polled["poller"]["requests"] > 0 and set(polled["poller"]["codes"]) <= {"200", "503"}
    assert doc["summary"]["poller"]["non_2xx_5xx"] == 0
    for key in ("load_seconds_max", "read_seconds_max", "time_to_ready_s"):
        assert doc["summary"][key]["idle_median"] > 0 and doc["summary"][key]["polled_median"] > 0
    assert "slowdown" in p.stdout
