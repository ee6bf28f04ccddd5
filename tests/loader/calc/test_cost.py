"""``gdsload cost`` and :mod:`gdsload.loader.calc.cost`: exact money math, report files, errors, the CLI."""

from __future__ import annotations

import doctest
import json
import math

import pytest
from click.testing import CliRunner

import gdsload.loader.calc.cost as cost_module
import gdsload.server.cli as cli_module
from gdsload.loader import ConfigError, GdsloadError
from gdsload.loader.calc.cost import GB, CostInputs, checkpoint_cost, parse_duration, read_report
from gdsload.server.cmd_cost import cost as cost_command

# Round numbers: 100 GB, ratio 2, 10 GB/s per GPU × 4 GPUs, 10 GB/s storage, $2/GPU-h, hourly, keep 3, $0.10/GB-month.
SMALL = dict(
    checkpoint_bytes=100 * GB,
    ratio=2.0,
    compress_gbps=10.0,
    write_gbps=10.0,
    gpus=4,
    gpu_hour_usd=2.0,
    interval_s=3600.0,
    retention=3,
    storage_usd_gb_month=0.10,
)


def test_doctests() -> None:
    assert doctest.testmod(cost_module).failed == 0


def test_small_case_by_hand() -> None:
    r = checkpoint_cost(CostInputs(**SMALL))
    assert r.compressed_bytes == 50 * GB and r.compress_gbps_aggregate == 40
    assert (r.write_raw_s, r.compress_s, r.write_compressed_s) == (10.0, 2.5, 5.0)
    assert (r.wait_pipelined_s, r.wait_serial_s, r.bound) == (5.0, 7.5, "write")  # max(2.5, 5), 2.5 + 5
    assert (r.saved_s, r.saved_serial_s) == (5.0, 2.5)
    assert r.checkpoints_per_month == 720  # 30 days / 1 h
    assert r.idle_saved_gpu_s == 20 and r.idle_saved_gpu_s_month == 14_400  # 5 s × 4 GPUs × 720
    assert r.idle_raw_usd_month == pytest.approx(10 * 720 * 4 / 3600 * 2)  # $16
    assert r.idle_saved_usd_month == pytest.approx(8.0)  # 4 GPU-h × $2
    assert r.idle_saved_serial_usd_month == pytest.approx(4.0)
    assert (r.stored_raw_gb, r.stored_compressed_gb, r.storage_saved_gb) == (300, 150, 150)
    assert r.storage_saved_usd_month == pytest.approx(15.0)
    assert r.total_saved_usd_month == pytest.approx(23.0)
    assert (r.written_raw_gb_month, r.written_compressed_gb_month) == (72_000, 36_000)
    # aggregate scope: 40 GB/s for the whole job is the same thing
    agg = checkpoint_cost(CostInputs(**{**SMALL, "compress_gbps": 40.0, "compress_scope": "aggregate"}))
    assert agg.compress_s == 2.5 and agg.total_saved_usd_month == pytest.approx(23.0)


def test_every_formula_shows_its_inputs() -> None:
    f = "\n".join(checkpoint_cost(CostInputs(**SMALL)).formulas)
    for text in (
        "100.000 GB / ratio 2 = 50.000 GB",
        "10 GB/s per GPU × 4 GPUs = 40.000 GB/s",
        "max(2.500, 5.000) = 5.000 s (write-bound)",
        "2.500 + 5.000 = 7.500 s",
        "2,592,000 s / 3,600 s = 720.00",
        "150.0 GB × $0.1/GB-month = $15.00",
    ):
        assert text in f, text


def test_nvcomp_article_idle_cost() -> None:
    """NVIDIA's article: 782 GB at 5 GB/s = 156.4 s, 1440 checkpoints a month, 8 GPUs at $4.40: ~$2,200."""
    r = checkpoint_cost(CostInputs(782 * GB, 1.0, 50.0, 5.0, 8, 4.40, parse_duration("30m"), 1, 0.0))
    assert r.write_raw_s == pytest.approx(156.4) and r.checkpoints_per_month == 1440
    assert r.idle_raw_usd_month == pytest.approx(156.4 * 1440 * 8 / 3600 * 4.40) == pytest.approx(2202.112)
    assert r.written_raw_gb_month == pytest.approx(1_126_080)  # the article's "1.13 PB"
    assert r.saved_s <= 0 and r.storage_saved_gb == 0  # ratio 1.0 saves nothing


