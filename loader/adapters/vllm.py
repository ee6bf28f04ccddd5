"""vLLM: load format ``gdsload``, registered in every vLLM process through a plugin entry point.

Install gdsload next to vLLM and start it with ``--load-format gdsload``; options go through
``--model-loader-extra-config`` (see :class:`~gdsload.loader.adapters.base.AdapterOptions`)::

    vllm serve /models/llama-tp2 --tensor-parallel-size 2 --load-format gdsload \\
        --model-loader-extra-config '{"sidecar_url": "http://127.0.0.1:8471", "token_file": "/run/gdsload/token"}'

The package declares the entry point ``[project.entry-points."vllm.general_plugins"]
gdsload = "gdsload.loader.adapters.vllm:register"``; vLLM calls :func:`register` in the API
process and in every worker, which registers :class:`GdsloadModelLoader` as load format
``gdsload`` (a ``BaseModelLoader`` subclass, built lazily so this module imports without vLLM).

What the loader does, per worker (global rank ``r`` = pipeline stage x tensor-parallel size +
tensor-parallel rank, as vLLM numbers its workers):

- ``vllm`` layout (vLLM's own parameter names and per-rank shapes, what ``save_sharded_state``
  and ``gdsload shard --layout vllm`` write), sharded for exactly this tensor x pipeline layout (and
  expert parallel on or off as the engine runs): rank ``r``'s tensors go into ``model.state_dict()`` by name, with vLLM's sharded_state rules — tensors that
  share memory with another state-dict entry are not targets, and a parameter larger than its
  checkpoint tensor (LoRA padding) is written only in its leading part. Names and shapes are
  checked from the headers before anything is read; then the files are read (and decoded)
  straight into the parameters' own memory, with no arena and no second copy;
- ``hf`` layout at TP=1 (an ordinary checkpoint): ``model.load_weights(iterator)`` — vLLM's
  own weight loaders fuse q/k/v and gate/up and slice for each rank, so this also serves tp > 1
  (every worker reads the whole checkpoint, as vLLM's default loader does);
- anything else (``hf`` shards, another tp, TensorRT-LLM files) is a :class:`LayoutError` naming the fix.

With ``sidecar_url``, the rank's tensors are mapped from the sidecar (CUDA IPC on a GPU, shared
memory on CPU) instead of being read from storage again. A pre-sharded rank is **adopted**: each
parameter that matches its mapped tensor exactly takes the mapped memory as its storage (no
copy, one copy of the model per device), the rest are copied, and the report counts both
(``adopted=``, ``copied=``). The worker then holds the rank's lease for as long as it lives
(``GET /v1/ipc/{rank}/hold``): the sidecar keeps the memory, refuses a reload or unload unless
forced, and releases the lease when the engine exits. On CPU the mapping is copy-on-write, so
vLLM's own post-processing of weights never reaches the sidecar's copy, and the weights stay
valid if the sidecar goes away. On a GPU the memory is the sidecar's: a quantized model is copied
instead, and a worker whose lease the sidecar drops stops itself (SIGTERM) rather than compute
from memory that may be freed. ``{"adopt": false}`` copies everything and releases the lease after
the load, as an HF-layout directory always does (its weights go through ``model.load_weights``).

Checked against vLLM's source (``vllm/model_executor/model_loader/``: ``base_loader.py``,
``__init__.py`` ``register_model_loader``, ``sharded_state_loader.py``; ``vllm/plugins/__init__.py``;
``vllm/config/load.py``) and run by vLLM 0.32 itself in the test suite's engine tier (``tests/engine``).

Each worker logs one line through vLLM's logger, ``Loading weights took 0.41 seconds (gdsload): rank 0:
...``, with the backend, I/O mode, bytes and GB/s of the read; gdsload's own warnings go to vLLM's log.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..pipeline.config import LoadConfig
from ..errors import BackendUnavailableError, ConfigError
from .base import (
    AdapterOptions,
    CheckpointLayout,
    EngineNotInstalledError,
    InjectError,
    InjectReport,
    Injector,
    LayoutError,
    StateDictInjector,
    Target,
    Weights,
    _error_message,
    collect_weights,
    compare,
    describe_checkpoint,
    hold_for_adoption,
    import_engine,
    inject_held,
    open_rank,
)

__all__ = [
    "LOAD_FORMAT",
    "ShardedStateInjector",
    "LoadWeightsInjector",
    "LoadRoute",
    "choose_route",
    "load_into_model",
    "filter_shared_tensors",
    "loader_class",
    "register",
]

log = logging.getLogger(__name__)

LOAD_FORMAT = "gdsload"
"""The ``--load-format`` value the plugin registers."""


def filter_shared_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop state-dict entries whose memory another entry covers (tied weights, views of fused tensors).

    vLLM's sharded_state rule: of tensors over the same storage, keep the one covering the most
    memory; among identical spans keep the smallest name. Non-contiguous tensors never cover others.
    """
    groups: dict[tuple[torch.device, int], list[tuple[str, torch.Tensor]]] = collections.defaultdict(list)
    for name, t in state.items():
        if t.numel():
            groups[(t.device, t.untyped_storage().data_ptr())].append((name, t))

    def span(t: torch.Tensor) -> tuple[int, int]:
        """First and one-past-last byte the tensor touches (strides included: it may be non-contiguous)."""
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    kept: dict[str, torch.Tensor] = {}
    for group in groups.values():
        for name, t in group:
            start, end = span(t)
            covered = False
            for other, o in group:
                if other == name or not o.is_contiguous():
                    continue
                o_start, o_end = span(o)
                if not (o_start <= start and end <= o_end):
                    continue  # o does not contain t
                if (o_start, o_end) != (start, end) or not t.is_contiguous() or other < name:
                    covered = True  # o covers strictly more, or is the same span under a smaller name
                    break
            if not covered:
                kept[name] = t
    return kept


