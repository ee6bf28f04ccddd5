"""Load options: one named tuple, ``GDSLOAD_*`` environment variables parsed and checked in one place.

Precedence: explicit argument > environment variable > default.

| variable              | accepted values                           | default  |
|-----------------------|-------------------------------------------|----------|
| GDSLOAD_BACKEND       | auto, or a backend name (backend_names()) | auto     |
| GDSLOAD_NUM_THREADS   | integer 1..256                            | per backend (cpu: 8 cold, one per core cached; pinned and cufile 16 cached / 4 cold) |
| GDSLOAD_CHUNK_BYTES   | size, 4 KiB multiple <= 1GiB: 16MiB, 1GiB | per backend (cpu 16MiB; pinned, cufile 4MiB cached / 2MiB cold; pinned without kvikio 16MiB) |
| GDSLOAD_PINNED_BYTES  | size: upper bound on pinned host staging  | 1GiB     |
| GDSLOAD_STAGING_BYTES | size >= 1MiB: GPU staging of compressed ranks | 960MiB |
| GDSLOAD_VERIFY        | 0/1, true/false, yes/no                   | unset: check the checksums files record |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from ..config import parse_bool, parse_size
from ..errors import ConfigError

__all__ = ["LoadConfig", "DEFAULT_STAGING_BYTES"]

DEFAULT_STAGING_BYTES = 960 << 20
"""Staging for a compressed rank's stored bytes, all its buffers together: what a compressed load takes
beyond its tensors (nvCOMP's scratch and tables add a few MB), under 1 GiB in all."""


class LoadConfig(NamedTuple):
    """How ``load_rank`` reads. Build with :meth:`resolve`, which applies the environment and checks every
    value (:meth:`check`)."""

    backend: str = "auto"
    """Reader backend: ``auto`` (try cufile, pinned, mmap, cpu in order; see ``auto_order()``) or one name."""
    num_threads: int | None = None
    """Reader threads per rank; None picks the backend's default."""
    chunk_bytes: int | None = None
    """Largest single read (the pinned pipeline's buffer size, kvikio's task size); None picks the
    backend's default."""
    pinned_bytes: int = 1 << 30
    """Upper bound on pinned host memory used for staging."""
    staging_bytes: int = DEFAULT_STAGING_BYTES
    """The most GPU memory a compressed rank's stored bytes take besides the arena on their way to the
    decoder; read groups are at most a third of it. In place (the default on a GPU) only the last groups
    take memory of their own; loads into the caller's tensors use three buffers of a third each (on the
    CPU, one)."""
    verify: bool | None = None
    """None (the default): check every tensor against the checksum its file records, on the loaded bytes
    (:mod:`gdsload.loader.pipeline.verify`). True: also each file's manifest digest, over the loaded bytes, and
    fail when anything loaded cannot be checked. False: check nothing beyond what a codec checks by itself."""

    def check(self) -> LoadConfig:
        """This config, once every value is known to be usable; :class:`ConfigError` naming the first that is not."""
        from ..io import backend_names, is_backend

        if self.backend != "auto" and not is_backend(self.backend):
            raise ConfigError(f"backend={self.backend!r} is not known; choose one of {['auto', *backend_names()]}")
        if self.num_threads is not None and (type(self.num_threads) is not int or not 1 <= self.num_threads <= 256):
            raise ConfigError(f"num_threads={self.num_threads!r} must be an integer in 1..256")
        if self.chunk_bytes is not None and (
            type(self.chunk_bytes) is not int or not 4096 <= self.chunk_bytes <= 1 << 30 or self.chunk_bytes % 4096
        ):
            raise ConfigError(
                f"chunk_bytes={self.chunk_bytes!r} must be a multiple of 4 KiB between 4 KiB and 1 GiB; "
                "write binary units, e.g. 4MiB (4M and 4MB mean 4,000,000 bytes)"
            )
        if type(self.pinned_bytes) is not int or self.pinned_bytes < 1 << 20:
            raise ConfigError(f"pinned_bytes={self.pinned_bytes!r} must be at least 1 MiB")
        if type(self.staging_bytes) is not int or self.staging_bytes < 1 << 20:
            raise ConfigError(f"staging_bytes={self.staging_bytes!r} must be at least 1 MiB")
        if self.verify not in (None, True, False):
            raise ConfigError(f"verify={self.verify!r} must be None (check recorded checksums), True or False")
        return self

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> LoadConfig:
        """Defaults, then ``GDSLOAD_*`` from ``env`` (default ``os.environ``), then non-None ``overrides``."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        if "GDSLOAD_BACKEND" in env:
            values["backend"] = env["GDSLOAD_BACKEND"].strip()
        if "GDSLOAD_NUM_THREADS" in env:
            raw = env["GDSLOAD_NUM_THREADS"]
            if not (raw.strip().isascii() and raw.strip().isdigit()):
                raise ConfigError(f"GDSLOAD_NUM_THREADS={raw!r} is not an integer")
            values["num_threads"] = int(raw)
        if "GDSLOAD_CHUNK_BYTES" in env:
            values["chunk_bytes"] = parse_size(env["GDSLOAD_CHUNK_BYTES"], what="GDSLOAD_CHUNK_BYTES")
        if "GDSLOAD_PINNED_BYTES" in env:
            values["pinned_bytes"] = parse_size(env["GDSLOAD_PINNED_BYTES"], what="GDSLOAD_PINNED_BYTES")
        if "GDSLOAD_STAGING_BYTES" in env:
            values["staging_bytes"] = parse_size(env["GDSLOAD_STAGING_BYTES"], what="GDSLOAD_STAGING_BYTES")
        if "GDSLOAD_VERIFY" in env:
            values["verify"] = parse_bool(env["GDSLOAD_VERIFY"], "GDSLOAD_VERIFY")
        from_env = {k: f"GDSLOAD_{k.upper()}" for k in values}
        known = set(cls._fields)
        for k, v in overrides.items():
            if k not in known:
                raise TypeError(f"unknown load option {k!r}; known: {sorted(known)}")
            if v is not None:
                values[k] = v
                from_env.pop(k, None)
        try:
            return cls(**values).check()
        except ConfigError as e:  # say which variable to fix when the value came from the environment
            var = next((var for k, var in from_env.items() if str(e).startswith(f"{k}=")), None)
            if var is None:
                raise
            raise ConfigError(f"{var}: {e}") from None
