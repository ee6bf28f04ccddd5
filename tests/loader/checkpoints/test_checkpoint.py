"""Training checkpoints: save/load bit-exact, no pickle, atomic writes, typed errors, the pipeline."""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import random
import struct
import subprocess
import sys
import threading
import time
import types
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tensor_cases import all_dtypes, random_tensor
from gdsload.loader import (
    BackendUnavailableError,
    CodecError,
    ConfigError,
    GdsloadError,
    load_rank,
    read_header,
    save_file,
)
from gdsload.loader.checkpoints import container as ckpt_mod
from gdsload.loader.checkpoints.container import (
    CHECKPOINT_KEY,
    CheckpointError,
    CheckpointTypeError,
    CheckpointWriteError,
    load_compressed_checkpoint,
    save_compressed_checkpoint,
)
from gdsload.loader.format.compression import METADATA_KEY, parse_compression

VOCAB, DIM = 256, 128


class TinyTransformer(nn.Module):
    """Embedding, two pre-norm encoder layers with dropout, a head: enough tensors above and below 64 KiB."""

    def __init__(self, embed: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if embed else nn.Linear(DIM, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def _make(
    seed: int, device: str = "cpu", embed: bool = True, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyTransformer(embed).to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def _batch(i: int, device: str = "cpu", embed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randint(0, VOCAB, (4, 16), generator=g) if embed else torch.randn(4, 16, DIM, generator=g)
    return x.to(device), torch.randint(0, VOCAB, (4, 16), generator=g).to(device)


def _bf16_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(i, "cuda", embed=False)
    return x.bfloat16(), y


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = batch
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    opt.step()


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Strict equality: same types all the way down, tensors bitwise (dtype, shape, device), floats by their bits."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device, a.requires_grad) == (b.dtype, b.shape, b.device, b.requires_grad), where
        assert _bits(a) == _bits(b), f"{where}: values differ"
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), where
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
        assert_same(getattr(a, "_metadata", None), getattr(b, "_metadata", None), f"{where}._metadata")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A transformer + AdamW after three steps on the CPU, saved with Zstd; the state as it was at save time."""
    model, opt = _make(seed=0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    for i in range(3):
        _step(model, opt, _batch(i))
        sched.step()
    random.seed(7)
    np.random.seed(7)
    extras = {
        "epoch": 3,
        "best_loss": float("inf"),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "scheduler": sched.state_dict(),
        "history": [[1.5, -0.0, float("nan")], (2, "two", None), {"ok": True}],
    }
    path = tmp_path_factory.mktemp("ckpt") / "step-3.safetensors"
    report = save_compressed_checkpoint(model, opt, path, "Zstd", extras=extras)
    return {
        "model": model,
        "opt": opt,
        "path": path,
        "report": report,
        "extras": copy.deepcopy(extras),
        "model_sd": copy.deepcopy(model.state_dict()),
        "opt_sd": copy.deepcopy(opt.state_dict()),
    }


# --------------------------------------------------------------------------- CPU: round trips


def test_codec_is_the_keyword_as_everywhere_else(trained, tmp_path):
    """``codec=`` (the word compress, shard and gdsload.save use) saves as the positional ``algorithm`` does; the
    two naming different codecs is refused before anything is written."""
    sd = trained["model_sd"]
    path = tmp_path / "c.safetensors"
    report = save_compressed_checkpoint(sd, None, path, codec="zstd")
    assert report.algorithm.lower() == "zstd"
    assert_same(load_compressed_checkpoint(path, "cpu")["model"], sd, "model")
    with pytest.raises(ConfigError, match="name two codecs"):
        save_compressed_checkpoint(sd, None, tmp_path / "d.safetensors", "ANS", codec="zstd")
    assert not (tmp_path / "d.safetensors").exists()


def test_zstd_round_trip_is_bit_exact(trained):
    ck = load_compressed_checkpoint(trained["path"], "cpu")
    assert set(ck) == {"model", "optimizer", "extras"}
    assert_same(ck["model"], trained["model_sd"], "model")
    assert_same(ck["optimizer"], trained["opt_sd"], "optimizer")
    assert_same(ck["extras"], trained["extras"], "extras")
    steps = [s["step"] for s in ck["optimizer"]["state"].values()]
    assert steps and all(s.dtype == torch.float32 and s.dim() == 0 and float(s) == 3.0 for s in steps)
    assert type(ck["optimizer"]["param_groups"][0]["betas"]) is tuple
    # device=None: back where it was saved from (all CPU here)
    assert_same(load_compressed_checkpoint(trained["path"]), ck)


def test_report_has_ratio_and_separate_timings(trained):
    r = trained["report"]
    assert r.algorithm == "zstd" and r.writer == "posix"
    assert 0 < r.compressed < r.tensors
    assert r.logical_bytes > r.stored_bytes and r.ratio > 1.0
    assert r.file_bytes == os.path.getsize(trained["path"])
    assert r.compress_seconds > 0 and r.write_seconds > 0
    assert r.total_seconds >= max(r.compress_seconds, r.write_seconds)
    assert r.gbps > 0 and r.compress_gbps > 0 and r.write_gbps > 0
    line = r.summary()
    assert "ratio" in line and "compress" in line and "write" in line and "writer=posix" in line
    assert json.loads(json.dumps(r.to_dict()))["ratio"] == pytest.approx(r.ratio)


def test_resumed_training_matches_uninterrupted_training_exactly(trained):
    ck = load_compressed_checkpoint(trained["path"], "cpu")
    model, opt = _make(seed=123)  # different initial weights: everything must come from the file
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])

    ref_model, ref_opt = _make(seed=0)  # the in-memory state at save time, through torch's own copies
    ref_model.load_state_dict(trained["model_sd"])
    ref_opt.load_state_dict(copy.deepcopy(trained["opt_sd"]))

    runs = ((model, opt, ck["extras"]["rng"]["torch"]), (ref_model, ref_opt, trained["extras"]["rng"]["torch"]))
    for m, o, rng in runs:
        torch.set_rng_state(rng)  # dropout draws the same masks
        for i in (3, 4):  # two more steps
            _step(m, o, _batch(i))
    assert_same(model.state_dict(), ref_model.state_dict(), "model after resume")
    assert_same(opt.state_dict(), ref_opt.state_dict(), "optimizer after resume")
    # and it really moved: the resumed weights are not the saved ones
    assert _bits(model.state_dict()["head.weight"]) != _bits(trained["model_sd"]["head.weight"])


def test_extras_rng_states_restore_the_generators(trained):
    ck = load_compressed_checkpoint(trained["path"], "cpu")
    rng = ck["extras"]["rng"]
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    got = (np.random.rand(3).tolist(), random.random(), torch.rand(3).tolist())
    np.random.set_state(trained["extras"]["rng"]["numpy"])
    random.setstate(trained["extras"]["rng"]["python"])
    torch.set_rng_state(trained["extras"]["rng"]["torch"])
    assert got == (np.random.rand(3).tolist(), random.random(), torch.rand(3).tolist())
    sched_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(sched_opt, T_max=100)
    sched.load_state_dict(ck["extras"]["scheduler"])
    assert sched.last_epoch == 3


def test_file_is_safetensors_with_no_pickle(trained):
    path = trained["path"]
    assert not zipfile.is_zipfile(path)  # torch.save's container is a zip of pickles
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__")
    assert set(meta) == {"format", CHECKPOINT_KEY, METADATA_KEY}

    def strict(token: str) -> None:
        raise AssertionError(f"{token} is not standard JSON; other readers of the skeleton would reject it")

    skeleton = json.loads(meta[CHECKPOINT_KEY], parse_constant=strict)  # the extras hold inf and nan
    assert skeleton["version"] == 1 and set(skeleton["tree"]) == {"model", "optimizer", "extras"}
    assert set(skeleton["tensors"]) == set(header)  # every stored byte belongs to a described tensor
    h = read_header(path)  # strict: tiles the data section exactly, no trailing bytes
    assert h.data_aligned and not h.misaligned()
    comp = parse_compression(h)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(header)
        for name in f.keys():
            t = f.get_tensor(name)
            if name in comp:
                assert t.dtype == torch.uint8 and t.dim() == 1
            elif t.dtype != torch.uint8:
                assert list(t.shape) == skeleton["tensors"][name]["shape"]
        assert torch.equal(f.get_tensor("model/head.bias"), trained["model_sd"]["head.bias"])
    # load_rank reads it too, decoding the compressed tensors
    res = load_rank(path)
    name = "optim/state/0/exp_avg"
    assert name in comp and _bits(res.tensors[name]) == _bits(trained["opt_sd"]["state"][0]["exp_avg"])


def test_same_state_gives_the_same_bytes_from_module_or_state_dict(trained, tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_compressed_checkpoint(trained["model_sd"], trained["opt_sd"], a, "zstd", extras=trained["extras"])
    model, opt = _make(seed=5)
    model.load_state_dict(trained["model_sd"])
    opt.load_state_dict(copy.deepcopy(trained["opt_sd"]))
    save_compressed_checkpoint(model, opt, b, "ZSTD", extras=trained["extras"])
    assert a.read_bytes() == b.read_bytes() == trained["path"].read_bytes()


def test_extras_with_tensors_nested_containers_sharing_and_odd_keys(tmp_path):
    big = torch.arange(40_000, dtype=torch.int64)  # 320 KB: compressed
    w = torch.randn(300, 70)
    p = nn.Parameter(torch.randn(5, 3))
    frozen = nn.Parameter(torch.randn(2), requires_grad=False)
    extras = {
        "nested": [[big, [torch.tensor(1.5), torch.empty(0, 3)]], (w.t(), w[1:3])],  # non-contiguous views
        "same": (w, w),  # one tensor twice: comes back as one tensor
        "params": {"p": p, "frozen": frozen, "grad": torch.ones(2, requires_grad=True)},
        "keys": {3: "int", 2.5: "float", None: "none", True: "bool", (1, "a"): "tuple", "s": {"deep": [None]}},
        "odict": OrderedDict([("z", 1), ("a", 2)]),
        "numbers": [0, -1, 2**70, 1e-310, float("-inf"), float("nan"), -0.0, True, False, None, "ü/\u2603"],
        "numpy": {
            "arr": np.arange(12, dtype=">u4").reshape(3, 4),
            "f16": np.ones(3, np.float16),
            "scalar": np.float32(0.1),
            "bool": np.bool_(True),
            "empty": np.zeros((0, 2)),
        },
        "a/b": torch.ones(3),
        "a": {"b": torch.zeros(3)},  # the same tensor name as above: made unique
    }
    path = tmp_path / "x.safetensors"
    save_compressed_checkpoint(None, None, path, "zstd", extras=extras)
    ck = load_compressed_checkpoint(path, "cpu")
    assert ck["model"] is None and ck["optimizer"] is None
    assert_same(ck["extras"], extras, "extras")
    assert ck["extras"]["same"][0] is ck["extras"]["same"][1]
    assert type(ck["extras"]["params"]["p"]) is nn.Parameter and ck["extras"]["params"]["p"].requires_grad
    assert ck["extras"]["nested"][1][0].is_contiguous()
    assert parse_compression(read_header(path))["extra/nested/0/0"].codec == "zstd"


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(allow_nan=True), st.text(max_size=8)
)
_keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.tuples(st.integers(0, 3), st.text(max_size=2)))
_leaves = st.one_of(_scalars, st.integers(0, 300).map(lambda n: torch.arange(n, dtype=torch.int16).reshape(-1, 1)))
_trees = st.recursive(
    _leaves,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.tuples(kids, kids), st.dictionaries(_keys, kids, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=_trees)
def test_any_tree_of_supported_values_round_trips(tmp_path, tree):
    path = tmp_path / "t.safetensors"
    save_compressed_checkpoint(None, None, path, "zstd", extras={"tree": tree})
    assert_same(load_compressed_checkpoint(path)["extras"], {"tree": tree})


def test_header_room_for_tensors_of_4_gib_and_more():
    """A 4 GiB tensor (an embedding of a large model) must not overflow the reserve's uint32 chunk sizes."""
    from gdsload.loader.checkpoints.container import _reserve
    from gdsload.loader.checkpoints.tree import Leaf

    huge = Leaf("embed", torch.empty(2**31 + 7, dtype=torch.bfloat16, device="meta"), "BF16", "model['embed']")
    assert huge.nbytes > 0xFFFFFFFF
    chunks = -(-huge.nbytes // (256 << 10))  # zstd frames of 256 KiB: one uint32 size each, base64 in the header
    table = 4 * -(-4 * chunks // 3)
    for checksum in (False, True):
        reserved = _reserve([], [huge], "zstd", checksum, {})
        assert reserved % 4096 == 0 and reserved >= 8 + table


def test_a_checkpoint_without_tensors(tmp_path):
    path = tmp_path / "meta.safetensors"
    report = save_compressed_checkpoint(None, None, path, "zstd", extras={"epoch": 7})
    assert report.tensors == 0 and report.stored_bytes == 0 and report.file_bytes == path.stat().st_size == 4096
    assert load_compressed_checkpoint(path) == {"model": None, "optimizer": None, "extras": {"epoch": 7}}


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    emb = torch.randn(VOCAB, DIM)
    state = OrderedDict([("embed.weight", emb), ("lm_head.weight", emb), ("norm", torch.ones(DIM))])
    path = tmp_path / "tied.safetensors"
    report = save_compressed_checkpoint(state, None, path, "zstd")
    assert report.tensors == 2
    ck = load_compressed_checkpoint(path, "cpu")
    assert ck["model"]["embed.weight"] is ck["model"]["lm_head.weight"]
    assert_same(ck["model"], state)


def test_every_dtype_round_trips_compressed_or_raw(tmp_path):
    state: dict[str, torch.Tensor] = {}
    for i, dt in enumerate(all_dtypes()):
        name = str(dt).removeprefix("torch.")
        state[f"{name}.noise"] = random_tensor((96, 1024), dt, seed=i)  # incompressible: stored raw, as U8
        state[f"{name}.smooth"] = torch.zeros(96, 1024).to(dt)  # compresses
        state[f"{name}.small"] = random_tensor((3, 5), dt, seed=50 + i)
        state[f"{name}.scalar"] = random_tensor((), dt, seed=90 + i)
    state["c64"] = torch.randn(3, 4, dtype=torch.complex64).conj()  # conjugate bit resolved
    path = tmp_path / "dtypes.safetensors"
    report = save_compressed_checkpoint(state, None, path, "zstd")
    comp = parse_compression(read_header(path))
    raw_stream = [
        t.name for t in read_header(path).tensors if t.dtype == "U8" and t.name not in comp and "uint8" not in t.name
    ]
    assert comp and raw_stream and report.compressed == len(comp)
    ck = load_compressed_checkpoint(path, "cpu")
    expected = dict(state, c64=state["c64"].resolve_conj())
    assert_same(ck["model"], expected, "model")


def test_algorithm_none_stores_everything_typed_and_raw(trained, tmp_path):
    path = tmp_path / "raw.safetensors"
    report = save_compressed_checkpoint(trained["model_sd"], trained["opt_sd"], path, "none")
    assert report.algorithm == "none" and report.compressed == 0 and report.ratio == 1.0
    assert METADATA_KEY not in read_header(path).metadata
    assert_same(load_compressed_checkpoint(path, "cpu")["optimizer"], trained["opt_sd"])


# --------------------------------------------------------------------------- CPU: the pipeline and the writers


def test_compression_overlaps_writing(trained, tmp_path, monkeypatch):
    delay = 0.05
    real_encode, real_write = ckpt_mod.encode_tensor, ckpt_mod._PosixSink.write

    def slow_encode(*a: Any, **k: Any) -> Any:
        time.sleep(delay)
        return real_encode(*a, **k)

    def slow_write(self: Any, data: np.ndarray, offset: int) -> None:
        time.sleep(delay)
        real_write(self, data, offset)

    monkeypatch.setattr(ckpt_mod, "encode_tensor", slow_encode)
    monkeypatch.setattr(ckpt_mod._PosixSink, "write", slow_write)
    state = {f"w{i}": torch.randn(256, 1024) for i in range(8)}  # 1 MiB each: one write per tensor
    r = save_compressed_checkpoint(state, None, tmp_path / "p.safetensors", "zstd", min_gain=0.0)
    assert r.compress_seconds >= 8 * delay and r.write_seconds >= 8 * delay
    # serial would take compress + write; the pipeline hides one behind the other
    assert r.total_seconds < 0.8 * (r.compress_seconds + r.write_seconds), r.summary()
    assert_same(load_compressed_checkpoint(tmp_path / "p.safetensors")["model"], state)


class _FakeFuture:
    def __init__(self, n: int) -> None:
        self.n = n

    def get(self) -> int:
        return self.n


class _FakeCuFile:
    """kvikio.CuFile's write API over os.pwrite, to test the kvikio writer path on the CPU."""

    opened: list[tuple[str, str]] = []

    def __init__(self, file: Any, flags: str = "r") -> None:
        assert flags == "r+" and os.path.getsize(file) == 0
        self.fd = os.open(file, os.O_RDWR)
        _FakeCuFile.opened.append((str(file), flags))

    def pwrite(self, buf: np.ndarray, size: int, file_offset: int = 0) -> _FakeFuture:
        return _FakeFuture(os.pwrite(self.fd, memoryview(buf).cast("B")[:size], file_offset))

    def close(self) -> None:
        os.close(self.fd)


def test_kvikio_writer_writes_the_same_file(trained, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvikio", types.SimpleNamespace(CuFile=_FakeCuFile))
    _FakeCuFile.opened.clear()
    a, b = tmp_path / "kvikio.safetensors", tmp_path / "auto.safetensors"
    r = save_compressed_checkpoint(
        trained["model_sd"], trained["opt_sd"], a, "zstd", extras=trained["extras"], writer="kvikio"
    )
    assert r.writer == "kvikio" and len(_FakeCuFile.opened) == 1
    assert (
        save_compressed_checkpoint(trained["model_sd"], trained["opt_sd"], b, "zstd", extras=trained["extras"]).writer
        == "kvikio"
    )  # auto takes kvikio when it imports
    assert a.read_bytes() == b.read_bytes() == trained["path"].read_bytes()  # posix wrote that one


def test_kvikio_writer_named_explicitly_fails_loudly_without_kvikio(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvikio", None)  # import kvikio -> ImportError
    with pytest.raises(BackendUnavailableError, match="writer='posix'"):
        save_compressed_checkpoint({"w": torch.ones(3)}, None, tmp_path / "k.safetensors", "zstd", writer="kvikio")
    assert _listing(tmp_path) == []
    r = save_compressed_checkpoint({"w": torch.ones(3)}, None, tmp_path / "k.safetensors", "zstd")
    assert r.writer == "posix"


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gdsload-checkpoint-writer"]


def test_disk_full_leaves_the_previous_checkpoint_and_nothing_else(trained, tmp_path, monkeypatch):
    path = tmp_path / "last.safetensors"
    path.write_bytes(trained["path"].read_bytes())
    before = path.read_bytes()
    budget = [200_000]
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        n = min(len(memoryview(data)), budget[0])
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget[0] -= n
        return real_pwrite(fd, memoryview(data)[:n], offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    model, opt = trained["model"], trained["opt"]
    with pytest.raises(CheckpointWriteError) as info:
        save_compressed_checkpoint(model, opt, path, "zstd", extras=trained["extras"])
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert "No space left" in str(info.value) and "last.safetensors" in str(info.value)
    assert _listing(tmp_path) == ["last.safetensors"] and path.read_bytes() == before
    assert not _writer_threads()


def test_a_failing_writer_never_leaves_the_compressor_blocked(tmp_path, monkeypatch):
    def failing(self: Any, data: np.ndarray, offset: int) -> None:
        time.sleep(0.2)  # meanwhile the compressor fills the queue and blocks on it
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(ckpt_mod._PosixSink, "write", failing)
    state = {f"w{i}": torch.randn(64, 1024) for i in range(12)}
    outcome: list[BaseException] = []

    def save() -> None:
        try:
            save_compressed_checkpoint(state, None, tmp_path / "c.safetensors", "zstd", min_gain=0.0)
        except BaseException as e:
            outcome.append(e)

    worker = threading.Thread(target=save, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "save hung after the writer failed"
    assert isinstance(outcome[0], CheckpointWriteError) and outcome[0].errno == errno.EIO
    assert _listing(tmp_path) == [] and not _writer_threads()


def test_failure_while_compressing_leaves_nothing(tmp_path, monkeypatch):
    calls = [0]
    real = ckpt_mod.encode_tensor

    def flaky(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("simulated codec failure")
        return real(*a, **k)

    monkeypatch.setattr(ckpt_mod, "encode_tensor", flaky)
    state = {f"w{i}": torch.randn(128, 1024) for i in range(5)}
    with pytest.raises(RuntimeError, match="simulated"):
        save_compressed_checkpoint(state, None, tmp_path / "c.safetensors", "zstd")
    assert _listing(tmp_path) == [] and not _writer_threads()


# --------------------------------------------------------------------------- CPU: bad input


@pytest.mark.parametrize(
    ("extras", "where", "what"),
    [
        ({"logger": object()}, "extras['logger']", "builtins.object"),
        ({"fn": [1, lambda: 0]}, "extras['fn'][1]", "function"),
        ({"s": {1, 2}}, "extras['s']", "builtins.set"),
        ({"d": {"x": torch.Size([2])}}, "extras['d']['x']", "torch.Size"),
        ({"sp": torch.eye(3).to_sparse()}, "extras['sp']", "sparse"),
        ({"c128": torch.zeros(2, dtype=torch.complex128)}, "extras['c128']", "complex128"),
        ({"meta": torch.empty(2, device="meta")}, "extras['meta']", "meta"),
        ({"k": {frozenset(): 1}}, "extras['k']", "frozenset"),
        ({"strs": np.array(["a"])}, "extras['strs']", "<U1"),
        ({"dd": __import__("collections").defaultdict(int)}, "extras['dd']", "defaultdict"),
    ],
)
def test_unstorable_values_are_typed_errors_naming_the_path(tmp_path, extras, where, what):
    with pytest.raises(CheckpointTypeError) as info:
        save_compressed_checkpoint({"w": torch.ones(2)}, None, tmp_path / "c.safetensors", "zstd", extras=extras)
    assert isinstance(info.value, TypeError) and isinstance(info.value, GdsloadError)
    assert where in str(info.value) and what in str(info.value)
    assert _listing(tmp_path) == []


def test_cycles_and_bad_arguments_are_rejected_before_writing(tmp_path):
    loop: list[Any] = [1]
    loop.append(loop)
    p = tmp_path / "c.safetensors"
    with pytest.raises(CheckpointTypeError, match=r"extras\['loop'\]\[1\] contains itself"):
        save_compressed_checkpoint(None, None, p, "zstd", extras={"loop": loop})
    with pytest.raises(ConfigError, match="'ANS', 'Zstd', 'GDeflate'"):
        save_compressed_checkpoint({"w": torch.ones(2)}, None, p, "lz4")
    with pytest.raises(ConfigError, match="min_gain"):
        save_compressed_checkpoint({"w": torch.ones(2)}, None, p, "zstd", min_gain=1.5)
    with pytest.raises(ConfigError, match="writer"):
        save_compressed_checkpoint({"w": torch.ones(2)}, None, p, "zstd", writer="fast")
    with pytest.raises(ConfigError, match=r"\.safetensors"):
        save_compressed_checkpoint({"w": torch.ones(2)}, None, tmp_path / "c.pt", "zstd")
    with pytest.raises(CheckpointTypeError, match="torch.nn.modules.module.Module"):
        save_compressed_checkpoint(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0), None, p, "zstd")
    with pytest.raises(CheckpointTypeError, match="extras must be a dict"):
        save_compressed_checkpoint(None, None, p, "zstd", extras=[1, 2])
    with pytest.raises(CheckpointWriteError, match="create its directory"):
        save_compressed_checkpoint({"w": torch.ones(2)}, None, tmp_path / "missing" / "c.safetensors", "zstd")
    assert _listing(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on hosts without a GPU")
@pytest.mark.parametrize("algorithm", ["ANS", "gdeflate"])
def test_gpu_codec_without_a_gpu_is_a_codec_error_naming_the_fix(trained, tmp_path, algorithm):
    with pytest.raises(CodecError) as info:
        save_compressed_checkpoint(trained["model"], trained["opt"], tmp_path / "c.safetensors", algorithm)
    msg = str(info.value)
    assert "GPU" in msg and "algorithm='Zstd'" in msg and "model['" in msg
    assert _listing(tmp_path) == []


def test_loading_something_else_is_a_checkpoint_error(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.ones(2)}, plain)
    with pytest.raises(CheckpointError, match="not a gdsload training checkpoint"):
        load_compressed_checkpoint(plain)
    newer = tmp_path / "newer.safetensors"
    save_file({"w": torch.ones(2)}, newer, {CHECKPOINT_KEY: json.dumps({"version": 99})})
    with pytest.raises(CheckpointError, match="version 99"):
        load_compressed_checkpoint(newer)
    lying = tmp_path / "lying.safetensors"
    skeleton = {
        "version": 1,
        "tree": {"model": {"dict": [["w", {"tensor": "model/w"}]]}},
        "tensors": {"model/w": {"dtype": "F32", "shape": [3], "device": "cpu"}},
    }
    save_file({"model/w": torch.ones(2)}, lying, {CHECKPOINT_KEY: json.dumps(skeleton)})
    with pytest.raises(CheckpointError, match="skeleton says F32"):
        load_compressed_checkpoint(lying)
    skeleton["tensors"]["model/w"]["shape"] = [2]
    skeleton["tree"]["model"] = {"dict": [["w", {"nope": 1}]]}
    save_file({"model/w": torch.ones(2)}, lying, {CHECKPOINT_KEY: json.dumps(skeleton)})
    with pytest.raises(CheckpointError, match=r"corrupt at model\['w'\]"):
        load_compressed_checkpoint(lying)
    skeleton["tree"]["model"] = {"dict": [["w", {"tensor": "model/w"}]]}
    skeleton["tensors"]["model/w"]["device"] = "meta"  # no save writes it: tensors would come back without data
    save_file({"model/w": torch.ones(2)}, lying, {CHECKPOINT_KEY: json.dumps(skeleton)})
    with pytest.raises(CheckpointError, match="device 'meta' in the skeleton, which a save never writes"):
        load_compressed_checkpoint(lying)


def test_corrupt_skeleton_values_are_checkpoint_errors(tmp_path):
    path = tmp_path / "c.safetensors"
    table = {"model/w": {"dtype": ["F32"], "shape": [2], "device": "cpu"}}  # an unhashable dtype
    skeleton = {"version": 1, "tree": {"model": {"dict": [["w", {"tensor": "model/w"}]]}}, "tensors": table}
    save_file({"model/w": torch.ones(2)}, path, {CHECKPOINT_KEY: json.dumps(skeleton)})
    with pytest.raises(CheckpointError, match="c.safetensors"):
        load_compressed_checkpoint(path)
    table["model/w"]["dtype"] = "F32"
    skeleton["tree"]["extras"] = {"dict": [["x", {"npscalar": "<f8", "hex": ""}]]}  # no bytes for the scalar
    save_file({"model/w": torch.ones(2)}, path, {CHECKPOINT_KEY: json.dumps(skeleton)})
    with pytest.raises(CheckpointError, match=r"corrupt at extras\['x'\] \(IndexError"):
        load_compressed_checkpoint(path)


def test_requires_grad_stays_with_each_reference(tmp_path):
    w = torch.randn(3, requires_grad=True)
    path = tmp_path / "g.safetensors"
    save_compressed_checkpoint(None, None, path, "none", extras={"w": w, "snap": w.detach(), "again": w})
    e = load_compressed_checkpoint(path)["extras"]
    assert e["w"].requires_grad and not e["snap"].requires_grad  # as torch.load gives them
    assert e["again"] is e["w"] and torch.equal(e["snap"], w.detach())
    assert e["snap"].untyped_storage().data_ptr() == e["w"].untyped_storage().data_ptr()  # still one memory


def test_load_reads_the_file_whose_header_it_read(tmp_path, monkeypatch):
    # A trainer renames a new checkpoint over the path while a load is between header and data.
    path, other = tmp_path / "latest.safetensors", tmp_path / "next.safetensors"
    save_compressed_checkpoint(None, None, path, "none", extras={"x": torch.arange(4, dtype=torch.float32)})
    save_compressed_checkpoint(
        None, None, other, "none", extras={"z": torch.ones(8, dtype=torch.float64), "x": torch.full((4,), 7.0)}
    )
    real = ckpt_mod._skeleton

    def swap_then_parse(header: Any) -> Any:
        os.replace(other, path)
        return real(header)

    monkeypatch.setattr(ckpt_mod, "_skeleton", swap_then_parse)
    got = load_compressed_checkpoint(path)["extras"]
    assert list(got) == ["x"] and torch.equal(got["x"], torch.arange(4, dtype=torch.float32))


def test_concurrent_saves_of_one_path_do_not_mix(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    first_started, second_done = threading.Event(), threading.Event()
    real = ckpt_mod._compress
    seen: list[int] = []

    def slow_first(leaf: Any, *args: Any) -> Any:  # the first save stops after one tensor until the second is done
        seen.append(threading.get_ident())
        if threading.get_ident() == seen[0] and not second_done.is_set():
            first_started.set()
            second_done.wait(10)
        return real(leaf, *args)

    monkeypatch.setattr(ckpt_mod, "_compress", slow_first)
    big = 1 << 18  # above the raw threshold, so every tensor goes through _compress
    errors: list[BaseException] = []

    def save_ones() -> None:
        try:
            save_compressed_checkpoint({f"w{i}": torch.ones(big) for i in range(4)}, None, path, "zstd")
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    t = threading.Thread(target=save_ones)
    t.start()
    assert first_started.wait(10)
    save_compressed_checkpoint({f"w{i}": torch.full((big,), 2.0) for i in range(4)}, None, path, "zstd")
    second_done.set()
    t.join(20)
    assert not errors, errors
    model = load_compressed_checkpoint(path)["model"]
    assert {float(v.unique()) for v in model.values()} == {1.0}  # the last to finish wins, whole
    assert _listing(tmp_path) == ["c.safetensors"]


def test_a_killed_save_leaves_a_temp_the_next_save_removes(tmp_path):
    import fcntl

    from gdsload.loader.format.atomic import create_locked

    path = tmp_path / "c.safetensors"
    code = (
        "import os, sys, torch; from gdsload.loader.checkpoints import container as c; "
        "real = c._compress\n"
        "def die(*a):\n    os._exit(9)\n"
        "c._compress = die; "
        f"c.save_compressed_checkpoint({{'w': torch.ones(1 << 18)}}, None, {str(path)!r}, 'zstd')"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 9, p.stderr
    (dead,) = [tmp_path / n for n in _listing(tmp_path) if n.startswith(".c.safetensors.tmp-")]
    live, fd = create_locked(".c.safetensors.tmp-", tmp_path)  # another writer, still running, holds its lock
    # An entry under its creating name may be a live writer's, between making and locking it: kept while
    # young; one that old was left by a writer killed in that instant.
    young = tmp_path / ".c.safetensors.tmp.creating-young"
    young.write_bytes(b"")
    stale = tmp_path / ".c.safetensors.tmp.creating-stale"
    stale.write_bytes(b"")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    unlocked = tmp_path / ".c.safetensors.tmp-unlocked"  # under its final name unlocked: dead, whatever its age
    unlocked.write_bytes(b"")
    try:
        save_compressed_checkpoint({"w": torch.ones(3)}, None, path, "none")
        assert _listing(tmp_path) == sorted([live.name, young.name, "c.safetensors"])
        assert fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB) is None  # still ours
    finally:
        os.close(fd)


def test_a_leftover_that_cannot_be_removed_does_not_stop_a_save(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    stale = tmp_path / ".c.safetensors.tmp-abc123"  # e.g. another user's, in a sticky shared directory
    stale.write_bytes(b"old")
    os.utime(stale, (time.time() - 60, time.time() - 60))
    real_unlink = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self == stale:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    save_compressed_checkpoint({"w": torch.ones(3)}, None, path, "none")
    assert _listing(tmp_path) == [stale.name, "c.safetensors"]


def test_rename_failure_says_what_happened_once(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(FileNotFoundError(errno.ENOENT, "gone")))
    with pytest.raises(CheckpointWriteError) as info:
        save_compressed_checkpoint({"w": torch.ones(3)}, None, path, "none")
    text = str(info.value)
    assert text.count("nothing was written under that name") == 1 and "temporary file vanished" in text
    assert "create its directory" not in text and _listing(tmp_path) == []
    monkeypatch.undo()
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(ConfigError, match="is a directory; name a file in it"):
        save_compressed_checkpoint({"w": torch.ones(3)}, None, tmp_path / "d.safetensors", "none")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on hosts without a GPU")
def test_cuda_checkpoint_on_a_cpu_host_needs_a_device(tmp_path):
    path = tmp_path / "c.safetensors"
    save_compressed_checkpoint({"w": torch.ones(2)}, None, path, "zstd")
    h = read_header(path)
    skeleton = json.loads(h.metadata[CHECKPOINT_KEY])
    skeleton["tensors"]["model/w"]["device"] = "cuda:0"  # as if saved on a GPU host
    forged = tmp_path / "forged.safetensors"
    save_file({"model/w": torch.ones(2)}, forged, {CHECKPOINT_KEY: json.dumps(skeleton)})
    with pytest.raises(CheckpointError, match="device='cpu'"):
        load_compressed_checkpoint(forged)
    assert_same(load_compressed_checkpoint(forged, "cpu")["model"], {"w": torch.ones(2)})


# --------------------------------------------------------------------------- GPU (pytest -m gpu)


def _cuda_baseline() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.gpu
def test_gpu_ans_training_checkpoint_round_trips_and_resumes_exactly(tmp_path):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # deterministic attention backward: resumed steps compare bitwise
        # bf16 weights and moments (nvCOMP ANS <f2), fp32 step counters on the CPU
        model, opt = _make(seed=0, device="cuda", embed=False, dtype=torch.bfloat16)
        for i in range(3):
            _step(model, opt, _bf16_batch(i))
        extras = {"step": 3, "cuda_rng": torch.cuda.get_rng_state(), "rng": torch.get_rng_state()}
        saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        path = tmp_path / "gpu.safetensors"
        base = _cuda_baseline()
        r = save_compressed_checkpoint(model, opt, path, "ANS", extras=extras)
        assert _cuda_baseline() == base  # nothing left behind on the GPU
        assert r.algorithm == "ans" and r.compressed > 0 and r.ratio > 1.0
        assert r.compress_seconds > 0 and r.write_seconds > 0
        assert max(r.compress_seconds, r.write_seconds) <= r.total_seconds
        assert r.total_seconds < r.compress_seconds + r.write_seconds + 1.0, r.summary()
        assert all(e.codec == "ans" for e in parse_compression(read_header(path)).values())

        ck = load_compressed_checkpoint(path, "cuda")
        assert_same(ck["model"], saved_model, "model")
        steps = {k: v for k, v in saved_opt["state"].items()}
        got = ck["optimizer"]
        assert got["param_groups"] == saved_opt["param_groups"]
        for pid, st in steps.items():
            for k, v in st.items():
                t = got["state"][pid][k]
                assert t.device.type == "cuda" and _bits(t) == _bits(v) and t.dtype == v.dtype, (pid, k)
        original = load_compressed_checkpoint(path)  # device=None: where they were saved from
        assert_same(original["optimizer"], saved_opt, "optimizer")
        assert original["optimizer"]["state"][0]["step"].device.type == "cpu"
        assert original["model"]["head.weight"].device.type == "cuda"

        resumed, ropt = _make(seed=9, device="cuda", embed=False, dtype=torch.bfloat16)
        resumed.load_state_dict(original["model"])
        ropt.load_state_dict(original["optimizer"])
        torch.cuda.set_rng_state(original["extras"]["cuda_rng"])
        _step(resumed, ropt, _bf16_batch(3))
        torch.cuda.set_rng_state(extras["cuda_rng"])
        _step(model, opt, _bf16_batch(3))
        assert_same(resumed.state_dict(), model.state_dict(), "model after resume")
        assert_same(ropt.state_dict(), opt.state_dict(), "optimizer after resume")


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["ANS", "GDeflate", "Zstd"])
def test_gpu_codecs_round_trip_cpu_and_cuda_tensors(tmp_path, algorithm):
    g = torch.Generator().manual_seed(3)
    cpu_state = {
        "bf16": (0.02 * torch.randn(512, 1024, generator=g)).bfloat16(),
        "f32": torch.randn(300, 400, generator=g),
        "i64": torch.arange(50_000),
        "noise": random_tensor((200_000,), torch.uint8, seed=4),
        "small": torch.ones(7),
    }
    state = {**{f"cpu.{k}": v for k, v in cpu_state.items()}, **{f"gpu.{k}": v.cuda() for k, v in cpu_state.items()}}
    path = tmp_path / "c.safetensors"
    r = save_compressed_checkpoint(state, None, path, algorithm)  # ANS/GDeflate: CPU tensors go via the GPU
    assert r.compressed >= 4  # bf16 and int64, on each side; fp32 noise may gain less than 2%
    back = load_compressed_checkpoint(path)
    assert_same(back["model"], state)
    on_cpu = load_compressed_checkpoint(path, "cpu")  # ANS/GDeflate decode on the GPU, then come to the CPU
    assert_same(on_cpu["model"], {k: v.cpu() for k, v in state.items()})


@pytest.mark.gpu
def test_gpu_zstd_checkpoint_loads_on_the_cpu_decoder(tmp_path, monkeypatch):
    state = {"w": torch.randn(512, 512, device="cuda").bfloat16()}
    path = tmp_path / "z.safetensors"
    save_compressed_checkpoint(state, None, path, "zstd")
    monkeypatch.setattr(ckpt_mod, "nvcomp_available", lambda: "pretend: no GPU decoder")
    assert_same(load_compressed_checkpoint(path, "cpu")["model"], {"w": state["w"].cpu()})


@pytest.mark.gpu
def test_gpu_kvikio_and_posix_write_the_same_file(tmp_path):
    pytest.importorskip("kvikio")
    model, opt = _make(seed=1, device="cuda")
    _step(model, opt, _batch(0, "cuda"))
    a, b = tmp_path / "k.safetensors", tmp_path / "p.safetensors"
    ra = save_compressed_checkpoint(model, opt, a, "ANS", writer="kvikio")
    rb = save_compressed_checkpoint(model, opt, b, "ANS", writer="posix")
    assert (ra.writer, rb.writer) == ("kvikio", "posix")
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.gpu
def test_gpu_pipeline_report_on_a_larger_state(tmp_path):
    torch.manual_seed(0)
    state = {f"layer{i}.w": (0.02 * torch.randn(4096, 4096, device="cuda")) for i in range(16)}  # 1.07 GB fp32
    optim = {
        "state": {
            i: {"exp_avg": 1e-3 * torch.randn(4096, 4096, device="cuda"), "step": torch.tensor(9.0)} for i in range(4)
        },
        "param_groups": [{"lr": 1e-4, "params": list(range(4))}],
    }
    path = tmp_path / "big.safetensors"
    r = save_compressed_checkpoint(state, optim, path, "ANS")
    assert r.ratio > 1.0 and r.compressed == 20
    fast, slow = sorted((r.compress_seconds, r.write_seconds))
    # serial would take slow + fast; pipelined, the faster side hides behind the slower one
    assert slow <= r.total_seconds < slow + 0.5 * fast + 0.25, r.summary()
    back = load_compressed_checkpoint(path, "cuda")
    assert all(torch.equal(back["model"][k], v) for k, v in state.items())
    assert math.isclose(r.file_bytes, path.stat().st_size)
