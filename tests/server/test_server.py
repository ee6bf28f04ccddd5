"""The sidecar end to end: ``gdsload serve`` in a subprocess on loopback, real checkpoints, real HTTP.

The module-scoped server (two ranks, CPU) is driven through its life in file order: start and poll
like an autoscaler, status and metrics, refused requests, IPC hand-off to another process, a killed
worker, unload, reload to a second model, SIGTERM. Every wait is bounded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from gdsload.loader import read_header
from gdsload.loader.pipeline.result import PHASES
from gdsload.loader.prepare.synthetic import LlamaShape, make_checkpoint
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open
from sidecar_proc import TOKEN, Server


def worker_parent(pid: int, server_pid: int) -> psutil.Process:
    """The process a worker was forked from: the server's worker fork server (default), or the server (spawn)."""
    parent = psutil.Process(pid).parent()
    assert parent is not None
    if parent.pid != server_pid:
        assert parent.ppid() == server_pid and "forkserver" in " ".join(parent.cmdline()), parent.cmdline()
    return parent


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def rank_files(model: Path, rank: int) -> list[Path]:
    return sorted(model.glob(f"model-rank-{rank}-part-*.safetensors"))


def oracle_bytes(model: Path, rank: int) -> tuple[int, int]:
    """(stored, logical) bytes of a rank, from the files themselves."""
    stored = logical = 0
    for f in rank_files(model, rank):
        stored += read_header(f).data_len
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                logical += t.numel() * t.element_size()
    return stored, logical