def test_compress_bound_costs_time_and_break_even() -> None:
    # 5 GB/s aggregate compression in front of 10 GB/s storage: compressing makes the wait longer
    r = checkpoint_cost(CostInputs(**{**SMALL, "compress_gbps": 5.0, "compress_scope": "aggregate"}))
    assert (r.compress_s, r.wait_pipelined_s, r.bound, r.saved_s, r.saved_serial_s) == (
        20.0,
        20.0,
        "compress",
        -10.0,
        -15.0,
    )
    assert r.idle_saved_usd_month < 0 < r.storage_saved_usd_month
    be = "\n".join(r.breakeven)
    assert "5.00 GB/s <= 10 GB/s" in be and "does not save time" in be
    assert "write rate × r/(r-1) = 20.00 GB/s" in be  # 10 × 2 / (2 - 1)
    assert "storage faster than 5.00 GB/s (pipelined) or 2.50 GB/s (unpipelined)" in be
    ok = "\n".join(checkpoint_cost(CostInputs(**SMALL)).breakeven)
    assert "40.00 GB/s > 10 GB/s (per GPU: needs > 2.500 GB/s) -> saves time" in ok
    assert "a ratio above 4.00" in ok  # 40 / 10


def test_note_when_checkpoint_outlasts_interval() -> None:
    r = checkpoint_cost(CostInputs(**{**SMALL, "interval_s": 8.0}))
    assert any("not less than the 8 s interval" in n for n in r.notes)


def test_parse_duration() -> None:
    assert [parse_duration(v) for v in ("30m", "1.5h", "2d", "90", "45s", "10 min")] == [
        1800,
        5400,
        172800,
        90,
        45,
        600,
    ]
    with pytest.raises(ConfigError, match=r"--interval 'soon' is not a duration"):
        parse_duration("soon")
    with pytest.raises(ConfigError, match="positive"):
        parse_duration("0s")


@pytest.mark.parametrize(
    "override, words",
    [
        ({"ratio": 0.5}, ["--ratio", "= 0.5", ">= 1.0"]),
        ({"compress_scope": "all"}, ["--compress-scope", "'all'", "per-gpu, aggregate"]),
        ({"gpus": 0}, ["--gpus", "= 0", "positive integer"]),
        ({"retention": 0}, ["--retention", "= 0"]),
        ({"write_gbps": -1.0}, ["--write-gbps", "= -1.0", "positive"]),
        ({"compress_gbps": math.nan}, ["--compress-gbps", "nan"]),
        ({"gpu_hour_usd": -2.0}, ["--gpu-hour-usd", "non-negative"]),
        ({"checkpoint_bytes": 0}, ["--size", "= 0"]),
    ],
)
def test_validation_errors(override, words) -> None:
    with pytest.raises(ConfigError) as e:
        CostInputs(**{**SMALL, **override})
    assert isinstance(e.value, ValueError) and isinstance(e.value, GdsloadError)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_read_report(tmp_path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"ratio": 1.4, "compress_gbps": 30, "write_gbps": 12, "compress_scope": "aggregate"}))
    assert read_report(path) == {"ratio": 1.4, "compress_gbps": 30.0, "write_gbps": 12.0, "compress_scope": "aggregate"}
    # derived from bytes and seconds, nested under "checkpoint"; a direct figure wins over a derived one
    path.write_text(
        json.dumps(
            {
                "checkpoint": {
                    "logical_bytes": 6e9,
                    "stored_bytes": 4e9,
                    "compress_seconds": 0.2,
                    "write_seconds": 2.0,
                    "ratio": 1.6,
                }
            }
        )
    )
    assert read_report(path) == {"ratio": 1.6, "compress_gbps": 30.0, "write_gbps": 2.0}
    path.write_text(json.dumps({"ratio": "fast"}))
    with pytest.raises(ConfigError, match="ratio='fast' must be a positive number"):
        read_report(path)
    path.write_text(json.dumps({"speed": 3}))
    with pytest.raises(ConfigError, match="none of the known keys: ratio, compress_gbps"):
        read_report(path)
    path.write_text("[1, 2")
    with pytest.raises(ConfigError, match="not a readable JSON report"):
        read_report(path)


