"""gdsload.save / gdsload.load: drop-ins for torch.save / torch.load on gdsload's compressed tensor file."""

from __future__ import annotations

import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
from collections import OrderedDict

import numpy as np
import pytest
import safetensors
import torch
from torch import nn

import gdsload
from gdsload.loader.checkpoints import dropin, save_compressed_checkpoint
from gdsload.loader.checkpoints.encode import SEGMENT
from gdsload.loader.errors import (
    CheckpointError,
    CheckpointTypeError,
    CheckpointWriteError,
    CodecError,
    ConfigError,
    IntegrityError,
)
from gdsload.loader.format.compression import parse_compression
from gdsload.loader.format.safetensors import read_header
from gdsload.loader.format.writer import save_file
from tensor_cases import all_dtypes, random_tensor


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(a: object, b: object, where: str = "obj") -> None:
    """Same types all the way down; tensors bit for bit with their strides, offsets and flags."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad, a.device) == (
            b.dtype,
            b.shape,
            b.stride(),
            b.storage_offset(),
            b.requires_grad,
            b.device,
        ), where
        assert _bits(a) == _bits(b), f"{where}: values differ"
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _trained(steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(300, 128), nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 300))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randint(0, 300, (4, 8), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).reshape(-1, 300), x.reshape(-1)).backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _state() -> dict:
    model, opt, sched = _trained()
    base = torch.randn(64, 48)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "epoch": 3,
        "loss": float("nan"),
        "note": "trained",
        "flags": (True, None, 2.5, -0.0),
        "rng": torch.get_rng_state(),
        "base": base,
        "view": base[8:40, ::3],
        "t": base.t(),  # views of one storage, strided
        "param": nn.Parameter(torch.ones(7, 3)),
        "frozen": nn.Parameter(torch.zeros(2), requires_grad=False),
        "grad": torch.ones(3).requires_grad_(),
        "big": torch.randn(1 << 18) * 0.01,
        # split into 2 and 8 byte planes; sizes that end in a partial frame
        "big_bf16": torch.randn(100_001).bfloat16(),
        "big_f64": torch.randn(30_001, dtype=torch.float64),
        "dtypes": OrderedDict((str(dt), random_tensor((33, 17), dt, i)) for i, dt in enumerate(all_dtypes())),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "complex": torch.randn(4, 4, dtype=torch.complex64),
        "nested": [[{"a": torch.arange(5)}], {"b": (torch.zeros(1 << 16),)}],
    }


def test_round_trip_is_bit_exact_for_what_torch_save_takes(tmp_path):
    state = _state()
    report = gdsload.save(state, tmp_path / "ckpt.pt")
    back = gdsload.load(tmp_path / "ckpt.pt")
    assert_same(state, back)
    assert back["view"].untyped_storage().data_ptr() == back["base"].untyped_storage().data_ptr()
    assert back["t"].untyped_storage().data_ptr() == back["base"].untyped_storage().data_ptr()
    assert report.stored_bytes < report.logical_bytes and report.ratio > 1.3  # the zeros and embeddings gain
    # What torch.save and torch.load make of the same object is the oracle.
    torch.save(state, tmp_path / "ref.pt")
    assert_same(torch.load(tmp_path / "ref.pt"), back)


def test_loaded_state_resumes_training_bit_for_bit(tmp_path):
    model, opt, sched = _trained(3)
    gdsload.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, tmp_path / "c")
    model2, opt2, sched2 = _trained(0)
    ck = gdsload.load(tmp_path / "c")
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optim"])
    sched2.load_state_dict(ck["sched"])
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        x = torch.randint(0, 300, (4, 8), generator=torch.Generator().manual_seed(99))
        o.zero_grad()
        nn.functional.cross_entropy(m(x).reshape(-1, 300), x.reshape(-1)).backward()
        o.step()
        s.step()
    assert all(_bits(a) == _bits(b) for a, b in zip(model.parameters(), model2.parameters()))


def test_the_file_is_a_safetensors_file_with_checksums_for_every_entry(tmp_path):
    gdsload.save(_state(), tmp_path / "ckpt.pt", codec="zstd")
    with safetensors.safe_open(tmp_path / "ckpt.pt", "pt") as f:
        names = set(f.keys())
    header = read_header(tmp_path / "ckpt.pt")
    table = json.loads(header.metadata["gdsload.tensors"])["tensors"]
    assert names == set(table) and "pickle" in names
    assert all(meta["crc32"] for meta in table.values() if meta["shape"] != [0])
    comp = parse_compression(header)
    assert comp and all(e.dtype == "U8" for e in comp.values())  # what a decoder that knows no planes gets
    assert any(meta.get("planes") == 4 for meta in table.values())


def test_torch_load_of_a_gdsload_file_stops_with_a_message_naming_gdsload_load(tmp_path):
    gdsload.save({"w": torch.randn(1 << 16)}, tmp_path / "ckpt.pt")
    with pytest.raises(pickle.UnpicklingError, match=r"gdsload\.load"):
        torch.load(tmp_path / "ckpt.pt")  # weights_only=True, torch's default
    with pytest.raises(TypeError):  # weights_only=False: never a wrong object
        torch.load(tmp_path / "ckpt.pt", weights_only=False)


@pytest.mark.parametrize("count", [1, 400])
def test_the_torch_load_guard_holds_for_small_and_large_headers(tmp_path, count):
    gdsload.save({f"t{i}": torch.full((3,), float(i)) for i in range(count)}, tmp_path / "c.bin")
    raw = (tmp_path / "c.bin").read_bytes()
    assert raw[0] == ord("X")  # the header's length reads as a pickle string that covers its opening
    with pytest.raises(pickle.UnpicklingError, match="written by gdsload.save"):
        torch.load(tmp_path / "c.bin")
    assert gdsload.load(tmp_path / "c.bin")[f"t{count - 1}"][0] == count - 1


def test_into_fills_existing_tensors_in_place(tmp_path):
    model, opt, _ = _trained(3)
    gdsload.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}, tmp_path / "c.pt")
    fresh, opt2, _ = _trained(0)
    for p in fresh.parameters():
        p.grad = torch.zeros_like(p)
    opt2.step()  # the optimizer's state tensors exist
    into = {"model": fresh.state_dict(), "optim": opt2.state_dict()}
    where = {k: t.data_ptr() for k, t in into["model"].items()}
    back = gdsload.load(tmp_path / "c.pt", into=into)
    for k, t in into["model"].items():
        assert back["model"][k] is t and t.data_ptr() == where[k]
    assert all(_bits(a) == _bits(b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert back["optim"]["state"][1]["exp_avg"] is opt2.state[list(fresh.parameters())[1]]["exp_avg"]
    assert_same(opt.state_dict()["state"], opt2.state_dict()["state"])
    assert back["step"] == 3


def test_into_copies_into_views_that_do_not_own_their_memory(tmp_path):
    w = torch.randn(256, 128)
    gdsload.save({"w": w}, tmp_path / "c.pt")
    flat = torch.zeros(256 * 128 + 10)
    view = flat[10:].view(256, 128)
    back = gdsload.load(tmp_path / "c.pt", into={"w": view})
    assert back["w"] is view and torch.equal(view, w) and flat[:10].eq(0).all()


def test_into_with_another_dtype_or_shape_is_refused_by_name(tmp_path):
    gdsload.save({"model": {"w": torch.zeros(4, 4)}}, tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match=r"object\['model'\]\['w'\] is torch.float32\[4, 4\].*torch.float16"):
        gdsload.load(tmp_path / "c.pt", into={"model": {"w": torch.zeros(4, 4, dtype=torch.float16)}})


def test_map_location_as_in_torch_load(tmp_path):
    gdsload.save({"w": torch.arange(10.0)}, tmp_path / "c.pt")
    assert gdsload.load(tmp_path / "c.pt", map_location="cpu")["w"].device.type == "cpu"
    assert gdsload.load(tmp_path / "c.pt", map_location={"cpu": "cpu"})["w"].sum() == 45
    seen = []
    got = gdsload.load(tmp_path / "c.pt", map_location=lambda s, loc: seen.append(loc))
    assert seen == ["cpu"] and got["w"].sum() == 45
    with pytest.raises(CheckpointError, match="map_location='cpu'"):
        gdsload.load(tmp_path / "c.pt", map_location="cuda:7")


class Custom:
    def __init__(self, x: int):
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and other.x == self.x


def test_weights_only_refuses_classes_it_does_not_know_and_says_how_to_allow_them(tmp_path):
    gdsload.save({"obj": Custom(3), "arr": np.arange(4)}, tmp_path / "c.pt")
    with pytest.raises(CheckpointTypeError, match="weights_only=False.*add_safe_globals"):
        gdsload.load(tmp_path / "c.pt")
    back = gdsload.load(tmp_path / "c.pt", weights_only=False)
    assert back["obj"] == Custom(3) and back["arr"].tolist() == [0, 1, 2, 3]


def test_load_opens_torch_save_and_save_compressed_checkpoint_files(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "t.pt")
    assert gdsload.load(tmp_path / "t.pt")["w"].sum() == 3
    model, opt, _ = _trained(1)
    save_compressed_checkpoint(model, opt, tmp_path / "c.safetensors", "Zstd")
    back = gdsload.load(tmp_path / "c.safetensors", map_location="cpu")
    assert_same(back["model"], model.state_dict())
    save_file({"w": torch.ones(2)}, tmp_path / "plain.safetensors")
    with pytest.raises(CheckpointError, match="not a gdsload.save file"):
        gdsload.load(tmp_path / "plain.safetensors")


def test_a_failed_save_leaves_the_previous_file(tmp_path, monkeypatch):
    gdsload.save({"w": torch.ones(1 << 16)}, tmp_path / "c.pt")
    before = (tmp_path / "c.pt").read_bytes()
    real, calls = dropin.encode, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(dropin, "encode", failing)
    with pytest.raises(OSError):
        gdsload.save({"w": torch.zeros(1 << 16), "v": torch.zeros(1 << 16)}, tmp_path / "c.pt")
    assert (tmp_path / "c.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def test_a_killed_save_leaves_the_previous_file(tmp_path):
    gdsload.save({"w": torch.ones(1 << 20)}, tmp_path / "c.pt")
    code = textwrap.dedent(f"""
        import os, signal, torch, gdsload
        from gdsload.loader.checkpoints import dropin
        real = dropin.encode
        def killing(*a, **k):
            out = real(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
        dropin.encode = killing
        gdsload.save({{"w": torch.zeros(1 << 20)}}, {str(tmp_path / "c.pt")!r})
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert p.returncode == -signal.SIGKILL
    assert torch.equal(gdsload.load(tmp_path / "c.pt")["w"], torch.ones(1 << 20))
    gdsload.save({"w": torch.zeros(3)}, tmp_path / "c.pt")  # the next save removes the dead save's leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_damaged_bytes_are_found_by_their_checksum(tmp_path, codec):
    w = torch.randn(3 * SEGMENT // 4 + 5) * 0.01  # three segments
    gdsload.save({"w": w, "small": torch.arange(10)}, tmp_path / "c.pt", codec=codec)
    header = read_header(tmp_path / "c.pt")
    info = header["storages/0"]
    start = header.data_offset + info.start
    data = bytearray((tmp_path / "c.pt").read_bytes())
    at = start + info.nbytes - 100  # in the last segment
    data[at] ^= 0x10
    (tmp_path / "c.pt").write_bytes(bytes(data))
    with pytest.raises((IntegrityError, CodecError), match=r"storages/0"):
        gdsload.load(tmp_path / "c.pt")


def test_short_writes_still_write_every_byte(tmp_path, monkeypatch):
    real = os.pwritev

    def short(fd, buffers, offset):  # the system may write fewer bytes than asked
        return real(fd, [memoryview(buffers[0])[:1000]], offset)

    monkeypatch.setattr(os, "pwritev", short)
    state = {"w": torch.randn(1 << 19) * 0.01}
    gdsload.save(state, tmp_path / "c.pt")
    assert torch.equal(gdsload.load(tmp_path / "c.pt")["w"], state["w"])


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ConfigError, match="codec='lz4'"):
        gdsload.save({}, tmp_path / "c.pt", codec="lz4")
    with pytest.raises(ConfigError, match="must be a path"):
        gdsload.save({}, open(os.devnull, "wb"))
    with pytest.raises(ConfigError, match="is a directory"):
        gdsload.save({}, tmp_path)
    with pytest.raises(ConfigError, match=r"safetensors library.*'.*c\.pt'"):
        gdsload.save({}, tmp_path / "c.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        gdsload.load(tmp_path / "nothing.pt")
    with pytest.raises(CheckpointWriteError, match="create its directory first"):
        gdsload.save({"w": torch.ones(3)}, tmp_path / "no" / "such" / "c.pt")


def test_tensors_viewing_one_memory_as_two_dtypes_are_refused_as_torch_save_does(tmp_path):
    a = torch.zeros(8)
    with pytest.raises(CheckpointTypeError, match="same memory"):
        gdsload.save({"a": a, "b": a.view(torch.int32)}, tmp_path / "c.pt")


@pytest.mark.gpu
def test_cuda_tensors_compress_on_their_gpu_and_load_anywhere(tmp_path):
    model, opt, _ = _trained(2)
    model.cuda()
    state = {"model": model.state_dict(), "cpu": torch.randn(1 << 18)}
    report = gdsload.save(state, tmp_path / "c.pt")  # ANS on the GPU for CUDA storages
    assert report.stored_bytes < report.logical_bytes
    back = gdsload.load(tmp_path / "c.pt")
    assert_same(state, back)
    on_cpu = gdsload.load(tmp_path / "c.pt", map_location="cpu")
    assert all(t.device.type == "cpu" for t in on_cpu["model"].values())
    gdsload.save(state, tmp_path / "z.pt", codec="zstd")
    assert_same(state, gdsload.load(tmp_path / "z.pt"))
    into = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    gdsload.load(tmp_path / "c.pt", into=into)
    assert all(torch.equal(into["model"][k], v) for k, v in state["model"].items())


def test_top_level_package_is_lazy(tmp_path):
    code = "import sys, gdsload; assert 'torch' not in sys.modules; print(sorted(gdsload.__all__))"
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "['load', 'save']"
