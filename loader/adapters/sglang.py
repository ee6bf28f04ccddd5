"""SGLang: a loader class for ``load_format``, and live weight updates via ``update_weights_from_tensor``.

**Loading.** SGLang takes a model-loader *class* as ``load_format`` (``get_model_loader``
instantiates it with the ``LoadConfig``); options come from ``model_loader_extra_config``::

    import sglang
    from gdsload.loader.adapters import sglang as gds
    engine = sglang.Engine(model_path="/models/llama-tp2", tp_size=2, load_format=gds.loader_class(),
                           model_loader_extra_config={"backend": "auto"})

The loader builds the model as SGLang's loaders do and then follows the same plan as the vLLM
adapter (SGLang's model classes share vLLM's parameter names): a ``vllm``-layout directory for
exactly this tp is copied into ``model.state_dict()`` by name — after quantization
post-processing, as SGLang's ``ShardedStateLoader`` does, since such a state dict was saved
post-processed; an unsharded HF directory goes through ``model.load_weights(iterator)`` and is
post-processed afterwards, as SGLang's ``DefaultModelLoader`` does.

**Live updates.** :func:`update_weights_from_tensors` pushes a rank's tensors into a running
``sglang.Engine`` with ``update_weights_from_tensor(load_format="direct")`` in bounded buckets
(the KV cache is flushed once, after the last bucket). ``direct`` copies by exact parameter name
and shape (``model.named_parameters()``: fused names, per-rank shapes), so feed it a
``vllm``-layout rank; :func:`update_weights_per_rank` gives each TP rank its own tensors.

Checked against SGLang's source (``python/sglang/srt/model_loader/loader.py``: ``BaseModelLoader``,
``get_model_loader``, ``DefaultModelLoader.load_weights_and_postprocess``, ``ShardedStateLoader``;
``srt/entrypoints/engine.py`` ``Engine.update_weights_from_tensor``;
``srt/model_executor/model_runner.py`` ``update_weights_from_tensor``,
``_model_load_weights_direct``, ``LocalSerializedTensor``); re-checked against the main branch at
commit 005cbe0 (``get_model_loader(load_config, model_config=None)`` instantiates a class given as
``load_format``; ``load_model(*, model_config, device_config)``; ``_initialize_model`` takes the
quantization config; loaders that bypass ``model.load_weights`` call ``_post_load_weights``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ConfigError, GdsloadError
from .base import (
    AdapterOptions,
    EngineNotInstalledError,
    InjectError,
    InjectReport,
    LayoutError,
    Target,
    Weights,
    collect_weights,
    compare,
    import_engine,
)
from .vllm import load_into_model, choose_route

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "EngineUpdateError",
    "load_model_weights",
    "bucketize",
    "update_weights_from_tensors",
    "update_weights_per_rank",
    "loader_class",
]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 << 20
"""Bytes per ``update_weights_from_tensor`` call: large enough to amortize the RPC, small enough to bound memory."""


class EngineUpdateError(GdsloadError, RuntimeError):
    """A running engine refused a weight update."""


def load_model_weights(
    model: nn.Module,
    path: str | os.PathLike[str] | None,
    *,
    rank: int,
    tp_size: int,
    options: AdapterOptions | None = None,
    process_weights: Callable[[nn.Module], None] = lambda model: None,
    post_load: Callable[[nn.Module], None] | None = None,
) -> InjectReport:
    """Load rank ``rank``'s weights into an SGLang-built ``model``; ``process_weights`` runs quantization post-processing.

    Pre-sharded (``sharded_state``) directories hold post-processed state dicts, so
    ``process_weights`` runs before the copy; HF checkpoints are processed after ``load_weights``.
    A pre-sharded load bypasses ``model.load_weights``, so it then runs the model's own post-load
    step, as SGLang's loaders that bypass it do (``post_load``; by default ``model.post_load_weights()``
    where the model has one).

    >>> load_model_weights(model, "/models/llama-tp2", rank=0, tp_size=2)  # doctest: +SKIP
    """
    options = options or AdapterOptions()
    route = choose_route(path, rank=rank, tp_size=tp_size, options=options, engine="SGLang")
    if route.kind == "sharded_state":
        process_weights(model)
        report = load_into_model(model, path, rank=rank, tp_size=tp_size, options=options, engine="sglang", route=route)
        (post_load or _model_post_load)(model)
        return report
    report = load_into_model(model, path, rank=rank, tp_size=tp_size, options=options, engine="sglang", route=route)
    process_weights(model)
    return report


def _model_post_load(model: nn.Module) -> None:
    hook = getattr(model, "post_load_weights", None)
    if callable(hook):
        hook()


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_bytes`` (a larger tensor goes alone).

    >>> [len(b) for b in bucketize([("a", torch.ones(4)), ("b", torch.ones(4)), ("c", torch.ones(8))], 32)]
    [2, 1]
    """
    pairs = list(named)
    sizes = [(str(i), t.numel() * t.element_size()) for i, (_, t) in enumerate(pairs)]  # by position: names may repeat
    for positions in _group(sizes, bucket_bytes):
        yield [pairs[int(i)] for i in positions]


