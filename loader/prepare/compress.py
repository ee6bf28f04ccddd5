"""``compress``: re-pack safetensors files or directories as compressed, aligned safetensors.

Every tensor keeps its name. Tensors smaller than ``min_tensor_bytes``, or that do not shrink
by at least ``min_gain``, stay raw. Compression runs on the GPU (nvCOMP) when ``device`` is a
CUDA device; on the CPU only Zstd is available. Output is atomic: a directory is built beside
the destination and renamed into place when complete. ANS on a GPU runs without torch
(:mod:`gdsload.loader.prepare.gpu_compress`); the other codecs, and hosts without cupy, through torch.
"""

from __future__ import annotations

import json
import errno
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..codecs import default_params, encode_tensor, nvcomp_available
from ..codecs.registry import CPU_DEFAULT, GPU_DEFAULT, codec as codec_spec, codec_names
from ..format.compression import FORMAT_VERSION, METADATA_KEY, parse_compression
from ..format.digests import require
from ..format.discovery import scan_layout
from ..errors import CodecError, ConfigError, GdsloadError
from ..format.atomic import create_locked, remove_dead_leftovers
from ..format.safetensors import read_header
from ..format.writer import AlignedWriter, TensorSpec
from ..format.manifest import MANIFEST_NAME, write_manifest
from .build import CompressWriteError, write_error
from .gpu_compress import compress_files, torch_free_gpu
from .stats import CompressStats

if TYPE_CHECKING:
    import torch

__all__ = ["CompressStats", "compress_file", "compress_dir", "resolve_codec", "MIN_TENSOR_BYTES"]


WRITING_MARKER = ".gdsload-writing"
"""Kept in the staging directory until the output is complete (see discovery's ``UNFINISHED_MARKERS``)."""

log = logging.getLogger(__name__)

_OUTPUT_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
"""Write failures that are the output's, not the source's: a :class:`CompressWriteError` names the fix."""

MIN_TENSOR_BYTES = 64 << 10
"""Tensors smaller than this stay raw: too small to gain, and cheaper to read than to decode."""


def compress_device(codec: str, device: str | torch.device | None) -> torch.device:
    """Where ``codec`` compresses (``device`` None: the GPU when nvCOMP works); CodecError when it cannot here."""
    import torch

    if device is None:
        device = "cuda" if nvcomp_available() is None else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu" and not codec_spec(codec).cpu_encode:
        cpu = [c for c in codec_names() if codec_spec(c).cpu_encode and codec_spec(c).cpu_decode]
        raise CodecError(
            f"codec {codec!r} compresses on a GPU only (nvCOMP): {nvcomp_available() or 'device=cpu was asked for'}; "
            f"run on a CUDA host, or use {' or '.join(map(repr, cpu))}, which the CPU can write and read"
        )
    return dev


