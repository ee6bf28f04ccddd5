"""Engine adapters: hand a loaded rank's tensors to torch/transformers, vLLM, TensorRT-LLM or SGLang.

One interface: ``(name, tensor)`` pairs in, an :class:`InjectReport` (loaded, missing,
unexpected, bytes, seconds) out; strict mode raises one :class:`InjectError` listing every
missing/unexpected name and shape mismatch before anything is written.

- :func:`inject_module` / :func:`meta_init` — plain torch and transformers modules (zero-copy assign, or copy);
- :func:`inject_from_sidecar` — the same from a running ``gdsload serve``: parameters adopt its memory;
- ``gdsload.loader.adapters.vllm`` — load format ``gdsload`` (plugin entry point ``vllm.general_plugins``);
- ``gdsload.loader.adapters.trtllm`` — TensorRT-LLM checkpoint loader, legacy ``rank{N}.safetensors``;
- ``gdsload.loader.adapters.sglang`` — SGLang loader class and live ``update_weights_from_tensor``.

Engines are imported only inside those modules' loader factories, so this package imports on a
bare CPU host.

>>> from gdsload.loader import load_rank
>>> from gdsload.loader.adapters import inject_module, meta_init
>>> with meta_init(dtype=torch.bfloat16):                                  # doctest: +SKIP
...     model = LlamaForCausalLM(config)
>>> print(inject_module(model, load_rank("/models/llama", 0)).summary())   # doctest: +SKIP
inject torch into LlamaForCausalLM: 291 tensors, 16.06 GB in 0.004 s zero-copy=291 missing=0 unexpected=0 mismatched=0
"""

from __future__ import annotations

from .base import (
    AdapterOptions,
    CheckpointLayout,
    EngineNotInstalledError,
    InjectError,
    InjectReport,
    Injector,
    LayoutError,
    RankWeights,
    ShapeMismatch,
    StateDictInjector,
    Target,
    Weights,
    collect_weights,
    compare,
    describe_checkpoint,
    hold_for_adoption,
    open_rank,
)
from .torch_module import ModuleInjector, inject_from_sidecar, inject_module, meta_init

__all__ = [
    "AdapterOptions",
    "CheckpointLayout",
    "EngineNotInstalledError",
    "InjectError",
    "InjectReport",
    "Injector",
    "LayoutError",
    "ModuleInjector",
    "RankWeights",
    "ShapeMismatch",
    "StateDictInjector",
    "Target",
    "Weights",
    "collect_weights",
    "compare",
    "describe_checkpoint",
    "hold_for_adoption",
    "inject_from_sidecar",
    "inject_module",
    "meta_init",
    "open_rank",
]
