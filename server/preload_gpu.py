"""Imported by the worker fork server: the GPU worker's libraries (see :mod:`gdsload.server.forkserver`)."""

from .forkserver import gpu_modules, preload

preload(gpu_modules())
