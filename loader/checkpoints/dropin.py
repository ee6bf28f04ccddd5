"""``gdsload.save`` / ``gdsload.load``: drop-ins for ``torch.save`` / ``torch.load``, compressed.

``save`` pickles the object as ``torch.save`` does (pickle protocol 2, every tensor storage a persistent id, so views,
strides, shared storage, Parameters and any object torch.save takes come back as they were), but each storage's bytes
go into a tensor file (:mod:`.tensorfile`), compressed where they live: CUDA storages on their GPU, CPU storages with
Zstd on every core; the pickle is one more entry. Every entry carries checksums, checked on load.

``load`` unpickles with torch's ``weights_only`` unpickler by default: the same safety as
``torch.load(weights_only=True)`` and the same allow-list (``torch.serialization.add_safe_globals``);
``weights_only=False`` unpickles anything, for files you trust. ``map_location`` works as in ``torch.load``. With
``into`` (an object of the same structure, e.g. ``{"model": model.state_dict(), ...}``) every saved tensor whose
counterpart there has its dtype and shape is decoded straight into that tensor's memory, and the returned object
holds the existing tensors themselves. ``load`` also opens ``torch.save`` files (through ``torch.load``) and files of
:func:`~gdsload.loader.checkpoints.container.save_compressed_checkpoint`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .encode import dtype_name, encode, resolve_codec
from .reader import Slot, TensorFile
from .tensorfile import Planned, TensorFileWriter
from ..config import format_bytes
from ..errors import CheckpointError, CheckpointTypeError, ConfigError

__all__ = ["OBJECT_KEY", "SaveReport", "save", "load"]

log = logging.getLogger(__name__)

OBJECT_KEY = "gdsload.object"
_PICKLE = "pickle"
_PROTOCOL = 2
"""torch.save's pickle protocol, the one torch's weights_only unpickler reads."""

MapLocation = str | torch.device | Mapping[str, str] | Callable[..., Any] | None


@dataclass(frozen=True)
class SaveReport:
    """What :func:`save` wrote."""

    path: str
    storages: int
    logical_bytes: int
    stored_bytes: int
    file_bytes: int
    encode_seconds: float
    """The calling thread's time compressing (and copying compressed bytes off GPUs)."""
    write_seconds: float
    """The writer thread's time writing, and the header's write."""
    seconds: float
    writer: str

    @property
    def ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def summary(self) -> str:
        return (
            f"saved {self.path!r}: {format_bytes(self.logical_bytes)} in {self.storages} storages -> "
            f"{format_bytes(self.stored_bytes)} (ratio {self.ratio:.3f}) in {self.seconds:.3f} s; encode "
            f"{self.encode_seconds:.3f} s, write {self.write_seconds:.3f} s ({self.writer})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


def _path(f: Any, what: str) -> Path:
    if isinstance(f, (str, os.PathLike)):
        return Path(os.fspath(f))
    raise ConfigError(
        f"{what}: f={f!r} must be a path (str or os.PathLike); gdsload writes files in place with "
        "a rename, which a file object does not allow (use torch.save for buffers)"
    )


# --------------------------------------------------------------------------- save


def _pickle(obj: Any) -> tuple[bytes, dict[str, tuple[torch.UntypedStorage, torch.dtype, str, int]]]:
    """``obj`` pickled as torch.save pickles it, and its storages by key: (storage, dtype, location, numel)."""
    from torch.serialization import location_tag, normalize_storage_type

    storages: dict[str, tuple[torch.UntypedStorage, torch.dtype, str, int]] = {}
    keys: dict[int, str] = {}
    dtypes: dict[int, torch.dtype] = {}

    def persistent_id(o: Any) -> tuple[Any, ...] | None:
        if not (isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o)):
            return None
        if isinstance(o, torch.storage.TypedStorage):
            storage, dtype = o._untyped_storage, o.dtype
            kind, numel = getattr(torch, o._pickle_storage_type()), o._size()
        else:
            storage, dtype = o, torch.uint8
            kind, numel = normalize_storage_type(type(o)), o.nbytes()
        if storage.device.type != "meta" and storage.data_ptr() != 0:
            seen = dtypes.setdefault(storage.data_ptr(), dtype)
            if seen != dtype:
                raise CheckpointTypeError(
                    f"the object holds tensors or storages that view the same memory as "
                    f"{seen} and {dtype}, which torch.save cannot store either; save a copy "
                    "of one (t.clone())"
                )
        key = keys.setdefault(storage._cdata, str(len(keys)))
        location = location_tag(storage)
        storages[key] = (storage, dtype, location, numel)
        return ("storage", kind, key, location, numel)

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            return persistent_id(o)

    buf = io.BytesIO()
    try:
        Pickler(buf, protocol=_PROTOCOL).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise CheckpointTypeError(
            f"the object cannot be pickled ({type(e).__name__}: {e}); gdsload.save stores what torch.save stores"
        ) from e
    return buf.getvalue(), storages


