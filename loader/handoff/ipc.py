"""Hand a loaded rank to another process on the same host without copying it.

The exporter (the sidecar worker holding a :class:`LoadResult`) describes its arena as a
JSON-able document: an IPC handle for the arena's memory plus a tensor table (name, dtype,
shape, byte offset). The importer (the engine process) maps the arena and rebuilds each tensor
as a view — no bytes move.

- CUDA arenas use CUDA IPC; the importer must run on the same GPU. A torch arena is shared
  through torch's storage sharing (kind ``cuda``); an arena loaded without torch (a
  :class:`~gdsload.loader.devices.DriverDevice`, the sidecar worker's torch-free path) by its own
  ``cuIpcGetMemHandle`` (kind ``cuda-ipc``), which the importer opens with the driver's
  ``cuIpcOpenMemHandle`` and closes when the last tensor view is gone.
- CPU arenas are shared through ``/dev/shm`` (named as torch's shm manager names them): the
  sidecar's CPU workers load into shared memory from the start (``TorchDevice(cpu, shared=True)``),
  another CPU arena is moved there on its first export. So the same hand-off works on CPU-only
  hosts and in tests.

The exporter must keep the result alive until every importer is done (the sidecar holds it
until the engine releases it, or the model is unloaded).

>>> doc = export_rank(result)            # in the sidecar worker  # doctest: +SKIP
>>> tensors = import_rank(doc)           # in the engine process  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import ctypes
import logging
import math
import os
from typing import TYPE_CHECKING, Any

from ..dtypes import ITEMSIZE, to_torch
from ..errors import GdsloadError
from ..pipeline.result import LoadResult

if TYPE_CHECKING:
    import torch

__all__ = ["IPC_VERSION", "IpcError", "export_rank", "import_rank"]

IPC_VERSION = 1

log = logging.getLogger(__name__)


class IpcError(GdsloadError, RuntimeError):
    """An IPC document cannot be exported or mapped here."""


def _b64(x: bytes) -> str:
    return base64.b64encode(x).decode("ascii")


def _unb64(x: str) -> bytes:
    return base64.b64decode(x.encode("ascii"))


def export_rank(result: LoadResult, *, rank: int | None = None) -> dict[str, Any]:
    """Describe ``result``'s arena and tensors so another process can map them."""
    if result.arena is None:
        raise IpcError("the result was closed; there is no arena to export")
    mapped = [s.name for s in result.slots if s.buffer > result.report.direct_tensors]  # after the caller's targets
    if mapped:
        raise IpcError(
            f"{len(mapped)} tensor(s) are views of their files' own pages, mapped by the 'mmap' backend "
            f"(what load_rank picks for host memory), not of an arena ({', '.join(map(repr, mapped[:4]))}); "
            "to hand a rank to another process, load it with backend='cpu', or onto "
            "TorchDevice(torch.device('cpu'), shared=True) (shared memory from the start)"
        )
    outside = [s.name for s in result.slots if s.buffer]
    if outside:
        raise IpcError(
            f"{len(outside)} tensor(s) were loaded into the caller's own memory, not the arena "
            f"({', '.join(map(repr, outside[:4]))}); only arena tensors can be exported"
        )
    device = result.device
    rank = result.report.rank if rank is None else rank
    if device is not None and not device.uses_torch:
        return _export_ipc(result, rank)
    (arena,) = result.arenas
    storage = arena.untyped_storage()
    table = [
        {
            "name": s.name,
            "dtype": s.dtype,
            "shape": list(s.shape),
            "offset": s.offset if s.nbytes else 0,
            "nbytes": s.nbytes,
        }
        for s in result.slots
    ]
    doc: dict[str, Any] = {"version": IPC_VERSION, "rank": rank, "nbytes": storage.nbytes(), "tensors": table}
    if arena.device.type == "cuda":
        import torch

        (dev, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
        doc["kind"] = "cuda"
        doc["cuda"] = {
            "device_uuid": str(torch.cuda.get_device_properties(dev).uuid),
            "handle": _b64(handle),
            "size": size,
            "offset": offset,
            "ref_counter_handle": _b64(ref_handle),
            "ref_counter_offset": ref_offset,
            "event_handle": _b64(event_handle) if event_handle else None,
            "event_sync_required": event_sync,
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


def _export_ipc(result: LoadResult, rank: int) -> dict[str, Any]:
    device, arena = result.device, result.arena
    return {
        "version": IPC_VERSION,
        "rank": rank,
        "nbytes": arena.nbytes,
        "tensors": [
            {
                "name": s.name,
                "dtype": s.dtype,
                "shape": list(s.shape),
                "offset": s.offset if s.nbytes else 0,
                "nbytes": s.nbytes,
            }
            for s in result.slots
        ],
        "kind": "cuda-ipc",
        "cuda_ipc": {
            "device_uuid": device.facts()["uuid"],
            "handle": _b64(device.ipc_handle(arena)),
            "size": arena.nbytes,
        },
    }


class _CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _IpcMapping:
    """An opened ``cudaIpcMemHandle``: a CUDA array interface over it, closed when collected.

    torch tensors made from it by ``torch.as_tensor`` hold a reference to it, so the mapping
    lives exactly as long as some view of it does.
    """

    def __init__(self, handle: bytes, size: int, device: int):
        self._cuda = ctypes.CDLL("libcuda.so.1")
        h = _CUipcMemHandle()
        ctypes.memmove(ctypes.byref(h), handle, ctypes.sizeof(h))
        # The context the mapping belongs to (the device's primary one, current here): the close
        # may run on any thread, so it makes this context current for the call.
        self._ctx = ctypes.c_void_p()
        self._cuda.cuCtxGetCurrent(ctypes.byref(self._ctx))
        ptr = ctypes.c_uint64()
        # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
        rc = self._cuda.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, ctypes.c_uint(1))
        if rc != 0:
            raise IpcError(
                f"cuIpcOpenMemHandle failed (CUresult {rc}) on device {device}; the exporter may have "
                "unloaded the rank, or this process is not on the exporter's GPU"
            )
        self.ptr = ptr.value
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
        }

    def __del__(self) -> None:
        if not getattr(self, "ptr", None):
            return
        cuda = self._cuda
        pushed = cuda.cuCtxPushCurrent_v2(self._ctx) == 0
        rc = cuda.cuIpcCloseMemHandle(ctypes.c_uint64(self.ptr))
        if pushed:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        if rc != 0:
            log.warning("cuIpcCloseMemHandle failed (CUresult %d); the mapping stays until this process exits", rc)
        self.ptr = 0


