"""Reading a tensor file (:mod:`.tensorfile`) into memory the caller gives, every segment's checksum checked.

Into CPU memory, raw entries are read straight into their destination and compressed ones decoded there (Zstd on
every core: a task per 8 MiB segment reads that segment's frames, decodes them, undoes a byte-plane split and checks
the segment's CRC-32 while the bytes are in cache). Into GPU memory, an entry's stored bytes are copied to the GPU
and decoded there with nvCOMP (or, without nvCOMP, decoded on the CPU first), then checked on the GPU.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .encode import (
    FRAME,
    SEGMENT,
    check_segments,
    decode_crcs,
    gpu_crcs,
    pool,
    torch_dtype,
    unsplit,
    unsplit_frame,
)
from .tensorfile import FORMAT_VERSION, TENSORS_KEY
from ..codecs import nvcomp_available
from ..codecs.registry import codec as codec_spec
from ..errors import CheckpointError, CodecError
from ..format.compression import CompressedEntry, parse_compression
from ..format.safetensors import SafetensorsHeader, read_header

__all__ = ["Slot", "TensorFile"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    """One entry of a tensor file: where its stored bytes are and what they hold."""

    name: str
    start: int
    """Absolute file offset of the stored bytes."""
    stored: int
    nbytes: int
    """The tensor's own bytes."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc32: tuple[int, ...]
    planes: int
    entry: CompressedEntry | None


