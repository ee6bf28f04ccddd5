"""What I/O path a read really takes: determined from the host, never assumed.

Modes reported per file (``LoadReport.files[i].io_mode``):

- ``gds``: cuFile with nvidia-fs: DMA from storage straight into GPU memory;
- ``p2pdma``: cuFile over the kernel's PCI P2PDMA (no nvidia-fs module; ``use_pci_p2pdma`` on);
- ``compat``: cuFile is in use but has no GDS path here, so it bounces through host memory;
- ``posix``: POSIX reads into host memory, then copies to the GPU (our pinned pipeline, and kvikio
  in its own compatibility mode, where it does not load libcufile at all);
- ``cpu``: POSIX reads into host memory, no GPU.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, NamedTuple

__all__ = [
    "KvikioState",
    "kvikio_state",
    "nvidia_fs_loaded",
    "cufile_json_path",
    "cufile_config",
    "p2pdma_configured",
    "o_direct_supported",
    "mount_of",
    "gds_filesystem",
    "gds_fs_type",
    "cufile_io_mode",
]


class KvikioState(NamedTuple):
    importable: bool
    version: str | None = None
    compat_mode: str | None = None
    """kvikio's setting: ON, OFF or AUTO."""
    compat_preferred: bool | None = None
    """True when kvikio will not use libcufile (POSIX reads + bounce buffers instead)."""
    gds_available: bool | None = None
    """cuFile driver's own answer (``is_gds_available``)."""
    error: str | None = None


@functools.cache
def kvikio_state() -> KvikioState:
    """Ask kvikio (if installed) how it would read; asked once per process.

    Asking may open the cuFile driver, which takes milliseconds, and ``auto`` selection asks
    more than once per load.
    """
    try:
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        return KvikioState(importable=False, error=f"{type(e).__name__}: {e}")
    mode = str(kvikio.defaults.get("compat_mode"))
    mode = {"0": "OFF", "1": "ON", "2": "AUTO"}.get(mode, mode.rsplit(".", 1)[-1])
    preferred = bool(kvikio.defaults.is_compat_mode_preferred())
    gds: bool | None = None
    error = None
    if not preferred:
        try:
            gds = bool(kvikio.cufile_driver.get("is_gds_available"))
        except Exception as e:  # the driver could not be opened
            error = f"cuFile driver: {type(e).__name__}: {e}"
    return KvikioState(True, getattr(kvikio, "__version__", None), mode, preferred, gds, error)


def nvidia_fs_loaded() -> bool:
    """True when the nvidia-fs kernel module (classic GDS) is loaded."""
    return os.path.exists("/proc/driver/nvidia-fs") or os.path.isdir("/sys/module/nvidia_fs")


def cufile_json_path() -> str | None:
    """The cufile.json in force: ``CUFILE_ENV_PATH_JSON``, else ``/etc/cufile.json``, if it exists."""
    path = os.environ.get("CUFILE_ENV_PATH_JSON", "/etc/cufile.json")
    return path if os.path.isfile(path) else None


def cufile_config() -> dict[str, Any] | None:
    """cufile.json parsed (it allows // comments), or None when absent, unreadable or not a cufile.json."""
    path = cufile_json_path()
    if path is None:
        return None
    try:
        text = open(path, encoding="utf-8").read()
        text = re.sub(r"^\s*//.*$", "", text, flags=re.M)
        text = re.sub(r",(\s*[}\]])", r"\1", text)  # tolerate trailing commas
        doc = json.loads(text)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("properties", {}), dict):
        return None  # valid JSON of another shape: not a cufile.json
    return doc


def p2pdma_configured(config: dict[str, Any] | None = None) -> bool:
    """True when cufile.json turns on PCI P2PDMA (``properties.use_pci_p2pdma``)."""
    config = cufile_config() if config is None else config
    return bool(config and config.get("properties", {}).get("use_pci_p2pdma"))


def o_direct_supported(path: str) -> bool:
    """True when ``path``'s file system accepts O_DIRECT opens (tmpfs did not before Linux 6.6)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def mount_of(path: str, mounts: str = "/proc/mounts") -> tuple[str, str]:
    """``(mount point, file-system type)`` of the mount holding ``path``, from ``mounts`` (/proc/mounts)."""
    best, fs = "/", "unknown"
    real = os.path.realpath(path)
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                # The kernel writes space, tab, newline and backslash in mount points as \040 and the like.
                mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), parts[1])
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, fs = mount, parts[2]
    except OSError:
        pass
    return best, fs


NO_GDS_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "overlay", "squashfs", "devtmpfs", "proc", "sysfs"})
"""File systems whose files cuFile cannot DMA into GPU memory (memory or stacked file systems), though
some accept O_DIRECT (tmpfs does since Linux 6.6); also every FUSE file system."""


def gds_filesystem(path: str) -> bool:
    """False when ``path`` lies on a file system GPUDirect Storage cannot read from (see NO_GDS_FILESYSTEMS)."""
    return gds_fs_type(mount_of(path)[1])


def gds_fs_type(fs_type: str) -> bool:
    """False for file-system types GPUDirect Storage cannot read from (NO_GDS_FILESYSTEMS, FUSE)."""
    return fs_type not in NO_GDS_FILESYSTEMS and not fs_type.startswith("fuse")


def cufile_io_mode(state: KvikioState, direct_ok: bool, *, gds_fs: bool = True) -> str:
    """The mode a kvikio ``CuFile.pread`` of a file really takes.

    ``direct_ok``: the file opens with O_DIRECT; ``gds_fs``: its file system is one cuFile can DMA
    from (:func:`gds_filesystem`). Without either, cuFile bounces through host memory: ``compat``.
    """
    if not state.importable or state.compat_preferred:
        return "posix"
    if state.gds_available and direct_ok and gds_fs and nvidia_fs_loaded():
        return "gds"
    if state.gds_available and direct_ok and gds_fs and p2pdma_configured():
        return "p2pdma"
    return "compat"
