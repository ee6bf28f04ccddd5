"""The format layer against the reference: safetensors opens what we write, we load what it writes."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import safetensors
import safetensors.torch
import torch

from tensor_cases import all_dtypes, mixed_tensors, random_tensor
from gdsload.loader import AlignedWriter, TensorSpec, load_rank, read_header, save_file
from gdsload.loader.dtypes import ITEMSIZE, from_torch, to_torch
from gdsload.loader.format.safetensors import DATA_ALIGNMENT


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_dtype_table_round_trips_every_torch_dtype():
    for dt in all_dtypes():
        name = from_torch(dt)
        assert to_torch(name) == dt
        assert ITEMSIZE[name] == torch.empty((), dtype=dt).element_size()


def test_our_files_open_in_safetensors_bit_identical(tmp_path):
    tensors = mixed_tensors()
    path = tmp_path / "ours.safetensors"
    save_file(tensors, path, {"format": "pt", "note": "ünïcode"})
    with safetensors.safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        sums = json.loads(metadata.pop("gdsload.checksums"))  # what gdsload adds: each tensor's CRC-32
        assert metadata == {"format": "pt", "note": "ünïcode"}
        assert set(f.keys()) == set(tensors) == set(sums["tensors"]) and sums["algorithm"] == "crc32"
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert _bit_equal(got, t), name
            raw = got.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if got.numel() else b""
            assert int(sums["tensors"][name], 16) == zlib.crc32(raw), name


def test_our_files_are_aligned(tmp_path):
    path = tmp_path / "ours.safetensors"
    save_file(mixed_tensors(), path)
    h = read_header(path)
    assert h.data_offset % DATA_ALIGNMENT == 0 and h.data_aligned
    assert h.misaligned() == []
    for t in h.tensors:
        assert (h.data_offset + t.start) % t.itemsize == 0, t.name
    # Element sizes never increase along the file: the ordering that makes natural alignment hold.
    sizes = [t.itemsize for t in h.tensors if t.nbytes]
    assert sizes == sorted(sizes, reverse=True)


def test_safetensors_files_load_bit_identical(tmp_path):
    tensors = mixed_tensors(seed=3)
    path = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    assert read_header(path).metadata == {"format": "pt"}
    result = load_rank(path)
    assert set(result.tensors) == set(tensors)
    for name, t in tensors.items():
        assert _bit_equal(result.tensors[name], t), name


@pytest.mark.parametrize("dtype", all_dtypes(), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 0, 2), (2, 3, 5, 7)])
def test_each_dtype_and_shape_round_trips_both_ways(tmp_path, dtype, shape):
    t = random_tensor(shape, dtype, seed=hash((str(dtype), shape)) % 1000)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save_file({"t": t}, ours)
    safetensors.torch.save_file({"t": t}, str(theirs))
    assert _bit_equal(safetensors.torch.load_file(str(ours))["t"], t)
    assert _bit_equal(load_rank(theirs).tensors["t"], t)
    assert _bit_equal(load_rank(ours).tensors["t"], t)


def test_header_is_space_padded_json(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"a": torch.ones(3)}, path, {"k": "v"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + n].decode()
    assert text.rstrip(" ").endswith("}") and text.endswith(" ")
    meta = json.loads(text)["__metadata__"]
    assert meta.pop("gdsload.checksums").startswith('{"version":1,"algorithm":"crc32"') and meta == {"k": "v"}


def test_writer_streams_in_declared_order_and_checks_each_tensor(tmp_path):
    specs = [TensorSpec("small", "U8", (3,)), TensorSpec("big", "F64", (2,)), TensorSpec("mid", "BF16", (4,))]
    with AlignedWriter(tmp_path / "s.safetensors", specs) as w:
        assert [s.name for s in w.order] == ["big", "mid", "small"]
        with pytest.raises(ValueError, match="expected tensor 'big' next"):
            w.write("small", torch.zeros(3, dtype=torch.uint8))
        with pytest.raises(ValueError, match=r"declared F64\[2\], got F32\[2\]"):
            w.write("big", torch.zeros(2, dtype=torch.float32))
        w.write("big", torch.zeros(2, dtype=torch.float64))
        w.write("mid", torch.zeros(4, dtype=torch.bfloat16))
        w.write("small", torch.zeros(3, dtype=torch.uint8))
    assert safetensors.torch.load_file(str(tmp_path / "s.safetensors"))["big"].dtype == torch.float64


def test_a_manifest_digest_gdsload_cannot_check_is_named_with_its_file(tmp_path):
    """A digest of an unknown algorithm (or no algorithm) stops a verifying load with the manifest, the file,
    the value and the fix; a load that does not verify is not stopped by it."""
    from gdsload.loader import write_manifest
    from gdsload.loader.errors import ManifestError

    save_file({"x": torch.ones(8)}, tmp_path / "model.safetensors")
    write_manifest(tmp_path, {0: ["model.safetensors"]}, tp_size=1, layout="hf")
    doc = json.loads((tmp_path / "gdsload.json").read_text())
    for bad in ("md5:d41d8cd98f00b204e9800998ecf8427e", "9f86d081884c7d65", "blake3:"):
        doc["ranks"]["0"][0]["digest"] = bad
        (tmp_path / "gdsload.json").write_text(json.dumps(doc))
        with pytest.raises(ManifestError) as e:
            load_rank(tmp_path, verify=True)
        assert str(tmp_path / "gdsload.json") in str(e.value) and "'model.safetensors'" in str(e.value)
        assert repr(bad) in str(e.value) and "blake3, sha256" in str(e.value)
        assert torch.equal(load_rank(tmp_path).tensors["x"], torch.ones(8))


def test_without_the_blake3_package_a_digest_asks_for_it_or_for_sha256(tmp_path, monkeypatch):
    from gdsload.loader.errors import ConfigError
    from gdsload.loader.format import digests

    monkeypatch.setitem(__import__("sys").modules, "blake3", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install blake3.*--digest-algorithm sha256"):
        AlignedWriter(tmp_path / "w.safetensors", [TensorSpec("w", "F32", (2,))])
    assert not (tmp_path / "w.safetensors").exists()
    with AlignedWriter(tmp_path / "w.safetensors", [TensorSpec("w", "F32", (2,))], digest="sha256") as w:
        w.write("w", torch.ones(2))
    assert w.digest == digests.file_digest(tmp_path / "w.safetensors", "sha256")
    with pytest.raises(ConfigError, match="unknown digest algorithm 'md5'"):
        digests.hasher("md5")


def test_writer_writes_in_pieces_from_threads_and_hashes_on_the_way(tmp_path, monkeypatch):
    """Tensors split into many pieces written at once by several threads, with a small in-flight
    bound: safetensors reads every tensor back bit-identical, and the writer's digest is the file's blake3
    (sha256 when asked for), as the hash libraries compute them over the file's bytes."""
    import hashlib

    import blake3

    import gdsload.loader.format.writer as fmt
    from gdsload.loader.format.digests import file_digest

    monkeypatch.setattr(fmt, "WRITE_PIECE", 4096)
    monkeypatch.setattr(fmt, "WRITE_IN_FLIGHT", 3 * 4096)
    tensors = {**mixed_tensors(), "large": random_tensor((300, 77), torch.float32), "empty": torch.zeros(0, 3)}
    path = tmp_path / "p.safetensors"
    with AlignedWriter(path, [TensorSpec.of(n, t) for n, t in tensors.items()], {"k": "v"}, threads=3) as w:
        for spec in w.order:
            w.write(spec.name, tensors[spec.name])
    assert w.digest == file_digest(path) == "blake3:" + blake3.blake3(path.read_bytes()).hexdigest()
    with AlignedWriter(
        tmp_path / "s.safetensors",
        [TensorSpec.of(n, t) for n, t in tensors.items()],
        {"k": "v"},
        threads=3,
        digest="sha256",
    ) as w2:
        for spec in w2.order:
            w2.write(spec.name, tensors[spec.name])
    assert (tmp_path / "s.safetensors").read_bytes() == path.read_bytes()
    assert w2.digest == file_digest(path, "sha256") == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    back = safetensors.torch.load_file(str(path))
    assert set(back) == set(tensors) and all(_bit_equal(back[n], t) for n, t in tensors.items())
    with AlignedWriter(tmp_path / "q.safetensors", [TensorSpec.of("large", tensors["large"])], digest=False) as w:
        w.write("large", tensors["large"])
    assert w.digest is None


