"""nvCOMP on a GPU: the codecs of one device and stream (:class:`GpuCodecs`), the jobs it decodes, and the device
bytes its C-API decoder works in, whichever owns the memory (torch, cupy or the CUDA driver).

Each codec's GPU side is its :attr:`~gdsload.loader.codecs.registry.Codec.nvcomp_algorithm` and
:meth:`~gdsload.loader.codecs.registry.Codec.nvcomp_options`; ANS chunks decode through nvCOMP's C API, many tensors
per call (:mod:`gdsload.loader.codecs.nvcomp_c`), which also computes the CRC-32 the encoder records; the rest through
nvCOMP's Python package, imported on first use.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

from .registry import codec
from ..devices import CupyDevice, Device
from ..errors import CodecError
from ..format.compression import CompressedEntry

if TYPE_CHECKING:
    import torch

__all__ = [
    "GpuCodecs",
    "DecodeJob",
    "gather_chunks",
    "pack_slots",
    "TorchStreamBytes",
    "CupyStreamBytes",
    "DriverStreamBytes",
]


class _Bytes:
    """The first ``nbytes`` of an nvCOMP device array, as a uint8 CUDA array torch can view (the array
    stays referenced, and so alive, as long as the view). Through ``__cuda_array_interface__``, not DLPack:
    nvCOMP 6.0's batch outputs taken by DLPack crashed the process (double free, abort)."""

    def __init__(self, array: Any, nbytes: int):
        self.array = array
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
            "strides": None,
            "data": (array.__cuda_array_interface__["data"][0], False),
        }


