"""gdsload as DCP's storage: dcp.save / dcp.async_save / dcp.load, FSDP2 over gloo, resharding, crash safety.

The multi-process tests run tests/dcp_worker.py, one process per rank (CPU, gloo, FSDP2's fully_shard); the
others run DCP in this process, without a process group.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import safetensors
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from gdsload.loader.checkpoints import GdsloadReader, GdsloadWriter, dcp_write
from gdsload.loader.checkpoints.dcp_layout import METADATA_NAME
from gdsload.loader.errors import CheckpointError, CodecError, ConfigError, IntegrityError
from gdsload.loader.format.safetensors import read_header

WORKER = Path(__file__).with_name("dcp_worker.py")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def raises(match: str) -> pytest.RaisesContext:
    """DCP hands a rank's error on as CheckpointException (a BaseException) holding its traceback text."""
    return pytest.raises((CheckpointException, Exception), match=match)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, root: Path, world: int, timeout: float = 300) -> list[tuple[int, str]]:
    """Run ``scenario`` on ``world`` ranks; (exit status, output) per rank."""
    port = _port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(root), str(r), str(world), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    outs = []
    try:
        for p in procs:
            outs.append((p.wait(timeout=timeout), p.stdout.read()))  # type: ignore[union-attr]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def ok(outs: list[tuple[int, str]]) -> list[str]:
    for rc, out in outs:
        assert rc == 0, out[-3000:]
    return [out.strip().splitlines()[-1] for _, out in outs]


@pytest.fixture(scope="module")
def saved_at_world_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp4")
    lines = ok(launch("save", root, 4))
    assert all(line.startswith("OK save") for line in lines)
    return root


@pytest.mark.parametrize("world", [2, 1])
def test_fsdp2_state_saved_at_world_4_loads_bit_exact_at_world(saved_at_world_4, world):
    files = sorted(p.name for p in (saved_at_world_4 / "ckpt").iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) == 4 and METADATA_NAME in files
    ok(launch("load", saved_at_world_4, world))


