"""What one compression wrote: counts, bytes before and after, digests; shared by the torch and torch-free paths."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompressStats"]


@dataclass
class CompressStats:
    files: int = 0
    tensors: int = 0
    compressed: int = 0
    raw: int = 0
    logical_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
    per_dtype: dict[str, list[int]] = field(default_factory=dict)
    """dtype -> [logical bytes, stored bytes] of the compressed tensors."""
    digests: dict[str, str] = field(default_factory=dict)
    """Written file -> its ``"<algorithm>:<hex>"`` digest, computed on the way to disk (when asked for)."""

    @property
    def ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def add(self, other: CompressStats) -> None:
        for k in ("files", "tensors", "compressed", "raw", "logical_bytes", "stored_bytes", "seconds"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for dt, (a, b) in other.per_dtype.items():
            cur = self.per_dtype.setdefault(dt, [0, 0])
            cur[0] += a
            cur[1] += b
        self.digests.update(other.digests)
