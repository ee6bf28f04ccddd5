"""gdsload.bench: cold-start and peer benchmarks. Depends on the loader; never imported by it."""

from ..server.signals import stop_on_sigterm

__all__ = ["stop_on_sigterm"]
