"""Smoke test of the cold-start bench on a tiny model, CPU methods only (the GPU run is on the device)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gdsload.bench.coldstart import format_table
from gdsload.loader import ConfigError, load_rank
from gdsload.loader.prepare.synthetic import PRESETS, make_checkpoint, shape_for_size, tensor_shapes

GDSLOAD = [sys.executable, "-m", "gdsload.server.cli"]


def test_make_model_is_reproducible_and_llama_shaped(tmp_path):
    a = make_checkpoint(tmp_path / "a", "tiny", tp=2)
    b = make_checkpoint(tmp_path / "b", "tiny", tp=2)
    for rank in (0, 1):
        ta, tb = load_rank(a, rank).tensors, load_rank(b, rank).tensors
        assert all(
            ta[k].view(-1).view(__import__("torch").int16).equal(tb[k].view(-1).view(__import__("torch").int16))
            for k in ta
        )
    full = dict((n, s) for n, s, _ in tensor_shapes(PRESETS["tiny"]))
    r0 = load_rank(a, 0).tensors
    assert (
        r0["model.layers.0.self_attn.q_proj.weight"].shape[0] * 2 == full["model.layers.0.self_attn.q_proj.weight"][0]
    )
    assert r0["model.layers.0.mlp.down_proj.weight"].shape[1] * 2 == full["model.layers.0.mlp.down_proj.weight"][1]
    w = r0["model.layers.0.mlp.up_proj.weight"].float()
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    eight = shape_for_size(9_080_000_000)
    assert (eight.hidden, eight.layers) == (4096, 16)  # the 9.08 GB bench checkpoint: Llama-3-8B widths, 16 layers


def test_synthetic_ranks_hold_whole_heads(tmp_path):
    # tiny: 8 heads of 32, 4 KV heads. At tp=8 each KV head sits on two ranks, as gdsload shard and vLLM place it.
    import torch

    m = make_checkpoint(tmp_path / "tp8", "tiny", tp=8)
    full = make_checkpoint(tmp_path / "tp1", "tiny", tp=1)
    whole = load_rank(full, 0).tensors
    for rank in range(8):
        t = load_rank(m, rank).tensors
        k = "model.layers.0.self_attn.k_proj.weight"
        assert t[k].shape == (32, 256) and torch.equal(t[k], whole[k][rank // 2 * 32 : (rank // 2 + 1) * 32])
        q = "model.layers.0.self_attn.q_proj.weight"
        assert t[q].shape == (32, 256) and torch.equal(t[q], whole[q][rank * 32 : (rank + 1) * 32])
    with pytest.raises(ConfigError, match=r"tp values that do: \[1, 2, 4, 8\]"):
        make_checkpoint(tmp_path / "tp16", "tiny", tp=16)  # 16 ranks would split a head of the 8
    assert not (tmp_path / "tp16").exists()


def test_bench_runs_end_to_end_on_cpu(tmp_path):
    model = tmp_path / "m"
    p = subprocess.run(
        [*GDSLOAD, "bench", "--make-model", "8MB", "--out", str(model), "--codec", "zstd", "--progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    # Both halves report progress on stderr, as plain lines off a terminal; stdout keeps the results.
    assert "make model: " in p.stderr and "compress (zstd): " in p.stderr and "(100%)" in p.stderr, p.stderr
    assert "make model" not in p.stdout and "compressed with zstd: ratio" in p.stdout, p.stdout
    out = tmp_path / "out"
    p = subprocess.run(
        [
            *GDSLOAD,
            "bench",
            str(model),
            "--compressed",
            f"{model}-zstd",
            "--device",
            "cpu",
            "--repeat",
            "1",
            "--warm",
            "--cold",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["methods"] == ["gdsload:auto", "gdsload:cpu", "safetensors", "gdsload:auto:compressed"]
    assert doc["complete"]
    logical = load_rank(model).report.logical_bytes
    assert len(doc["runs"]) == 8 and all("error" not in r and r["bytes"] == logical for r in doc["runs"])
    # what load_rank does by default on the CPU: cached files mapped, a cold rank read into fresh memory
    auto = {(r["condition"], r["backend"], *r["io_modes"]) for r in doc["runs"] if r["method"] == "gdsload:auto"}
    assert auto == {("warm", "mmap", "mmap"), ("cold", "mmap", "cpu")}
    cold = [r for r in doc["runs"] if r["condition"] == "cold"]
    assert all(r["evicted_by"] in ("drop_caches", "fadvise") and r["resident_before"] < 0.05 for r in cold)
    # Memory: each run's own peak RSS (it holds at least the loaded bytes), no GPU figure on the CPU.
    assert all(r["rss_peak_bytes"] >= r["rss_before_bytes"] > 0 and r["gpu_peak_bytes"] is None for r in doc["runs"])
    assert all(r["rss_peak_bytes"] >= logical for r in doc["runs"] if r["method"] == "safetensors")
    assert all(
        row["rss_peak_bytes"]
        == max(
            r["rss_peak_bytes"]
            for r in doc["runs"]
            if r["method"] == row["method"] and r["condition"] == row["condition"]
        )
        for row in doc["summary"]
    )
    assert doc["limits"]["raw_read_gbps.cold"] > 0 and doc["facts"]["cpus"] >= 1
    shapes = {k: v for k, v in doc["limits"].items() if k.startswith("raw_read_gbps.cold.")}
    assert len(shapes) == 6 and doc["limits"]["raw_read_gbps.cold"] == max(shapes.values())
    # The sidecar's time to ready, per condition and directory, from a real `gdsload serve` on loopback.
    assert [(t["condition"], t["dir"]) for t in doc["ttr"]] == [
        ("warm", "plain"),
        ("warm", "compressed"),
        ("cold", "plain"),
        ("cold", "compressed"),
    ]
    for t in doc["ttr"]:
        assert "error" not in t, t
        assert t["backends"] == ["cpu"] and t["logical_bytes"] == logical
        assert 0 < t["load_seconds_max"] < t["time_to_ready_s"] < 120
    # Bytes read from the files per second: fewer than the logical ones for the compressed copy only.
    for row in doc["summary"]:
        ratio = row["median_gbps"] / row["read_gbps"]
        assert ratio > 1.0 if row["method"].endswith(":compressed") else ratio == pytest.approx(1.0), row
    table = format_table(doc)
    assert "gdsload:auto:compressed" in table and "cold" in table and "serve:compressed" in table
    # gdsload's runs say what read each file, as their load report does
    assert all(len(r["readers"]) == len(r["io_modes"]) for r in doc["runs"] if r["method"].startswith("gdsload"))
    assert " via " not in table  # the cpu backend reads its files itself
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = subprocess.run(
        [*GDSLOAD, "bench", "--plot", str(out / "results.json"), "--out", str(tmp_path / "charts")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and (tmp_path / "charts" / "chart.png").read_bytes()[:4] == b"\x89PNG", p.stderr


def test_a_model_made_as_hugging_face_publishes_it_holds_the_same_tensors(tmp_path):
    """``--writer safetensors``: the safetensors library's own files, HF's part names and index, no manifest;
    the same values as the aligned model, and gdsload loads them."""
    import safetensors.torch
    import torch

    from gdsload.loader import read_header

    a, b = tmp_path / "aligned", tmp_path / "hf"
    for out, extra in ((a, []), (b, ["--writer", "safetensors"])):
        p = subprocess.run(
            [*GDSLOAD, "bench", "--make-model", "8MB", "--max-file-size", "3MB", "--out", str(out), *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr
    parts = sorted(x.name for x in b.glob("*.safetensors"))
    assert len(parts) >= 3 and parts[0] == f"model-00001-of-{len(parts):05d}.safetensors"
    assert not (b / "gdsload.json").exists() and (b / "config.json").read_text() == (a / "config.json").read_text()
    index = json.loads((b / "model.safetensors.index.json").read_text())
    ref = {k: v for f in parts for k, v in safetensors.torch.load_file(str(b / f)).items()}
    assert set(index["weight_map"]) == set(ref) and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in ref.values()
    )
    assert any(read_header(b / f).data_offset % 4096 for f in parts)  # the library's layout, not gdsload's
    ours = load_rank(a).tensors
    assert set(ours) == set(ref) and all(torch.equal(ours[k], v) for k, v in ref.items())
    got = load_rank(b).tensors
    assert all(torch.equal(got[k], v) for k, v in ref.items())
    p = subprocess.run(
        [
            *GDSLOAD,
            "bench",
            "--make-model",
            "8MB",
            "--writer",
            "safetensors",
            "--tp",
            "2",
            "--out",
            str(tmp_path / "t2"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "--tp 2 needs --writer gdsload" in p.stderr and not (tmp_path / "t2").exists()


def test_tmpfs_condition_copies_afresh_and_removes_only_its_copy(tmp_path):
    from gdsload.bench.coldstart import BenchConfig, run_bench
    from gdsload.loader.prepare.synthetic import make_checkpoint

    model = make_checkpoint(tmp_path / "m", "tiny")
    shm = tmp_path / "shm"
    stale = make_checkpoint(shm / "gdsload-bench-plain", "tiny", tp=2)  # someone's older copy, another model
    doc = run_bench(
        BenchConfig(
            model_dir=model,
            methods=["gdsload:cpu"],
            repeat=1,
            device="cpu",
            out=tmp_path / "out",
            conditions=("tmpfs",),
            tmpfs_root=shm,
            ttr=False,
        ),
        log=lambda *a: None,
    )
    assert [r["bytes"] for r in doc["runs"]] == [load_rank(model).report.logical_bytes]
    assert sorted(p.name for p in shm.iterdir()) == ["gdsload-bench-plain"] and (stale / "gdsload.json").exists()


def test_warm_and_cold_are_not_run_on_a_memory_file_system(tmp_path, monkeypatch):
    """A model in tmpfs never leaves the page cache: `cold` would time memory reads under the name of a disk's."""
    from gdsload.bench import coldstart
    from gdsload.bench.coldstart import BenchConfig, run_bench

    model = make_checkpoint(tmp_path / "m", "tiny")
    monkeypatch.setattr(coldstart, "mount_of", lambda p: ("/m", "tmpfs" if str(p).startswith(str(model)) else "ext4"))
    shm = tmp_path / "shm"
    shm.mkdir()
    lines: list[str] = []
    doc = run_bench(
        BenchConfig(
            model_dir=model,
            methods=["gdsload:cpu"],
            repeat=1,
            device="cpu",
            out=tmp_path / "out",
            conditions=("tmpfs", "warm", "cold"),
            tmpfs_root=shm,
            ttr=False,
        ),
        log=lines.append,
    )
    assert doc["config"]["conditions"] == ["tmpfs"] and [r["condition"] for r in doc["runs"]] == ["tmpfs"]
    assert set(doc["conditions_skipped"]) == {"warm", "cold"}
    assert all(
        why.startswith(str(model)) and "lies on a memory file system (tmpfs)" in why
        for why in doc["conditions_skipped"].values()
    )
    assert any(line.startswith("condition cold skipped") for line in lines)
    other = make_checkpoint(tmp_path / "elsewhere", "tiny")
    assert coldstart.conditions_in_memory(("cold",), other, None) == {}
    assert set(coldstart.conditions_in_memory(("cold",), other, model)) == {"cold"}  # one directory in memory is enough
    with pytest.raises(ValueError, match="no condition can run"):
        run_bench(
            BenchConfig(
                model_dir=model,
                methods=["gdsload:cpu"],
                repeat=1,
                device="cpu",
                out=tmp_path / "o2",
                conditions=("cold",),
                ttr=False,
            ),
            log=lines.append,
        )
    assert not (tmp_path / "o2").exists()