def gather_chunks(arrays: list[Any], starts: list[int], sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The compressed chunks ``arrays`` (nvCOMP batch outputs), chunk *i* at ``starts[i]`` of one uint8
    tensor on the device, with zeros in the gaps."""
    import torch

    total = starts[-1] + sizes[-1] if sizes else 0
    # The encoder has finished with them (``buffer_size`` waited for it): any stream may copy them now.
    out = torch.zeros(total, dtype=torch.uint8, device=device)
    for at, n, a in zip(starts, sizes, arrays):
        out[at : at + n].copy_(torch.as_tensor(_Bytes(a, n), device=device))
    return out


def pack_slots(slots: Any, align: int) -> torch.Tensor:
    """The chunks :func:`~gdsload.loader.codecs.nvcomp_c.ans_encode` left in fixed-size slots of a torch
    tensor, laid end to end as ``layout: chunks`` stores them (each starting ``align``-aligned, zeros in the gaps),
    in one masked copy on the device instead of one copy per chunk."""
    import numpy as np
    import torch

    sizes = slots.sizes.astype(np.int64)
    n = len(sizes)
    if not n:
        return torch.empty(0, dtype=torch.uint8, device=slots.array.device if slots.array is not None else "cuda")
    units = -(-sizes // align)  # aligned units each chunk takes up, its padding included
    total = int(units[:-1].sum()) * align + int(sizes[-1])
    grid = slots.array[: n * slots.slot_bytes].view(n, slots.slot_bytes // align, align)
    keep = torch.arange(grid.shape[1], device=grid.device) < torch.from_numpy(units).to(grid.device)[:, None]
    packed = grid.masked_select(keep.unsqueeze(-1))[:total]
    # The padding after a chunk holds whatever its slot held past the bitstream: zeroed, as the format writes gaps.
    pads = units * align - sizes
    pads[-1] = 0
    if pads.any():
        ends = np.cumsum(units * align) - units * align + sizes
        first_pad = np.cumsum(pads) - pads
        at = np.repeat(ends, pads) + np.arange(int(pads.sum())) - np.repeat(first_pad, pads)
        packed[torch.from_numpy(at).to(grid.device)] = 0
    return packed


class DecodeJob(NamedTuple):
    """Chunks of one tensor for :meth:`GpuCodecs.decode_many`: ``src`` holds its stored chunks
    ``first:stop`` (``stop=None``: through the last), ``dst`` its whole decoded bytes, where each chunk
    lands at its own offset. A tensor can so be decoded a run of chunks at a time, from a staging
    buffer smaller than it; ``layout: native`` tensors only whole."""

    entry: CompressedEntry
    src: Any
    dst: Any
    path: str
    first: int = 0
    stop: int | None = None

    @property
    def ends(self) -> bool:
        """Whether this job decodes the tensor's last chunk: its checks run after it."""
        return self.stop is None or self.stop >= len(self.entry.chunks)


class GpuCodecs:
    """nvCOMP codecs for one GPU and stream, created once and reused.

    ``device`` is where the bytes live (:class:`~gdsload.loader.devices.Device`: torch's memory, or memory
    allocated through the CUDA driver or cupy); ``stream`` the raw ``cudaStream_t`` (torch's
    ``Stream.cuda_stream``, a device's :meth:`~gdsload.loader.devices.Device.stream` handle), None for the
    default stream.
    """

    def __init__(self, device: Device, stream: int | None = None, *, encode: bool = False, verify: bool = False):
        self.device = device
        self.device_index = device.index or 0
        self.stream = stream
        self._encode, self._verify = encode, verify
        self._cache: dict[Any, Any] = {}
        self._ans: Any = None  # nvcomp_c.AnsDecoder, made on the first ANS chunks
        self._bytes: TorchStreamBytes | CupyStreamBytes | DriverStreamBytes | None = None

    @functools.cached_property
    def nv(self) -> Any:
        """nvCOMP's Python package, imported on first use: ANS chunks decode through its C library alone."""
        from nvidia import nvcomp

        return nvcomp

    @property
    def policy(self) -> Any:
        """The checksum policy of native streams: encoders store checksums; decoders check them only when asked to."""
        policy = self.nv.ChecksumPolicy
        if self._encode:
            return policy.COMPUTE_AND_NO_VERIFY
        return policy.NO_COMPUTE_AND_VERIFY_IF_PRESENT if self._verify else policy.NO_COMPUTE_NO_VERIFY

    def close(self) -> None:
        """Drop every nvCOMP codec made here (call it while the stream they borrow still exists)."""
        self._cache.clear()
        if self._ans is not None:
            self._ans.close()

    def _kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"device_id": self.device_index}
        if self.stream is not None:
            kw["cuda_stream"] = self.stream
        return kw

    def _gpu_side(self, codec_name: str) -> Any:
        spec = codec(codec_name)
        if not spec.gpu:
            raise CodecError(
                f"codec {codec_name!r} runs on the CPU only (it has no nvCOMP algorithm); load its files with "
                "device='cpu', or compress them with a codec nvCOMP decodes (ans, zstd)"
            )
        return spec

    def native(self, codec_name: str, params: dict[str, Any]) -> Any:
        """nvCOMP's codec for ``codec_name``'s own containers (``layout: native``), with the options ``params`` give."""
        key = ("native", codec_name, tuple(sorted(params.items())))
        if key not in self._cache:
            spec = self._gpu_side(codec_name)
            self._cache[key] = self.nv.Codec(
                algorithm=spec.nvcomp_algorithm,
                uncomp_chunk_size=spec.chunk_bytes,
                checksum_policy=self.policy,
                **spec.nvcomp_options(params),
                **self._kwargs(),
            )
        return self._cache[key]

    def chunked(self, codec_name: str, params: dict[str, Any] | None = None) -> Any:
        """nvCOMP's batch codec for raw chunks (``layout: chunks``), with the options ``params`` give (decoding
        needs none)."""
        spec = self._gpu_side(codec_name)
        opts = spec.nvcomp_options(params) if params else {}
        key = ("chunks", codec_name, tuple(sorted(opts.items())))
        if key not in self._cache:
            nv = self.nv
            self._cache[key] = nv.Codec(
                algorithm=spec.nvcomp_algorithm,
                bitstream_kind=nv.BitstreamKind.RAW,
                **opts,
                **self._kwargs(),
            )
        return self._cache[key]

    def ans_chunks(
        self, raw: torch.Tensor, codec_name: str, params: dict[str, Any], where: str
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``raw`` (a 16-byte aligned CUDA uint8 tensor) compressed in chunks of the codec's ``chunk_bytes``, every
        chunk in one call of nvCOMP's C API (its batched ANS encoder) on this stream, which it waits for; returns
        the stored bytes, on the device as ``layout: chunks`` lays them out, and each chunk's compressed size."""
        import numpy as np

        from .nvcomp_c import ans_encode

        spec = codec(codec_name)
        n = raw.numel()
        starts = np.arange(0, n, spec.chunk_bytes, dtype=np.uint64)
        slots = ans_encode(
            np.uint64(raw.data_ptr()) + starts,
            np.minimum(np.uint64(spec.chunk_bytes), np.uint64(n) - starts),
            params["data_type"],
            self._stream_bytes(),
            self.stream or 0,
            where,
        )
        return pack_slots(slots, spec.chunk_align), tuple(slots.sizes.tolist())

    def _stream_bytes(self) -> TorchStreamBytes | CupyStreamBytes | DriverStreamBytes:
        if self._bytes is None:
            if self.device.uses_torch:
                self._bytes = TorchStreamBytes(self.device, self.stream or 0)
            elif isinstance(self.device, CupyDevice):  # the offline compressor works on cupy arrays
                self._bytes = CupyStreamBytes(self.stream or 0)
            else:
                self._bytes = DriverStreamBytes(self.device, self.stream or 0)
        return self._bytes

    def crc32(self, array: Any, where: str) -> int:
        """zlib's CRC-32 of a 1-D uint8 array on the current device, computed on this stream (the default
        stream when None): on the GPU where nvCOMP's library has the call, else of a host copy."""
        from .nvcomp_c import device_crc32

        try:
            got = device_crc32(
                [(self.device.address(array), self.device.nbytes(array))], self._stream_bytes(), self.stream or 0, where
            )
        except CodecError:  # the C library cannot be loaded here: nvCOMP's Python package may still encode
            got = None
        return int(got[0]) if got is not None else zlib.crc32(self.device.to_host(array))

    def crc_batches(self, where: str, table: tuple[Any, int, int] | None = None) -> Any:
        """A :class:`~gdsload.loader.codecs.nvcomp_c.CrcBatches` on this stream (CRC-32s launched as bytes become
        ready, read back at the end; ``table`` as it takes it); None where nvCOMP's library or its CRC-32 call is
        missing."""
        from .nvcomp_c import CrcBatches, library_unavailable

        if library_unavailable() is not None or not CrcBatches.available():
            return None
        return CrcBatches(self._stream_bytes(), self.stream or 0, where, table=table)

    def crcs(self, spans: list[tuple[int, int]], where: str) -> list[int] | None:
        """zlib's CRC-32 of each device byte range ``(address, nbytes)``, all in one batch on this stream; None
        where nvCOMP's library or its CRC-32 call is missing."""
        from .nvcomp_c import device_crc32, library_unavailable

        if library_unavailable() is not None:
            return None
        return device_crc32(spans, self._stream_bytes(), self.stream or 0, where)

    def decode(self, entry: CompressedEntry, src: Any, dst: Any, *, path: str) -> None:
        """Decode ``entry`` from device bytes ``src`` into device bytes ``dst``.

        ``src`` and ``dst`` are 1-D uint8 buffers of ``device``. Returns
        with the decode queued on the stream, except for ANS chunks, which are checked here
        (the stream synchronized); :meth:`decode_many` batches them.
        """
        self.decode_many([DecodeJob(entry, src, dst, path)])
        self.finish()

    def decode_many(self, jobs: list[DecodeJob]) -> None:
        """Queue every job's decode on the stream; then :meth:`finish`.

        ANS chunks of all the jobs go to nvCOMP in one call, without the GIL; every other job is
        its own call. Sources must stay put until the stream is synchronized, destinations until
        :meth:`finish` has checked them.
        """
        ans = [j for j in jobs if j.entry.layout == "chunks" and codec(j.entry.codec).batch_decoder]
        if ans:
            from .nvcomp_c import AnsChunks, AnsDecoder

            if self._ans is None:
                self._ans = AnsDecoder(self.stream or 0, self._stream_bytes())
            address = self.device.address
            self._ans.launch(
                AnsChunks.build(
                    [
                        (
                            j.entry,
                            address(j.src),
                            address(j.dst),
                            f"{j.path!r}: tensor {j.entry.name!r}",
                            j.first,
                            j.stop,
                        )
                        for j in ans
                    ]
                )
            )
        for j in jobs:
            if not (j.entry.layout == "chunks" and codec(j.entry.codec).batch_decoder):
                self._decode_one(j)

    def copy(self, dst: Any, src: Any) -> None:
        """Queue a copy of device bytes ``src`` into ``dst`` (as many) on the stream, after the decodes queued."""
        self._stream_bytes().copy(dst, src)

    def checked_on_device(self, entry: CompressedEntry) -> bool:
        """Whether :meth:`finish` has checked ``entry``'s decoded bytes against its ``crc32`` (ANS
        chunks, on the device, whatever ``verify`` says); others need ``verify`` for that."""
        return (
            entry.crc32 is not None
            and entry.layout == "chunks"
            and codec(entry.codec).batch_decoder
            and self._ans is not None
            and self._ans.checks_crc32
        )

    def finish(self, *, but_last: bool = False) -> None:
        """Wait for the stream, and raise :class:`CodecError` if a batch of ANS chunks failed to
        decode or does not match the CRC-32 its file records.

        With ``but_last``, the newest batch's CRC-32 check may still run on the device (a later
        ``finish`` checks it): its destinations must stay put until then, its sources need not.
        """
        if self._ans is not None and self._bytes is not None:
            self._bytes.sync()
            self._ans.check(keep=1 if but_last else 0)

    def _decode_one(self, job: DecodeJob) -> None:
        entry, src, dst = job.entry, job.src, job.dst
        where = f"{job.path!r}: tensor {entry.name!r}"
        nv = self.nv
        try:
            if entry.layout == "native":
                if job.first or not job.ends:
                    raise CodecError(f"{where}: a layout 'native' tensor decodes only whole")
                codec = self.native(entry.codec, entry.params)
                out = codec.decode(nv.as_array(src), out=nv.as_array(dst))
                if out.buffer_size != entry.nbytes:
                    raise CodecError(f"{where}: decoded {out.buffer_size} bytes, the metadata says {entry.nbytes}")
            else:
                spans = entry.chunk_spans()[job.first : job.stop]
                base = spans[0][0] if spans else 0  # src starts at the first chunk of the run
                spans = [(s - base, n, d, m) for s, n, d, m in spans]
                srcs = nv.as_arrays([src[s : s + n] for s, n, _, _ in spans])
                dsts = nv.as_arrays([dst[d : d + n] for _, _, d, n in spans])
                self.chunked(entry.codec).decode(srcs, out=dsts)
        except CodecError:
            raise
        except Exception as e:  # nvCOMP reports corrupt streams and bad checksums as exceptions
            raise CodecError(f"{where}: nvCOMP could not decode it ({type(e).__name__}: {e})") from None


def _host_bytes(host: Any) -> ctypes.Array[ctypes.c_char]:
    """A writable host buffer (a ``bytearray``, a numpy array) as ctypes bytes, for its address (the buffer stays
    alive as long as they do)."""
    view = memoryview(host).cast("B")
    return (ctypes.c_char * view.nbytes).from_buffer(view)


class TorchStreamBytes:
    """Device bytes for :class:`~gdsload.loader.codecs.nvcomp_c.AnsDecoder`, as torch tensors on ``stream``."""

    def __init__(self, device: Device, stream: int):
        import torch

        self.torch = torch
        self._owner = device
        self.device = torch.device("cuda", device.index)
        self.stream = torch.cuda.ExternalStream(stream, device=self.device)
        self._streams: dict[int, Any] = {stream: self.stream}

    def empty(self, nbytes: int) -> tuple[Any, int]:
        a = self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)
        return a, a.data_ptr()

    def put(self, array: Any, host: Any) -> None:
        src = self.torch.frombuffer(memoryview(host).cast("B"), dtype=self.torch.uint8)
        with self.torch.cuda.stream(self.stream):
            array[: src.numel()].copy_(src, non_blocking=True)

    def get(self, array: Any, nbytes: int) -> Any:
        return array[:nbytes].cpu().numpy()

    def copy(self, dst: Any, src: Any) -> None:
        with self.torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def zero(self, array: Any) -> None:
        with self.torch.cuda.stream(self.stream):
            array.zero_()

    def sync(self) -> None:
        self.stream.synchronize()

    def side_stream(self) -> int:
        return self._owner.stream(1).handle  # the device's second kept stream (torch's pool is not made)

    def _external(self, handle: int) -> Any:
        if handle not in self._streams:
            self._streams[handle] = self.torch.cuda.ExternalStream(handle, device=self.device)
        return self._streams[handle]

    def record(self, stream: int) -> Any:
        event = self.torch.cuda.Event()
        event.record(self._external(stream))
        return event

    def wait(self, stream: int, event: Any) -> None:
        self._external(stream).wait_event(event)

    def wait_event(self, event: Any) -> None:
        event.synchronize()


