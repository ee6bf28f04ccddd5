"""Reproducible synthetic Llama-shaped checkpoints, for demos, tests and benchmarks.

Values are N(0, 0.02) in bf16 (what trained weights look like to a codec), each tensor seeded
from its name so every rank and every run sees the same numbers. Shapes follow the Llama
family; the number of layers is chosen to reach the requested size (9.08 GB at Llama-3-8B
widths with 16 layers). With ``experts``, each layer's MLP is a Mixtral mixture of experts
(``block_sparse_moe.gate`` and ``experts.{e}.w1/w2/w3``, top-2 routing) and the config a
``MixtralForCausalLM``'s.

Rank files split column-parallel weights (q/k/v, gate/up, embedding, lm_head) along dim 0 and
row-parallel ones (o, down) along dim 1, with norms replicated: a plain ``hf``-layout split, by whole
heads. With fewer KV heads than ranks, each KV head is replicated on ``tp / kv_heads`` ranks, as
``gdsload shard`` and vLLM place them.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..calc.capacity import kv_heads_split
from ..errors import ConfigError
from ..format.writer import AlignedWriter, TensorSpec
from ..format.manifest import write_manifest

__all__ = [
    "LlamaShape",
    "PRESETS",
    "shape_for_size",
    "model_bytes",
    "tensor_shapes",
    "make_checkpoint",
    "make_hf_checkpoint",
    "file_groups",
    "write_tokenizer",
]


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int
    experts: int = 0
    """Experts of each layer's mixture-of-experts MLP (Mixtral); 0: a dense MLP (Llama)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config_json(self) -> dict[str, object]:
        """A transformers ``LlamaConfig`` (``MixtralConfig`` with experts) for these shapes."""
        moe = (
            {"num_local_experts": self.experts, "num_experts_per_tok": 2, "sliding_window": None}
            if self.experts
            else {}
        )
        return {
            "architectures": ["MixtralForCausalLM" if self.experts else "LlamaForCausalLM"],
            "model_type": "mixtral" if self.experts else "llama",
            **moe,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }


PRESETS: dict[str, LlamaShape] = {
    "tiny": LlamaShape(hidden=256, intermediate=688, heads=8, kv_heads=4, vocab=4096, layers=2),
    "small": LlamaShape(hidden=1024, intermediate=2816, heads=16, kv_heads=4, vocab=32000, layers=4),
    "1b": LlamaShape(hidden=2048, intermediate=5632, heads=16, kv_heads=4, vocab=32000, layers=8),
    "8b": LlamaShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, layers=32),
}


