"""The HTTP app in-process (FastAPI's test client), for states the subprocess tests do not reach cheaply."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gdsload.server.app import create_app
from gdsload.server.settings import ServeConfig
from gdsload.server.supervisor import Supervisor, WorkerError


def test_started_without_a_model(tmp_path: Path):
    config = ServeConfig.resolve(env={"GDSLOAD_TOKEN": "tok-1234567890abcdef"})
    with TestClient(create_app(Supervisor(config)), base_url="http://127.0.0.1") as client:
        assert client.get("/healthz").status_code == 200
        r = client.get("/readyz")
        assert r.status_code == 503
        assert r.json() == {"ready": False, "generation": 0, "ranks": {}, "reason": "no model loaded; POST /v1/reload"}
        s = client.get("/v1/status", headers={"Authorization": "Bearer tok-1234567890abcdef"}).json()
        assert s["state"] == "unloaded" and s["model"] is None and s["process"]["time_to_ready_s"] is None
        samples = {
            s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples
        }
        assert samples["gdsload_ready"] == 0.0 and "gdsload_time_to_ready_seconds" not in samples
        # A token but no --allow-root: reload accepts no path, and says how to allow one.
        r = client.post(
            "/v1/reload", json={"model_dir": str(tmp_path)}, headers={"Authorization": "Bearer tok-1234567890abcdef"}
        )
        assert r.status_code == 403 and "--allow-root" in r.json()["error"]["message"]
        r = client.post("/v1/unload", headers={"Authorization": "Bearer tok-1234567890abcdef"})
        assert r.status_code == 200 and r.json() == {"unloaded": None, "generation": 1}
        r = client.get("/v1/ipc/0", headers={"Authorization": "Bearer tok-1234567890abcdef"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "UnknownRankError"


def test_chunked_body_over_the_limit_is_413():
    config = ServeConfig.resolve(env={"GDSLOAD_TOKEN": "tok-1234567890abcdef"})
    with TestClient(create_app(Supervisor(config)), base_url="http://127.0.0.1") as client:

        def chunks():
            for _ in range(80):
                yield b"x" * 1024

        r = client.post(
            "/v1/reload",
            content=chunks(),
            headers={"Authorization": "Bearer tok-1234567890abcdef", "Content-Type": "application/json"},
        )
        assert r.status_code == 413


AUTH = {"Authorization": "Bearer tok-1234567890abcdef"}


def test_every_error_has_the_error_shape():
    config = ServeConfig.resolve(env={"GDSLOAD_TOKEN": "tok-1234567890abcdef"})
    with TestClient(create_app(Supervisor(config)), base_url="http://127.0.0.1") as client:

        def error(r, code: int, kind: str) -> str:
            assert r.status_code == code, r.text
            assert set(r.json()) == {"error"} and r.json()["error"]["type"] == kind, r.text
            return r.json()["error"]["message"]

        bad_json = {"content": b"{not json", "headers": {"Content-Type": "application/json"}}
        # The token is checked before the body is looked at.
        error(client.post("/v1/reload", **bad_json), 401, "UnauthorizedError")
        assert "not valid JSON" in error(
            client.post("/v1/reload", content=bad_json["content"], headers={**bad_json["headers"], **AUTH}),
            400,
            "MalformedJson",
        )
        assert "body.model_dir: Field required" in error(
            client.post("/v1/reload", json={}, headers=AUTH), 422, "InvalidRequest"
        )
        assert "path.rank" in error(client.get("/v1/ipc/zero", headers=AUTH), 422, "InvalidRequest")
        assert "GET /v2/nothing" in error(client.get("/v2/nothing"), 404, "NotFound")
        error(client.delete("/healthz"), 405, "MethodNotAllowed")
        # Probes answer HEAD as they answer GET, without a body.
        for path, code in (("/healthz", 200), ("/readyz", 503)):
            r = client.head(path)
            assert r.status_code == code and r.content == b""


def test_a_fault_of_the_server_answers_500_in_the_error_shape(monkeypatch):
    supervisor = Supervisor(ServeConfig.resolve(env={}))
    monkeypatch.setattr(supervisor, "status", lambda detail=True: 1 / 0)
    with TestClient(create_app(supervisor), raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
        r = client.get("/v1/status")
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalError"
        assert r.json()["error"]["message"].startswith("ZeroDivisionError: division by zero")


def test_a_dead_supervisor_loop_fails_liveness(tmp_path: Path, monkeypatch):
    """Should the loop that starts and restarts workers die, the process must not look alive forever."""

    def broken(self, path: str) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Supervisor, "_initial_load", broken)
    supervisor = Supervisor(ServeConfig.resolve(model_dir=str(tmp_path), env={}))
    with TestClient(create_app(supervisor), base_url="http://localhost") as client:
        deadline = time.monotonic() + 10
        while supervisor.loop_error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        r = client.get("/healthz")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert r.json()["error"]["type"] == "SupervisorFailed" and "RuntimeError: a bug" in r.json()["error"]["message"]
        assert client.head("/healthz").status_code == 503
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["reason"].startswith("SupervisorFailed; see the log")
        assert client.get("/v1/status").json()["state"] == "failed"


def test_start_returns_at_once_and_the_workers_start_behind_it(sharded_dir: Path, monkeypatch):
    """``start`` waits for no worker (an event loop calls it): the supervisor's thread starts them, even when
    starting one takes long (a fork server still importing torch)."""
    from gdsload.server.target import check_target
    from gdsload.server.workers import WorkerHandle

    spawn = WorkerHandle.spawn

    def slow_spawn(*args, **kwargs):
        time.sleep(1.0)
        return spawn(*args, **kwargs)

    monkeypatch.setattr(WorkerHandle, "spawn", slow_spawn)
    config = ServeConfig.resolve(model_dir=str(sharded_dir), device_map="cpu", env={})
    supervisor = Supervisor(config, check_target(str(sharded_dir), config))
    try:
        assert supervisor.readiness()[0] == 503  # every rank listed, pending, before anything started
        assert b'"ranks":{"0":"pending","1":"pending"}' in supervisor.readiness()[1]
        t = time.monotonic()
        supervisor.start()
        assert time.monotonic() - t < 0.5
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ranks = supervisor.status()["ranks"]
            if all(r["pid"] is not None for r in ranks.values()):
                break
            time.sleep(0.02)
        assert sorted(ranks) == ["0", "1"]
        assert all(r["pid"] is not None and r["started_at"] is not None for r in ranks.values()), ranks
    finally:
        supervisor.stop()


def test_waiting_for_leases_ends_when_the_server_stops(monkeypatch):
    supervisor = Supervisor(ServeConfig.resolve(env={}))
    monkeypatch.setattr(supervisor, "outstanding_leases", lambda: {0: 1})  # an engine that never releases
    supervisor.start()
    outcome: list[BaseException] = []

    def unload() -> None:
        try:
            supervisor.unload(wait_s=60)
        except BaseException as e:
            outcome.append(e)

    waiter = threading.Thread(target=unload)
    waiter.start()
    time.sleep(0.2)
    t = time.monotonic()
    supervisor.stop()
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - t < 5
    assert isinstance(outcome[0], WorkerError) and "shutting down" in str(outcome[0])


def test_the_host_check_is_starlettes_with_ipv6_and_ports_and_the_api_error_shape():
    """Loopback names with and without ports, IPv6 in brackets, case: answered; another name: 400 in the API's
    error shape; the probes answer any Host."""
    config = ServeConfig.resolve(host="::1", env={})
    app = create_app(Supervisor(config))
    for base in ("http://[::1]:8471", "http://localhost", "http://LOCALHOST:8471", "http://127.0.0.1:1"):
        with TestClient(app, base_url=base) as client:
            assert client.get("/v1/status").status_code == 200, base
    with TestClient(app, base_url="http://attacker.example") as client:
        r = client.get("/v1/status")
        assert r.status_code == 400 and r.json()["error"]["type"] == "HostNotAllowed"
        assert "'attacker.example'" in r.json()["error"]["message"] and "[::1]" in r.json()["error"]["message"]
        assert client.get("/readyz").status_code == 503 and client.get("/healthz").status_code == 200
    wide = create_app(Supervisor(ServeConfig.resolve(host="0.0.0.0", env={})))  # any Host when not on loopback
    with TestClient(wide, base_url="http://sidecar.internal:8471") as client:
        assert client.get("/v1/status").status_code == 200