def _storage_tensor(storage: torch.UntypedStorage, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A storage's bytes as a 1-D tensor of its dtype (uint8 where its size is not a whole number of them)."""
    if numel * dtype.itemsize != storage.nbytes():
        dtype, numel = torch.uint8, storage.nbytes()
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (numel,), (1,))


def save(
    obj: Any,
    f: str | os.PathLike[str],
    *,
    codec: str = "auto",
    planes: bool = True,
    min_gain: float = 0.02,
    writer: str = "auto",
) -> SaveReport:
    """Save ``obj`` (anything ``torch.save`` takes) to the file ``f``, compressed, atomically.

    ``codec``: ``"auto"`` (ANS on GPUs where nvCOMP runs, Zstd on the CPU), ``"zstd"`` (Zstd everywhere: the file
    loads on any host), ``"ans"`` or ``"none"``. ``planes``: split floating-point tensors into byte planes before
    Zstd (smaller files). Tensors under 64 KiB, or that shrink by less than ``min_gain``, are stored raw. The file
    is written beside ``f`` and renamed into place: a failure leaves a previous file at ``f`` untouched. ``f`` may
    not end in ``.safetensors`` (``torch.load`` would hand it to the safetensors library, which reads no pickle);
    ``torch.load`` of the file otherwise stops with an error naming ``gdsload.load``.

    >>> import gdsload
    >>> gdsload.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 10}, "ckpt.pt")  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    path = _path(f, "gdsload.save")
    codec = resolve_codec(codec)
    if not isinstance(min_gain, (int, float)) or not 0 <= min_gain < 1:
        raise ConfigError(f"min_gain={min_gain!r} must be a number in [0, 1)")
    if path.is_dir():
        raise ConfigError(f"gdsload.save: {str(path)!r} is a directory; name a file in it")
    if path.suffix == ".safetensors":
        raise ConfigError(
            f"gdsload.save: {str(path)!r} ends in '.safetensors', and torch.load hands such names to "
            "the safetensors library, which would return the compressed bytes as tensors; name it as "
            f"a torch.save file, e.g. {str(path.with_suffix('.pt'))!r}"
        )
    data, storages = _pickle(obj)
    table: dict[str, dict[str, Any]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for key, (storage, dtype, location, numel) in storages.items():
        entry = f"storages/{key}"
        table[key] = {
            "entry": entry,
            "dtype": dtype_name(dtype),
            "numel": numel,
            "nbytes": storage.nbytes(),
            "location": location,
        }
        if storage.device.type == "meta":
            table[key]["entry"] = None
            continue
        tensors[entry] = _storage_tensor(storage, dtype, numel)
    pickled = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    tensors[_PICKLE] = pickled
    planned = [
        Planned(name, t.numel() * t.element_size(), dtype_name(t.dtype), tuple(t.shape), codec != "none")
        for name, t in tensors.items()
    ]
    kind = {
        OBJECT_KEY: json.dumps(
            {"version": 1, "torch": torch.__version__, "protocol": _PROTOCOL, "pickle": _PICKLE, "storages": table},
            separators=(",", ":"),
        )
    }
    encode_s = 0.0
    stored = 0
    with TensorFileWriter(path, planned, kind, writer=writer, guard=True) as w:
        for name, t in sorted(tensors.items(), key=lambda kv: -kv[1].numel() * kv[1].element_size()):
            s = encode(t, codec, name=name, planes=planes, min_gain=min_gain)
            encode_s += s.seconds
            stored += s.data.nbytes
            w.add(name, s, s.meta(t))
    assert w.stats is not None
    report = SaveReport(
        str(path),
        len(storages),
        sum(t.numel() * t.element_size() for t in tensors.values()),
        w.stats.stored_bytes,
        w.stats.file_bytes,
        encode_s,
        w.stats.write_seconds,
        time.perf_counter() - t0,
        w.stats.writer,
    )
    log.info("%s", report.summary())
    return report


# --------------------------------------------------------------------------- load


def _restore(location: str, map_location: MapLocation, path: str) -> torch.device:
    """Where a storage saved at ``location`` goes (``map_location`` a device, a name or a dict of names)."""
    target: Any = location
    if isinstance(map_location, Mapping):
        target = map_location.get(location, location)
    elif isinstance(map_location, (str, torch.device)):
        target = map_location
    try:
        dev = torch.device(target)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"gdsload.load({path!r}): map_location gives {target!r} for storages saved on "
            f"{location!r}, which is not a device"
        ) from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise CheckpointError(
                f"gdsload.load({path!r}): storages saved on {location!r} would go to {str(dev)!r}, "
                f"and this host has {count} CUDA device(s); pass map_location='cpu' (or a device "
                "it has)"
            )
    elif dev.type not in ("cpu", "meta"):
        raise ConfigError(f"gdsload.load({path!r}): device {str(dev)!r} is not 'cpu', 'cuda[:N]' or 'meta'")
    return dev


def _unpickle(data: bytes, persistent_load: Callable[[Any], Any], weights_only: bool, path: str) -> Any:
    if weights_only:
        import torch._weights_only_unpickler as safe

        unpickler: Any = safe.Unpickler(io.BytesIO(data), encoding="utf-8")
    else:
        from torch.serialization import StorageType

        class Unpickler(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> Any:
                if type(name) is str and "Storage" in name:
                    try:
                        return StorageType(name)
                    except KeyError:
                        pass
                return super().find_class(module, name)

        unpickler = Unpickler(io.BytesIO(data), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    try:
        result = unpickler.load()
    except pickle.UnpicklingError as e:
        if not weights_only:
            raise
        raise CheckpointTypeError(
            f"gdsload.load({path!r}) with weights_only=True refused the object: {e}. If you trust the file, pass "
            "weights_only=False, or allow that class with torch.serialization.add_safe_globals([...])"
        ) from None
    torch._utils._validate_loaded_sparse_tensors()
    return result


def _pairs(
    saved: Any, into: Any, keys: tuple[Any, ...] = ()
) -> list[tuple[tuple[Any, ...], torch.Tensor, torch.Tensor]]:
    """(keys, saved tensor, existing tensor) wherever the two objects hold a tensor at the same place."""
    out = []
    if isinstance(saved, torch.Tensor):
        if isinstance(into, torch.Tensor):
            out.append((keys, saved, into))
    elif isinstance(saved, Mapping) and isinstance(into, Mapping):
        for k, v in saved.items():
            if k in into:
                out += _pairs(v, into[k], (*keys, k))
    elif isinstance(saved, (list, tuple)) and isinstance(into, (list, tuple)):
        for i, (a, b) in enumerate(zip(saved, into)):
            out += _pairs(a, b, (*keys, i))
    return out


def _at(keys: tuple[Any, ...]) -> str:
    return "object" + "".join(f"[{k!r}]" for k in keys)


def _substitute(obj: Any, into: Any) -> Any:
    """``obj`` with every tensor replaced by ``into``'s tensor at the same place (filled already)."""
    if isinstance(obj, torch.Tensor):
        return into if isinstance(into, torch.Tensor) else obj
    if isinstance(obj, dict) and isinstance(into, Mapping):
        for k in obj:
            if k in into:
                obj[k] = _substitute(obj[k], into[k])
        return obj
    if isinstance(obj, list) and isinstance(into, (list, tuple)):
        obj[: len(into)] = [_substitute(a, b) for a, b in zip(obj, into)]
        return obj
    if isinstance(obj, tuple) and isinstance(into, (list, tuple)) and type(obj) is tuple:
        return tuple(_substitute(a, b) for a, b in zip(obj, into)) + obj[len(into) :]
    return obj