def tensor_shapes(s: LlamaShape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, split)`` for every tensor; split is ``col``, ``row``, ``kv`` (column-parallel by whole
    KV heads, replicated when there are fewer than ranks) or ``rep``."""
    d = s.head_dim
    yield "model.embed_tokens.weight", (s.vocab, s.hidden), "col"
    for i in range(s.layers):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", (s.heads * d, s.hidden), "col"
        yield p + "self_attn.k_proj.weight", (s.kv_heads * d, s.hidden), "kv"
        yield p + "self_attn.v_proj.weight", (s.kv_heads * d, s.hidden), "kv"
        yield p + "self_attn.o_proj.weight", (s.hidden, s.heads * d), "row"
        if s.experts:
            yield p + "block_sparse_moe.gate.weight", (s.experts, s.hidden), "rep"
            for e in range(s.experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                yield q + "w1.weight", (s.intermediate, s.hidden), "col"
                yield q + "w2.weight", (s.hidden, s.intermediate), "row"
                yield q + "w3.weight", (s.intermediate, s.hidden), "col"
        else:
            yield p + "mlp.gate_proj.weight", (s.intermediate, s.hidden), "col"
            yield p + "mlp.up_proj.weight", (s.intermediate, s.hidden), "col"
            yield p + "mlp.down_proj.weight", (s.hidden, s.intermediate), "row"
        yield p + "input_layernorm.weight", (s.hidden,), "rep"
        yield p + "post_attention_layernorm.weight", (s.hidden,), "rep"
    yield "model.norm.weight", (s.hidden,), "rep"
    yield "lm_head.weight", (s.vocab, s.hidden), "col"


def model_bytes(s: LlamaShape) -> int:
    """The checkpoint's size: every tensor's bf16 bytes, once (a tensor-parallel split writes the replicated
    ones once per rank on top)."""
    return sum(math.prod(shape) for _, shape, _ in tensor_shapes(s)) * 2


def shape_for_size(nbytes: int, experts: int = 0) -> LlamaShape:
    """The widest preset whose embedding and head stay under a third of ``nbytes``, with as many
    layers as fit (at least one); with ``experts``, a Mixtral of that width.

    >>> shape_for_size(2 << 30, experts=8).experts
    8
    """
    best = LlamaShape(**{**asdict(PRESETS["tiny"]), "experts": experts})
    for shape in PRESETS.values():
        shape = LlamaShape(**{**asdict(shape), "experts": experts})
        fixed = model_bytes(LlamaShape(**{**asdict(shape), "layers": 0}))
        if fixed <= nbytes / 3:
            best = shape
    fixed = model_bytes(LlamaShape(**{**asdict(best), "layers": 0}))
    per_layer = model_bytes(LlamaShape(**{**asdict(best), "layers": 1})) - fixed
    layers = max(1, round((nbytes - fixed) / per_layer))
    return LlamaShape(**{**asdict(best), "layers": layers})


def _full_tensor(name: str, shape: tuple[int, ...], device: str = "cpu") -> torch.Tensor:
    """N(0, 0.02) bf16 values seeded by the tensor's name: the same bytes on every run on the same
    kind of ``device`` (CPU and CUDA generators give different, equally distributed, values)."""
    g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    if len(shape) == 1:  # norms: around 1, like trained RMSNorm weights
        t = 1.0 + 0.02 * torch.randn(shape, generator=g, device=device)
    else:
        t = 0.02 * torch.randn(shape, generator=g, device=device)
    return t.to(torch.bfloat16).cpu()


def _rank_rows(s: LlamaShape, split: str, rank: int, tp: int, size: int) -> tuple[int, int]:
    """``[start, stop)`` of the split dimension (of ``size``) that ``rank`` holds."""
    if split == "kv" and s.kv_heads < tp:  # one KV head, shared by tp / kv_heads ranks
        head = rank // (tp // s.kv_heads)
        return head * s.head_dim, (head + 1) * s.head_dim
    step = size // tp
    return rank * step, (rank + 1) * step


def _rank_slice(t: torch.Tensor, s: LlamaShape, split: str, rank: int, tp: int) -> torch.Tensor:
    if split == "rep" or tp == 1:
        return t
    dim = 1 if split == "row" else 0
    start, stop = _rank_rows(s, split, rank, tp, t.shape[dim])
    return t.narrow(dim, start, stop - start)


def _check_tp(s: LlamaShape, tp: int) -> None:
    if type(tp) is not int or tp < 1:
        raise ConfigError(f"tp={tp!r} must be a positive integer")
    if s.heads % tp or not kv_heads_split(s.kv_heads, tp) or s.intermediate % tp or s.vocab % tp:
        ok = [
            n
            for n in range(1, s.heads + 1)
            if not s.heads % n and not s.intermediate % n and not s.vocab % n and kv_heads_split(s.kv_heads, n)
        ]
        raise ConfigError(
            f"tp={tp} does not split this synthetic shape by whole heads (heads={s.heads}, "
            f"kv_heads={s.kv_heads}, intermediate={s.intermediate}, vocab={s.vocab}); "
            f"tp values that do: {ok}"
        )


def make_checkpoint(
    out: str | os.PathLike[str],
    shape: LlamaShape | str | int = "tiny",
    *,
    tp: int = 1,
    max_file_bytes: int = 5 << 30,
    progress: Callable[[int], None] | None = None,
    device: str = "cpu",
) -> Path:
    """Write a synthetic checkpoint as ``model-rank-{r}-part-{p}.safetensors`` + ``gdsload.json``.

    ``shape`` is a :class:`LlamaShape`, a preset name or a target size in bytes; ``progress`` is
    called with the byte count of each tensor written. ``device="cuda"`` draws the random values
    on the GPU (tens of times faster for multi-GB models; recorded in the manifest, since the
    values differ from a CPU-drawn model of the same shape).

    >>> make_checkpoint("/tmp/m", "tiny", tp=2)  # doctest: +SKIP
    """
    if isinstance(shape, str):
        shape = PRESETS[shape]
    elif isinstance(shape, int):
        shape = shape_for_size(shape)
    entries = list(tensor_shapes(shape))
    _check_tp(shape, tp)  # before anything is written
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    full_shapes = {name: s for name, s, _ in entries}
    ranks: dict[int, list[str]] = {}
    digests: dict[str, str] = {}
    for rank in range(tp):
        # Group tensors into files of at most max_file_bytes, in model order.
        files: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
        size = 0
        for name, full, split in entries:
            part_shape = list(full)
            if split != "rep" and tp > 1:
                dim = 1 if split == "row" else 0
                start, stop = _rank_rows(shape, split, rank, tp, full[dim])
                part_shape[dim] = stop - start
            nbytes = math.prod(part_shape) * 2
            if files[-1] and size + nbytes > max_file_bytes:
                files.append([])
                size = 0
            files[-1].append((name, tuple(part_shape), split))
            size += nbytes
        for part, group in enumerate(files):
            fname = f"model-rank-{rank}-part-{part}.safetensors"
            specs = [TensorSpec(name, "BF16", s) for name, s, _ in group]
            splits = {name: split for name, _, split in group}
            with AlignedWriter(out / fname, specs, {"format": "pt"}) as w:
                for spec in w.order:
                    t = _rank_slice(
                        _full_tensor(spec.name, full_shapes[spec.name], device), shape, splits[spec.name], rank, tp
                    )
                    w.write(spec.name, t.contiguous())
                    if progress is not None:
                        progress(spec.nbytes)
            ranks.setdefault(rank, []).append(fname)
            if w.digest is not None:
                digests[fname] = w.digest
    (out / "config.json").write_text(json.dumps(shape.config_json(), indent=2) + "\n")
    write_manifest(
        out,
        ranks,
        tp_size=tp,
        layout="hf",
        digests=digests,
        extra={"synthetic": {**asdict(shape), "generator": torch.device(device).type}},
    )
    return out


def file_groups(
    shapes: list[tuple[str, tuple[int, ...]]], max_file_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """bf16 ``(name, shape)`` pairs grouped, in order, into files of at most ``max_file_bytes`` (a larger tensor
    alone in its file)."""
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * 2
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    return groups


def write_tokenizer(out: str | os.PathLike[str], vocab: int) -> bool:
    """A word-level tokenizer of ``vocab`` words (``w0``, ``w1``, ...) for a synthetic model, so engines run it on
    text; False (nothing written) where the ``tokenizers`` package is not installed."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError:
        return False
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(Path(out) / "tokenizer.json"))
    (Path(out) / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 4096,
            },
            indent=2,
        )
        + "\n"
    )
    return True


