"""``gdsload shard --compress ans`` on a GPU without torch: no uncompressed shard reaches the disk.

1. The source tensors the plan needs are read into GPU memory once, file by file (the load
   pipeline, :func:`~gdsload.loader.pipeline.load.load_rank` on a :class:`~gdsload.loader.devices.CupyDevice`).
2. Each output file's tensors are built there: a whole source tensor, or one range of its rows, is
   used where it lies; fused, padded or column-split tensors are copied together (one 2-D copy per
   piece); constants are filled from the host.
3. The file is compressed, laid out and written as ``gdsload compress`` does it
   (:func:`~gdsload.loader.prepare.gpu_compress.encode_tensors`,
   :func:`~gdsload.loader.prepare.gpu_compress.write_encoded`): a file is written while the next is built.

The files and manifest are, byte for byte, those of sharding this plan through torch and then compressing
the shards (:func:`~gdsload.loader.prepare.compress.compress_dir`); the resuming and atomicity of
:func:`~gdsload.loader.prepare.shard.execute_plan` hold unchanged.
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gdsload.loader.config import format_bytes
from gdsload.loader.dtypes import ITEMSIZE
from gdsload.loader.prepare.gpu_compress import DeviceTensor, EncodedFile, Job, encode_tensors, torch_free_gpu, \
    write_encoded
from gdsload.loader.prepare.shard import PlannedFile, ShardPlan, SourceReadError, file_metadata
from gdsload.loader.prepare.shard_rules import OutTensor

__all__ = ["gpu_for", "GpuShardWriter", "compression_totals"]

log = logging.getLogger(__name__)

_ENCODE_FACTOR = 4
"""GPU memory an output file takes while it is built and encoded, in multiples of its size (see
:func:`~gdsload.loader.prepare.gpu_compress.compress_files`)."""


def gpu_for(plan: ShardPlan) -> int | None:
    """The GPU that can build and compress ``plan``'s files without torch, or None: the plan does not
    compress with ANS, quantizes (done through torch), :func:`torch_free_gpu` finds no GPU path, or
    the GPU lacks the memory to hold the source and a file being encoded (logged)."""
    options = plan.options
    if options.compress is None or options.quantize is not None or not all(
            _buildable(plan, t, spec.dtype) for f in plan.files for t, spec in zip(f.tensors, f.specs)):
        return None
    index = torch_free_gpu(options.compress, None)
    if index is None:
        return None
    import cupy

    from gdsload.loader.prepare.gpu_compress import _free_bytes

    need = _source_bytes(plan) + _ENCODE_FACTOR * max((f.nbytes for f in plan.files), default=0)
    free = _free_bytes(cupy, index)
    if free < need:
        log.info("sharding through torch, then compressing: building the files on GPU %d takes %s, %s is free",
                 index, format_bytes(need), format_bytes(free))
        return None
    return index


def compression_totals(paths: Sequence[Path]) -> tuple[int, int]:
    """Logical and stored bytes of the tensors of ``paths`` (from their headers)."""
    from gdsload.loader.format.compression import parse_compression
    from gdsload.loader.format.safetensors import read_header

    logical = stored = 0
    for path in paths:
        header = read_header(path)
        packed = parse_compression(header)
        stored += sum(t.nbytes for t in header.tensors)
        logical += sum(packed[t.name].nbytes if t.name in packed else t.nbytes for t in header.tensors)
    return logical, stored


def _buildable(plan: ShardPlan, t: OutTensor, dtype: str) -> bool:
    """Whether :func:`_build` can make ``t`` (every tensor of Llama-family shardings without quantization)."""
    if t.op == "fill":
        return dtype in ("F32", "F16", "BF16")
    if t.op != "copy" or t.dim not in (None, 0, 1):
        return False
    return t.dim != 1 or (not t.pad and all(len(plan._src.shape(p.source)) == 2 for p in t.pieces))


def _needed(plan: ShardPlan, files: Sequence[PlannedFile]) -> dict[str, set[str]]:
    """Source file -> the names of its tensors that ``files`` are built from."""
    by_file: dict[str, set[str]] = collections.defaultdict(set)
    for f in files:
        for t in f.tensors:
            for p in t.pieces:
                by_file[plan._src.tensors[p.source].path].add(p.source)
    return by_file


def _source_bytes(plan: ShardPlan) -> int:
    src = plan._src
    return sum(src.tensors[n].info.nbytes for names in _needed(plan, plan.files).values() for n in names)


class GpuShardWriter:
    """A :class:`~gdsload.loader.prepare.shard.FilesWriter` that builds, compresses (ANS) and writes a
    plan's files on GPU ``index`` (from :func:`gpu_for`).

    >>> plan = plan_shard("/models/Llama-3-8B", ShardOptions(tp=2, compress="ans"))  # doctest: +SKIP
    >>> execute_plan(plan, "/models/llama3-tp2-ans", files_writer=GpuShardWriter(plan, gpu_for(plan)))
    """

    def __init__(self, plan: ShardPlan, index: int, *, min_gain: float = 0.02, checksum: bool = True,
                 min_tensor_bytes: int | None = None):
        from gdsload.loader.prepare.compress import MIN_TENSOR_BYTES

        self.plan = plan
        self.index = index
        self.min_gain = min_gain
        self.checksum = checksum
        self.min_tensor_bytes = MIN_TENSOR_BYTES if min_tensor_bytes is None else min_tensor_bytes

    def write(self, todo: Sequence[tuple[PlannedFile, Path]], progress: Callable[[int], None] | None) -> dict[str, str]:
        from gdsload.loader.devices import CupyDevice

        if not todo:
            return {}
        dev = CupyDevice(self.index)
        sources, loads = self._load_sources(dev, [f for f, _ in todo])
        try:
            jobs = [Job(str(path), _ENCODE_FACTOR * f.nbytes, functools.partial(self._encode, dev, sources, f, path))
                    for f, path in todo]
            stats = write_encoded(jobs, [f.nbytes for f, _ in todo], index=self.index,
                                  digest=self.plan.options.digest, progress=progress)
        finally:
            for loaded in loads:
                loaded.close()
        return {f.relpath: s.digests[str(path)] for (f, path), s in zip(todo, stats) if str(path) in s.digests}

    def manifest_extra(self, paths: Sequence[Path]) -> dict[str, Any]:
        """The ``compression`` block ``gdsload compress`` records, over every file of the output."""
        logical, stored = compression_totals(paths)
        return {"compression": {"codec": self.plan.options.compress, "min_gain": self.min_gain,
                                "ratio": round(logical / stored if stored else 1.0, 4)}}

    def _load_sources(self, dev: Any, files: Sequence[PlannedFile]) -> tuple[dict[str, DeviceTensor], list[Any]]:
        from gdsload.loader.pipeline.load import load_rank

        sources: dict[str, DeviceTensor] = {}
        loads: list[Any] = []
        try:
            for path, names in sorted(_needed(self.plan, files).items()):
                loaded = load_rank(path, device=dev, only=names)
                loads.append(loaded)
                for s in loaded.slots:
                    planned = self.plan._src.tensors[s.name].info
                    if (s.dtype, tuple(s.shape)) != (planned.dtype, tuple(planned.shape)):
                        raise SourceReadError(
                            errno.ESTALE, f"{path!r}: tensor {s.name!r} is now {s.dtype} {list(s.shape)}, planned as "
                            f"{planned.dtype} {list(planned.shape)}; the source changed since planning — restore it "
                            "and rerun")
                    address = int(loaded.arenas[s.buffer].data.ptr) + s.offset
                    sources[s.name] = DeviceTensor(s.name, s.dtype, tuple(s.shape), address, s.nbytes)
        except BaseException:
            for loaded in loads:
                loaded.close()
            raise
        return sources, loads

    def _encode(self, dev: Any, sources: dict[str, DeviceTensor], f: PlannedFile, path: Path) -> EncodedFile:
        from gdsload.loader.format.safetensors import aligned_header

        metadata = file_metadata(self.plan, f)
        # The order the uncompressed shard's header lists its tensors in: what `gdsload compress` reads.
        order, _, _ = aligned_header(f.specs, metadata)
        by_name = {t.name: t for t in f.tensors}
        stream = dev.cupy.cuda.Stream(non_blocking=True)
        held: list[Any] = []  # the tensors built here, alive until encoded
        tensors = [_build(dev, stream, sources, by_name[spec.name], spec.dtype, held) for spec in order]
        stream.synchronize()
        return encode_tensors(dev, tensors, metadata, path, mode_from=None, min_gain=self.min_gain,
                              checksum=self.checksum, min_tensor_bytes=self.min_tensor_bytes)


def _build(dev: Any, stream: Any, sources: dict[str, DeviceTensor], t: OutTensor, dtype: str,
           held: list[Any]) -> DeviceTensor:
    """Output tensor ``t`` in GPU memory: where it lies in a source tensor, or built into a new buffer."""
    runtime = dev.cupy.cuda.runtime
    nbytes = math.prod(t.shape) * ITEMSIZE[dtype]
    if t.op == "fill":
        host = _filled(t.fill, dtype, math.prod(t.shape))
        buf = dev.empty(nbytes)
        held += [buf, host]  # the host bytes too: the copy is done when the stream is synchronized
        runtime.memcpyAsync(int(buf.data.ptr), host.ctypes.data, nbytes, 1, stream.ptr)
        return DeviceTensor(t.name, dtype, t.shape, int(buf.data.ptr), nbytes)
    if t.op != "copy":
        raise ValueError(f"output tensor {t.name!r}: op {t.op!r} is built through torch (gdsload shard --quantize)")
    first = sources[t.pieces[0].source]
    if t.dim is None:  # the whole source
        return DeviceTensor(t.name, dtype, t.shape, first.address, first.nbytes)
    if t.dim == 0 and len(t.pieces) == 1 and not t.pad:  # one range of rows: where it lies
        row = math.prod(first.shape[1:]) * ITEMSIZE[dtype]
        p = t.pieces[0]
        return DeviceTensor(t.name, dtype, t.shape, first.address + p.start * row, p.length * row)
    buf = dev.empty(nbytes)
    held.append(buf)
    base, at = int(buf.data.ptr), 0
    item = ITEMSIZE[dtype]
    for p in t.pieces:
        src = sources[p.source]
        if t.dim == 0:
            row = math.prod(src.shape[1:]) * item
            runtime.memcpyAsync(base + at, src.address + p.start * row, p.length * row, 3, stream.ptr)
            at += p.length * row
        elif t.dim == 1 and len(src.shape) == 2 and not t.pad:  # columns: one 2-D copy, row by row
            rows, cols = src.shape
            runtime.memcpy2DAsync(base + at, t.shape[1] * item, src.address + p.start * item, cols * item,
                                  p.length * item, rows, 3, stream.ptr)
            at += p.length * item
        else:
            raise ValueError(f"output tensor {t.name!r}: pieces along dim {t.dim} of {p.source!r} "
                             f"{list(src.shape)} with {t.pad} padding rows cannot be built here")
    if t.pad:
        runtime.memsetAsync(base + at, 0, nbytes - at, stream.ptr)
    return DeviceTensor(t.name, dtype, t.shape, base, nbytes)


def _filled(value: float, dtype: str, count: int) -> np.ndarray:
    """``count`` copies of ``value`` as ``dtype`` (F32, F16 or BF16, rounded to nearest even), as bytes."""
    if dtype == "F32":
        return np.full(count, value, np.float32).view(np.uint8)
    if dtype == "F16":
        return np.full(count, value, np.float16).view(np.uint8)
    if dtype == "BF16":
        bits = np.full(count, value, np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype(np.uint16).view(np.uint8)
    raise ValueError(f"a constant of dtype {dtype} cannot be built here")
