"""A kvikio stand-in whose ``CuFile.pread`` copies real file bytes into host memory, and host memory the cufile
backend takes for a GPU: for testing the kvikio reader's logic on a CPU host (on a GPU host the real kvikio runs)."""

from __future__ import annotations

import os
import sys

import torch

from gdsload.loader.devices import TorchDevice


def stand_in_kvikio(monkeypatch, fail_on: str | None = None, direct_switch: bool = False) -> dict:
    """A kvikio whose CuFile.pread copies real file bytes into host memory; records what was done.

    With ``direct_switch`` it has the ``auto_direct_io_read`` setting (kvikio 26.10 has it) and
    ``CuFile.is_direct_io_supported``."""
    import types
    from types import SimpleNamespace

    from gdsload.loader.io import cufile
    from gdsload.loader.io.iomode import KvikioState

    seen: dict = {"settings": [], "restored": 0, "opened": [], "closed": [], "preads": []}

    class CuFile:
        def __init__(self, path, mode):
            path = os.path.realpath(path)  # the plan hands kvikio /proc/self/fd/N: the very file it planned
            if fail_on and path.endswith(fail_on):
                raise OSError(f"cannot open {path}")
            self.fh = open(path, "rb")
            seen["opened"].append(path)

        def pread(self, buf, n, off):
            seen["preads"].append((self.fh.name, off, n))
            self.fh.seek(off)
            data = self.fh.read(n)
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return SimpleNamespace(get=lambda: len(data))

        def close(self):
            self.fh.close()
            seen["closed"].append(self.fh.name)

    class Settings:
        def __init__(self, values):
            seen["settings"].append(values)

        def __exit__(self, *exc):
            seen["restored"] += 1

    kvikio = types.ModuleType("kvikio")
    kvikio.CuFile = CuFile
    kvikio.CompatMode = SimpleNamespace(ON="ON")
    kvikio.defaults = SimpleNamespace(set=Settings)
    if direct_switch:
        kvikio.defaults.get = lambda name: {"auto_direct_io_read": False}[name]
        CuFile.is_direct_io_supported = lambda self: True
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", kvikio.defaults)
    monkeypatch.setattr(cufile, "kvikio_state", lambda: KvikioState(True, "stand-in", "ON", True, None))
    monkeypatch.setenv("GDSLOAD_STAGED", "0")  # these tests are about kvikio's reads, not the staged reader's
    return seen


class HostAsCuda(TorchDevice):
    """Host memory that the cufile backend takes for a GPU: records when it is made current and synchronized."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.kind = "cuda"  # type: ignore[misc]
        self.index = 0
        self.hooks: list[str] = []

    def activate(self) -> None:
        self.hooks.append("use")

    def synchronize(self) -> None:
        self.hooks.append("sync")


def host_reader(chunk: int = 1 << 20):
    from gdsload.loader.io import ReadOptions
    from gdsload.loader.io.cufile import CuFileBackend

    r = CuFileBackend(HostAsCuda(), ReadOptions(num_threads=3, chunk_bytes=chunk))
    r.hooks = r.device.hooks
    return r
