"""Tiny real models for the engine tier: config.json, random bf16 weights, a word-level tokenizer.

Built in a few milliseconds each run, from a seed, with only torch, safetensors and tokenizers.
Every model has grouped-query attention; ``llama-kv1`` has a single KV head, so at tp=2 its KV
head is replicated on both ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

__all__ = ["MODELS", "TinyModel", "build_model", "PROMPTS"]

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


MODELS: dict[str, TinyModel] = {
    "llama": TinyModel("LlamaForCausalLM", "llama"),
    "qwen2": TinyModel("Qwen2ForCausalLM", "qwen2", qkv_bias=True),
    "mistral": TinyModel("MistralForCausalLM", "mistral", kv_heads=2),
    "llama-kv1": TinyModel("LlamaForCausalLM", "llama", kv_heads=1),
}


def _tokenizer(out: Path, vocab: int) -> None:
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 2048,
    }))


def build_model(out: Path, kind: str, seed: int = 0) -> Path:
    """Write model ``kind`` (a key of :data:`MODELS`) into ``out``; returns ``out``."""
    m = MODELS[kind]
    out.mkdir(parents=True, exist_ok=True)
    _tokenizer(out, m.vocab)
    config = {
        "architectures": [m.architecture], "model_type": m.model_type, "hidden_size": m.hidden,
        "intermediate_size": m.intermediate, "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads,
        "num_hidden_layers": m.layers, "vocab_size": m.vocab, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    }
    if m.model_type == "mistral":
        config["sliding_window"] = None
    (out / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, mean: float = 0.0) -> torch.Tensor:
        return (mean + 0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16)

    d = m.hidden // m.heads
    w = {"model.embed_tokens.weight": rnd(m.vocab, m.hidden), "model.norm.weight": rnd(m.hidden, mean=1.0),
         "lm_head.weight": rnd(m.vocab, m.hidden)}
    for i in range(m.layers):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": rnd(m.hidden, mean=1.0),
            p + "post_attention_layernorm.weight": rnd(m.hidden, mean=1.0),
            p + "self_attn.q_proj.weight": rnd(m.heads * d, m.hidden),
            p + "self_attn.k_proj.weight": rnd(m.kv_heads * d, m.hidden),
            p + "self_attn.v_proj.weight": rnd(m.kv_heads * d, m.hidden),
            p + "self_attn.o_proj.weight": rnd(m.hidden, m.heads * d),
            p + "mlp.gate_proj.weight": rnd(m.intermediate, m.hidden),
            p + "mlp.up_proj.weight": rnd(m.intermediate, m.hidden),
            p + "mlp.down_proj.weight": rnd(m.hidden, m.intermediate),
        }
        if m.qkv_bias:
            w |= {p + "self_attn.q_proj.bias": rnd(m.heads * d), p + "self_attn.k_proj.bias": rnd(m.kv_heads * d),
                  p + "self_attn.v_proj.bias": rnd(m.kv_heads * d)}
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
