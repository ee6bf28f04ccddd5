"""Compressed loads through the GPU pipeline, checked against safetensors on a CUDA host (`pytest -m gpu`)."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
import torch

from gpu_cases import _bench_like, _bits, _check, _reference, _skip_if_missing, gpu_device
from gdsload.loader import CodecError, load_rank, save_file
from gdsload.loader.prepare.compress import compress_dir

pytestmark = pytest.mark.gpu


def _many_groups(tmp_path: Path, monkeypatch, *, seed: int) -> Path:
    """24 bf16 tensors (one of 8 MiB) and three small ones that stay raw in ``tmp_path/w``, their ANS copy in
    ``tmp_path/z``, and staging made 3 MiB (groups of 1 MiB: two small tensors, or a run of the large one's
    chunks)."""

    src = tmp_path / "w"
    src.mkdir()
    g = torch.Generator().manual_seed(seed)
    tensors = {f"w{i:02d}": (0.02 * torch.randn(512, 512, generator=g)).to(torch.bfloat16) for i in range(24)}
    tensors["w12"] = (0.02 * torch.randn(4096, 1024, generator=g)).to(torch.bfloat16)
    for name in ("w05a", "w12a", "w23a"):  # between the others in the file: in place, copied from the stream
        tensors[name] = torch.randn(2048, generator=g).to(torch.bfloat16)
    save_file(tensors, src / "model.safetensors")
    compress_dir(src, tmp_path / "z", codec="ans", device="cuda")
    monkeypatch.setenv("GDSLOAD_STAGING_BYTES", str(3 << 20))  # three 1 MiB buffers
    return src


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("backend", ["pinned", "cufile"])
def test_compressed_load_through_many_groups_holds_arena_plus_staging(tmp_path, monkeypatch, backend, in_place):
    """Groups of 1 MiB, one tensor (8 MiB) larger than the staging allowed (3 MiB): bit-identical, the large
    tensor read and decoded a run of chunks at a time, and torch's GPU peak is the arena plus the staging the
    report names (nvCOMP's own scratch is not torch's and is not counted). In place, the groups are read into
    the arena's top and only the last ones into staging of their own; otherwise through three buffers."""
    from gdsload.loader.pipeline import decode

    _skip_if_missing(backend)
    src = _many_groups(tmp_path, monkeypatch, seed=1)
    monkeypatch.setattr(decode, "IN_PLACE", in_place)
    layouts = []
    real = decode.in_place
    monkeypatch.setattr(decode, "in_place", lambda *a: layouts.append(real(*a)) or layouts[-1])
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = load_rank(tmp_path / "z", device="cuda", backend=backend, verify=True)
    peak = torch.cuda.max_memory_allocated() - base
    _check(res, _reference([src / "model.safetensors"]))
    if in_place:
        (layout,) = layouts
        assert layout is not None and len(layout.runs) > 10 and layout.split < len(layout.runs)
        assert 0 < res.report.staging_bytes == layout.spill < 3 << 20
    else:
        assert not layouts and res.report.staging_bytes == 3 << 20
    arena = sum(a.numel() for a in res.arenas)
    assert arena >= res.report.logical_bytes and peak <= arena + res.report.staging_bytes + (1 << 20), (peak, arena)


@pytest.mark.parametrize("where", ["torch", "cupy", "driver"])
def test_a_flipped_byte_in_any_staging_group_fails_the_load(tmp_path, monkeypatch, where):
    """A group's CRC-32 check is read back while later groups decode: a bad tensor in the first, a
    middle or the last group still fails the load, naming it, and a good load passes; so does a bad
    byte in the first or last run of chunks of a tensor (8 MiB) spread over several groups."""
    from gdsload.loader import read_header

    _many_groups(tmp_path, monkeypatch, seed=5)
    device = gpu_device(where)
    good = tmp_path / "z" / "model.safetensors"
    assert (
        load_rank(tmp_path / "z", device=device).report.logical_bytes == (23 * 512 * 512 + 4096 * 1024 + 3 * 2048) * 2
    )
    h = read_header(good)
    for name, at in (("w00", 0.3), ("w13", 0.3), ("w23", 0.3), ("w12", 0.02), ("w12", 0.98)):
        bad = tmp_path / f"bad-{name}-{at}"
        shutil.copytree(tmp_path / "z", bad)
        raw = bytearray(good.read_bytes())
        raw[h.data_offset + h[name].start + int(h[name].nbytes * at)] ^= 0x21
        (bad / "model.safetensors").write_bytes(bytes(raw))
        with pytest.raises(CodecError, match=rf"tensor '{name}'.*(CRC-32|does not decode)"):
            load_rank(bad, device=device)


def test_backends_agree_on_compressed_and_plain_rank(tmp_path, sharded_dir):
    d = tmp_path / "copy"
    shutil.copytree(sharded_dir, d)
    a = load_rank(d, 1, device="cuda", backend="pinned")
    b = load_rank(d, 1, device="cpu")
    for k in a.tensors:
        assert _bits(a.tensors[k]) == _bits(b.tensors[k]), k


# A compressed load onto GPU 1 in a process that sees every GPU (as an engine's tensor-parallel
# worker does), then: does GPU 0 hold a context? Through torch and without (a DriverDevice).
_OTHER_GPU_CHILD = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
def active(dev):
    flags, on = ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on)) == 0
    return on.value
if sys.argv[2] == "torch":
    import torch
    from gdsload.loader import load_rank
    torch.cuda.set_device(1)
    res = load_rank(sys.argv[1], device="cuda:1", backend="pinned")
    torch.cuda.synchronize()
else:
    from gdsload.loader.devices import DriverDevice
    from gdsload.loader.pipeline.load import load_rank
    res = load_rank(sys.argv[1], device=DriverDevice(1))
    res.device.synchronize()
print(active(0), active(1))
"""


_NVCOMP_PY = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="nvCOMP 6.0's Python package opens a context on GPU 0 at its first decode in a process decoding on "
    "GPU 1 (seen on two H200s, 2026-11-29); ANS chunks go through its C API instead",
)


@pytest.mark.multi_gpu(2)
@pytest.mark.parametrize(
    "codec, path",
    [
        ("ans", "torch"),
        pytest.param("zstd", "torch", marks=_NVCOMP_PY),
        ("ans", "bare"),
        pytest.param("zstd", "bare", marks=_NVCOMP_PY),
    ],
)
def test_compressed_load_on_gpu1_leaves_gpu0_alone(tmp_path, codec, path):
    import subprocess
    import sys

    src = _bench_like(tmp_path)
    out = tmp_path / codec
    compress_dir(src, out, codec=codec, device="cuda")
    p = subprocess.run(
        [sys.executable, "-c", _OTHER_GPU_CHILD, str(out), path], capture_output=True, text=True, timeout=120
    )
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])  # not the defect this test is about: a plain failure
    gpu0, gpu1 = (int(x) for x in p.stdout.split())
    if gpu1 != 1:
        raise RuntimeError(f"the load left no context on GPU 1: {p.stdout!r}")  # not the known defect
    assert gpu0 == 0, "the process holds a CUDA context on GPU 0"
