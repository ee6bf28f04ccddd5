"""GPU readers, checked against safetensors on a CUDA host (`pytest -m gpu`): every backend, cold and cached files."""

from __future__ import annotations

import gc
import logging
import os

import numpy as np
import pytest
import safetensors.torch
import torch

from gpu_cases import _check, _reference, _skip_if_missing
from tensor_cases import mixed_tensors
from gdsload.loader import TruncatedFileError, load_rank, save_file
from gdsload.loader.io import IO_MODES, auto_order
from gdsload.loader.io.iomode import nvidia_fs_loaded
from gdsload.loader.io.pagecache import evict, resident_fraction

pytestmark = pytest.mark.gpu


GPU_BACKENDS = ["pinned", "cufile", "fastsafetensors"]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_every_backend_is_bit_identical_to_safetensors(sharded_dir, backend):
    _skip_if_missing(backend)
    for rank in (0, 1):
        result = load_rank(sharded_dir, rank, device="cuda", backend=backend)
        ref = {
            k: v for k, v in _reference(sorted(sharded_dir.glob("*.safetensors"))).items() if k.startswith(f"r{rank}.")
        }
        _check(result, ref)
        assert result.report.backend == backend and len(result.report.files) == 2
        for f in result.report.files:
            assert f.io_mode in IO_MODES and f.io_mode != "cpu"
            if f.io_mode == "gds":
                assert nvidia_fs_loaded()


@pytest.mark.parametrize("backend", ["pinned", "cufile"])
def test_foreign_and_reference_written_files(tmp_path, backend):
    _skip_if_missing(backend)
    from tensor_cases import _misaligned_file

    foreign = tmp_path / "foreign.safetensors"
    _misaligned_file(foreign)
    theirs = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(mixed_tensors(seed=9), str(theirs))
    for path in (foreign, theirs):
        res = load_rank(path, device="cuda", backend=backend)
        _check(res, _reference([path]))
    assert load_rank(foreign, device="cuda", backend=backend).report.files[0].copied_tensors == 3


def test_pinned_reads_cold_files_with_o_direct(tmp_path):
    _skip_if_missing("pinned")
    d = tmp_path / "cold"  # tmp_path lies on the machine's disk, which accepts O_DIRECT
    d.mkdir()
    tensors = {f"w{i}": (0.02 * torch.randn(1000 + i, 333)).to(torch.bfloat16) for i in range(4)}
    save_file(tensors, d / "model.safetensors")
    files = [str(d / "model.safetensors")]
    evict(files)
    if resident_fraction(files) > 0.1:
        pytest.skip("could not evict the file from the page cache here")
    res = load_rank(d, device="cuda", backend="pinned", chunk_bytes=1 << 16)
    assert res.report.files[0].direct_io
    assert resident_fraction(files) < 0.5  # O_DIRECT really ran: the page cache stayed (nearly) empty
    _check(res, tensors)
    (d / "model.safetensors").read_bytes()  # O_DIRECT bypassed the cache: fill it by hand
    warm = load_rank(d, device="cuda", backend="pinned")
    assert not warm.report.files[0].direct_io  # cached now: read through the page cache
    _check(warm, tensors)


def test_auto_picks_pinned_without_gds_and_says_why(sharded_dir, caplog):
    caplog.set_level(logging.INFO, logger="gdsload.loader.io")
    res = load_rank(sharded_dir, 0, device="cuda")
    if nvidia_fs_loaded():
        assert res.report.backend in auto_order()
    else:
        assert res.report.backend == "pinned"
        assert "backend cufile skipped" in caplog.text


def test_memory_returns_to_baseline_after_close(sharded_dir):
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    res = load_rank(sharded_dir, 1, device="cuda", backend="pinned")
    assert torch.cuda.memory_allocated() > base
    res.close()
    del res
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base
    # Pinned staging went back to the driver (the backend empties torch's host cache on close).
    host = torch.cuda.host_memory_stats()
    assert host.get("reserved_bytes.current", 0) == 0, dict(host)


