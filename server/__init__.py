"""gdsload.server: the sidecar and the command line, thin shells over :mod:`gdsload.loader`."""

__all__: list[str] = []
