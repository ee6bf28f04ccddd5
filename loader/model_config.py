"""A Hugging Face ``config.json``, read once: what ``gdsload shard``, ``gdsload plan`` and the adapters ask of a model.

The reader takes the file as transformers writes it — a multimodal wrapper's ``text_config`` unwrapped,
``num_key_value_heads`` and ``head_dim`` defaulted as transformers defaults them, the mixture-of-experts
keys of every family (``num_local_experts``, ``num_experts``, ``n_routed_experts``) under one name — and
checks nothing beyond the JSON itself: each consumer says what it needs (:meth:`ModelConfig.need`) and
raises its own error naming the key and the file.

>>> cfg = ModelConfig.from_dict({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
...     "hidden_size": 4096, "num_attention_heads": 32, "num_local_experts": 8, "num_experts_per_tok": 2})
>>> cfg.architecture, cfg.experts, cfg.kv_heads
('MixtralForCausalLM', 8, 32)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import GdsloadError

__all__ = ["ModelConfig", "ModelConfigError", "TIED_BY_DEFAULT"]

TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "cohere"})
"""``model_type``s whose transformers config ties lm_head to the embeddings unless it says otherwise."""

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


class ModelConfigError(GdsloadError, ValueError):
    """config.json is missing, unreadable, not JSON, or lacks a value a command needs."""


@dataclass(frozen=True)
class ModelConfig:
    """The facts of one model's ``config.json`` (None where the file does not say)."""

    where: str
    """The file these facts come from (for messages)."""
    raw: Mapping[str, Any] = field(repr=False)
    """The language model's keys (a wrapper's ``text_config`` merged over the wrapper's own)."""
    architecture: str | None
    """``architectures[0]``."""
    model_type: str | None
    wrapper: str | None
    """The multimodal wrapper's ``model_type`` when the language model's keys came from its ``text_config``."""
    layers: int | None
    hidden: int | None
    heads: int | None
    kv_heads: int | None
    """``num_key_value_heads``, else ``num_attention_heads``."""
    head_dim: int | None
    """``head_dim``, else ``hidden_size // num_attention_heads``."""
    intermediate: int | None
    vocab: int | None
    tie_word_embeddings: bool
    """As written, else transformers' default for the ``model_type`` (:data:`TIED_BY_DEFAULT`)."""
    tie_is_default: bool
    """``tie_word_embeddings`` is absent and was defaulted."""
    max_position: int | None
    experts: int | None
    """Routed experts per MoE layer (``num_local_experts`` / ``num_experts`` / ``n_routed_experts``); None: dense."""
    experts_per_token: int | None
    moe_intermediate: int | None
    shared_experts: int | None
    quantization: Mapping[str, Any] | None
    """``quantization_config``: the checkpoint is already quantized."""
    dtype: str | None
    """``torch_dtype`` (or transformers 5's ``dtype``)."""

    @property
    def is_moe(self) -> bool:
        return bool(self.experts)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``path`` (a config.json, or a directory holding one); :class:`ModelConfigError` if it cannot.

        >>> ModelConfig.read("/models/Mixtral-8x7B").experts  # doctest: +SKIP
        8
        """
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelConfigError(
                f"{str(p)!r} does not exist; a Hugging Face model directory holds config.json "
                "next to its *.safetensors files"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{str(p)!r} is not a readable JSON file ({e}); fetch it again") from None
        return cls.from_dict(doc, where=str(p))

    @classmethod
    def from_dict(cls, doc: Any, *, where: str = "config.json") -> ModelConfig:
        """The facts of an already-parsed config.json (see the module docstring)."""
        if not isinstance(doc, Mapping):
            raise ModelConfigError(f"{where!r} holds a JSON {type(doc).__name__}, expected an object")
        archs = doc.get("architectures")
        architecture = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
        wrapper = None
        if "num_hidden_layers" not in doc and isinstance(doc.get("text_config"), Mapping):
            wrapper = str(doc.get("model_type") or "multimodal")
            text = doc["text_config"]
            doc = {**{k: v for k, v in doc.items() if k not in ("text_config", "model_type")}, **text}
        model_type = doc.get("model_type") if isinstance(doc.get("model_type"), str) else None
        hidden, heads = _int(doc.get("hidden_size")), _int(doc.get("num_attention_heads"))
        kv_heads = _int(doc.get("num_key_value_heads")) if doc.get("num_key_value_heads") is not None else heads
        head_dim = (
            _int(doc.get("head_dim"))
            if doc.get("head_dim") is not None
            else (hidden // heads if hidden and heads else None)
        )
        tied = doc.get("tie_word_embeddings")
        experts = next((_int(doc[k]) for k in _EXPERT_KEYS if doc.get(k)), None)
        quant = doc.get("quantization_config")
        return cls(
            where=where,
            raw=dict(doc),
            architecture=architecture,
            model_type=model_type,
            wrapper=wrapper,
            layers=_int(doc.get("num_hidden_layers")),
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=_int(doc.get("intermediate_size")),
            vocab=_int(doc.get("vocab_size")),
            tie_word_embeddings=bool(tied) if tied is not None else model_type in TIED_BY_DEFAULT,
            tie_is_default=tied is None,
            max_position=_int(doc.get("max_position_embeddings")),
            experts=experts,
            experts_per_token=_int(doc.get("num_experts_per_tok")),
            moe_intermediate=_int(doc.get("moe_intermediate_size")),
            shared_experts=_int(doc.get("n_shared_experts") or doc.get("num_shared_experts")),
            quantization=quant if isinstance(quant, Mapping) else ({"quant_method": quant} if quant else None),
            dtype=str(doc.get("torch_dtype") or doc.get("dtype") or "") or None,
        )

    def need(self, key: str, error: type[GdsloadError] = ModelConfigError) -> int:
        """``raw[key]`` as a positive integer, else ``error`` naming the file, the key and the value.

        >>> ModelConfig.from_dict({"hidden_size": 0}).need("hidden_size")
        Traceback (most recent call last):
        gdsload.loader.model_config.ModelConfigError: 'config.json': hidden_size must be a positive integer, got 0
        """
        value = self.raw.get(key)
        if type(value) is not int or value < 1:
            raise error(f"{self.where!r}: {key} must be a positive integer, got {value!r}")
        return value


def _int(value: Any) -> int | None:
    """``value`` when it is a plain int, else None (bool is not a count)."""
    return value if type(value) is int else None
