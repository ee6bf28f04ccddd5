"""The installed ``gdsload`` command, run as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from gdsload.loader.dtypes import ITEMSIZE

GDSLOAD = [sys.executable, "-m", "gdsload.server.cli"]


def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([*GDSLOAD, *args], capture_output=True, text=True, timeout=120)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def test_entry_point_is_installed():
    exe = shutil.which("gdsload") or str(__import__("pathlib").Path(sys.executable).with_name("gdsload"))
    p = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "gdsload" in p.stdout


def test_inspect(sharded_dir):
    out = run("inspect", str(sharded_dir)).stdout
    assert "tp=2" in out and "model-rank-1-part-1.safetensors" in out and "data@4K" in out
    doc = json.loads(run("inspect", str(sharded_dir), "--json", "--tensors").stdout)
    assert doc["tp_size"] == 2 and doc["source"] == "manifest"
    f = doc["ranks"]["0"][0]
    assert json.loads(f["metadata"].pop("gdsload.checksums"))["algorithm"] == "crc32"  # each tensor's checksum
    assert f["data_aligned_4k"] and f["misaligned_tensors"] == 0 and f["metadata"] == {"rank": "0", "part": "0"}
    assert all(t["offset"] % ITEMSIZE[t["dtype"]] == 0 for t in f["tensor_list"])
    assert len(f["tensor_list"]) == f["tensors"]


@pytest.mark.parametrize("hostile", ["nested", "huge-length", "lone-surrogate"])
def test_inspect_of_a_hostile_header_is_one_typed_error(tmp_path, hostile):
    """`inspect` refuses a header nested 100,000 deep, one that claims more bytes than the file has, and one the
    safetensors library rejects (a lone surrogate escape) with one line naming the file: no traceback, exit 1."""
    import struct

    header = {
        "nested": b'{"__metadata__": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
        "huge-length": None,
        "lone-surrogate": b'{"__metadata__": {"k": "\\ud800"}}',
    }[hostile]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + b"{}" if header is None else struct.pack("<Q", len(header)) + header)
    p = run("inspect", str(path), ok=False)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert p.stderr.startswith(f"error: {str(path)!r}: ") and p.stderr.count("\n") == 1, p.stderr
    doc = json.loads(run("inspect", str(path), "--json", ok=False).stdout)
    assert doc["error"]["type"] == "HeaderError", doc


def test_compress_one_file_writes_one_loadable_file(tmp_path):
    """`gdsload compress FILE OUT` writes OUT alone (no manifest), and it loads as the source does."""
    import safetensors.torch
    import torch

    from gdsload.loader import load_rank

    model = tmp_path / "plain"
    run("bench", "--make-model", "8MB", "--out", str(model))
    src = sorted(model.glob("*.safetensors"))[0]
    out = tmp_path / "one" / "model.z.safetensors"
    out.parent.mkdir()
    done = run("compress", str(src), str(out), "--codec", "zstd", "--device", "cpu").stdout
    assert "compressed with zstd" in done and sorted(p.name for p in out.parent.iterdir()) == [out.name]
    ref = safetensors.torch.load_file(str(src))
    got = load_rank(out).tensors
    assert set(got) == set(ref) and all(torch.equal(got[k], v) for k, v in ref.items())


def test_inspect_shows_what_compressed_tensors_decode_to(tmp_path):
    model, out_dir = tmp_path / "plain", tmp_path / "zstd"
    run("bench", "--make-model", "8MB", "--out", str(model))  # tensors big enough to compress
    run("compress", str(model), str(out_dir), "--codec", "zstd", "--device", "cpu")
    doc = json.loads(run("inspect", str(out_dir), "--json", "--tensors").stdout)
    f = next(f for f in doc["ranks"]["0"] if "compression" in f)  # a file may hold only small (raw) tensors
    c = f["compression"]
    packed = [t for t in f["tensor_list"] if "codec" in t]
    assert c["tensors"] == len(packed) > 0 and c["codecs"] == {"zstd": len(packed)}
    assert c["stored_bytes"] == sum(t["bytes"] for t in packed) < c["logical_bytes"]
    assert c["logical_bytes"] == sum(t["logical_bytes"] for t in packed)
    assert c["ratio"] == round(c["logical_bytes"] / c["stored_bytes"], 3)
    assert all(t["stored_dtype"] == "U8" and t["dtype"] != "U8" for t in packed)
    assert "U8" not in f["dtypes"]  # counted as what they decode to
    plain = {p["file"]: p for p in json.loads(run("inspect", str(model), "--json").stdout)["ranks"]["0"]}
    assert f["dtypes"] == plain[f["file"]]["dtypes"] and not any("compression" in p for p in plain.values())
    text = run("inspect", str(out_dir)).stdout
    assert f"{c['tensors']} compressed (zstd×{c['tensors']}" in text and f"ratio {c['ratio']}" in text


def test_load_prints_report(sharded_dir):
    out = run("load", str(sharded_dir), "--rank", "1", "--threads", "2", "--chunk", "64KiB", "--verify").stdout
    assert out.startswith("rank 1: ") and "backend=mmap io=mmap files=2" in out and "verified=True" in out
    doc = json.loads(run("load", str(sharded_dir), "--json").stdout)
    assert doc["rank"] == 0 and doc["logical_bytes"] > 0 and len(doc["files"]) == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["load", "{d}", "--rank", "5"], "error: No files for rank 5"),
        (["load", "{d}", "--backend", "warp"], "error: backend='warp' is not known"),
        (["load", "{d}", "--chunk", "huge"], "is not a size"),
        (["load", "{d}", "--rank", "-1"], "-1 is not in the range x>=0"),
        (["load", "{d}", "--device", "gpu0"], "'gpu0' is not a device; use cpu, cuda or cuda:N"),
    ],
)
def test_errors_are_one_line_and_nonzero(sharded_dir, args, message):
    p = run(*[a.format(d=sharded_dir) for a in args], ok=False)
    assert p.returncode != 0
    assert message in p.stderr and "Traceback" not in p.stderr
