"""Smoke test of ``bench/shard_rss.py`` on a tiny checkpoint (the real figure comes from a 2 GB run)."""

from __future__ import annotations

import json
import subprocess
import sys

from gdsload.loader import Manifest


def test_shard_rss_bench_runs_and_reports(tmp_path):
    work = tmp_path / "bench"
    p = subprocess.run(
        [sys.executable, "-m", "gdsload.bench.shard_rss", "--size", "12MB", "--tp", "2", "--quantize", "fp8",
         "--out", str(work), "--keep", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    assert result["source"]["bytes"] > 10_000_000 and result["source"]["files"] >= 1
    assert 0 < result["baseline_rss_bytes"] < result["peak_rss_bytes"] <= result["bound_bytes"]
    assert result["within_bound"] and result["command"].startswith("gdsload shard ")
    assert json.loads((work / "results.json").read_text()) == result
    manifest = Manifest.read(work / "sharded")
    assert manifest.tp_size == 2 and manifest.extra["shard"]["quantize"] == "fp8:per-tensor"


def test_shard_rss_without_keep_removes_only_what_it_made(tmp_path):
    work = tmp_path / "bench"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    p = subprocess.run([sys.executable, "-m", "gdsload.bench.shard_rss", "--size", "12MB", "--tp", "2",
                        "--out", str(work)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in work.iterdir()) == ["notes.txt", "results.json"]
    assert json.loads((work / "results.json").read_text())["within_bound"]
