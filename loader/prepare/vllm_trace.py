"""What each rank of vLLM holds, asked of vLLM's own model code: ``python vllm_trace.py REQUEST.json OUT.json``.

For every global rank of a (tensor × pipeline × expert)-parallel layout this script builds that rank's model
with the installed vLLM — on the CPU, in one process, under stand-ins for vLLM's parallel groups — and runs
the model's own ``load_weights`` over the source checkpoint's tensors. The tensors it feeds hold no data
(the meta device; small ones are read for real), and every write of the weight loaders into the model's
state is recorded instead of done: *this region of parameter P comes from this strided view of source
tensor S*, *this region is filled with 0*. The recipes it prints (JSON) are exactly vLLM's placement —
fused projections, padded vocabularies, replicated KV heads, experts of an expert-parallel rank, the layers
of a pipeline stage, buffers the attention layers register — without a rule written per architecture.

How it stays exact and cheap:

- **Construction.** The model is built as vLLM builds it, with one change: large uninitialised
  allocations (``torch.empty`` of more than :data:`META_BYTES`) land on the meta device, so a rank of any
  size takes a few MB. Everything else — buffers, expert maps, rotary caches — is real, so construction
  code that looks at values runs unchanged, and an entry no checkpoint fills (e.g. ``attn._k_scale``)
  keeps the value vLLM gives it.
- **Loading.** A dispatch mode intercepts ``copy_``, ``fill_`` and ``zero_`` into the model's state. The
  source side of a copy is a view of a source tensor (its storage is the source's), or a copy-like
  operation of one (``clone``, ``to``), which is followed as the same view; a small source is real, so
  values computed from it are recorded as constants. Any other write into the state, or a copy from
  something computed out of a large source, stops the trace with the operation's name (never a guess).
- **State.** The entries are those of ``model.state_dict()`` after vLLM's ``sharded_state`` filter (one
  entry per piece of memory), so the recipes name exactly the tensors vLLM's ``sharded_state`` loader asks
  for. An entry is checked to be fully written (by the loaders, or by construction); a parameter the
  checkpoint leaves unfilled is an error, as in vLLM's default loader.
- **FP8.** With ``fp8`` requested, the model is built from the checkpoint's config plus a
  ``quantization_config`` (``hf_overrides``). Copies of a bf16/fp16/fp32 source into an fp8 parameter are
  marked ``fp8`` (quantize with that source's scale); a second pass feeds one synthetic
  ``<weight>_scale`` per quantized source — scalar per tensor, or one per output channel — so vLLM's own
  scale loaders place the scales (``op: scale``).

This file imports only the standard library, torch and vLLM (never gdsload), so it runs in any
interpreter that has vLLM, e.g. another virtual environment's (``gdsload shard --vllm-python``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

FORMAT = 1
"""Version of the request and result documents."""

META_BYTES = 1 << 20
"""Uninitialised allocations larger than this are made on the meta device while the model is built."""

SMALL_SOURCE_BYTES = 1 << 16
"""Source tensors up to this size are read for real (weight loaders may look at their values)."""

_ST_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}
_FLOAT_SOURCES = ("F16", "BF16", "F32")


class TraceError(Exception):
    """The weight loaders did something this trace cannot represent; the message names the operation and tensors."""


def _torch_dtype(st: str) -> Any:
    import torch

    return getattr(torch, _ST_DTYPES[st])


def _st_dtype(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    for st, torch_name in _ST_DTYPES.items():
        if torch_name == name:
            return st
    raise TraceError(f"the model holds a tensor of dtype {name}, which safetensors cannot store")


def _key(t: Any) -> int:
    """Identity of a tensor's storage (views share it; the meta device keeps it too)."""
    return t.untyped_storage()._cdata


def _geometry(t: Any) -> list[Any]:
    return [t.storage_offset(), list(t.shape), list(t.stride())]


