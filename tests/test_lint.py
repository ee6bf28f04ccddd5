"""Static checks that stay fast: ruff's pyflakes and pycodestyle errors, and ruff's layout, over the whole tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREE = ["loader", "server", "bench", "tests", "setup.py"]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (it comes with the test extra: pip install -e '.[test]')")
    return subprocess.run([ruff, *args, *TREE], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_finds_no_errors():
    p = _ruff("check", "--select", "E,F,W", "--ignore", "E501", "--output-format", "concise")
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_tree_is_laid_out_by_ruff_format():
    """`ruff format` (its settings in pyproject.toml) leaves every file as it is: run it before committing."""
    p = _ruff("format", "--check")
    assert p.returncode == 0, p.stdout + p.stderr
