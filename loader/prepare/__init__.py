"""Offline preparation of model directories.

- :mod:`.shard` (with :mod:`.shard_rules`): ``gdsload shard``, by tensor-parallel rank, in vLLM's layout or HF's;
- :mod:`.quantize`: FP8 weights and scales as vLLM reads them;
- :mod:`.compress`: ``gdsload compress``, any safetensors directory re-packed compressed;
- :mod:`.synthetic`: reproducible Llama-shaped checkpoints for demos, tests and benchmarks.
"""
