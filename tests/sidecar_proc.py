"""``gdsload serve`` in a child process on loopback, for the server and engine tiers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

__all__ = ["URL_RE", "TOKEN", "Server"]

TOKEN = "test-token-5f0c2a9e1d"
"""The bearer token the tests start sidecars with."""

URL_RE = re.compile(r"listening on (http://[^\s\"]+:\d+)")


class Server:
    """``gdsload serve`` in a child process, its log in a file, an httpx client on its URL."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        new_group: bool = False,
        token: str | None = None,
    ):
        """``token``: started with it (``GDSLOAD_TOKEN``) unless ``args`` name a token file; :meth:`status` sends
        the server's token, wherever it came from, and so sees every detail."""
        clean = {k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")}
        env = dict(env or {})
        if "--token-file" in args:
            self.token: str | None = Path(args[args.index("--token-file") + 1]).read_text().strip()
        else:
            if token is not None:
                env.setdefault("GDSLOAD_TOKEN", token)
            self.token = env.get("GDSLOAD_TOKEN")
        self.log_path = log_path
        self.started = time.monotonic()
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gdsload.server.cmd_serve", *args, "--host", "127.0.0.1", "--port", "0"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**clean, "PYTHONUNBUFFERED": "1", **env},
                start_new_session=new_group,  # its own process group, to be signalled as a whole
            )
        self.url = self._wait_for_url(60)
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if m := URL_RE.search(self.log()):
                return m[1]
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.log()}"
            time.sleep(0.02)
        raise AssertionError(f"server did not listen within {timeout} s:\n{self.log()}")

    def poll_ready(self, timeout: float = 60, period: float = 0.05) -> list[tuple[int, dict[str, Any]]]:
        """GET /readyz like an autoscaler until 200; every answer seen, in order."""
        seen: list[tuple[int, dict[str, Any]]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.http.get("/readyz", timeout=2)
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                return seen
            assert r.status_code == 503, r.text
            if "failed" in r.json()["ranks"].values() and self.token:
                errors = {k: v["error"] for k, v in self.status()["ranks"].items() if v["error"]}
                raise AssertionError(f"a rank failed while polling for readiness: {errors}")
            time.sleep(period)
        raise AssertionError(f"/readyz not 200 within {timeout} s; last {seen[-1]}\n{self.log()[-3000:]}")

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def status(self) -> dict[str, Any]:
        r = self.http.get("/v1/status", headers=self.auth())
        assert r.status_code == 200, r.text
        return r.json()

    def terminate(self, timeout: float = 30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
