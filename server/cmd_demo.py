"""``gdsload demo``: the sidecar on the embedded default (CPU, local files), end to end.

Builds a small synthetic Llama as rank shards, starts ``gdsload serve`` on it as a child process
on a free loopback port, polls ``/readyz`` the way an autoscaler does until it answers 200,
prints each rank's load report from ``/v1/status``, then stops the server with SIGTERM and
checks that it and its workers exit cleanly. Only the standard library talks HTTP here.

>>> # gdsload demo --size 64MiB --tp 2   # doctest: +SKIP
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from collections.abc import Callable
from typing import Any

import click

from ..loader.pipeline.result import FileReport, LoadReport

from .cli import SIZE, print_report
from .options import json_option

__all__ = ["demo", "serve_command"]

_URL_RE = re.compile(r"listening on (http://[^\s\"]+:\d+)")


def serve_command(*args: str) -> list[str]:
    """The argv that runs ``gdsload serve ARGS`` with this interpreter (no installed script needed)."""
    return [sys.executable, "-m", "gdsload.server.cmd_serve", *args]


@click.command("demo")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where to build the demo model (default: a temporary directory, removed afterwards).",
)
@click.option("--tp", default=2, show_default=True, help="Ranks to shard the demo model into (one worker each).")
@click.option("--size", type=SIZE, default="64MiB", show_default=True, help="Approximate model size.")
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to wait for /readyz to answer 200.")
@json_option
def demo(workdir: str | None, tp: int, size: int, timeout: float, as_json: bool = False) -> None:
    """Build a synthetic model as rank shards, serve it with `gdsload serve` (CPU), poll /readyz until 200,
    print the per-rank load reports from /v1/status, then stop the server with SIGTERM.

    With ``--json`` the steps go to stderr and stdout gets one JSON document: each rank's load report, the time to
    ready, and whether the server and its workers stopped cleanly."""
    from ..loader.prepare.synthetic import make_checkpoint, shape_for_size

    say = functools.partial(click.echo, err=as_json)

    with tempfile.TemporaryDirectory(prefix="gdsload-demo-") as tmp:
        root = Path(workdir) if workdir else Path(tmp) / "model"
        shape = shape_for_size(size)
        say(f"building a synthetic Llama ({shape.layers} layers, hidden {shape.hidden}) as {tp} rank shards in {root}")
        make_checkpoint(root, shape, tp=tp)

        log_path = Path(tmp) / "serve.log"
        # Flags pin what the demo needs; the worker verifies the manifest digests (GDSLOAD_VERIFY).
        cmd = serve_command(
            str(root),
            "--tp",
            str(tp),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--device-map",
            "cpu",
            "--log-level",
            "info",
        )  # the demo reads the port and each rank's progress from the log
        token = secrets.token_hex(16)  # /v1/status shows each rank's load report to the token's holder
        env = {**os.environ, "GDSLOAD_VERIFY": "1", "PYTHONUNBUFFERED": "1", "GDSLOAD_TOKEN": token}
        say(f"starting: gdsload serve {root} --tp {tp} --host 127.0.0.1 --port 0 --device-map cpu")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = _wait_for_url(log_path, proc, timeout)
            say(f"server pid {proc.pid} answers at {url}; polling {url}/readyz like an autoscaler")
            _poll_ready(url, proc, log_path, timeout, token, say)
            status = _get_json(url + "/v1/status", token)
            ranks = sorted(status["ranks"], key=int)
            if not as_json:
                for key in ranks:
                    print_report(_report_from_dict(status["ranks"][key]["report"]), as_json=False)
            say(
                f"time to ready: {status['process']['time_to_ready_s']:.2f} s after the server process started "
                f"({status['load']['time_to_ready_s']:.2f} s from the start of the load)"
            )
            pids = [r["pid"] for r in status["ranks"].values() if r["pid"]]
            _stop(proc, log_path, pids, say)
            if as_json:
                doc = {
                    "model": str(root),
                    "tp": tp,
                    "ranks": {key: status["ranks"][key]["report"] for key in ranks},
                    "time_to_ready_s": status["process"]["time_to_ready_s"],
                    "load_time_to_ready_s": status["load"]["time_to_ready_s"],
                    "stopped_cleanly": True,
                }
                click.echo(json.dumps(doc, indent=2))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _report_from_dict(d: dict[str, Any]) -> LoadReport:
    names = set(LoadReport.FIELDS)
    file_names = set(FileReport._fields)
    values = {k: v for k, v in d.items() if k in names and k != "files"}
    files = [FileReport(**{k: v for k, v in f.items() if k in file_names}) for f in d["files"]]
    return LoadReport(files=files, **values)


def _tail(log_path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_for_url(log_path: Path, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _URL_RE.search(log_path.read_text(errors="replace"))
        if m:
            return m[1]
        if proc.poll() is not None:
            raise click.ClickException(f"gdsload serve exited with status {proc.returncode}:\n{_tail(log_path)}")
        time.sleep(0.05)
    raise click.ClickException(f"gdsload serve did not start listening within {timeout:.0f} s:\n{_tail(log_path)}")


def _get(url: str, timeout: float = 2.0, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (our own loopback URL)
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _get_json(url: str, token: str | None = None) -> dict[str, Any]:
    code, body = _get(url, token=token)
    if code != 200:
        raise click.ClickException(f"GET {url} answered {code}: {body[:300]!r}")
    return json.loads(body)


def _poll_ready(
    url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float, token: str, say: Callable[[str], Any]
) -> None:
    """GET /readyz every 0.2 s (1 s per request) until 200; print each change of the per-rank states."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise click.ClickException(f"gdsload serve exited with status {proc.returncode}:\n{_tail(log_path)}")
        try:
            code, body = _get(url + "/readyz", timeout=1.0)
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            code, body = 0, str(e).encode()
        doc = json.loads(body) if code in (200, 503) else {}
        states = " ".join(f"{r}={s}" for r, s in sorted(doc.get("ranks", {}).items(), key=lambda kv: int(kv[0])))
        if (code, states) != last:
            say(f"  {time.monotonic() - start:6.2f} s  /readyz {code or 'no answer'}  {states}")
            last = (code, states)
        if code == 200:
            return
        failed = [r for r, s in doc.get("ranks", {}).items() if s == "failed"]
        if failed:
            status = _get_json(url + "/v1/status", token)
            errors = "; ".join(f"rank {r}: {status['ranks'][r]['error']}" for r in failed)
            raise click.ClickException(f"loading failed: {errors}")
        time.sleep(0.2)
    raise click.ClickException(f"/readyz did not answer 200 within {timeout:.0f} s:\n{_tail(log_path)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _stop(proc: subprocess.Popen[bytes], log_path: Path, worker_pids: list[int], say: Callable[[str], Any]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        raise click.ClickException(f"gdsload serve did not exit within 30 s of SIGTERM:\n{_tail(log_path)}") from None
    if code != 0:
        raise click.ClickException(f"gdsload serve exited with status {code} after SIGTERM:\n{_tail(log_path)}")
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in worker_pids if _alive(p)]
    if left:
        raise click.ClickException(f"worker processes {left} outlived the server")
    say(f"server stopped cleanly on SIGTERM (exit status 0); worker processes {worker_pids} are gone")


if __name__ == "__main__":
    demo(prog_name="gdsload demo")
