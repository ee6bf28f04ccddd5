"""Every load checked by default: the per-tensor checksums writers record, checked on the bytes that were loaded.

The GPU cases (marked ``gpu``) check on the device after the copy (nvCOMP's CRC kernel); run them with
``pytest -m gpu tests/loader/pipeline/test_integrity.py`` on a GPU host.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import threading
import zlib
from pathlib import Path

import pytest
import safetensors.torch
import torch

from gdsload.loader import IntegrityError, TruncatedFileError, load_rank, read_header, save_file, write_manifest
from gdsload.loader.format.checksums import METADATA_KEY, parse_checksums
from gdsload.loader.prepare.compress import compress_dir


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 128, generator=g).to(torch.bfloat16),
        "v": torch.randn(3000, generator=g),
        "i": torch.randint(0, 100, (40, 7), generator=g),
        "s": torch.tensor(2.5, dtype=torch.float64),
        "e": torch.empty(0, 9),
    }


def _flip(path: Path, at: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ (1 << bit)]))


def _data_bytes(path: Path) -> list[tuple[str, int, int]]:
    """(tensor, absolute start, length) of each non-empty tensor of a file."""
    h = read_header(path)
    return [(t.name, h.data_offset + t.start, t.nbytes) for t in h.tensors if t.nbytes]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    save_file(_weights(0), d / "model-rank-0-part-0.safetensors", {"format": "pt"})
    save_file({f"b.{k}": v for k, v in _weights(1).items()}, d / "model-rank-0-part-1.safetensors")
    write_manifest(
        d, {0: ["model-rank-0-part-0.safetensors", "model-rank-0-part-1.safetensors"]}, tp_size=1, layout="vllm"
    )
    return d


def test_what_gdsload_writes_records_each_tensors_crc32(tmp_path):
    """save_file, and the raw tensors of a Zstd file: the table holds each tensor's CRC-32, as zlib computes it
    over the bytes the reference library reads back; compressed tensors carry a crc32 of their own (and keep the
    entry of their decoded bytes the source file recorded)."""
    src = tmp_path / "src"
    src.mkdir()
    tensors = {**_weights(), "tiny": torch.arange(4, dtype=torch.int8)}
    save_file(tensors, src / "model.safetensors")
    compress_dir(src, tmp_path / "z", codec="zstd", device="cpu")
    for path in (src / "model.safetensors", tmp_path / "z" / "model.safetensors"):
        table = parse_checksums(read_header(path))
        with safetensors.safe_open(str(path), "pt") as f:
            packed = json.loads(f.metadata().get("gdsload.compression", '{"tensors": {}}'))["tensors"]
            for name in f.keys():
                t = tensors[name] if name in packed else f.get_tensor(name)
                if name in packed:
                    assert "crc32" in packed[name]
                raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
                assert table[name] == zlib.crc32(raw), (path, name)
        assert packed or path.parent == src


@pytest.mark.parametrize("backend", ["cpu", "mmap", "mmap-copy"])
def test_single_bit_flips_in_raw_tensors_are_caught_by_default(model, backend, monkeypatch):
    """40 single-bit flips anywhere in the tensors' bytes: each load fails with an IntegrityError naming the file
    and the tensor (with verify left at its default); undone, the model loads and says it was checked.
    ``mmap-copy``: the mapped bytes checked through copies, as where ``MADV_POPULATE_READ`` is missing."""
    if backend == "mmap-copy":
        import gdsload.loader.io.mmap as m

        monkeypatch.setattr(m, "_populate_works", False)
        backend = "mmap"
    rng = random.Random(55)
    files = sorted(model.glob("*.safetensors"))
    caught = 0
    for _ in range(40):
        path = rng.choice(files)
        name, start, n = rng.choice(_data_bytes(path))
        at, bit = start + rng.randrange(n), rng.randrange(8)
        _flip(path, at, bit)
        try:
            with pytest.raises(IntegrityError) as e:
                load_rank(model, backend=backend)
            assert repr(str(path)) in str(e.value) and repr(name) in str(e.value) and "CRC-32" in str(e.value)
            caught += 1
        finally:
            _flip(path, at, bit)
    assert caught == 40
    report = load_rank(model, backend=backend).report
    assert report.verified and report.verification["unchecked_tensors"] == 0
    assert all(f.checked_tensors == f.tensors and f.checked_by.startswith("crc32 (cpu") for f in report.files)


def test_verify_false_and_the_environment_turn_the_check_off(model, monkeypatch):
    path = model / "model-rank-0-part-0.safetensors"
    _, start, _ = _data_bytes(path)[0]
    _flip(path, start + 3)
    assert load_rank(model, verify=False).report.verified is False
    monkeypatch.setenv("GDSLOAD_VERIFY", "0")
    report = load_rank(model).report
    assert report.verified is False and report.verification == {"mode": "off"}
    monkeypatch.setenv("GDSLOAD_VERIFY", "1")
    with pytest.raises(IntegrityError):
        load_rank(model)


def _crc_threads(monkeypatch) -> list[str]:
    """The names of the threads that compute the load's CRCs, in call order (filled as the load runs)."""
    import gdsload.loader.pipeline.verify as verify

    threads: list[str] = []
    real = verify.crc32

    def spy(data, value=0):
        threads.append(threading.current_thread().name)
        return real(data, value)

    monkeypatch.setattr(verify, "crc32", spy)
    return threads


