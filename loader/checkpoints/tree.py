"""Training state <-> (tensors, JSON skeleton): the part of checkpoints that never touches a file.

``Flattener`` walks a model/optimizer state tree and names every tensor; everything else goes
into a strict-JSON skeleton (no pickle). ``Rebuilder`` turns the skeleton and the loaded tensors
back into the tree, with the original Python types.
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..dtypes import from_torch
from ..errors import CheckpointError, CheckpointTypeError

__all__ = ["Leaf", "Flattener", "Rebuilder", "state_of"]


# --------------------------------------------------------------------------- state tree -> skeleton


@dataclass
class Leaf:
    name: str
    tensor: torch.Tensor
    """Detached, conjugate and negative bits resolved; on its original device."""
    dtype: str
    where: str

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class Flattener:
    """Turns a state tree into a JSON skeleton and a list of uniquely named tensors."""

    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self._names: set[str] = set()
        self._views: dict[tuple[Any, ...], str] = {}
        self._open: set[int] = set()

    def node(self, value: Any, parts: list[str], where: str) -> Any:
        kind = type(value)
        if value is None or kind is bool or kind is int or kind is str:
            return value
        if kind is float:
            return value if math.isfinite(value) else {"f64": struct.pack("<d", value).hex()}
        if isinstance(value, torch.Tensor):
            return self._tensor(value, parts, where)
        if kind in (list, tuple, dict, OrderedDict):
            if id(value) in self._open:
                raise CheckpointTypeError(f"{where} contains itself; a checkpoint stores trees, not cycles")
            self._open.add(id(value))
            try:
                if kind is list or kind is tuple:
                    items = [self.node(v, [*parts, str(i)], f"{where}[{i}]") for i, v in enumerate(value)]
                    return {kind.__name__: items}
                pairs = [
                    [self._key(k, where), self.node(v, [*parts, str(k)], f"{where}[{k!r}]")] for k, v in value.items()
                ]
                out: dict[str, Any] = {"odict" if kind is OrderedDict else "dict": pairs}
                meta = getattr(value, "_metadata", None)  # what Module.state_dict() attaches
                if meta is not None:
                    out["_metadata"] = self.node(meta, [*parts, "_metadata"], f"{where}._metadata")
                return out
            finally:
                self._open.discard(id(value))
        if kind is np.ndarray:
            return self._ndarray(value, parts, where)
        if isinstance(value, np.generic) and value.dtype.kind in "biufc":
            return {"npscalar": value.dtype.str, "hex": value.tobytes().hex()}
        raise CheckpointTypeError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}, which a checkpoint cannot store without pickle; "
            "store None, bool, int, float, str, list, tuple, dict, torch.Tensor or numeric numpy values "
            "(convert it, e.g. to a dict of numbers, or leave it out)"
        )

    def _key(self, key: Any, where: str) -> Any:
        kind = type(key)
        if key is None or kind is bool or kind is int or kind is str:
            return key
        if kind is float:
            return key if math.isfinite(key) else {"f64": struct.pack("<d", key).hex()}
        if kind is tuple:
            return {"tuple": [self._key(k, where) for k in key]}
        raise CheckpointTypeError(
            f"{where} has the key {key!r} of type {kind.__qualname__}; dict keys must be str, int, float, bool, "
            "None or tuples of these"
        )

    def _tensor(self, t: torch.Tensor, parts: list[str], where: str) -> dict[str, Any]:
        kind = type(t)
        if kind is not torch.Tensor and kind is not torch.nn.Parameter:
            raise CheckpointTypeError(
                f"{where} is a {kind.__module__}.{kind.__qualname__}, a tensor subclass that cannot be rebuilt "
                "without pickle; store a plain tensor (for a DTensor: .full_tensor() or .to_local())"
            )
        if t.layout != torch.strided:
            raise CheckpointTypeError(f"{where} is a {t.layout} tensor; store t.to_dense() instead")
        if t.is_quantized:
            raise CheckpointTypeError(f"{where} is a quantized tensor; store t.int_repr() and its scales instead")
        if t.device.type not in ("cpu", "cuda"):
            raise CheckpointTypeError(
                f"{where} is on device {str(t.device)!r}; a checkpoint stores CPU and CUDA tensors "
                "(meta tensors hold no data) — move it with .cpu()"
            )
        try:
            dtype = from_torch(t.dtype)
        except TypeError:
            raise CheckpointTypeError(
                f"{where} has dtype {t.dtype}, which safetensors cannot store; convert it "
                f"(e.g. .to(torch.float64), or .view() as an integer type) or leave it out"
            ) from None
        key = None
        if t.numel():
            key = (
                str(t.device),
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
                t.dtype,
                t.is_conj(),
                t.is_neg(),
            )
        name = self._views.get(key) if key is not None else None
        if name is None:
            data = t.detach()
            data = data.resolve_conj() if data.is_conj() else data
            data = data.resolve_neg() if data.is_neg() else data
            name = self._unique("/".join(parts))
            self.leaves.append(Leaf(name, data, dtype, where))
            if key is not None:
                self._views[key] = name
        node: dict[str, Any] = {"tensor": name}
        if kind is torch.nn.Parameter:
            node["parameter"] = True
        if t.requires_grad:
            node["requires_grad"] = True
        return node

    def _ndarray(self, a: np.ndarray, parts: list[str], where: str) -> dict[str, Any]:
        if a.dtype.kind not in "biufc":
            raise CheckpointTypeError(
                f"{where} is a numpy array of dtype {a.dtype}; only bool and numeric arrays can be stored "
                "(convert it, e.g. strings to a list of str)"
            )
        raw = torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8).copy())
        name = self._unique("/".join(parts))
        self.leaves.append(Leaf(name, raw, "U8", where))
        return {"ndarray": name, "dtype": a.dtype.str, "shape": list(a.shape)}

    def _unique(self, base: str) -> str:
        name, n = base, 1
        while name in self._names:
            name, n = f"{base}#{n}", n + 1
        self._names.add(name)
        return name


def state_of(obj: Any, kind: type, what: str) -> Any:
    if obj is None or isinstance(obj, Mapping):
        return obj
    if isinstance(obj, kind):
        return obj.state_dict()
    raise CheckpointTypeError(
        f"{what} must be a {kind.__module__}.{kind.__qualname__}, its state_dict() or None; "
        f"got {type(obj).__module__}.{type(obj).__qualname__}"
    )


# --------------------------------------------------------------------------- skeleton -> state tree


class Rebuilder:
    """Turns a skeleton back into the state tree, given the loaded tensors by name."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], path: str):
        self.tensors = tensors
        self.path = path
        self._params: dict[str, torch.nn.Parameter] = {}
        self._grad_aliases: dict[str, torch.Tensor] = {}

    def build(self, node: Any, where: str) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        try:
            if type(node) is not dict:
                raise TypeError(f"unexpected {type(node).__name__}")
            if "tensor" in node:
                return self._tensor(node)
            for kind in ("list", "tuple"):
                if kind in node:
                    items = [self.build(v, f"{where}[{i}]") for i, v in enumerate(node[kind])]
                    return items if kind == "list" else tuple(items)
            for kind in ("dict", "odict"):
                if kind in node:
                    out: dict[Any, Any] = OrderedDict() if kind == "odict" else {}
                    for k, v in node[kind]:
                        key = self.build(k, where)
                        out[key] = self.build(v, f"{where}[{key!r}]")
                    if "_metadata" in node:
                        meta = self.build(node["_metadata"], f"{where}._metadata")
                        out._metadata = meta  # type: ignore[attr-defined]
                    return out
            if "f64" in node:
                return struct.unpack("<d", bytes.fromhex(node["f64"]))[0]
            if "ndarray" in node:
                raw = self.tensors[node["ndarray"]].cpu().numpy().tobytes()
                return np.frombuffer(raw, dtype=np.dtype(node["dtype"])).reshape(node["shape"]).copy()
            if "npscalar" in node:
                return np.frombuffer(bytes.fromhex(node["hex"]), dtype=np.dtype(node["npscalar"]))[0]
            raise KeyError(f"no known tag among {sorted(node)}")
        except CheckpointError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, struct.error) as e:
            raise CheckpointError(
                f"{self.path!r}: the checkpoint skeleton is corrupt at {where} ({type(e).__name__}: {e}); "
                "re-save the checkpoint"
            ) from None

    def _tensor(self, node: dict[str, Any]) -> torch.Tensor:
        name = node["tensor"]
        t = self.tensors[name]
        if node.get("parameter"):
            if name not in self._params:
                self._params[name] = torch.nn.Parameter(t, requires_grad=bool(node.get("requires_grad")))
            return self._params[name]
        if not node.get("requires_grad"):
            return t
        # A tensor saved once may be reached both with and without requires_grad (w and w.detach()):
        # the ones that want it share one alias of its memory; the stored tensor itself stays as it was.
        if name not in self._grad_aliases:
            self._grad_aliases[name] = t.detach().requires_grad_(True)
        return self._grad_aliases[name]
