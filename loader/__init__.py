"""gdsload.loader: put a model's weights into memory as fast as the hardware allows.

>>> from gdsload.loader import load_rank
>>> result = load_rank("/models/llama-tp2", rank=0, device="cpu")  # doctest: +SKIP
>>> print(result.report.summary())
rank 0: 8.03 GB in 3.912 s (2.05 GB/s) backend=cpu io=cpu files=2
"""

from __future__ import annotations

__version__ = "0.1.0"

from .adapters import EngineNotInstalledError, InjectError, InjectReport, LayoutError, inject_module, meta_init
from .api import load_rank
from .checkpoint import (
    CheckpointError,
    CheckpointReport,
    CheckpointTypeError,
    CheckpointWriteError,
    load_compressed_checkpoint,
    save_compressed_checkpoint,
)
from .config import LoadConfig, format_bytes, parse_size
from .discover import RankFiles, discover, list_ranks
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
    TruncatedFileError,
)
from .format import AlignedWriter, SafetensorsHeader, TensorInfo, TensorSpec, parse_header, read_header, save_file
from .manifest import MANIFEST_NAME, Manifest, ManifestFile, write_manifest
from .plan import LoadPlan, plan_rank
from .quantize import QuantScheme
from .result import FileReport, LoadReport, LoadResult
from .shard import (
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
from .sidecar_client import DEFAULT_SIDECAR_URL, SidecarClient, SidecarError

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