def _storage_info(pid: Any) -> tuple[str, torch.dtype]:
    from torch.serialization import _maybe_decode_ascii

    if not isinstance(pid, tuple) or len(pid) != 5 or _maybe_decode_ascii(pid[0]) != "storage":
        raise CheckpointError(f"the pickle names a persistent object {pid!r:.100}, which gdsload.save never writes")
    kind, key = pid[1], _maybe_decode_ascii(pid[2])
    return key, (torch.uint8 if kind is torch.UntypedStorage else kind.dtype)


def load(
    f: str | os.PathLike[str], map_location: MapLocation = None, *, weights_only: bool = True, into: Any = None
) -> Any:
    """Load what :func:`save` saved, bit for bit (``torch.load``'s arguments mean the same here).

    ``into``: an object of the same structure whose tensors are filled in place (see the module's doc). Also opens
    ``torch.save`` files (handed to ``torch.load``) and :func:`save_compressed_checkpoint` files.

    >>> import gdsload
    >>> state = gdsload.load("ckpt.pt", map_location="cpu")  # doctest: +SKIP
    >>> model.load_state_dict(state["model"])  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    path = _path(f, "gdsload.load")
    where = str(path)
    if not path.is_file():
        raise CheckpointError(
            f"gdsload.load: {where!r} does not exist" if not path.exists() else f"gdsload.load: {where!r} is not a file"
        )
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head == b"PK\x03\x04":  # a torch.save archive
        if into is not None:
            raise ConfigError(
                f"gdsload.load({where!r}): into= works on files gdsload.save wrote; this one is a torch.save archive"
            )
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    if head[:1] != b"X":  # not the length gdsload.save gives its headers: save_compressed_checkpoint's file?
        from .container import CHECKPOINT_KEY, load_compressed_checkpoint
        from ..format.safetensors import read_header

        if CHECKPOINT_KEY in read_header(path).metadata:
            if into is not None or not isinstance(map_location, (str, torch.device, type(None))):
                raise ConfigError(
                    f"gdsload.load({where!r}): a save_compressed_checkpoint file takes map_location as "
                    "a device only, and no into="
                )
            return load_compressed_checkpoint(path, map_location)
    with TensorFile(path, OBJECT_KEY, what="gdsload.save file") as tf:
        return _load_open(tf, where, map_location, weights_only, into, t0)


def _load_open(tf: TensorFile, where: str, map_location: MapLocation, weights_only: bool, into: Any, t0: float) -> Any:
    table = tf.kind.get("storages")
    if not isinstance(table, dict) or not isinstance(tf.kind.get("pickle"), str):
        raise CheckpointError(f"{where!r}: __metadata__[{OBJECT_KEY!r}] lacks its storage table; the file is corrupt")
    data = tf.read_bytes(tf[tf.kind["pickle"]])

    def info(key: str) -> tuple[Slot | None, dict[str, Any]]:
        spec = table.get(key)
        if not isinstance(spec, dict):
            raise CheckpointError(f"{where!r}: the pickle names storage {key!r}, which the file lacks; it is corrupt")
        return (tf[spec["entry"]] if spec.get("entry") is not None else None), spec

    # With into: a first pass on meta storages finds which saved tensors have a counterpart there.
    direct: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, tuple[Any, ...]]] = []
    if into is not None:
        metas: dict[int, str] = {}

        def meta_load(pid: Any) -> Any:
            key, dtype = _storage_info(pid)
            slot, spec = info(key)
            storage = torch.UntypedStorage(int(spec["nbytes"]), device="meta")
            metas[storage._cdata] = key
            return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

        skeleton = _unpickle(data, meta_load, weights_only, where)
        for keys, saved, have in _pairs(skeleton, into):
            if (saved.dtype, saved.shape) != (have.dtype, have.shape):
                raise CheckpointError(
                    f"gdsload.load({where!r}, into=...): {_at(keys)} is {saved.dtype}{list(saved.shape)} "
                    f"in the file but {have.dtype}{list(have.shape)} in into"
                )
            key = metas[saved.untyped_storage()._cdata]
            whole = (
                saved.storage_offset() == 0
                and saved.is_contiguous()
                and saved.numel() * saved.element_size() == saved.untyped_storage().nbytes()
            )
            owns = (
                have.is_contiguous()
                and have.storage_offset() == 0
                and have.untyped_storage().nbytes() == have.numel() * have.element_size()
            )
            if whole and owns and key not in direct:
                direct[key] = have
            else:
                copies.append((have, keys))

    # Every storage's memory, then one read of them all (decoded in parallel, checksums checked).
    made: dict[str, torch.UntypedStorage] = {}
    jobs: list[tuple[Slot, torch.Tensor]] = []
    later: list[tuple[str, str, Callable[..., Any]]] = []
    for key in table:
        slot, spec = info(key)
        location, nbytes = str(spec["location"]), int(spec["nbytes"])
        if key in direct:
            made[key] = direct[key].untyped_storage()
            dst = direct[key]
        elif callable(map_location) and not isinstance(map_location, (str, torch.device, Mapping)):
            dst = torch.empty(nbytes, dtype=torch.uint8)
            made[key] = dst.untyped_storage()
            later.append((key, location, map_location))
        else:
            dev = _restore(location, map_location, where)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            made[key] = dst.untyped_storage()
        if slot is not None and dst.device.type != "meta":
            jobs.append((slot, dst))
    tf.read(jobs)
    for key, location, fn in later:  # as torch.load: map_location(storage, location), None for the default
        moved = fn(made[key], location)
        if moved is None:
            dev = _restore(location, None, where)
            moved = torch.empty(0, dtype=torch.uint8).set_(made[key]).to(dev).untyped_storage()
        made[key] = moved if isinstance(moved, torch.UntypedStorage) else moved.untyped()

    def persistent_load(pid: Any) -> Any:
        key, dtype = _storage_info(pid)
        if key not in made:
            raise CheckpointError(f"{where!r}: the pickle names storage {key!r}, which the file lacks; it is corrupt")
        return torch.storage.TypedStorage(wrap_storage=made[key], dtype=dtype, _internal=True)

    result = _unpickle(data, persistent_load, weights_only, where)
    if into is not None:
        for have, keys in copies:
            found = _find(result, keys)
            if found is not have:
                have.copy_(found)
        result = _substitute(result, into)
    seconds = time.perf_counter() - t0
    logical = sum(int(s["nbytes"]) for s in table.values())
    log.info(
        "loaded %r: %s in %d storages in %.3f s (%d filled in place)",
        where,
        format_bytes(logical),
        len(table),
        seconds,
        len(direct),
    )
    return result


def _find(obj: Any, keys: tuple[Any, ...]) -> Any:
    for k in keys:
        obj = obj[k]
    return obj
