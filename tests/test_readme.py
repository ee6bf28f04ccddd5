"""The README's two set-up commands stay true: CI runs the test command, the demo command names a real subcommand."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    return re.findall(r"```sh\n(python3 -m venv .*?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_test_command():
    demo, tests = _commands()
    assert "pytest" in tests and "torch==2.13.0" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_demo_command_pins_cpu_torch_and_runs_demo():
    demo, _ = _commands()
    assert "torch==2.13.0" in demo and demo.endswith("gdsload demo")


def test_every_env_var_in_the_code_is_documented():
    code = "\n".join(p.read_text() for p in (ROOT / "loader").rglob("*.py"))
    code += "\n".join(p.read_text() for p in (ROOT / "server").rglob("*.py"))
    used = set(re.findall(r"GDSLOAD_[A-Z_]+", code))
    readme = (ROOT / "README.md").read_text()
    documented = set(re.findall(r"GDSLOAD_[A-Z_]+", readme))  # whole names: GDSLOAD_TOKEN_FILE is not GDSLOAD_TOKEN
    assert used and used <= documented, sorted(used - documented)
