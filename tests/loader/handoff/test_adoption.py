"""Adoption: an engine's parameters take the sidecar's memory as their storage, and the engine holds
the rank's lease for as long as it lives.

The real sidecar (``gdsload serve`` on loopback, CPU ranks in shared memory), engine processes
started as children and killed like crashed engines, and the engine adapter's own code path
(``load_into_model`` with ``sidecar_url``); the engine tier runs the same against vLLM itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from gdsload.loader import load_rank, save_file
from gdsload.loader.adapters.base import InjectReport
from gdsload.loader.adapters.vllm import ShardedStateInjector
from gdsload.loader.handoff.ipc import IpcError, export_rank, import_rank
from gdsload.loader.prepare.synthetic import make_checkpoint
from sidecar_proc import Server
from tensor_cases import engine_shaped
from sidecar_proc import TOKEN


def test_a_private_cpu_mapping_is_copy_on_write(tmp_path: Path):
    """What the engine writes into adopted tensors stays its own: the exporter and other importers keep
    the loaded bytes. A shared mapping (the copy hand-off) sees the exporter's memory itself."""
    save_file(
        {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)},
        tmp_path / "m.safetensors",
    )
    exported = load_rank(tmp_path, 0, device="cpu", backend="cpu")  # an arena, as the sidecar's
    doc = export_rank(exported)
    private, shared = import_rank(doc, private=True), import_rank(doc)
    for name, t in exported.tensors.items():
        assert torch.equal(private[name], t) and torch.equal(shared[name], t)
    private["a"].mul_(-1)
    assert exported.tensors["a"][1].item() == 1.0 and shared["a"][1].item() == 1.0
    assert private["a"][1].item() == -1.0
    shared["b"].zero_()  # a shared mapping is the exporter's memory
    assert exported.tensors["b"].sum().item() == 0 and private["b"].sum().item() == 15


def test_a_private_mapping_refuses_a_damaged_name(tmp_path: Path):
    save_file({"a": torch.ones(8)}, tmp_path / "m.safetensors")
    exported = load_rank(tmp_path, 0, device="cpu", backend="cpu")  # an arena, as the sidecar's
    doc = export_rank(exported)
    import base64

    for name in (b"/../etc/passwd", b"torch_1", b"/a/b"):
        bad = {**doc, "cpu": {**doc["cpu"], "handle": base64.b64encode(name).decode()}}
        with pytest.raises(IpcError, match="not a plain POSIX shm name"):
            import_rank(bad, private=True)
    gone = {**doc, "cpu": {**doc["cpu"], "handle": base64.b64encode(b"/gdsload-test-no-such-segment").decode()}}
    with pytest.raises(IpcError, match="cannot open the exporter's shared memory"):
        import_rank(gone, private=True)


class _Engine(nn.Module):
    """Parameters laid out as an engine lays them out: one of its own, a tied pair (one Parameter under
    two names), and a fused allocation whose parts are views (vLLM's sharded_state skips those)."""

    def __init__(self) -> None:
        super().__init__()
        self.own = nn.Linear(8, 4, bias=False)
        self.embed = nn.Embedding(16, 4)
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.embed.weight
        fused = torch.zeros(2, 6)
        self.left = nn.Parameter(fused[0], requires_grad=False)
        self.right = nn.Parameter(fused[1], requires_grad=False)
        self.scale = nn.Parameter(torch.zeros(3, dtype=torch.float32), requires_grad=False)
        self.register_buffer("table", torch.zeros(5))


def test_the_injector_adopts_what_matches_exactly_and_copies_the_rest():
    model = _Engine()
    marker = model.embed.weight
    mapped = {
        "own.weight": torch.randn(4, 8),
        "embed.weight": torch.randn(16, 4),
        "left": torch.randn(6),
        "right": torch.randn(6),
        "scale": torch.randn(3, dtype=torch.float64),  # another dtype: converted, so copied
        "table": torch.randn(5),
    }
    injector = ShardedStateInjector(model)
    injector.adopt = True
    report = InjectReport(engine="vllm", model="_Engine", loaded=list(mapped))
    injector.apply(mapped, report)
    assert report.adopted == 3 and report.copied == 3, report
    assert model.own.weight.data_ptr() == mapped["own.weight"].data_ptr()
    assert model.embed.weight is marker and marker.data_ptr() == mapped["embed.weight"].data_ptr()
    assert model.head.weight.data_ptr() == mapped["embed.weight"].data_ptr()  # the tie holds
    assert model.table.data_ptr() == mapped["table"].data_ptr()
    for name in ("left", "right", "scale"):  # views of one allocation, and a converted dtype: copied
        assert getattr(model, name).data_ptr() != mapped[name].data_ptr()
    assert model.left.untyped_storage().data_ptr() == model.right.untyped_storage().data_ptr()
    assert torch.equal(model.left, mapped["left"]) and torch.equal(model.scale, mapped["scale"].float())
    copying = ShardedStateInjector(_Engine())
    copying.adopt = False
    report = InjectReport(engine="vllm", model="_Engine", loaded=list(mapped))
    copying.apply(mapped, report)
    assert (report.adopted, report.copied) == (0, 6)