def _written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments an ATen operation writes to (its schema's mutable aliases)."""
    import torch

    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        out.extend(v for v in values if isinstance(v, torch.Tensor))
    return out


# ----------------------------------------------------------------------------------- the parallel groups


class _ProcessGroupStandIn:
    """Answers what model code asks of a process group while it is built (its size, this rank)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _group(name: str, groups: list[list[int]], rank: int) -> Any:
    """A vLLM ``GroupCoordinator`` for ``rank``'s group among ``groups``, with no communication behind it."""
    import torch
    from vllm.distributed import parallel_state as ps

    ranks = next(g for g in groups if rank in g)
    g = object.__new__(ps.GroupCoordinator)
    g.unique_name = f"{name}:stand-in"
    g.rank, g.local_rank, g.device_index = rank, 0, 0
    g.ranks, g.group_ranks = ranks, groups
    g.world_size, g.rank_in_group = len(ranks), ranks.index(rank)
    g.torch_distributed_backend = "gloo"
    g.cpu_group = g.device_group = _ProcessGroupStandIn(len(ranks), ranks.index(rank))
    g.device = torch.device("cpu")
    g.use_device_communicator, g.device_communicator, g.mq_broadcaster = False, None, None
    return g


def _set_groups(tp: int, pp: int, tp_rank: int, pp_rank: int, is_moe: bool) -> int:
    """Install stand-ins for every group vLLM's model code consults; returns the global rank.

    The ranks are numbered as vLLM numbers them (``initialize_model_parallel``: DP x PP x PCP x TP, tensor
    parallel innermost); data, context and decode-context parallel are 1.
    """
    import torch
    from vllm.distributed import parallel_state as ps

    world = tp * pp
    every = torch.arange(world).reshape(1, 1, pp, 1, tp)
    rank = pp_rank * tp + tp_rank

    def groups(t: Any, size: int) -> list[list[int]]:
        return [x.tolist() for x in t.reshape(-1, size).unbind(0)]

    ps._WORLD = _group("world", [list(range(world))], rank)
    ps._TP = _group("tp", groups(every, tp), rank)
    ps._ETP = ps._TP
    ps._DCP = _group("dcp", groups(every, 1), rank)
    ps._PCP = _group("pcp", groups(every.transpose(3, 4), 1), rank)
    ps._PP = _group("pp", groups(every.transpose(2, 4), pp), rank)
    ps._DP = _group("dp", groups(every.transpose(1, 4), 1), rank)
    ps._EP = _group("ep", groups(every.transpose(1, 2), tp), rank) if is_moe else None
    return rank


# ------------------------------------------------------------------------------------------ construction


_MODES: dict[str, Any] = {}


def _modes() -> tuple[Any, Any]:
    """The two dispatch modes (construction, then loading), defined on first use: importing this module imports
    no torch."""
    if not _MODES:
        from torch.utils._python_dispatch import TorchDispatchMode

        _MODES["construction"] = type("_Construction", (_ConstructionMixin, TorchDispatchMode), {})
        _MODES["trace"] = type("_Trace", (_TraceMixin, TorchDispatchMode), {})
    return _MODES["construction"], _MODES["trace"]


class _ConstructionMixin:
    """While the model is built: large ``empty`` allocations on the meta device, and what each storage got.

    ``state[key]`` is ``"fresh"`` (allocated empty, never written), ``"filled"`` (a meta storage only
    filled with constants, kept in ``fills``), or ``"opaque"`` (a meta storage written some other way: its
    values are lost). Storages absent from ``state`` hold real values.
    """

    def __init__(self) -> None:
        super().__init__()
        self.keep: dict[int, Any] = {}
        self.state: dict[int, str] = {}
        self.fills: dict[int, list[list[Any]]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        import torch

        aten = torch.ops.aten
        kwargs = dict(kwargs or {})
        if func in (aten.empty.memory_format, aten.empty_strided.default):
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            if math.prod(args[0]) * dtype.itemsize > META_BYTES:
                kwargs["device"] = torch.device("meta")
            out = func(*args, **kwargs)
            self.keep[_key(out)] = out
            self.state[_key(out)] = "fresh"
            return out
        for t in _written_tensors(func, args, kwargs):
            k = _key(t)
            if k not in self.state:
                continue
            if t.is_meta and func in (aten.fill_.Scalar, aten.zero_.default):
                value = float(args[1]) if func is aten.fill_.Scalar else 0.0
                self.fills.setdefault(k, []).append([*_geometry(t), value])
                self.state[k] = "filled" if self.state[k] in ("fresh", "filled") else "opaque"
            elif t.is_meta:
                self.state[k] = "opaque"
            else:
                del self.state[k]
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------- loading


_VIEWS = None


def _view_ops() -> frozenset[Any]:
    global _VIEWS
    if _VIEWS is None:
        import torch

        aten = torch.ops.aten
        _VIEWS = frozenset(
            {
                aten.slice.Tensor,
                aten.select.int,
                aten.view.default,
                aten._unsafe_view.default,
                aten.t.default,
                aten.transpose.int,
                aten.permute.default,
                aten.detach.default,
                aten.alias.default,
                aten.unsqueeze.default,
                aten.squeeze.dim,
                aten.squeeze.dims,
                aten.squeeze.default,
                aten.expand.default,
                aten.split.Tensor,
                aten.split_with_sizes.default,
                aten.chunk.default,
                aten.narrow.default,
                aten.unbind.int,
                aten.as_strided.default,
                aten.reshape.default,
                aten.unflatten.int,
                aten.flatten.using_ints,
                aten.view_as.default,
                aten.expand_as.default,
                aten.movedim.int,
            }
        )
    return _VIEWS


class _TraceMixin:
    """While ``load_weights`` runs: records the writes into the model's state instead of doing them."""

    def __init__(self, entries: dict[int, str], sources: dict[int, str]):
        super().__init__()
        self.entries = entries  # storage key -> a state-dict name on it (for messages)
        self.sources = sources  # storage key -> source tensor name
        self.records: list[dict[str, Any]] = []
        self.derived: dict[int, str] = {}  # storage key -> the operation that computed it from a large source
        self.filled: dict[int, list[tuple[list[Any], float, int]]] = {}  # source key -> (geometry, value, numel)
        self.keep: list[Any] = []
        self.current = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        import torch

        aten = torch.ops.aten
        kwargs = dict(kwargs or {})
        if func is aten.copy_.default:
            return self._copy(args[0], args[1])
        if func in (aten.fill_.Scalar, aten.zero_.default, aten.fill_.Tensor):
            dst = args[0]
            if _key(dst) in self.entries or _key(dst) in self.sources:
                value = args[1] if len(args) > 1 else 0.0
                if isinstance(value, torch.Tensor):
                    if value.is_meta:
                        raise TraceError(f"{self.current}: a fill with a value computed from a source tensor")
                    value = value.item()
                if _key(dst) in self.entries:
                    self.records.append({"key": _key(dst), "dst": _geometry(dst), "fill": float(value)})
                else:  # a loader blanks (part of) the tensor it was given, then copies it: those copies are fills
                    self.filled.setdefault(_key(dst), []).append((_geometry(dst), float(value), dst.numel()))
                return dst
        written = _written_tensors(func, args, kwargs)
        for t in written:
            if _key(t) in self.entries:
                raise TraceError(
                    f"{self.current}: {func} writes into {self.entries[_key(t)]!r}; only copies and "
                    "fills of the model's state can be recorded"
                )
            if _key(t) in self.sources:
                raise TraceError(f"{self.current}: {func} changes source tensor {self.sources[_key(t)]!r} in place")
        from_source = [
            a for a in _flat_tensors(args, kwargs) if a.is_meta and (_key(a) in self.sources or _key(a) in self.derived)
        ]
        if from_source and func in (aten.clone.default, aten._to_copy.default, aten.lift_fresh_copy.default):
            # A copy of a source (dtype or layout changed): the same elements, so followed as the same view.
            # A later ``copy_`` converts the dtype exactly as the copy would have.
            return args[0].detach()
        out = func(*args, **kwargs)
        if from_source and func not in _view_ops():
            for t in _flat_tensors((out,), {}):
                if t.is_meta:
                    self.derived[_key(t)] = str(func)
                    self.keep.append(t)
        return out

    def _copy(self, dst: Any, src: Any) -> Any:
        import torch

        k = _key(dst)
        if k not in self.entries:  # into a temporary: followed only where it holds real values
            if dst.is_meta or src.is_meta and (_key(src) in self.sources or _key(src) in self.derived):
                self.derived[k] = "a copy of a source tensor into a temporary"
                self.keep.append(dst)
                return dst
            return dst.copy_(src)
        src = torch.broadcast_to(src, dst.shape)
        s = _key(src)
        if s in self.filled:
            value = self._filled_value(s, src)
            if value is not None:
                self.records.append({"key": k, "dst": _geometry(dst), "fill": value})
                return dst
        if s in self.sources:
            self.records.append(
                {
                    "key": k,
                    "dst": _geometry(dst),
                    "src": self.sources[s],
                    "view": _geometry(src),
                    "src_dtype": _st_dtype(src.dtype),
                    "dst_dtype": _st_dtype(dst.dtype),
                }
            )
        elif not src.is_meta:
            value = src.to(dst.dtype).contiguous()
            self.records.append(
                {"key": k, "dst": _geometry(dst), "const": _encode(value), "dst_dtype": _st_dtype(dst.dtype)}
            )
        else:
            how = self.derived.get(s, "an operation this trace does not follow")
            raise TraceError(
                f"{self.current}: {self.entries[k]!r} is written from a tensor made by {how} from a "
                "source tensor; the placement cannot be recorded as views of the source"
            )
        return dst

    def _filled_value(self, key: int, src: Any) -> float | None:
        """The constant a loader filled the region ``src`` reads with (that whole source, or exactly that view);
        None where nothing was filled; :class:`TraceError` for a read that mixes filled and unfilled elements."""
        for geometry, value, numel in reversed(self.filled[key]):
            whole = geometry[0] == 0 and numel == src.untyped_storage().nbytes() // src.element_size()
            if whole or geometry == _geometry(src):
                return value
        raise TraceError(
            f"{self.current}: a copy reads part of a source tensor its loader filled in place; the "
            "placement cannot be recorded"
        )


def _flat_tensors(args: Any, kwargs: dict[str, Any]) -> Iterator[Any]:
    import torch

    for v in [*args, *kwargs.values()]:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))


