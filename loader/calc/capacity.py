"""HBM capacity planning: weights per GPU, KV-cache room, context and concurrency under tensor parallelism.

Pure arithmetic over a model's published dimensions; no torch, no GPU. The serving model is vLLM's:

* each GPU may use ``gpu_memory × gpu_memory_utilization`` bytes for weights, activations and the KV cache;
* linear layers are split across ``tp`` GPUs (column/row parallel), embeddings and ``lm_head`` are
  vocab-parallel (vocabulary padded to a multiple of 64), norms are replicated on every GPU, and when
  ``num_key_value_heads < tp`` each GPU keeps one KV head (its K/V weights and cache replicated ``tp / kv_heads``×);
* the KV cache is paged in blocks of 16 tokens; every GPU caches the same tokens for its own KV heads, so the
  token capacity of the whole TP group is the capacity of one GPU.

>>> from gdsload.loader.calc.capacity import BudgetInputs, plan, resolve_model
>>> p = plan(BudgetInputs(resolve_model("llama-3.1-405b"), tp=8, weights="fp8", kv_bits=16))
>>> p.kv_bytes_per_token_per_gpu       # 2 × 126 layers × 1 KV head × 128 × 2 bytes
64512
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..model_config import ModelConfig, ModelConfigError

__all__ = [
    "MIB",
    "GIB",
    "H200_MEMORY",
    "KV_BITS",
    "WEIGHT_FORMATS",
    "PRESETS",
    "ModelSpec",
    "WeightFormat",
    "WeightPart",
    "BudgetInputs",
    "HbmBudget",
    "resolve_model",
    "count_params",
    "weight_parts",
    "kv_bytes_per_token",
    "plan",
]

MIB = 1 << 20
GIB = 1 << 30
H200_MEMORY = 143771 * MIB
"""One H200 as ``nvidia-smi`` reports it: 143771 MiB = 150.76 GB = 140.40 GiB (the datasheet's "141 GB")."""

KV_BITS = (16, 8, 4, 3)
"""KV-cache element widths the planner knows: bf16/fp16, fp8, and 4- or 3-bit quantized caches."""

_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE for VocabParallelEmbedding / ParallelLMHead


def _flag(name: str, flag: str | None = None) -> str:
    return f"{name} ({flag or '--' + name.replace('_', '-')})"


GATED_MLP_DECODERS = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "granite", "cohere", "internlm2", "olmo2", "phi3"}
)
"""``model_type``s whose weights the planner counts right: dense decoders with a gated MLP (gate, up, down) and
grouped-query attention. A config without ``model_type`` is counted the same way."""


