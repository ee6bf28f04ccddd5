"""One rank of a multi-process DCP test: ``python dcp_worker.py SCENARIO DIR RANK WORLD PORT``.

A tiny model sharded with FSDP2 (``fully_shard``) over gloo on the CPU (world 1: the plain module, no process
group), AdamW and a step LR schedule, batches made from the step number. Scenarios:

- ``save``: train 2 steps, ``dcp.save`` to DIR/ckpt through GdsloadWriter; rank 0 writes the full state with
  torch.save to DIR/ref.pt (the oracle);
- ``load``: ``dcp.load`` DIR/ckpt at this world size, then compare the full state with DIR/ref.pt bit for bit;
- ``train``: train 6 steps, ``dcp.async_save`` to DIR/async after step 2 and go on at once; losses to DIR/losses.json;
- ``resume``: load DIR/async, train steps 3..6; losses to DIR/resumed.json;
- ``kill-write`` / ``kill-finish``: save DIR/k after 1 step (DIR/refk.pt the oracle), train a step, save DIR/k again
  and be SIGKILLed in the middle (rank 1 while writing its data, or rank 0 before the metadata's rename);
- ``check-k``: load DIR/k and compare with DIR/refk.pt.

Exit status 0 and a line ``OK ...`` on success.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from gdsload.loader.checkpoints import GdsloadReader, GdsloadWriter
from gdsload.loader.checkpoints import dcp_write

warnings.simplefilter("ignore")  # DCP's no-process-group and FSDP's notices
VOCAB, DIM = 512, 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    """Every weight matrix is 512 KiB (128 KiB a shard at world 4): large enough to be compressed."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def setup(
    rank: int, world: int, port: int
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = Tiny()
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (4, 16), generator=g)
    return x, torch.randint(0, VOCAB, (4, 16), generator=g)


def train(
    model: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, steps: range
) -> list[str]:
    losses = []
    for step in steps:
        x, y = batch(step)  # every rank the same batch: FSDP averages identical gradients
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item().hex())
    return losses


def state(model: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, step: int) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched.state_dict(), "step": step}


def restore(
    model: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, path: Path
) -> int:
    s = state(model, opt, sched, -1)
    dcp.load(s, storage_reader=GdsloadReader(path))
    set_state_dict(model, opt, model_state_dict=s["model"], optim_state_dict=s["optim"])
    sched.load_state_dict(s["sched"])
    return s["step"]


def full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def same(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{where}: bits differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), f"{where}: keys differ"
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def kill_after(calls: int) -> None:
    """SIGKILL this process at the ``calls``-th tensor the DCP writer encodes."""
    real, seen = dcp_write.encode, [0]

    def encode(*args: object, **kwargs: object) -> object:
        seen[0] += 1
        if seen[0] == calls:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    dcp_write.encode = encode


def kill_before_metadata() -> None:
    """SIGKILL this process when the coordinator is about to rename the metadata into place."""

    class Killer:
        def __init__(self, path: object) -> None:
            pass

        def __enter__(self) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        def __exit__(self, *exc: object) -> None:
            pass

    dcp_write.atomic_output = Killer


def main() -> None:
    scenario, root, rank, world, port = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:6])
    model, opt, sched = setup(rank, world, port)
    out = ""
    if scenario == "save":
        train(model, opt, sched, range(2))
        w = GdsloadWriter(root / "ckpt")
        dcp.save(state(model, opt, sched, 2), storage_writer=w)
        assert w.last_write is not None and w.last_write.stored_bytes < w.last_write.logical_bytes, w.last_write
        ref = full(model, opt)
        if rank == 0:
            torch.save(ref, root / "ref.pt")
        out = f"ratio {w.last_write.ratio:.3f}"
    elif scenario == "load":
        step = restore(model, opt, sched, root / "ckpt")
        got = full(model, opt)
        if rank == 0:
            same(got, torch.load(root / "ref.pt"), "state")
            assert step == 2 and sched.last_epoch == 2, (step, sched.last_epoch)
    elif scenario == "train":
        losses = train(model, opt, sched, range(2))
        w = GdsloadWriter(root / "async")
        # The background save's collectives get a group of their own, apart from FSDP's in the training loop.
        group = dist.new_group(backend="gloo") if world > 1 else None
        future = dcp.async_save(state(model, opt, sched, 2), storage_writer=w, process_group=group)
        losses += train(model, opt, sched, range(2, 6))  # the loop goes on while the save runs
        future.result()
        assert w.last_stage is not None and w.last_write is not None and w.last_write.staged
        out = f"stall {w.last_stage.seconds:.4f} s, held {w.last_stage.host_bytes} B"
        if rank == 0:
            (root / "losses.json").write_text(json.dumps(losses))
    elif scenario == "resume":
        step = restore(model, opt, sched, root / "async")
        losses = train(model, opt, sched, range(step, 6))
        if rank == 0:
            (root / "resumed.json").write_text(json.dumps(losses))
    elif scenario in ("kill-write", "kill-finish"):
        train(model, opt, sched, range(1))
        dcp.save(state(model, opt, sched, 1), storage_writer=GdsloadWriter(root / "k"))
        ref = full(model, opt)
        if rank == 0:
            torch.save(ref, root / "refk.pt")
        train(model, opt, sched, range(1, 2))
        if scenario == "kill-write" and rank == 1:
            kill_after(3)
        if scenario == "kill-finish" and rank == 0:
            kill_before_metadata()
        dcp.save(state(model, opt, sched, 2), storage_writer=GdsloadWriter(root / "k"))
        out = "the killed save finished?"
    elif scenario == "check-k":
        step = restore(model, opt, sched, root / "k")
        same(full(model, opt), torch.load(root / "refk.pt"), "state")
        assert step == 1, step
        files = sorted(os.listdir(root / "k"))
        out = f"files {files}"
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    print(f"OK {scenario} rank {rank}/{world} {out}", flush=True)


if __name__ == "__main__":
    main()
