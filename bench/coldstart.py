"""The cold-start benchmark: every method, every condition, the hardware limits, in one run.

Each load runs in a fresh process (:mod:`gdsload.bench.methods`) on the same bytes. Conditions:

- ``cold``: the files are evicted from the page cache before every run (``drop_caches`` as root,
  plus ``posix_fadvise(DONTNEED)``), and the resident fraction is measured and recorded;
- ``warm``: the files are in the page cache (one untimed run first; read through again before a run
  that would find some of their pages evicted, by this host's other work);
- ``tmpfs``: a copy of the files in ``/dev/shm`` (the stand-in for very fast storage).

Compressed methods (``…:compressed``) load a compressed copy of the same checkpoint and are
timed in logical (decoded) bytes. Output: a terminal table, ``results.json`` with every run and
the machine facts, and (with matplotlib) ``chart.png``.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ..loader.io.iomode import mount_of
from ..loader.io.pagecache import MEMORY_FILESYSTEMS, evict, resident_fraction

from .limits import decode_gbps, h2d_gbps, raw_read_gbps, read_during_h2d
from .methods import BARE, PEER_MODULES, PEERS
from .ttr import time_to_ready

__all__ = ["BenchConfig", "run_bench", "default_methods", "machine_facts", "conditions_in_memory"]

CONDITIONS = ("tmpfs", "warm", "cold")
OUR_BACKENDS = ("pinned", "cufile", "fastsafetensors")


@dataclass
class BenchConfig:
    model_dir: Path
    compressed_dir: Path | None = None
    methods: list[str] = field(default_factory=list)
    conditions: tuple[str, ...] = CONDITIONS
    repeat: int = 3
    device: str = "cuda"
    out: Path = Path("bench-out")
    tmpfs_root: Path = Path("/dev/shm")
    timeout: float = 600.0
    ttr: bool = True
    """Also time the sidecar: ``gdsload serve`` start -> ``/readyz`` 200, per condition and directory."""


def _installed(module: str) -> str | None:
    import importlib.util

    return None if importlib.util.find_spec(module) else f"{module} is not installed"


def default_methods(device: str, compressed: bool) -> tuple[list[str], dict[str, str]]:
    """Every method that can run here, and why the others were skipped."""
    methods, skipped = [], {}
    if device == "cpu":
        # auto: what load_rank does by default on the CPU (the files mapped); cpu: reads into fresh memory.
        methods = ["gdsload:auto", "gdsload:cpu", "safetensors"] + (["gdsload:auto:compressed"] if compressed else [])
        return methods, skipped
    for b in OUR_BACKENDS:
        from ..loader.io import backend_class

        from ..loader.devices import as_device

        reason = backend_class(b).probe(as_device(device))
        if reason:
            skipped[f"gdsload:{b}"] = reason
            continue
        methods.append(f"gdsload:{b}")
        if compressed and b != "fastsafetensors":
            methods.append(f"gdsload:{b}:compressed")
    from ..loader.devices import torch_free_unavailable

    reason = torch_free_unavailable()
    if reason:
        skipped[BARE] = reason
    else:  # the sidecar workers' path, without torch
        methods += [BARE] + ([f"{BARE}:compressed"] if compressed else [])
    for p in PEERS:
        reason = _installed(PEER_MODULES[p])
        if reason:
            skipped[p] = reason
        else:
            methods.append(p)
    return methods, skipped


def machine_facts(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    for pkg in (
        "gdsload",
        "torch",
        "safetensors",
        "kvikio-cu13",
        "kvikio-cu12",
        "nvidia-nvcomp-cu13",
        "nvidia-nvcomp-cu12",
        "fastsafetensors",
        "instanttensor",
        "runai-model-streamer",
        "cupy-cuda13x",
    ):
        try:
            facts.setdefault("versions", {})[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    if device.startswith("cuda"):
        import torch

        facts["gpu"] = torch.cuda.get_device_name()
        facts["cuda"] = torch.version.cuda
        try:
            q = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=driver_version,pcie.link.gen.current,pcie.link.width.current",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            facts["nvidia_smi"] = q.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
        from ..loader.io.iomode import kvikio_state, nvidia_fs_loaded

        facts["nvidia_fs"] = nvidia_fs_loaded()
        facts["kvikio"] = kvikio_state()._asdict()
    return facts


def _one(method: str, model_dir: Path, device: str, timeout: float) -> dict[str, Any]:
    try:
        p = subprocess.run(
            [sys.executable, "-m", "gdsload.bench.methods", method, str(model_dir), device],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:  # a hung loader is a failed run, not the end of the bench
        return {"method": method, "error": [f"timed out after {timeout:g} s"]}
    if p.returncode != 0:
        return {"method": method, "error": (p.stderr or p.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _files(d: Path) -> list[str]:
    from .methods import _files as method_files

    return method_files(str(d))  # what the methods load


def conditions_in_memory(conditions: Sequence[str], *dirs: Any) -> dict[str, str]:
    """The ``warm`` and ``cold`` conditions that cannot run, each with the reason: those need every
    model file on a disk. A file on a memory file system (directly or through a symlink) never leaves
    the page cache, so ``cold`` would time memory reads under a disk's name and ``warm`` would be the
    ``tmpfs`` condition again; and a condition whose methods read some from memory, some from a disk,
    compares nothing."""
    for d in dirs:
        if d is None:
            continue
        for f in _files(Path(d)):
            fs = mount_of(f)[1]
            if fs in MEMORY_FILESYSTEMS:
                return {
                    c: f"{f} lies on a memory file system ({fs}) and never leaves the page cache; `{c}` needs "
                    "every model file on a disk (the `tmpfs` condition times memory)"
                    for c in conditions
                    if c in ("warm", "cold")
                }
    return {}


def run_bench(cfg: BenchConfig, log=print) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Run every method under every condition; returns (and writes) the results document."""
    compressed = cfg.compressed_dir is not None
    methods, skipped = (cfg.methods, {}) if cfg.methods else default_methods(cfg.device, compressed)
    not_run = conditions_in_memory(cfg.conditions, cfg.model_dir, cfg.compressed_dir)
    for c, why in not_run.items():
        log(f"condition {c} skipped: {why}")
    conditions = [c for c in cfg.conditions if c not in not_run]
    if not conditions:
        raise ValueError(f"no condition can run: {not_run[cfg.conditions[0]]}")
    doc: dict[str, Any] = {
        "facts": machine_facts(cfg.device),
        "config": {
            "model_dir": str(cfg.model_dir),
            "compressed_dir": str(cfg.compressed_dir) if compressed else None,
            "repeat": cfg.repeat,
            "device": cfg.device,
            "methods": methods,
            "conditions": conditions,
        },
        "skipped": skipped,
        "conditions_skipped": not_run,
        "limits": {},
        "runs": [],
        "ttr": [],
        "complete": False,
    }
    if cfg.device.startswith("cuda"):
        doc["limits"]["h2d_gbps"] = h2d_gbps(cfg.device)
        if compressed:
            doc["limits"]["decode_gbps"] = decode_gbps(cfg.compressed_dir, cfg.device)
    log(f"limits: {doc['limits']}")
    for condition in conditions:
        dirs = {"plain": cfg.model_dir, "compressed": cfg.compressed_dir}
        copies: list[Path] = []
        try:
            if condition == "tmpfs":
                for k, d in list(dirs.items()):
                    if d is None:
                        continue
                    # A fresh copy under a unique name: never an older copy of another model, never someone
                    # else's; removed below even when the copy itself fails or is interrupted.
                    room = Path(tempfile.mkdtemp(prefix=f"gdsload-bench-{k}-", dir=cfg.tmpfs_root))
                    copies.append(room)
                    dirs[k] = room / Path(d).name
                    shutil.copytree(d, dirs[k])
            plain_files = _files(dirs["plain"])
            if condition == "cold":
                # Several access patterns, each from a cold cache: the limit is the best one; all are kept.
                # Disks differ: a virtio disk is fastest with few bytes in flight (one reader per
                # file, 1-2 MiB reads), others want many large reads.
                direct = _direct_ok(plain_files[0])
                shapes = {
                    "32x16MiB-interleaved": dict(threads=32, chunk=16 << 20, interleave=True),
                    "16x16MiB-file-by-file": dict(threads=16, chunk=16 << 20, interleave=False),
                    "4x16MiB-file-by-file": dict(threads=4, chunk=16 << 20, interleave=False),
                    "16x512KiB-file-by-file": dict(threads=16, chunk=512 << 10, interleave=False),
                    "one-per-file-2MiB": dict(chunk=2 << 20, per_file=True),
                    "one-per-file-1MiB": dict(chunk=1 << 20, per_file=True),
                }
                for name, shape in shapes.items():
                    how = evict(plain_files)
                    doc["limits"][f"raw_read_gbps.cold.{name}"] = raw_read_gbps(plain_files, direct=direct, **shape)
                doc["limits"][f"raw_read_gbps.{condition}"] = max(
                    doc["limits"][f"raw_read_gbps.cold.{n}"] for n in shapes
                )
                doc["limits"]["raw_read_direct"] = direct
                doc["limits"]["evicted_by"] = how
            else:
                raw_read_gbps(plain_files, direct=False)  # fills the cache
                # From memory, small cache-resident buffers read fastest; take the better of two shapes.
                doc["limits"][f"raw_read_gbps.{condition}"] = max(
                    raw_read_gbps(plain_files, direct=False, threads=t, chunk=c)
                    for t, c in ((16, 4 << 20), (32, 16 << 20))
                )
                if cfg.device.startswith("cuda"):
                    both = read_during_h2d(plain_files, cfg.device)
                    doc["limits"][f"read_during_h2d_gbps.{condition}"] = both["read_gbps"]
                    doc["limits"][f"h2d_during_read_gbps.{condition}"] = both["h2d_gbps"]
                    log(
                        f"{condition}: reads and H2D copies at once: read {both['read_gbps']:.2f} GB/s, "
                        f"H2D {both['h2d_gbps']:.2f} GB/s"
                    )
            log(f"{condition}: raw read {doc['limits'][f'raw_read_gbps.{condition}']:.2f} GB/s")
            # Methods take turns within each round: a disk whose speed drifts over minutes then
            # favours no method by its place in the list.
            if condition != "cold":
                for method in methods:
                    _one(method.removesuffix(":compressed"), _dir_of(method, dirs), cfg.device, cfg.timeout)  # warm-up
            for i in range(cfg.repeat):
                for method in methods:
                    d = _dir_of(method, dirs)
                    files = _files(d)
                    evicted = evict(files) if condition == "cold" else None
                    resident = resident_fraction(files)
                    if condition == "warm" and resident < 1.0:  # something else on the host evicted pages
                        _fill_cache(files)
                        resident = resident_fraction(files)
                    r = _one(method.removesuffix(":compressed"), d, cfg.device, cfg.timeout)
                    r.update(
                        method=method,
                        condition=condition,
                        run=i,
                        resident_before=round(resident, 4),
                        evicted_by=evicted,
                    )
                    doc["runs"].append(r)
                    _save(doc, cfg.out)  # a run cut short by a time limit still leaves its data
                    msg = r.get("error") or f"{r['bytes'] / r['seconds'] / 1e9:.2f} GB/s"
                    log(f"  {condition:5} {method:34} run {i}: {msg} (resident before {resident:.2f})")
            if cfg.ttr:
                for kind, d in dirs.items():
                    if d is None:
                        continue
                    files = _files(d)
                    evicted = evict(files) if condition == "cold" else None
                    r = time_to_ready(str(d), _serve_args(cfg.device), timeout=cfg.timeout)
                    r.update(condition=condition, dir=kind, evicted_by=evicted)
                    doc["ttr"].append(r)
                    _save(doc, cfg.out)
                    msg = r.get("error") or (
                        f"ready {r['time_to_ready_s']:.2f} s after start (load {r['load_seconds_max']:.2f} s)"
                    )
                    log(f"  {condition:5} {'serve:' + kind:34} {msg}")
        finally:
            for c in copies:
                shutil.rmtree(c, ignore_errors=True)
    doc["complete"] = True
    _save(doc, cfg.out)
    return doc


