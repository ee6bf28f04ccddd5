"""Imported by the worker fork server: the GPU worker's libraries (see :mod:`gdsload.server.forkserver`)."""

from .forkserver import GPU_MODULES, preload

preload(GPU_MODULES)
