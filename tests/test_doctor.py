"""``gdsload doctor``: facts read from this host, and the advice derived from them."""

from __future__ import annotations

import subprocess
import sys

from gdsload.loader.doctor import DoctorReport, MountFacts, _advise, diagnose, format_report

GPU = {"index": "0", "name": "NVIDIA H200", "pcie.link.gen.current": "5", "pcie.link.gen.max": "5"}
KVIKIO = {"importable": True, "compat_preferred": True, "gds_available": None}


def test_this_host_is_reported_from_its_own_facts(tmp_path):
    r = diagnose([str(tmp_path)])
    assert [m.path for m in r.mounts] == [str(tmp_path)]
    assert r.mounts[0].fs_type and r.mounts[0].mount_point.startswith("/")
    if not r.gpus:  # the CPU machines: nothing GPU-side is claimed
        assert r.expected_io_mode == "cpu" and r.torch_free_workers is None
        assert any("No NVIDIA GPU" in a for a in r.advice)
    text = format_report(r)
    assert f"mount    {tmp_path}" in text and "expected I/O mode for GPU loads:" in text


def test_gpu_host_without_gds_reads_through_host_memory_and_says_how_to_fix():
    r = DoctorReport(gpus=[GPU], torch_cuda="13.0", kvikio=KVIKIO, nvcomp="6.0.0",
                     mounts=[MountFacts("/dev/shm", "/dev/shm", "tmpfs", o_direct=False)])
    mode, advice = _advise(r)
    assert mode == "posix"
    assert any("nvidia-fs" in a for a in advice)
    assert any("/dev/shm (tmpfs) refuses O_DIRECT" in a for a in advice)
    assert not any("without torch" in a or "import torch" in a for a in advice)


def test_gds_host_expects_gds():
    r = DoctorReport(gpus=[GPU], torch_cuda="13.0", nvidia_fs=True,
                     kvikio={"importable": True, "compat_preferred": False, "gds_available": True}, nvcomp="6.0.0")
    assert _advise(r)[0] == "gds"


def test_sidecar_workers_that_would_import_torch_are_called_out():
    why = "cupy is not installed (cupy-cuda12x or cupy-cuda13x; gdsload[cu12] or gdsload[cu13] bring it)"
    r = DoctorReport(gpus=[GPU], torch_cuda="13.0", kvikio=KVIKIO, nvcomp="6.0.0", torch_free_workers=why)
    mode, advice = _advise(r)
    r.expected_io_mode, r.advice = mode, advice
    assert any("import torch" in a and "cupy" in a for a in advice)
    assert f"GPU workers load without torch: no ({why})" in format_report(r)
    r.torch_free_workers = None
    assert "GPU workers load without torch: yes" in format_report(r)


def test_doctor_command_runs():
    p = subprocess.run([sys.executable, "-m", "gdsload.server.cli", "doctor"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "expected I/O mode for GPU loads:" in p.stdout
