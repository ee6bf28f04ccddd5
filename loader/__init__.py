"""gdsload.loader: put a model's weights into memory as fast as the hardware allows.

>>> from gdsload.loader import load_rank
>>> result = load_rank("/models/llama-tp2", rank=0, device="cpu")  # doctest: +SKIP
>>> print(result.report.summary())
rank 0: 8.03 GB in 3.912 s (2.05 GB/s) backend=cpu io=cpu files=2

Names are imported on first use (PEP 562), so ``import gdsload.loader.errors`` or a command that
never loads tensors does not pay for importing torch.

The package is laid out by stage, each depending only on those before it:

- ``errors``, ``config``, ``dtypes``, ``devices``: the ground every stage stands on (the device
  interface: torch CPU/CUDA, or CUDA without torch);
- ``format``: safetensors headers and writing, compressed-tensor metadata, the manifest, finding a rank's files;
- ``plan``: from headers to the arena, the reads and each tensor's place;
- ``io``: reader backends (a registry; ``cpu``, ``mmap``, ``pinned``, ``cufile``, ``fastsafetensors``),
  I/O modes, page-cache residency;
- ``codecs``: compressing and decoding tensors (nvCOMP, zstandard);
- ``pipeline``: ``load_rank``, the one load pipeline, its decode stage, its result and report;
- ``handoff``: a loaded rank to another process (CUDA IPC, shared memory) and the sidecar's client;
- ``adapters``: vLLM, TensorRT-LLM, SGLang, torch modules;
- ``prepare``: offline preparation (``shard``, ``quantize``, ``compress``, synthetic checkpoints);
- ``checkpoints``: training checkpoints, compressed drop-ins for ``torch.save``/``torch.load``;
- ``calc``: the HBM capacity and compression-cost calculators; ``doctor``: what a host offers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

# public name -> submodule that defines it
_LAZY: dict[str, str] = {
    "EngineNotInstalledError": "adapters",
    "InjectError": "adapters",
    "InjectReport": "adapters",
    "LayoutError": "adapters",
    "inject_from_sidecar": "adapters",
    "inject_module": "adapters",
    "meta_init": "adapters",
    "load_rank": "pipeline.load",
    "CheckpointError": "errors",
    "CheckpointReport": "checkpoints.container",
    "CheckpointTypeError": "errors",
    "CheckpointWriteError": "errors",
    "load_compressed_checkpoint": "checkpoints.container",
    "save_compressed_checkpoint": "checkpoints.container",
    "LoadConfig": "pipeline.config",
    "format_bytes": "config",
    "parse_size": "config",
    "RankFiles": "format.discovery",
    "discover": "format.discovery",
    "list_ranks": "format.discovery",
    "BackendUnavailableError": "errors",
    "DeviceMemoryError": "errors",
    "UnfinishedOutputError": "errors",
    "CodecError": "errors",
    "ConfigError": "errors",
    "FormatError": "errors",
    "GdsloadError": "errors",
    "HeaderError": "errors",
    "IntegrityError": "errors",
    "ManifestError": "errors",
    "NoFilesForRankError": "errors",
    "FileUnreadableError": "errors",
    "TruncatedFileError": "errors",
    "AlignedWriter": "format.writer",
    "SafetensorsHeader": "format.safetensors",
    "TensorInfo": "format.safetensors",
    "TensorSpec": "format.writer",
    "parse_header": "format.safetensors",
    "read_header": "format.safetensors",
    "save_file": "format.writer",
    "MANIFEST_NAME": "format.manifest",
    "Manifest": "format.manifest",
    "ManifestFile": "format.manifest",
    "write_manifest": "format.manifest",
    "LoadPlan": "plan",
    "plan_rank": "plan",
    "QuantScheme": "prepare.quantize",
    "FileReport": "pipeline.result",
    "LoadReport": "pipeline.result",
    "LoadResult": "pipeline.result",
    "SourceCheckpointError": "prepare.shard",
    "OutputExistsError": "prepare.shard",
    "ShardConfigError": "prepare.shard",
    "ShardOptions": "prepare.shard",
    "ShardPlan": "prepare.shard",
    "ShardResult": "prepare.shard",
    "ShardWriteError": "prepare.shard",
    "SourceNotFoundError": "prepare.shard",
    "SourceReadError": "prepare.shard",
    "UnsupportedModelError": "prepare.shard",
    "UnsupportedSourceError": "prepare.shard",
    "execute_plan": "prepare.shard",
    "plan_shard": "prepare.shard",
    "shard_checkpoint": "prepare.shard",
    "DEFAULT_SIDECAR_URL": "handoff.sidecar_client",
    "SidecarClient": "handoff.sidecar_client",
    "SidecarError": "handoff.sidecar_client",
}

if TYPE_CHECKING:  # pragma: no cover
    from .adapters import (
        EngineNotInstalledError,
        InjectError,
        InjectReport,
        LayoutError,
        inject_from_sidecar,
        inject_module,
        meta_init,
    )
    from .pipeline.load import load_rank
    from .checkpoints.container import (
        CheckpointError,
        CheckpointReport,
        CheckpointTypeError,
        CheckpointWriteError,
        load_compressed_checkpoint,
        save_compressed_checkpoint,
    )
    from .config import format_bytes, parse_size
    from .pipeline.config import LoadConfig
    from .format.discovery import RankFiles, discover, list_ranks
    from .errors import (
        BackendUnavailableError,
        CodecError,
        ConfigError,
        FormatError,
        GdsloadError,
        HeaderError,
        IntegrityError,
        ManifestError,
        NoFilesForRankError,
        FileUnreadableError,
        TruncatedFileError,
    )
    from .format.safetensors import SafetensorsHeader, TensorInfo, parse_header, read_header
    from .format.writer import AlignedWriter, TensorSpec, save_file
    from .format.manifest import MANIFEST_NAME, Manifest, ManifestFile, write_manifest
    from .plan import LoadPlan, plan_rank
    from .prepare.quantize import QuantScheme
    from .pipeline.result import FileReport, LoadReport, LoadResult
    from .prepare.shard import (
        SourceCheckpointError,
        OutputExistsError,
        ShardConfigError,
        ShardOptions,
        ShardPlan,
        ShardResult,
        ShardWriteError,
        SourceNotFoundError,
        SourceReadError,
        UnsupportedModelError,
        UnsupportedSourceError,
        execute_plan,
        plan_shard,
        shard_checkpoint,
    )
    from .handoff.sidecar_client import DEFAULT_SIDECAR_URL, SidecarClient, SidecarError


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .config import gc_paused

    with gc_paused():  # importing the pipeline makes objects the collector would scan for nothing
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    "load_rank",
    "LoadConfig",
    "LoadResult",
    "LoadReport",
    "FileReport",
    "discover",
    "list_ranks",
    "RankFiles",
    "plan_rank",
    "LoadPlan",
    "read_header",
    "parse_header",
    "SafetensorsHeader",
    "TensorInfo",
    "TensorSpec",
    "AlignedWriter",
    "save_file",
    "MANIFEST_NAME",
    "Manifest",
    "ManifestFile",
    "write_manifest",
    "parse_size",
    "format_bytes",
    "GdsloadError",
    "FormatError",
    "HeaderError",
    "TruncatedFileError",
    "ManifestError",
    "NoFilesForRankError",
    "FileUnreadableError",
    "BackendUnavailableError",
    "DeviceMemoryError",
    "UnfinishedOutputError",
    "CodecError",
    "IntegrityError",
    "ConfigError",
    "inject_from_sidecar",
    "inject_module",
    "meta_init",
    "InjectReport",
    "InjectError",
    "LayoutError",
    "EngineNotInstalledError",
    "SidecarClient",
    "SidecarError",
    "DEFAULT_SIDECAR_URL",
    "QuantScheme",
    "shard_checkpoint",
    "plan_shard",
    "execute_plan",
    "ShardOptions",
    "ShardPlan",
    "ShardResult",
    "SourceCheckpointError",
    "OutputExistsError",
    "ShardConfigError",
    "ShardWriteError",
    "SourceNotFoundError",
    "SourceReadError",
    "UnsupportedModelError",
    "UnsupportedSourceError",
    "save_compressed_checkpoint",
    "load_compressed_checkpoint",
    "CheckpointReport",
    "CheckpointError",
    "CheckpointTypeError",
    "CheckpointWriteError",
]