class _Module(nn.Module):
    """A torch module as a user builds one: a tied embedding and head, a norm with running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("built", ["meta", "real"])
@pytest.mark.parametrize("adopt", [True, False])
def test_the_module_injector_counts_every_name_once(built: str, adopt: bool):
    from gdsload.loader.adapters import ModuleInjector, meta_init

    torch.manual_seed(0)
    mapped = {k: v.clone() for k, v in _Module().state_dict().items()}  # both tied names, as some files hold them
    mapped["lin.bias"] = mapped["lin.bias"].double()  # another dtype than the module's: converted, so copied
    if built == "meta":
        with meta_init():
            module = _Module()
    else:
        module = _Module()
    injector = ModuleInjector(module, assign=adopt or built == "meta")
    injector.adopt = adopt
    report = InjectReport(engine="torch", model="_Module", loaded=list(mapped))
    injector.apply(mapped, report)
    assert report.adopted + report.copied == len(mapped), report
    if adopt:
        assert (report.adopted, report.copied) == (len(mapped) - 1, 1), report
        assert module.embed.weight.data_ptr() == mapped["embed.weight"].data_ptr()
        assert module.head.weight is module.embed.weight  # the tie holds
        assert module.bn.running_mean.data_ptr() == mapped["bn.running_mean"].data_ptr()
        assert not module.embed.weight.requires_grad and not module.lin.weight.requires_grad
    else:
        assert report.adopted == 0
        ptrs = {t.data_ptr() for t in mapped.values()}
        assert not {t.data_ptr() for t in module.state_dict().values()} & ptrs  # nothing points at the mapping
    for name, t in module.state_dict().items():
        assert torch.equal(t, mapped[name].to(t.dtype)), name


_ENGINE = r"""
import json, os, sys, time, torch
from safetensors.torch import load_file
from torch import nn
from gdsload.loader.adapters.base import AdapterOptions
from gdsload.loader.adapters.vllm import load_into_model
from tensor_cases import engine_shaped

url, token, files = sys.argv[1], sys.argv[2], sys.argv[3:]
ref = {k: v for f in files for k, v in load_file(f).items()}
model = engine_shaped(ref)
start = time.perf_counter()
report = load_into_model(model, None, rank=0, tp_size=1,
                         options=AdapterOptions(sidecar_url=url, token=token, layout="vllm"))
seconds = time.perf_counter() - start
state = model.state_dict()
equal = all(torch.equal(state[k].view(torch.uint8), v.view(torch.uint8)) for k, v in ref.items())
for p in model.parameters():  # what an engine's post-processing may do: stays in this process
    p.data.zero_()
print(json.dumps({"adopted": report.adopted, "copied": report.copied, "tensors": len(ref), "equal": equal,
                  "seconds": seconds, "pid": os.getpid()}), flush=True)
