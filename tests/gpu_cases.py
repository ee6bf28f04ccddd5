"""Helpers shared by the GPU test modules (`pytest -m gpu`): tensors compared bit for bit with safetensors, backend
probes and a small bench-like checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from gdsload.loader import save_file


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _reference(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(safetensors.torch.load_file(str(f)))
    return out


def _check(result, ref: dict[str, torch.Tensor]) -> None:
    assert set(result.tensors) == set(ref)
    for name, t in ref.items():
        got = result.tensors[name]
        assert got.is_cuda and got.dtype == t.dtype and got.shape == t.shape, name
        assert _bits(got) == _bits(t), name


def _skip_if_missing(backend: str) -> None:
    from gdsload.loader.devices import as_device
    from gdsload.loader.io import backend_class

    reason = backend_class(backend).probe(as_device("cuda"))
    if reason:
        pytest.skip(f"{backend}: {reason}")


def _bench_like(tmp_path: Path, *, fp8: bool = True) -> Path:
    """Two part files of one rank (bf16, fp32, fp8 unless ``fp8=False``, and a norm), written by gdsload."""
    d = tmp_path / "w"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    for part in range(2):
        tensors = {
            f"p{part}.w": (0.02 * torch.randn(2048, 1024, generator=g)).to(torch.bfloat16),
            f"p{part}.f32": 0.02 * torch.randn(512, 256, generator=g),
        }
        if fp8:
            tensors[f"p{part}.fp8"] = torch.randn(1024, 512, generator=g).to(torch.float8_e4m3fn)
        tensors[f"p{part}.norm"] = torch.ones(1024, dtype=torch.bfloat16)
        save_file(tensors, d / f"model-rank-0-part-{part}.safetensors")
    return d


def gpu_device(where: str):
    """The device a GPU test loads onto, by the name of what drives it: ``torch`` (``"cuda"``), ``cupy``
    (:class:`~gdsload.loader.devices.CupyDevice`; skipped without cupy) or ``driver``
    (:class:`~gdsload.loader.devices.DriverDevice`, torch-free)."""
    if where == "cupy":
        pytest.importorskip("cupy")
        from gdsload.loader.devices import CupyDevice

        return CupyDevice(0)
    if where == "driver":
        from gdsload.loader.devices import DriverDevice

        return DriverDevice(0)
    assert where == "torch", where
    return "cuda"
