"""The code blocks of a Markdown file, and a runner that runs them as written, in order, in one directory.

A block's fence names its language and, after it, where it runs::

    ```sh               run here (the gdsload of this environment on PATH)
    ```python           run here, with this interpreter
    ```sh server        started in the background; the runner waits for its port to answer, then goes on
    ```sh vllm          needs vLLM: run by the engine tier, with the engine environment first on PATH
    ```python vllm      likewise, with the engine environment's interpreter
    ```sh vllm-server   a vLLM server: the engine tier starts it, asks it for a completion, stops it
    ```sh vllm-install  how the engine environment is built (the engine tier builds it with exactly this)
    ```sh gpu           needs a CUDA device: run on a GPU host (`pytest -m gpu`)
    ```sh setup         the README's two set-up commands (CI runs them: ``.ci/run``)

Nothing here imports gdsload: the engine tier uses it from another environment.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "blocks", "Runner", "WHERE"]

WHERE = ("here", "server", "vllm", "vllm-server", "vllm-install", "gpu", "setup")
_FENCE = re.compile(r"^```([a-z]+)[ \t]*([a-z-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    lang: str
    where: str
    code: str
    line: int

    def __str__(self) -> str:
        return f"line {self.line} ({self.lang} {self.where})"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order."""
    text = path.read_text()
    return [Block(m[1], m[2] or "here", m[3], text.count("\n", 0, m.start()) + 1) for m in _FENCE.finditer(text)]


def _port(code: str, default: int | None = None) -> int | None:
    found = re.findall(r"--port[ =](\d+)", code)
    return int(found[-1]) if found else default


def _answers(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


class Runner:
    """Runs blocks in ``workdir`` with ``env`` (PATH and the interpreter decide which gdsload and vLLM run)."""

    def __init__(self, workdir: Path, env: dict[str, str], python: str):
        self.workdir, self.env, self.python = workdir, env, python
        self.background: list[subprocess.Popen[bytes]] = []

    def run(self, block: Block, timeout: float = 600) -> str:
        """Run ``block`` to its end; its output, or AssertionError naming the block and what it printed."""
        if block.lang == "python":
            cmd = [self.python, "-c", block.code]
        else:
            cmd = ["bash", "-euo", "pipefail", "-c", block.code]
        p = subprocess.run(cmd, cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=timeout)
        out = p.stdout + p.stderr
        assert p.returncode == 0, (
            f"README block at {block} failed (exit {p.returncode}):\n{block.code}\n---\n{out[-4000:]}"
        )
        return out

    def start(self, block: Block, ready_path: str, timeout: float = 300, default_port: int | None = None) -> int:
        """Start ``block`` in the background and wait until ``http://127.0.0.1:PORT{ready_path}`` answers 200."""
        port = _port(block.code, default_port)
        assert port is not None, f"README block at {block} names no --port to wait for"
        log = self.workdir / f"block-{block.line}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", block.code],
                cwd=self.workdir,
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.background.append(proc)
        deadline = time.monotonic() + timeout
        while _answers(f"http://127.0.0.1:{port}{ready_path}") != 200:
            assert proc.poll() is None, (
                f"README block at {block} exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            )
            assert time.monotonic() < deadline, (
                f"README block at {block}: {ready_path} not 200 in {timeout:.0f} s:\n{log.read_text()[-4000:]}"
            )
            time.sleep(0.25)
        return port

    def stop(self) -> None:
        """Stop every background block (SIGTERM to its process group, then SIGKILL)."""
        for proc in reversed(self.background):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.background):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.background.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