sys.stdin.read()  # hold the weights until told to exit (or killed)
"""


def _serve(model: Path, tmp_path: Path) -> Server:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    return Server(
        [str(model), "--device-map", "cpu", "--token-file", str(token_file), "--allow-root", str(tmp_path)],
        tmp_path / "serve.log",
    )


def _start_engine(server: Server, files: list[str]) -> tuple[subprocess.Popen[str], dict]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENGINE, server.url, TOKEN, *files],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    assert line, f"the engine exited with {proc.wait(30)}"
    return proc, json.loads(line)


def _leases(server: Server) -> tuple[int, list[dict]]:
    rank = server.status()["ranks"]["0"]
    return rank["leases"], rank["held_by"]


def test_engines_adopt_a_rank_and_hold_it_until_they_exit(tmp_path: Path):
    model = make_checkpoint(tmp_path / "m", "tiny", tp=1)
    files = sorted(str(p) for p in model.glob("*.safetensors"))
    server = _serve(model, tmp_path)
    try:
        server.poll_ready()
        generation = server.status()["generation"]
        first, got = _start_engine(server, files)
        assert got["equal"] and got["adopted"] == got["tensors"] and got["copied"] == 0, got
        leases, holders = _leases(server)
        assert leases == 1 and [h["pid"] for h in holders] == [got["pid"]], holders
        # The engine zeroed its adopted weights: the sidecar's copy is untouched (copy-on-write).
        second, again = _start_engine(server, files)
        assert again["equal"] and again["adopted"] == again["tensors"], again
        assert server.status()["generation"] == generation  # adopted again, nothing reloaded
        assert _leases(server)[0] == 2
        # An engine that holds the rank keeps it from being pulled away.
        r = server.http.post("/v1/unload", json={}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 409, r.text
        # A crashed engine's lease goes when its process does.
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        deadline, t0 = time.monotonic() + 10, time.monotonic()
        while _leases(server)[0] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        freed_after = time.monotonic() - t0
        leases, holders = _leases(server)
        assert leases == 1 and [h["pid"] for h in holders] == [again["pid"]], holders
        print(f"lease of a killed engine released {freed_after:.3f} s after its exit")
        second.stdin.close()  # a clean exit releases too
        second.wait(10)
        deadline = time.monotonic() + 10
        while _leases(server)[0] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _leases(server) == (0, [])
        r = server.http.post("/v1/unload", json={}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
    finally:
        for p in ("first", "second"):
            proc = locals().get(p)
            if proc is not None and proc.poll() is None:
                proc.kill()
        server.close()


def test_a_forced_unload_tells_the_holding_engine(tmp_path: Path):
    """The sidecar may still be forced to drop a held rank: the engine hears of it at once, and its
    copy-on-write weights stay valid on CPU."""
    from gdsload.loader.handoff.sidecar_client import SidecarClient

    model = make_checkpoint(tmp_path / "m", "tiny", tp=1)
    server = _serve(model, tmp_path)
    try:
        server.poll_ready()
        mapped = SidecarClient(server.url, token=TOKEN).map_rank(0, private=True)
        ref = safetensors.torch.load_file(str(next(model.glob("*.safetensors"))))
        lost: list[str] = []
        mapped.hold(on_lost=lambda m, why: lost.append(why))
        r = server.http.post("/v1/unload", json={"force": True}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost and "voided the lease" in lost[0], lost
        for name, t in ref.items():  # the sidecar freed its arena; this process's mapping is still whole
            assert torch.equal(mapped.tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    finally:
        server.close()


def test_the_sidecar_stops_at_once_with_held_leases_and_tells_their_engines(tmp_path: Path):
    from gdsload.loader.handoff.sidecar_client import SidecarClient

    model = make_checkpoint(tmp_path / "m", "tiny", tp=1)
    server = _serve(model, tmp_path)
    try:
        server.poll_ready()
        mapped = SidecarClient(server.url, token=TOKEN).map_rank(0, private=True)
        lost: list[str] = []
        mapped.hold(on_lost=lambda m, why: lost.append(why))
        t0 = time.monotonic()
        assert server.terminate(timeout=30) == 0
        stopped_after = time.monotonic() - t0
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost and "shutting down" in lost[0], lost
        assert stopped_after < 4, f"the sidecar took {stopped_after:.1f} s to stop with a lease held"
        print(f"sidecar stopped {stopped_after:.2f} s after SIGTERM with a held lease")
    finally:
        server.close()


def test_a_sidecar_that_cannot_hold_leases_gets_its_tensors_copied(tmp_path: Path):
    """Against a sidecar without held leases (an older gdsload), the engine copies and releases, as before."""
    from gdsload.loader.adapters.base import AdapterOptions
    from gdsload.loader.adapters.vllm import load_into_model
    from ipc_sidecar import TOKEN as FAKE_TOKEN
    from ipc_sidecar import Sidecar as _Sidecar

    model_dir = make_checkpoint(tmp_path / "m", "tiny", tp=1)
    exported = load_rank(model_dir, 0, backend="cpu")  # an arena, as the sidecar's
    ref = {k: v.clone() for k, v in exported.tensors.items()}
    with _Sidecar({0: json.loads(json.dumps({**export_rank(exported), "lease": "ab" * 16}))}) as sidecar:
        model = engine_shaped(ref)
        report = load_into_model(
            model,
            None,
            rank=0,
            tp_size=1,
            options=AdapterOptions(sidecar_url=sidecar.url, token=FAKE_TOKEN, layout="vllm"),
        )
        assert (report.adopted, report.copied) == (0, len(ref)), report.summary()
        assert sidecar.released == [0]
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref.items())


def test_held_leases_survive_a_blanket_release_and_are_held_once(tmp_path: Path):
    from gdsload.loader.handoff.sidecar_client import SidecarClient, SidecarNotReadyError

    model = make_checkpoint(tmp_path / "m", "tiny", tp=1)
    server = _serve(model, tmp_path)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        server.poll_ready()
        client = SidecarClient(server.url, token=TOKEN)
        held = client.map_rank(0, private=True)
        held.hold()
        loose = server.http.get("/v1/ipc/0", headers=auth).json()["lease"]  # an engine that maps without holding
        r = server.http.post("/v1/ipc/0/release", json={}, headers=auth)  # every lease no engine holds
        assert r.status_code == 200 and r.json()["released"] == [loose], r.text
        assert _leases(server)[0] == 1
        r = server.http.get("/v1/ipc/0/hold", params={"lease": held.lease}, headers=auth)  # a second hold
        assert r.status_code == 409 and "already held" in r.text, r.text
        r = server.http.post("/v1/unload", json={}, headers=auth)
        assert r.status_code == 409 and "hold theirs while they run" in r.text, r.text
        with pytest.raises(SidecarNotReadyError, match="no longer holds lease"):
            client._open_hold(0, "cd" * 16)
        held.release()
        deadline = time.monotonic() + 10
        while _leases(server)[0] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _leases(server) == (0, [])
    finally:
        server.close()


# ------------------------------------------------- a transformers model in another process (the restart bench's engine)


def _restarts(server: Server, model: Path, device: str, methods: tuple[str, ...]) -> tuple[list[dict], list]:
    """Engines started one after another by the restart bench's own code; the leases seen while each ran."""
    from gdsload.bench.restart import run_engine

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    seen: list[tuple[int, list[int]]] = []

    def holding(answer: dict) -> None:
        leases, holders = _leases(server)
        seen.append((leases, [h["pid"] for h in holders]))

    runs = []
    for method in methods:
        r = run_engine(method, model, device, server.url, env, token=TOKEN, while_running=holding)
        assert "error" not in r, f"{method}: {r.get('error')}"
        runs.append(r)
        deadline = time.monotonic() + 10  # the exited engine's lease goes with its connection
        while _leases(server)[0] and time.monotonic() < deadline:
            time.sleep(0.02)
    return runs, seen