class CupyStreamBytes:
    """Device bytes for :class:`~gdsload.loader.codecs.nvcomp_c.AnsDecoder`, as cupy arrays on ``stream`` (a raw handle)."""

    def __init__(self, stream: int):
        import cupy

        self.cupy = cupy
        self.stream = stream
        self._side: list[Any] = []

    def empty(self, nbytes: int) -> tuple[Any, int]:
        a = self.cupy.empty(nbytes, dtype=self.cupy.uint8)
        return a, a.data.ptr

    def put(self, array: Any, host: Any) -> None:
        # From pageable memory: the runtime has taken the bytes when the call returns.
        buf = _host_bytes(host)
        self.cupy.cuda.runtime.memcpyAsync(
            array.data.ptr, ctypes.addressof(buf), len(buf), self.cupy.cuda.runtime.memcpyHostToDevice, self.stream
        )

    def get(self, array: Any, nbytes: int) -> Any:
        return array[:nbytes].get()

    def copy(self, dst: Any, src: Any) -> None:
        rt = self.cupy.cuda.runtime
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice, self.stream)

    def zero(self, array: Any) -> None:
        self.cupy.cuda.runtime.memsetAsync(array.data.ptr, 0, array.nbytes, self.stream)

    def sync(self) -> None:
        self.cupy.cuda.runtime.streamSynchronize(self.stream)

    def side_stream(self) -> int:
        s = self.cupy.cuda.Stream(non_blocking=True)
        self._side.append(s)  # lives as long as this object (the decoder that launches on it)
        return int(s.ptr)

    def record(self, stream: int) -> Any:
        event = self.cupy.cuda.Event(disable_timing=True)
        self.cupy.cuda.runtime.eventRecord(event.ptr, stream)  # raw handles: no stream object to wrap
        return event

    def wait(self, stream: int, event: Any) -> None:
        self.cupy.cuda.runtime.streamWaitEvent(stream, event.ptr, 0)

    def wait_event(self, event: Any) -> None:
        event.synchronize()


