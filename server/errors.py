"""The sidecar's own error types (besides the loader's): what a request to the supervisor can fail with."""

from __future__ import annotations

from ..loader.errors import GdsloadError

__all__ = ["WorkerError", "UnknownRankError", "UnknownLeaseError", "ExportsOutstandingError"]


class WorkerError(GdsloadError, RuntimeError):
    """A worker died, did not answer, or failed a command."""


class UnknownRankError(GdsloadError, LookupError):
    """The rank is not served by this sidecar."""


class UnknownLeaseError(GdsloadError, LookupError):
    """The IPC lease is not outstanding (released already, or voided by a restart or reload)."""


class ExportsOutstandingError(GdsloadError, RuntimeError):
    """Unload or reload refused: engines still map exported tensors."""
