"""The torch-free load path of sidecar workers: ``load_rank`` onto a ``DriverDevice``, read by ``cufile``.

CPU tests drive the ``cufile`` backend's kvikio logic against a stand-in kvikio and host memory.
GPU tests run the torch-free load in a child process (so "no torch" can be checked) and compare
every tensor with the safetensors library; the hand-off is mapped back as torch tensors here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from gpu_cases import _bench_like
from kvikio_stand_in import host_reader, stand_in_kvikio

from gdsload.loader import save_file
from gdsload.loader.devices import torch_free_unavailable
from gdsload.loader.dtypes import from_torch
from gdsload.loader.handoff.ipc import IpcError, import_rank

# Load one rank without torch; print digests, the report, which heavy libraries the load imported, and GPU memory.
CHILD = r"""
import gc, hashlib, json, sys
from gdsload.loader.devices import DriverDevice
from gdsload.loader.handoff.ipc import export_rank
from gdsload.loader.pipeline.load import load_rank
path, rank, export = sys.argv[1], int(sys.argv[2]), sys.argv[4] == "1"
verify = {"1": True, "0": False, "-": None}[sys.argv[3]]
dev = DriverDevice(0)
free0 = dev.memory_info()[0]
res = load_rank(path, rank, device=dev, verify=verify)
imported = sorted(m for m in ("torch", "cupy", "numpy", "kvikio") if m in sys.modules)
loaded = dev.memory_info()[0]
host = dev.to_host(res.arena)
out = {"digests": {s.name: [s.dtype, list(s.shape), hashlib.sha256(host[s.offset:s.offset + s.nbytes].tobytes()).hexdigest()]
                   for s in res.slots},
       "imported": imported, "report": res.report.to_dict(), "arena_bytes": res.arena.nbytes}
if export:
    out["doc"] = export_rank(res)
print(json.dumps(out), flush=True)
if export:
    sys.stdin.readline()  # the importer has mapped, checked and dropped its views
res.close()
del res, host
gc.collect()
print(json.dumps({"free0": free0, "loaded": loaded, "closed": dev.memory_info()[0]}), flush=True)
"""


def _oracle(files: list[Path]) -> dict[str, list]:
    """name -> [safetensors dtype, shape, sha256 of the bytes], as the safetensors library reads them."""
    out = {}
    for f in files:
        for name, t in safetensors.torch.load_file(str(f)).items():
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            out[name] = [from_torch(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
    return out


def _run(path: Path, rank: int = 0, *, verify: bool | None = False) -> tuple[dict, dict]:
    """Load a rank torch-free in a fresh process (``verify=None``: the default checks)."""
    flag = {True: "1", False: "0", None: "-"}[verify]
    p = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", CHILD, str(path), str(rank), flag, "0"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr
    first, last = (json.loads(line) for line in p.stdout.strip().splitlines()[-2:])
    return first, last


def _needs_bare() -> None:
    why = torch_free_unavailable()
    if why:
        pytest.skip(f"the torch-free path cannot run here: {why}")


# ---------------------------------------------------------------------------------------------- CPU


# What a torch-free GPU load imports (the load path, its reader, decode stage and codecs); prints the standard
# library's heavier modules that came in with it, beside what the interpreter's start had already imported.
IMPORTS = r"""
import json, sys
before = set(sys.modules)
import gdsload.loader.devices, gdsload.loader.pipeline.load, gdsload.loader.io.cufile, gdsload.loader.pipeline.decode
import gdsload.loader.codecs.nvcomp_c
from gdsload.loader.codecs.registry import codec
codec("ans"), codec("zstd")
heavy = ("torch", "numpy", "dataclasses", "inspect", "hashlib", "shutil", "platform", "concurrent.futures",
         "importlib.metadata", "subprocess", "tempfile")