def _group(sizes: Iterable[tuple[str, int]], limit: int) -> Iterator[list[str]]:
    if limit < 1:
        raise ConfigError(f"bucket_bytes={limit!r} must be positive")
    bucket: list[str] = []
    total = 0
    for name, n in sizes:
        if bucket and total + n > limit:
            yield bucket
            bucket, total = [], 0
        bucket.append(name)
        total += n
    if bucket:
        yield bucket


def _expected_targets(expected: nn.Module | Mapping[str, Sequence[int]]) -> dict[str, Target]:
    if isinstance(expected, nn.Module):
        return {n: Target(tuple(p.shape), p.dtype) for n, p in expected.named_parameters()}
    return {n: Target(tuple(shape)) for n, shape in expected.items()}


def _push(
    engine: Any,
    named: list[tuple[str, Any]],
    sizes: Mapping[str, int],
    *,
    load_format: str | None,
    bucket_bytes: int,
    flush_cache: bool,
) -> int:
    buckets = list(_group(((n, sizes[n]) for n, _ in named), bucket_bytes))
    values = dict(named)
    for i, names in enumerate(buckets):
        result = engine.update_weights_from_tensor(
            named_tensors=[(n, values[n]) for n in names],
            load_format=load_format,
            flush_cache=flush_cache and i == len(buckets) - 1,
        )
        ok, message = _result(result)
        if not ok:
            shown = ", ".join(map(repr, names[:6])) + (f", ... ({len(names)} tensors)" if len(names) > 6 else "")
            raise EngineUpdateError(
                f"SGLang refused weight bucket {i + 1}/{len(buckets)} ({shown}): {message}; with "
                f"load_format={load_format!r} names and shapes must equal the engine model's named_parameters() "
                "(fused names, per-rank shapes) — buckets before this one were applied"
            )
    return len(buckets)


def _result(result: Any) -> tuple[bool, str]:
    if result is None:
        return True, ""
    if isinstance(result, Mapping):
        return bool(result.get("success", True)), str(result.get("message", ""))
    if isinstance(result, (tuple, list)) and result:
        return bool(result[0]), str(result[1]) if len(result) > 1 else ""
    return bool(result), ""


def _check(
    tensors: Mapping[str, torch.Tensor],
    expected: nn.Module | Mapping[str, Sequence[int]] | None,
    engine: Any,
    strict: bool,
) -> InjectReport:
    if expected is None:
        report = InjectReport(engine="sglang", model=type(engine).__name__, loaded=list(tensors))
        report.bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return report
    report = compare(tensors, _expected_targets(expected), engine="sglang", model=type(engine).__name__)
    report.missing = []  # a live update may refresh any subset of the parameters
    if not report.ok:
        msg = (
            f"update for {type(engine).__name__}: {len(report.unexpected)} unknown names "
            f"({', '.join(map(repr, report.unexpected[:8]))}) and {len(report.mismatched)} shape mismatches "
            f"({', '.join(map(str, report.mismatched[:4]))}); direct updates need the engine's parameter names "
            "and per-rank shapes (a vllm-layout rank)"
        )
        if strict:
            raise InjectError(msg, report)
        log.warning("%s; sending only the matching tensors", msg)
    return report


