"""Tensor-parallel sharding rules for the Llama family, as vLLM applies them.

Per rank ``r`` of ``tp`` (heads ``H``, KV heads ``K``, head size ``d``, intermediate ``I``,
vocabulary ``V`` padded to ``Vp``, a multiple of 64):

* column-parallel (split the output rows): ``q_proj`` rows ``[r·H/tp·d, (r+1)·H/tp·d)``;
  ``gate_proj``/``up_proj`` rows ``[r·I/tp, (r+1)·I/tp)``; their biases alike.
* ``k_proj``/``v_proj``: split like ``q_proj`` when ``K >= tp``; when ``K < tp`` each KV head is
  replicated on ``tp/K`` ranks and rank ``r`` holds head ``r // (tp/K)`` (vLLM's QKVParallelLinear).
* row-parallel (split the input columns): ``o_proj`` and ``down_proj``; their biases replicated.
* vocab-parallel: ``embed_tokens`` and ``lm_head`` rows ``[r·Vp/tp, (r+1)·Vp/tp)``; in the vllm layout
  rows past ``V`` are zero-filled (vLLM's VocabParallelEmbedding with padding 64), in the hf layout
  a rank holds only the real rows of its range.
* replicated: every norm.

Layouts: ``vllm`` fuses per rank as vLLM's model parameters are named and shaped
(``self_attn.qkv_proj`` = q, k, v rows stacked; ``mlp.gate_up_proj`` = gate, up rows stacked;
with tied embeddings only ``lm_head.weight``, the name vLLM's ``sharded_state`` loader keeps);
``hf`` keeps the Hugging Face names, one slice per rank. The vllm layout also holds the entries vLLM's
attention layers register and no HF checkpoint has (:func:`vllm_attention_state`), so a rank's
file is exactly the model's state dict at that tensor-parallel size.

Each planned output tensor is an :class:`OutTensor`: *pieces* of source tensors, concatenated
along one dimension and zero-padded, optionally quantized to FP8. Nothing here reads data.

>>> spec = ModelSpec.from_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
...     "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
...     "num_hidden_layers": 32, "vocab_size": 128256})
>>> {t.name: t.shape for t in rank_tensors(spec, tp=2, rank=0, layout="vllm")}["model.layers.0.self_attn.qkv_proj.weight"]
(3072, 4096)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gdsload.loader.errors import GdsloadError
from gdsload.loader.prepare.quantize import QuantScheme

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "VOCAB_PADDING",
    "LAYOUTS",
    "EngineState",
    "vllm_attention_state",
    "UnsupportedModelError",
    "ShardConfigError",
    "SourceCheckpointError",
    "ModelSpec",
    "Piece",
    "OutTensor",
    "padded_vocab",
    "valid_tp_sizes",
    "check_tp",
    "expected_tensors",
    "rank_tensors",
]

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
"""Architectures ``gdsload shard`` knows (config.json ``architectures[0]``) -> ``model_type``."""

VOCAB_PADDING = 64
"""vLLM pads the vocabulary of embeddings and lm_head to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE)."""

LAYOUTS = ("vllm", "hf")

@dataclass(frozen=True)
class EngineState:
    """A tensor the engine's attention layer registers that no Hugging Face checkpoint holds.

    vLLM's ``sharded_state`` loader (and gdsload's strict mode) want every entry of the model's
    state dict, so the vllm layout stores these with the value vLLM gives them when a checkpoint
    lacks them; vLLM then derives its attention scales from them after loading, exactly as it
    does for an ordinary checkpoint.
    """

    name: str
    """Name under ``model.layers.N.self_attn.attn.``."""
    shape: tuple[int, ...]
    dtype: str | None
    """safetensors dtype; None: the model's dtype (what vLLM's default dtype is while it builds the model)."""
    fill: float


def vllm_attention_state(quant: QuantScheme | None) -> tuple[EngineState, ...]:
    """The attention-layer entries of vLLM's state dict (vLLM 0.32) for a model quantized with ``quant``.

    Every attention layer registers the buffers ``_k_scale``, ``_v_scale``, ``_q_scale`` and
    ``_prob_scale`` (fp32 scalars, 1.0). A quantized model's KV-cache method adds parameters:
    vLLM's ``fp8`` method (per-tensor) ``q_scale``, ``k_scale``, ``v_scale``, ``prob_scale``
    (scalars in the model dtype, -1.0: "not calibrated", after which vLLM uses 1.0);
    ``compressed-tensors`` (per-channel) ``q_scale``, ``k_scale``, ``v_scale`` (fp32 ``[1]``, 1.0)
    and ``q_zero_point``, ``k_zero_point``, ``v_zero_point`` (model dtype ``[1]``, 0.0).

    >>> [s.name for s in vllm_attention_state(None)]
    ['_k_scale', '_v_scale', '_q_scale', '_prob_scale']
    """
    out = [EngineState(n, (), "F32", 1.0) for n in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")]
    if quant is None:
        return tuple(out)
    if not quant.per_channel:
        return tuple(EngineState(n, (), None, -1.0) for n in ("q_scale", "k_scale", "v_scale", "prob_scale")) + \
            tuple(out)
    scales = [EngineState(n, (1,), "F32", 1.0) for n in ("k_scale", "v_scale", "q_scale")]
    zeros = [EngineState(n, (1,), None, 0.0) for n in ("k_zero_point", "v_zero_point", "q_zero_point")]
    return tuple(scales + zeros + out)


class UnsupportedModelError(GdsloadError, ValueError):
    """config.json describes an architecture (or a quantized checkpoint) ``gdsload shard`` can't shard."""


