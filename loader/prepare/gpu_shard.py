"""``gdsload shard --codec ans`` on a GPU without torch: no uncompressed shard reaches the disk.

1. The source tensors the plan needs are read into GPU memory once, file by file (the load
   pipeline, :func:`~gdsload.loader.pipeline.load.load_rank` on a :class:`~gdsload.loader.devices.CupyDevice`).
2. Each output file's tensors are built there from their recipes: a whole source tensor, or one
   contiguous block of it, is used where it lies; fused, padded, column-split or expert-stacked tensors
   are copied together (one 2-D copy per part); constants are filled from the host.
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

from ..config import format_bytes
from ..dtypes import ITEMSIZE
from .gpu_compress import (
    DeviceTensor,
    EncodedFile,
    Job,
    encode_tensors,
    torch_free_gpu,
    write_encoded,
)
from ..format import checksums
from .recipe import Recipe, View
from .shard import PlannedFile, ShardPlan, SourceReadError, file_metadata

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
    if (
        options.compress is None
        or options.quantize is not None
        or not all(_buildable(plan, t, spec.dtype) for f in plan.files for t, spec in zip(f.tensors, f.specs))
    ):
        return None
    index = torch_free_gpu(options.compress, None)
    if index is None:
        return None
    import cupy

    from .gpu_compress import _free_bytes

    need = _source_bytes(plan) + _ENCODE_FACTOR * max((f.nbytes for f in plan.files), default=0)
    free = _free_bytes(cupy, index)
    if free < need:
        log.info(
            "sharding through torch, then compressing: building the files on GPU %d takes %s, %s is free",
            index,
            format_bytes(need),
            format_bytes(free),
        )
        return None
    return index


def compression_totals(paths: Sequence[Path]) -> tuple[int, int]:
    """Logical and stored bytes of the tensors of ``paths`` (from their headers)."""
    from ..format.compression import parse_compression
    from ..format.safetensors import read_header

    logical = stored = 0
    for path in paths:
        header = read_header(path)
        packed = parse_compression(header)
        stored += sum(t.nbytes for t in header.tensors)
        logical += sum(packed[t.name].nbytes if t.name in packed else t.nbytes for t in header.tensors)
    return logical, stored


def _fold(view: View) -> tuple[int, int, int] | None:
    """``(rows, row stride, row length)`` in elements when ``view`` is rows of contiguous elements, else None."""
    dims = [(n, st) for n, st in zip(view.shape, view.strides) if n != 1]
    length = 1
    while dims and dims[-1][1] == length:
        length *= dims.pop()[0]
    if not dims:
        return 1, length, length
    if len(dims) == 1:
        return dims[0][0], dims[0][1], length
    return None


def _copy_geometry(dst: View, src: View) -> tuple[int, int, int, int] | None:
    """``(rows, dst pitch, src pitch, row length)`` (elements) of one 2-D copy from ``src`` to ``dst``, or None."""
    a, b = _fold(dst), _fold(src)
    if a is None or b is None:
        return None
    if a[0] == 1 and b[0] > 1 and a[2] == b[0] * b[2]:
        a = (b[0], b[2], b[2])
    elif b[0] == 1 and a[0] > 1 and b[2] == a[0] * a[2]:
        b = (a[0], a[2], a[2])
    if a[0] != b[0] or a[2] != b[2]:
        return None
    return a[0], a[1], b[1], a[2]


def _buildable(plan: ShardPlan, t: Recipe, dtype: str) -> bool:
    """Whether :func:`_build` can make ``t``: copies without dtype change and constants, each a 2-D region."""
    for p in t.parts:
        if p.kind in ("fill", "const"):
            if _fold(p.dst) is None or p.kind == "fill" and dtype not in ("F32", "F16", "BF16"):
                return False
        elif p.kind != "copy" or plan.source.dtype(p.source) != dtype or _copy_geometry(p.dst, p.src) is None:
            return False
    return True


def _needed(plan: ShardPlan, files: Sequence[PlannedFile]) -> dict[str, set[str]]:
    """Source file -> the names of its tensors that ``files`` are built from."""
    by_file: dict[str, set[str]] = collections.defaultdict(set)
    for f in files:
        for t in f.tensors:
            for name in t.sources:
                by_file[plan.source.tensors[name].path].add(name)
    return by_file


def _source_bytes(plan: ShardPlan) -> int:
    src = plan.source
    return sum(src.tensors[n].info.nbytes for names in _needed(plan, plan.files).values() for n in names)


class GpuShardWriter:
    """A :class:`~gdsload.loader.prepare.shard.FilesWriter` that builds, compresses (ANS) and writes a
    plan's files on GPU ``index`` (from :func:`gpu_for`).

    >>> plan = plan_shard("/models/Llama-3-8B", ShardOptions(tp=2, compress="ans"))  # doctest: +SKIP
    >>> execute_plan(plan, "/models/llama3-tp2-ans", files_writer=GpuShardWriter(plan, gpu_for(plan)))
    """

    def __init__(
        self,
        plan: ShardPlan,
        index: int,
        *,
        min_gain: float = 0.02,
        checksum: bool = True,
        min_tensor_bytes: int | None = None,
    ):
        from .compress import MIN_TENSOR_BYTES

        self.plan = plan
        self.index = index
        self.min_gain = min_gain
        self.checksum = checksum
        self.min_tensor_bytes = MIN_TENSOR_BYTES if min_tensor_bytes is None else min_tensor_bytes

    def write(self, todo: Sequence[tuple[PlannedFile, Path]], progress: Callable[[int], None] | None) -> dict[str, str]:
        from ..devices import CupyDevice

        if not todo:
            return {}
        dev = CupyDevice(self.index)
        sources, loads = self._load_sources(dev, [f for f, _ in todo])
        try:
            jobs = [
                Job(str(path), _ENCODE_FACTOR * f.nbytes, functools.partial(self._encode, dev, sources, f, path))
                for f, path in todo
            ]
            stats = write_encoded(
                jobs, [f.nbytes for f, _ in todo], index=self.index, digest=self.plan.options.digest, progress=progress
            )
        finally:
            for loaded in loads:
                loaded.close()
        return {f.relpath: s.digests[str(path)] for (f, path), s in zip(todo, stats) if str(path) in s.digests}

    def manifest_extra(self, paths: Sequence[Path]) -> dict[str, Any]:
        """The ``compression`` block ``gdsload compress`` records, over every file of the output."""
        logical, stored = compression_totals(paths)
        return {
            "compression": {
                "codec": self.plan.options.compress,
                "min_gain": self.min_gain,
                "ratio": round(logical / stored if stored else 1.0, 4),
            }
        }

    def _load_sources(self, dev: Any, files: Sequence[PlannedFile]) -> tuple[dict[str, DeviceTensor], list[Any]]:
        from ..pipeline.load import load_rank

        sources: dict[str, DeviceTensor] = {}
        loads: list[Any] = []
        try:
            for path, names in sorted(_needed(self.plan, files).items()):
                loaded = load_rank(path, device=dev, only=names)
                loads.append(loaded)
                for s in loaded.slots:
                    planned = self.plan.source.tensors[s.name].info
                    if (s.dtype, tuple(s.shape)) != (planned.dtype, tuple(planned.shape)):
                        raise SourceReadError(
                            errno.ESTALE,
                            f"{path!r}: tensor {s.name!r} is now {s.dtype} {list(s.shape)}, planned as "
                            f"{planned.dtype} {list(planned.shape)}; the source changed since planning — restore it "
                            "and rerun",
                        )
                    address = int(loaded.arenas[s.buffer].data.ptr) + s.offset
                    sources[s.name] = DeviceTensor(s.name, s.dtype, tuple(s.shape), address, s.nbytes)
        except BaseException:
            for loaded in loads:
                loaded.close()
            raise
        return sources, loads

    def _encode(self, dev: Any, sources: dict[str, DeviceTensor], f: PlannedFile, path: Path) -> EncodedFile:
        from ..format.writer import aligned_header

        metadata = file_metadata(self.plan, f)
        # The order the uncompressed shard's header lists its tensors in: what `gdsload compress` reads.
        order, _, _ = aligned_header(f.specs, metadata)
        by_name = {t.name: t for t in f.tensors}
        stream = dev.cupy.cuda.Stream(non_blocking=True)
        held: list[Any] = []  # the tensors built here, alive until encoded
        tensors = [_build(dev, stream, sources, by_name[spec.name], spec.dtype, held) for spec in order]
        stream.synchronize()
        metadata[checksums.METADATA_KEY] = _checksum_table(dev, stream, tensors, f, str(path))
        return encode_tensors(
            dev,
            tensors,
            metadata,
            path,
            mode_from=None,
            min_gain=self.min_gain,
            checksum=self.checksum,
            min_tensor_bytes=self.min_tensor_bytes,
        )


def _checksum_table(dev: Any, stream: Any, tensors: Sequence[DeviceTensor], f: PlannedFile, what: str) -> str:
    """The checksum table the uncompressed shard's writer records (every tensor, in the plan's order), which the
    compressed file keeps: CRCs of the tensors built on the GPU, in one batch."""
    from ..codecs.gpu import CupyStreamBytes
    from ..codecs.nvcomp_c import device_crc32
    from .gpu_compress import _host_crc32

    nonempty = [t for t in tensors if t.nbytes]
    got = (
        device_crc32([(t.address, t.nbytes) for t in nonempty], CupyStreamBytes(stream.ptr), stream.ptr, what)
        if nonempty
        else []
    )
    crc = {
        t.name: int(got[i]) if got is not None else _host_crc32(dev.cupy, t.address, t.nbytes)
        for i, t in enumerate(nonempty)
    }
    return checksums.render({spec.name: crc.get(spec.name, 0) for spec in f.specs})


def _build(
    dev: Any, stream: Any, sources: dict[str, DeviceTensor], t: Recipe, dtype: str, held: list[Any]
) -> DeviceTensor:
    """Output tensor ``t`` in GPU memory: where it lies in a source tensor, or built into a new buffer."""
    runtime = dev.cupy.cuda.runtime
    item = ITEMSIZE[dtype]
    nbytes = math.prod(t.shape) * item
    whole = View.of(t.shape)
    if t.init is None and len(t.parts) == 1 and t.parts[0].kind == "copy" and t.parts[0].dst == whole:
        p = t.parts[0]
        src = sources[p.source]  # type: ignore[index]
        if _fold(p.src) is not None and _fold(p.src)[0] == 1:  # type: ignore[index]
            return DeviceTensor(t.name, dtype, t.shape, src.address + p.src.offset * item, nbytes)  # type: ignore[union-attr]
    buf = dev.empty(nbytes)
    held.append(buf)
    base = int(buf.data.ptr)
    if t.init is not None:
        host = np.frombuffer(t.init, dtype=np.uint8).copy()
        held.append(host)  # alive until the stream is synchronized
        runtime.memcpyAsync(base, host.ctypes.data, nbytes, 1, stream.ptr)
    for p in t.parts:
        if p.kind in ("fill", "const"):
            rows, pitch, length = _fold(p.dst)  # type: ignore[misc]
            host = (
                _filled(float(p.value), dtype, p.dst.numel)
                if p.kind == "fill"
                else np.frombuffer(p.value or b"", dtype=np.uint8).copy()
            )  # type: ignore[arg-type]
            held.append(host)
            runtime.memcpy2DAsync(
                base + p.dst.offset * item,
                pitch * item,
                host.ctypes.data,
                length * item,
                length * item,
                rows,
                1,
                stream.ptr,
            )
            continue
        geometry = _copy_geometry(p.dst, p.src)  # type: ignore[arg-type]
        if p.kind != "copy" or geometry is None:
            raise ValueError(
                f"output tensor {t.name!r}: a {p.kind} part from {p.source!r} cannot be built on the GPU "
                "(gdsload shard builds it through torch)"
            )
        rows, dpitch, spitch, length = geometry
        src = sources[p.source]  # type: ignore[index]
        runtime.memcpy2DAsync(
            base + p.dst.offset * item,
            dpitch * item,
            src.address + p.src.offset * item,  # type: ignore[union-attr]
            spitch * item,
            length * item,
            rows,
            3,
            stream.ptr,
        )
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