def _pread_into(fd: int, view: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{where}: the file ends {len(view) - done} bytes early; it was truncated")
        done += n


class TensorFile:
    """An open tensor file: its header read and checked, its entries as :class:`Slot` by name.

    ``kind`` is the metadata key that says what the file is (``gdsload.object``, ``gdsload.dcp``); its JSON is
    :attr:`kind`. The file stays open (one descriptor: a save that renames a new file into place meanwhile does not
    change what is read) until :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str], kind: str, *, what: str = "gdsload checkpoint"):
        self.path = os.fspath(path)
        self._file = open(self.path, "rb")
        try:
            self.header = read_header(self.path, file=self._file)
            self.kind = self._kind(self.header, kind, what)
            self.slots = self._slots(self.header)
        except BaseException:
            self._file.close()
            raise
        self.fd = self._file.fileno()
        self._gpu: dict[int, Any] = {}

    def close(self) -> None:
        for codecs in self._gpu.values():
            codecs.close()
        self._gpu.clear()
        self._file.close()

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ the header

    @staticmethod
    def _kind(header: SafetensorsHeader, key: str, what: str) -> dict[str, Any]:
        raw = header.metadata.get(key)
        if raw is None:
            raise CheckpointError(f"{header.path!r} is a safetensors file but not a {what} (no __metadata__[{key!r}])")
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as e:
            raise CheckpointError(
                f"{header.path!r}: __metadata__[{key!r}] is not JSON ({e}); the file is corrupt"
            ) from None
        if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
            version = doc.get("version") if isinstance(doc, dict) else doc
            raise CheckpointError(
                f"{header.path!r}: {what} format version {version!r} is not {FORMAT_VERSION}; upgrade gdsload"
            )
        return doc

    def _slots(self, header: SafetensorsHeader) -> dict[str, Slot]:
        path = header.path
        try:
            doc = json.loads(header.metadata.get(TENSORS_KEY, ""))
            table = doc["tensors"]
            ok = (
                doc.get("version") == FORMAT_VERSION
                and doc.get("segment") == SEGMENT
                and isinstance(table, dict)
                and doc.get("frame") == FRAME
            )
        except (json.JSONDecodeError, KeyError, TypeError):
            ok = False
        if not ok:
            raise CheckpointError(
                f"{path!r}: __metadata__[{TENSORS_KEY!r}] is missing or malformed; the file is "
                "corrupt, or was written by another gdsload version"
            )
        comp = parse_compression(header)
        stored = {t.name: t for t in header.tensors}
        slots = {}
        for name, meta in table.items():
            where = f"{path!r}: tensor {name!r}"
            t = stored.get(name)
            if t is None or not isinstance(meta, dict):
                raise CheckpointError(f"{where} is described but not stored; the file is corrupt")
            dtype = torch_dtype(meta.get("dtype"), where)
            shape = meta.get("shape")
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise CheckpointError(f"{where}: shape {shape!r} is not a list of sizes; the file is corrupt")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            planes = meta.get("planes", 1)
            if planes not in (1, 2, 4, 8) or nbytes % planes:
                raise CheckpointError(f"{where}: planes {planes!r} cannot split {nbytes} bytes; the file is corrupt")
            entry = comp.get(name)
            size = entry.nbytes if entry is not None else t.nbytes
            if size != nbytes:
                raise CheckpointError(
                    f"{where}: {size} bytes are stored for a {list(shape)} {dtype} tensor of "
                    f"{nbytes} bytes; the file is corrupt"
                )
            if entry is not None and entry.layout == "chunks" and SEGMENT % entry.chunk_bytes:
                raise CheckpointError(
                    f"{where}: chunks of {entry.chunk_bytes} bytes do not divide the "
                    f"{SEGMENT}-byte checksum segments; the file is corrupt"
                )
            if planes > 1 and (entry is None or entry.chunk_bytes != FRAME):
                raise CheckpointError(
                    f"{where}: a byte-plane split needs {FRAME}-byte Zstd frames; the file is corrupt"
                )
            crcs = tuple(decode_crcs(meta.get("crc32"), nbytes, where))
            slots[name] = Slot(
                name, header.data_offset + t.start, t.nbytes, nbytes, dtype, tuple(shape), crcs, planes, entry
            )
        return slots

    def __getitem__(self, name: str) -> Slot:
        try:
            return self.slots[name]
        except KeyError:
            raise CheckpointError(f"{self.path!r} has no tensor {name!r}; the file is corrupt") from None

    # ------------------------------------------------------------------ reading

    def read_bytes(self, slot: Slot) -> bytes:
        """The slot's bytes in host memory (small things: a pickle, an object DCP stores as bytes)."""
        out = torch.empty(slot.nbytes, dtype=torch.uint8)
        self.read([(slot, out)])
        return out.numpy().tobytes()

    def read(self, jobs: Sequence[tuple[Slot, torch.Tensor]]) -> None:
        """Read each slot into its tensor (contiguous, any dtype and shape with the slot's byte count, on the CPU or
        a GPU), checking every segment's CRC-32; :class:`IntegrityError` or :class:`CodecError` on damage."""
        cpu, gpu = [], []
        for slot, dst in jobs:
            if not dst.is_contiguous() or dst.numel() * dst.element_size() != slot.nbytes:
                raise CheckpointError(
                    f"{self.path!r}: tensor {slot.name!r} ({slot.nbytes} bytes) cannot be read "
                    f"into a {'non-contiguous ' if not dst.is_contiguous() else ''}tensor of "
                    f"{dst.numel() * dst.element_size()} bytes; a gdsload bug"
                )
            raw = dst.reshape(-1).view(torch.uint8) if slot.nbytes else dst
            (gpu if dst.is_cuda else cpu).append((slot, raw))
        tasks = []
        for slot, raw in cpu:
            if slot.entry is not None and not codec_spec(slot.entry.codec).cpu_decode:
                self._read_gpu_codec_to_cpu(slot, raw)
                continue
            view = raw.numpy() if slot.nbytes else np.empty(0, np.uint8)
            starts = np.fromiter(slot.entry.chunk_offsets(), np.int64) if slot.entry is not None else None
            tasks += [(slot, view, i, starts) for i in range(len(slot.crc32))]
        for future in [pool().submit(self._segment, *task) for task in tasks]:
            future.result()
        for slot, raw in gpu:
            self._read_gpu(slot, raw)

    def _segment(self, slot: Slot, dst: np.ndarray, i: int, starts: np.ndarray | None) -> None:
        """Segment ``i`` of a slot into host bytes ``dst`` (the whole tensor), then its checksum."""
        where = f"{self.path!r}: tensor {slot.name!r}"
        lo, hi = i * SEGMENT, min((i + 1) * SEGMENT, slot.nbytes)
        e = slot.entry
        if e is None:
            _pread_into(self.fd, memoryview(dst[lo:hi]), slot.start + lo, where)
        else:
            assert starts is not None
            step, spec = e.chunk_bytes, codec_spec(e.codec)
            first, stop = lo // step, -(-hi // step)
            begin, end = int(starts[first]), int(starts[stop - 1]) + e.chunks[stop - 1]
            src = bytearray(end - begin)
            _pread_into(self.fd, memoryview(src), slot.start + begin, where)
            for k in range(first, stop):
                at, size = int(starts[k]) - begin, e.chunks[k]
                d_lo, d_hi = k * step, min((k + 1) * step, slot.nbytes)
                try:
                    frame = spec.decode_chunk(memoryview(src)[at : at + size], d_hi - d_lo, e.params)
                except Exception as err:  # the codec's own error for a damaged chunk
                    raise CodecError(f"{where}: {e.codec} chunk {k} is corrupt ({err}); the file is damaged") from None
                if len(frame) != d_hi - d_lo:
                    raise CodecError(
                        f"{where}: {e.codec} chunk {k} decoded to {len(frame)} bytes, expected "
                        f"{d_hi - d_lo}; the file is damaged"
                    )
                unsplit_frame(frame, dst[d_lo:d_hi], slot.planes)
        check_segments([zlib.crc32(dst[lo:hi])], [slot.crc32[i]], i, where)

    # ------------------------------------------------------------------ GPUs

    def _codecs(self, device: torch.device) -> Any:
        from ..codecs import GpuCodecs
        from ..devices import as_device

        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._gpu:
            self._gpu[index] = GpuCodecs(as_device(torch.device("cuda", index)))
        return self._gpu[index]

    def _stored_on(self, slot: Slot, device: torch.device) -> torch.Tensor:
        host = torch.empty(slot.stored, dtype=torch.uint8, pin_memory=True)
        if slot.stored:
            _pread_into(self.fd, memoryview(host.numpy()), slot.start, f"{self.path!r}: tensor {slot.name!r}")
        return host.to(device)

    def _decode_gpu(self, slot: Slot, dst: torch.Tensor) -> None:
        """Decode a compressed slot on ``dst``'s GPU into ``dst`` (its bytes, planes undone)."""
        from ..codecs import DecodeJob

        assert slot.entry is not None
        src = self._stored_on(slot, dst.device)
        out = torch.empty_like(dst) if slot.planes > 1 else dst
        codecs = self._codecs(dst.device)
        with torch.cuda.device(dst.device):
            codecs.decode_many([DecodeJob(slot.entry, src, out, self.path)])
            codecs.finish()
            torch.cuda.current_stream().synchronize()
            if slot.planes > 1:
                unsplit(out, dst, slot.planes)

    def _check_gpu(self, slot: Slot, raw: torch.Tensor) -> None:
        check_segments(gpu_crcs(raw, slot.name), slot.crc32, 0, f"{self.path!r}: tensor {slot.name!r}")

    def _read_gpu(self, slot: Slot, raw: torch.Tensor) -> None:
        e = slot.entry
        if e is None:
            raw.copy_(self._stored_on(slot, raw.device))
        elif nvcomp_available() is None:
            self._decode_gpu(slot, raw)
        elif codec_spec(e.codec).cpu_decode:  # no nvCOMP here: decoded on the CPU, then copied
            host = torch.empty(slot.nbytes, dtype=torch.uint8, pin_memory=True)
            self.read([(slot, host)])
            raw.copy_(host)
            return
        else:
            raise CodecError(
                f"{self.path!r}: tensor {slot.name!r} is compressed with {e.codec!r}, which only nvCOMP "
                f"decodes, and here {nvcomp_available()}; install gdsload[cu12] or gdsload[cu13]"
            )
        self._check_gpu(slot, raw)

    def _read_gpu_codec_to_cpu(self, slot: Slot, raw: torch.Tensor) -> None:
        why = nvcomp_available()
        if why is not None:
            assert slot.entry is not None
            raise CodecError(
                f"{self.path!r}: tensor {slot.name!r} is compressed with {slot.entry.codec!r}, which only a GPU "
                f"decodes (nvCOMP), and here {why}; load it on a CUDA host, or save with codec='zstd' for CPU hosts"
            )
        dev = torch.device("cuda", torch.cuda.current_device())
        tmp = torch.empty(slot.nbytes, dtype=torch.uint8, device=dev)
        self._decode_gpu(slot, tmp)
        self._check_gpu(slot, tmp)
        raw.copy_(tmp)
