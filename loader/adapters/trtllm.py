"""TensorRT-LLM: a checkpoint loader for the PyTorch backend, and legacy ``rank{N}.safetensors`` checkpoints.

**PyTorch backend** (``tensorrt_llm.LLM``). TensorRT-LLM picks a checkpoint loader by format
name (``register_checkpoint_loader``) or takes an instance (``LLM(checkpoint_loader=...)``).
:func:`register` registers ``GdsloadCheckpointLoader`` as format ``gdsload``; it is
TensorRT-LLM's HF checkpoint loader (HF config parsing, HF weight mappers) with gdsload's
weight loader, which returns the weights dict with ``load_rank`` (or maps it from a sidecar)::

    from gdsload.loader.adapters import trtllm
    llm = LLM(model="/models/llama", checkpoint_loader=trtllm.checkpoint_loader_class()())

TensorRT-LLM's modules slice full HF tensors for their rank themselves (``load_weight_shard``),
so this path takes an unsharded (TP=1) HF-layout directory at any tensor-parallel size: every
rank reads the whole checkpoint, as TensorRT-LLM's own HF loader does. Pre-sharded directories
are refused with a :class:`LayoutError` (TensorRT-LLM would slice them a second time).

**Legacy checkpoints** (``convert_checkpoint.py`` output for ``trtllm-build``): ``config.json``
with a ``mapping`` (world_size, tp_size, pp_size, cp_size) and one ``rank{N}.safetensors`` per
rank, in TensorRT-LLM's own names. :func:`load_legacy_checkpoint` returns rank N's config and
tensors (the rank → file rule follows ``PretrainedModel.from_checkpoint``: context-parallel
ranks share a file); :func:`legacy_model` builds the ``tensorrt_llm.models`` model from them.

Checked against TensorRT-LLM's source (``tensorrt_llm/_torch/models/checkpoints/``:
``base_checkpoint_loader.py``, ``base_weight_loader.py``, ``hf/checkpoint_loader.py``;
``_torch/models/modeling_utils.py`` ``register_checkpoint_loader``; ``_torch/modules/linear.py``
``load_weight_shard``; ``models/modeling_utils.py`` ``PretrainedModel.from_checkpoint``;
``docs/source/architecture/checkpoint.md``, ``docs/source/torch/features/checkpoint_loading.md``),
1.0-1.2 era main branch.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..format.discovery import list_ranks
from ..errors import ConfigError
from ..format.manifest import Manifest
from .base import (
    AdapterOptions,
    LayoutError,
    RankWeights,
    describe_checkpoint,
    import_engine,
    open_rank,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "LegacyMapping",
    "LegacyCheckpoint",
    "read_legacy_config",
    "load_legacy_checkpoint",
    "legacy_model",
    "load_trtllm_weights",
    "weight_loader_class",
    "checkpoint_loader_class",
    "register",
]

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "gdsload"
"""The ``checkpoint_format`` name :func:`register` registers."""


@dataclass(frozen=True)
class LegacyMapping:
    """The ``mapping`` of a legacy TensorRT-LLM ``config.json``."""

    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1

    @property
    def files(self) -> int:
        """How many ``rank{N}.safetensors`` the checkpoint holds (context-parallel ranks share files)."""
        return self.tp_size * self.pp_size

    def file_rank(self, rank: int) -> int:
        """The file rank ``rank`` reads: ``rank % tp + rank // (tp * cp) * tp``."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(
                f"rank {rank} is outside the checkpoint's world_size {self.world_size} "
                f"(tp={self.tp_size} pp={self.pp_size} cp={self.cp_size})"
            )
        return rank % self.tp_size + rank // (self.tp_size * self.cp_size) * self.tp_size


@dataclass
class LegacyCheckpoint:
    """One rank of a legacy checkpoint: its ``config.json`` and its tensors."""

    config: dict[str, Any]
    mapping: LegacyMapping
    rank: int
    file_rank: int
    weights: RankWeights = field(repr=False)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.weights.tensors

    def close(self) -> None:
        self.weights.close()