class ShardConfigError(GdsloadError, ValueError):
    """The tensor-parallel size doesn't divide the model's heads, intermediate size or vocabulary."""


class SourceCheckpointError(GdsloadError, ValueError):
    """The source checkpoint lacks tensors, has unexpected ones, or has wrong shapes or dtypes."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts of a Llama-family model, read from its config.json."""

    architecture: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2; Llama with ``attention_bias``)."""
    o_bias: bool = False
    """o_proj carries a bias (Llama with ``attention_bias``)."""
    mlp_bias: bool = False
    """gate/up/down projections carry a bias (Llama with ``mlp_bias``)."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, where: str = "config.json") -> ModelSpec:
        """Validate a config.json dict; raises :class:`UnsupportedModelError` for anything else.

        >>> ModelSpec.from_config(json.load(open("config.json"))).kv_heads  # doctest: +SKIP
        8
        """
        archs = config.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            mt = config.get("model_type")
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            if arch is None and mt in by_type:
                arch = by_type[mt]
            else:
                raise UnsupportedModelError(
                    f"{where!r}: architecture {arch!r} (model_type {mt!r}) is not supported by `gdsload shard`; "
                    f"it shards the Llama family: {', '.join(SUPPORTED_ARCHITECTURES)}. Shard other models with "
                    "their engine's own tool (e.g. vLLM's save_sharded_state) and load them with gdsload"
                )
        qc = config.get("quantization_config")
        if qc:
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise UnsupportedModelError(
                f"{where!r}: the checkpoint is already quantized (quantization_config.quant_method={method!r}); "
                "`gdsload shard` needs the unquantized bf16/fp16/fp32 checkpoint (add --quantize fp8 to quantize it)"
            )

        def need(key: str) -> int:
            value = config.get(key)
            if type(value) is not int or value < 1:
                raise UnsupportedModelError(f"{where!r}: {key} must be a positive integer, got {value!r}")
            return value

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = heads if config.get("num_key_value_heads") is None else config["num_key_value_heads"]
        head_dim = hidden // heads if config.get("head_dim") is None else config["head_dim"]
        if type(kv_heads) is not int or kv_heads < 1 or heads % kv_heads:
            raise UnsupportedModelError(
                f"{where!r}: num_key_value_heads={kv_heads!r} must be a positive divisor of num_attention_heads={heads}"
            )
        if type(head_dim) is not int or head_dim < 1:
            raise UnsupportedModelError(f"{where!r}: head_dim must be a positive integer, got {head_dim!r}")
        model_type = SUPPORTED_ARCHITECTURES[arch]
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            architecture=arch,
            hidden=hidden,
            intermediate=need("intermediate_size"),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=need("vocab_size"),
            layers=need("num_hidden_layers"),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
        )


