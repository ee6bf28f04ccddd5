"""Imported by the worker fork server: torch and ``load_rank``'s modules (see :mod:`gdsload.server.forkserver`)."""

from .forkserver import TORCH_MODULES, preload

preload(TORCH_MODULES)
