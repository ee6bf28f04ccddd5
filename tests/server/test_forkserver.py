"""The worker fork server's preload: what it records, the CUDA check, and the choice of libraries.

The fork server itself runs in every ``gdsload serve`` test (it is the default worker start);
tests/server/test_server.py checks that the workers are its children and that it leaves with the server.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys

import pytest

from gdsload.server import forkserver
from gdsload.server.settings import ServeConfig
from gdsload.server.start import start_worker_server


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> dict:
    fresh: dict = {}
    monkeypatch.setattr(forkserver, "STATE", fresh)
    return fresh


def test_preload_records_each_import_and_never_raises():
    # In a fresh interpreter, as in the fork server (this test process may have initialised CUDA itself).
    code = (
        "import json; from gdsload.server import forkserver as f; "
        "f.preload(('json', 'gdsload_no_such_module', 'json')); print(json.dumps(f.STATE))"
    )
    state = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert isinstance(state["modules"]["json"], float) and state["modules"]["json"] >= 0
    assert state["modules"]["gdsload_no_such_module"].startswith("ModuleNotFoundError: ")
    assert state["seconds"] >= 0 and state["threads"] >= 1
    # No driver on a CPU host (None); where there is one, these imports did not initialise it.
    assert state["cuda_initialised"] in (None, False)


def test_a_fork_server_that_initialised_cuda_is_refused(state: dict):
    assert forkserver.inherited_problem() is None  # nothing inherited: a spawned worker, or this process
    state.update(modules={"cupy": 0.4, "broken": "ImportError: x"}, cuda_initialised=True, seconds=0.4)
    problem = forkserver.inherited_problem()
    assert problem is not None
    assert "initialised CUDA while importing ['cupy']" in problem and "--worker-start spawn" in problem


@pytest.mark.parametrize(
    "gpu, torch, names",
    [
        (True, False, ["gdsload.server.preload_gpu"]),
        (False, True, ["gdsload.server.preload_torch"]),
        (True, True, ["gdsload.server.preload_gpu", "gdsload.server.preload_torch"]),
    ],
)
def test_preload_modules(gpu: bool, torch: bool, names: list[str]):
    assert forkserver.preload_modules(gpu, torch) == names


@pytest.mark.parametrize(
    "fst, gds, reader",
    [
        (True, False, forkserver.FST_MODULES),  # fastsafetensors reads every cold rank: kvikio and numpy not needed
        (True, True, forkserver.FST_MODULES + forkserver.KVIKIO_MODULES),  # GPUDirect Storage reads go through kvikio
        (False, False, forkserver.KVIKIO_MODULES),
    ],
)
def test_the_gpu_preload_names_the_cold_reader_this_host_uses(
    monkeypatch: pytest.MonkeyPatch, fst: bool, gds: bool, reader: tuple[str, ...]
):
    import importlib.util

    from gdsload.loader.io import cufile

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if fst else None) if name == "fastsafetensors" else find_spec(name, *a),
    )
    monkeypatch.setattr(cufile, "_gds_possible", lambda: gds)
    assert forkserver.gpu_modules() == forkserver.GPU_MODULES + reader


def test_choosing_the_gpu_preload_imports_neither_reader():
    code = (
        "import sys; from gdsload.server.forkserver import gpu_modules; names = gpu_modules(); "
        "print(names, [m for m in ('fastsafetensors', 'kvikio', 'numpy') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.rstrip().endswith(" []"), out
    assert "'gdsload.loader.pipeline.load'" in out


def test_context_names_the_start_method():
    assert forkserver.context("spawn").get_start_method() == "spawn"
    assert forkserver.context("forkserver").get_start_method() == "forkserver"
    with pytest.raises(ValueError, match="'fork' is not 'forkserver' or 'spawn'"):
        forkserver.context("fork")


def test_auto_forks_where_workers_import_torch():
    assert forkserver.resolve("auto", torch=True) == "forkserver"
    assert forkserver.resolve("auto", torch=False) == "spawn"
    assert forkserver.resolve("forkserver", torch=False) == "forkserver"
    assert forkserver.resolve("spawn", torch=True) == "spawn"


@pytest.mark.parametrize(
    "gpus, torch_free, backend, device_map, worker_start, method, preload",
    [
        # Torch-free GPU workers: auto spawns them (their imports hide the CUDA context); forkserver preloads the GPU path.
        ("0,1", True, "auto", "auto", "auto", "spawn", None),
        ("0,1", True, "auto", "auto", "forkserver", "forkserver", ["gdsload.server.preload_gpu"]),
        # Some worker loads with torch: auto forks, and the helper imports torch as well.
        (
            "0,1",
            True,
            "pinned",
            "auto",
            "auto",
            "forkserver",
            ["gdsload.server.preload_gpu", "gdsload.server.preload_torch"],
        ),
        (
            "0,1",
            False,
            "auto",
            "auto",
            "auto",
            "forkserver",
            ["gdsload.server.preload_gpu", "gdsload.server.preload_torch"],
        ),
        (
            "0,1",
            True,
            "auto",
            "0:0,1:cpu",
            "auto",
            "forkserver",
            ["gdsload.server.preload_gpu", "gdsload.server.preload_torch"],
        ),
        ("0,1", True, "auto", "cpu", "auto", "forkserver", ["gdsload.server.preload_torch"]),
        ("", True, "auto", "auto", "auto", "forkserver", ["gdsload.server.preload_torch"]),
        ("", True, "auto", "auto", "spawn", "spawn", None),
    ],
)
def test_the_server_preloads_what_its_workers_import(
    monkeypatch: pytest.MonkeyPatch,
    gpus: str,
    torch_free: bool,
    backend: str,
    device_map: str,
    worker_start: str,
    method: str,
    preload: list[str] | None,
):
    import importlib.util

    from gdsload.server import start

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if torch_free else None) if name in ("cupy", "kvikio") else real_find_spec(name, *a),
    )
    started: list[list[str]] = []
    monkeypatch.setattr(
        forkserver.multiprocessing.forkserver,
        "ensure_running",
        lambda: started.append(list(multiprocessing.forkserver._forkserver._preload_modules)),
    )
    monkeypatch.setattr(multiprocessing.forkserver._forkserver, "_preload_modules", [])
    config = ServeConfig(backend=backend, device_map=device_map, worker_start=worker_start)
    assert start.worker_start_method(config) == method
    start_worker_server(config)
    assert started == ([preload] if preload else [])  # spawn starts no helper


def test_a_failing_fork_server_falls_back_to_spawn(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A fork server that cannot fork (it crashed in a native import, say) costs no rank: the server
    says why in the log and the status, and starts this worker and every later one with spawn."""
    import time

    from gdsload.loader.prepare.synthetic import LlamaShape, make_checkpoint
    from gdsload.server import supervisor
    from gdsload.server.workers import WorkerHandle

    model = make_checkpoint(
        tmp_path / "m", LlamaShape(hidden=64, intermediate=128, heads=4, kv_heads=4, vocab=256, layers=1), tp=2
    )
    real_spawn = WorkerHandle.spawn.__func__
    methods: list[str] = []

    def spawn(cls, spec, start_method="spawn"):
        methods.append(start_method)
        if start_method == "forkserver":
            raise EOFError("the fork server closed the connection")
        return real_spawn(cls, spec, start_method)

    monkeypatch.setattr(WorkerHandle, "spawn", classmethod(spawn))
    monkeypatch.setattr(forkserver, "start", lambda *a, **k: None)  # no real helper in the test process
    sup = supervisor.Supervisor(ServeConfig(model_dir=str(model), device_map="cpu"))
    assert sup.worker_start == "forkserver"  # auto, for workers that load with torch
    sup.start()
    try:
        deadline = time.monotonic() + 120
        while sup.readiness()[0] != 200:
            assert time.monotonic() < deadline, sup.status()
            time.sleep(0.05)
        status = sup.status()
        assert status["worker_start"] == "spawn"
        assert status["fork_server"] == {"error": "EOFError: the fork server closed the connection"}
        assert all(r["restarts"] == 0 and r["failures"] == 0 for r in status["ranks"].values())
        # The ranks start at once: each tried the fork server at most once, then every worker was spawned.
        assert methods.count("spawn") == 2 and 1 <= methods.count("forkserver") <= 2, methods
        assert methods[-1] == "spawn"
    finally:
        sup.stop()


def test_the_server_starts_its_first_workers_before_importing_numpy(tmp_path):
    """Listing a model's files for its first generation imports no numpy (planning does, on a reload): every
    import before the workers' start delays them."""
    from gdsload.loader.prepare.synthetic import LlamaShape, make_checkpoint

    model = make_checkpoint(
        tmp_path / "m", LlamaShape(hidden=64, intermediate=128, heads=4, kv_heads=4, vocab=256, layers=1), tp=2
    )
    code = (
        "import json, os, sys; from gdsload.server.settings import ServeConfig; "
        "from gdsload.server.target import check_target; "
        "t = check_target(sys.argv[1], ServeConfig(model_dir=sys.argv[1], device_map='cpu')); "
        "print(json.dumps({'ranks': sorted(t.files), 'numpy': 'numpy' in sys.modules}))"
    )
    out = json.loads(
        subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, check=True).stdout
    )
    assert out == {"ranks": [0, 1], "numpy": False}
