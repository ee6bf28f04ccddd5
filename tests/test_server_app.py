"""The HTTP app in-process (FastAPI's test client), for states the subprocess tests do not reach cheaply."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gdsload.server.app import create_app
from gdsload.server.settings import ServeConfig
from gdsload.server.supervisor import Supervisor


def test_started_without_a_model(tmp_path: Path):
    config = ServeConfig.resolve(env={"GDSLOAD_TOKEN": "tok-123456"})
    with TestClient(create_app(Supervisor(config))) as client:
        assert client.get("/healthz").status_code == 200
        r = client.get("/readyz")
        assert r.status_code == 503
        assert r.json() == {"ready": False, "model": None, "generation": 0, "ranks": {},
                            "reason": "no model loaded; POST /v1/reload"}
        s = client.get("/v1/status").json()
        assert s["state"] == "unloaded" and s["model"] is None and s["process"]["time_to_ready_s"] is None
        samples = {s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text)
                   for s in f.samples}
        assert samples["gdsload_ready"] == 0.0 and "gdsload_time_to_ready_seconds" not in samples
        # A token but no --allow-root: reload accepts no path, and says how to allow one.
        r = client.post("/v1/reload", json={"model_dir": str(tmp_path)}, headers={"Authorization": "Bearer tok-123456"})
        assert r.status_code == 403 and "--allow-root" in r.json()["error"]["message"]
        r = client.post("/v1/unload", headers={"Authorization": "Bearer tok-123456"})
        assert r.status_code == 200 and r.json() == {"unloaded": None, "generation": 1}
        r = client.get("/v1/ipc/0", headers={"Authorization": "Bearer tok-123456"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "UnknownRankError"


def test_chunked_body_over_the_limit_is_413():
    config = ServeConfig.resolve(env={"GDSLOAD_TOKEN": "tok-123456"})
    with TestClient(create_app(Supervisor(config))) as client:
        def chunks():
            for _ in range(80):
                yield b"x" * 1024

        r = client.post("/v1/reload", content=chunks(), headers={"Authorization": "Bearer tok-123456",
                                                                 "Content-Type": "application/json"})
        assert r.status_code == 413