def test_async_save_while_training_resumes_to_the_same_losses_bit_for_bit(tmp_path):
    lines = ok(launch("train", tmp_path, 2))
    assert "stall" in lines[0]
    ok(launch("resume", tmp_path, 2))
    uninterrupted = json.loads((tmp_path / "losses.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert len(uninterrupted) == 6 and resumed == uninterrupted[2:]


@pytest.mark.parametrize("scenario", ["kill-write", "kill-finish"])
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, scenario):
    outs = launch(scenario, tmp_path, 2, timeout=120)
    killed = 1 if scenario == "kill-write" else 0
    assert outs[killed][0] == -signal.SIGKILL, outs[killed][1][-2000:]
    assert outs[1 - killed][0] != 0  # the survivor's save failed: its peer is gone
    assert "OK" not in outs[1 - killed][1]
    names = os.listdir(tmp_path / "k")
    assert len([n for n in names if n.endswith(".safetensors")]) > 2  # the dead save's files are there too
    ok(launch("check-k", tmp_path, 1))


# --------------------------------------------------------------------------- one process, no process group


def _trained() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for i in range(3):
        opt.zero_grad()
        model(torch.randn(4, 256, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _state(model: nn.Module, opt: torch.optim.Optimizer, sched: object, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "step": step,
        "extra": {"note": "x", "rng": torch.get_rng_state()},
    }


def _template() -> dict:
    model, opt, sched = _trained()
    for p in model.parameters():
        p.data.zero_()
    state = _state(model, opt, sched, -1)
    for t in state["optim"]["state"].values():
        for v in t.values():
            v.zero_()
    state["extra"]["rng"] = torch.zeros_like(state["extra"]["rng"])
    return state


def _bits_equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_bits_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bits_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_save_and_load_without_a_process_group(tmp_path):
    model, opt, sched = _trained()
    state = _state(model, opt, sched, 3)
    w = GdsloadWriter(tmp_path)
    dcp.save(state, storage_writer=w)
    assert w.last_write.stored_bytes < w.last_write.logical_bytes
    back = _template()
    dcp.load(back, storage_reader=GdsloadReader(tmp_path))
    assert _bits_equal(state, back)
    (data,) = [p for p in tmp_path.iterdir() if p.suffix == ".safetensors"]
    with safetensors.safe_open(data, "pt") as f:  # the data file is an ordinary safetensors file
        assert "model.0.weight@0,0" in f.keys()


def test_checkpoint_id_picks_the_directory(tmp_path):
    model, opt, sched = _trained()
    w, r = GdsloadWriter(), GdsloadReader()
    dcp.save(_state(model, opt, sched, 1), checkpoint_id=tmp_path / "a", storage_writer=w)
    back = _template()
    dcp.load(back, checkpoint_id=tmp_path / "a", storage_reader=r)
    assert back["step"] == 1 and _bits_equal(back["model"], model.state_dict())


def test_async_save_writes_the_snapshot_not_what_training_did_after(tmp_path):
    model, opt, sched = _trained()
    state = _state(model, opt, sched, 3)
    expected = {k: v.clone() for k, v in state["model"].items()}
    w = GdsloadWriter(tmp_path)
    future = dcp.async_save(state, storage_writer=w)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the loop goes on
    future.result()
    report = w.last_stage
    assert report is not None and report.seconds > 0 and report.copied == report.logical_bytes
    assert report.host_bytes >= report.logical_bytes and report.gpu_compressed == 0
    assert w.last_write.staged
    back = _template()
    dcp.load(back, storage_reader=GdsloadReader(tmp_path))
    assert _bits_equal(back["model"], expected)


def test_staging_limit_compresses_during_the_stall_and_holds_less(tmp_path):
    model, opt, sched = _trained()
    state = _state(model, opt, sched, 3)
    w = GdsloadWriter(tmp_path, staging_limit=0)
    dcp.async_save(state, storage_writer=w).result()
    report = w.last_stage
    assert report.copied == 0 and report.cpu_compressed == report.logical_bytes
    assert report.host_bytes < report.logical_bytes
    back = _template()
    dcp.load(back, storage_reader=GdsloadReader(tmp_path))
    assert _bits_equal(state, back)


def test_a_new_save_replaces_the_old_files_and_keeps_foreign_ones(tmp_path):
    model, opt, sched = _trained()
    (tmp_path / "notes.txt").write_text("mine")
    dcp.save(_state(model, opt, sched, 1), storage_writer=GdsloadWriter(tmp_path))
    first = {p.name for p in tmp_path.glob("*.safetensors")}
    dcp.save(_state(model, opt, sched, 2), storage_writer=GdsloadWriter(tmp_path))
    second = {p.name for p in tmp_path.glob("*.safetensors")}
    assert len(first) == len(second) == 1 and not first & second
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_save_that_fails_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = _trained()
    state = _state(model, opt, sched, 1)
    dcp.save(state, storage_writer=GdsloadWriter(tmp_path))
    before = sorted(os.listdir(tmp_path))
    real, calls = dcp_write.encode, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(dcp_write, "encode", failing)
    with raises("No space left"):
        dcp.save(_state(model, opt, sched, 2), storage_writer=GdsloadWriter(tmp_path))
    assert sorted(os.listdir(tmp_path)) == before
    back = _template()
    dcp.load(back, storage_reader=GdsloadReader(tmp_path))
    assert back["step"] == 1 and _bits_equal(back["model"], state["model"])


def test_damage_is_found_by_checksum(tmp_path):
    model, opt, sched = _trained()
    dcp.save(_state(model, opt, sched, 1), storage_writer=GdsloadWriter(tmp_path, codec="none"))
    (data,) = tmp_path.glob("*.safetensors")
    header = read_header(data)
    info = header["model.0.weight@0,0"]
    raw = bytearray(data.read_bytes())
    raw[header.data_offset + info.start + 12345] ^= 1
    data.write_bytes(bytes(raw))
    with raises(r"model\.0\.weight@0,0.*CRC-32") as e:
        dcp.load(_template(), storage_reader=GdsloadReader(tmp_path))
    assert "IntegrityError" in str(e.value) or isinstance(e.value, IntegrityError)


def test_metadata_is_read_without_running_code(tmp_path):
    model, opt, sched = _trained()
    dcp.save(_state(model, opt, sched, 1), storage_writer=GdsloadWriter(tmp_path))

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (tmp_path / METADATA_NAME).write_bytes(pickle.dumps(Evil()))
    with raises("system"):
        dcp.load(_template(), storage_reader=GdsloadReader(tmp_path))
    assert not (tmp_path / "pwned").exists()


def test_a_directory_of_dcps_own_writer_gets_a_clear_error(tmp_path):
    model, opt, sched = _trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(model, opt, sched, 1), storage_writer=dcp.FileSystemWriter(tmp_path))
    with raises("FileSystemReader"):
        dcp.load(_template(), storage_reader=GdsloadReader(tmp_path))


def test_the_writer_refuses_to_travel_to_another_process():
    with pytest.raises(CheckpointError, match="AsyncCheckpointerType.THREAD"):
        pickle.dumps(GdsloadWriter("x"))


def test_options_are_checked():
    with pytest.raises(ConfigError, match="codec='lz4'"):
        GdsloadWriter("x", codec="lz4")
    with pytest.raises(ConfigError, match="staging_limit"):
        GdsloadWriter("x", staging_limit=-1)


def test_a_missing_data_file_is_named(tmp_path):
    model, opt, sched = _trained()
    dcp.save(_state(model, opt, sched, 1), storage_writer=GdsloadWriter(tmp_path))
    for p in tmp_path.glob("*.safetensors"):
        p.unlink()
    with raises("is missing"):
        dcp.load(_template(), storage_reader=GdsloadReader(tmp_path))


def test_ans_entries_say_they_need_a_gpu_on_a_cpu_host(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    import numpy as np

    from gdsload.loader.checkpoints.dcp_layout import DCP_KEY
    from gdsload.loader.checkpoints.encode import FRAME, Stored
    from gdsload.loader.checkpoints.reader import TensorFile
    from gdsload.loader.checkpoints.tensorfile import Planned, TensorFileWriter
    from gdsload.loader.format.compression import CompressedEntry

    # An entry as a GPU host writes it (nvCOMP ANS chunks, 16-byte aligned); its bytes do not matter here.
    n = 2 * FRAME
    entry = CompressedEntry("w", "U8", (n,), n, "ans", "chunks", 32, {"data_type": "<f4"}, FRAME, (16, 16), None, 16)
    stored = Stored(np.zeros(32, np.uint8), n, [0], entry)
    with TensorFileWriter(
        tmp_path / "f.safetensors", [Planned("w", n, "float32", (n // 4,), True)], {DCP_KEY: '{"version":1}'}
    ) as w:
        w.add("w", stored, stored.meta(dtype=torch.float32, shape=(n // 4,)))
    with TensorFile(tmp_path / "f.safetensors", DCP_KEY) as f:
        with pytest.raises(CodecError, match="'w' is compressed with 'ans', which only a GPU decodes"):
            f.read([(f["w"], torch.empty(n // 4))])


@pytest.mark.gpu
def test_cuda_state_compresses_on_the_gpu_and_reloads(tmp_path):
    model, opt, sched = _trained()
    model.cuda()
    opt2 = torch.optim.AdamW(model.parameters())
    opt2.zero_grad()
    model(torch.randn(4, 256, device="cuda")).pow(2).mean().backward()
    opt2.step()
    state = {"model": model.state_dict(), "optim": opt2.state_dict()}
    w = GdsloadWriter(tmp_path)
    future = dcp.async_save(state, storage_writer=w)
    future.result()
    assert w.last_stage.gpu_compressed > 0 and w.last_stage.host_bytes < w.last_stage.logical_bytes
    back = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optim": {
            "state": {k: {n: torch.zeros_like(t) for n, t in s.items()} for k, s in state["optim"]["state"].items()},
            "param_groups": state["optim"]["param_groups"],
        },
    }
    dcp.load(back, storage_reader=GdsloadReader(tmp_path))
    assert _bits_equal(back["model"], state["model"]) and _bits_equal(back["optim"], state["optim"])
    cpu = {"model": {k: torch.zeros_like(v, device="cpu") for k, v in state["model"].items()}}
    dcp.load(cpu, storage_reader=GdsloadReader(tmp_path))  # ANS decoded on the GPU, then copied to the CPU
    assert all(torch.equal(cpu["model"][k], v.cpu()) for k, v in state["model"].items())


@pytest.mark.gpu
def test_async_save_copies_cuda_state_out_through_pinned_blocks_and_writes_the_snapshot(tmp_path, monkeypatch):
    """The stall compresses CUDA tensors on the GPU and queues the copies of their stored bytes into page-locked
    blocks (an item larger than what a block has left spans two, written as one entry); it returns only once
    the copies are done, so what training does next is not in the checkpoint."""
    monkeypatch.setattr(dcp_write, "PINNED_BLOCK", 1 << 20)
    g = torch.Generator(device="cuda").manual_seed(5)
    state = {
        "big": 0.02 * torch.randn(3 << 18, device="cuda", generator=g),  # 3 MiB: its stored bytes span blocks
        "odd": 0.02 * torch.randn(100_003, device="cuda", generator=g),
        "noise": torch.randint(0, 256, (1 << 19,), device="cuda", dtype=torch.uint8, generator=g),  # stays raw
        "step": torch.tensor(7),
    }
    want = {k: v.clone() for k, v in state.items()}
    w = GdsloadWriter(tmp_path)
    future = dcp.async_save(state, storage_writer=w)
    for v in state.values():
        v.add_(1)  # training goes on
    future.result()
    report = w.last_stage
    assert report.gpu_compressed == sum(want[k].numel() * want[k].element_size() for k in ("big", "odd", "noise"))
    # The three CUDA tensors' stored bytes (all of host_bytes but the 8 of "step") in page-locked blocks of 1 MiB
    # and, at the end, the power of two that holds what is left: more than one block, less than one block spare.
    assert 1 << 20 < report.host_bytes - 8 <= report.pinned_bytes < report.host_bytes + (1 << 20)
    back = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(back, storage_reader=GdsloadReader(tmp_path))
    assert _bits_equal(back, want)
