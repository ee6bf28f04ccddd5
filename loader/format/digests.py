"""Whole-file digests as the manifest records them: ``"<algorithm>:<hex>"``.

Two algorithms:

- ``blake3`` (the default for new files): a tree hash, so one file's digest is computed by several cores
  at once, and one core alone hashes faster than SHA-256 does: a writer that hashes its bytes on the way
  to disk does not wait for the hash.
- ``sha256``: what Hugging Face records as a file's LFS object id, for a manifest whose digests must match
  those; manifests written before ``blake3`` hold these, and they are checked as before.

>>> h = hasher("blake3"); h.update(b"abc"); h.text()  # doctest: +SKIP
'blake3:6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85'
>>> file_digest("model.safetensors", "sha256")  # doctest: +SKIP
'sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08'
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError, ManifestError

__all__ = ["ALGORITHMS", "DEFAULT", "Hasher", "hasher", "algorithm_of", "digest_algorithm", "require", "file_digest"]

ALGORITHMS = ("blake3", "sha256")
DEFAULT = "blake3"
_CHUNK = 8 << 20


class Hasher:
    """One digest in progress: ``update`` with bytes (the GIL is let go of while they are hashed), then ``text``."""

    def __init__(self, algorithm: str, impl: Any):
        self.algorithm = algorithm
        self._impl = impl

    def update(self, data: Any) -> None:
        self._impl.update(data)

    def text(self) -> str:
        """``"<algorithm>:<hex>"``, the manifest's form."""
        return f"{self.algorithm}:{self._impl.hexdigest()}"


def _blake3() -> Any:
    try:
        import blake3
    except ImportError:
        raise ConfigError(
            "blake3 digests need the blake3 package, which is not installed (gdsload depends on it): "
            "`pip install blake3`; or write sha256 digests (--digest-algorithm sha256, "
            "digest='sha256'), or load a model whose manifest records blake3 digests without verify"
        ) from None
    return blake3


def hasher(algorithm: str = DEFAULT, initial: bytes = b"") -> Hasher:
    """A new :class:`Hasher` of ``algorithm`` (``"blake3"`` or ``"sha256"``), fed ``initial`` first."""
    if algorithm == "blake3":
        b3 = _blake3()
        h = Hasher(algorithm, b3.blake3(max_threads=b3.blake3.AUTO))  # a large update is hashed on every core
    elif algorithm == "sha256":
        import hashlib  # here: a load that checks no digest imports no hashing

        h = Hasher(algorithm, hashlib.sha256())
    else:
        raise ConfigError(f"unknown digest algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    if initial:
        h.update(initial)
    return h


def digest_algorithm(digest: bool | str | None) -> str | None:
    """The algorithm a writer's ``digest`` option asks for: True is :data:`DEFAULT`, False (or None) none, a name
    of :data:`ALGORITHMS` itself."""
    if digest is True:
        return DEFAULT
    if digest is False or digest is None:
        return None
    if digest not in ALGORITHMS:
        raise ConfigError(
            f"digest={digest!r} names no digest algorithm gdsload knows; give True (blake3), "
            "'blake3', 'sha256', or False for none"
        )
    return digest


def require(digest: bool | str | None) -> str | None:
    """:func:`digest_algorithm`, and its package imported: a writer calls it before it makes any file."""
    algorithm = digest_algorithm(digest)
    if algorithm == "blake3":
        _blake3()
    return algorithm


def algorithm_of(digest: str, where: str = "the manifest") -> str:
    """The algorithm of a recorded ``"<algorithm>:<hex>"`` digest; a :class:`ManifestError` starting with
    ``where`` (the manifest and the file it describes) when it is not one gdsload checks."""
    algorithm, sep, hexpart = digest.partition(":")
    if not sep or algorithm not in ALGORITHMS or not hexpart:
        raise ManifestError(
            f"{where}: the digest {digest!r} is not '<algorithm>:<hex>' with an algorithm of "
            f"{', '.join(ALGORITHMS)}; rewrite the manifest (gdsload compress and shard write one) "
            "or load without verifying"
        )
    return algorithm


def file_digest(path: str | os.PathLike[str], algorithm: str = DEFAULT) -> str:
    """``"<algorithm>:<hex>"`` of a whole file (blake3 on every core, through a mapping of the file;
    sha256 on one, in 8 MiB reads)."""
    if algorithm == "blake3":
        b3 = _blake3()
        impl = b3.blake3(max_threads=b3.blake3.AUTO)
        if os.path.getsize(path):  # an empty file cannot be mapped
            impl.update_mmap(os.fspath(path))
        return f"blake3:{impl.hexdigest()}"
    h = hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.text()