def import_rank(doc: dict[str, Any], *, private: bool = False) -> dict[str, torch.Tensor]:
    """Map an exported arena in this process and rebuild its tensors as views.

    For CUDA, the current process must see the exporter's GPU; the device is found by UUID.
    ``private`` (CPU arenas): map the shared memory copy-on-write, so that what this process
    writes into the tensors stays its own and the exporter's bytes never change; pages it only
    reads stay shared. An engine that adopts the tensors as its parameters wants this. CUDA IPC
    memory has no such mapping: there, writes reach the exporter's memory.
    """
    if not isinstance(doc, dict) or doc.get("version") != IPC_VERSION:
        version = doc.get("version") if isinstance(doc, dict) else doc
        raise IpcError(f"IPC document version {version!r} is not {IPC_VERSION}; upgrade gdsload on both sides")
    if doc.get("kind") not in ("cuda", "cuda-ipc", "cpu"):
        raise IpcError(f"IPC document kind {doc.get('kind')!r} is not 'cuda', 'cuda-ipc' or 'cpu'")
    _check_table(doc)  # before anything is mapped
    try:
        return _import_checked(doc, private=private)
    except (KeyError, TypeError, ValueError) as e:
        raise IpcError(
            f"the IPC document is damaged ({type(e).__name__}: {e}); ask the sidecar for a new one"
        ) from None


