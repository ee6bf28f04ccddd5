"""gdsload.loader: put a model's weights into memory as fast as the hardware allows.

>>> from gdsload.loader import load_rank
>>> result = load_rank("/models/llama-tp2", rank=0, device="cpu")  # doctest: +SKIP
>>> print(result.report.summary())
rank 0: 8.03 GB in 3.912 s (2.05 GB/s) backend=cpu io=cpu files=2

Names are imported on first use (PEP 562), so ``import gdsload.loader.errors`` or a command that
never loads tensors does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> submodule that defines it
_LAZY: dict[str, str] = {
    "EngineNotInstalledError": "adapters",
    "InjectError": "adapters",
    "InjectReport": "adapters",
    "LayoutError": "adapters",
    "inject_module": "adapters",
    "meta_init": "adapters",
    "load_rank": "pipeline",
    "CheckpointError": "errors",
    "CheckpointReport": "checkpoint",
    "CheckpointTypeError": "errors",
    "CheckpointWriteError": "errors",
    "load_compressed_checkpoint": "checkpoint",
    "save_compressed_checkpoint": "checkpoint",
    "LoadConfig": "config",
    "format_bytes": "config",
    "parse_size": "config",
    "RankFiles": "discovery",
    "discover": "discovery",
    "list_ranks": "discovery",
    "BackendUnavailableError": "errors",
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
    "AlignedWriter": "format",
    "SafetensorsHeader": "format",
    "TensorInfo": "format",
    "TensorSpec": "format",
    "parse_header": "format",
    "read_header": "format",
    "save_file": "format",
    "MANIFEST_NAME": "manifest",
    "Manifest": "manifest",
    "ManifestFile": "manifest",
    "write_manifest": "manifest",
    "LoadPlan": "plan",
    "plan_rank": "plan",
    "QuantScheme": "quantize",
    "FileReport": "result",
    "LoadReport": "result",
    "LoadResult": "result",
    "SourceCheckpointError": "shard",
    "OutputExistsError": "shard",
    "ShardConfigError": "shard",
    "ShardOptions": "shard",
    "ShardPlan": "shard",
    "ShardResult": "shard",
    "ShardWriteError": "shard",
    "SourceNotFoundError": "shard",
    "SourceReadError": "shard",
    "UnsupportedModelError": "shard",
    "UnsupportedSourceError": "shard",
    "execute_plan": "shard",
    "plan_shard": "shard",
    "shard_checkpoint": "shard",
    "DEFAULT_SIDECAR_URL": "sidecar_client",
    "SidecarClient": "sidecar_client",
    "SidecarError": "sidecar_client",
}

if TYPE_CHECKING:  # pragma: no cover
    from .adapters import EngineNotInstalledError, InjectError, InjectReport, LayoutError, inject_module, meta_init
    from .pipeline import load_rank
    from .checkpoint import CheckpointError, CheckpointReport, CheckpointTypeError, CheckpointWriteError, load_compressed_checkpoint, save_compressed_checkpoint
    from .config import LoadConfig, format_bytes, parse_size
    from .discovery import RankFiles, discover, list_ranks
    from .errors import BackendUnavailableError, CodecError, ConfigError, FormatError, GdsloadError, HeaderError, IntegrityError, ManifestError, NoFilesForRankError, FileUnreadableError, TruncatedFileError
    from .format import AlignedWriter, SafetensorsHeader, TensorInfo, TensorSpec, parse_header, read_header, save_file
    from .manifest import MANIFEST_NAME, Manifest, ManifestFile, write_manifest
    from .plan import LoadPlan, plan_rank
    from .quantize import QuantScheme
    from .result import FileReport, LoadReport, LoadResult
    from .shard import SourceCheckpointError, OutputExistsError, ShardConfigError, ShardOptions, ShardPlan, ShardResult, ShardWriteError, SourceNotFoundError, SourceReadError, UnsupportedModelError, UnsupportedSourceError, execute_plan, plan_shard, shard_checkpoint
    from .sidecar_client import DEFAULT_SIDECAR_URL, SidecarClient, SidecarError


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
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
    "CodecError",
    "IntegrityError",
    "ConfigError",
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