def test_cached_files_go_through_the_staged_reader_and_the_report_says_so(sharded_dir, monkeypatch):
    from gdsload.loader.io import staged

    if staged.unavailable():
        pytest.skip(staged.unavailable())
    ref = {k: v for k, v in _reference(sorted(sharded_dir.glob("*.safetensors"))).items() if k.startswith("r0.")}
    for backend in ("pinned", "cufile"):
        _skip_if_missing(backend)
        result = load_rank(sharded_dir, 0, device="cuda", backend=backend)
        assert {f.reader for f in result.report.files} == {"staged"}, result.report.files
        assert {f.io_mode for f in result.report.files} == {"posix"} and "reader=staged" in result.report.summary()
        _check(result, ref)
    monkeypatch.setenv("GDSLOAD_STAGED", "0")  # kvikio reads instead, as where the staged reader is not built
    result = load_rank(sharded_dir, 0, device="cuda", backend="pinned")
    assert {f.reader for f in result.report.files} <= {"kvikio", "ring"} and "staged" not in result.report.summary()
    _check(result, ref)


def test_staged_reader_on_the_gpu_copies_exact_ranges_and_names_a_short_file(tmp_path):
    from gdsload.loader.io import staged

    if staged.unavailable():
        pytest.skip(staged.unavailable())
    data = np.random.default_rng(3).integers(0, 256, 7_340_033, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    path.write_bytes(data.tobytes())
    dst = torch.zeros(data.size + 4096, dtype=torch.uint8, device="cuda")
    fd = os.open(path, os.O_RDONLY)
    try:
        with staged.StagedPool(torch.cuda.current_device(), threads=4, chunk=1 << 20, buffers=2) as eng:
            with pytest.raises(TruncatedFileError, match="shrank"):
                eng.submit([(fd, 0, data.size + 4096, dst.data_ptr())], [str(path)])()
            # unaligned ranges in reverse order, the first range starting mid-page
            items = [(fd, 4097, data.size - 4097, dst.data_ptr() + 4097), (fd, 0, 4097, dst.data_ptr())]
            eng.submit(items, [str(path)] * 2)()
        torch.cuda.synchronize()
        assert np.array_equal(dst[: data.size].cpu().numpy(), data)
    finally:
        os.close(fd)


def test_reads_and_copies_at_once_are_both_timed(tmp_path):
    from gdsload.bench.limits import read_during_h2d

    files = []
    for i in range(2):
        f = tmp_path / f"part{i}.bin"
        f.write_bytes(os.urandom(256 << 20))
        files.append(str(f))
    both = read_during_h2d(files, "cuda", piece=8 << 20)
    assert set(both) == {"read_gbps", "h2d_gbps"}
    assert both["read_gbps"] > 0 and both["h2d_gbps"] > 0
    with pytest.raises(ValueError, match="too short"):
        read_during_h2d(files[:1], "cuda", piece=1 << 30)


def test_devices_keep_their_decode_and_check_streams():
    """The decode and check streams are made once per device (through the driver), non-blocking, and work."""
    import ctypes

    from gdsload.loader.devices import as_device

    dev = as_device("cuda:0")
    a, b = dev.stream(0), dev.stream(1)
    assert a.handle != b.handle
    assert (a.handle, b.handle) == (dev.stream(0).handle, as_device("cuda:0").stream(1).handle)
    flags = ctypes.c_uint()
    assert ctypes.CDLL("libcuda.so.1").cuStreamGetFlags(ctypes.c_void_p(a.handle), ctypes.byref(flags)) == 0
    assert flags.value == 1  # CU_STREAM_NON_BLOCKING: its work never waits on the legacy default stream
    x = torch.ones(1 << 20, device="cuda:0")
    with a.activate():
        y = x * 2
    a.synchronize()
    assert float(y.sum()) == 2 * (1 << 20)