def update_weights_from_tensors(
    engine: Any,
    weights: Weights,
    *,
    load_format: str | None = "direct",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    flush_cache: bool = True,
    expected: nn.Module | Mapping[str, Sequence[int]] | None = None,
    strict: bool = True,
) -> InjectReport:
    """Push ``weights`` into a running ``sglang.Engine`` (every TP rank receives the same tensors).

    Calls ``engine.update_weights_from_tensor(named_tensors, load_format, flush_cache)`` once per
    bucket of at most ``bucket_bytes``, flushing the cache after the last. ``expected`` (the
    engine's parameter names and shapes, or a module with them) checks names and shapes before
    anything is sent.

    >>> engine = sglang.Engine(model_path="/models/llama", load_format=loader_class())  # doctest: +SKIP
    >>> update_weights_from_tensors(engine, load_rank("/ckpt/step-2000-tp1-vllm", 0, device="cuda"))  # doctest: +SKIP
    """
    start = time.perf_counter()
    tensors = collect_weights(weights)
    report = _check(tensors, expected, engine, strict)
    named = [(n, tensors[n]) for n in report.loaded]
    sizes = {n: t.numel() * t.element_size() for n, t in named}
    buckets = _push(engine, named, sizes, load_format=load_format, bucket_bytes=bucket_bytes, flush_cache=flush_cache)
    report.seconds = time.perf_counter() - start
    log.info("%s buckets=%d", report.summary(), buckets)
    return report


def update_weights_per_rank(
    engine: Any,
    ranks: Sequence[Weights],
    *,
    load_format: str | None = "direct",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    flush_cache: bool = True,
) -> InjectReport:
    """Push per-rank tensors into a running TP engine: rank ``r`` of the engine receives ``ranks[r]``.

    Each tensor travels as SGLang's ``LocalSerializedTensor`` (one serialized handle per rank;
    CUDA tensors go by IPC handle, not by value). Every rank must hold the same names.

    >>> update_weights_per_rank(engine, [load_rank(d, r, device=f"cuda:{r}") for r in range(2)])  # doctest: +SKIP
    """
    start = time.perf_counter()
    per_rank = [collect_weights(w) for w in ranks]
    if not per_rank:
        raise ConfigError("ranks is empty; give one weights mapping per tensor-parallel rank")
    names = list(per_rank[0])
    for r, tensors in enumerate(per_rank[1:], start=1):
        if set(tensors) != set(names):
            diff = sorted(set(tensors) ^ set(names))
            raise LayoutError(
                f"rank {r} and rank 0 hold different tensor names (e.g. {diff[:6]}); "
                "per-rank updates need the same names on every rank"
            )
    local, serializer = _sglang_serialization()
    named = [(n, local(values=[serializer.serialize(t[n]) for t in per_rank])) for n in names]
    sizes = {n: per_rank[0][n].numel() * per_rank[0][n].element_size() for n in names}
    buckets = _push(engine, named, sizes, load_format=load_format, bucket_bytes=bucket_bytes, flush_cache=flush_cache)
    report = InjectReport(
        engine="sglang",
        model=type(engine).__name__,
        loaded=names,
        bytes=sum(sizes.values()) * len(per_rank),
        seconds=time.perf_counter() - start,
    )
    log.info("%s ranks=%d buckets=%d", report.summary(), len(per_rank), buckets)
    return report