def compress_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    codec: str = "auto",
    min_gain: float = 0.02,
    device: str | torch.device | None = None,
    checksum: bool = True,
    min_tensor_bytes: int = MIN_TENSOR_BYTES,
    progress: Callable[[int], None] | None = None,
    digest: bool | str = True,
) -> CompressStats:
    """Compress one safetensors file into ``dst`` (written atomically); with ``digest`` (True: blake3; or
    ``"sha256"``) the stats hold its digest, computed from the bytes as they are written.

    >>> compress_file("model.safetensors", "model.z.safetensors", codec="zstd", device="cpu")  # doctest: +SKIP
    """
    codec = resolve_codec(codec, device)
    _check_options(codec, min_gain)
    require(digest)  # the digest asked for can be made: checked before any file is encoded
    t0 = time.perf_counter()
    index = torch_free_gpu(codec, device)
    if index is not None:
        stats = compress_files(
            [(src, dst)],
            index=index,
            min_gain=min_gain,
            checksum=checksum,
            min_tensor_bytes=min_tensor_bytes,
            digest=digest,
            progress=progress,
        )[0]
        stats.seconds = time.perf_counter() - t0
        return stats
    import torch

    from ..pipeline.load import load_rank

    dev = compress_device(codec, device)
    header = read_header(src)
    source_entries = parse_compression(header)  # a compressed source is decoded, then re-compressed
    # On the CPU the tensors are compressed or written straight from the file's pages (mapped, not copied).
    loaded = load_rank(src, device=dev, backend="mmap" if dev.type == "cpu" else None)
    stats = CompressStats(files=1)
    specs: list[TensorSpec] = []
    blobs: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for t in header.tensors:
        tensor = loaded.tensors[t.name]
        nbytes = tensor.numel() * tensor.element_size()
        stats.tensors += 1
        stats.logical_bytes += nbytes
        kept = False
        if nbytes >= min_tensor_bytes:
            dtype = source_entries[t.name].dtype if t.name in source_entries else t.dtype
            # On a GPU the compressed bytes stay there until written (copied out through pinned memory below).
            entry, blob = encode_tensor(
                t.name,
                tensor,
                dtype,
                codec,
                params=default_params(codec, dtype),
                checksum=checksum,
                keep_on_device=True,
            )
            stored = int(blob.nbytes)
            if stored <= (1 - min_gain) * nbytes:
                kept = True
                specs.append(TensorSpec(t.name, "U8", (stored,)))
                blobs[t.name] = blob if isinstance(blob, torch.Tensor) else torch.from_numpy(blob)
                entries[t.name] = entry.to_json()
                stats.compressed += 1
                stats.stored_bytes += stored
                cur = stats.per_dtype.setdefault(dtype, [0, 0])
                cur[0] += nbytes
                cur[1] += stored
        if not kept:
            specs.append(TensorSpec.of(t.name, tensor))
            blobs[t.name] = tensor
            stats.raw += 1
            stats.stored_bytes += nbytes
        if progress is not None:
            progress(nbytes)
    metadata = {k: v for k, v in header.metadata.items() if k != METADATA_KEY}
    if entries:
        metadata[METADATA_KEY] = json.dumps({"version": FORMAT_VERSION, "tensors": entries}, separators=(",", ":"))
    with AlignedWriter(dst, specs, metadata, digest=digest) as w:
        for spec in w.order:
            w.write(spec.name, _to_host(blobs.pop(spec.name)))
    if w.digest is not None:
        stats.digests[str(dst)] = w.digest
    shutil.copymode(src, dst)  # private weights stay private (copy2 keeps the other files' modes too)
    loaded.close()
    stats.seconds = time.perf_counter() - t0
    return stats


def resolve_codec(codec: str, device: str | torch.device | None = None) -> str:
    """``auto``: ANS where nvCOMP runs (and ``device`` is not the CPU), else Zstd, which the CPU encodes and decodes.
    Any other name is returned as it is.

    >>> resolve_codec("auto", "cpu")
    'zstd'
    """
    if codec != "auto":
        return codec
    if device is not None and str(device) == "cpu":
        return CPU_DEFAULT
    return GPU_DEFAULT if nvcomp_available() is None else CPU_DEFAULT


