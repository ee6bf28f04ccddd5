"""IPC hand-off: another process maps a loaded rank and sees the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from gdsload.loader import load_rank
from gdsload.loader.handoff.ipc import IpcError, export_rank, import_rank

_CHILD = r"""
import json, sys, hashlib
from gdsload.loader.handoff.ipc import import_rank
doc = json.loads(sys.stdin.read())
tensors = import_rank(doc)
out = {}
for name, t in sorted(tensors.items()):
    raw = t.contiguous().reshape(-1).view(__import__("torch").uint8).cpu().numpy().tobytes() if t.numel() else b""
    out[name] = [str(t.dtype), list(t.shape), str(t.device), hashlib.sha256(raw).hexdigest()]
print(json.dumps(out))
"""


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    import hashlib

    out = {}
    for name, t in sorted(tensors.items()):
        raw = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
        out[name] = [str(t.dtype), list(t.shape), str(t.device), hashlib.sha256(raw).hexdigest()]
    return out


def _map_in_child(doc: dict) -> dict:
    p = subprocess.run(
        [sys.executable, "-c", _CHILD], input=json.dumps(doc), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_cpu_arena_maps_in_another_process(sharded_dir):
    result = load_rank(sharded_dir, 1, backend="cpu")
    before = _digests(result.tensors)
    doc = json.loads(json.dumps(export_rank(result)))  # survives JSON, as over HTTP
    assert doc["kind"] == "cpu" and doc["rank"] == 1
    assert _digests(result.tensors) == before  # moving the arena to shared memory kept every view valid
    assert _map_in_child(doc) == before


def test_shared_cpu_device_loads_into_shared_memory_and_exports_without_a_move(sharded_dir):
    """What the sidecar's CPU workers load into: the arena is shared memory from the start, so the first
    hand-off moves nothing (the tensors' addresses stay put) and another process sees the same bytes."""
    from gdsload.loader.devices import TorchDevice

    result = load_rank(sharded_dir, 1, device=TorchDevice(torch.device("cpu"), shared=True))
    (arena,) = result.arenas
    assert arena.untyped_storage().is_shared()
    addresses = {n: t.data_ptr() for n, t in result.tensors.items()}
    before = _digests(result.tensors)
    doc = export_rank(result)
    assert {n: t.data_ptr() for n, t in result.tensors.items()} == addresses
    assert _map_in_child(json.loads(json.dumps(doc))) == before == _digests(load_rank(sharded_dir, 1).tensors)


def test_shared_memory_is_for_the_cpu_only():
    from gdsload.loader.devices import TorchDevice
    from gdsload.loader.errors import ConfigError

    with pytest.raises(ConfigError, match="shared=True is for host memory"):
        TorchDevice(torch.device("cuda", 0), shared=True)


def test_a_rank_of_mapped_files_is_refused_naming_the_backends_that_export(sharded_dir):
    """``auto`` maps the files on the CPU: those tensors have no arena to share, and export says what to load with."""
    for f in sharded_dir.glob("*.safetensors"):  # cached, as auto maps them (other tests drop the page cache)
        f.read_bytes()
    result = load_rank(sharded_dir, 0)
    assert result.report.backend == "mmap"
    with pytest.raises(IpcError, match=r"views of their files' own pages.*backend='cpu'.*shared=True"):
        export_rank(result)


def test_import_in_same_process_gives_views_of_one_mapping(sharded_dir):
    result = load_rank(sharded_dir, 0, backend="cpu")
    tensors = import_rank(export_rank(result))
    ptrs = {t.untyped_storage().data_ptr() for t in tensors.values() if t.numel()}
    assert len(ptrs) == 1
    assert _digests(tensors) == _digests(result.tensors)


def test_bad_documents_are_typed_errors(sharded_dir):
    with pytest.raises(IpcError, match="version"):
        import_rank({"version": 99})
    with pytest.raises(IpcError, match="kind"):
        import_rank({"version": 1, "kind": "tpu"})
    good = json.loads(json.dumps(export_rank(load_rank(sharded_dir, 0, backend="cpu"))))
    first = good["tensors"][0]
    for damage, words in (
        (lambda d: d.pop("tensors"), "no valid 'nbytes' and 'tensors'"),
        (lambda d: d["tensors"][0].update(offset=d["nbytes"]), "does not fit its"),
        (lambda d: d["tensors"][0].update(dtype="Q4"), "does not fit its"),
        (lambda d: d["tensors"][0].update(shape=[*first["shape"], 2]), "does not fit its"),
        (lambda d: d.pop("cpu"), "the IPC document is damaged"),
    ):
        doc = json.loads(json.dumps(good))
        damage(doc)
        with pytest.raises(IpcError, match=words):
            import_rank(doc)


@pytest.mark.gpu
def test_cuda_arena_maps_in_another_process(sharded_dir):
    result = load_rank(sharded_dir, 1, device="cuda")
    doc = json.loads(json.dumps(export_rank(result)))
    assert doc["kind"] == "cuda"
    assert _map_in_child(doc) == _digests(result.tensors)


def test_shared_allocation_beyond_dev_shm_is_refused_before_any_write(sharded_dir, monkeypatch):
    """tmpfs claims pages when written: an arena larger than /dev/shm's room would die by SIGBUS mid-read,
    so it is refused up front, naming the bytes, the room and the fix."""
    import os

    from gdsload.loader import devices
    from gdsload.loader.errors import DeviceMemoryError

    real = os.statvfs("/dev/shm")

    class Tiny:
        f_bavail, f_frsize = 1, real.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda path: Tiny())
    with pytest.raises(DeviceMemoryError, match=r"rank 0 needs .* /dev/shm has \d+ free; .*--shm-size"):
        load_rank(sharded_dir, 0, device=devices.TorchDevice(torch.device("cpu"), shared=True))