def test_the_check_runs_beside_the_read_in_the_reading_threads(model, monkeypatch):
    """With the cpu reader, each tensor's CRC is folded in by the thread that read its bytes, as they arrive."""
    threads = _crc_threads(monkeypatch)
    report = load_rank(model, backend="cpu", num_threads=2, chunk_bytes=4096).report
    assert report.verified and report.verification["checked_on"] == "cpu, beside the read"
    assert threads and all(t.startswith("gdsload-cpu") for t in threads), set(threads)


def test_mapped_bytes_are_checked_by_the_threads_that_map_them_in(tmp_path, monkeypatch):
    """With the mmap reader, each piece of a mapping is checked right after the thread that mapped its pages in
    (several threads, pieces smaller than a tensor), not in a pass over the mappings after the load."""
    import gdsload.loader.io.mmap as mapped

    d = tmp_path / "m"
    d.mkdir()
    g = torch.Generator().manual_seed(2)
    tensors = {f"t{i}": torch.randn(1_000_000 + 4097 * i, generator=g) for i in range(5)}  # about 4 MB each
    save_file(tensors, d / "model.safetensors")
    monkeypatch.setattr(mapped, "_MAP_IN_PIECE", 1 << 20)
    threads = _crc_threads(monkeypatch)
    result = load_rank(d, backend="mmap", num_threads=2)
    report = result.report
    assert report.files[0].io_mode == "mmap"
    assert report.verified and report.verification["checked_on"] == "cpu, beside the read"
    assert len(threads) > len(tensors) and all(t.startswith("gdsload-mmap") for t in threads), set(threads)
    assert all(torch.equal(result.tensors[k], v) for k, v in tensors.items())
    h = read_header(d / "model.safetensors")
    _flip(d / "model.safetensors", h.data_offset + h["t3"].start + (3 << 20) // 2)  # inside a middle piece of t3
    with pytest.raises(IntegrityError, match="'t3'"):
        load_rank(d, backend="mmap", num_threads=2)


def test_partial_and_direct_loads_are_checked(model):
    """``only`` and ``into`` loads check what they load, where it landed."""
    path = model / "model-rank-0-part-0.safetensors"
    full = load_rank(model).tensors
    into = {"w": torch.empty_like(full["w"]), "b.v": torch.empty_like(full["b.v"])}
    report = load_rank(model, into=into, only={"i"}).report
    assert report.verified and sum(f.checked_tensors for f in report.files) == 3
    h = read_header(path)
    w = h["w"]
    _flip(path, h.data_offset + w.start + w.nbytes - 1)
    with pytest.raises(IntegrityError, match="'w'"):
        load_rank(model, into={"w": torch.empty_like(full["w"])})
    assert torch.equal(load_rank(model, only={"i"}).tensors["i"], full["i"])  # its bytes are intact


def test_a_file_replaced_during_the_load_is_not_reported_verified(tmp_path):
    """The bytes loaded came from a damaged file that was swapped for a good copy while the load ran: the check
    is of the loaded bytes (never a re-read of the path), so the load fails instead of saying verified=True."""
    d = tmp_path / "m"
    d.mkdir()
    good = tmp_path / "good.safetensors"
    safetensors.torch.save_file(_weights(), str(good))  # another writer: no checksums, the manifest's digest only
    shutil.copy(good, d / "model.safetensors")
    write_manifest(d, {0: ["model.safetensors"]}, tp_size=1, layout="plain")
    _, start, _ = _data_bytes(d / "model.safetensors")[0]
    _flip(d / "model.safetensors", start + 10)

    def swap(plan):  # the damaged file is open; the path now names a good copy
        shutil.copy(good, d / "fresh.tmp")
        os.replace(d / "fresh.tmp", d / "model.safetensors")

    with pytest.raises(IntegrityError, match=r"model.safetensors.*blake3 digest .* does not match the manifest"):
        load_rank(d, verify=True, on_plan=swap)
    assert load_rank(d, verify=True).report.verified  # the good copy itself verifies


def test_gdsload_files_replaced_during_the_load_fail_their_checksums(model):
    path = model / "model-rank-0-part-1.safetensors"
    good = path.read_bytes()
    _, start, _ = _data_bytes(path)[0]
    _flip(path, start)

    def swap(plan):
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(good)
        os.replace(tmp, path)

    with pytest.raises(IntegrityError, match="CRC-32"):
        load_rank(model, on_plan=swap)


@pytest.mark.parametrize("how", ["null", "deleted"])
def test_digests_missing_from_the_manifest_with_verify_asked_for(tmp_path, how):
    """Files of another writer whose manifest digests are null or gone: verify=True is a typed error, not a quiet
    verified=False; gdsload's own files are still checked through their checksums."""
    d = tmp_path / "m"
    d.mkdir()
    safetensors.torch.save_file(_weights(), str(d / "model.safetensors"))
    write_manifest(d, {0: ["model.safetensors"]}, tp_size=1, layout="plain")
    doc = json.loads((d / "gdsload.json").read_text())
    for files in doc["ranks"].values():
        for f in files:
            if how == "null":
                f["digest"] = None
            else:
                del f["digest"]
    (d / "gdsload.json").write_text(json.dumps(doc))
    with pytest.raises(
        IntegrityError,
        match=r"verify was asked for, but 5 of its tensors cannot be checked: .*records no digest for it",
    ):
        load_rank(d, verify=True)
    assert load_rank(d).report.verified is False  # the default checks what is recorded: here, nothing
    save_file(_weights(), d / "model.safetensors")
    doc["ranks"]["0"][0]["bytes"] = (d / "model.safetensors").stat().st_size
    (d / "gdsload.json").write_text(json.dumps(doc))
    report = load_rank(d, verify=True).report
    assert report.verified and report.verification["digest_files"] == 0 and report.verification["checksum_tensors"] == 5


def test_verify_true_checks_the_manifest_digest_over_the_loaded_bytes_too(model):
    report = load_rank(model, verify=True).report
    assert report.verified and report.verification["digest_files"] == 2
    assert all("blake3 digest of the loaded file" in f.checked_by for f in report.files)


def test_a_damaged_checksum_table_is_typed(model):
    path = model / "model-rank-0-part-0.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + n].decode()
    for old, new in [('\\"w\\":\\"', '\\"x\\":\\"'), ('\\"crc32\\"', '\\"adler\\"')]:
        assert old in text
        bad = text.replace(old, new, 1).encode()
        path.write_bytes(struct.pack("<Q", n) + bad + raw[8 + n :])
        with pytest.raises(IntegrityError, match=f"model-rank-0-part-0.safetensors.*{METADATA_KEY}"):
            load_rank(model, verify=None)
        assert load_rank(model, verify=False).tensors["w"].shape == (256, 128)
    path.write_bytes(bytes(raw))


def test_a_flipped_raw_tensor_in_a_zstd_file_is_caught_by_default(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save_file({**_weights(), "norm": torch.ones(64)}, src / "model.safetensors")
    compress_dir(src, tmp_path / "z", codec="zstd", device="cpu")
    path = tmp_path / "z" / "model.safetensors"
    table = parse_checksums(read_header(path))
    h = read_header(path)
    t = h["norm"]
    assert "norm" in table
    _flip(path, h.data_offset + t.start + 5)
    with pytest.raises(IntegrityError, match="'norm'"):
        load_rank(path)


# ------------------------------------------------------------------------------------------------ GPU


def _gpu_model(tmp_path: Path) -> Path:
    d = tmp_path / "g"
    d.mkdir()
    g = torch.Generator().manual_seed(3)
    save_file(
        {
            "w": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),
            "b": torch.randn(77, generator=g),
            "e": torch.empty(0),
        },
        d / "model.safetensors",
    )
    return d


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "pinned", "cufile"])
def test_gpu_loads_are_checked_on_the_device_after_the_copy(tmp_path, backend):
    from gdsload.loader.devices import as_device
    from gdsload.loader.io import backend_class

    reason = backend_class(backend).probe(as_device("cuda")) if backend != "auto" else None
    if reason:
        pytest.skip(reason)
    d = _gpu_model(tmp_path)
    report = load_rank(d, device="cuda", backend=backend).report
    assert report.verified and "nvCOMP" in report.verification["checked_on"], report.verification
    path = d / "model.safetensors"
    h = read_header(path)
    _flip(path, h.data_offset + h["w"].start + 12345, 3)
    with pytest.raises(IntegrityError, match="'w'.*CRC-32"):
        load_rank(d, device="cuda", backend=backend)
    assert load_rank(d, device="cuda", backend=backend, verify=False).report.verified is False


