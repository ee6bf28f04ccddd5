"""Typed errors. Every error gdsload raises is a ``GdsloadError`` and also the fitting builtin.

Messages say what failed, quote the value, say what was expected and how to fix it::

    HeaderError: 'model-rank-0-part-0.safetensors': tensor 'lm_head.weight' has dtype 'BF32'; expected one of
    BF16, BOOL, ... — the file was not written by a safetensors writer, re-export it.
"""

from __future__ import annotations

__all__ = [
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
    "CheckpointError",
    "CheckpointTypeError",
    "CheckpointWriteError",
]


class GdsloadError(Exception):
    """Root of every error gdsload raises on purpose."""


class FormatError(GdsloadError, ValueError):
    """A file is not a valid safetensors file (or not one gdsload can read)."""


class HeaderError(FormatError):
    """The safetensors header is malformed: bad JSON, unknown dtype, byte ranges that lie."""


class TruncatedFileError(FormatError):
    """The file is shorter than its header says."""


class ManifestError(GdsloadError, ValueError):
    """``gdsload.json`` is malformed or disagrees with the files next to it."""


class NoFilesForRankError(GdsloadError, FileNotFoundError):
    """Discovery found no files for the requested rank."""


class UnfinishedOutputError(GdsloadError, FileNotFoundError):
    """The directory is the output of a ``gdsload shard`` or ``gdsload compress`` run that has not finished
    (still running, or killed): nothing in it is loaded until the run completes."""


class FileUnreadableError(GdsloadError, OSError):
    """A file of the rank cannot be opened or read (removed, permissions, not a regular file)."""


class DeviceMemoryError(GdsloadError, MemoryError):
    """The memory a load needs (its arena, or staging) cannot be allocated on its device."""


class BackendUnavailableError(GdsloadError, RuntimeError):
    """A reader backend that was named explicitly cannot run on this host."""


class CodecError(GdsloadError, ValueError):
    """Compressed data is corrupt, or its codec cannot be decoded here."""


class IntegrityError(GdsloadError, ValueError):
    """Loaded bytes do not match the digest or checksum recorded for them."""


class ConfigError(GdsloadError, ValueError):
    """An option or ``GDSLOAD_*`` environment variable has a value outside its allowed set."""


class CheckpointError(GdsloadError, ValueError):
    """A file is not a gdsload training checkpoint, or its skeleton disagrees with its tensors."""


class CheckpointTypeError(CheckpointError, TypeError):
    """A value in the state cannot be stored without pickle (its path and type are named)."""


class CheckpointWriteError(GdsloadError, OSError):
    """Writing the checkpoint failed (``errno`` kept); nothing was left under the final name."""