def test_a_write_failing_in_a_writer_thread_names_the_tensor_and_leaves_nothing(tmp_path, monkeypatch):
    import errno
    import os

    real = os.pwrite

    def pwrite(fd: int, data: object, offset: int) -> int:
        if offset >= DATA_ALIGNMENT + 4 * 1000:  # the second tensor's bytes
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    specs = [TensorSpec("a", "F32", (1000,)), TensorSpec("b", "F32", (1000,))]
    with pytest.raises(OSError, match=r"x\.safetensors: writing tensor 'b' failed \(No space left") as info:
        with AlignedWriter(tmp_path / "x.safetensors", specs) as w:
            w.write("a", torch.zeros(1000))
            w.write("b", torch.ones(1000))
    assert info.value.errno == errno.ENOSPC and info.value.tensor == "b"
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_nothing_on_disk(tmp_path):
    specs = [TensorSpec("a", "F32", (2,)), TensorSpec("b", "F32", (2,))]
    with pytest.raises(ValueError, match="never written"):
        with AlignedWriter(tmp_path / "x.safetensors", specs) as w:
            w.write("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="boom"):
        with AlignedWriter(tmp_path / "y.safetensors", specs) as w:
            w.write("a", torch.zeros(2))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


FULL_DISK = """
import resource, signal, sys, torch
from gdsload.loader import save_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
try:
    save_file({"w": torch.ones(4096)}, sys.argv[1])
except OSError as e:
    print(type(e).__name__, e)
"""


@pytest.mark.parametrize("limit", [100, 6000], ids=["header", "data"])
def test_a_full_disk_leaves_nothing_and_names_the_file(tmp_path, limit):
    import subprocess
    import sys

    target = tmp_path / "w.safetensors"
    p = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(target), str(limit)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("OSError") and str(target) in p.stdout, p.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_failed_rename_leaves_nothing(tmp_path):
    (tmp_path / "w.safetensors").mkdir()  # the name is taken by a directory
    with pytest.raises(OSError, match="nothing was written under that name"):
        save_file({"w": torch.ones(4)}, tmp_path / "w.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="unique"):
        AlignedWriter(tmp_path / "d.safetensors", [TensorSpec("a", "F32", (1,)), TensorSpec("a", "F32", (1,))])
    with pytest.raises(TypeError, match="str to str"):
        save_file({"a": torch.ones(1)}, tmp_path / "m.safetensors", {"k": 1})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="cannot be stored in safetensors"):
        save_file({"a": torch.ones(1, dtype=torch.complex128)}, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="'__metadata__'"):
        save_file({"__metadata__": torch.ones(1)}, tmp_path / "n.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_non_contiguous_and_views_are_written_by_value(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t(), "slice": base[1:3, ::2]}
    save_file(tensors, tmp_path / "v.safetensors")
    loaded = safetensors.torch.load_file(str(tmp_path / "v.safetensors"))
    assert torch.equal(loaded["t"], base.t()) and torch.equal(loaded["slice"], base[1:3, ::2])


def test_writer_refuses_text_safetensors_could_not_read(tmp_path):
    for tensors, metadata, what in (
        ({"\ud800": torch.ones(1)}, None, "tensor name"),
        ({"a": torch.ones(1)}, {"k": "\udc00"}, "metadata value of 'k'"),
    ):
        with pytest.raises(ValueError, match=f"{what}.*lone surrogate"):
            save_file(tensors, tmp_path / "t.safetensors", metadata)
        assert not list(tmp_path.iterdir())
