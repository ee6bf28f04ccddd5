"""Reader backends and codecs from other packages, declared as entry points, as a user installs them.

A real distribution (a ``.dist-info`` with ``entry_points.txt``) on the child interpreter's path
declares a backend and a codec; ``importlib.metadata`` finds them as it finds any installed
package's. Loads of files written with built-in codecs do not look at installed packages at all.

The codec is a new one, not a variant of a built-in: Deflate through the standard library's ``zlib``, one module
with its own encoder and decoder and one registration. Adding it changes nothing in gdsload.
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

from gdsload.loader import read_header
from gdsload.loader.prepare.compress import compress_dir
from gdsload.loader.prepare.synthetic import make_checkpoint

_PACKAGE = {
    "thirdparty_codec.py": """
        import zlib

        from gdsload.loader.codecs.registry import Codec, register_codec

        class Deflate(Codec):
            name = "deflate"
            chunk_bytes = 1 << 20

            def params(self, dtype):
                return {"level": 1}

            def encode_chunk(self, data, params):
                return zlib.compress(data, params["level"])

            def decode_chunk(self, data, nbytes, params):
                return zlib.decompressobj().decompress(data, nbytes)

        register_codec(Deflate())
    """,
    "thirdparty_reader.py": """
        from gdsload.loader.io.cpu import CpuBackend

        class ThirdPartyBackend(CpuBackend):
            name = "thirdparty"
    """,
    "thirdparty-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: thirdparty\nVersion: 1.0\n",
    "thirdparty-1.0.dist-info/entry_points.txt": """
        [gdsload.codecs]
        deflate = thirdparty_codec

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
if mode == "compress":  # the command line writes files with the other package's codec
    from gdsload.server.cli import main

    sys.argv = ["gdsload", "compress", sys.argv[2], sys.argv[3], "--codec", "deflate"]
    try:
        main()
    except SystemExit as e:
        assert not e.code, e.code
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
    # (Parsed as JSON here: this process has not installed the other package, so its codec is unknown to it.)
    codecs = [
        e["codec"]
        for f in sorted((tmp_path / "third").glob("*.safetensors"))
        for e in json.loads(read_header(f).metadata["gdsload.compression"])["tensors"].values()
    ]
    assert codecs and set(codecs) == {"deflate"}, codecs
    assert "deflate" in json.dumps(header), "the manifest records the third-party codec"
    # A fresh process finds the codec its files name, and the backend asked for, each looked up once.
    got = child("load", tmp_path / "third", tmp_path / "third.pt")
    assert got["ours"] == ["gdsload.backends", "gdsload.codecs"] and got["backend"] == "thirdparty", got
    ref = {k: v for f in plain.glob("*.safetensors") for k, v in safetensors.torch.load_file(str(f)).items()}
    for which in ("builtin.pt", "third.pt"):
        tensors = torch.load(tmp_path / which)
        assert tensors.keys() == ref.keys()
        for name, t in ref.items():
            assert torch.equal(tensors[name].view(torch.uint8), t.view(torch.uint8)), (which, name)