def _fill_cache(files: Sequence[str]) -> None:
    """Read the files through once, so that their pages are in the page cache again."""
    buf = bytearray(16 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def _dir_of(method: str, dirs: dict[str, Any]) -> Any:
    return dirs["compressed" if method.endswith(":compressed") else "plain"]


def _serve_args(device: str) -> list[str]:
    """``gdsload serve`` flags putting rank 0 where the bench loads: ``cpu``, or the GPU's index."""
    if device == "cpu":
        return ["--device-map", "cpu"]
    index = device.partition(":")[2]
    return ["--device-map", f"0:{index or 0}"]


def _save(doc: dict[str, Any], out: Path) -> None:
    doc["summary"] = summarize(doc)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, out / "results.json")


def _direct_ok(path: str) -> bool:
    from ..loader.io.iomode import o_direct_supported

    return o_direct_supported(path)


def summarize(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for condition in doc["config"]["conditions"]:
        best_peer = 0.0
        cond_rows = []
        for method in doc["config"]["methods"]:
            runs = [
                r for r in doc["runs"] if r["method"] == method and r["condition"] == condition and "error" not in r
            ]
            errs = [
                r["error"]
                for r in doc["runs"]
                if r["method"] == method and r["condition"] == condition and "error" in r
            ]
            if not runs:
                if errs:  # no runs at all: not reached (yet)
                    cond_rows.append(
                        {
                            "method": method,
                            "condition": condition,
                            "error": errs[:1],
                            "runs_ok": 0,
                            "runs_failed": len(errs),
                        }
                    )
                continue
            rates = [r["bytes"] / r["seconds"] / 1e9 for r in runs]
            # Bytes taken from the files per second of the whole call: a compressed copy's stored bytes, for
            # everything else the logical ones. Where the disk bounds every method, these meet.
            read_rates = [(r.get("stored_bytes") or r["bytes"]) / r["seconds"] / 1e9 for r in runs]
            row = {
                "method": method,
                "condition": condition,
                "median_gbps": statistics.median(rates),
                "min_gbps": min(rates),
                "max_gbps": max(rates),
                "read_gbps": statistics.median(read_rates),
                "seconds": statistics.median(r["seconds"] for r in runs),
                "bytes": runs[0]["bytes"],
                "io_modes": runs[0].get("io_modes"),
                "backend": runs[0].get("backend"),
                "readers": runs[0].get("readers"),
                "max_resident_before": max(r["resident_before"] for r in runs),
                "rss_peak_bytes": _most(runs, "rss_peak_bytes"),
                "gpu_peak_bytes": _most(runs, "gpu_peak_bytes"),
                "gpu_peak_from": runs[0].get("gpu_peak_from"),
                "runs_ok": len(runs),
                "runs_failed": len(errs),
            }
            if errs:
                row["error"] = errs[:1]
            if not method.startswith("gdsload"):
                best_peer = max(best_peer, row["median_gbps"])
            cond_rows.append(row)
        raw = doc["limits"].get(f"raw_read_gbps.{condition}")
        h2d = doc["limits"].get("h2d_gbps")
        for row in cond_rows:
            if "median_gbps" in row:
                row["vs_raw_read"] = row["median_gbps"] / raw if raw else None
                row["vs_h2d"] = row["median_gbps"] / h2d if h2d else None
                row["vs_best_peer"] = row["median_gbps"] / best_peer if best_peer else None
        rows.extend(cond_rows)
    return rows


def _most(runs: list[dict[str, Any]], key: str) -> int | None:
    """The largest of the runs' ``key`` (None when no run recorded it)."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return max(values) if values else None


def _io(row: dict[str, Any]) -> str:
    """The I/O modes that ran, and what read the files where the load names another reader than its backend
    (``posix via fastsafetensors``)."""
    modes = ",".join(sorted(set(row.get("io_modes") or []))) or "-"
    readers = ",".join(sorted({e for e in row.get("readers") or [] if e and e != row.get("backend")}))
    return f"{modes} via {readers}" if readers else modes


def format_table(doc: dict[str, Any]) -> str:
    lines = [
        f"{'condition':9} {'method':34} {'GB/s':>7} {'min':>7} {'max':>7} {'read':>6} {'s':>7} "
        f"{'/raw':>6} {'/h2d':>6} {'/peer':>6} {'RSS GB':>6} {'GPU GB':>6}  io"
    ]
    gb = lambda v: f"{v / 1e9:6.2f}" if v is not None else "     -"  # noqa: E731
    for r in doc["summary"]:
        if "median_gbps" not in r:
            lines.append(f"{r['condition']:9} {r['method']:34} error: {r['error']}")
            continue
        f = lambda v: f"{v:6.2f}" if v is not None else "     -"  # noqa: E731
        failed = (
            f"  ({r['runs_failed']} of {r['runs_ok'] + r['runs_failed']} runs failed: {r['error']})"
            if r.get("runs_failed")
            else ""
        )
        lines.append(
            f"{r['condition']:9} {r['method']:34} {r['median_gbps']:7.2f} {r['min_gbps']:7.2f} "
            f"{r['max_gbps']:7.2f} {f(r.get('read_gbps'))} {r['seconds']:7.3f} {f(r['vs_raw_read'])} {f(r['vs_h2d'])} "
            f"{f(r['vs_best_peer'])} {gb(r.get('rss_peak_bytes'))} {gb(r.get('gpu_peak_bytes'))}  "
            f"{_io(r)}{failed}"
        )
    for r in doc.get("ttr", []):
        what = f"{r['condition']:9} {'serve:' + r['dir']:34}"
        if "error" in r:
            lines.append(f"{what} error: {r['error']}")
        else:
            lines.append(
                f"{what} ready {r['time_to_ready_s']:.2f} s after process start; load "
                f"{r['load_seconds_max']:.2f} s ({', '.join(r['backends'])}, {', '.join(r['io_modes'])})"
            )
    return "\n".join(lines)