print(json.dumps(sorted(m for m in heavy if m in sys.modules and m not in before)))
"""


def test_the_load_path_imports_nothing_a_load_does_not_run():
    """A fresh process pays for every module its first load imports: a torch-free load brings in neither
    torch nor numpy, nor the standard library's modules that only writing, hashing or describing code needs
    (what torch imports anyway, a torch-free process would pay for)."""
    p = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == []


def test_bare_path_is_only_for_kvikio_backends():
    assert "runs with torch" in torch_free_unavailable("pinned")
    assert "runs with torch" in torch_free_unavailable("fastsafetensors")


def test_bare_path_names_what_is_missing(monkeypatch):
    import importlib.util

    from gdsload.loader import driver

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kvikio" else real(name, *a))
    why = torch_free_unavailable("auto")
    assert "kvikio is not installed" in why and "gdsload[cu12]" in why
    monkeypatch.undo()
    if importlib.util.find_spec("kvikio") is not None and driver.device_count() == 0:
        assert "CUDA" in torch_free_unavailable("auto")  # no driver, or no device: the driver's answer
    assert torch_free_unavailable("auto", probe=False) == (None if importlib.util.find_spec("kvikio") else why)


def test_device_buffers_slice_like_byte_arrays_and_show_their_address():
    from gdsload.loader.driver import DeviceBuffer

    owner = object()
    buf = DeviceBuffer(1 << 40, 1000, owner)
    part = buf[100:300]
    assert (part.ptr, part.nbytes, len(part)) == ((1 << 40) + 100, 200, 200)
    assert part[50:].ptr == (1 << 40) + 150 and part[50:].nbytes == 150
    assert buf[990:2000].nbytes == 10 and buf[500:400].nbytes == 0 and buf[-10:].ptr == (1 << 40) + 990
    assert part.__cuda_array_interface__ == {
        "shape": (200,),
        "typestr": "|u1",
        "data": ((1 << 40) + 100, False),
        "strides": None,
        "version": 3,
    }
    assert part._mem is owner  # a slice keeps the allocation alive
    with pytest.raises(ValueError, match="step 1"):
        buf[::2]
    with pytest.raises(TypeError, match=r"sliced with \[start:stop\]"):
        buf[3]


def test_no_cuda_driver_is_a_typed_error_that_says_what_to_do(monkeypatch):
    import ctypes

    from gdsload.loader import driver
    from gdsload.loader.errors import BackendUnavailableError

    def missing(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(driver, "_lib", None)
    monkeypatch.setattr(ctypes, "CDLL", missing)
    with pytest.raises(BackendUnavailableError, match=r"libcuda.so.1\) does not load: .*install the NVIDIA driver"):
        driver.lib()
    assert driver.device_count() == 0
    assert driver.error_name(2) == "CUresult 2"  # an error still gets its number where no driver loads


def test_cuda_ipc_document_with_a_damaged_handle_is_a_typed_error():
    doc = {
        "version": 1,
        "kind": "cuda-ipc",
        "rank": 0,
        "nbytes": 16,
        "tensors": [],
        "cuda_ipc": {"device_uuid": "00000000-0000-0000-0000-000000000000", "handle": "AAAA", "size": 16},
    }
    with pytest.raises(IpcError, match="3 bytes, not 64"):
        import_rank(doc)


def test_cuda_ipc_document_for_an_absent_gpu_is_a_typed_error():
    doc = {
        "version": 1,
        "kind": "cuda-ipc",
        "rank": 0,
        "nbytes": 16,
        "tensors": [],
        "cuda_ipc": {
            "device_uuid": "00000000-0000-0000-0000-000000000000",
            "handle": base64.b64encode(bytes(64)).decode(),
            "size": 16,
        },
    }
    with pytest.raises(IpcError, match="not visible"):
        import_rank(doc)


def test_kvikio_reads_land_every_byte_and_hold_settings_from_open_to_close(sharded_dir, monkeypatch):
    from gdsload.loader import discover, plan_rank

    seen = stand_in_kvikio(monkeypatch)
    plan = plan_rank(discover(sharded_dir, 1))
    reader = host_reader()
    arena = reader.allocate(plan.arena_bytes)
    reader.open(plan)
    reader.read(plan.extents, [arena])
    assert seen["settings"] == [{"num_threads": 3, "task_size": 1 << 20, "bounce_buffer_size": 1 << 20}]
    assert seen["restored"] == 0
    assert reader.hooks == ["use", "use", "sync"]  # open, submit, after the reads
    assert reader.io_modes() == ["posix", "posix"] and reader.direct_io() == [False, False]
    reader.close()
    assert seen["restored"] == 1 and sorted(seen["closed"]) == sorted(seen["opened"]) == sorted(
        f.path for f in plan.files
    )
    ref = {}
    for f in plan.files:
        ref.update(safetensors.torch.load_file(f.path))
    for p in plan.placements:
        assert p.copy_from is None
        raw = ref[p.name].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(arena[p.offset : p.offset + p.nbytes], raw), p.name


def _assert_oracle_bytes(plan, arena) -> None:
    ref = {}
    for f in plan.files:
        ref.update(safetensors.torch.load_file(f.path))
    for p in plan.placements:
        raw = ref[p.name].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(arena[p.offset : p.offset + p.nbytes], raw), p.name


def _cold_rank(sharded_dir, monkeypatch) -> tuple[dict, Any, list[str]]:
    """kvikio stood in for, rank 1 planned and evicted from the page cache (or the test skipped)."""
    from gdsload.loader import discover, plan_rank
    from gdsload.loader.io.iomode import o_direct_supported
    from gdsload.loader.io.pagecache import evict, resident_fraction

    seen = stand_in_kvikio(monkeypatch, direct_switch=True)
    plan = plan_rank(discover(sharded_dir, 1))
    paths = [f.path for f in plan.files]
    if not o_direct_supported(paths[0]):
        pytest.skip("this file system refuses O_DIRECT")
    evict(paths)
    if resident_fraction(paths) > 0.1:
        pytest.skip("the page cache could not be emptied here")
    return seen, plan, paths


def test_cold_files_are_read_with_o_direct_in_one_sequential_stream_per_thread(sharded_dir, monkeypatch):
    from gdsload.loader.plan import split_extents, stream_order

    seen, plan, paths = _cold_rank(sharded_dir, monkeypatch)
    small = host_reader(chunk=4096)  # kvikio reads O_DIRECT only through bounce buffers of two pages or more
    small.open(plan)
    small.close()
    assert not small.cold_direct and seen["settings"][-1]["auto_direct_io_read"] is False
    seen["settings"].clear()
    reader = host_reader(chunk=8192)
    arena = reader.allocate(plan.arena_bytes)
    reader.open(plan)
    reader.read(plan.extents, [arena])
    assert reader.cold_direct and reader.direct_io() == [True, True] and reader.io_modes() == ["posix", "posix"]
    assert seen["settings"] == [
        {"num_threads": 3, "task_size": 8192, "bounce_buffer_size": 8192, "auto_direct_io_read": True}
    ]
    # One kvikio task per read, cut at aligned offsets, queued as three sequential streams.
    queued = stream_order(split_extents([e for e in plan.extents if e.length], 8192, interleave=False, aligned=True), 3)
    assert len(queued) > 3
    assert seen["preads"] == [(paths[e.file_index], e.file_offset, e.length) for e in queued]
    reader.close()
    _assert_oracle_bytes(plan, arena)

    # The same files, now cached: page-cache reads, kvikio's usual shape, O_DIRECT switched off.
    seen["settings"].clear()
    reader = host_reader(chunk=8192)
    reader.open(plan)
    reader.read(plan.extents, [reader.allocate(plan.arena_bytes)])
    reader.close()
    assert not reader.cold_direct and reader.direct_io() == [False, False]
    assert seen["settings"] == [
        {"num_threads": 3, "task_size": 8192, "bounce_buffer_size": 8192, "auto_direct_io_read": False}
    ]


def test_a_cold_rank_goes_to_the_fastsafetensors_reader_and_kvikio_is_not_touched(sharded_dir, monkeypatch):
    import ctypes

    from gdsload.loader.io import cufile

    seen, plan, paths = _cold_rank(sharded_dir, monkeypatch)
    done: list = []

    class Reader:  # stands in for fastsafetensors' reader: copies the file bytes where the extents say
        def submit(self, extents, buffers, progress):
            for e in extents:
                with open(paths[e.file_index], "rb") as f:
                    f.seek(e.file_offset)
                    data = f.read(e.length)
                ctypes.memmove(buffers[e.buffer][0] + e.offset, data, len(data))
                done.append(e)
            return lambda: None

        def close(self):
            done.append("closed")

    monkeypatch.setattr(cufile.CuFileBackend, "COLD_READER", "fastsafetensors")
    monkeypatch.setattr(cufile, "make_fst_reader", lambda paths, index, open_paths=None: (Reader(), None))
    reader = host_reader(chunk=8192)
    arena = reader.allocate(plan.arena_bytes)
    reader.open(plan)
    reader.read(plan.extents, [arena])
    assert reader.cold_direct and reader.direct_io() == [True, True] and reader.io_modes() == ["posix", "posix"]
    assert reader.file_readers() == ["fastsafetensors", "fastsafetensors"]
    reader.close()
    assert done[-1] == "closed" and len(done) > 1
    assert seen["settings"] == [] and seen["opened"] == []  # kvikio was neither set up nor handed a file
    _assert_oracle_bytes(plan, arena)

    # Where the reader cannot start (no fastsafetensors, or its set-up refused), kvikio reads the rank.
    from gdsload.loader.io.pagecache import evict

    evict(paths)  # the stand-in read through the page cache
    monkeypatch.setattr(cufile, "make_fst_reader", lambda paths, index, open_paths=None: (None, "not here"))
    reader = host_reader(chunk=8192)
    arena = reader.allocate(plan.arena_bytes)
    reader.open(plan)
    reader.read(plan.extents, [arena])
    reader.close()
    assert reader.cold_direct and reader.file_readers() == ["kvikio", "kvikio"] and seen["settings"]
    _assert_oracle_bytes(plan, arena)


def _read_cold_rank(sharded_dir, monkeypatch) -> tuple[dict, Any, list[str], Any]:
    """:func:`_cold_rank`, then one read of it with 8 KiB reads; also returns the arena."""
    seen, plan, paths = _cold_rank(sharded_dir, monkeypatch)
    reader = host_reader(chunk=8192)
    arena = reader.allocate(plan.arena_bytes)
    reader.open(plan)
    reader.read(plan.extents, [arena])
    reader.close()
    return seen, plan, paths, arena


def test_cold_pieces_are_read_in_order_by_one_thread_each(sharded_dir, monkeypatch):
    """``COLD_PIECE``: each kvikio task (one thread) covers a piece of several O_DIRECT reads, in file order."""
    from gdsload.loader.io.cufile import CuFileBackend
    from gdsload.loader.plan import split_extents, stream_order

    monkeypatch.setattr(CuFileBackend, "COLD_PIECE", 3 * 8192 + 100)  # rounded down to whole reads
    seen, plan, paths, arena = _read_cold_rank(sharded_dir, monkeypatch)
    assert seen["settings"] == [
        {"num_threads": 3, "task_size": 3 * 8192, "bounce_buffer_size": 8192, "auto_direct_io_read": True}
    ]
    pieces = stream_order(
        split_extents([e for e in plan.extents if e.length], 3 * 8192, interleave=False, aligned=True), 3
    )
    assert seen["preads"] == [(paths[e.file_index], e.file_offset, e.length) for e in pieces]
    _assert_oracle_bytes(plan, arena)


def test_cold_streams_keep_neighbouring_reads_of_a_stream_in_flight(sharded_dir, monkeypatch):
    """``COLD_STREAMS``: fewer streams than threads, so the threads take neighbouring reads of each stream."""
    from gdsload.loader.io.cufile import CuFileBackend
    from gdsload.loader.plan import split_extents, stream_order

    monkeypatch.setattr(CuFileBackend, "COLD_STREAMS", 1)
    seen, plan, paths, arena = _read_cold_rank(sharded_dir, monkeypatch)
    assert seen["settings"][0]["num_threads"] == 3
    reads = split_extents([e for e in plan.extents if e.length], 8192, interleave=False, aligned=True)
    assert stream_order(reads, 1) == reads  # one stream: every read in file order
    assert seen["preads"] == [(paths[e.file_index], e.file_offset, e.length) for e in reads]
    _assert_oracle_bytes(plan, arena)


def test_a_small_cached_file_does_not_make_a_cold_rank_warm(tmp_path, monkeypatch):
    from gdsload.loader import discover, plan_rank
    from gdsload.loader.io.iomode import o_direct_supported
    from gdsload.loader.io.pagecache import evict, resident_fraction

    seen = stand_in_kvikio(monkeypatch, direct_switch=True)
    big, small = tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"
    save_file({"w": torch.arange(6 << 20, dtype=torch.int32)}, big)
    save_file({"norm": torch.ones(16)}, small)
    if not o_direct_supported(str(big)):
        pytest.skip("this file system refuses O_DIRECT")
    evict([str(big), str(small)])
    small.read_bytes()  # cached, as reading its header would cache it anyway
    if resident_fraction([str(big)]) > 0.1 or resident_fraction([str(small)]) < 0.9:
        pytest.skip("the page cache could not be set up here")
    plan = plan_rank(discover(tmp_path, 0))
    reader = host_reader(chunk=1 << 20)
    arena = reader.allocate(plan.arena_bytes)
    reader.open(plan)
    reader.read(plan.extents, [arena])
    reader.close()
    assert reader.cold_direct and reader.direct_io() == [True, True]
    assert seen["settings"][0]["auto_direct_io_read"] is True
    _assert_oracle_bytes(plan, arena)


def test_kvikio_reader_closes_the_files_it_opened_when_a_later_open_fails(sharded_dir, monkeypatch):
    from gdsload.loader import discover, plan_rank

    seen = stand_in_kvikio(monkeypatch, fail_on="part-1.safetensors")
    plan = plan_rank(discover(sharded_dir, 0))
    reader = host_reader()
    with pytest.raises(OSError, match="part-1"):
        reader.open(plan)
    reader.close()
    assert len(seen["opened"]) == 1 and seen["closed"] == seen["opened"] and seen["restored"] == 1


def test_kvikio_bounce_buffers_are_sized_to_its_task():
    reader = host_reader(chunk=8 << 20)
    reader.options = type(reader.options)(chunk_bytes=8 << 20)
    assert reader._kvikio_settings() == {
        "num_threads": 16,
        "task_size": 8 << 20,
        "bounce_buffer_size": 8 << 20,
        "auto_direct_io_read": False,
    }
    reader.cold_direct = True  # as open() decides for a cold rank
    assert reader._kvikio_settings() == {
        "num_threads": 4,
        "task_size": 8 << 20,
        "bounce_buffer_size": 8 << 20,
        "auto_direct_io_read": True,
    }


@pytest.mark.gpu
def test_bare_load_is_bit_identical_and_never_imports_torch(sharded_dir):
    _needs_bare()
    for rank in (0, 1):
        out, _ = _run(sharded_dir, rank, verify=True)
        assert "torch" not in out["imported"] and "cupy" not in out["imported"]
        assert out["digests"] == _oracle(sorted(sharded_dir.glob(f"model-rank-{rank}-part-*.safetensors")))
        r = out["report"]
        assert r["backend"] == "cufile" and r["verified"] and r["device"] == "cuda:0"
        assert {f["io_mode"] for f in r["files"]} <= {"gds", "p2pdma", "compat", "posix"}
        from gdsload.loader.io import staged

        if staged.unavailable() is None and not any(f["io_mode"] in ("gds", "p2pdma") for f in r["files"]):
            # cached files without GDS: the staged reader reads them, and the report names it
            assert {f["reader"] for f in r["files"]} == {"staged"} and {f["io_mode"] for f in r["files"]} == {"posix"}
            # At the default checks an uncompressed rank needs no numpy and no kvikio (their imports cost a fresh
            # worker 0.2-0.3 s); verify=True copies the loaded bytes to the host to hash them, through numpy.
            plain, _ = _run(sharded_dir, rank, verify=None)
            assert plain["imported"] == [], plain["imported"]


@pytest.mark.gpu
def test_bare_load_of_foreign_misaligned_file(tmp_path):
    _needs_bare()
    from tensor_cases import _misaligned_file

    path = tmp_path / "foreign.safetensors"
    _misaligned_file(path)
    out, _ = _run(path)
    assert out["digests"] == _oracle([path])
    assert out["report"]["files"][0]["copied_tensors"] == 3


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["ours", "foreign-misaligned"])
def test_bare_load_of_cold_files_reads_them_with_o_direct(tmp_path, which):
    _needs_bare()
    from gdsload.loader.io.iomode import o_direct_supported
    from gdsload.loader.io.pagecache import evict, resident_fraction

    if which == "ours":  # big enough that the readahead of its header read leaves it cold
        path, files = tmp_path / "ours.safetensors", [tmp_path / "ours.safetensors"]
        save_file({"w": torch.randn(6 << 20).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64)}, path)
    else:  # odd header length and tensor offsets, and big enough that its header page is a small part
        import numpy as np

        path, files = tmp_path / "foreign.safetensors", [tmp_path / "foreign.safetensors"]
        big = np.random.default_rng(1).integers(0, 255, 24 << 20, dtype=np.uint8)
        header = {
            "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
            "b": {"dtype": "U8", "shape": [big.size], "data_offsets": [3, 3 + big.size]},
            "c": {"dtype": "U8", "shape": [5], "data_offsets": [3 + big.size, 8 + big.size]},
        }
        raw = json.dumps(header).encode() + b" "
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"abc" + big.tobytes() + b"defgh")
    if not o_direct_supported(str(files[0])):
        pytest.skip("this file system refuses O_DIRECT")
    evict(files)
    out, _ = _run(path)
    # O_DIRECT reads leave the page cache as it was: only the headers (read to plan) come in.
    assert resident_fraction(files) < 0.5
    assert all(f["direct_io"] and f["io_mode"] == "posix" for f in out["report"]["files"])
    assert out["digests"] == _oracle(files)


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["ans", "zstd"])
def test_bare_load_decodes_compressed_files(tmp_path, codec):
    _needs_bare()
    from gdsload.loader.prepare.compress import compress_dir

    src = _bench_like(tmp_path, fp8=False)
    out_dir = tmp_path / codec
    compress_dir(src, out_dir, codec=codec, device="cuda")
    out, _ = _run(out_dir, verify=True)
    assert out["digests"] == _oracle(sorted(src.glob("*.safetensors")))
    r = out["report"]
    assert r["verified"] and r["stored_bytes"] < r["logical_bytes"] and r["staging_bytes"] > 0
    if codec == "ans":  # its chunk tables are made without numpy, and the device checks each tensor's CRC-32
        out, _ = _run(out_dir)
        assert out["digests"] == _oracle(sorted(src.glob("*.safetensors")))
        assert "numpy" not in out["imported"] and "torch" not in out["imported"], out["imported"]


@pytest.mark.gpu
@pytest.mark.parametrize("codec", [None, "ans"])
def test_a_cold_rank_is_read_by_fastsafetensors_without_importing_kvikio(tmp_path, codec):
    _needs_bare()
    pytest.importorskip("fastsafetensors")
    from gdsload.loader.io.pagecache import evict, resident_fraction
    from gdsload.loader.prepare.compress import compress_dir

    src = tmp_path / "src"  # tmp_path lies on the machine's disk, which accepts O_DIRECT
    src.mkdir()
    g = torch.Generator().manual_seed(4)
    for part in range(2):
        save_file(
            {
                f"p{part}.w": (0.02 * torch.randn(2048, 1024, generator=g)).to(torch.bfloat16),
                f"p{part}.odd": torch.randn(333, 17, generator=g),
            },
            src / f"model-rank-0-part-{part}.safetensors",
        )
    d = src
    if codec:
        d = tmp_path / codec
        compress_dir(src, d, codec=codec, device="cuda")
    files = [str(p) for p in sorted(d.glob("*.safetensors"))]
    evict(files)
    if resident_fraction(files) > 0.1:
        pytest.skip("could not evict the files from the page cache here")
    out, _ = _run(d)
    assert out["digests"] == _oracle(sorted(src.glob("*.safetensors")))
    files_said = out["report"]["files"]
    assert {f["reader"] for f in files_said} == {"fastsafetensors"} and all(f["direct_io"] for f in files_said)
    assert not {"kvikio", "numpy", "torch"} & set(out["imported"]), out["imported"]


@pytest.mark.gpu
def test_bare_close_gives_the_memory_back(tmp_path):
    _needs_bare()
    g = torch.Generator().manual_seed(2)
    for part in range(2):
        save_file(
            {f"w{part}": torch.randn(32 << 20, generator=g).to(torch.bfloat16)},
            tmp_path / f"model-rank-0-part-{part}.safetensors",
        )  # 2 x 64 MiB
    out, mem = _run(tmp_path)
    assert out["arena_bytes"] >= 128 << 20
    assert mem["free0"] - mem["loaded"] >= out["arena_bytes"]  # the arena was really on the GPU
    assert mem["closed"] - mem["loaded"] >= out["arena_bytes"] - (2 << 20)  # and its cudaFree happened on close
    assert mem["free0"] - mem["closed"] <= 64 << 20  # nothing big left behind (nvCOMP/kvikio scratch at most)


@pytest.mark.gpu
def test_bare_export_maps_as_torch_tensors_in_another_process(sharded_dir):
    _needs_bare()
    p = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-c", CHILD, str(sharded_dir), "1", "0", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out = json.loads(p.stdout.readline())
        doc = json.loads(json.dumps(out["doc"]))  # survives JSON, as over HTTP
        assert doc["kind"] == "cuda-ipc"
        tensors = import_rank(doc)
        oracle = safetensors.torch.load_file(str(sharded_dir / "model-rank-1-part-0.safetensors"))
        oracle.update(safetensors.torch.load_file(str(sharded_dir / "model-rank-1-part-1.safetensors")))
        assert set(tensors) == set(oracle)
        for name, ref in oracle.items():
            got = tensors[name]
            assert got.is_cuda and got.dtype == ref.dtype and got.shape == ref.shape, name
            assert torch.equal(got.cpu().view(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), name
        del tensors, got
        torch.cuda.synchronize()
        p.stdin.write("done\n")
        p.stdin.flush()
        assert p.wait(60) == 0, p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.gpu
def test_a_buffer_dropped_on_another_thread_is_freed_without_touching_that_threads_context():
    import ctypes
    import threading

    from gdsload.loader import driver
    from gdsload.loader.devices import DriverDevice

    if driver.device_count() < 1:
        pytest.skip("the CUDA driver reports no device")
    dev = DriverDevice(0)
    free0 = dev.memory_info()[0]
    held = {"buf": dev.empty(256 << 20)}
    assert dev.memory_info()[0] <= free0 - (256 << 20)
    seen = []

    def drop() -> None:
        held.pop("buf")  # the last reference: the allocation is freed here, on a thread with no context
        now = ctypes.c_void_p()
        assert driver.lib().cuCtxGetCurrent(ctypes.byref(now)) == 0
        seen.append(now.value)

    t = threading.Thread(target=drop)
    t.start()
    t.join()
    assert seen == [None]
    assert dev.memory_info()[0] >= free0 - (8 << 20)