def test_a_rank_read_in_landing_groups_is_cut_into_consecutive_groups_of_about_equal_bytes():
    from gdsload.loader.plan import Extent, landing_groups

    extents = [Extent(0, 0, 100, 0), Extent(1, 0, 0, 100), Extent(1, 10, 250, 100, buffer=1)]
    groups = landing_groups(extents, 4, 50)
    assert [sum(e.length for e in g) for g in groups] == [88, 88, 88, 86]
    flat = [e for g in groups for e in g]
    # Together they are the extents, in order, cut where a boundary falls inside one.
    assert [(e.file_index, e.file_offset, e.length, e.offset, e.buffer) for e in flat] == [
        (0, 0, 88, 0, 0),
        (0, 88, 12, 88, 0),
        (1, 10, 76, 100, 1),
        (1, 86, 88, 176, 1),
        (1, 174, 86, 264, 1),
    ]
    assert landing_groups(extents, 4, 1000) == [[extents[0], extents[2]]]  # small: one group
    assert landing_groups([], 4, 1) == []


def test_landing_groups_are_all_in_flight_and_each_is_handed_on_as_it_lands():
    """Every group is queued before the checks are set up and before the first wait; each is handed on after its
    own wait, in order; after a failure the later groups are still waited for (they write into the buffers until
    then) but not handed on, and the checks queued are abandoned."""
    from gdsload.loader.pipeline.load import _read_in_groups

    log: list[str] = []

    class Reader:
        def submit(self, group, dsts, progress):
            log.append(f"submit {group[0]}")

            def wait():
                log.append(f"wait {group[0]}")
                if group[0] == "g2":
                    raise OSError("read failed")

            return wait

    class Checks:
        def on_landed(self, g):
            log.append(f"landed {g[0]}")

        def abandon(self):
            log.append("abandoned")

    def checks():
        log.append("checks")
        return Checks()

    assert isinstance(_read_in_groups(Reader(), [["g0"], ["g1"]], [], None, checks), Checks)
    assert log == ["submit g0", "submit g1", "checks", "wait g0", "landed g0", "wait g1", "landed g1"]
    log.clear()
    with pytest.raises(OSError, match="read failed"):
        _read_in_groups(Reader(), [["g1"], ["g2"], ["g3"]], [], None, checks)
    assert log == [
        *("submit g1", "submit g2", "submit g3", "checks"),
        *("wait g1", "landed g1", "wait g2", "wait g3", "abandoned"),
    ]
    log.clear()

    def broken():
        raise RuntimeError("no checks")

    with pytest.raises(RuntimeError, match="no checks"):
        _read_in_groups(Reader(), [["g0"], ["g1"]], [], None, broken)
    assert log == ["submit g0", "submit g1", "wait g0", "wait g1"]  # still every read waited for


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", "driver"])
def test_gpu_checks_run_as_each_group_of_reads_lands(tmp_path, monkeypatch, device):
    """A rank read in several groups: the tensors of the groups that landed are checked while the later groups
    are read, every tensor is checked, and a flip in the first or the last group is caught, naming its tensor."""
    from gdsload.loader.devices import DriverDevice, torch_free_unavailable
    from gdsload.loader import plan

    if device == "driver" and torch_free_unavailable():
        pytest.skip(torch_free_unavailable())
    monkeypatch.setattr(plan, "LANDING_MIN_BYTES", 1 << 20)
    d = tmp_path / "m"
    d.mkdir()
    g = torch.Generator().manual_seed(5)
    tensors = {f"layer{i}.w": torch.randn(512, 1024, generator=g).to(torch.bfloat16) for i in range(12)}
    tensors["norm"] = torch.randn(77, generator=g)
    tensors["z.big"] = torch.randn(3 << 20, generator=g)  # 12 MiB: checked in pieces, combined on the host
    save_file(tensors, d / "model.safetensors")

    def load(**kw):
        return load_rank(d, device=DriverDevice(0) if device == "driver" else "cuda", **kw)

    result = load()
    v = result.report.verification
    assert result.report.verified and v["checked_tensors"] == len(tensors), v
    assert v["checked_as_landed_tensors"] > 0, v  # not all after the last copy
    assert "nvCOMP" in v["checked_on"], v
    path = d / "model.safetensors"
    h = read_header(path)
    for name in ("layer0.w", "z.big"):
        clean = path.read_bytes()
        _flip(path, h.data_offset + h[name].start + 999, 5)
        with pytest.raises(IntegrityError, match=f"'{name}'"):
            load()
        path.write_bytes(clean)


