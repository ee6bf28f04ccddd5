"""A wheel built from the repository installs on its own and imports under the gdsload namespace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the tree git knows (ignored files left out): an old build/ directory in
    # the checkout would add modules.
    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    src = tmp_path_factory.mktemp("src")
    for rel in tracked.decode().split("\0"):
        if rel and (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        timeout=300,
    )
    (whl,) = out.glob("gdsload-*.whl")
    return whl


def test_wheel_contents_are_namespaced(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"gdsload", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    # Every module of the source tree ships, under gdsload/, and nothing else does (a package missing
    # from pyproject's list, or a module left over from an old build, fails here).
    source = {
        f"gdsload/{p.relative_to(ROOT).as_posix()}".replace("gdsload/loader/_toplevel/", "gdsload/")
        for top in ("loader", "server", "bench")
        for p in (ROOT / top).rglob("*.py")
    }
    shipped = {n for n in names if n.endswith(".py")}
    assert "gdsload/loader/io/cpu.py" in source and "gdsload/server/cli.py" in source
    assert "gdsload/__init__.py" in shipped  # the top-level package: gdsload.save / gdsload.load
    assert source - shipped == set(), "modules missing from the wheel"
    assert shipped - source == set(), "modules in the wheel that the source tree does not have"
    assert not any(n.startswith(("loader/", "server/", "bench/", "tests/")) for n in names)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_the_staged_engine_is_built_where_a_c_compiler_is(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    built = [n for n in names if n.startswith("gdsload/loader/io/_staged") and n.endswith(".so")]
    assert len(built) == 1, names


def test_wheel_metadata_keeps_gpu_packages_in_extras(wheel):
    meta_name = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("dist-info/METADATA"))
    meta = Parser().parsestr(zipfile.ZipFile(wheel).read(meta_name).decode())
    requires = meta.get_all("Requires-Dist")
    core = [r for r in requires if "extra ==" not in r]
    assert not any(gpu in r for r in core for gpu in ("kvikio", "nvcomp", "cupy"))
    for extra in ("cu12", "cu13"):
        assert any("kvikio" in r and f'extra == "{extra}"' in r for r in requires)
    assert (
        "gdsload = gdsload.server.cli:main"
        in zipfile.ZipFile(wheel).read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    )


def test_installed_wheel_imports_from_its_own_location(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    code = (
        "import gdsload.loader, gdsload.server.cli, gdsload.bench, importlib.util, sys;"
        "print(gdsload.loader.__file__);"
        "assert importlib.util.find_spec('loader') is None and importlib.util.find_spec('server') is None;"
        "print(gdsload.loader.__version__)"
    )
    # Run from an empty directory so the repository's own loader/ is not on the path.
    env = {**os.environ, "PYTHONPATH": str(target)}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0].startswith(str(target))


def test_installed_wheel_saves_and_loads_through_the_top_level_names(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    code = (
        "import gdsload, torch;"
        "assert gdsload.__file__.startswith(%r), gdsload.__file__;"
        "state = {'w': torch.randn(300, 300), 'step': 7};"
        "gdsload.save(state, 'c.pt');"
        "back = gdsload.load('c.pt', map_location='cpu');"
        "assert torch.equal(back['w'], state['w']) and back['step'] == 7;"
        "print('ok')"
    ) % str(target)
    env = {**os.environ, "PYTHONPATH": str(target)}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