@dataclass(frozen=True)
class ModelSpec:
    """The dimensions of a dense decoder-only transformer (Llama, Mistral, Qwen2/3 families).

    >>> ModelSpec("tiny", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1000).kv_heads
    2
    """

    name: str
    layers: int
    """``num_hidden_layers``."""
    hidden: int
    """``hidden_size``."""
    heads: int
    """``num_attention_heads`` (query heads)."""
    kv_heads: int
    """``num_key_value_heads``; fewer than ``heads`` means grouped-query attention (GQA)."""
    head_dim: int
    """``head_dim``, else ``hidden_size // num_attention_heads``."""
    intermediate: int
    """``intermediate_size`` of the gated MLP (gate, up, down projections)."""
    vocab: int
    """``vocab_size``."""
    tied_embeddings: bool = False
    """``tie_word_embeddings``: ``lm_head`` shares the embedding matrix."""
    max_position: int | None = None
    """``max_position_embeddings``: the longest context one request may have."""
    qkv_bias: bool = False
    """Biases on q/k/v projections (``attention_bias``; Qwen2 has them)."""
    o_bias: bool = False
    """Bias on the attention output projection (``attention_bias`` in Llama configs)."""
    mlp_bias: bool = False
    """Biases on the MLP projections (``mlp_bias``)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            v = getattr(self, f)
            if type(v) is not int or v < 1:
                raise ConfigError(f"model {self.name!r}: {f}={v!r} must be a positive integer")
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model {self.name!r}: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; "
                "grouped-query attention needs whole groups"
            )
        if self.max_position is not None and (type(self.max_position) is not int or self.max_position < 1):
            raise ConfigError(f"model {self.name!r}: max_position={self.max_position!r} must be a positive integer")

    @classmethod
    def from_hf_config(cls, doc: Mapping[str, Any], name: str = "config.json") -> ModelSpec:
        """Read a Hugging Face ``config.json`` (already parsed).

        >>> ModelSpec.from_hf_config({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        ...                           "intermediate_size": 128, "vocab_size": 1000}).kv_heads
        4
        """
        try:
            cfg = ModelConfig.from_dict(doc, where=name)
        except ModelConfigError as e:
            raise ConfigError(str(e)) from None
        doc = cfg.raw
        moe = sorted(
            k for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size") if doc.get(k)
        )
        if moe:
            raise ConfigError(
                f"{name}: mixture-of-experts configs ({', '.join(moe)}) are not supported; "
                "the planner counts dense models only"
            )
        missing = [
            k
            for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
            if k not in doc
        ]
        if missing:
            raise ConfigError(
                f"{name}: missing {missing}; expected a Hugging Face config.json of a dense decoder "
                "(Llama, Mistral, Qwen2)"
            )
        model_type = cfg.model_type or ""
        if model_type and model_type not in GATED_MLP_DECODERS:
            raise ConfigError(
                f"{name}: model_type {model_type!r} is not one the planner counts: it assumes a dense "
                "decoder with a gated MLP (gate, up and down projections) and grouped-query "
                f"attention, as in {', '.join(sorted(GATED_MLP_DECODERS))}"
            )
        tied_note = (
            ""
            if not cfg.tie_is_default
            else (
                f"; tie_word_embeddings absent, taken as {str(cfg.tie_word_embeddings).lower()} "
                f"(transformers' default for {model_type or 'a config without model_type'})"
            )
        )
        attention_bias = bool(doc.get("attention_bias", False))
        return cls(
            name=name,
            layers=doc["num_hidden_layers"],
            hidden=doc["hidden_size"],
            heads=doc["num_attention_heads"],
            kv_heads=doc.get("num_key_value_heads") or doc["num_attention_heads"],
            head_dim=doc.get("head_dim") or cfg.head_dim or 0,
            intermediate=doc["intermediate_size"],
            vocab=doc["vocab_size"],
            tied_embeddings=cfg.tie_word_embeddings,
            max_position=doc.get("max_position_embeddings"),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(doc.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            source=f"{name} (model_type={model_type or '?'}{tied_note}"
            + (
                f"; the language model of a {cfg.wrapper} config: its vision or audio encoder is not counted"
                if cfg.wrapper
                else ""
            )
            + ")",
        )


# Published dimensions. Source: the config.json files of meta-llama/Llama-3.1-8B, -70B and -405B on the Hugging
# Face Hub, which agree with Table 3 of "The Llama 3 Herd of Models" (Meta, arXiv:2407.21783): layers, model
# dimension, FFN dimension, attention heads, 8 KV heads, vocabulary 128,256 (the paper rounds it to "128K"),
# context 131,072 (RoPE scaled), untied embeddings. Totals: 8,030,261,248 / 70,553,706,496 / 405,853,388,800.
_LLAMA_31 = "meta-llama/Llama-3.1-{} config.json on the Hugging Face Hub; Llama 3 paper (arXiv:2407.21783) Table 3"
PRESETS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec(
        "llama-3.1-8b",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=14336,
        vocab=128256,
        max_position=131072,
        source=_LLAMA_31.format("8B"),
    ),
    "llama-3.1-70b": ModelSpec(
        "llama-3.1-70b",
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        head_dim=128,
        intermediate=28672,
        vocab=128256,
        max_position=131072,
        source=_LLAMA_31.format("70B"),
    ),
    "llama-3.1-405b": ModelSpec(
        "llama-3.1-405b",
        layers=126,
        hidden=16384,
        heads=128,
        kv_heads=8,
        head_dim=128,
        intermediate=53248,
        vocab=128256,
        max_position=131072,
        source=_LLAMA_31.format("405B"),
    ),
}


def resolve_model(model: str | Path) -> ModelSpec:
    """A preset name (case-insensitive), a ``config.json`` path, or a directory holding one.

    >>> resolve_model("Llama-3.1-8B").layers
    32
    """
    key = str(model).strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model {str(model)!r} is neither a preset ({', '.join(PRESETS)}) nor a path to a "
            "Hugging Face config.json (or a directory holding one)"
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{str(path)!r} is not a readable JSON config: {e}") from e
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{str(path)!r} holds a JSON {type(doc).__name__}, expected an object")
    return ModelSpec.from_hf_config(doc, name=str(path))


@dataclass(frozen=True)
class WeightFormat:
    """How linear-layer weights are stored: element bits plus quantization scales."""

    name: str
    bits: int
    """Bits per weight element."""
    scale_group: int | None
    """Elements (along the input dimension) sharing one scale; None: one scale per matrix."""
    scale_bytes: int
    """Bytes per scale (0: no scales)."""
    describe: str


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat("bf16", 16, None, 0, "bf16: 2 bytes per parameter, no scales"),
    "fp8": WeightFormat(
        "fp8",
        8,
        None,
        4,
        "fp8 e4m3: 1 byte per linear-layer weight + one fp32 scale per matrix "
        "(per-tensor, as `gdsload shard --quantize fp8` writes)",
    ),
    "int4": WeightFormat(
        "int4",
        4,
        128,
        2,
        "int4: 0.5 byte per linear-layer weight + one fp16 scale per 128 "
        "inputs (symmetric GPTQ/AWQ-style, group 128, no zero points)",
    ),
}


@dataclass(frozen=True)
class WeightPart:
    """One kind of parameter as one GPU holds it (``count`` copies, e.g. one per layer)."""

    name: str
    rows: int
    cols: int
    count: int
    linear: bool
    """A linear-layer weight (quantized by fp8/int4); else kept at 16 bits."""
    replicated: bool
    """Every GPU (or a group of GPUs) holds the same copy."""

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad(n: int, multiple: int) -> int:
    return _ceil_div(n, multiple) * multiple


def weight_parts(spec: ModelSpec, tp: int = 1, *, vocab_padding: int = _VOCAB_PADDING) -> list[WeightPart]:
    """The parameters one TP rank holds, part by part (vLLM's sharding; ``tp=1, vocab_padding=1``: the model).

    >>> sum(p.params for p in weight_parts(PRESETS["llama-3.1-8b"], vocab_padding=1))
    8030261248
    """
    _check_tp(spec, tp)
    hd, h, L = spec.head_dim, spec.hidden, spec.layers
    q_out = spec.heads // tp * hd
    kv_rep = tp > spec.kv_heads
    kv_out = max(1, spec.kv_heads // tp) * hd
    ff = spec.intermediate // tp
    vocab = _ceil_div(_pad(spec.vocab, vocab_padding), tp)
    parts = [WeightPart("embed_tokens", vocab, h, 1, False, False)]
    if not spec.tied_embeddings:
        parts.append(WeightPart("lm_head", vocab, h, 1, False, False))
    parts += [
        WeightPart("q_proj", q_out, h, L, True, False),
        WeightPart("k_proj", kv_out, h, L, True, kv_rep),
        WeightPart("v_proj", kv_out, h, L, True, kv_rep),
        WeightPart("o_proj", h, q_out, L, True, False),
        WeightPart("gate_proj", ff, h, L, True, False),
        WeightPart("up_proj", ff, h, L, True, False),
        WeightPart("down_proj", h, ff, L, True, False),
    ]
    if spec.qkv_bias:
        parts += [
            WeightPart("q_proj.bias", q_out, 1, L, False, False),
            WeightPart("kv_proj.bias", 2 * kv_out, 1, L, False, kv_rep),
        ]
    if spec.o_bias:
        parts.append(WeightPart("o_proj.bias", h, 1, L, False, True))
    if spec.mlp_bias:
        parts += [
            WeightPart("gate_up_proj.bias", 2 * ff, 1, L, False, False),
            WeightPart("down_proj.bias", h, 1, L, False, True),
        ]
    parts.append(WeightPart("layer norms", 2 * h, 1, L, False, True))
    if spec.qk_norm:
        parts.append(WeightPart("q_norm/k_norm", 2 * hd, 1, L, False, True))
    parts.append(WeightPart("final norm", h, 1, 1, False, True))
    return parts


def count_params(spec: ModelSpec) -> int:
    """Total parameters of the unsharded model (embeddings, attention, MLP, norms, ``lm_head`` unless tied).

    >>> count_params(PRESETS["llama-3.1-405b"])
    405853388800
    """
    return sum(p.params for p in weight_parts(spec, 1, vocab_padding=1))


def _part_bytes(part: WeightPart, fmt: WeightFormat, quantize_embeddings: bool) -> int:
    quantized = fmt.scale_bytes or fmt.bits != 16
    if not (quantized and (part.linear or (quantize_embeddings and part.name in ("embed_tokens", "lm_head")))):
        return part.params * 2
    data = part.params * fmt.bits // 8
    per_matrix = part.rows * _ceil_div(part.cols, fmt.scale_group) if fmt.scale_group else 1
    scales = part.count * per_matrix * fmt.scale_bytes
    return data + scales


def kv_heads_split(kv_heads: int, tp: int) -> bool:
    """Whether ``kv_heads`` KV heads go over ``tp`` ranks whole: split evenly (``kv_heads`` a multiple of
    ``tp``) or each replicated on ``tp / kv_heads`` ranks (``tp`` a multiple of ``kv_heads``), as vLLM does."""
    return kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0


def _check_tp(spec: ModelSpec, tp: int) -> None:
    if type(tp) is not int or tp < 1:
        raise ConfigError(f"{_flag('tp')} = {tp!r} must be a positive integer")
    if spec.heads % tp or spec.intermediate % tp or not kv_heads_split(spec.kv_heads, tp):
        ok = [
            n
            for n in range(1, spec.heads + 1)
            if not spec.heads % n and not spec.intermediate % n and kv_heads_split(spec.kv_heads, n)
        ]
        raise ConfigError(
            f"{_flag('tp')} = {tp!r} does not split {spec.name!r} (heads={spec.heads}, kv_heads={spec.kv_heads}, "
            f"intermediate={spec.intermediate}): it must divide heads and intermediate, and divide or be a "
            f"multiple of kv_heads; allowed values: {ok}"
        )


def kv_bytes_per_token(spec: ModelSpec, tp: int, kv_bits: int, group: int = 128, scale_bits: int = 0) -> int:
    """KV-cache bytes one GPU stores per token: ``2 × layers × kv_heads_per_gpu × bytes_per_head_vector``.

    ``bytes_per_head_vector = ceil(head_dim × kv_bits / 8) + ceil(ceil(head_dim / group) × scale_bits / 8)``;
    ``kv_heads_per_gpu = max(1, kv_heads / tp)``.

    >>> kv_bytes_per_token(PRESETS["llama-3.1-405b"], tp=1, kv_bits=16)   # 2 × 126 × 8 × 128 × 2
    516096
    """
    _check_tp(spec, tp)
    vector = _ceil_div(spec.head_dim * kv_bits, 8) + _ceil_div(_ceil_div(spec.head_dim, group) * scale_bits, 8)
    return 2 * spec.layers * max(1, spec.kv_heads // tp) * vector


@dataclass(frozen=True)
class BudgetInputs:
    """Everything the plan depends on. Memory sizes are bytes (MiB/GiB = 2^20/2^30, GB = 10^9).

    >>> BudgetInputs(PRESETS["llama-3.1-70b"], tp=4, weights="fp8").gpu_memory // MIB
    143771
    """

    model: ModelSpec
    tp: int = 1
    """Tensor-parallel size: GPUs that share one copy of the model."""
    gpu_memory: int = H200_MEMORY
    """Total memory of one GPU in bytes, as ``nvidia-smi`` reports it (MiB × 2^20)."""
    weights: str = "bf16"
    """Weight format: bf16, fp8 or int4 (see WEIGHT_FORMATS)."""
    kv_bits: int = 16
    """KV-cache element width: 16, 8, 4 or 3."""
    gpu_memory_utilization: float = 0.9
    """vLLM's fraction of GPU memory for weights + activations + KV cache; the rest is headroom."""
    activation_reserve: int = 4 * GIB
    """Per GPU, inside the utilization budget: peak activations of the profiling forward pass plus memory
    allocated outside PyTorch (NCCL, cuBLAS workspaces). vLLM logs both at start-up; use your figures."""
    cuda_graph_reserve: int = 1 * GIB
    """Per GPU: memory held by captured CUDA graphs, inside the budget (0 with --enforce-eager, or where your
    vLLM leaves graphs in the (1 - utilization) headroom)."""
    context: int | None = None
    """Tokens per request for the concurrency figure; None: the model's max_position_embeddings."""
    kv_group_size: int = 128
    """Elements of a K or V head vector that share one quantization scale (quantized KV only)."""
    kv_scale_bits: int | None = None
    """Bits of scale (+ zero point) per group; None: 0 for 16- and 8-bit KV (fp8 with a per-tensor scale),
    16 for 4- and 3-bit KV (one fp16 scale per group)."""
    block_size: int = 16
    """KV-cache page size in tokens (vLLM's default); capacity is rounded down to whole blocks."""
    quantize_embeddings: bool = False
    """Also quantize embed_tokens and lm_head (vLLM keeps them at 16 bits for fp8/int4 checkpoints)."""
    kv_cache_heads: int | None = None
    """What-if: size the KV cache for this many KV heads instead of the model's ``kv_heads`` (weights are
    unchanged). ``heads`` models a cache that ignores grouped-query attention."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelSpec):
            raise ConfigError(f"model={self.model!r} must be a ModelSpec; use resolve_model()")
        _check_tp(self.model, self.tp)
        if type(self.gpu_memory) is not int or self.gpu_memory < 1:
            raise ConfigError(f"{_flag('gpu_memory')} = {self.gpu_memory!r} must be a positive size in bytes")
        if self.weights not in WEIGHT_FORMATS:
            raise ConfigError(
                f"{_flag('weights')} = {self.weights!r} is not known; allowed values: {', '.join(WEIGHT_FORMATS)}"
            )
        if self.kv_bits not in KV_BITS or type(self.kv_bits) is not int:
            raise ConfigError(
                f"{_flag('kv_bits')} = {self.kv_bits!r} is not supported; "
                f"allowed values: {', '.join(map(str, KV_BITS))}"
            )
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ConfigError(f"{_flag('gpu_memory_utilization')} = {u!r} must be a fraction in (0, 1]")
        for name in ("activation_reserve", "cuda_graph_reserve"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ConfigError(f"{_flag(name)} = {v!r} must be a size in bytes >= 0")
        if self.context is not None and (type(self.context) is not int or self.context < 1):
            raise ConfigError(f"{_flag('context')} = {self.context!r} must be a positive number of tokens")
        if type(self.kv_group_size) is not int or self.kv_group_size < 1:
            raise ConfigError(f"{_flag('kv_group_size')} = {self.kv_group_size!r} must be a positive integer")
        if self.kv_scale_bits is not None and (
            type(self.kv_scale_bits) is not int or not 0 <= self.kv_scale_bits <= 64
        ):
            raise ConfigError(f"{_flag('kv_scale_bits')} = {self.kv_scale_bits!r} must be an integer in 0..64")
        if type(self.block_size) is not int or self.block_size < 1:
            raise ConfigError(f"{_flag('block_size')} = {self.block_size!r} must be a positive number of tokens")
        if self.kv_cache_heads is not None:
            h = self.model.heads
            if type(self.kv_cache_heads) is not int or self.kv_cache_heads < 1 or h % self.kv_cache_heads:
                raise ConfigError(
                    f"{_flag('kv_cache_heads', '--kv-heads')} = {self.kv_cache_heads!r} must divide "
                    f"the model's {h} attention heads; allowed values: "
                    f"{[n for n in range(1, h + 1) if not h % n]}"
                )
            ok = [n for n in range(1, h + 1) if not h % n and kv_heads_split(n, self.tp)]
            if self.kv_cache_heads not in ok:
                raise ConfigError(
                    f"{_flag('kv_cache_heads', '--kv-heads')} = {self.kv_cache_heads!r} does not split "
                    f"over tp {self.tp} (it must divide or be a multiple of tp, and divide the "
                    f"model's {h} attention heads); allowed values with this tp: {ok}"
                )

    @property
    def kv_spec(self) -> ModelSpec:
        """The model as the KV cache sees it (``kv_cache_heads`` applied)."""
        if self.kv_cache_heads is None or self.kv_cache_heads == self.model.kv_heads:
            return self.model
        return replace(self.model, kv_heads=self.kv_cache_heads)

    @property
    def resolved_kv_scale_bits(self) -> int:
        if self.kv_scale_bits is not None:
            return self.kv_scale_bits
        return 16 if self.kv_bits < 8 else 0


@dataclass(frozen=True)
class HbmBudget:
    """The answer: where each GPU's memory goes and what the KV cache holds. Bytes are per GPU."""

    inputs: BudgetInputs
    params: int
    """Parameters of the whole (unsharded) model."""
    weights_bytes: int
    """Weight bytes one GPU holds (its shard plus what is replicated)."""
    weights_naive_bytes: int
    """``params × bytes_per_param / tp`` (bytes_per_param = the format's bits / 8), for comparison."""
    replicated_bytes: int
    """Part of ``weights_bytes`` that other GPUs hold identically (norms, replicated KV heads, some biases)."""
    usable_bytes: int
    """``floor(gpu_memory × gpu_memory_utilization)``."""
    kv_budget_bytes: int
    """``usable - weights - activation_reserve - cuda_graph_reserve`` (negative: the model does not fit)."""
    kv_heads_per_gpu: int
    kv_replication: int
    """How many GPUs hold each KV head (1 unless kv_heads < tp)."""
    kv_scale_bits: int
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_token_model: int
    """Distinct KV bytes per token across the TP group (each replicated head counted once)."""
    kv_effective_bits: float
    """Bits per cached K/V element including scales."""
    max_tokens: int
    """Tokens the KV cache holds, across all concurrent requests (whole blocks)."""
    context: int
    """Context length used for the concurrency figure."""
    max_context_per_request: int
    """``min(max_tokens, max_position_embeddings)``: the longest single request that fits."""
    concurrent_sequences: int
    """Requests of ``context`` tokens that fit at once: ``max_tokens // ceil_to_block(context)``."""
    assumptions: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    formulas: tuple[str, ...] = field(default=())
    """Each result with its inputs filled in."""

    @property
    def fits(self) -> bool:
        """Weights and reserves fit, and the cache holds at least one request of ``context`` tokens (else vLLM
        refuses to start)."""
        return self.kv_budget_bytes > 0 and self.concurrent_sequences > 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: inputs (model dims included), results and the assumptions, all bytes per GPU."""
        doc = asdict(self)
        doc["inputs"]["model"] = asdict(self.inputs.model)
        doc["inputs"]["kv_scale_bits"] = self.kv_scale_bits
        doc["fits"] = self.fits
        doc["assumptions"] = list(self.assumptions)
        doc["notes"] = list(self.notes)
        doc["formulas"] = list(self.formulas)
        return doc


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def plan(inputs: BudgetInputs) -> HbmBudget:
    """Compute the HBM plan for ``inputs``.

    >>> p = plan(BudgetInputs(PRESETS["llama-3.1-8b"], tp=1, weights="bf16", kv_bits=16))
    >>> p.kv_bytes_per_token_per_gpu, p.weights_bytes   # 2 × 32 × 8 × 128 × 2; 8.03e9 params × 2 bytes
    (131072, 16060522496)
    """
    spec, tp, fmt = inputs.model, inputs.tp, WEIGHT_FORMATS[inputs.weights]
    parts = weight_parts(spec, tp)
    weights = sum(_part_bytes(p, fmt, inputs.quantize_embeddings) for p in parts)
    replicated = sum(_part_bytes(p, fmt, inputs.quantize_embeddings) for p in parts if p.replicated)
    params = count_params(spec)
    naive = params * fmt.bits // 8 // tp
    usable = math.floor(inputs.gpu_memory * inputs.gpu_memory_utilization)
    budget = usable - weights - inputs.activation_reserve - inputs.cuda_graph_reserve
    scale_bits = inputs.resolved_kv_scale_bits
    kv_spec = inputs.kv_spec
    per_token = kv_bytes_per_token(kv_spec, tp, inputs.kv_bits, inputs.kv_group_size, scale_bits)
    kv_per_gpu = max(1, kv_spec.kv_heads // tp)
    replication = max(1, tp // kv_spec.kv_heads)
    per_token_model = per_token * tp // replication
    block_bytes = inputs.block_size * per_token
    max_tokens = max(0, budget) // block_bytes * inputs.block_size
    context = inputs.context or spec.max_position or max_tokens or 1
    max_ctx = min(max_tokens, spec.max_position) if spec.max_position else max_tokens
    concurrent = max_tokens // _pad(context, inputs.block_size)
    effective_bits = per_token * 8 / (2 * spec.layers * kv_per_gpu * spec.head_dim)

    kv_desc = {
        16: "16-bit (bf16/fp16), no scales",
        8: "fp8 e4m3 with one per-tensor scale per layer (vLLM kv_cache_dtype=fp8), no per-token overhead",
    }.get(inputs.kv_bits, f"{inputs.kv_bits}-bit quantized")
    if scale_bits:
        kv_desc += (
            f" + {scale_bits} bits of scale per {inputs.kv_group_size} elements "
            f"(+{scale_bits / inputs.kv_group_size:.3f} bit/element; --kv-scale-bits/--kv-group-size)"
        )
    elif inputs.kv_bits < 16 and inputs.kv_bits != 8:
        kv_desc += ", scale overhead ignored (--kv-scale-bits 0)"
    head_note = "" if kv_spec is spec else f" (--kv-heads what-if; the model has {spec.kv_heads})"
    assumptions = [
        f"GPU memory: {inputs.gpu_memory // MIB} MiB = {inputs.gpu_memory / 1e9:.2f} GB = "
        f"{_gib(inputs.gpu_memory)} per GPU, as nvidia-smi reports it (H200: 143771 MiB, sold as '141 GB')",
        f"gpu_memory_utilization {inputs.gpu_memory_utilization:g}: vLLM budgets weights + activations + KV cache "
        f"within {_gib(usable)}; the remaining {_gib(inputs.gpu_memory - usable)} is headroom "
        "(fragmentation, whatever vLLM's profiling does not see)",
        f"activation reserve {_gib(inputs.activation_reserve)} per GPU (peak activations of vLLM's profiling "
        "run + non-PyTorch memory such as NCCL buffers; take it from your vLLM start-up log)",
        f"CUDA-graph reserve {_gib(inputs.cuda_graph_reserve)} per GPU (0 with --enforce-eager)",
        f"weights: {fmt.describe}; "
        + (
            "embeddings and lm_head quantized too"
            if inputs.quantize_embeddings and fmt.name != "bf16"
            else "embeddings, lm_head, norms and biases at 16 bits"
        ),
        f"tensor parallel {tp}: column/row-parallel linears, vocab-parallel embeddings (vocab padded to a multiple "
        f"of {_VOCAB_PADDING}); replicated on every GPU: layer norms"
        + (
            f", K/V weights and cache (kv_heads {kv_spec.kv_heads} < tp {tp}: each KV head on {replication} GPUs)"
            if replication > 1
            else ""
        ),
        f"KV cache: {kv_spec.kv_heads} KV heads{head_note} × head_dim {spec.head_dim} × {spec.layers} layers, "
        f"{kv_per_gpu} KV head(s) per GPU; {kv_desc}",
        f"KV cache paged in blocks of {inputs.block_size} tokens; capacity rounded down to whole blocks",
        f"every request's KV lives on all {tp} GPU(s) (each its own heads): the group holds as many tokens as one GPU",
        "not modelled: pipeline parallelism, prefix caching, speculative decoding, sliding-window layers, LoRA",
    ]
    if spec.tied_embeddings:
        assumptions.append("tied embeddings: lm_head shares embed_tokens (counted once)")
    vec_data = _ceil_div(kv_spec.head_dim * inputs.kv_bits, 8)
    vec_scale = _ceil_div(_ceil_div(kv_spec.head_dim, inputs.kv_group_size) * scale_bits, 8)
    formulas = (
        f"params = {params:,} (embeddings, attention, MLP, norms{', lm_head' if not spec.tied_embeddings else ''})",
        f"weights per GPU = {weights:,} B = {_gib(weights)} (params × {fmt.bits / 8:g} B / tp {tp} would be "
        f"{_gib(naive)}; the difference: 16-bit embeddings and norms, replicated parts {_gib(replicated)}, vocab "
        "padding, scales)",
        f"usable = {inputs.gpu_memory:,} B × {inputs.gpu_memory_utilization:g} = {usable:,} B = {_gib(usable)}",
        f"KV budget = usable - weights - activation reserve - CUDA graphs = {_gib(usable)} - {_gib(weights)} - "
        f"{_gib(inputs.activation_reserve)} - {_gib(inputs.cuda_graph_reserve)} = {_gib(budget)}",
        f"KV bytes/token/GPU = 2 × {kv_spec.layers} layers × {kv_per_gpu} KV head(s) × "
        f"(ceil({kv_spec.head_dim} × {inputs.kv_bits} / 8) = {vec_data} B"
        + (
            f" + ceil(ceil({kv_spec.head_dim} / {inputs.kv_group_size}) × {scale_bits} / 8) = {vec_scale} B"
            if scale_bits
            else ""
        )
        + f") = {per_token:,} B ({effective_bits:.3f} bits/element)",
        f"max tokens = floor({max(0, budget):,} / ({inputs.block_size} × {per_token:,})) × {inputs.block_size} "
        f"= {max_tokens:,}",
        f"max context per request = min({max_tokens:,}, max_position_embeddings "
        f"{f'{spec.max_position:,}' if spec.max_position else 'unknown'}) = {max_ctx:,}",
        f"concurrent sequences = floor({max_tokens:,} / {_pad(context, inputs.block_size):,}) = {concurrent:,}",
    )
    notes = []
    if budget <= 0:
        notes.append(
            f"does not fit: weights {_gib(weights)} + reserves "
            f"{_gib(inputs.activation_reserve + inputs.cuda_graph_reserve)} exceed the usable "
            f"{_gib(usable)} per GPU; raise --tp, quantize weights, or raise --gpu-memory-utilization"
        )
    elif budget < block_bytes:
        notes.append(
            f"does not fit: the KV budget {_gib(budget)} is less than one cache block ({inputs.block_size} "
            f"tokens × {per_token:,} B = {_gib(block_bytes)}); free memory as above or lower --block-size"
        )
    elif spec.max_position and max_tokens > spec.max_position:
        notes.append(
            f"the cache holds {max_tokens:,} tokens but one request is capped at max_position_embeddings "
            f"{spec.max_position:,}; the rest serves other requests"
        )
    if spec.max_position and context > spec.max_position:
        notes.append(f"--context {context:,} exceeds the model's max_position_embeddings {spec.max_position:,}")
    if 0 < max_tokens < context:
        notes.append(
            f"a {context:,}-token request does not fit in the cache ({max_tokens:,} tokens): vLLM would "
            f"refuse to start with max_model_len {context:,}; lower --context"
        )
    return HbmBudget(
        inputs=inputs,
        params=params,
        weights_bytes=weights,
        weights_naive_bytes=naive,
        replicated_bytes=replicated,
        usable_bytes=usable,
        kv_budget_bytes=budget,
        kv_heads_per_gpu=kv_per_gpu,
        kv_replication=replication,
        kv_scale_bits=scale_bits,
        kv_bytes_per_token_per_gpu=per_token,
        kv_bytes_per_token_model=per_token_model,
        kv_effective_bits=effective_bits,
        max_tokens=max_tokens,
        context=context,
        max_context_per_request=max_ctx,
        concurrent_sequences=concurrent,
        assumptions=tuple(assumptions),
        notes=tuple(notes),
        formulas=formulas,
    )
