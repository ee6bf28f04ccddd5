"""Codecs: each one an object in the registry (:mod:`.registry`; the built-ins ANS, Zstd and GDeflate in a module
each), run on the CPU by :mod:`.cpu` and on a GPU through nvCOMP by :mod:`.gpu`.

Encoding picks the codec's parameters from the tensor's dtype; decoding writes straight into the tensor's slot in
the arena. nvCOMP is imported only when a GPU codec runs, so the CPU path works on hosts without CUDA.
"""

from __future__ import annotations

import sys
import zlib
from typing import TYPE_CHECKING, Any

from .cpu import check_crc32, cpu_decode, encode_chunks
from .gpu import DecodeJob, GpuCodecs, gather_chunks
from .registry import Codec, codec, register_codec
from ..config import usable_cores
from ..devices import as_device
from ..format.compression import CompressedEntry

if TYPE_CHECKING:  # numpy is imported by the encoders: decoding imports none
    import numpy as np
    import torch

__all__ = [
    "Codec",
    "codec",
    "register_codec",
    "default_params",
    "encode_tensor",
    "cpu_decode",
    "check_crc32",
    "GpuCodecs",
    "DecodeJob",
    "nvcomp_available",
    "cuda_device_count",
]


def _c_library_unavailable() -> str | None:
    from .nvcomp_c import library_unavailable

    return library_unavailable()


def default_params(codec_name: str, dtype: str) -> dict[str, Any]:
    """The encoder parameters ``codec_name`` uses for a tensor of safetensors ``dtype``."""
    return codec(codec_name).params(dtype)


def cuda_device_count() -> int:
    """CUDA devices this process sees, asked of the CUDA driver unless torch is already loaded (torch costs seconds)."""
    if "torch" not in sys.modules:
        from .. import driver

        n = driver.device_count()
        if n:
            return n  # none: torch gives the answer (and its reason) below
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nvcomp_available(*, library_only: bool = False) -> str | None:
    """None when nvCOMP and a CUDA device are usable, else why not.

    ``library_only``: only nvCOMP's C library is needed, not its Python package (a load whose tensors are all
    ANS chunks decodes them through the C API, and importing the package would only delay its first decode).
    """
    if not cuda_device_count():
        return "no CUDA device"
    if library_only:
        from .nvcomp_c import library_unavailable

        return library_unavailable()
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError as e:
        return f"nvidia-nvcomp is not installed ({e}); install gdsload[cu12] or gdsload[cu13]"
    return None


def encode_tensor(
    name: str,
    tensor: torch.Tensor,
    dtype: str,
    codec_name: str,
    *,
    params: dict[str, Any] | None = None,
    checksum: bool = True,
    threads: int | None = None,
    keep_on_device: bool = False,
) -> tuple[CompressedEntry, np.ndarray | torch.Tensor]:
    """Compress one tensor; returns its metadata entry and the stored bytes (host uint8 array; with
    ``keep_on_device``, a CUDA tensor's stay on its GPU as a uint8 tensor, for the caller to copy out).

    A CUDA tensor is compressed on its GPU with nvCOMP where the codec has a GPU side; other tensors on the CPU
    through the codec's :meth:`~gdsload.loader.codecs.registry.Codec.encode_chunk`, ``threads`` chunks at once
    (None: one per core this process may run on).
    """
    import torch

    spec = codec(codec_name)
    params = dict(spec.params(dtype) if params is None else params)
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    nbytes = raw.numel()
    layout = spec.layouts[0]
    if not (raw.is_cuda and spec.gpu):
        host = raw.cpu().numpy()
        blob, sizes, crc = encode_chunks(name, host, codec_name, params, threads or usable_cores(), checksum=checksum)
        entry = CompressedEntry(
            name,
            dtype,
            tuple(tensor.shape),
            nbytes,
            codec_name,
            layout,
            blob.size,
            params,
            spec.chunk_bytes,
            sizes,
            crc,
        )
        return entry, blob
    codecs = GpuCodecs(as_device(raw.device), encode=True)
    crc = None
    if checksum:
        # On the GPU when the tensor's device is the current one and torch works on its default stream, which
        # nvCOMP's kernel then runs on (and is ordered after the tensor's making); else of a host copy.
        on_default = (
            raw.device.index == torch.cuda.current_device() and torch.cuda.current_stream(raw.device).cuda_stream == 0
        )
        crc = codecs.crc32(raw, f"tensor {name!r}") if on_default else zlib.crc32(raw.cpu().numpy())
    if layout == "native":
        enc = codecs.native(codec_name, params).encode(codecs.nv.as_array(raw))
        # buffer_size waits for the encoder and is the compressed size; the exported buffer may be
        # the (larger) worst-case capacity.
        size = enc.buffer_size
        blob = torch.from_dlpack(enc).view(torch.uint8).reshape(-1)[:size]
        blob = blob.clone() if keep_on_device else blob.cpu().numpy()
        entry = CompressedEntry(name, dtype, tuple(tensor.shape), nbytes, codec_name, layout, size, params, crc32=crc)
        return entry, blob
    chunk, align = spec.chunk_bytes, spec.chunk_align
    if raw.data_ptr() % 16:  # nvCOMP's ANS compressor wants 16-byte aligned chunks; a fresh copy is aligned
        raw = raw.clone()
    entry = CompressedEntry(
        name, dtype, tuple(tensor.shape), nbytes, codec_name, layout, 0, params, chunk, (), crc, align
    )
    if spec.batch_decoder and _c_library_unavailable() is None:  # ANS: every chunk in one call of nvCOMP's C API
        blob, sizes = codecs.ans_chunks(raw, codec_name, params, f"tensor {name!r}")
    else:
        enc = codecs.chunked(codec_name, params).encode(codecs.nv.as_arrays(list(raw.split(chunk))))
        sizes = tuple(int(a.buffer_size) for a in enc)  # waits for the encoder
        blob = gather_chunks(enc, entry._replace(chunks=sizes).chunk_table()[0].tolist(), sizes, raw.device)
    entry = entry._replace(chunks=sizes, stored_bytes=blob.numel())
    return entry, blob if keep_on_device else blob.cpu().numpy()
