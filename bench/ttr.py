"""Sidecar time-to-ready: start ``gdsload serve``, poll ``/readyz`` the way an autoscaler does.

The clock starts just before the server process is created and stops at the first ``/readyz``
200 (polled every 10 ms). Also recorded, from ``/v1/status``: each rank's load seconds and
phases, and where a worker's time went before its load began (interpreter, imports, CUDA):

    python -m gdsload.bench.ttr /dev/shm/model --repeat 3 -- --backend auto

Arguments after ``--`` go to ``gdsload serve``. One JSON line per run.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from . import stop_on_sigterm

__all__ = ["time_to_ready"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, timeout: float = 2.0, token: str | None = None) -> tuple[int, bytes]:
    return _request(port, "GET", path, timeout=timeout, token=token)


def _request(
    port: int,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    token: str | None = None,
    timeout: float = 2.0,
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _reload_to_ready(
    port: int, model_dir: str, token: str, generation: int, timeout: float, poll_s: float
) -> tuple[float, dict[str, Any]]:
    """``POST /v1/reload`` of ``model_dir``; seconds until the next generation is ready, and its status."""
    t0 = time.perf_counter()
    # The server stops the old workers before it answers (up to its stop timeout).
    code, body = _request(port, "POST", "/v1/reload", {"model_dir": model_dir}, token=token, timeout=timeout)
    if code != 202:
        raise RuntimeError(f"reload answered {code}: {body[:500]!r}")
    while time.perf_counter() - t0 < timeout:
        code, body = _get(port, "/v1/status", token=token)
        status = json.loads(body)
        if status["generation"] > generation and status["state"] in ("ready", "failed"):
            if status["state"] == "failed":
                raise RuntimeError(f"reload failed: {status.get('error') or status['ranks']}")
            return time.perf_counter() - t0, status
        time.sleep(poll_s)
    raise RuntimeError(f"reload not ready after {timeout:.0f} s")


def time_to_ready(
    model_dir: str,
    serve_args: list[str] | tuple[str, ...] = (),
    *,
    timeout: float = 300.0,
    poll_s: float = 0.01,
    while_ready: Callable[[dict[str, Any]], Any] | None = None,
    reload: bool = False,
) -> dict[str, Any]:
    """Start a server on ``model_dir``; seconds until ``/readyz`` says 200, and what it reported.

    ``while_ready(status)``, if given, runs once the server is ready and before it is stopped (the
    workers still hold their tensors); what it returns is kept under ``"while_ready"``. ``reload``:
    then ``POST /v1/reload`` the same directory and time it too (under ``"reload"``: new workers, same files;
    the server gets a token of its own and ``--allow-root``, so ``serve_args`` must not name a token file).
    """
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "gdsload.server.cli",
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--log-level",
        "warning",
        *serve_args,
    ]
    env = dict(os.environ)
    token = secrets.token_hex(16)  # /v1/status shows pids, paths and devices to the token only
    env["GDSLOAD_TOKEN"] = token
    if reload:
        cmd += ["--allow-root", os.path.dirname(os.path.realpath(model_dir))]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    first_answer = None
    try:
        while True:
            elapsed = time.perf_counter() - t0
            if proc.poll() is not None:
                return {"error": f"server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}"}
            if elapsed > timeout:
                return {"error": f"not ready after {timeout:.0f} s"}
            try:
                code, body = _get(port, "/readyz", timeout=1.0)
            except OSError:
                code = None  # not listening yet
            if code is not None and first_answer is None:
                first_answer = elapsed
            ranks = json.loads(body).get("ranks", {}) if code == 503 else None
            if ranks is not None and ("failed" in ranks.values() or not ranks):
                _, body = _get(port, "/v1/status", token=token)  # no rank yet: the server may have failed before any
                doc = json.loads(body)
                errors = {r: d.get("error") for r, d in doc.get("ranks", {}).items() if d.get("error")}
                if errors:
                    return {"error": f"a rank failed while loading: {errors}"}
                if doc.get("state") == "failed":
                    return {"error": f"the server failed before loading: {doc.get('error')}"}
            if code == 200:
                ttr = time.perf_counter() - t0
                break
            time.sleep(poll_s)
        _, body = _get(port, "/v1/status", token=token)
        status = json.loads(body)
        seen = while_ready(status) if while_ready is not None else None
        reloaded = None
        if reload:
            try:
                seconds, after = _reload_to_ready(
                    port, os.path.realpath(model_dir), token, status["generation"], timeout, poll_s
                )
                reloaded = {
                    "reload_to_ready_s": seconds,
                    "server_reported_s": after["load"]["time_to_ready_s"],
                    **_summary(after, after["load"]["started_at"]),
                }
            except (RuntimeError, OSError) as e:
                reloaded = {"error": str(e)}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out = {
        "time_to_ready_s": ttr,
        "first_http_answer_s": first_answer,
        "server_reported_ttr_s": status["process"]["time_to_ready_s"],
        **_summary(status, status["process"]["started_at"]),
    }
    if while_ready is not None:
        out["while_ready"] = seen
    if reload:
        out["reload"] = reloaded
    return out


def _summary(status: dict[str, Any], started: float) -> dict[str, Any]:
    """Per-rank loads and start-up marks of one generation; ``started``: when the server started it."""
    ranks = status.get("ranks", {})
    loads = {r: d.get("seconds") for r, d in ranks.items()}
    logical = sum(d.get("logical_bytes") or 0 for d in ranks.values())
    # The ranks load side by side: their bytes over the window from the first load's start to the last one's end,
    # with the end taken in the worker where it reports it (the server may read a worker's message a little later).
    windows = [
        ((d.get("loaded_at") or d["ready_at"]) - d["seconds"], d.get("loaded_at") or d["ready_at"])
        for d in ranks.values()
        if d.get("ready_at") and d.get("seconds")
    ]
    window = max(e for _, e in windows) - min(s for s, _ in windows) if windows else None
    # Workers start loading when their own start-up is done, so loads may not overlap: the seconds all
    # ranks were loading at once (0 when one finished before another started).
    overlap = max(0.0, min(e for _, e in windows) - max(s for s, _ in windows)) if windows else None
    return {
        "load_seconds": loads,
        "load_seconds_max": max((s for s in loads.values() if s is not None), default=None),
        "logical_bytes": logical,
        "backends": sorted({d.get("backend") for d in ranks.values() if d.get("backend")}),
        "io_modes": sorted({d.get("io_mode") for d in ranks.values() if d.get("io_mode")}),
        # Server start -> worker asked for; then asked for -> the worker's load done (taken in the worker, or
        # when the server read "ready"), less the load itself: interpreter, imports, CUDA context.
        "spawned_after_s": {r: round(d["started_at"] - started, 3) for r, d in ranks.items() if d.get("started_at")},
        "worker_overhead_s": {
            r: round((d.get("loaded_at") or d["ready_at"]) - d["started_at"] - d["seconds"], 3)
            for r, d in ranks.items()
            if d.get("ready_at") and d.get("started_at") and d.get("seconds")
        },
        # Worker asked for -> its entry point ran (forked, or its interpreter up) -> its GPU library imported ->
        # its CUDA context usable (times taken in the worker).
        "entered_after_s": {
            r: round(d["entered_at"] - d["started_at"], 3)
            for r, d in ranks.items()
            if d.get("entered_at") and d.get("started_at")
        },
        "imported_after_s": {
            r: round(d["imported_at"] - d["started_at"], 3)
            for r, d in ranks.items()
            if d.get("imported_at") and d.get("started_at")
        },
        "cuda_ready_after_s": {
            r: round(d["cuda_ready_at"] - d["started_at"], 3)
            for r, d in ranks.items()
            if d.get("cuda_ready_at") and d.get("started_at")
        },
        # Worker's load done -> the server heard of it.
        "ready_message_lag_s": {
            r: round(d["ready_at"] - d["loaded_at"], 4)
            for r, d in ranks.items()
            if d.get("ready_at") and d.get("loaded_at")
        },
        "phases": {r: d.get("phases") for r, d in ranks.items()},
        "pids": {r: d.get("pid") for r, d in ranks.items()},
        "load_window_s": window,
        "loads_overlap_s": overlap,
        "aggregate_gbps": logical / window / 1e9 if window else None,
    }


def main() -> None:
    argv = sys.argv[1:]
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1 :]
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--reload", action="store_true", help="then POST /v1/reload the same model and time that too")
    args = ap.parse_args(argv)
    stop_on_sigterm()
    for i in range(args.repeat):
        r = time_to_ready(args.model_dir, serve_args, timeout=args.timeout, reload=args.reload)
        print(json.dumps({"run": i, **r}, default=str), flush=True)


if __name__ == "__main__":
    main()