def read_legacy_config(checkpoint_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], LegacyMapping]:
    """Parse and check a legacy checkpoint's ``config.json`` against the ``rank{N}.safetensors`` beside it.

    >>> read_legacy_config("/ckpt/llama-tp2")[1]  # doctest: +SKIP
    LegacyMapping(world_size=2, tp_size=2, pp_size=1, cp_size=1)
    """
    path = Path(checkpoint_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LayoutError(
            f"{str(path)!r} is missing; a TensorRT-LLM checkpoint directory holds config.json next "
            "to rank{N}.safetensors (written by convert_checkpoint.py)"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LayoutError(f"{str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise LayoutError(f"{str(path)!r} must hold a JSON object, got {type(config).__name__}")
    raw = config.get("mapping") or {}
    if not isinstance(raw, dict):
        raise LayoutError(f"{str(path)!r}: 'mapping' must be an object, got {raw!r}")
    values: dict[str, int] = {}
    for key in ("tp_size", "pp_size", "cp_size"):
        v = raw.get(key, 1)
        if type(v) is not int or v < 1:
            raise LayoutError(f"{str(path)!r}: mapping.{key}={v!r} must be a positive integer")
        values[key] = v
    expected_world = values["tp_size"] * values["pp_size"] * values["cp_size"]
    world = raw.get("world_size", expected_world)
    if world != expected_world:
        raise LayoutError(
            f"{str(path)!r}: mapping.world_size={world!r} but tp_size*pp_size*cp_size="
            f"{expected_world}; fix the config or re-run convert_checkpoint.py"
        )
    mapping = LegacyMapping(world_size=world, **values)
    source, _, ranks = list_ranks(checkpoint_dir)
    if source == "manifest" and Manifest.read(checkpoint_dir).layout == "trtllm":
        source = "trtllm"  # e.g. `gdsload compress` of a legacy checkpoint: the same rank files, with a manifest
    if source != "trtllm":
        raise LayoutError(
            f"{str(checkpoint_dir)!r} has no rank{{N}}.safetensors files (found a {source!r} "
            "layout); this is not a legacy TensorRT-LLM checkpoint"
        )
    if sorted(ranks) != list(range(mapping.files)):
        raise LayoutError(
            f"{str(path)!r} says tp_size={mapping.tp_size} pp_size={mapping.pp_size} "
            f"({mapping.files} rank files) but the directory holds rank files {sorted(ranks)}; the copy is "
            "incomplete or the config belongs to another conversion"
        )
    return config, mapping


def load_legacy_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    rank: int,
    *,
    options: AdapterOptions | None = None,
    device: str | torch.device = "cpu",
) -> LegacyCheckpoint:
    """Rank ``rank``'s config and tensors of a legacy ``rank{N}.safetensors`` checkpoint.

    >>> ckpt = load_legacy_checkpoint("/ckpt/llama-tp2", rank=1)  # doctest: +SKIP
    >>> ckpt.file_rank, sorted(ckpt.tensors)[:1]  # doctest: +SKIP
    (1, ['lm_head.weight'])
    """
    config, mapping = read_legacy_config(checkpoint_dir)
    file_rank = mapping.file_rank(rank)
    weights = open_rank(checkpoint_dir, file_rank, options=options, device=device)
    log.info(
        "TensorRT-LLM legacy checkpoint %s: rank %d reads rank%d.safetensors (%d tensors)",
        checkpoint_dir,
        rank,
        file_rank,
        len(weights.tensors),
    )
    return LegacyCheckpoint(config=config, mapping=mapping, rank=rank, file_rank=file_rank, weights=weights)


def legacy_model(checkpoint_dir: str | os.PathLike[str], rank: int, *, options: AdapterOptions | None = None) -> Any:
    """Build the ``tensorrt_llm.models`` model of rank ``rank`` from a legacy checkpoint (for ``trtllm-build``).

    The same steps as ``PretrainedModel.from_checkpoint``, with the rank's tensors from gdsload.

    >>> model = legacy_model("/ckpt/llama-tp2", rank=0)  # doctest: +SKIP
    """
    models = import_engine("tensorrt_llm.models", "tensorrt_llm", "legacy TensorRT-LLM checkpoints")
    modeling = import_engine("tensorrt_llm.models.modeling_utils", "tensorrt_llm", "legacy TensorRT-LLM checkpoints")
    config = modeling.PretrainedConfig.from_json_file(os.path.join(checkpoint_dir, "config.json"))
    config.set_rank(rank)
    model_cls = models.MODEL_MAP.get(config.architecture)
    if model_cls is None:
        raise LayoutError(f"TensorRT-LLM has no model class for architecture {config.architecture!r}")
    ckpt = load_legacy_checkpoint(checkpoint_dir, rank, options=options)
    try:
        pruned = bool(getattr(config, "is_pruned", False))
        weights = modeling.preprocess_weights(dict(ckpt.tensors), config, from_pruned=pruned)
        model = model_cls(config)
        model.load(weights, from_pruned=pruned)
    finally:
        ckpt.close()
    return model


def load_trtllm_weights(
    checkpoint_dir: str | os.PathLike[str],
    *,
    tp_rank: int,
    tp_size: int,
    options: AdapterOptions | None = None,
    device: str | torch.device = "cpu",
) -> RankWeights:
    """The weights dict the PyTorch backend's rank ``tp_rank`` of ``tp_size`` gets: the full HF checkpoint.

    >>> load_trtllm_weights("/models/llama", tp_rank=1, tp_size=2).tensors["lm_head.weight"].shape  # doctest: +SKIP
    torch.Size([128256, 4096])
    """
    options = options or AdapterOptions()
    if options.layout is not None:
        layout, dir_tp = options.layout, 1
    else:
        described = describe_checkpoint(checkpoint_dir)
        layout, dir_tp = described.layout, described.tp_size
    where = repr(str(checkpoint_dir))
    if layout == "trtllm":
        raise LayoutError(
            f"{where} is a legacy TensorRT-LLM checkpoint (rank{{N}}.safetensors, TensorRT-LLM names), which the "
            "PyTorch backend does not read; build an engine from it (legacy_model / trtllm-build) or give LLM() "
            "the HF checkpoint"
        )
    if layout != "hf" or dir_tp != 1:
        raise LayoutError(
            f"{where} holds {layout}-layout shards for tp={dir_tp}; TensorRT-LLM's PyTorch backend slices full HF "
            "tensors for each rank itself (load_weight_shard) and would slice these again — give it the unsharded "
            "TP=1 checkpoint"
        )
    if options.sidecar_url is not None and tp_size > 1:
        raise LayoutError(
            f"with a sidecar, TensorRT-LLM serves tp=1 only here (every rank would map rank 0's "
            f"arena from one GPU); load {where} from storage for tp={tp_size}"
        )
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank={tp_rank} is outside tp_size={tp_size}")
    return open_rank(checkpoint_dir, 0, options=options, device=device)


# ---------------------------------------------------------------------------------------------
# TensorRT-LLM classes, built on first use; resolvable by name (module __getattr__) so they pickle.


@functools.cache
def weight_loader_class() -> type:
    """``GdsloadWeightLoader``: a TensorRT-LLM ``BaseWeightLoader`` returning the rank's weights (imports TRT-LLM)."""
    base = import_engine(
        "tensorrt_llm._torch.models.checkpoints.base_weight_loader",
        "tensorrt_llm",
        "the gdsload TensorRT-LLM weight loader",
    )

    class GdsloadWeightLoader(base.BaseWeightLoader):  # type: ignore[name-defined,misc]
        """Loads the weights dict with gdsload; ``options`` as for the other adapters."""

        def __init__(self, options: AdapterOptions | dict[str, Any] | None = None):
            self.options = options if isinstance(options, AdapterOptions) else AdapterOptions.from_mapping(options)
            self._open: list[RankWeights] = []

        def load_weights(self, checkpoint_dir: str, mapping: Any = None, **kwargs: Any) -> dict[str, Any]:
            tp_rank = getattr(mapping, "tp_rank", 0) if mapping is not None else 0
            tp_size = getattr(mapping, "tp_size", 1) if mapping is not None else 1
            weights = load_trtllm_weights(checkpoint_dir, tp_rank=tp_rank, tp_size=tp_size, options=self.options)
            self._open.append(weights)
            return dict(weights.tensors)

        def cleanup(self) -> None:
            while self._open:
                self._open.pop().close()

    return _publish(GdsloadWeightLoader)


@functools.cache
def checkpoint_loader_class() -> type:
    """``GdsloadCheckpointLoader``: TensorRT-LLM's HF checkpoint loader with gdsload's weight loader."""
    hf = import_engine(
        "tensorrt_llm._torch.models.checkpoints.hf.checkpoint_loader",
        "tensorrt_llm",
        "the gdsload TensorRT-LLM checkpoint loader",
    )
    weight_loader = weight_loader_class()

    class GdsloadCheckpointLoader(hf.HfCheckpointLoader):  # type: ignore[name-defined,misc]
        """HF config and weight mapping from TensorRT-LLM, weights from gdsload.

        The format reported to TensorRT-LLM's mapper lookup stays ``HF`` (the names are HF names).
        """

        def __init__(self, *, options: AdapterOptions | dict[str, Any] | None = None, **kwargs: Any):
            self._gdsload_options = options
            super().__init__(**kwargs)

        def get_default_weight_loader(self) -> Any:
            return weight_loader(getattr(self, "_gdsload_options", None))

    return _publish(GdsloadCheckpointLoader)


_registered = False


def register() -> None:
    """Register ``GdsloadCheckpointLoader`` as TensorRT-LLM checkpoint format ``gdsload`` in this process.

    >>> register(); llm = LLM(model="/models/llama", checkpoint_format="gdsload")  # doctest: +SKIP
    """
    global _registered
    if _registered:
        return
    modeling = import_engine(
        "tensorrt_llm._torch.models.modeling_utils", "tensorrt_llm", "the gdsload TensorRT-LLM checkpoint loader"
    )
    modeling.register_checkpoint_loader(CHECKPOINT_FORMAT)(checkpoint_loader_class())
    _registered = True
    log.info("registered TensorRT-LLM checkpoint format %r", CHECKPOINT_FORMAT)


def _publish(cls: type) -> type:
    cls.__module__ = __name__
    cls.__qualname__ = cls.__name__
    return cls


def __getattr__(name: str) -> Any:
    if name == "GdsloadWeightLoader":
        return weight_loader_class()
    if name == "GdsloadCheckpointLoader":
        return checkpoint_loader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