def _encode(t: Any) -> str:
    import torch

    raw = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0).view(torch.uint8)
    return base64.b64encode(bytes(raw.numpy())).decode()


# -------------------------------------------------------------------------------------------- the result


def _kept_entries(state: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``sharded_state`` filter: of state-dict tensors over the same memory keep the one covering the
    most, among identical spans the smallest name (storages compared by identity: meta tensors have no address).
    """
    groups: dict[int, list[tuple[str, Any]]] = {}
    for name, t in state.items():
        if t.numel():
            groups.setdefault(_key(t), []).append((name, t))

    def span(t: Any) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.storage_offset() * t.element_size(), (t.storage_offset() + last + 1) * t.element_size()

    kept = {}
    for group in groups.values():
        for name, t in group:
            a, b = span(t)
            covered = False
            for other, o in group:
                if other == name or not o.is_contiguous():
                    continue
                a2, b2 = span(o)
                if a < a2 or b2 < b:
                    continue
                if a2 < a or b < b2 or not t.is_contiguous() or other < name:
                    covered = True
                    break
            if not covered:
                kept[name] = t
    return kept


def _covered(parts: list[dict[str, Any]], numel: int, limit: int = 1 << 22) -> int | None:
    """Elements of a ``numel``-element entry that ``parts`` write (None: too many runs to count)."""
    runs: list[tuple[int, int]] = []
    for p in parts:
        offset, sizes, strides = p["dst"]
        if 0 in sizes:
            continue
        dims = [(n, s) for n, s in zip(sizes, strides) if n > 1]
        inner = 1
        while dims and dims[-1][1] == inner:  # fold the contiguous innermost dims into one run
            inner *= dims.pop()[0]
        starts = [offset]
        for n, s in dims:
            starts = [a + i * s for a in starts for i in range(n)]
            if len(runs) + len(starts) > limit:
                return None
        runs.extend((a, a + inner) for a in starts)
    runs.sort()
    total, end = 0, 0
    for a, b in runs:
        a, b = max(a, end, 0), min(b, numel)
        if b > a:
            total += b - a
            end = b
    return total


def _rank_entries(model: Any, built: Any, trace: Any, where: str) -> list[dict[str, Any]]:
    state = model.state_dict()
    kept = _kept_entries(state)
    by_storage: dict[int, list[tuple[str, Any]]] = {}
    for name, t in kept.items():
        by_storage.setdefault(_key(t), []).append((name, t))
    parts: dict[str, list[dict[str, Any]]] = {name: [] for name in kept}
    for rec in trace.records:
        offset, sizes, strides = rec["dst"]
        last = offset + sum((n - 1) * s for n, s in zip(sizes, strides)) if all(sizes) else offset
        for name, t in by_storage.get(rec["key"], ()):
            start = t.storage_offset()
            if start <= offset and last < start + t.numel():
                part = {k: v for k, v in rec.items() if k != "key"}
                part["dst"] = [offset - start, sizes, strides]
                parts[name].append(part)
                break
    entries = []
    for name, t in kept.items():
        if not t.is_contiguous():
            raise TraceError(f"{where}: state-dict entry {name!r} is not contiguous; it cannot be a file's tensor")
        k = _key(t)
        state_of = built.state.get(k)
        mine = parts[name]
        done = _covered(mine, t.numel())
        if done is None:  # too many runs to union: trust the element count of what was written
            done = min(t.numel(), sum(math.prod(p["dst"][1]) for p in mine))
        entry: dict[str, Any] = {
            "name": name,
            "dtype": _st_dtype(t.dtype),
            "shape": list(t.shape),
            "init": None,
            "parts": mine,
        }
        if done < t.numel():
            if state_of is None:  # real values from construction underneath what the loaders write
                entry["init"] = _encode(t.detach().to("cpu"))
            elif state_of == "filled":
                start = t.storage_offset()
                fills = [
                    {"dst": [off - start, sizes, strides], "fill": value}
                    for off, sizes, strides, value in built.fills[k]
                ]
                entry["parts"] = fills + mine
                if (_covered(entry["parts"], t.numel()) or t.numel()) < t.numel():
                    raise TraceError(
                        f"{where}: {name!r} is partly never written (neither by the weight loaders nor at construction)"
                    )
            else:
                what = "none" if not mine else f"{done} of {t.numel()} elements"
                raise TraceError(
                    f"{where}: the weight loaders fill {what} of {name!r} {list(t.shape)} and construction gives it no "
                    "value; the checkpoint lacks this tensor (vLLM's own loader would fail the same way: "
                    "'weights were not initialized from checkpoint')"
                )
        entries.append(entry)
    return entries


def _scale_name(source: str) -> str:
    return source[: -len(".weight")] + ".weight_scale" if source.endswith(".weight") else source + "_scale"


def _meta_source(dtype: str, shape: list[int]) -> Any:
    import torch

    return torch.empty(shape, dtype=_torch_dtype(dtype), device="meta")


def _read_small(path: str, offsets: list[int], dtype: str, shape: list[int]) -> Any:
    import torch

    start, stop = offsets
    with open(path, "rb") as f:
        f.seek(start)
        raw = bytearray(f.read(stop - start))
    if len(raw) != stop - start:
        raise TraceError(f"{path!r}: the file ends before its tensors do; the source changed while it was read")
    t = torch.frombuffer(raw, dtype=_torch_dtype(dtype)) if raw else torch.empty(0, dtype=_torch_dtype(dtype))
    return t.reshape(shape)


def _load(model: Any, cfg: Any, trace: Any, weights: list[tuple[str, Any]], arch: str) -> None:
    from vllm.config import set_current_vllm_config

    def stream() -> Iterator[tuple[str, Any]]:
        for name, t in weights:
            trace.current = f"tensor {name!r}"
            yield name, t

    try:
        with trace, set_current_vllm_config(cfg):
            model.load_weights(stream())
    except TraceError:
        raise
    except Exception as e:  # vLLM's loaders raise what they raise; say where
        raise TraceError(
            f"vLLM's {arch}.load_weights failed at {trace.current or 'the start'}: {type(e).__name__}: {e}"
        ) from e


def trace(request: dict[str, Any]) -> dict[str, Any]:
    """Every requested rank's entries (see the module docstring); ``request`` as :func:`main` reads it."""
    import torch
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    tp, pp, ep = request["tp"], request["pp"], request["ep"]
    args = EngineArgs(
        model=request["source"],
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enable_expert_parallel=ep > 1,
        expert_placement_strategy=request.get("expert_placement", "linear"),
        dtype=request.get("dtype", "auto"),
        hf_overrides=request.get("hf_overrides") or {},
        trust_remote_code=request.get("trust_remote_code", False),
        enforce_eager=True,
        max_model_len=128,
        skip_tokenizer_init=True,
        load_format="dummy",
        seed=0,
    )
    cfg = args.create_engine_config()
    arch = cfg.model_config.architecture
    scale_shape = request.get("fp8_scales")  # None, "tensor" or "channel"
    tensors = request["tensors"]
    shapes = {name: shape for name, _, shape, _, _ in tensors}
    result: dict[str, Any] = {
        "format": FORMAT,
        "vllm_version": vllm.__version__,
        "architecture": arch,
        "dtype": _st_dtype(cfg.model_config.dtype),
        "ranks": {},
    }
    wanted = request.get("ranks") or list(range(tp * pp))
    # Every rank's model stays alive until the trace ends: vLLM caches facts about a model by ``id(model)`` (which
    # layers a pipeline stage lacks), and a later rank's model could otherwise get an earlier one's id, and with it
    # the wrong stage's missing layers.
    models: list[Any] = []
    for rank in wanted:
        tp_rank, pp_rank = rank % tp, rank // tp
        _set_groups(tp, pp, tp_rank, pp_rank, cfg.model_config.is_moe)
        cfg.compilation_config.static_forward_context.clear()
        construction, tracing = _modes()
        built = construction()
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"), built:
            model = initialize_model(vllm_config=cfg)
        state = model.state_dict()
        entries_by_key: dict[int, str] = {}
        for name, t in state.items():
            entries_by_key.setdefault(_key(t), name)
        weights: list[tuple[str, Any]] = []
        sources: dict[int, str] = {}
        for name, dtype, shape, path, offsets in tensors:
            small = math.prod(shape) * torch.empty(0, dtype=_torch_dtype(dtype)).element_size() <= SMALL_SOURCE_BYTES
            t = _read_small(path, offsets, dtype, shape) if small else _meta_source(dtype, shape)
            sources[_key(t)] = name
            weights.append((name, t))
        where = f"rank {rank} (tensor-parallel rank {tp_rank}, pipeline stage {pp_rank})"
        tracer = tracing(entries_by_key, sources)
        _load(model, cfg, tracer, weights, arch)
        quantized: dict[str, list[int]] = {}
        for rec in tracer.records:
            if "src" in rec and rec["dst_dtype"].startswith("F8") and rec["src_dtype"] in _FLOAT_SOURCES:
                if scale_shape is None:
                    raise TraceError(
                        f"{where}: vLLM builds {entries_by_key[rec['key']]!r} as {rec['dst_dtype']} "
                        f"from {rec['src']!r} ({rec['src_dtype']}) without fp8 being asked for"
                    )
                rec["op"] = "fp8"
                quantized[rec["src"]] = shapes[rec["src"]]
        if quantized:  # the scales: synthetic checkpoint tensors, placed by vLLM's own scale loaders
            scales = {}
            synthetic = []
            for src, shape in quantized.items():
                t = _meta_source("F32", [] if scale_shape == "tensor" else [shape[0], 1])
                scales[_key(t)] = src
                synthetic.append((_scale_name(src), t))
            scale_trace = tracing(entries_by_key, scales)
            _load(model, cfg, scale_trace, synthetic, arch)
            for rec in scale_trace.records:
                if "src" in rec:
                    rec["op"] = "scale"
            tracer.records.extend(scale_trace.records)
        result["ranks"][str(rank)] = {
            "tp_rank": tp_rank,
            "pp_rank": pp_rank,
            "entries": _rank_entries(model, built, tracer, where),
        }
        models.append(model)
        del model, state, tracer
    return result


def main(argv: list[str] | None = None) -> int:
    """``vllm_trace.py REQUEST.json OUT.json``: exit 0 with the result written, 2 with ``{"error": ...}`` written."""
    argv = sys.argv[1:] if argv is None else argv
    request_path, out_path = argv
    with open(request_path) as f:
        request = json.load(f)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    start = time.perf_counter()
    try:
        if request.get("format") != FORMAT:
            raise TraceError(f"request format {request.get('format')!r}; this script reads {FORMAT}")
        result = trace(request)
        code = 0
    except TraceError as e:
        result, code = {"error": str(e), "kind": "trace"}, 2
    except ImportError as e:
        result, code = {"error": f"{type(e).__name__}: {e}", "kind": "import"}, 2
    except Exception as e:  # vLLM's configuration refuses the model or the layout: its own words
        result = {"error": f"{type(e).__name__}: {e}", "kind": "vllm", "traceback": traceback.format_exc(limit=8)}
        code = 2
    result["seconds"] = time.perf_counter() - start
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)
    return code


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
