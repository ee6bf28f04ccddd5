"""gdsload.bench: cold-start and peer benchmarks. Depends on the loader; never imported by it."""

__all__: list[str] = []
