"""Static checks that stay fast: ruff's pyflakes and pycodestyle errors over the whole tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_no_errors():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (it comes with the test extra: pip install -e '.[test]')")
    p = subprocess.run([ruff, "check", "--select", "E,F,W", "--ignore", "E501", "--output-format", "concise",
                        "loader", "server", "bench", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
