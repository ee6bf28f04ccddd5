"""The training-checkpoint benchmarks run end to end on a tiny state (the figures come from bench/, not tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gdsload.bench import ckpt_bench


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory):
    return ckpt_bench.prepare(2 << 20, tmp_path_factory.mktemp("state"), steps=1)


@pytest.mark.parametrize("method", ckpt_bench.METHODS)
def test_every_method_saves_and_restores_bit_exact(state, tmp_path, method):
    row = ckpt_bench.run_one(method, state, tmp_path / "out", "cpu")
    assert row["bit_exact"] and row["written_bytes"] > 0 and 0 < row["stall_s"] <= row["save_s"]
    if method.endswith("-async"):  # a second save's stall, from the same process
        assert 0 < row["next_stall_s"] < row["save_s"] + 60
    else:
        assert row["next_stall_s"] is None
    if method.startswith("gdsload") or "zstd" in method:
        assert row["ratio"] > 1.02  # the compressed methods write fewer bytes than the state holds


def test_rounds_run_each_method_in_a_fresh_process_and_summarise(state, tmp_path):
    doc = ckpt_bench.run(state, tmp_path, ["torch.save", "gdsload-dcp-async"], 1, "cpu")
    assert [e["method"] for e in doc["summary"]] == ["torch.save", "gdsload-dcp-async"]
    table = ckpt_bench.table(doc)
    assert "| gdsload-dcp-async |" in table and "| torch.save |" in table
    assert doc["summary"][0]["next_stall_s"] is None and doc["summary"][1]["next_stall_s"]["median"] > 0


def test_the_ratio_bench_reports_each_part(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gdsload.bench.ckpt_ratio",
            "--steps",
            "2",
            "--scale",
            "1",
            "--models",
            "dense",
            "--codecs",
            "zstd,zstd+planes",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    ratios = json.loads(out.read_text())["models"]["dense"]["ratios"]
    assert set(ratios) == {"zstd", "zstd+planes"}
    for codec in ratios.values():
        assert set(codec) == {"weights", "exp_avg", "exp_avg_sq"} and all(r["ratio"] > 1 for r in codec.values())