def _check_options(codec: str, min_gain: float) -> None:
    if codec not in codec_names():
        raise ConfigError(f"codec={codec!r} is not one of {['auto', *codec_names()]}")
    if not 0 <= min_gain < 1:
        raise ConfigError(f"min_gain={min_gain!r} must be in [0, 1)")


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A GPU tensor copied into pinned host memory (a DMA at the link's speed, where pageable memory takes a
    fraction of it); host tensors as they are. The writer lets go of each copy once it is written, and torch
    keeps the freed pinned blocks for the next tensors: pinned memory is allocated about once."""
    import torch

    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


def compress_dir(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    codec: str = "auto",
    min_gain: float = 0.02,
    device: str | torch.device | None = None,
    min_tensor_bytes: int = MIN_TENSOR_BYTES,
    digest: bool | str = True,
    progress: Callable[[int], None] | None = None,
) -> CompressStats:
    """Compress every safetensors file of a model directory into ``out`` with the same names.

    Other files (config, tokenizer, generation config) are copied; ``gdsload.json`` is
    rewritten for the new files (and written if the source had none), with each file's digest when
    ``digest`` (True: blake3; or ``"sha256"``; computed from the bytes as they are written). ``out`` must not exist;
    it appears only once complete. The stats' ``seconds`` is the whole call.

    >>> compress_dir("llama-tp2", "llama-tp2-ans", codec="ans")  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    codec = resolve_codec(codec, device)
    _check_options(codec, min_gain)
    require(digest)  # the digest asked for can be made: checked before any file is encoded
    src_p, out_p = Path(src), Path(out)
    if not src_p.is_dir():
        raise ConfigError(f"source {str(src)!r} is not a directory; use compress_file for single files")
    if out_p.exists():
        raise ConfigError(f"output {str(out)!r} already exists; choose a new directory (nothing was written)")
    scanned = scan_layout(src_p)
    source, ranks, manifest = scanned.source, scanned.ranks, scanned.manifest
    out_p.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_leftovers(out_p.parent, f".{out_p.name}.partial-")  # a run killed outright left these
    staging, lock = create_locked(f".{out_p.name}.partial-", out_p.parent, directory=True)
    total = CompressStats()
    try:
        writing = staging / WRITING_MARKER  # the staging directory never loads (discovery refuses it)
        writing.touch()
        pairs: list[tuple[Path, Path]] = []
        for item in sorted(src_p.rglob("*")):  # subdirectories too: a manifest may list files in them
            rel_item = item.relative_to(src_p)
            if str(rel_item) == MANIFEST_NAME or any(part.startswith(".") for part in rel_item.parts):
                continue
            if not item.is_file():
                continue
            (staging / rel_item).parent.mkdir(parents=True, exist_ok=True)
            if item.suffix == ".safetensors":
                pairs.append((item, staging / rel_item))
            else:
                shutil.copy2(item, staging / rel_item)
        index = torch_free_gpu(codec, device)
        if index is not None:  # the files are written while the next ones are compressed
            done = compress_files(
                pairs,
                index=index,
                min_gain=min_gain,
                checksum=True,
                min_tensor_bytes=min_tensor_bytes,
                digest=digest,
                progress=progress,
            )
        else:
            done = [
                compress_file(
                    item,
                    out_item,
                    codec=codec,
                    min_gain=min_gain,
                    device=device,
                    min_tensor_bytes=min_tensor_bytes,
                    progress=progress,
                    digest=digest,
                )
                for item, out_item in pairs
            ]
        for (item, _), stats in zip(pairs, done):
            log.info(
                "%s: %d/%d tensors compressed, ratio %.3f",
                item.relative_to(src_p),
                stats.compressed,
                stats.tensors,
                stats.ratio,
            )
            total.add(stats)
        rel = {r: [os.path.relpath(p, src_p) for p in files] for r, files in ranks.items()}
        layout = manifest.layout if manifest else {"vllm": "vllm", "trtllm": "trtllm"}.get(source, "plain")
        extra = dict(manifest.extra) if manifest else {}
        extra["compression"] = {"codec": codec, "min_gain": min_gain, "ratio": round(total.ratio, 4)}
        digests = {os.path.relpath(p, staging): d for p, d in total.digests.items()}
        write_manifest(
            staging,
            rel,
            tp_size=scanned.tp_size,
            pp_size=scanned.pp_size,
            ep_size=scanned.ep_size,
            layout=layout,
            extra=extra,
            digest=digest,
            digests=digests,
        )
        writing.unlink()
        os.rename(staging, out_p)  # OUT appears complete, in one step
        total.digests = {str(out_p / rel): d for rel, d in digests.items()}
        total.seconds = time.perf_counter() - t0
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, GdsloadError) and e.errno in _OUTPUT_FULL:
            raise write_error(e, out_p, "the compressed copy", CompressWriteError) from e
        raise
    finally:
        os.close(lock)
    return total