def test_a_codec_registered_in_process_round_trips_and_names_damage(tmp_path: Path, monkeypatch):
    """A codec object registered by a program (no packaging) compresses and loads on the CPU bit-exact; a damaged
    chunk is a CodecError naming the tensor and the codec; codecs that cannot work are refused at registration."""
    import bz2

    import pytest

    from gdsload.loader import CodecError, load_rank, read_header
    from gdsload.loader.codecs import registry
    from gdsload.loader.format import compression

    monkeypatch.setattr(registry, "_CODECS", dict(registry._CODECS))
    monkeypatch.setattr(compression, "CODECS", dict(compression.CODECS))

    class Bz2(registry.Codec):
        name = "bz2"
        chunk_bytes = 128 << 10

        def encode_chunk(self, data, params):
            return bz2.compress(data, 1)

        def decode_chunk(self, data, nbytes, params):
            return bz2.decompress(data)

    registry.register_codec(Bz2())
    assert registry.codec("bz2").cpu_decode and not registry.codec("bz2").gpu
    plain = make_checkpoint(tmp_path / "plain", "tiny", tp=1)
    out = tmp_path / "bz2"
    compress_dir(plain, out, codec="bz2", device="cpu", min_tensor_bytes=4096)
    ref = {k: v for f in plain.glob("*.safetensors") for k, v in safetensors.torch.load_file(str(f)).items()}
    got = load_rank(out, 0, device="cpu", verify=True).tensors
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name

    f = sorted(out.glob("*.safetensors"))[0]
    h = read_header(f)
    entries = compression.parse_compression(h)
    assert entries and {e.codec for e in entries.values()} == {"bz2"}
    name = max(entries, key=lambda n: entries[n].stored_bytes)
    raw = bytearray(f.read_bytes())
    mid = h.data_offset + h[name].start + h[name].nbytes // 2
    raw[mid : mid + 16] = bytes(16)
    f.write_bytes(bytes(raw))
    with pytest.raises(CodecError, match=rf"tensor {name!r}: the bz2 chunk at stored byte \d+ is corrupt"):
        load_rank(out, 0, device="cpu")

    class NoName(registry.Codec):
        pass

    class CpuNative(Bz2):
        name = "bz2-native"
        layouts = ("native",)

    class Padded(Bz2):
        name = "bz2-padded"
        chunk_align = 16

    for bad, why in ((NoName(), "needs a name"), (CpuNative(), "nvcomp_algorithm"), (Padded(), "chunk_align")):
        with pytest.raises(ValueError, match=why):
            registry.register_codec(bad)
    with pytest.raises(TypeError, match="Codec instance"):
        registry.register_codec("bz2")  # type: ignore[arg-type]


def test_an_engine_adapter_is_one_class_on_the_shared_base(tmp_path: Path):
    """An engine adapter written outside gdsload: one StateDictInjector subclass that says what the engine's model
    expects and how a tensor goes in. The base compares names and shapes before anything is written."""
    import numpy as np
    import pytest

    from gdsload.loader import load_rank
    from gdsload.loader.adapters import InjectError, StateDictInjector, Target

    class ToyEngineInjector(StateDictInjector):
        """A toy engine keeps its weights as numpy arrays under its own names (``model/norm/weight``)."""

        engine = "toy"

        def __init__(self, weights: dict[str, np.ndarray]):
            self.weights = weights

        @property
        def model_name(self) -> str:
            return "ToyModel"

        def targets(self):
            return {k.replace("/", "."): Target(tuple(v.shape)) for k, v in self.weights.items()}

        def apply(self, tensors, report) -> int:
            for name, t in tensors.items():
                mine = self.weights[name.replace(".", "/")]
                mine[...] = t.view(torch.uint8).numpy().view(mine.dtype).reshape(mine.shape)
            return 0

    plain = make_checkpoint(tmp_path / "plain", "tiny", tp=1)
    ref = {k: v for f in plain.glob("*.safetensors") for k, v in safetensors.torch.load_file(str(f)).items()}
    as_np = {
        k: v.view(torch.uint8).numpy().view(np.uint16 if v.element_size() == 2 else np.uint8) for k, v in ref.items()
    }
    engine = {k.replace(".", "/"): np.zeros_like(a) for k, a in as_np.items()}
    with load_rank(plain, 0, device="cpu") as result:
        report = ToyEngineInjector(engine).inject(result)
    assert report.ok and len(report.loaded) == len(ref) and report.engine == "toy"
    for k, a in as_np.items():
        assert np.array_equal(engine[k.replace(".", "/")], a), k

    # A model that expects one more tensor and one other shape: nothing is written, every difference is named.
    first = next(iter(engine))
    wrong = {k: np.zeros_like(a) for k, a in engine.items()}
    wrong[first] = np.zeros(wrong[first].size + 1, wrong[first].dtype)
    wrong["extra/weight"] = np.zeros(4, np.uint16)
    with load_rank(plain, 0, device="cpu") as result, pytest.raises(InjectError) as err:
        ToyEngineInjector(wrong).inject(result)
    assert "extra.weight" in str(err.value) and first.replace("/", ".") in str(err.value)
    assert all(not a.any() for a in wrong.values()), "a strict inject that does not fit writes nothing"
