"""Tiny real models for the engine tier: config.json, random bf16 weights, a word-level tokenizer.

Built in a few milliseconds each run, from a seed, with only torch, safetensors and tokenizers, under
the tensor names Hugging Face checkpoints use. Every model has grouped-query attention; ``llama-kv1`` has
a single KV head, so at tp=2 its KV head is replicated on both ranks. The others cover the families
vLLM lays out differently: mixture of experts (``mixtral``, ``qwen3-moe``), multi-head latent attention
with shared experts and a dense first layer (``deepseek-v2``, MLA head size 576, which vLLM's CPU build
supports), and per-head q/k norms (``qwen3``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

__all__ = ["MODELS", "MOE", "TinyModel", "build_model", "PROMPTS"]

PROMPTS = [[1, 4, 5, 6, 7], [1, 13, 23, 33, 43, 53, 63], [1, 10]]
"""Prompts every case generates from, as token ids: the same for every model type, whatever tokenizer class
vLLM picks for it."""


@dataclass(frozen=True)
class TinyModel:
    architecture: str
    model_type: str
    hidden: int = 256
    intermediate: int = 688
    heads: int = 8
    kv_heads: int = 4
    layers: int = 4
    vocab: int = 1000
    """Not a multiple of 64: vLLM pads embeddings and lm_head, which the shard layout must match."""
    qkv_bias: bool = False
    head_dim: int | None = None
    experts: int = 0
    """Routed experts per MoE layer (0: dense)."""
    moe_intermediate: int = 64


MODELS: dict[str, TinyModel] = {
    "llama": TinyModel("LlamaForCausalLM", "llama"),
    "qwen2": TinyModel("Qwen2ForCausalLM", "qwen2", qkv_bias=True),
    "mistral": TinyModel("MistralForCausalLM", "mistral", kv_heads=2),
    "llama-kv1": TinyModel("LlamaForCausalLM", "llama", kv_heads=1),
    "mixtral": TinyModel(
        "MixtralForCausalLM", "mixtral", hidden=128, intermediate=256, heads=4, kv_heads=2, layers=2, experts=4
    ),
    "qwen3-moe": TinyModel(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        hidden=128,
        intermediate=256,
        heads=4,
        kv_heads=2,
        layers=2,
        head_dim=32,
        experts=4,
    ),
    "deepseek-v2": TinyModel(
        "DeepseekV2ForCausalLM", "deepseek_v2", hidden=128, intermediate=256, heads=4, kv_heads=4, layers=2, experts=4
    ),
    "qwen3": TinyModel(
        "Qwen3ForCausalLM", "qwen3", hidden=128, intermediate=256, heads=4, kv_heads=2, layers=2, head_dim=32
    ),
}
MOE = ("mixtral", "qwen3-moe", "deepseek-v2")
"""The mixture-of-experts models (they shard with expert parallel too)."""

_MLA = {"kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32}
"""DeepSeek-V2's attention sizes: MLA head size kv_lora_rank + qk_rope_head_dim = 576, the one vLLM's CPU build runs."""


def _tokenizer(out: Path, vocab: int) -> None:
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 2048,
            }
        )
    )


def _config(m: TinyModel) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": [m.architecture],
        "model_type": m.model_type,
        "hidden_size": m.hidden,
        "intermediate_size": m.intermediate,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "num_hidden_layers": m.layers,
        "vocab_size": m.vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if m.head_dim is not None:
        config["head_dim"] = m.head_dim
    if m.model_type == "mistral":
        config["sliding_window"] = None
    if m.model_type == "mixtral":
        config |= {"num_local_experts": m.experts, "num_experts_per_tok": 2, "sliding_window": None}
    if m.model_type == "qwen3_moe":
        config |= {
            "num_experts": m.experts,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": m.moe_intermediate,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        }
    if m.model_type == "deepseek_v2":
        config |= {
            **_MLA,
            "n_routed_experts": m.experts,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": m.moe_intermediate,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "greedy",
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "rms_norm_eps": 1e-6,
        }
    return config


def _layer(m: TinyModel, i: int, rnd: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of layer ``i`` under Hugging Face's names."""
    p = f"model.layers.{i}."
    h, d = m.hidden, m.head_dim or m.hidden // m.heads
    w = {p + "input_layernorm.weight": rnd(h, mean=1.0), p + "post_attention_layernorm.weight": rnd(h, mean=1.0)}
    if m.model_type == "deepseek_v2":
        rope, nope, v, lora = (
            _MLA["qk_rope_head_dim"],
            _MLA["qk_nope_head_dim"],
            _MLA["v_head_dim"],
            _MLA["kv_lora_rank"],
        )
        w |= {
            p + "self_attn.q_proj.weight": rnd(m.heads * (nope + rope), h),
            p + "self_attn.kv_a_proj_with_mqa.weight": rnd(lora + rope, h),
            p + "self_attn.kv_a_layernorm.weight": rnd(lora, mean=1.0),
            p + "self_attn.kv_b_proj.weight": rnd(m.heads * (nope + v), lora),
            p + "self_attn.o_proj.weight": rnd(h, m.heads * v),
        }
    else:
        w |= {
            p + "self_attn.q_proj.weight": rnd(m.heads * d, h),
            p + "self_attn.k_proj.weight": rnd(m.kv_heads * d, h),
            p + "self_attn.v_proj.weight": rnd(m.kv_heads * d, h),
            p + "self_attn.o_proj.weight": rnd(h, m.heads * d),
        }
        if m.qkv_bias:
            w |= {
                p + "self_attn.q_proj.bias": rnd(m.heads * d),
                p + "self_attn.k_proj.bias": rnd(m.kv_heads * d),
                p + "self_attn.v_proj.bias": rnd(m.kv_heads * d),
            }
        if m.model_type in ("qwen3", "qwen3_moe"):
            w |= {p + "self_attn.q_norm.weight": rnd(d, mean=1.0), p + "self_attn.k_norm.weight": rnd(d, mean=1.0)}

    def mlp(prefix: str, inter: int) -> dict[str, torch.Tensor]:
        return {
            prefix + "gate_proj.weight": rnd(inter, h),
            prefix + "up_proj.weight": rnd(inter, h),
            prefix + "down_proj.weight": rnd(h, inter),
        }

    if m.model_type == "mixtral":
        w[p + "block_sparse_moe.gate.weight"] = rnd(m.experts, h)
        for e in range(m.experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            w |= {
                q + "w1.weight": rnd(m.intermediate, h),
                q + "w2.weight": rnd(h, m.intermediate),
                q + "w3.weight": rnd(m.intermediate, h),
            }
    elif m.experts and not (m.model_type == "deepseek_v2" and i == 0):  # DeepSeek's first layer is dense
        w[p + "mlp.gate.weight"] = rnd(m.experts, h)
        for e in range(m.experts):
            w |= mlp(f"{p}mlp.experts.{e}.", m.moe_intermediate)
        if m.model_type == "deepseek_v2":
            w |= mlp(f"{p}mlp.shared_experts.", m.moe_intermediate)
    else:
        w |= mlp(p + "mlp.", m.intermediate)
    return w


def build_model(out: Path, kind: str, seed: int = 0) -> Path:
    """Write model ``kind`` (a key of :data:`MODELS`) into ``out``; returns ``out``."""
    m = MODELS[kind]
    out.mkdir(parents=True, exist_ok=True)
    _tokenizer(out, m.vocab)
    (out / "config.json").write_text(json.dumps(_config(m), indent=1))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, mean: float = 0.0) -> torch.Tensor:
        return (mean + 0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16)

    w = {
        "model.embed_tokens.weight": rnd(m.vocab, m.hidden),
        "model.norm.weight": rnd(m.hidden, mean=1.0),
        "lm_head.weight": rnd(m.vocab, m.hidden),
    }
    for i in range(m.layers):
        w |= _layer(m, i, rnd)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