def _sglang_serialization() -> tuple[Any, Any]:
    import_engine("sglang", "sglang", "per-rank SGLang weight updates")
    local = serializer = None
    for module in (
        "sglang.srt.model_executor.model_runner",
        "sglang.srt.weight_sync.utils",
        "sglang.srt.model_executor.model_runner_components.weight_updater",
    ):
        try:
            local = getattr(
                import_engine(module, "sglang", "per-rank SGLang weight updates"), "LocalSerializedTensor", None
            )
        except ImportError:
            continue
        if local is not None:
            break
    for module in ("sglang.srt.utils", "sglang.srt.utils.common"):
        try:
            serializer = getattr(
                import_engine(module, "sglang", "per-rank SGLang weight updates"), "MultiprocessingSerializer", None
            )
        except ImportError:
            continue
        if serializer is not None:
            break
    if local is None or serializer is None:
        raise EngineNotInstalledError(
            "this SGLang has no LocalSerializedTensor / MultiprocessingSerializer where gdsload looks for them; "
            "per-rank updates need an SGLang release with update_weights_from_tensor and LocalSerializedTensor"
        )
    try:  # CUDA tensors must pickle by device UUID, as SGLang's own senders arrange
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        pass
    else:
        monkey_patch_torch_reductions()
    return local, serializer


# ---------------------------------------------------------------------------------------------
# The SGLang loader class, built on first use so that importing this module never imports SGLang.


@functools.cache
def loader_class() -> type:
    """The SGLang model-loader class to pass as ``load_format`` (imports SGLang).

    >>> sglang.Engine(model_path="/models/llama", load_format=loader_class())  # doctest: +SKIP
    """
    loader = import_engine("sglang.srt.model_loader.loader", "sglang", "the gdsload SGLang loader")

    class GdsloadSGLangLoader(loader.BaseModelLoader):  # type: ignore[name-defined,misc]
        """SGLang load format backed by gdsload: pre-sharded ranks by state-dict name, or HF via load_weights."""

        def __init__(self, load_config: Any):
            super().__init__(load_config)
            extra = getattr(load_config, "model_loader_extra_config", None) or None
            self.options = AdapterOptions.from_mapping(extra, where="model_loader_extra_config")

        def download_model(self, model_config: Any) -> None:
            path = model_config.model_path
            if self.options.sidecar_url is None and not os.path.exists(path):
                raise LayoutError(
                    f"the gdsload SGLang loader reads local directories only and {path!r} is not one; "
                    "download the model first, or give sidecar_url to map it from a sidecar"
                )

        def load_model(self, *, model_config: Any, device_config: Any, **kwargs: Any) -> nn.Module:
            from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
            from sglang.srt.model_loader.utils import set_default_torch_dtype

            self.download_model(model_config)
            target = torch.device(device_config.device)
            # SGLang of 2025 and later resolves the quantization config in the loader and passes it in;
            # earlier releases resolved it inside _initialize_model.
            quant_config = getattr(loader, "_get_quantization_config", None)
            extra = () if quant_config is None else (quant_config(model_config, self.load_config),)
            with set_default_torch_dtype(model_config.dtype):
                with target:
                    model = loader._initialize_model(model_config, self.load_config, *extra)
                load_model_weights(
                    model,
                    model_config.model_path,
                    rank=get_tensor_model_parallel_rank(),
                    tp_size=get_tensor_model_parallel_world_size(),
                    options=self.options,
                    process_weights=functools.partial(_process_quantized, loader, target=target),
                    post_load=getattr(loader, "_post_load_weights", None),
                )
            return model.eval()

    GdsloadSGLangLoader.__module__ = __name__
    GdsloadSGLangLoader.__qualname__ = "GdsloadSGLangLoader"
    return GdsloadSGLangLoader


def _process_quantized(loader: Any, model: nn.Module, *, target: torch.device) -> None:
    """SGLang's post-load step: each module's ``quant_method.process_weights_after_loading`` on the target device."""
    context = getattr(loader, "device_loading_context", None)
    for _, module in model.named_modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is None:
            continue
        if context is None:
            quant_method.process_weights_after_loading(module)
        else:
            with context(module, target):
                quant_method.process_weights_after_loading(module)


def __getattr__(name: str) -> Any:
    if name == "GdsloadSGLangLoader":
        return loader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
