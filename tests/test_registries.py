"""Reader backends and codecs from other packages, declared as entry points, as a user installs them.

A real distribution (a ``.dist-info`` with ``entry_points.txt``) on the child interpreter's path
declares a backend and a codec; ``importlib.metadata`` finds them as it finds any installed
package's. Loads of files written with built-in codecs do not look at installed packages at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import safetensors.torch
import torch

from gdsload.loader.prepare.compress import compress_dir
from gdsload.loader.prepare.synthetic import make_checkpoint

_PACKAGE = {
    "thirdparty_codec.py": """
        from gdsload.loader.codecs.registry import CodecSpec, register_codec

        register_codec(CodecSpec("zstd-1m", layouts=("chunks",), nvcomp_algorithm="Zstd",
                                 params=lambda dtype: {"level": 1}, chunk_bytes=1 << 20,
                                 cpu_encode=True, cpu_decode=True))
    """,
    "thirdparty_reader.py": """
        from gdsload.loader.io.cpu import CpuBackend

        class ThirdPartyBackend(CpuBackend):
            name = "thirdparty"
    """,
    "thirdparty-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: thirdparty\nVersion: 1.0\n",
    "thirdparty-1.0.dist-info/entry_points.txt": """
        [gdsload.codecs]
        zstd-1m = thirdparty_codec

        [gdsload.backends]
        thirdparty = thirdparty_reader:ThirdPartyBackend
    """,
}

_CHILD = r"""
import json, sys
import importlib.metadata as metadata

scanned = []
real = metadata.entry_points
def spy(**kw):
    scanned.append(kw.get("group"))
    return real(**kw)
metadata.entry_points = spy

import torch
from gdsload.loader import load_rank

mode = sys.argv[1]
if mode == "compress":  # a process that writes files with the other package's codec
    from gdsload.loader.prepare.compress import compress_dir

    compress_dir(sys.argv[2], sys.argv[3], codec="zstd-1m", device="cpu", min_tensor_bytes=4096)
    print(json.dumps({"scanned": scanned}))
elif mode == "builtin":  # files of a built-in codec: nothing scanned
    tensors = {k: v.clone() for k, v in load_rank(sys.argv[2], 0, device="cpu").tensors.items()}
    torch.save(tensors, sys.argv[3])
    print(json.dumps({"scanned": scanned}))
else:  # a fresh process loads those files through the other package's backend
    result = load_rank(sys.argv[2], 0, device="cpu", backend="thirdparty")
    torch.save(dict(result.tensors), sys.argv[3])
    print(json.dumps({"scanned": scanned, "backend": result.report.backend}))
"""


def test_a_backend_and_a_codec_from_another_package(tmp_path: Path):
    site = tmp_path / "site"
    for rel, text in _PACKAGE.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(textwrap.dedent(text).lstrip())
    plain = make_checkpoint(tmp_path / "plain", "tiny", tp=1)
    builtin = tmp_path / "zstd"
    compress_dir(plain, builtin, codec="zstd", device="cpu", min_tensor_bytes=4096)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}

    def child(*args: object) -> dict:
        p = subprocess.run(
            [sys.executable, "-c", _CHILD, *map(str, args)], capture_output=True, text=True, timeout=300, env=env
        )
        assert p.returncode == 0, p.stderr[-3000:]
        got = json.loads(p.stdout.strip().splitlines()[-1])
        got["ours"] = sorted(g for g in got["scanned"] if g.startswith("gdsload."))
        return got

    # Built-in names never make the loader read every installed package's metadata.
    assert child("builtin", builtin, tmp_path / "builtin.pt")["ours"] == []
    assert "gdsload.codecs" in child("compress", plain, tmp_path / "third")["ours"]
    header = json.loads((tmp_path / "third" / "gdsload.json").read_text())
    assert "zstd-1m" in json.dumps(header), "the manifest records the third-party codec"
    # A fresh process finds the codec its files name, and the backend asked for, each looked up once.
    got = child("load", tmp_path / "third", tmp_path / "third.pt")
    assert got["ours"] == ["gdsload.backends", "gdsload.codecs"] and got["backend"] == "thirdparty", got
    ref = {k: v for f in plain.glob("*.safetensors") for k, v in safetensors.torch.load_file(str(f)).items()}
    for which in ("builtin.pt", "third.pt"):
        tensors = torch.load(tmp_path / which)
        assert tensors.keys() == ref.keys()
        for name, t in ref.items():
            assert torch.equal(tensors[name].view(torch.uint8), t.view(torch.uint8)), (which, name)