def _check_restarts(runs: list[dict], seen: list, tensors: int) -> None:
    first, second, copied, oracle = runs[:4]
    assert first["adopted"] == first["loaded"] == tensors and first["copied"] == 0, first
    assert second["adopted"] == second["loaded"] == tensors, second  # a second start adopts again
    assert (copied["adopted"], copied["copied"]) == (0, tensors), copied
    # The same logits, bit for bit, as the model given safetensors' own load of the files.
    assert {r["logits_sha256"] for r in runs} == {oracle["logits_sha256"]}
    # An adopting engine holds the rank's lease while it runs; a copying one gave it back.
    assert seen[:3] == [(1, [first["pid"]]), (1, [second["pid"]]), (0, [])], seen


def test_a_transformers_model_in_another_process_adopts_the_rank(tmp_path: Path):
    pytest.importorskip("transformers")
    model = make_checkpoint(tmp_path / "m", "tiny", tp=1)
    tensors = len(safetensors.torch.load_file(str(next(model.glob("*.safetensors")))))
    server = _serve(model, tmp_path)
    try:
        server.poll_ready()
        generation = server.status()["generation"]
        runs, seen = _restarts(server, model, "cpu", ("adopted", "adopted", "copied", "safetensors"))
        _check_restarts(runs, seen, tensors)
        assert server.status()["generation"] == generation  # nothing was reloaded between the starts
        assert _leases(server) == (0, [])
    finally:
        server.close()


@pytest.mark.gpu
def test_a_transformers_model_adopts_the_sidecars_gpu_memory_over_cuda_ipc(tmp_path: Path):
    """On a GPU: the parameters are the sidecar's memory (the engine allocates next to nothing), where a
    fresh read allocates the whole model."""
    pytest.importorskip("transformers")
    model = make_checkpoint(tmp_path / "m", "small", tp=1)
    ref = {k: v for f in model.glob("*.safetensors") for k, v in safetensors.torch.load_file(str(f)).items()}
    nbytes = sum(t.numel() * t.element_size() for t in ref.values())
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    server = Server(
        [str(model), "--token-file", str(token_file), "--allow-root", str(tmp_path)], tmp_path / "serve.log"
    )
    try:
        server.poll_ready(timeout=120)
        assert server.status()["ranks"]["0"]["device"].startswith("cuda")
        runs, seen = _restarts(server, model, "cuda:0", ("adopted", "adopted", "copied", "safetensors", "gdsload"))
        _check_restarts(runs, seen, len(ref))
        adopted, fresh = runs[0], runs[4]
        # The adopting engine allocated what the fresh read did less the whole model: buffers and activations only.
        assert fresh["allocated_bytes"] >= nbytes, fresh
        assert fresh["allocated_bytes"] - adopted["allocated_bytes"] >= 0.98 * nbytes, (adopted, fresh)
        print(
            f"engine allocations: adopted {adopted['allocated_bytes'] / 1e6:.1f} MB, fresh read "
            f"{fresh['allocated_bytes'] / 1e6:.1f} MB, model {nbytes / 1e6:.1f} MB"
        )
    finally:
        server.close()