@pytest.mark.gpu
def test_gpu_checks_of_ans_and_zstd_files(tmp_path):
    """An ANS file's raw tensors (CRC-32 on the device) and a Zstd file decoded on the GPU (its decoded CRC-32 on
    the device): flips in a raw tensor are caught by default."""
    src = _gpu_model(tmp_path)
    for codec in ("ans", "zstd"):
        out = tmp_path / codec
        compress_dir(src, out, codec=codec, device="cuda", min_tensor_bytes=1024)
        report = load_rank(out, device="cuda").report
        assert report.verified, report.verification
        path = out / "model.safetensors"
        h = read_header(path)
        _flip(path, h.data_offset + h["b"].start + 1)  # "b" is too small to compress: stored raw
        with pytest.raises(IntegrityError, match="'b'"):
            load_rank(out, device="cuda")


@pytest.mark.gpu
def test_torch_free_gpu_loads_are_checked(tmp_path):
    from gdsload.loader.devices import DriverDevice, torch_free_unavailable

    why = torch_free_unavailable()
    if why:
        pytest.skip(why)
    d = _gpu_model(tmp_path)
    report = load_rank(d, device=DriverDevice(0)).report
    assert report.verified and "nvCOMP" in report.verification["checked_on"]
    path = d / "model.safetensors"
    h = read_header(path)
    _flip(path, h.data_offset + h["b"].start)
    with pytest.raises(IntegrityError, match="'b'"):
        load_rank(d, device=DriverDevice(0))