class ShardedStateInjector(StateDictInjector):
    """Copy a pre-sharded rank into ``model.state_dict()`` by name (vLLM/SGLang ``sharded_state`` semantics)."""

    engine = "vllm"
    allow_narrow = True
    fix = (
        "the directory must hold this model's per-rank state dict for this tensor-parallel size "
        "(vLLM's save_sharded_state, or `gdsload shard --layout vllm`), or pass strict=False"
    )

    adopt: bool | None = None
    """For tensors mapped from a sidecar (set by :func:`load_into_model`): True lets each parameter whose
    shape, dtype and device match take the mapped memory as its storage (``report.adopted``), the rest
    copied (``report.copied``); False copies all (counted); None (not a sidecar mapping) copies."""

    def __init__(self, model: nn.Module, *, engine: str = "vllm"):
        self.model = model
        self.engine = engine  # type: ignore[misc]
        self._state = filter_shared_tensors(model.state_dict())

    @property
    def model_name(self) -> str:
        return type(self.model).__name__

    def targets(self) -> Mapping[str, Target]:
        return {name: Target(tuple(t.shape), t.dtype) for name, t in self._state.items()}

    def _destination(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The part of the state-dict entry ``name`` a checkpoint tensor of ``shape`` fills (its leading part)."""
        dst = self._state[name]
        for dim, size in enumerate(shape):
            if size < dst.shape[dim]:
                dst = dst.narrow(dim, 0, size)
        return dst

    def apply(self, tensors: Mapping[str, torch.Tensor], report: InjectReport) -> int:
        narrowed = set(report.narrowed)
        owners = self._owners() if self.adopt else {}
        with torch.no_grad():
            for name, t in tensors.items():
                dst = self._destination(name, tuple(t.shape))
                if self.adopt and name not in narrowed and self._adopt(t, dst, owners):
                    report.adopted += 1
                    continue
                if self.adopt is not None:
                    report.copied += 1
                if name in narrowed:
                    log.debug(
                        "%r: checkpoint %s into parameter %s (leading part only)",
                        name,
                        list(t.shape),
                        list(self._state[name].shape),
                    )
                if dst.dtype != t.dtype:
                    log.warning("%r: checkpoint dtype %s into parameter dtype %s (converted)", name, t.dtype, dst.dtype)
                dst.copy_(t)
        return 0

    def _owners(self) -> dict[int, list[tuple[nn.Module, str, torch.Tensor, bool]]]:
        """Every parameter and buffer by the address of its storage: ``(module, attribute, tensor, is_parameter)``."""
        out: dict[int, list[tuple[nn.Module, str, torch.Tensor, bool]]] = collections.defaultdict(list)
        for module in self.model.modules():
            for table, is_param in ((module._parameters, True), (module._buffers, False)):
                for attr, t in table.items():
                    if t is not None and t.numel():
                        out[t.untyped_storage().data_ptr()].append((module, attr, t, is_param))
        return out

    @staticmethod
    def _adopt(
        t: torch.Tensor, dst: torch.Tensor, owners: Mapping[int, list[tuple[nn.Module, str, torch.Tensor, bool]]]
    ) -> bool:
        """Make the parameter (or buffer) behind ``dst`` use ``t``'s memory; False where only a copy is right.

        Adopted only when ``t`` is exactly what the parameter is (shape, dtype, device, strides) and
        the parameter owns its storage alone (buffers, which engines update in place, only on CPU, where
        the mapping is private): a storage shared with other tensors (fused or tied
        views of one allocation under different objects) keeps its memory and is copied into. One
        Parameter object under several names (tied weights) is adopted once, for all of them. The
        Parameter objects stay (``param.data`` is swapped), with the attributes vLLM set on them.
        """
        if (
            t.dtype != dst.dtype
            or t.shape != dst.shape
            or t.device != dst.device
            or not t.is_contiguous()
            or dst.stride() != t.stride()
        ):
            return False
        storage = dst.untyped_storage()
        if dst.data_ptr() != storage.data_ptr() or storage.nbytes() != dst.numel() * dst.element_size():
            return False
        group = owners.get(storage.data_ptr(), [])
        if not group or len({id(o[2]) for o in group}) != 1:
            return False
        module, attr, obj, is_param = group[0]
        if is_param:
            obj.data = t
        elif t.device.type == "cpu":  # buffers change in place (scales, statistics): only a private mapping may
            for m, a, _, _ in group:
                m._buffers[a] = t
        else:
            return False
        return True

    def load(
        self, path: str | os.PathLike[str], rank: int, *, options: AdapterOptions, device: torch.device
    ) -> tuple[InjectReport, str]:
        """Read rank ``rank`` of ``path`` straight into the parameters; returns the report and the load's summary.

        Names and shapes are checked from the headers first, so a strict mismatch raises before any
        byte is read. Every tensor whose destination is the parameter itself (same dtype, and
        contiguous, as vLLM's own parameters are) is read, or decoded, into it: no arena and no
        second copy. The rest (a dtype vLLM converts, a LoRA-padded parameter filled in its
        leading part where that part is not contiguous) loads into a small arena and is copied.
        """
        from ..format.discovery import discover
        from ..dtypes import from_torch
        from ..plan import rank_index
        from ..pipeline.load import load_rank

        start = time.perf_counter()
        index = rank_index(discover(path, rank))
        report = compare(index, self.targets(), engine=self.engine, model=self.model_name, allow_narrow=True)
        if not report.ok:
            if options.strict:
                report.seconds = time.perf_counter() - start
                raise InjectError(_error_message(report, self.fix), report)
            log.warning("%s", _error_message(report, self.fix).replace("strict inject", "inject", 1))
        into: dict[str, torch.Tensor] = {}
        for name in report.loaded:
            meta = index[name]
            dst = self._destination(name, meta.shape)
            if dst.is_contiguous() and from_torch(dst.dtype) == meta.dtype and dst.device == device:
                into[name] = dst.detach()
        result = load_rank(path, rank, device=device, backend=options.backend, into=into, only=report.loaded)
        try:
            self.apply({n: result.tensors[n] for n in report.loaded if n not in into}, report)
        finally:
            summary = result.report.summary()
            result.close()
        report.direct = len(into)
        report.seconds = time.perf_counter() - start
        log.info("%s", report.summary())
        return report, summary


class LoadWeightsInjector(Injector):
    """Feed HF-named tensors to ``model.load_weights(iterable)``, the engine's own name mapping and TP slicing.

    vLLM (and SGLang) models return the set of parameter names they filled; parameters not in
    it are reported missing (vLLM's default-loader check, which vLLM skips for quantized models
    whose extra parameters no checkpoint holds: ``check_unfilled=False``). Names the model does
    not know make its ``load_weights`` raise; that is re-raised as :class:`InjectError` naming the tensor.
    """

    def __init__(self, model: nn.Module, *, engine: str = "vllm", check_unfilled: bool = True):
        self.model = model
        self.engine = engine  # type: ignore[misc]
        self.check_unfilled = check_unfilled

    def inject(self, weights: Weights, *, strict: bool = True) -> InjectReport:
        start = time.perf_counter()
        tensors = collect_weights(weights)
        name = type(self.model).__name__
        report = InjectReport(engine=self.engine, model=name)
        current: list[str] = []

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for key, t in tensors.items():
                current[:] = [key]
                report.bytes += t.numel() * t.element_size()
                report.loaded.append(key)
                yield key, t

        try:
            filled = self.model.load_weights(stream())
        except (KeyError, AttributeError, IndexError, AssertionError, ValueError, RuntimeError) as e:
            at = f" at tensor {current[0]!r}" if current else ""
            raise InjectError(
                f"{name}.load_weights failed{at}: {type(e).__name__}: {e}; the checkpoint's names or shapes do not "
                f"match this model (is it an unsharded HF checkpoint of the same architecture?)"
            ) from e
        if self.check_unfilled and isinstance(filled, (set, frozenset)):
            params = {n for n, _ in self.model.named_parameters()}
            report.missing = sorted(params - set(filled))
        report.seconds = time.perf_counter() - start
        if report.missing:
            msg = (
                f"{name}.load_weights left {len(report.missing)} parameters unfilled: "
                f"{', '.join(map(repr, report.missing[:12]))}"
            )
            if strict:
                raise InjectError(
                    msg + "; the checkpoint lacks them — use the full checkpoint, or strict=False", report
                )
            log.warning("%s", msg)
        log.info("%s", report.summary())
        return report


@dataclass(frozen=True)
class LoadRoute:
    """How one engine worker loads its rank: which path, and which files' rank."""

    kind: str
    """``sharded_state`` (copy by state-dict name) or ``load_weights`` (the model maps HF names)."""
    file_rank: int
    """The rank whose files (or sidecar arena) this worker reads."""
    layout: CheckpointLayout


def choose_route(
    path: str | os.PathLike[str] | None,
    *,
    rank: int,
    tp_size: int,
    options: AdapterOptions,
    engine: str = "vLLM",
    pp_size: int = 1,
    ep_size: int | None = None,
) -> LoadRoute:
    """Decide how global rank ``rank`` of a ``tp_size`` x ``pp_size`` engine loads ``path``; :class:`LayoutError` if
    it can't. ``ep_size`` is the engine's expert-parallel size (None: not known, not checked).

    >>> choose_route("/models/llama-tp2", rank=1, tp_size=2, options=AdapterOptions()).kind  # doctest: +SKIP
    'sharded_state'
    """
    if options.layout is not None:
        vllm_layout = options.layout == "vllm"
        layout = CheckpointLayout(
            options.layout,
            tp_size if vllm_layout else 1,
            "option",
            pp_size=pp_size if vllm_layout else 1,
            ep_size=ep_size,
        )
    elif path is None or not os.path.exists(path):
        raise LayoutError(
            f"{engine}: model path {str(path)!r} is not readable here, so its layout is unknown; give "
            '"layout": "vllm" or "hf" in the loader\'s extra config (needed when loading from a sidecar only)'
        )
    else:
        layout = describe_checkpoint(path)
    where = f"{str(path)!r}"
    if layout.layout == "vllm":
        if (layout.tp_size, layout.pp_size) != (tp_size, pp_size):
            raise LayoutError(
                f"{engine}: {where} was sharded for tensor-parallel size {layout.tp_size} x pipeline-parallel size "
                f"{layout.pp_size} (vllm layout) but the engine runs tp={tp_size} x pp={pp_size}; start it with "
                f"--tensor-parallel-size {layout.tp_size} --pipeline-parallel-size {layout.pp_size}, or re-shard "
                f"with `gdsload shard SRC OUT --tp {tp_size} --pp {pp_size}`"
            )
        if ep_size is not None and layout.ep_size is not None and layout.ep_size != ep_size:
            how = "with" if layout.ep_size > 1 else "without"
            raise LayoutError(
                f"{engine}: {where} was sharded {how} expert parallel (ep={layout.ep_size}) but the engine runs "
                f"ep={ep_size}; start it {how} --enable-expert-parallel, or re-shard with "
                f"`gdsload shard SRC OUT --tp {tp_size} --pp {pp_size} --ep {ep_size}`"
            )
        return LoadRoute("sharded_state", rank, layout)
    if layout.layout == "hf":
        if layout.tp_size != 1:
            raise LayoutError(
                f"{engine}: {where} holds hf-layout shards for tp={layout.tp_size}; {engine}'s load_weights slices "
                "full HF tensors itself, so it needs the unsharded (TP=1) checkpoint — point it there, or write "
                f"engine-native shards with `gdsload shard SRC OUT --tp {tp_size} --layout vllm`"
            )
        if options.sidecar_url is not None and tp_size * pp_size > 1:
            raise LayoutError(
                f"{engine}: with a sidecar, an hf-layout checkpoint serves tp=1 only (every rank would map rank 0's "
                f"arena from one GPU); run tp=1, load from storage, or shard with `--tp {tp_size} --layout vllm`"
            )
        return LoadRoute("load_weights", 0, layout)
    raise LayoutError(
        f"{engine}: {where} is a TensorRT-LLM checkpoint (rank{{N}}.safetensors with TensorRT-LLM names); "
        "load it with gdsload.loader.adapters.trtllm, or give this engine an HF or vllm-layout directory"
    )


def load_into_model(
    model: nn.Module,
    path: str | os.PathLike[str] | None,
    *,
    rank: int,
    tp_size: int,
    options: AdapterOptions | None = None,
    engine: str = "vllm",
    route: LoadRoute | None = None,
    check_unfilled: bool = True,
    adopt_cuda: bool = True,
    pp_size: int = 1,
    ep_size: int | None = None,
) -> InjectReport:
    """Load global rank ``rank``'s weights from ``path`` (or the sidecar) into an engine's ``model``.

    This is what the registered loader runs in each worker; it needs no engine import, so it
    also serves engine-shaped plain torch modules. ``check_unfilled=False`` skips the
    unfilled-parameter check of the ``load_weights`` path (quantized models).

    From a sidecar, a pre-sharded rank is adopted (``options.adopt``): parameters take the
    mapped memory as their storage where they match it exactly, and this process holds the
    rank's lease until it exits (:meth:`MappedRank.hold`). On CPU the mapping is copy-on-write,
    so whatever the engine does to its weights stays its own. CUDA IPC memory is the sidecar's
    own: ``adopt_cuda=False`` (an engine that rewrites weights in place, e.g. repacking for a
    quantization) copies instead.

    >>> load_into_model(model, "/models/llama-tp2", rank=0, tp_size=2)  # doctest: +SKIP
    """
    options = options or AdapterOptions()
    route = route or choose_route(
        path, rank=rank, tp_size=tp_size, options=options, engine=engine, pp_size=pp_size, ep_size=ep_size
    )
    device = _model_device(model)
    if route.kind == "sharded_state" and options.sidecar_url is None and path is not None:
        sharded = ShardedStateInjector(model, engine=engine)
        try:
            report, report.source = sharded.load(path, route.file_rank, options=options, device=device)
        except BackendUnavailableError as e:
            if device.type == "cpu" or LoadConfig.resolve(backend=options.backend).backend != "auto":
                raise
            log.info("rank %d: no backend reads to %s here (%s); reading to host memory and copying", rank, device, e)
        else:
            log.info("rank %d: %s (%s, %s layout)", rank, report.summary(), route.kind, route.layout.layout)
            return report
    injector: Injector = (
        ShardedStateInjector(model, engine=engine)
        if route.kind == "sharded_state"
        else LoadWeightsInjector(model, engine=engine, check_unfilled=check_unfilled)
    )
    if (
        route.kind == "load_weights"
        and device.type == "cpu"
        and options.sidecar_url is None
        and LoadConfig.resolve(backend=options.backend).backend == "auto"
    ):
        # The model's weight loaders copy every tensor into its parameters: hand them views of the files'
        # own pages (nothing read into an arena first, one copy in all).
        options = dataclasses.replace(options, backend="mmap")
    adopting = (
        options.sidecar_url is not None
        and route.kind == "sharded_state"
        and options.adopt
        and (device.type == "cpu" or adopt_cuda)
    )
    with open_rank(
        path,
        route.file_rank,
        options=options,
        device=device,
        expect_device=True,
        private=adopting and device.type == "cpu",
    ) as weights:
        held = adopting and hold_for_adoption(weights, engine=f"{engine} engine")
        if isinstance(injector, ShardedStateInjector) and options.sidecar_url is not None:
            injector.adopt = held
        report = inject_held(injector, weights, held=held, strict=options.strict)
        if weights.origin == "sidecar" and route.kind == "load_weights":
            report.copied = len(report.loaded)  # the model's weight loaders copy every tensor
    log.info("rank %d: %s (%s, %s layout)", rank, report.summary(), route.kind, route.layout.layout)
    return report


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# The vLLM classes, built on first use so that importing this module never imports vLLM.


@functools.cache
def loader_class() -> type:
    """The ``BaseModelLoader`` subclass for load format ``gdsload`` (imports vLLM)."""
    base_loader = import_engine("vllm.model_executor.model_loader.base_loader", "vllm", "the gdsload vLLM loader")
    from vllm.logger import init_logger

    vllm_log = init_logger("vllm.gdsload")

    class GdsloadModelLoader(base_loader.BaseModelLoader):  # type: ignore[name-defined,misc]
        """vLLM load format ``gdsload``: pre-sharded ranks by state-dict name, or HF checkpoints via load_weights."""

        def __init__(self, load_config: Any):
            super().__init__(load_config)
            self.options = AdapterOptions.from_mapping(
                _as_dict(load_config.model_loader_extra_config), where="--model-loader-extra-config"
            )

        def download_model(self, model_config: Any) -> None:
            path = _weights_path(model_config)
            if self.options.sidecar_url is None and not os.path.isdir(path) and not os.path.isfile(path):
                raise LayoutError(
                    f"load format {LOAD_FORMAT!r} reads local directories only and {path!r} is not one; download "
                    "the model first (e.g. `huggingface-cli download`), or give sidecar_url to map it from a sidecar"
                )

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            from vllm.distributed import (
                get_pp_group,
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            start = time.perf_counter()
            self.download_model(model_config)
            tp_rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            pp_rank, pp = get_pp_group().rank_in_group, get_pp_group().world_size
            rank = pp_rank * tp + tp_rank  # vLLM's own numbering: tensor parallel innermost
            # vLLM checks for unfilled parameters only when the model is not quantized; so do we. A
            # quantized model's weights may be rewritten in place after loading: on a GPU, those are
            # copied from a sidecar rather than adopted (its memory is shared).
            unquantized = getattr(model_config, "quantization", None) is None
            report = load_into_model(
                model,
                _weights_path(model_config),
                rank=rank,
                tp_size=tp,
                options=self.options,
                engine="vllm",
                check_unfilled=unquantized,
                adopt_cuda=unquantized,
                pp_size=pp,
                ep_size=_expert_parallel_size(tp),
            )
            # One line per worker in vLLM's own log, as vLLM's loaders write it, with what gdsload did.
            stage = f", pp stage {pp_rank} of {pp}" if pp > 1 else ""
            vllm_log.info(
                "Loading weights took %.2f seconds (gdsload, tp rank %d of %d%s): %s; %s",
                time.perf_counter() - start,
                tp_rank,
                tp,
                stage,
                report.source,
                report.summary(),
            )

    GdsloadModelLoader.__module__ = __name__
    GdsloadModelLoader.__qualname__ = "GdsloadModelLoader"  # picklable by name (module __getattr__)
    return GdsloadModelLoader


_registered = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group: register load format ``gdsload`` in this process.

    vLLM may call plugins more than once per process; only the first call registers.

    >>> register()  # inside a process where vLLM is installed  # doctest: +SKIP
    """
    global _registered
    if _registered:
        return
    cls = loader_class()
    model_loader = import_engine("vllm.model_executor.model_loader", "vllm", "the gdsload vLLM plugin")
    register_fn: Callable[[str], Callable[[type], type]] | None = getattr(model_loader, "register_model_loader", None)
    if register_fn is None:
        raise EngineNotInstalledError(
            "this vLLM has no vllm.model_executor.model_loader.register_model_loader (vLLM 0.9 and later have "
            "it); upgrade vLLM to use --load-format gdsload"
        )
    register_fn(LOAD_FORMAT)(cls)
    _route_warnings_to_vllm()
    _registered = True
    log.info("registered vLLM load format %r", LOAD_FORMAT)


class _ToVllmLog(logging.Handler):
    """Hands gdsload's records to the handlers vLLM configured on its ``vllm`` logger."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _route_warnings_to_vllm() -> None:
    """Inside vLLM, gdsload's warnings and errors appear in vLLM's log, formatted as vLLM's own lines.

    Nothing changes when the process configured the ``gdsload`` logger itself (a handler or a level).
    """
    lib = logging.getLogger("gdsload")
    if lib.handlers or lib.level != logging.NOTSET:
        return
    lib.addHandler(_ToVllmLog())
    lib.setLevel(logging.WARNING)


def _expert_parallel_size(tp: int) -> int | None:
    """The engine's expert-parallel size over one stage (``tp`` with ``--enable-expert-parallel``, else 1), or None
    when this vLLM does not say (or runs data parallel, which gdsload's layouts do not describe)."""
    try:
        from vllm.config import get_current_vllm_config

        parallel = get_current_vllm_config().parallel_config
        if getattr(parallel, "data_parallel_size", 1) != 1:
            return None
        return tp if parallel.enable_expert_parallel else 1
    except (ImportError, AttributeError):
        return None


def _weights_path(model_config: Any) -> str:
    return str(getattr(model_config, "model_weights", None) or model_config.model)


def _as_dict(extra: Any) -> Mapping[str, Any] | None:
    if extra is None or isinstance(extra, Mapping):
        return extra
    raise ConfigError(
        f"--model-loader-extra-config for load format {LOAD_FORMAT!r} must be a JSON object of "
        f"gdsload options, got {type(extra).__name__}"
    )


def __getattr__(name: str) -> Any:
    if name == "GdsloadModelLoader":
        return loader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