def padded_vocab(vocab: int, pad_to: int = VOCAB_PADDING) -> int:
    """``vocab`` rounded up to a multiple of ``pad_to`` (vLLM's ``pad_vocab_size``).

    >>> padded_vocab(151936), padded_vocab(32001)
    (151936, 32064)
    """
    return -(-vocab // pad_to) * pad_to


def _tp_problems(spec: ModelSpec, tp: int) -> list[str]:
    out = []
    if spec.heads % tp:
        out.append(f"num_attention_heads={spec.heads} is not divisible by tp={tp}")
    if spec.kv_heads >= tp and spec.kv_heads % tp:
        out.append(f"num_key_value_heads={spec.kv_heads} is not divisible by tp={tp}")
    if spec.kv_heads < tp and tp % spec.kv_heads:
        out.append(f"tp={tp} is not a multiple of num_key_value_heads={spec.kv_heads} (KV heads can't be replicated evenly)")
    if spec.intermediate % tp:
        out.append(f"intermediate_size={spec.intermediate} is not divisible by tp={tp}")
    vp = padded_vocab(spec.vocab)
    if vp % tp:
        out.append(f"the vocabulary padded to a multiple of {VOCAB_PADDING} ({spec.vocab} -> {vp}) is not divisible by tp={tp}")
    return out


def valid_tp_sizes(spec: ModelSpec, limit: int = 64) -> list[int]:
    """Every TP size up to ``limit`` that shards this model evenly.

    >>> valid_tp_sizes(spec, limit=8)  # 32 heads, 8 KV heads  # doctest: +SKIP
    [1, 2, 4, 8]
    """
    return [t for t in range(1, limit + 1) if not _tp_problems(spec, t)]


def check_tp(spec: ModelSpec, tp: int, *, where: str = "config.json") -> None:
    """Raise :class:`ShardConfigError`, with the numbers, when ``tp`` doesn't shard ``spec`` evenly.

    >>> check_tp(spec, 3)  # doctest: +SKIP
    ShardConfigError: 'config.json': cannot shard LlamaForCausalLM for tp=3: num_attention_heads=32 is not ...
    """
    if type(tp) is not int or tp < 1:
        raise ShardConfigError(f"tp={tp!r} must be a positive integer")
    problems = _tp_problems(spec, tp)
    if problems:
        raise ShardConfigError(
            f"{where!r}: cannot shard {spec.architecture} for tp={tp}: {'; '.join(problems)}. "
            f"TP sizes that work for this model: {', '.join(map(str, valid_tp_sizes(spec)))}"
        )


def expected_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``spec`` holds, name -> shape, in model order.

    >>> expected_tensors(spec)["model.layers.0.self_attn.k_proj.weight"]  # doctest: +SKIP
    (1024, 4096)
    """
    h, d, i = spec.hidden, spec.head_dim, spec.intermediate
    q, kv = spec.heads * d, spec.kv_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab, h)}
    for layer in range(spec.layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = (h,)
        for name, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            out[f"{p}self_attn.{name}.weight"] = (rows, cols)
            if spec.qkv_bias and name != "o_proj" or spec.o_bias and name == "o_proj":
                out[f"{p}self_attn.{name}.bias"] = (rows,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        for name, rows, cols in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
            out[f"{p}mlp.{name}.weight"] = (rows, cols)
            if spec.mlp_bias:
                out[f"{p}mlp.{name}.bias"] = (rows,)
    out["model.norm.weight"] = (h,)
    if not spec.tie_embeddings:
        out["lm_head.weight"] = (spec.vocab, h)
    return out


@dataclass(frozen=True)
class Piece:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of one source tensor."""

    source: str
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class OutTensor:
    """One tensor of one rank's output, and how to build it from the source.

    ``op`` is ``copy`` (pieces, source dtype), ``fp8`` (pieces, each quantized with its source's
    scale), ``fp8_scale`` (the fp32 scales ``scale_of``'s pieces were quantized with) or ``fill``
    (a constant). Pieces are concatenated along ``dim`` (None: the one piece is the whole
    source), then ``pad`` zero rows are appended.
    """

    name: str
    shape: tuple[int, ...]
    op: str = "copy"
    dim: int | None = None
    pieces: tuple[Piece, ...] = ()
    pad: int = 0
    scale_of: str | None = None
    """For ``fp8_scale``: the ``fp8`` output tensor whose scales these are."""
    fill: float = 0.0
    dtype: str | None = None
    """For ``fill``: the safetensors dtype (None: the model's dtype)."""
    split: str = "replicate"
    """``column``, ``row``, ``vocab``, ``replicate``: how the tensor is split, for the manifest's plan."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.source for p in self.pieces))


class _Ranges:
    """Row/column ranges of one rank, per the rules in the module docstring."""

    def __init__(self, spec: ModelSpec, tp: int, rank: int):
        d = spec.head_dim
        qh = spec.heads // tp
        kvh = max(1, spec.kv_heads // tp)
        replicas = tp // spec.kv_heads if spec.kv_heads < tp else 1
        kv_first = (rank // replicas) * kvh
        self.q = (rank * qh * d, (rank + 1) * qh * d)
        self.kv = (kv_first * d, (kv_first + kvh) * d)
        per_i = spec.intermediate // tp
        self.mlp = (rank * per_i, (rank + 1) * per_i)
        per_v = padded_vocab(spec.vocab) // tp
        start = min(rank * per_v, spec.vocab)
        stop = min((rank + 1) * per_v, spec.vocab)
        self.vocab = (start, stop)
        self.vocab_rows = per_v


def _piece(source: str, rng: tuple[int, int]) -> Piece:
    return Piece(source, rng[0], rng[1])


def rank_tensors(
    spec: ModelSpec,
    tp: int,
    rank: int,
    layout: str,
    quant: QuantScheme | None = None,
) -> list[OutTensor]:
    """The output tensors of ``rank``, in model order.

    >>> names = [t.name for t in rank_tensors(spec, 4, 3, "hf")]  # doctest: +SKIP
    """
    if layout not in LAYOUTS:
        raise ShardConfigError(f"layout {layout!r} is not known; choose one of {', '.join(LAYOUTS)}")
    if not 0 <= rank < tp:
        raise ShardConfigError(f"rank {rank} is outside 0..{tp - 1}")
    check_tp(spec, tp)
    rg = _Ranges(spec, tp, rank)
    h = spec.hidden
    out: list[OutTensor] = []

    def replicate(name: str, shape: tuple[int, ...], source: str | None = None) -> None:
        src = source or name
        out.append(OutTensor(name, shape, "copy", None, (Piece(src, 0, shape[0]),)))

    def linear(name: str, pieces: list[Piece], dim: int, other: int, split: str) -> None:
        """A (possibly fused) linear weight: pieces along ``dim``, ``other`` the size of the
        unsplit dimension; quantized when asked."""
        n = sum(p.length for p in pieces)
        shape = (n, other) if dim == 0 else (other, n)
        if quant is None:
            out.append(OutTensor(name + ".weight", shape, "copy", dim, tuple(pieces), split=split))
            return
        out.append(OutTensor(name + ".weight", shape, "fp8", dim, tuple(pieces), split=split,
                             meta={"granularity": quant.granularity}))
        if quant.per_channel:
            scale_shape: tuple[int, ...] = (shape[0], 1)
            scale_split = split if dim == 0 else "replicate"
        elif layout == "vllm":
            scale_shape, scale_split = (len(pieces),), "replicate"
        else:
            scale_shape, scale_split = (), "replicate"
        out.append(OutTensor(name + ".weight_scale", scale_shape, "fp8_scale", dim, tuple(pieces),
                             scale_of=name + ".weight", split=scale_split,
                             meta={"granularity": quant.granularity}))

    def bias(name: str, pieces: list[Piece], split: str) -> None:
        n = sum(p.length for p in pieces)
        out.append(OutTensor(name + ".bias", (n,), "copy", 0, tuple(pieces), split=split))

    def vocab(name: str, source: str) -> None:
        # A rank past the vocabulary holds padding only: an empty piece still names the source (its dtype).
        # The hf layout keeps the real rows only (at tp=1: the source's own shape).
        pieces = (_piece(source, rg.vocab),)
        rows = rg.vocab[1] - rg.vocab[0]
        pad = rg.vocab_rows - rows if layout == "vllm" else 0
        out.append(OutTensor(name, (rows + pad, h), "copy", 0, pieces, pad=pad, split="vocab"))

    if layout == "hf" or not spec.tie_embeddings:
        vocab("model.embed_tokens.weight", "model.embed_tokens.weight")
    for layer in range(spec.layers):
        p = f"model.layers.{layer}."
        a, m = p + "self_attn.", p + "mlp."
        replicate(p + "input_layernorm.weight", (h,))
        if layout == "vllm":
            qkv = [_piece(a + "q_proj.weight", rg.q), _piece(a + "k_proj.weight", rg.kv),
                   _piece(a + "v_proj.weight", rg.kv)]
            linear(a + "qkv_proj", qkv, 0, h, "column")
            if spec.qkv_bias:
                bias(a + "qkv_proj", [_piece(a + f"{x}_proj.bias", r) for x, r in
                                      (("q", rg.q), ("k", rg.kv), ("v", rg.kv))], "column")
        else:
            for x, r in (("q", rg.q), ("k", rg.kv), ("v", rg.kv)):
                linear(a + f"{x}_proj", [_piece(a + f"{x}_proj.weight", r)], 0, h, "column")
                if spec.qkv_bias:
                    bias(a + f"{x}_proj", [_piece(a + f"{x}_proj.bias", r)], "column")
        linear(a + "o_proj", [_piece(a + "o_proj.weight", rg.q)], 1, h, "row")
        if spec.o_bias:
            replicate(a + "o_proj.bias", (h,))
        if layout == "vllm":
            for st in vllm_attention_state(quant):
                out.append(OutTensor(a + "attn." + st.name, st.shape, "fill", fill=st.fill, dtype=st.dtype))
        replicate(p + "post_attention_layernorm.weight", (h,))
        if layout == "vllm":
            linear(m + "gate_up_proj", [_piece(m + "gate_proj.weight", rg.mlp),
                                        _piece(m + "up_proj.weight", rg.mlp)], 0, h, "column")
            if spec.mlp_bias:
                bias(m + "gate_up_proj", [_piece(m + "gate_proj.bias", rg.mlp),
                                          _piece(m + "up_proj.bias", rg.mlp)], "column")
        else:
            for x in ("gate", "up"):
                linear(m + f"{x}_proj", [_piece(m + f"{x}_proj.weight", rg.mlp)], 0, h, "column")
                if spec.mlp_bias:
                    bias(m + f"{x}_proj", [_piece(m + f"{x}_proj.bias", rg.mlp)], "column")
        linear(m + "down_proj", [_piece(m + "down_proj.weight", rg.mlp)], 1, h, "row")
        if spec.mlp_bias:
            replicate(m + "down_proj.bias", (h,))
    replicate("model.norm.weight", (h,))
    if layout == "vllm" or not spec.tie_embeddings:
        vocab("lm_head.weight", "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight")
    return out