# -------------------------------------------------------------------------- a mapped file cut short


_TRUNCATE_AFTER_MAPPING = r"""
import os, sys
from gdsload.loader import GdsloadError, load_rank
from gdsload.loader.io.mmap import MmapBackend

path, verify = sys.argv[1], {"none": None, "1": True}[sys.argv[2]]
if sys.argv[3] == "copy":  # a kernel without MADV_POPULATE_READ: the checks copy the mapped bytes instead
    import gdsload.loader.io.mmap as m
    m._populate_works = False
real = MmapBackend.file_buffers

def cut(self):  # the load has mapped its files: now one of them is cut short, before its bytes are checked
    bufs = real(self)
    os.truncate(path, 4096)
    return bufs

MmapBackend.file_buffers = cut
try:
    load_rank(os.path.dirname(path), backend="mmap", verify=verify)
except GdsloadError as e:
    print(type(e).__name__, "|", e)
else:
    print("loaded")
"""


@pytest.mark.parametrize("reads", ["in-place", "copy"])
@pytest.mark.parametrize("verify", ["none", "1"])
def test_a_mapped_file_cut_short_during_the_load_is_a_typed_error_not_sigbus(tmp_path, verify, reads):
    """The mmap reader: a file truncated after it was mapped, while the load checks its bytes, ends the load with
    a TruncatedFileError naming it (the process used to die of SIGBUS), whether the checks read the mapping in
    place or, without ``MADV_POPULATE_READ``, copy it."""
    import subprocess
    import sys

    d = tmp_path / "m"
    d.mkdir()
    save_file({"w": torch.randn(512, 512), "b": torch.ones(10)}, d / "model.safetensors")
    if verify == "1":
        write_manifest(d, {0: ["model.safetensors"]}, tp_size=1, layout="plain")
    p = subprocess.run(
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-c",
            _TRUNCATE_AFTER_MAPPING,
            str(d / "model.safetensors"),
            verify,
            reads,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, f"the load died ({p.returncode}): {p.stderr[-2000:]}"
    assert p.stdout.startswith("TruncatedFileError |") and "model.safetensors" in p.stdout, p.stdout


def test_a_file_cut_short_before_it_is_mapped_is_a_typed_error(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    save_file({"w": torch.randn(512, 512)}, d / "model.safetensors")

    def cut(plan):  # the header was read; the file shrinks before the reader maps it
        os.truncate(d / "model.safetensors", 8192)

    with pytest.raises(TruncatedFileError, match=r"model.safetensors' is 8192 bytes now, its header described"):
        load_rank(d, backend="mmap", on_plan=cut)


def test_without_isal_the_checksums_come_from_zlib(model, monkeypatch):
    """ISA-L computes the CRC-32 where the isal package is installed; without it zlib gives the same values."""
    import sys

    import gdsload.loader.format.checksums as sums

    fast = sums.crc32(b"gdsload" * 1000)
    monkeypatch.setitem(sys.modules, "isal", None)
    monkeypatch.setattr(sums, "_IMPL", None)
    assert sums.crc32(b"gdsload" * 1000) == fast == zlib.crc32(b"gdsload" * 1000)
    assert load_rank(model).report.verified


def test_a_repack_records_the_table_of_intact_data_as_it_was(tmp_path):
    """gdsload compress keeps a source's checksum table byte for byte where the data is intact (what the GPU's
    compressor, which copies the metadata, writes too): its entries in their order, raw ones recomputed."""
    from gdsload.loader.format.checksums import METADATA_KEY

    src = tmp_path / "src"
    src.mkdir()
    save_file(
        {"small": torch.ones(8), **_weights(), "a.late": torch.arange(9, dtype=torch.int16)}, src / "model.safetensors"
    )
    compress_dir(src, tmp_path / "z", codec="zstd", device="cpu")
    before = read_header(src / "model.safetensors").metadata[METADATA_KEY]
    assert read_header(tmp_path / "z" / "model.safetensors").metadata[METADATA_KEY] == before