class DriverStreamBytes:
    """Device bytes for :class:`~gdsload.loader.codecs.nvcomp_c.AnsDecoder` through the CUDA driver, on ``stream``
    (a raw handle): loads onto a :class:`~gdsload.loader.devices.DriverDevice`, which import no cupy."""

    def __init__(self, device: Device, stream: int):
        from .. import driver

        self.driver, self.cuda = driver, driver.lib()
        self._owner = device
        self.index = device.index or 0
        self.stream = stream

    def _call(self, what: str, fn: Any, *args: Any) -> None:
        self.driver.current(self.index)  # the decoder's thread may have no context yet
        self.driver.check(fn(*args), what)

    def empty(self, nbytes: int) -> tuple[Any, int]:
        a = self.driver.allocate(self.index, nbytes)
        return a, a.ptr

    def put(self, array: Any, host: Any) -> None:
        # From pageable memory: the driver has taken the bytes when the call returns.
        buf = _host_bytes(host)
        self._call(
            "cuMemcpyHtoDAsync", self.cuda.cuMemcpyHtoDAsync_v2, array.ptr, ctypes.addressof(buf), len(buf), self.stream
        )

    def get(self, array: Any, nbytes: int) -> bytearray:
        out = bytearray(nbytes)
        if nbytes:
            self._call("cuMemcpyDtoH", self.cuda.cuMemcpyDtoH_v2, ctypes.addressof(_host_bytes(out)), array.ptr, nbytes)
        return out

    def copy(self, dst: Any, src: Any) -> None:
        n = self._owner.nbytes(src)
        self._call(
            "cuMemcpyDtoDAsync",
            self.cuda.cuMemcpyDtoDAsync_v2,
            self._owner.address(dst),
            self._owner.address(src),
            n,
            self.stream,
        )

    def zero(self, array: Any) -> None:
        self._call("cuMemsetD8Async", self.cuda.cuMemsetD8Async, array.ptr, 0, array.nbytes, self.stream)

    def sync(self) -> None:
        self._call("cuStreamSynchronize", self.cuda.cuStreamSynchronize, self.stream)

    def side_stream(self) -> int:
        return self._owner.stream(1).handle  # the device's second kept stream

    def record(self, stream: int) -> _Event:
        handle = ctypes.c_void_p()
        self._call("cuEventCreate", self.cuda.cuEventCreate, ctypes.byref(handle), self.driver.CU_EVENT_DISABLE_TIMING)
        event = _Event(self.cuda, int(handle.value or 0))
        self._call("cuEventRecord", self.cuda.cuEventRecord, event.handle, stream)
        return event

    def wait(self, stream: int, event: _Event) -> None:
        self._call("cuStreamWaitEvent", self.cuda.cuStreamWaitEvent, stream, event.handle, 0)

    def wait_event(self, event: _Event) -> None:
        self._call("cuEventSynchronize", self.cuda.cuEventSynchronize, event.handle)


class _Event:
    """A CUDA event made through the driver, destroyed when dropped."""

    def __init__(self, cuda: Any, handle: int):
        self.handle = handle
        weakref.finalize(self, cuda.cuEventDestroy_v2, handle).atexit = False
