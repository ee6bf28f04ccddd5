"""The ``demo`` command (the README's first command)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")}


def test_demo_serves_polls_reports_and_stops(tmp_path: Path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gdsload.server.cmd_demo",
            "--workdir",
            str(tmp_path / "demo"),
            "--size",
            "8MiB",
            "--timeout",
            "90",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=_env(),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "/readyz 200  0=ready 1=ready" in out
    assert "rank 0: " in out and "rank 1: " in out and out.count("verified=True") == 2  # digests checked by workers
    assert "backend=cpu io=cpu" in out and "time to ready:" in out
    assert "server stopped cleanly on SIGTERM (exit status 0)" in out
    assert (tmp_path / "demo" / "gdsload.json").exists()


def test_demo_json_is_one_document_on_stdout_and_the_steps_on_stderr(tmp_path: Path):
    """`gdsload demo --json`: stdout parses as one JSON document (each rank's report, the time to ready, a clean
    stop); the steps a person reads go to stderr."""
    import json

    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gdsload.server.cli",
            "demo",
            "--json",
            "--workdir",
            str(tmp_path / "demo"),
            "--size",
            "8MiB",
            "--timeout",
            "90",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=_env(),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert sorted(doc["ranks"]) == ["0", "1"] and doc["tp"] == 2 and doc["stopped_cleanly"] is True
    assert all(r["verified"] and r["files"] for r in doc["ranks"].values()), doc["ranks"]
    assert doc["time_to_ready_s"] >= doc["load_time_to_ready_s"] > 0
    assert "/readyz 200" in p.stderr and "server stopped cleanly" in p.stderr