def make_hf_checkpoint(
    out: str | os.PathLike[str],
    shape: LlamaShape | str | int,
    *,
    max_file_bytes: int = 5 << 30,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write the same model as :func:`make_checkpoint` (tp=1, the same values) the way Hugging Face publishes
    checkpoints: the ``safetensors`` library's ``save_file``, in model order, into
    ``model-0000K-of-0000N.safetensors`` parts with a ``model.safetensors.index.json``, and no ``gdsload.json``.
    The data sections start wherever the library's headers end, not at 4 KiB.

    >>> make_hf_checkpoint("/tmp/hf", "tiny", max_file_bytes=1 << 20)  # doctest: +SKIP
    """
    import safetensors.torch

    if isinstance(shape, str):
        shape = PRESETS[shape]
    elif isinstance(shape, int):
        shape = shape_for_size(shape)
    parts = file_groups([(name, full) for name, full, _ in tensor_shapes(shape)], max_file_bytes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for k, group in enumerate(parts, start=1):
        fname = f"model-{k:05d}-of-{len(parts):05d}.safetensors"
        tensors = {name: _full_tensor(name, full, device).cpu() for name, full in group}
        safetensors.torch.save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * 2
            if progress is not None:
                progress(t.numel() * 2)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(shape.config_json(), indent=2) + "\n")
    write_tokenizer(out, shape.vocab)
    return out