def test_bench_cli_refuses_cold_alone_on_tmpfs(tmp_path):
    import tempfile

    from gdsload.loader.io.iomode import mount_of

    if mount_of("/dev/shm")[1] != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    room = Path(tempfile.mkdtemp(prefix="gdsload-test-", dir="/dev/shm"))
    try:
        model = make_checkpoint(room / "m", "tiny")
        p = subprocess.run(
            [*GDSLOAD, "bench", str(model), "--device", "cpu", "--cold", "--out", str(tmp_path / "o")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode != 0 and "lies on a memory file system (tmpfs)" in p.stderr and "Traceback" not in p.stderr
        assert not (tmp_path / "o").exists()
        # A directory on disk whose files are links into tmpfs is in memory too.
        links = tmp_path / "links"
        links.mkdir()
        for f in model.iterdir():
            (links / f.name).symlink_to(f)
        p = subprocess.run(
            [*GDSLOAD, "bench", str(links), "--device", "cpu", "--cold", "--out", str(tmp_path / "o")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode != 0 and "lies on a memory file system (tmpfs)" in p.stderr, p.stderr
    finally:
        shutil.rmtree(room)


def test_bench_cli_refuses_bad_input_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{")
    for args, words in (
        (["--repeat", "0", str(tmp_path)], "0 is not in the range x>=1"),
        (["--device", "gpu0", str(tmp_path)], "'gpu0' is not a device"),
        (["--device", "cpu", str(tmp_path / "empty")], "holds no .safetensors files"),
        (
            ["--make-model", "8MB", "--tp", "3", "--out", str(tmp_path / "t3")],
            "tp=3 does not split this synthetic shape by whole heads",
        ),
        (["--make-model", "8MB", "--compress", "lzma", "--out", str(tmp_path / "c")], "'lzma'"),
        (["--plot", str(tmp_path / "bad.json")], "is not a results.json"),
    ):
        p = subprocess.run([*GDSLOAD, "bench", *args], capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and words in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "empty"]  # nothing half-made


def test_bench_cli_refuses_what_it_would_measure_wrongly(tmp_path):
    tp2 = make_checkpoint(tmp_path / "tp2", "tiny", tp=2)
    plain = make_checkpoint(tmp_path / "plain", "tiny")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_text("mine")
    nofacts = tmp_path / "nofacts.json"
    nofacts.write_text(json.dumps({"config": {}, "summary": [], "limits": {}}))
    empty = tmp_path / "empty.json"
    empty.write_text(
        json.dumps(
            {
                "config": {"conditions": ["warm"], "methods": [], "device": "cpu", "repeat": 1},
                "summary": [],
                "limits": {},
                "facts": {"date": "x"},
            }
        )
    )
    nulls = tmp_path / "nulls.json"
    nulls.write_text(empty.read_text().replace('"summary": []', '"summary": null'))
    partial = tmp_path / "partial.json"
    good_row = {"method": "x", "condition": "warm", "median_gbps": 1, "min_gbps": 1, "max_gbps": 1}
    partial.write_text(
        empty.read_text().replace(
            '"summary": []', json.dumps({"summary": [good_row, {"method": "y", "median_gbps": 1}]})[1:-1]
        )
    )
    for args, words in (
        ([str(tp2), "--device", "cpu"], "holds 2 ranks (tp=2)"),  # peers would read both ranks, we one
        ([str(plain), "--device", "cpu", "--methods", "gdsload:cpu:compressed"], "needs --compressed DIR"),
        ([str(plain), "--device", "cpu", "--compressed", str(plain)], "holds no compressed tensors"),
        (["--make-model", "8MB", "--out", str(tmp_path / "notes")], "is not empty"),  # stale parts would stay
        (["--plot", str(nofacts)], "is not a results.json"),
        (["--plot", str(empty)], "no method has a successful run"),
        (["--plot", str(nulls)], "its summary is not a list"),
        (["--plot", str(partial)], "a summary row lacks one of"),
    ):
        p = subprocess.run(
            [*GDSLOAD, "bench", *args] + ([] if "--out" in args else ["--out", str(tmp_path / "o")]),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode != 0 and words in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    assert (tmp_path / "notes" / "x.txt").read_text() == "mine" and not (tmp_path / "o").exists()


@pytest.mark.skipif(
    __import__("gdsload.loader.codecs", fromlist=["x"]).nvcomp_available() is None,
    reason="checks the refusal on hosts without nvCOMP",
)
def test_make_model_refuses_a_gpu_codec_before_writing(tmp_path):
    p = subprocess.run(
        [*GDSLOAD, "bench", "--make-model", "8MB", "--compress", "ans", "--out", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "'ans' compresses on a GPU only" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "m").exists()


def test_methods_read_the_manifests_files_only(tmp_path):
    from gdsload.bench.methods import _files

    model = make_checkpoint(tmp_path / "m", "tiny")
    listed = sorted(str(p) for p in model.glob("*.safetensors"))
    stray = model / "model-rank-1-part-0.safetensors"  # an older tp=2 model's part left behind
    stray.write_bytes((model / "model-rank-0-part-0.safetensors").read_bytes())
    assert _files(str(model)) == listed


def test_failed_and_timed_out_runs_are_counted_not_hidden(tmp_path):
    from gdsload.bench.coldstart import _one, format_table, summarize

    model = make_checkpoint(tmp_path / "m", "tiny")
    r = _one("gdsload:cpu", model, "cpu", timeout=0.001)  # a hung loader: an error row, not a traceback
    assert r["error"] == ["timed out after 0.001 s"]
    ok = {"method": "gdsload:cpu", "condition": "warm", "bytes": 100, "seconds": 1.0, "resident_before": 1.0}
    doc = {
        "config": {"conditions": ["warm"], "methods": ["gdsload:cpu"]},
        "limits": {},
        "runs": [ok, {**ok, "seconds": 2.0}, {**r, "condition": "warm"}],
    }
    (row,) = summarize(doc)
    assert (row["runs_ok"], row["runs_failed"], row["median_gbps"]) == (2, 1, 75e-9)
    doc["summary"] = [row]
    assert "(1 of 3 runs failed: [['timed out after 0.001 s']])" in format_table(doc)


def test_tmpfs_copy_is_removed_when_copying_fails(tmp_path):
    from gdsload.bench.coldstart import BenchConfig, run_bench

    model = make_checkpoint(tmp_path / "m", "tiny")
    (model / "dangling").symlink_to(tmp_path / "nowhere")  # copytree fails on it
    shm = tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(OSError):
        run_bench(
            BenchConfig(
                model_dir=model,
                methods=["gdsload:cpu"],
                repeat=1,
                device="cpu",
                out=tmp_path / "out",
                conditions=("tmpfs",),
                tmpfs_root=shm,
                ttr=False,
            ),
            log=lambda *a: None,
        )
    assert list(shm.iterdir()) == []


def test_sigterm_during_the_bench_removes_its_tmpfs_copy(tmp_path):
    model = make_checkpoint(tmp_path / "m", "tiny")
    shm = tmp_path / "shm"
    shm.mkdir()
    # The bench as `gdsload bench` runs it (SIGTERM handled as for every one-shot command), stopped mid-run.
    code = (
        "import os, signal\n"
        "from pathlib import Path\n"
        "from gdsload.server.signals import stop_on_sigterm\n"
        "import gdsload.bench.coldstart as c\n"
        "def one(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM)\n"
        "c._one = one\n"
        "stop_on_sigterm()\n"
        f"c.run_bench(c.BenchConfig(model_dir=Path({str(model)!r}), methods=['gdsload:cpu'], repeat=1, "
        f"device='cpu', out=Path({str(tmp_path / 'out')!r}), conditions=('tmpfs',), tmpfs_root=Path({str(shm)!r}), "
        "ttr=False), log=lambda *a: None)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 143, p.stderr
    assert list(shm.iterdir()) == []


def test_time_to_ready_stops_when_the_server_refuses_its_target(tmp_path):
    """``gdsload serve`` checks its model before it starts and exits 2 naming the fix; the bench says so."""
    from gdsload.bench.ttr import time_to_ready

    r = time_to_ready(str(tmp_path / "missing"), ["--device-map", "cpu"], timeout=30)
    assert r["error"].startswith("server exited with 2") and "does not exist" in r["error"], r


def test_cpu_load_times_the_whole_call_in_fresh_processes(tmp_path):
    """Every method in its own process, its loader's import inside the clock, the process timed too."""
    model = make_checkpoint(tmp_path / "m", "tiny")
    code = (
        "import sys, time\n"
        "from gdsload.bench.cpu_load import _worker\n"
        "print('torch imported before the call:', 'torch' in sys.modules)\n"
        f"_worker('gdsload', {str(model)!r}, 2)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "torch imported before the call: False" in p.stdout, p.stdout + p.stderr
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "gdsload.bench.cpu_load", "--model", str(model), "--repeat", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    assert {(r["method"], r["condition"]) for r in runs} == {
        (m, c) for m in ("gdsload", "gdsload-cpu", "safetensors") for c in ("tmpfs", "cold", "warm")
    }
    assert all(r["resident_before"] > 0.99 for r in runs if r["condition"] != "cold")
    assert len({r["bytes"] for r in runs}) == 1
    assert all(0 < r["seconds"] < r["process_s"] for r in runs)
    # taking turns: the second round starts with another method than the first
    warm = [r["method"] for r in runs if r["condition"] == "warm"]
    assert warm[0] != warm[3]


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssFile:"))


def test_in_memory_maps_in_every_page_of_a_mapped_load(tmp_path):
    """The CPU bench's clock stops with every method's bytes in memory: safetensors' tensors view a file
    mapping, whose pages come into the process only when read."""
    import safetensors.torch
    import torch

    from gdsload.bench.methods import in_memory

    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"w": torch.arange(4 << 20, dtype=torch.int32), "b": torch.ones(3)}, str(path))
    tensors = safetensors.torch.load_file(str(path))
    before = _rss_file()
    in_memory(tensors.values())
    assert _rss_file() - before >= 15 << 20


def test_multi_gpu_bench_rows_on_cpu(tmp_path):
    """The tensor-parallel bench's three kinds of rows, with the CPU backend: real processes, real files."""
    tp2 = make_checkpoint(tmp_path / "tp2", "tiny", tp=2)
    tp1 = make_checkpoint(tmp_path / "tp1", "tiny", tp=1)
    out = tmp_path / "rows.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gdsload.bench.multi_gpu",
            str(tp2),
            "--single",
            str(tp1),
            "--device",
            "cpu",
            "--methods",
            "gdsload:pinned,safetensors",
            "--repeat",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if "error" in r]
    (limits,) = [r for r in rows if r["row"] == "limits"]
    assert limits["tp"] == 2 and limits["files"] == 2 and limits["raw_read_gbps_16_threads"] > 0
    assert "h2d_one_gpu_gbps" not in limits  # no GPU: host reads only
    together = limits["raw_read_rank_processes"]  # one reader process per rank, started together
    assert together["processes"] == 2 and together["bytes"] == limits["bytes"]
    assert together["aggregate_gbps"] > 0 and len(together["per_process_gbps"]) == 2
    assert (
        limits["raw_read_rank_processes_4mib"]["bytes"] == limits["bytes"]
        and limits["raw_read_gbps_16_threads_4mib"] > 0
    )
    single = {r["method"]: r for r in rows if r["row"] == "single"}
    assert set(single) == {"gdsload:cpu", "safetensors"}
    assert single["gdsload:cpu"]["bytes"] == single["safetensors"]["bytes"] > 0
    groups = {(r["method"], r["world"]): r for r in rows if r["row"] == "group"}
    assert set(groups) == {("gdsload:cpu", 1), ("gdsload:cpu", 2), ("safetensors", 1), ("safetensors", 2)}
    for (m, world), r in groups.items():
        assert sorted(x["rank"] for x in r["ranks"]) == list(range(world))
        assert len({x["pid"] for x in r["ranks"]}) == world  # one process per rank
        assert r["aggregate_gbps"] == r["bytes"] / r["window_s"] / 1e9 > 0
    # Both ranks' bytes: the whole model plus the small tensors every rank keeps a copy of (norms).
    both = groups[("gdsload:cpu", 2)]["bytes"]
    assert both == groups[("safetensors", 2)]["bytes"]
    assert single["safetensors"]["bytes"] < both < 1.01 * single["safetensors"]["bytes"]
    (serve,) = [r for r in rows if r["row"] == "serve"]
    assert serve["tp"] == 2 and set(serve["load_seconds"]) == {"0", "1"}
    assert serve["logical_bytes"] == both and serve["aggregate_gbps"] > 0
    # Two loads: when they overlap, window + overlap = both loads; when they do not, the window holds both and a gap.
    window, overlap, loads = serve["load_window_s"], serve["loads_overlap_s"], list(serve["load_seconds"].values())
    assert overlap >= 0 and window >= max(loads) - 1e-6
    if overlap > 0:
        assert window + overlap == pytest.approx(sum(loads), abs=1e-6)
    else:
        assert window >= sum(loads) - 1e-6
    assert all(0 <= lag < 5 for lag in serve["ready_message_lag_s"].values()) and len(serve["ready_message_lag_s"]) == 2
    assert "group   gdsload:cpu        world=2" in p.stdout and "limits  raw read" in p.stdout
    assert "2 processes at once" in p.stdout


@pytest.mark.parametrize("order", [dict(per_file=True), dict(interleave=True), dict()])
def test_raw_read_reads_every_byte_once_in_each_order(tmp_path, monkeypatch, order):
    from gdsload.bench import limits

    files = []
    for i, size in enumerate((3 << 20, (5 << 20) + 4096, 12288)):
        (tmp_path / f"f{i}").write_bytes(bytes([i + 1]) * size)
        files.append(str(tmp_path / f"f{i}"))
    seen: list[tuple[str, int, int]] = []
    real = limits.os.preadv

    def spy(fd, bufs, off):
        n = real(fd, bufs, off)
        seen.append((limits.os.readlink(f"/proc/self/fd/{fd}"), off, n))
        return n

    monkeypatch.setattr(limits.os, "preadv", spy)
    total, seconds = limits._raw_read(files, direct=False, threads=2, chunk=1 << 20, **order)
    monkeypatch.undo()
    assert total == sum(map(limits.os.path.getsize, files)) and seconds > 0
    for f in files:  # each file read once, front to back when one reader has it
        offsets = [off for path, off, _ in seen if path == f]
        assert sorted(offsets) == list(range(0, limits.os.path.getsize(f), 1 << 20))
        if order.get("per_file"):
            assert offsets == sorted(offsets)


def test_context_check_flags_a_process_on_another_ranks_gpu():
    from gdsload.bench.multi_gpu import _contexts

    own = {101: "gpu-a", 102: "gpu-b"}
    smi = {101: {"gpu-a": 4860}, 102: {"gpu-a": 520, "gpu-b": 5958}, 999: {"gpu-b": 1}}
    c = _contexts(own, smi)
    assert c["foreign"] == {"102": ["gpu-a"]} and c["listed"] == 2
    assert _contexts(own, {101: {"gpu-a": 1}, 102: {"gpu-b": 1}})["foreign"] == {}
    assert _contexts(own, {})["listed"] == 0  # nvidia-smi lists nobody here: nothing is claimed
    assert _contexts(own, None) is None


def test_host_read_together_reports_a_worker_that_cannot_read(tmp_path):
    from gdsload.bench.limits import raw_read_together

    good = tmp_path / "a.bin"
    good.write_bytes(b"x" * (1 << 20))
    with pytest.raises(RuntimeError, match="host-read worker failed"):
        raw_read_together([[str(good)], [str(tmp_path / "missing.bin")]], threads=2)
    r = raw_read_together([[str(good)], [str(good)]], threads=2)
    assert r["bytes"] == 2 << 20 and r["processes"] == 2 and r["aggregate_gbps"] > 0


def test_restart_bench_runs_engines_against_a_sidecar_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    model = make_checkpoint(tmp_path / "m", "tiny", tp=1)
    out = tmp_path / "out"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gdsload.bench.restart",
            str(model),
            "--device",
            "cpu",
            "--rounds",
            "2",
            "--methods",
            "adopted,safetensors",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    result = json.loads((out / "results.json").read_text())
    assert result["logits_identical"] and result["failed"] == 0
    runs = result["runs"]
    assert [r["method"] for r in runs] == ["adopted", "safetensors", "safetensors", "adopted"]  # turns rotate
    for r in runs:
        assert r["marks"]["imports"] <= r["marks"]["model_built"] <= r["marks"]["weights"] <= r["start_to_token_s"]
        assert r["adopted"] == (r["loaded"] if r["method"] == "adopted" else 0)
    assert "adopted" in p.stdout and "safetensors" in p.stdout


def test_restart_bench_refuses_an_unknown_method(tmp_path):
    model = make_checkpoint(tmp_path / "m", "tiny", tp=1)
    p = subprocess.run(
        [sys.executable, "-m", "gdsload.bench.restart", str(model), "--methods", "adopted,vllm"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "['vllm'] unknown" in p.stderr, p.stderr


def test_the_table_names_what_read_the_files():
    from gdsload.bench.coldstart import _io

    assert (
        _io({"io_modes": ["posix", "posix"], "readers": ["fastsafetensors", "fastsafetensors"]})
        == "posix via fastsafetensors"
    )
    assert _io({"io_modes": ["posix", "posix"], "readers": ["kvikio", "staged"]}) == "posix via kvikio,staged"
    assert _io({"io_modes": ["posix"], "backend": "cpu", "readers": ["cpu"]}) == "posix"  # the backend itself
    assert _io({"io_modes": None}) == "-"  # a peer: no report


def test_shard_bench_runs_gdsload_on_a_tiny_checkpoint(tmp_path):
    """``gdsload bench shard`` where vLLM is not installed: the built-in rules' layout, timed in fresh processes."""
    out = tmp_path / "shard-bench"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gdsload.server.cli",
            "bench",
            "shard",
            "--size",
            "8MiB",
            "--experts",
            "0",
            "--layouts",
            "tp2",
            "--rounds",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "results.json").read_text())
    (row,) = doc["table"]
    assert row["method"] == "gdsload" and row["ok"] == "1/1" and row["median_s"] > 0 and row["peak_rss_gb"] > 0
    assert row["rank0_tensors"] > 0 and doc["source_bytes"] > 8_000_000
    assert (out / "gdsload-tp2" / "gdsload.json").exists()


def test_every_bench_module_is_behind_gdsload_bench():
    """Each module of gdsload.bench is a `gdsload bench` subcommand, or what one runs."""
    from gdsload.bench.cli import SUBCOMMANDS

    used = {m for m, _ in SUBCOMMANDS.values()} | {"cli", "coldstart", "methods", "limits", "plot", "__init__"}
    here = {p.stem for p in (Path(__file__).resolve().parents[2] / "bench").glob("*.py")}
    assert here <= used, sorted(here - used)


def test_verify_cost_bench_times_both_modes_on_the_cpu(tmp_path):
    model = make_checkpoint(tmp_path / "m", "tiny")
    out = tmp_path / "runs.json"
    p = subprocess.run(
        [sys.executable, "-m", "gdsload.server.cli", "bench", "verify", str(model), "--rounds", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    (by_mode,) = json.loads(out.read_text()).values()
    assert set(by_mode) == {"off", "default"} and all(len(v) == 1 and v[0]["seconds"] > 0 for v in by_mode.values())
    assert "| m |" in p.stdout  # the Markdown table
