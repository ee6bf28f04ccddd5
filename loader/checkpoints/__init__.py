"""Training checkpoints: compressed, bit-exact drop-ins for ``torch.save`` / ``torch.load``.

- :mod:`.container`: :func:`save_compressed_checkpoint` and :func:`load_compressed_checkpoint`;
- :mod:`.tree`: state trees (model, optimizer, extras) flattened to named tensors and a JSON skeleton.
"""

from gdsload.loader.checkpoints.container import CheckpointReport, load_compressed_checkpoint, save_compressed_checkpoint

__all__ = ["save_compressed_checkpoint", "load_compressed_checkpoint", "CheckpointReport"]
