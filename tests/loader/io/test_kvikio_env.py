"""kvikio's settings: what the ``cufile`` and ``pinned`` backends set for a load, and the ``KVIKIO_*`` variables a
user set, which win. The settings are computed on any host; applying them to kvikio is checked on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gdsload.loader.io import ReadOptions
from gdsload.loader.io.cufile import CuFileBackend
from gdsload.loader.io.kvikio_env import ENV_VARS, settings_to_apply, user_settings
from gdsload.loader.io.pinned import PinnedBackend


def _cufile(cold: bool) -> CuFileBackend:
    backend = CuFileBackend("cuda", ReadOptions())
    backend.cold_direct = cold
    return backend


def _pinned(cold: bool) -> PinnedBackend:
    backend = PinnedBackend("cuda", ReadOptions())
    backend._kv_switch, backend.kvikio_direct = True, cold
    return backend


def test_without_kvikio_variables_the_backends_set_their_own_values():
    assert settings_to_apply(_cufile(cold=False)._kvikio_settings(), {}) == {
        "num_threads": 16,
        "task_size": 4 << 20,
        "bounce_buffer_size": 4 << 20,
        "auto_direct_io_read": False,
    }
    assert settings_to_apply(_cufile(cold=True)._kvikio_settings(), {"PATH": "/bin"}) == {
        "num_threads": 4,
        "task_size": 2 << 20,
        "bounce_buffer_size": 2 << 20,
        "auto_direct_io_read": True,
    }
    assert settings_to_apply(_pinned(cold=False)._kvikio_wanted(), {}) == {
        "compat_mode": "ON",
        "num_threads": 16,
        "task_size": 4 << 20,
        "bounce_buffer_size": 4 << 20,
        "auto_direct_io_read": False,
    }


@pytest.mark.parametrize("make", [_cufile, _pinned])
def test_a_users_kvikio_variables_win(make):
    env = {
        "KVIKIO_NTHREADS": "32",
        "KVIKIO_TASK_SIZE": "1048576",
        "KVIKIO_COMPAT_MODE": "OFF",
        "KVIKIO_AUTO_DIRECT_IO_READ": "0",
    }
    for cold in (False, True):
        backend = make(cold)
        wanted = backend._kvikio_settings() if isinstance(backend, CuFileBackend) else backend._kvikio_wanted()
        applied = settings_to_apply(wanted, env)
        # Every setting the user fixed is left to kvikio (which read the variable); the rest are still set.
        assert not {"num_threads", "task_size", "compat_mode", "auto_direct_io_read"} & set(applied), applied
        assert applied == {"bounce_buffer_size": wanted["bounce_buffer_size"]}


def test_an_empty_variable_leaves_the_setting_to_gdsload():
    assert user_settings({"KVIKIO_NTHREADS": "", "KVIKIO_TASK_SIZE": " ", "KVIKIO_GDS_THRESHOLD": "0"}) == {
        "gds_threshold": "KVIKIO_GDS_THRESHOLD"
    }
    assert set(ENV_VARS.values()) >= {"KVIKIO_NTHREADS", "KVIKIO_TASK_SIZE", "KVIKIO_COMPAT_MODE"}


@pytest.mark.gpu
def test_kvikio_keeps_the_users_values_while_a_backend_holds_its_settings():
    """Against the real kvikio, in a process started with the user's variables: what the backends apply from
    open to close leaves KVIKIO_NTHREADS and KVIKIO_TASK_SIZE as the user set them, sets the rest, and puts
    everything back afterwards."""
    pytest.importorskip("kvikio")
    code = """
import json
import os
import kvikio, kvikio.defaults
from gdsload.loader.io import ReadOptions
from gdsload.loader.io.cufile import CuFileBackend
from gdsload.loader.io.kvikio_env import settings_to_apply
backend = CuFileBackend("cuda", ReadOptions())
before = kvikio.defaults.get("bounce_buffer_size")
with kvikio.defaults.set(settings_to_apply(backend._kvikio_settings())):
    held = {k: kvikio.defaults.get(k) for k in ("num_threads", "task_size", "bounce_buffer_size")}
print(json.dumps({"held": held, "after": kvikio.defaults.get("bounce_buffer_size"), "before": before}))
"""
    env = {**os.environ, "KVIKIO_NTHREADS": "3", "KVIKIO_TASK_SIZE": str(1 << 20)}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["held"] == {"num_threads": 3, "task_size": 1 << 20, "bounce_buffer_size": 4 << 20}
    assert out["after"] == out["before"]


@pytest.mark.gpu
def test_pinned_reports_the_io_mode_of_the_users_kvikio_compat_mode(tmp_path):
    """With the user's KVIKIO_COMPAT_MODE in force, kvikio decides whether cuFile reads the files: the pinned
    backend's report says what kvikio does (``posix`` only where kvikio keeps to POSIX reads)."""
    pytest.importorskip("kvikio")
    from gdsload.loader.prepare.synthetic import make_checkpoint

    model = make_checkpoint(tmp_path / "m", "tiny")
    code = f"""
import json
from gdsload.loader import load_rank
from gdsload.loader.io.iomode import cufile_io_mode, gds_filesystem, kvikio_state, o_direct_supported
r = load_rank({str(model)!r}, device="cuda", backend="pinned")
state = kvikio_state()
want = ["posix" if state.compat_preferred or f.reader != "kvikio" else
        cufile_io_mode(state, o_direct_supported(f.path), gds_fs=gds_filesystem(f.path)) for f in r.report.files]
print(json.dumps({{"modes": [f.io_mode for f in r.report.files], "want": want,
                  "readers": [f.reader for f in r.report.files]}}))
"""
    env = {**os.environ, "KVIKIO_COMPAT_MODE": "AUTO", "GDSLOAD_STAGED": "0"}  # cached files through kvikio
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["modes"] == out["want"], out


def test_the_cufile_backend_leaves_the_users_settings_to_kvikio_when_it_opens(sharded_dir, monkeypatch):
    """Through the backend's own open and close, with kvikio stood in for (it needs a GPU): what it sets
    leaves out the user's KVIKIO_NTHREADS and KVIKIO_COMPAT_MODE, and is put back at close."""
    from kvikio_stand_in import host_reader as _host_reader, stand_in_kvikio as _stand_in_kvikio

    from gdsload.loader import discover, plan_rank

    seen = _stand_in_kvikio(monkeypatch)
    sys.modules["kvikio"].defaults.get = {"num_threads": 32}.__getitem__  # what kvikio read from the variable
    monkeypatch.setenv("KVIKIO_NTHREADS", "32")
    monkeypatch.setenv("KVIKIO_COMPAT_MODE", "ON")
    plan = plan_rank(discover(sharded_dir, 1))
    reader = _host_reader()
    reader.open(plan)
    try:
        assert seen["settings"] == [{"task_size": 1 << 20, "bounce_buffer_size": 1 << 20}]
        assert reader._cold_shape == (1 << 20, 32)  # the read order follows the threads kvikio really has
    finally:
        reader.close()
        plan.close()
    assert seen["restored"] == 1
