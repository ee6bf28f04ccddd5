"""Calculators behind ``gdsload plan`` (:mod:`.capacity`: HBM and KV-cache capacity) and ``gdsload cost``
(:mod:`.cost`: what compressed checkpoints save)."""