def test_results_out_of_range_are_errors_not_inf(tmp_path) -> None:
    for override, words in (
        ({"compress_gbps": 1e-320}, ["non-finite compress_s", "compress_gbps=1e-320"]),
        ({"gpu_hour_usd": 1e308}, ["non-finite idle_raw_usd_month"]),
        ({"gpus": 10**400}, ["too large to compute with"]),
    ):
        with pytest.raises(ConfigError) as e:
            checkpoint_cost(CostInputs(**{**SMALL, **override}))
        for w in words:
            assert w in str(e.value), (w, str(e.value))
    with pytest.raises(ConfigError, match=r"ratio \(--ratio\) = 10+ must be a positive number"):
        CostInputs(**{**SMALL, "ratio": 10**400})
    path = tmp_path / "r.json"
    path.write_text('{"logical_bytes": ' + "9" * 400 + ', "stored_bytes": 1, "compress_seconds": 1}')
    with pytest.raises(ConfigError, match="logical_bytes=9+ must be a positive number within a float's range"):
        read_report(path)


# ----------------------------------------------------------------------------------------------- the command

FLAGS = [
    "--size",
    "100GB",
    "--ratio",
    "2",
    "--compress-gbps",
    "10",
    "--write-gbps",
    "10",
    "--gpus",
    "4",
    "--gpu-hour-usd",
    "2",
    "--interval",
    "1h",
    "--retention",
    "3",
    "--storage-usd-gb-month",
    "0.10",
]


def test_cli_json_and_table() -> None:
    runner = CliRunner()
    r = runner.invoke(cost_command, [*FLAGS, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["wait_pipelined_s"] == 5.0 and doc["total_saved_usd_month"] == pytest.approx(23.0)
    assert doc["inputs"]["compress_scope"] == "per-gpu" and doc["inputs_from"]["compress_scope"] == "default"
    assert doc["inputs"]["interval_s"] == 3600 and len(doc["formulas"]) >= 10 and doc["breakeven"]
    r = runner.invoke(cost_command, FLAGS)
    assert r.exit_code == 0, r.output
    for text in (
        "Inputs",
        "Per checkpoint",
        "Per month (720.00 checkpoints)",
        "5.00 s (write-bound)",
        "Formulas",
        "Break-even",
        "$23.00",
        "10 GB/s per-gpu",
    ):
        assert text in r.output, text


def test_cli_from_report(tmp_path) -> None:
    report = tmp_path / "measured.json"
    report.write_text(
        json.dumps({"logical_bytes": 4e9, "stored_bytes": 2e9, "compress_seconds": 0.4, "write_seconds": 0.2})
    )
    base = [
        "--size",
        "100GB",
        "--gpus",
        "4",
        "--gpu-hour-usd",
        "2",
        "--interval",
        "3600",
        "--retention",
        "3",
        "--storage-usd-gb-month",
        "0.1",
        "--from-report",
        str(report),
        "--json",
    ]
    doc = json.loads(CliRunner().invoke(cost_command, base).output)
    assert (doc["inputs"]["ratio"], doc["inputs"]["compress_gbps"], doc["inputs"]["write_gbps"]) == (2.0, 10.0, 10.0)
    assert doc["inputs_from"]["ratio"] == f"report {report}" and doc["total_saved_usd_month"] == pytest.approx(23.0)
    # a flag wins over the report
    doc = json.loads(CliRunner().invoke(cost_command, [*base, "--ratio", "4"]).output)
    assert doc["inputs"]["ratio"] == 4.0 and doc["inputs_from"]["ratio"] == "flag"


def test_cli_report_path_printed_verbatim(tmp_path) -> None:
    d = tmp_path / "rep[v2]"
    d.mkdir()
    (d / "r.json").write_text(json.dumps({"ratio": 1.5}))
    r = CliRunner().invoke(cost_command, [*FLAGS[:2], *FLAGS[4:], "--from-report", str(d / "r.json")])
    assert r.exit_code == 0, r.output
    assert "rep[v2]" in r.output.replace("\n", "")


def test_cli_errors(monkeypatch, capsys) -> None:
    r = CliRunner().invoke(cost_command, ["--size", "1TB", "--gpus", "8"])
    assert r.exit_code == 2
    assert "missing --ratio, --compress-gbps, --write-gbps, --gpu-hour-usd, --retention" in r.output
    r = CliRunner().invoke(cost_command, [*FLAGS, "--interval", "soon"])
    assert isinstance(r.exception, ConfigError)
    monkeypatch.setitem(cli_module._LAZY_COMMANDS, "cost", "gdsload.server.cmd_cost:cost")
    with pytest.raises(SystemExit) as e:
        cli_module.main(["cost", *FLAGS, "--ratio", "0.5"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("error: ratio (--ratio) = 0.5 must be >= 1.0")
