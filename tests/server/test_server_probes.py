"""The probes from the first millisecond: ``gdsload serve`` in a real process, polled on real loopback HTTP
the way a kubelet polls it (a new connection per probe, a short timeout), from the moment it is spawned.

The bounds are generous (a busy two-core host) and about responsiveness, not speed: the first answers
come while the workers are still starting, and no probe waits for a worker.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from gdsload.loader.prepare.synthetic import make_checkpoint

FIRST_ANSWER_S = 2.0
"""Latest first answer (of either probe) after the process is spawned."""
SLOWEST_PROBE_S = 1.5
"""Longest any single probe may take once the server answers (a kubelet's default timeout is 1 s; the margin is
for a busy two-core host)."""
P99_S = 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe(port: int, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2 * SLOWEST_PROBE_S)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_probes_answer_from_the_start_and_never_wait_for_a_worker(tmp_path: Path):
    model = make_checkpoint(tmp_path / "m", "tiny", tp=2)
    port = _free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")}
    with open(tmp_path / "serve.log", "wb") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gdsload.server.cmd_serve",
                str(model),
                "--port",
                str(port),
                "--device-map",
                "cpu",
                "--log-format",
                "json",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean,
        )
    first_wall: float | None = None
    answers: list[tuple[float, str, int, float, dict]] = []  # (since spawn, path, status, seconds, body)
    refused = 0
    try:
        while time.monotonic() - t0 < 120:
            for path in ("/healthz", "/readyz"):
                t = time.monotonic()
                try:
                    code, body = _probe(port, path)
                except ConnectionRefusedError:  # not bound yet
                    refused += 1
                    time.sleep(0.002)
                    continue
                except (TimeoutError, socket.timeout):
                    raise AssertionError(
                        f"{path} did not answer within {2 * SLOWEST_PROBE_S} s, "
                        f"{t - t0:.2f} s after the start; answers so far: {answers[-4:]}"
                    ) from None
                answers.append((t - t0, path, code, time.monotonic() - t, body))
                first_wall = first_wall or time.time()
            if answers and answers[-1][1] == "/readyz" and answers[-1][2] == 200:
                break
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        assert answers and answers[-1][2] == 200, answers[-4:]
        first_at = answers[0][0] + answers[0][3]
        latencies = sorted(a[3] for a in answers)
        p99 = latencies[int(0.99 * (len(latencies) - 1))]
        print(
            f"probes: first answer {first_at * 1000:.0f} ms after spawn ({refused} refused before the bind); "
            f"{len(answers)} answers until ready at {answers[-1][0]:.2f} s; p50 "
            f"{latencies[len(latencies) // 2] * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
        )
        assert first_at < FIRST_ANSWER_S, answers[:2]
        # Answered before any worker started (workers start behind the probes, not ahead of them).
        started = [
            json.loads(line)
            for line in (tmp_path / "serve.log").read_text().splitlines()
            if line.startswith("{") and "started worker" in line
        ]
        first_start = min(
            datetime.strptime(x["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
            for x in started
        )
        assert first_wall is not None and first_wall < first_start, (first_wall, first_start)
        # The first answers come while the workers start: alive, and not ready with every rank listed.
        first = {path: (code, body) for _, path, code, _, body in reversed(answers[:2])}
        assert first["/healthz"][0] == 200 and first["/healthz"][1]["status"] == "alive", first
        code, body = first["/readyz"]
        assert code == 503 and set(body["ranks"]) == {"0", "1"}, first
        assert set(body["ranks"].values()) <= {"pending", "loading"}, first
        assert all(code == 200 for _, p, code, _, _ in answers if p == "/healthz")
        assert {code for _, p, code, _, _ in answers if p == "/readyz"} == {503, 200}
        assert latencies[-1] < SLOWEST_PROBE_S and p99 < P99_S, (p99, latencies[-5:])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