def oracle_digests(model: Path, rank: int) -> dict[str, list[Any]]:
    """name -> [dtype, shape, sha256 of the bytes], read by the reference safetensors library."""
    import torch

    out = {}
    for f in rank_files(model, rank):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
                out[name] = [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
    return out


# An engine process: map the exported rank, describe every tensor.
ENGINE = r"""
import hashlib, json, sys
import torch
from gdsload.loader.handoff.ipc import import_rank
doc = json.loads(sys.stdin.read())
tensors = import_rank(doc)
out = {}
for name, t in tensors.items():
    raw = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
    out[name] = [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
print(json.dumps({"device": str(next(iter(tensors.values())).device), "tensors": out}))
"""


def map_in_engine(doc: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, "-c", ENGINE],
        input=json.dumps(doc),
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else {**os.environ, **env},
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@dataclass
class Models:
    root: Path
    a: Path
    b: Path
    empty: Path
    outside: Path
    escape: Path
    sneaky: Path
    corrupt: Path
    tampered: Path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("models")
    a = make_checkpoint(root / "model-a", "tiny", tp=2)
    b = make_checkpoint(
        root / "model-b", LlamaShape(hidden=128, intermediate=344, heads=4, kv_heads=2, vocab=1024, layers=3), tp=2
    )
    (root / "empty").mkdir()
    outside = tmp_path_factory.mktemp("outside") / "model"
    shutil.copytree(a, outside)
    (root / "escape").symlink_to(outside, target_is_directory=True)  # a directory symlink out of the root
    sneaky = root / "sneaky"  # a real directory inside the root whose rank-1 file links out of it
    sneaky.mkdir()
    for name in ("gdsload.json", "config.json", "model-rank-0-part-0.safetensors"):
        shutil.copy(a / name, sneaky / name)
    (sneaky / "model-rank-1-part-0.safetensors").symlink_to(outside / "model-rank-1-part-0.safetensors")
    corrupt = root / "corrupt"  # rank 1's file cut in half
    shutil.copytree(a, corrupt)
    victim = corrupt / "model-rank-1-part-0.safetensors"
    os.truncate(victim, victim.stat().st_size // 2)
    tampered = root / "tampered"  # rank 1's last data byte flipped: the header still parses, the digest differs
    shutil.copytree(a, tampered)
    victim = tampered / "model-rank-1-part-0.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    return Models(root, a, b, root / "empty", outside, root / "escape", sneaky, corrupt, tampered)


@pytest.fixture(scope="module")
def server(models: Models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Model A, token from a file, allowed root; restart backoff, JSON logs and digest checks from the environment.
    Leases nobody holds last a minute here (the default is seconds): the tests map exports by hand."""
    tmp = tmp_path_factory.mktemp("server")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    srv = Server(
        [str(models.a), "--allow-root", str(models.root), "--token-file", str(token_file)],
        tmp / "serve.log",
        env={
            "GDSLOAD_RESTART_BACKOFF": "0.2",
            "GDSLOAD_LOG_FORMAT": "json",
            "GDSLOAD_STOP_TIMEOUT": "5",
            "GDSLOAD_VERIFY": "1",
            "GDSLOAD_LEASE_GRACE": "60",
        },
    )
    # What an operator sees in the first moments: the process answers while the ranks still load.
    srv.first_health = srv.http.get("/healthz")
    srv.first_health_after = time.monotonic() - srv.started
    srv.first_status = srv.status()
    srv.startup_polls = srv.poll_ready()
    yield srv
    srv.close()


# ---------------------------------------------------------------------------------------------- start-up


def test_answers_while_loading_then_ready(server: Server):
    assert server.first_health.status_code == 200 and server.first_health.json()["status"] == "alive"
    assert server.first_status["state"] in ("loading", "ready")
    codes = [code for code, _ in server.startup_polls]
    assert codes[-1] == 200 and set(codes) <= {200, 503}
    if server.first_status["state"] == "loading":  # the usual case: the API is up before the workers
        assert codes[0] == 503
        assert server.startup_polls[0][1]["ranks"].get("0") in (None, "pending", "loading")
    assert server.startup_polls[-1][1] == {"ready": True, "generation": 1, "ranks": {"0": "ready", "1": "ready"}}


def test_status_reports_every_rank(server: Server, models: Models):
    s = server.status()
    assert s["state"] == "ready" and s["ready"] and s["error"] is None
    assert s["model"]["path"] == str(models.a) and s["model"]["tp_size"] == 2 and s["model"]["source"] == "manifest"
    assert 0 < s["process"]["time_to_ready_s"] <= s["process"]["uptime_s"]
    assert 0 < s["load"]["time_to_ready_s"] <= s["process"]["time_to_ready_s"]
    assert s["config"]["auth"] == "token" and "token" not in s["config"]
    for rank in (0, 1):
        r = s["ranks"][str(rank)]
        stored, logical = oracle_bytes(models.a, rank)
        assert r["state"] == "ready" and r["error"] is None
        assert r["device"] == "cpu" and r["cuda_visible_devices"] == "" and r["backend"] == "cpu"
        assert r["io_mode"] == "cpu"
        assert r["files"] == [f.name for f in rank_files(models.a, rank)]
        assert (r["stored_bytes"], r["logical_bytes"], r["bytes_done"]) == (stored, logical, stored)
        assert set(r["phases"]) == set(PHASES) and all(v >= 0 for v in r["phases"].values())
        assert r["seconds"] == pytest.approx(sum(r["phases"].values())) and r["gbps"] > 0
        assert r["restarts"] == 0 and r["failures"] == 0 and r["leases"] == 0
        # The worker takes the time its load returned: after it was started, before the server heard.
        assert r["started_at"] + r["seconds"] <= r["loaded_at"] <= r["ready_at"]
        assert r["imported_at"] is None and r["cuda_ready_at"] is None  # host-memory ranks make no CUDA context
        assert r["started_at"] <= r["entered_at"] <= r["loaded_at"] - r["seconds"]
    # The default on a host whose workers load with torch: both forked from one helper, which imported torch
    # without initialising CUDA, and said so.
    assert s["config"]["worker_start"] == "auto" and s["worker_start"] == "forkserver"
    fork_server = s["fork_server"]
    assert isinstance(fork_server["modules"]["torch"], float) and fork_server["cuda_initialised"] in (None, False)
    assert fork_server["threads"] >= 1 and fork_server["seconds"] >= fork_server["modules"]["torch"]
    assert s["ranks"]["0"]["pid"] != s["ranks"]["1"]["pid"]  # one worker process per rank
    parents = {worker_parent(s["ranks"][r]["pid"], server.proc.pid).pid for r in ("0", "1")}
    assert len(parents) == 1 and parents != {server.proc.pid}


def test_metrics(server: Server, models: Models):
    r = server.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = metric_values(r.text)
    assert m[("gdsload_ready", ())] == 1.0
    status = server.status()
    for rank in ("0", "1"):
        rs = status["ranks"][rank]
        assert m[("gdsload_rank_ready", (("rank", rank),))] == 1.0
        assert m[("gdsload_rank_state", (("rank", rank), ("state", "ready")))] == 1.0
        assert m[("gdsload_rank_state", (("rank", rank), ("state", "failed")))] == 0.0
        for phase in PHASES:
            assert m[("gdsload_load_phase_seconds", (("phase", phase), ("rank", rank)))] == pytest.approx(
                rs["phases"][phase]
            )
        assert m[("gdsload_load_bytes", (("kind", "logical"), ("rank", rank)))] == rs["logical_bytes"]
        assert m[("gdsload_load_bytes", (("kind", "stored"), ("rank", rank)))] == rs["stored_bytes"]
        assert m[("gdsload_load_throughput_bytes_per_second", (("rank", rank),))] == pytest.approx(rs["gbps"] * 1e9)
    assert m[("gdsload_time_to_ready_seconds", (("scope", "process"),))] == pytest.approx(
        status["process"]["time_to_ready_s"]
    )
    for rank in ("0", "1"):  # nothing failed or restarted yet, and both counters are there at 0 for alerts' rate()
        assert m[("gdsload_worker_restarts_total", (("rank", rank),))] == 0.0
        assert m[("gdsload_load_failures_total", (("rank", rank),))] == 0.0
    assert ("process_cpu_seconds_total", ()) in m
    # Prometheus' naming guide: the unit last, counters end in _total (the exposition adds it to a counter family).
    families = {f.name: f for f in text_string_to_metric_families(r.text) if f.name.startswith("gdsload_")}
    for name, family in families.items():
        assert re.fullmatch(r"gdsload_[a-z_]+?(_bytes_per_second|_seconds|_bytes)?", name), name
        assert not re.search(r"_(bytes|seconds)_(?!per_second$)", name), name
        assert family.type in ("gauge", "counter", "info"), (name, family.type)
    assert families["gdsload_model_generation"].type == "counter"
    assert m[("gdsload_model_generation_total", ())] == status["generation"]
    for rank in ("0", "1"):
        assert m[("gdsload_load_read_bytes", (("rank", rank),))] == status["ranks"][rank]["bytes_done"]


def test_openapi_documents_the_api(server: Server):
    spec = server.http.get("/openapi.json").json()
    paths = spec["paths"]
    assert {
        "/healthz",
        "/readyz",
        "/v1/status",
        "/metrics",
        "/v1/reload",
        "/v1/unload",
        "/v1/ipc/{rank}",
        "/v1/ipc/{rank}/release",
    } <= set(paths)
    page = server.http.get("/docs")
    assert page.status_code == 200
    # What the document says each answer is, each answer is.
    for path in ("/healthz", "/readyz", "/v1/status", "/metrics"):
        r = server.http.get(path, headers=auth())
        declared = paths[path]["get"]["responses"][str(r.status_code)]["content"]
        assert r.headers["content-type"].split(";")[0] in declared, (path, r.headers["content-type"], declared)
    r = server.http.get("/v1/ipc/0", headers={"Authorization": "Bearer wrong"})
    error = paths["/v1/ipc/{rank}"]["get"]["responses"]["401"]["content"]["application/json"]["schema"]
    assert r.status_code == 401 and error == {"$ref": "#/components/schemas/Error"} and set(r.json()) == {"error"}
    assert "HTTPValidationError" not in json.dumps(spec)  # 422s are in the API's error shape too
    # /redoc is neither served nor named anywhere.
    assert server.http.get("/redoc").status_code == 404 and "redoc" not in json.dumps(spec) + page.text


# ---------------------------------------------------------------------------------------------- refusals


PROTECTED = [
    ("POST", "/v1/reload", {"model_dir": "/nonexistent"}),
    ("POST", "/v1/unload", None),
    ("GET", "/v1/ipc/0", None),
    ("POST", "/v1/ipc/0/release", {"lease": "0" * 32}),
]


@pytest.mark.parametrize("method, path, body", PROTECTED)
def test_token_required(server: Server, method: str, path: str, body: dict[str, Any] | None):
    for headers in ({}, auth("wrong-token"), {"Authorization": f"Basic {TOKEN}"}, {"Authorization": TOKEN}):
        r = server.http.request(method, path, json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["type"] == "UnauthorizedError"
    assert server.http.get("/readyz").status_code == 200  # nothing happened


def test_model_paths_confined_to_allowed_roots(server: Server, models: Models):
    cases = {
        "/etc": "outside the allowed roots",
        str(models.root / ".." / models.outside.parent.name / "model"): "outside the allowed roots",
        str(models.escape): "resolves (through a symlink or '..') to a path outside the allowed roots",
        str(models.sneaky): "model-rank-1-part-0.safetensors",
    }
    for path, words in cases.items():
        r = server.http.post("/v1/reload", json={"model_dir": path}, headers=auth())
        assert r.status_code == 403, (path, r.text)
        err = r.json()["error"]
        assert err["type"] == "PathNotAllowedError" and words in err["message"], err
        assert str(models.outside) not in err["message"]  # where a link leads is not told
    s = server.status()
    assert s["ready"] and s["generation"] == 1 and s["model"]["path"] == str(models.a)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"model_dir": "relative/model"},
        {"model_dir": "/models/a\u0000b"},
        {"model_dir": "/m", "surprise": 1},
        {"model_dir": "/m", "ranks": ["0"]},
        {"model_dir": "/m", "ranks": [-1]},
        {"model_dir": "/m", "ranks": []},
        {"model_dir": "/m", "wait_s": -1},
        {"model_dir": "/m", "wait_s": 601},
        {"model_dir": "/m", "force": "yes"},
        {"model_dir": 7},
        ["/m"],
    ],
)
def test_invalid_bodies_are_422(server: Server, body: Any):
    r = server.http.post("/v1/reload", json=body, headers=auth())
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "InvalidRequest" and r.json()["error"]["message"].startswith("body")


def test_other_malformed_requests(server: Server):
    r = server.http.post("/v1/reload", content=b"{not json", headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "MalformedJson"
    r = server.http.post(
        "/v1/reload", content=b"x" * (65 << 10), headers={**auth(), "Content-Type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLarge"
    for r in (
        server.http.post("/v1/unload", json={"wait_s": "soon"}, headers=auth()),
        server.http.post("/v1/ipc/0/release", json={"lease": "not-a-lease"}, headers=auth()),
        server.http.get("/v1/ipc/zero", headers=auth()),
    ):
        assert r.status_code == 422 and r.json()["error"]["type"] == "InvalidRequest", r.text
    r = server.http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFound"
    r = server.http.head("/readyz")
    assert r.status_code == 200 and r.content == b""
    r = server.http.get("/v1/ipc/7", headers=auth())
    assert r.status_code == 404 and r.json()["error"]["type"] == "UnknownRankError"


def test_bad_reload_target_keeps_the_current_model(server: Server, models: Models):
    r = server.http.post("/v1/reload", json={"model_dir": str(models.empty)}, headers=auth())
    assert r.status_code == 404 and r.json()["error"]["type"] == "NoFilesForRankError"
    assert str(models.empty) in r.json()["error"]["message"]
    r = server.http.post("/v1/reload", json={"model_dir": str(models.b), "ranks": [0, 5]}, headers=auth())
    assert r.status_code == 404 and "No files for rank 5" in r.json()["error"]["message"]
    # The served files' headers are read before anything stops: a file cut short is refused up front.
    r = server.http.post("/v1/reload", json={"model_dir": str(models.corrupt)}, headers=auth())
    # (the manifest records every file's size: a file cut short is named from it)
    assert r.status_code == 400 and r.json()["error"]["type"] in (
        "ManifestError",
        "TruncatedFileError",
        "HeaderError",
    ), r.text
    assert "model-rank-1-part-0.safetensors" in r.json()["error"]["message"]
    s = server.status()
    assert s["ready"] and s["generation"] == 1 and s["model"]["path"] == str(models.a)


# ---------------------------------------------------------------------------------------------- IPC hand-off


def test_ipc_export_maps_in_another_process(server: Server, models: Models):
    r = server.http.get("/v1/ipc/1", headers=auth())
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["kind"] == "cpu" and doc["rank"] == 1 and re.fullmatch(r"[0-9a-f]{32}", doc["lease"])
    assert {t["name"] for t in doc["tensors"]} == set(oracle_digests(models.a, 1))
    engine = map_in_engine(doc)
    assert engine["device"] == "cpu"
    assert engine["tensors"] == oracle_digests(models.a, 1)  # the engine sees the files' bytes, bit for bit
    assert server.status()["ranks"]["1"]["leases"] == 1

    # The memory stays valid until released: unload and reload are refused meanwhile, clearly.
    for path, body in (("/v1/unload", None), ("/v1/reload", {"model_dir": str(models.b)})):
        r = server.http.post(path, json=body, headers=auth())
        assert r.status_code == 409, r.text
        assert r.json()["error"]["type"] == "ExportsOutstandingError" and doc["lease"] in r.json()["error"]["message"]
    r = server.http.post("/v1/unload", json={"wait_s": 0.3}, headers=auth())
    assert r.status_code == 409

    r = server.http.post("/v1/ipc/1/release", json={"lease": "f" * 32}, headers=auth())
    assert r.status_code == 404 and r.json()["error"]["type"] == "UnknownLeaseError"
    r = server.http.post("/v1/ipc/1/release", json={"lease": doc["lease"]}, headers=auth())
    assert r.status_code == 200 and r.json() == {"released": [doc["lease"]], "rank": 1, "outstanding": 0}
    assert server.http.post("/v1/ipc/1/release", json={"lease": doc["lease"]}, headers=auth()).status_code == 404

    # An engine that does not keep lease ids releases everything it took from a rank with an empty body.
    leases = [server.http.get("/v1/ipc/0", headers=auth()).json()["lease"] for _ in range(2)]
    r = server.http.post("/v1/ipc/0/release", json={}, headers=auth())
    assert r.status_code == 200 and sorted(r.json()["released"]) == sorted(leases)
    assert server.status()["leases"] == 0


# ---------------------------------------------------------------------------------------------- failures


def test_killed_worker_is_restarted_and_other_ranks_keep_their_tensors(server: Server):
    before = server.status()["ranks"]
    victim = before["1"]["pid"]
    os.kill(victim, signal.SIGKILL)
    seen: list[tuple[int, dict[str, Any]]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # 503 while rank 1 is down, then 200 again
        r = server.http.get("/readyz")
        seen.append((r.status_code, r.json()))
        if r.status_code == 200 and any(code == 503 for code, _ in seen):
            break
        time.sleep(0.02)
    codes = [code for code, _ in seen]
    assert 503 in codes and codes[-1] == 200, codes
    assert {doc["ranks"]["1"] for code, doc in seen if code == 503} <= {"failed", "pending", "loading"}
    assert all(doc["ranks"]["0"] == "ready" for _, doc in seen)

    after = server.status()["ranks"]
    assert after["1"]["pid"] != victim and not psutil.pid_exists(victim)
    assert after["1"]["restarts"] == 1 and after["1"]["failures"] == 1 and after["1"]["error"] is None
    crash = after["1"]["last_error"]
    assert (
        crash["type"] == "WorkerCrashedError" and "SIGKILL" in crash["message"] and "restarting in" in crash["message"]
    )
    assert (after["0"]["pid"], after["0"]["ready_at"], after["0"]["restarts"]) == (
        before["0"]["pid"],
        before["0"]["ready_at"],
        0,
    )  # rank 0 was never touched
    m = metric_values(server.http.get("/metrics").text)
    assert m[("gdsload_worker_restarts_total", (("rank", "1"),))] == 1.0
    assert m[("gdsload_load_failures_total", (("rank", "1"),))] == 1.0


# ---------------------------------------------------------------------------------------------- unload, reload, stop


def test_unload_frees_the_workers(server: Server, models: Models):
    pids = [r["pid"] for r in server.status()["ranks"].values()]
    r = server.http.post("/v1/unload", headers=auth())
    assert r.status_code == 200 and r.json()["unloaded"] == str(models.a)
    # unload answers once the workers are asked to stop; they free their memory and exit right after
    deadline = time.monotonic() + 15
    while (
        any(psutil.pid_exists(p) for p in pids) or server.status()["stopping_workers"]
    ) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(psutil.pid_exists(p) for p in pids) and server.status()["stopping_workers"] == 0
    r = server.http.get("/readyz")
    assert r.status_code == 503 and r.json()["ranks"] == {} and r.json()["reason"] == "no model loaded; POST /v1/reload"
    s = server.status()
    assert s["state"] == "unloaded" and s["ranks"] == {} and s["model"] is None
    assert server.http.get("/healthz").status_code == 200


def test_corrupt_rank_fails_typed_and_is_not_restarted(server: Server, models: Models):
    # The headers are fine, so the reload is taken; the worker's digest check (GDSLOAD_VERIFY=1) finds the damage.
    r = server.http.post("/v1/reload", json={"model_dir": str(models.tampered), "ranks": [1]}, headers=auth())
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 60
    while server.status()["ranks"]["1"]["state"] != "failed" and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # a restart would show by now
    s = server.status()
    r1 = s["ranks"]["1"]
    assert r1["state"] == "failed" and s["state"] == "failed"
    assert r1["error"]["type"] == "IntegrityError", r1["error"]
    # The server's log says it at ERROR, in one line with the rank, the type and the error's own fix.
    errors = [
        json.loads(line)
        for line in server.log().splitlines()
        if line.startswith("{") and '"level": "error"' in line and "rank 1 failed to load" in line
    ]
    assert len(errors) == 1 and errors[0]["message"].startswith(
        f"rank 1 failed to load: IntegrityError: {r1['error']['message']}"
    ), errors
    assert "model-rank-1-part-0.safetensors" in r1["error"]["message"]
    assert r1["restarts"] == 1 and r1["failures"] == 2 and r1["pid"] is None  # counts from the earlier kill
    r = server.http.get("/readyz")
    assert r.status_code == 503 and r.json()["ranks"] == {"1": "failed"}
    assert r.json()["reason"] == f"rank(s) 1 failed ({r1['error']['type']}); see /v1/status"
    m = metric_values(server.http.get("/metrics").text)
    assert m[("gdsload_ready", ())] == 0.0 and m[("gdsload_load_failures_total", (("rank", "1"),))] == 2.0
    assert m[("gdsload_rank_state", (("rank", "1"), ("state", "failed")))] == 1.0


def test_reload_to_a_second_model(server: Server, models: Models):
    r = server.http.post("/v1/reload", json={"model_dir": str(models.b)}, headers=auth())
    assert r.status_code == 202, r.text
    assert r.json()["model"] == str(models.b) and r.json()["ranks"] == [0, 1]
    generation = r.json()["generation"]
    polls = server.poll_ready()
    assert polls[-1][1]["generation"] == generation
    s = server.status()
    assert s["model"]["path"] == str(models.b) and s["load"]["time_to_ready_s"] > 0
    for rank in (0, 1):
        stored, logical = oracle_bytes(models.b, rank)
        assert (s["ranks"][str(rank)]["stored_bytes"], s["ranks"][str(rank)]["logical_bytes"]) == (stored, logical)
    assert (s["ranks"]["0"]["restarts"], s["ranks"]["1"]["restarts"]) == (0, 1)  # per rank, across models
    doc = server.http.get("/v1/ipc/0", headers=auth()).json()
    assert {t["name"] for t in doc["tensors"]} == set(oracle_digests(models.b, 0))
    server.http.post("/v1/ipc/0/release", json={"lease": doc["lease"]}, headers=auth())


def test_sigterm_stops_workers_and_exits_cleanly(server: Server):
    pids = [r["pid"] for r in server.status()["ranks"].values()]
    assert pids and all(psutil.pid_exists(p) for p in pids)
    helper = worker_parent(pids[0], server.proc.pid)
    assert server.terminate() == 0
    assert not any(psutil.pid_exists(p) for p in pids)
    helper.wait(10)  # the worker fork server leaves with the server
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    assert lines and all(
        {"ts", "level", "logger", "message", "pid"} <= set(x) for x in lines
    )  # GDSLOAD_LOG_FORMAT=json
    messages = [x["message"] for x in lines]
    assert "all workers stopped" in messages and messages[-1] == "stopped"
    assert any(x.get("rank") == 1 and "unloaded; freed" in x["message"] for x in lines)  # workers log, tagged


# ---------------------------------------------------------------------------------------------- bad models


def _serve_once(args: list[str], log_path: Path, timeout: float = 60) -> tuple[int, str]:
    """``gdsload serve ARGS`` to its end: exit status and everything it wrote."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")}
    with open(log_path, "wb") as log:
        p = subprocess.run(
            [sys.executable, "-m", "gdsload.server.cmd_serve", *args, "--port", "0"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**clean, "PYTHONUNBUFFERED": "1"},
            timeout=timeout,
        )
    return p.returncode, log_path.read_text()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One unsharded checkpoint, as Hugging Face publishes one (tp=1, no manifest)."""
    import torch
    from safetensors.torch import save_file as st_save

    root = tmp_path_factory.mktemp("hf")
    st_save({"w": torch.ones(4, 4)}, str(root / "model.safetensors"))
    return root


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing", ["ModelNotFoundError", "does not exist", "give the directory"]),
        ("empty", ["NoFilesForRankError", "no .safetensors files", "gdsload shard"]),
        ("a file", ["ModelNotFoundError", "is not a directory or a .safetensors file"]),
        ("--tp 4", ["TensorParallelMismatchError", "--tp 4", "holds ranks 0-1", "tp=2", "serve it with --tp 2"]),
        ("--tp 1", ["TensorParallelMismatchError", "serve it with --tp 2", "use --ranks"]),
        ("--ranks 5", ["NoFilesForRankError", "--ranks 5", "No files for rank 5", "holds ranks 0-1"]),
        ("hf --tp 2", ["TensorParallelMismatchError", "one unsharded checkpoint", "gdsload shard", "--tp 2"]),
        ("--device-map 0:3,1:3", ["ConfigError", "puts rank 0 on GPU 3", "fix the map"]),
    ],
)
def test_serve_refuses_a_bad_target_before_it_starts(
    models: Models, hf_model: Path, tmp_path: Path, case: str, words: list[str]
):
    """A target that cannot be served ends ``serve`` at once: status 2, one ERROR line naming the fix, no port
    bound, no worker started."""
    args = {
        "missing": [str(tmp_path / "no-such-model"), "--tp", "2"],
        "empty": [str(models.empty)],
        "a file": [str(models.a / "gdsload.json")],
        "--tp 4": [str(models.a), "--tp", "4"],
        "--tp 1": [str(models.a), "--tp", "1"],
        "--ranks 5": [str(models.a), "--ranks", "5"],
        "hf --tp 2": [str(hf_model), "--tp", "2"],
        "--device-map 0:3,1:3": [str(models.a), "--device-map", "0:3,1:3"],
    }[case]
    code, out = _serve_once(args, tmp_path / "serve.log")
    lines = out.splitlines()
    assert code == 2 and len(lines) == 1, out
    assert " ERROR " in lines[0] and "cannot serve" in lines[0], lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "listening on" not in out and "started worker" not in out


def test_a_bad_target_in_json_logs_is_one_json_error(tmp_path: Path):
    code, out = _serve_once([str(tmp_path / "nothing"), "--log-format", "json"], tmp_path / "serve.log")
    (line,) = out.splitlines()
    doc = json.loads(line)
    assert code == 2 and doc["level"] == "error" and "does not exist" in doc["message"], doc


def test_started_without_a_model_says_how_to_configure_a_token(tmp_path: Path):
    srv = Server([], tmp_path / "serve.log")
    try:
        assert srv.http.get("/healthz").status_code == 200
        r = srv.http.get("/readyz")
        assert r.status_code == 503 and r.json()["reason"] == "no model loaded; POST /v1/reload"
        # Without a token, mutating and hand-off endpoints say how to configure one.
        for method, path, body in PROTECTED:
            r = srv.http.request(method, path, json=body, headers=auth())
            assert r.status_code == 403 and r.json()["error"]["type"] == "TokenNotConfiguredError"
            assert "GDSLOAD_TOKEN" in r.json()["error"]["message"]
        assert srv.terminate() == 0
    finally:
        srv.close()


@pytest.mark.parametrize("when", ["loading", "ready"])
@pytest.mark.parametrize("worker_start", ["forkserver", "spawn"])
def test_a_sigterm_to_the_process_group_is_a_clean_stop(models: Models, tmp_path: Path, when: str, worker_start: str):
    """What Kubernetes and systemd send: SIGTERM to every process of the group at once (server, fork server,
    workers). The server stops its workers in order: exit status 0, no ERROR, no restart, nothing left running."""
    srv = Server(
        [str(models.a), "--device-map", "cpu", "--worker-start", worker_start], tmp_path / "serve.log", new_group=True
    )
    try:
        if when == "ready":
            srv.poll_ready()
        else:  # while the workers start and load
            deadline = time.monotonic() + 60
            while "started worker" not in srv.log() and time.monotonic() < deadline:
                time.sleep(0.01)
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        os.killpg(srv.proc.pid, signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log()
        log = srv.log()
        bad = [line for line in log.splitlines() if " ERROR " in line or "restarting" in line or "Traceback" in line]
        assert not bad, log
        assert log.rstrip().endswith("stopped"), log[-2000:]
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        srv.close()


def test_eight_ranks_load_in_eight_processes(tmp_path: Path):
    """The tp=8 path end to end on the CPU (the 8-GPU machine is not lent): eight workers, one per
    rank, each with its own rank's bytes, /readyz 200 only when all eight are ready."""
    model = make_checkpoint(
        tmp_path / "tp8", LlamaShape(hidden=256, intermediate=512, heads=8, kv_heads=8, vocab=4096, layers=2), tp=8
    )
    srv = Server([str(model), "--tp", "8", "--device-map", "cpu"], tmp_path / "serve.log", token=TOKEN)
    try:
        polls = srv.poll_ready(timeout=180)
        assert all(code == 503 for code, _ in polls[:-1]) and polls[-1][0] == 200
        s = srv.status()
        assert s["model"]["tp_size"] == 8 and sorted(s["ranks"], key=int) == [str(r) for r in range(8)]
        pids = set()
        for rank in range(8):
            r = s["ranks"][str(rank)]
            stored, logical = oracle_bytes(model, rank)
            assert r["state"] == "ready" and r["files"] == [f.name for f in rank_files(model, rank)]
            assert (r["stored_bytes"], r["logical_bytes"]) == (stored, logical) and r["seconds"] > 0
            worker_parent(r["pid"], srv.proc.pid)
            pids.add(r["pid"])
        assert len(pids) == 8
        assert srv.terminate() == 0 and not any(
            psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids
        )
    finally:
        srv.close()


def test_the_bound_port_is_named_at_any_log_level(models: Models, tmp_path: Path):
    srv = Server([str(models.a), "--log-level", "error"], tmp_path / "serve.log")  # finds the URL in the log
    try:
        assert srv.http.get("/healthz").status_code == 200
        assert "INFO" not in srv.log() and srv.terminate() == 0
    finally:
        srv.close()


def test_stuck_workers_are_killed_together_at_the_stop_timeout(tmp_path: Path):
    """Four frozen workers (SIGSTOP: they cannot act on 'unload', SIGTERM waits) are escalated at once:
    shutdown takes the stop timeout plus one grace period, not one grace period per worker."""
    model = make_checkpoint(
        tmp_path / "tp4", LlamaShape(hidden=256, intermediate=512, heads=8, kv_heads=8, vocab=4096, layers=2), tp=4
    )
    srv = Server(
        [str(model), "--tp", "4", "--device-map", "cpu", "--stop-timeout", "1"], tmp_path / "serve.log", token=TOKEN
    )
    try:
        srv.poll_ready(timeout=120)
        pids = [r["pid"] for r in srv.status()["ranks"].values()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        t = time.monotonic()
        assert srv.terminate() == 0
        took = time.monotonic() - t
        assert took < 6.5, took  # one at a time: 1 s + 4 x 2 s
        assert srv.log().count("sending SIGKILL") == 4
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    finally:
        srv.close()


def test_workers_outlive_their_fork_server(models: Models, tmp_path: Path):
    """The fork server reports its children's exits; if it dies, the workers it forked keep their ranks
    (their liveness is watched through pidfds), and the next worker start launches a new fork server."""
    srv = Server(
        [str(models.a), "--tp", "2", "--device-map", "cpu"],
        tmp_path / "serve.log",
        token=TOKEN,
        env={"GDSLOAD_RESTART_BACKOFF": "0.1"},
    )
    try:
        srv.poll_ready(timeout=120)
        before = srv.status()["ranks"]
        helper = worker_parent(before["0"]["pid"], srv.proc.pid)
        helper.kill()  # it stays a zombie of the server until the next worker start looks for it
        deadline = time.monotonic() + 10
        while psutil.pid_exists(helper.pid) and helper.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.5)  # time for the supervisor to (wrongly) notice anything
        after = srv.status()["ranks"]
        assert srv.http.get("/readyz").status_code == 200
        for r in ("0", "1"):
            assert after[r]["pid"] == before[r]["pid"] and psutil.pid_exists(before[r]["pid"])
            assert after[r]["state"] == "ready" and after[r]["restarts"] == 0 and after[r]["failures"] == 0
        os.kill(before["1"]["pid"], signal.SIGKILL)  # now a real crash: noticed, restarted by a new fork server
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r1 = srv.status()["ranks"]["1"]
            if r1["restarts"] == 1 and r1["state"] == "ready":
                break
            time.sleep(0.05)
        # Its fork server is gone, so nobody can say how it ended; that it ended is seen all the same.
        assert r1["restarts"] == 1 and r1["state"] == "ready"
        assert "exit status is unknown (the fork server that started it is gone)" in r1["last_error"]["message"]
        new_helper = worker_parent(r1["pid"], srv.proc.pid)
        assert new_helper.pid not in (helper.pid, srv.proc.pid)
        assert srv.status()["ranks"]["0"]["pid"] == before["0"]["pid"]
        assert srv.terminate() == 0
        # The orphaned worker of the dead fork server stopped with the server too.
        assert not psutil.pid_exists(before["0"]["pid"]) or psutil.Process(before["0"]["pid"]).status() == "zombie"
    finally:
        srv.close()


def test_spawned_workers_load_the_same(models: Models, tmp_path: Path):
    """``--worker-start spawn``: a fresh interpreter per worker, started by the server itself."""
    srv = Server(
        [str(models.a), "--tp", "2", "--device-map", "cpu", "--worker-start", "spawn"],
        tmp_path / "serve.log",
        token=TOKEN,
    )
    try:
        srv.poll_ready(timeout=120)
        s = srv.status()
        assert s["config"]["worker_start"] == s["worker_start"] == "spawn" and s["fork_server"] is None
        for rank in (0, 1):
            r = s["ranks"][str(rank)]
            assert r["state"] == "ready" and (r["stored_bytes"], r["logical_bytes"]) == oracle_bytes(models.a, rank)
            assert r["started_at"] < r["entered_at"] <= r["loaded_at"] - r["seconds"]
            assert worker_parent(r["pid"], srv.proc.pid).pid == srv.proc.pid
        assert srv.terminate() == 0
    finally:
        srv.close()


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_worker_sees_one_gpu_and_exports_cuda_ipc(models: Models, tmp_path: Path):
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = visible.split(",")[0].strip() if visible else "0"
    srv = Server([str(models.a), "--ranks", "0"], tmp_path / "serve.log", env={"GDSLOAD_TOKEN": TOKEN})
    try:
        srv.poll_ready(timeout=120)
        r0 = srv.status()["ranks"]["0"]
        assert r0["device"] == "cuda:0" and r0["cuda_visible_devices"] == first
        assert r0["gpu"]["uuid"] == str(torch.cuda.get_device_properties(0).uuid)  # our cuda:0 is its only GPU
        assert r0["io_mode"] in ("gds", "p2pdma", "compat", "posix")
        doc = srv.http.get("/v1/ipc/0", headers=auth()).json()
        # A worker that can load without torch does, and exports its own CUDA IPC handle (a CupyDevice load).
        from gdsload.loader.devices import torch_free_unavailable

        assert doc["kind"] == ("cuda-ipc" if torch_free_unavailable() is None else "cuda")
        engine = map_in_engine(doc)
        assert engine["device"].startswith("cuda") and engine["tensors"] == oracle_digests(models.a, 0)
        srv.http.post("/v1/ipc/0/release", json={"lease": doc["lease"]}, headers=auth())
        pid = r0["pid"]
        assert srv.terminate() == 0
        assert not psutil.pid_exists(pid)
        smi = shutil.which("nvidia-smi")
        if smi:  # the worker's CUDA context is gone with it
            out = subprocess.run(
                [smi, "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            ).stdout
            assert str(pid) not in out.split()
    finally:
        srv.close()


@pytest.mark.gpu
@pytest.mark.multi_gpu(2)
@pytest.mark.parametrize("worker_start", ["auto", "forkserver"])
def test_tp2_one_gpu_per_worker_and_ipc_per_rank(models: Models, tmp_path: Path, worker_start: str):
    """--tp 2: each worker holds a context on its own GPU only; an engine per GPU maps its rank."""
    import torch
    from gdsload.bench.multi_gpu import gpu_processes
    from gdsload.loader.devices import torch_free_unavailable
    from gdsload.server.workers import visible_gpus

    visible = visible_gpus()
    # auto spawns torch-free GPU workers (their imports hide the CUDA context) and forks torch ones.
    resolved = worker_start if worker_start != "auto" else "spawn" if torch_free_unavailable() is None else "forkserver"
    srv = Server(
        [str(models.a), "--tp", "2", "--worker-start", worker_start],
        tmp_path / "serve.log",
        env={"GDSLOAD_TOKEN": TOKEN},
    )
    try:
        srv.poll_ready(timeout=180)
        ranks = srv.status()["ranks"]
        assert [ranks[r]["cuda_visible_devices"] for r in ("0", "1")] == visible[:2]
        for r in (0, 1):
            x = ranks[str(r)]
            assert x["device"] == "cuda:0"  # the worker's only GPU
            assert x["gpu"]["uuid"] == str(torch.cuda.get_device_properties(r).uuid)
            # Start-up marks taken in the worker, in order.
            assert x["started_at"] <= x["entered_at"] <= x["imported_at"] <= x["cuda_ready_at"] <= x["loaded_at"]
            assert x["loaded_at"] <= x["ready_at"]
        assert srv.status()["worker_start"] == resolved
        parent = worker_parent(ranks["0"]["pid"], srv.proc.pid)
        assert (parent.pid == srv.proc.pid) == (resolved == "spawn")
        smi = gpu_processes()
        if smi:  # nvidia-smi lists processes here: each worker is on its own GPU and no other
            for r in (0, 1):
                assert sorted(smi.get(ranks[str(r)]["pid"], {})) == [ranks[str(r)]["gpu"]["uuid"]], smi
            assert parent.pid not in smi and srv.proc.pid not in smi  # neither the server nor the fork server
        for r in (0, 1):
            doc = srv.http.get(f"/v1/ipc/{r}", headers=auth()).json()
            engine = map_in_engine(doc, env={"CUDA_VISIBLE_DEVICES": visible[r]})
            assert engine["device"] == "cuda:0" and engine["tensors"] == oracle_digests(models.a, r)
            srv.http.post(f"/v1/ipc/{r}/release", json={"lease": doc["lease"]}, headers=auth())
        assert srv.terminate() == 0
    finally:
        srv.close()
