"""Hand a loaded rank to another process on the same host without copying it.

The exporter (the sidecar worker holding a :class:`LoadResult`) describes its arena as a
JSON-able document: an IPC handle for the arena's memory plus a tensor table (name, dtype,
shape, byte offset). The importer (the engine process) maps the arena and rebuilds each tensor
as a view — no bytes move.

- CUDA arenas use CUDA IPC (``cudaIpcGetMemHandle`` through torch's storage sharing); the
  importer must run on the same GPU.
- CPU arenas are moved once into shared memory (``/dev/shm`` via torch's shm manager), so
  the same hand-off works on CPU-only hosts and in tests.

The exporter must keep the result alive until every importer is done (the sidecar holds it
until the engine releases it, or the model is unloaded).

>>> doc = export_rank(result)            # in the sidecar worker  # doctest: +SKIP
>>> tensors = import_rank(doc)           # in the engine process  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import os
from typing import Any

import torch

from .dtypes import from_torch, to_torch
from .errors import GdsloadError
from .result import LoadResult

__all__ = ["IPC_VERSION", "IpcError", "export_rank", "import_rank"]

IPC_VERSION = 1


class IpcError(GdsloadError, RuntimeError):
    """An IPC document cannot be exported or mapped here."""


def _b64(x: bytes) -> str:
    return base64.b64encode(x).decode("ascii")


def _unb64(x: str) -> bytes:
    return base64.b64decode(x.encode("ascii"))


def export_rank(result: LoadResult, *, rank: int | None = None) -> dict[str, Any]:
    """Describe ``result``'s arena and tensors so another process can map them."""
    if len(result.arenas) != 1:
        raise IpcError(f"export needs exactly one arena per rank, the result holds {len(result.arenas)}")
    (arena,) = result.arenas
    storage = arena.untyped_storage()
    base = storage.data_ptr()
    table = []
    for name, t in result.tensors.items():
        if t.numel() and t.untyped_storage().data_ptr() != base:
            raise IpcError(f"tensor {name!r} is not a view of the rank's arena; it cannot be exported")
        table.append({
            "name": name,
            "dtype": from_torch(t.dtype),
            "shape": list(t.shape),
            "offset": t.storage_offset() * t.element_size() if t.numel() else 0,
            "nbytes": t.numel() * t.element_size(),
        })
    doc: dict[str, Any] = {"version": IPC_VERSION, "rank": result.report.rank if rank is None else rank,
                           "nbytes": storage.nbytes(), "tensors": table}
    if arena.device.type == "cuda":
        (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
        doc["kind"] = "cuda"
        doc["cuda"] = {
            "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
            "handle": _b64(handle), "size": size, "offset": offset,
            "ref_counter_handle": _b64(ref_handle), "ref_counter_offset": ref_offset,
            "event_handle": _b64(event_handle) if event_handle else None, "event_sync_required": event_sync,
        }
    elif arena.device.type == "cpu":
        if not storage.is_shared():
            storage.share_memory_()  # in place: every view of the arena follows
        manager, handle, size = storage._share_filename_cpu_()
        doc["kind"] = "cpu"
        doc["cpu"] = {"manager": _b64(manager), "handle": _b64(handle), "size": size}
    else:
        raise IpcError(f"arenas on {arena.device.type!r} cannot be exported; load to cuda or cpu")
    return doc


def import_rank(doc: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Map an exported arena in this process and rebuild its tensors as views.

    For CUDA, the current process must see the exporter's GPU; the device is found by UUID.
    """
    if doc.get("version") != IPC_VERSION:
        raise IpcError(f"IPC document version {doc.get('version')!r} is not {IPC_VERSION}; upgrade gdsload on both sides")
    kind = doc.get("kind")
    if kind == "cuda":
        c = doc["cuda"]
        device = _device_by_uuid(c["device_uuid"])
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(
                device, _unb64(c["handle"]), c["size"], c["offset"],
                _unb64(c["ref_counter_handle"]), c["ref_counter_offset"],
                _unb64(c["event_handle"]) if c["event_handle"] else b"", c["event_sync_required"],
            )
        dev = torch.device("cuda", device)
    elif kind == "cpu":
        c = doc["cpu"]
        storage = torch.UntypedStorage._new_shared_filename_cpu(_unb64(c["manager"]), _unb64(c["handle"]), c["size"])
        dev = torch.device("cpu")
    else:
        raise IpcError(f"IPC document kind {kind!r} is not 'cuda' or 'cpu'")
    arena = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage)
    if arena.numel() < doc["nbytes"]:
        raise IpcError(f"mapped {arena.numel()} bytes but the exporter described {doc['nbytes']}")
    out: dict[str, torch.Tensor] = {}
    for t in doc["tensors"]:
        dtype = to_torch(t["dtype"])
        if t["nbytes"] == 0:
            out[t["name"]] = torch.empty(t["shape"], dtype=dtype, device=dev)
        else:
            out[t["name"]] = arena[t["offset"] : t["offset"] + t["nbytes"]].view(dtype).view(t["shape"])
    return out


def _device_by_uuid(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise IpcError(
        f"the exporter's GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); run the engine on the same GPU"
    )