def _check_table(doc: dict[str, Any]) -> None:
    """Every tensor of the document lies inside the arena, aligned for its dtype, its size matching its shape."""
    total, table = doc.get("nbytes"), doc.get("tensors")
    if type(total) is not int or total < 0 or not isinstance(table, list):
        raise IpcError("the IPC document has no valid 'nbytes' and 'tensors'; ask the sidecar for a new one")
    for t in table:
        ok = isinstance(t, dict) and isinstance(t.get("name"), str) and t.get("dtype") in ITEMSIZE
        shape, offset, nbytes = (t.get("shape"), t.get("offset"), t.get("nbytes")) if ok else (None, None, None)
        ok = ok and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        ok = ok and type(offset) is int and type(nbytes) is int and 0 <= offset and offset + nbytes <= total
        ok = ok and nbytes == math.prod(shape) * ITEMSIZE[t["dtype"]] and offset % ITEMSIZE[t["dtype"]] == 0
        if not ok:
            raise IpcError(
                f"the IPC document's tensor entry {t!r:.200} does not fit its {total}-byte arena (offset, "
                "size, dtype and shape must agree); the document is damaged: ask the sidecar for a new one"
            )


def _import_checked(doc: dict[str, Any], *, private: bool = False) -> dict[str, torch.Tensor]:
    import torch

    kind = doc.get("kind")
    if kind == "cuda":
        c = doc["cuda"]
        device = _device_by_uuid(c["device_uuid"])
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(
                device,
                _unb64(c["handle"]),
                c["size"],
                c["offset"],
                _unb64(c["ref_counter_handle"]),
                c["ref_counter_offset"],
                _unb64(c["event_handle"]) if c["event_handle"] else b"",
                c["event_sync_required"],
            )
        dev = torch.device("cuda", device)
    elif kind == "cuda-ipc":
        c = doc["cuda_ipc"]
        handle = _unb64(c["handle"])
        if len(handle) != ctypes.sizeof(_CUipcMemHandle):
            raise IpcError(
                f"the CUDA IPC handle is {len(handle)} bytes, not {ctypes.sizeof(_CUipcMemHandle)}; "
                "the document is damaged: ask the sidecar for a new one"
            )
        device = _device_by_uuid(c["device_uuid"])
        dev = torch.device("cuda", device)
        with torch.cuda.device(device):
            torch.empty(0, device=dev)  # the device's primary context, current on this thread
            arena = torch.as_tensor(_IpcMapping(handle, c["size"], device), device=dev)
        storage = None
    elif private:  # "cpu", copy-on-write
        c = doc["cpu"]
        arena, storage = _map_private(_unb64(c["handle"]), c["size"]), None
        dev = torch.device("cpu")
    else:  # "cpu" (import_rank checked the kind)
        c = doc["cpu"]
        storage = torch.UntypedStorage._new_shared_filename_cpu(_unb64(c["manager"]), _unb64(c["handle"]), c["size"])
        dev = torch.device("cpu")
    if storage is not None:
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


_SHM_DIR = "/dev/shm"


def _map_private(handle: bytes, size: int) -> torch.Tensor:
    """The shared-memory object ``handle`` (a POSIX shm name, as torch's shm manager makes them) mapped
    copy-on-write, as a uint8 tensor that keeps the mapping alive."""
    import mmap

    import torch

    name = handle.decode("ascii", "replace")
    if not name.startswith("/") or "/" in name[1:] or name in ("/", "/.", "/.."):
        raise IpcError(f"the shared-memory name {name!r} is not a plain POSIX shm name; the document is damaged")
    path = _SHM_DIR + name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise IpcError(
            f"cannot open the exporter's shared memory {path!r} ({e.strerror}); the sidecar no longer "
            "holds it, or this process cannot see its /dev/shm: ask the sidecar for a new document"
        ) from None
    try:
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        # torch's refcounted shared memory keeps a small header (the reference count) in front of the
        # bytes: the data is the file's last ``size`` bytes.
        have = os.fstat(fd).st_size
        lead = have - size
        if not 0 <= lead <= mmap.PAGESIZE:
            raise IpcError(
                f"the exporter's shared memory {path!r} has {have} bytes, the document says {size}; "
                "ask the sidecar for a new document"
            )
        mm = mmap.mmap(fd, have, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8, offset=lead, count=size)  # holds ``mm`` until the last view goes


def _device_by_uuid(uuid: str) -> int:
    import torch

    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise IpcError(
        f"the exporter's GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); run the engine on the same GPU"
    )
