"""Devices: everything the load pipeline asks of the memory it loads into, behind one small interface.

The pipeline (:mod:`gdsload.loader.pipeline.load`) and the readers, codecs and hand-off never test what
kind of array they hold. They call a :class:`Device`:

- :class:`TorchDevice` — a torch device, ``cpu`` or ``cuda:N``: buffers are 1-D ``uint8`` tensors;
- :class:`DriverDevice` — a GPU driven through the CUDA driver API alone (the sidecar's workers: ``import
  torch`` costs seconds in a fresh process, ``import cupy`` with numpy half a second): buffers are
  :class:`~gdsload.loader.driver.DeviceBuffer` objects over their own ``cuMemAlloc``, so a buffer is the base
  of its allocation and its CUDA IPC handle maps exactly that buffer;
- :class:`CupyDevice` — the same through cupy, whose arrays the offline GPU compressor computes on.

A buffer supports slicing (``buf[a:b]`` is a view) on every device. Tensors are made from buffers only by
:meth:`Device.view`, which torch devices support and the others do not (cupy has no bfloat16).

>>> dev = as_device("cpu")
>>> buf = dev.empty(8)
>>> dev.view(buf, "F32", (2,)).shape
torch.Size([2])
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import BackendUnavailableError, ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "Device",
    "Stream",
    "TorchDevice",
    "CupyDevice",
    "DriverDevice",
    "PrimaryContext",
    "as_device",
    "cuda_error_name",
    "device_uuid",
    "start_primary_context",
    "torch_free_unavailable",
]


class Stream:
    """A CUDA stream a device made: its raw handle, a wait, and a context that makes it current."""

    def __init__(
        self,
        handle: int,
        synchronize: Callable[[], None],
        activate: Callable[[], contextlib.AbstractContextManager[Any]],
    ):
        self.handle = handle
        self.synchronize = synchronize
        self.activate = activate


class Device(abc.ABC):
    """Memory of one device, as the pipeline uses it."""

    kind: ClassVar[str]
    """``cpu`` or ``cuda``."""
    uses_torch: ClassVar[bool]
    index: int | None
    """CUDA ordinal (None on the CPU)."""

    def __str__(self) -> str:
        return "cpu" if self.index is None else f"cuda:{self.index}"

    @abc.abstractmethod
    def empty(self, nbytes: int) -> Any:
        """A new 1-D uint8 buffer of ``nbytes`` (not zeroed)."""

    @abc.abstractmethod
    def address(self, buf: Any) -> int:
        """The address of a buffer's first byte."""

    def nbytes(self, buf: Any) -> int:
        return int(buf.nbytes)

    def activate(self) -> None:
        """Make this device current on the calling thread (GPU devices)."""

    def synchronize(self) -> None:
        """Wait for all work queued on this device."""

    def stream(self, which: int = 0) -> Stream:
        """Stream ``which`` of those this device keeps for work beside the reads (0: decoding, 1: checking
        what was decoded); GPU devices only. nvCOMP borrows a stream without owning it and may outlive a
        load (an error's traceback holds it), so each is made once and kept for the process's life; loads
        on one device share them."""
        raise BackendUnavailableError(f"{self} has no CUDA streams")

    @abc.abstractmethod
    def to_host(self, buf: Any) -> np.ndarray:
        """A buffer's bytes in host memory (a copy for GPU buffers, a view on the CPU)."""

    @abc.abstractmethod
    def copy(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into ``dst``, two buffers of this device of the same size (queued on GPUs)."""

    def view(self, buf: Any, dtype: str, shape: tuple[int, ...]) -> Any:
        """``buf`` seen as a tensor of safetensors ``dtype`` and ``shape`` (torch devices)."""
        raise BackendUnavailableError(f"{self} ({type(self).__name__}) makes no torch tensors")

    def views(self, bufs: Sequence[Any], slices: Iterable[tuple[int, int, int, str, tuple[int, ...]]]) -> list[Any]:
        """:meth:`view` of many slices: ``(buffer index in bufs, offset, nbytes, dtype, shape)`` each (a device
        that overrides :meth:`view` overrides this too)."""
        return [self.view(bufs[b][off : off + n], dtype, shape) for b, off, n, dtype, shape in slices]

    def bytes_of(self, tensor: Any) -> Any:
        """The 1-D uint8 buffer over a contiguous tensor's own bytes (destinations the caller owns)."""
        raise BackendUnavailableError(f"{self} ({type(self).__name__}) takes no torch tensors as destinations")

    def host_memoryview(self, buf: Any) -> memoryview:
        """A writable view of a host buffer's bytes (CPU devices)."""
        raise BackendUnavailableError(f"{self} holds no host buffers")


_KEPT: dict[tuple[type, int | None, int], Any] = {}
"""The streams devices keep, by device class, device index and :meth:`Device.stream`'s ``which``."""
_KEPT_LOCK = threading.Lock()


class PrimaryContext:
    """GPU ``index``'s primary context (the one torch and CuPy use), retained through the CUDA driver until
    :meth:`release`: the staged reader copies in it, the decoder's streams are made in it, and a sidecar
    worker makes it while it imports.

    Raises :class:`BackendUnavailableError` naming the failing call when the driver does not load or
    refuses.
    """

    def __init__(self, index: int):
        import ctypes

        self.index = index
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise BackendUnavailableError(f"the CUDA driver (libcuda.so.1) does not load: {e}") from None
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._check(self.lib.cuInit(0), "cuInit")
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        self.device = dev.value
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.handle: int | None = ctx.value

    def _check(self, result: int, what: str) -> None:
        if result:
            raise BackendUnavailableError(
                f"{what} failed for CUDA device {self.index}: {cuda_error_name(result, self.lib)}"
            )

    def new_stream(self) -> int:
        """A new non-blocking stream in this context (``cuStreamCreate``), whatever context the thread has."""
        import ctypes

        stream, popped = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.lib.cuCtxPushCurrent_v2(ctypes.c_void_p(self.handle)), "cuCtxPushCurrent")
        try:
            self._check(self.lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")  # CU_STREAM_NON_BLOCKING
        finally:
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
        return int(stream.value or 0)

    def release(self) -> None:
        """Give the retained context back (once)."""
        if self.handle is not None:
            import ctypes

            self.lib.cuDevicePrimaryCtxRelease_v2(ctypes.c_int(self.device))
            self.handle = None


def start_primary_context(index: int = 0) -> None:
    """Create GPU ``index``'s primary CUDA context on a thread while the process imports its libraries.

    Both take a good part of a second in a fresh process; the driver call releases the GIL, so they
    overlap. cupy, kvikio and torch then find the primary context made and retain it. Where the
    driver library is missing, nothing happens here and whatever uses the GPU reports the problem.
    """

    def run() -> None:
        try:
            PrimaryContext(index)  # retained for the process's life, as torch does
        except BackendUnavailableError:
            pass

    threading.Thread(target=run, name="gdsload-cuda-context", daemon=True).start()


def cuda_error_name(result: int, lib: Any = None) -> str:
    """``CUDA_ERROR_...`` for a CUresult (``lib``: the loaded driver, else it is loaded here)."""
    from . import driver

    return driver.error_name(result, lib)


def _driver_stream(index: int | None) -> int | None:
    """A new non-blocking stream in GPU ``index``'s primary context, made through the CUDA driver (the
    context stays retained for the stream's life); None if the driver refuses (torch then makes it).

    torch's first ``torch.cuda.Stream`` makes its whole pool of streams for the device, which takes milliseconds
    and holds up the reader threads' copies while it runs.
    """
    try:
        return PrimaryContext(index or 0).new_stream()
    except BackendUnavailableError:
        return None


class TorchDevice(Device):
    """A torch device: ``cpu`` or ``cuda:N``.

    ``shared=True`` (CPU only) allocates host memory as shared memory (``/dev/shm``, named the way
    torch's multiprocessing shares storage), so a loaded rank can be handed to another process
    without moving it first: what the sidecar's CPU workers load into.
    """

    uses_torch = True

    def __init__(self, device: torch.device, *, shared: bool = False):
        import torch

        self.torch = torch
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise BackendUnavailableError(f"no backend can load to {str(device)!r}: gdsload loads to 'cpu' or 'cuda:N'")
        if shared and device.type != "cpu":
            raise ConfigError(f"shared=True is for host memory; {str(device)!r} is not the CPU")
        self.device = device
        self.index = device.index
        self.kind = device.type  # type: ignore[misc]
        self.shared = shared

    def __str__(self) -> str:
        return str(self.device)

    def empty(self, nbytes: int) -> Any:
        if not self.shared:
            return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)
        _check_shm_room(nbytes)
        storage = self.torch.UntypedStorage._new_using_filename_cpu(nbytes)
        return self.torch.empty(0, dtype=self.torch.uint8).set_(storage, 0, (nbytes,), (1,))

    def address(self, buf: Any) -> int:
        return int(buf.data_ptr())

    def activate(self) -> None:
        if self.kind == "cuda":
            self.torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        if self.kind == "cuda":
            self.torch.cuda.synchronize(self.device)

    def stream(self, which: int = 0) -> Stream:
        if self.kind != "cuda":
            return super().stream(which)
        torch = self.torch
        torch.cuda.set_device(self.device)
        with _KEPT_LOCK:
            s = _KEPT.get((type(self), self.index, which))
            if s is None:
                handle = _driver_stream(self.index)
                s = (
                    torch.cuda.ExternalStream(handle, device=self.device)
                    if handle is not None
                    else torch.cuda.Stream(device=self.device)
                )
                _KEPT[type(self), self.index, which] = s
        return Stream(s.cuda_stream, s.synchronize, lambda: torch.cuda.stream(s))

    def to_host(self, buf: Any) -> np.ndarray:
        return buf.cpu().numpy() if self.kind == "cuda" else buf.numpy()

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def view(self, buf: Any, dtype: str, shape: tuple[int, ...]) -> Any:
        from .dtypes import to_torch

        dt = to_torch(dtype)
        if not buf.numel():
            return self.torch.empty(shape, dtype=dt, device=self.device)
        return buf.view(dt).view(shape)

    def views(self, bufs: Sequence[Any], slices: Iterable[tuple[int, int, int, str, tuple[int, ...]]]) -> list[Any]:
        # One op a tensor: each buffer is seen as each dtype once, and every tensor is a strided view of that
        # (a slice then two views cost three; a rank has hundreds of tensors).
        from .dtypes import to_torch

        typed: dict[tuple[int, str], Any] = {}
        out = []
        for b, off, n, dtype, shape in slices:
            base = typed.get((b, dtype))
            if base is None:  # a contiguous buffer the dtype's size divides, from an aligned start; else view()
                buf, dt = bufs[b], to_torch(dtype)
                fits = buf.is_contiguous() and not buf.numel() % dt.itemsize and not buf.storage_offset() % dt.itemsize
                base = typed[b, dtype] = buf.view(dt) if fits else False
            size = base.element_size() if base is not False else 0
            if not n or not size or off % size:
                out.append(self.view(bufs[b][off : off + n], dtype, shape))
                continue
            strides, step = [], 1
            for d in reversed(shape):
                strides.append(step)
                step *= d
            out.append(base.as_strided(shape, strides[::-1], base.storage_offset() + off // size))
        return out

    def bytes_of(self, tensor: Any) -> Any:
        return tensor.detach().reshape(-1).view(self.torch.uint8)

    def host_memoryview(self, buf: Any) -> memoryview:
        if self.kind != "cpu":
            return super().host_memoryview(buf)
        return memoryview(buf.numpy()) if buf.numel() else memoryview(bytearray())


class CupyDevice(Device):
    """GPU ``index`` driven through cupy, without torch."""

    kind = "cuda"
    uses_torch = False

    def __init__(self, index: int = 0):
        import cupy

        self.cupy = cupy
        self.index = index

    def empty(self, nbytes: int) -> Any:
        cupy = self.cupy
        with cupy.cuda.Device(self.index):
            mem = cupy.cuda.Memory(max(nbytes, 1))  # its own cudaMalloc, not cupy's pool: IPC maps exactly it
        return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def address(self, buf: Any) -> int:
        return int(buf.data.ptr)

    def activate(self) -> None:
        # .use(), not a `with` block: leaving one makes the previous device current again, and on
        # CUDA 12+ that opens a context there (GPU 0, in a process that sees several GPUs).
        self.cupy.cuda.Device(self.index).use()

    def synchronize(self) -> None:
        self.cupy.cuda.runtime.deviceSynchronize()

    def stream(self, which: int = 0) -> Stream:
        self.activate()
        with _KEPT_LOCK:
            s = _KEPT.get((type(self), self.index, which))
            if s is None:
                s = _KEPT[type(self), self.index, which] = self.cupy.cuda.Stream(non_blocking=True)
        return Stream(int(s.ptr), s.synchronize, contextlib.nullcontext)

    def to_host(self, buf: Any) -> np.ndarray:
        return buf.get()

    def copy(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def facts(self) -> dict[str, Any]:
        """Name, UUID (formatted as torch formats it) and memory of this GPU, without torch."""
        props = self.cupy.cuda.runtime.getDeviceProperties(self.index)
        name = props["name"]
        return {
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "uuid": device_uuid(self.index),
            "total_memory": int(props["totalGlobalMem"]),
        }

    def ipc_handle(self, buf: Any) -> bytes:
        """The CUDA IPC handle of a buffer this device allocated (the base of its own ``cudaMalloc``)."""
        with self.cupy.cuda.Device(self.index):
            return bytes(self.cupy.cuda.runtime.ipcGetMemHandle(self.address(buf)))


class DriverDevice(Device):
    """GPU ``index`` driven through the CUDA driver API (:mod:`gdsload.loader.driver`), without torch, cupy or numpy.

    Buffers are :class:`~gdsload.loader.driver.DeviceBuffer` objects over their own ``cuMemAlloc``; the
    sidecar's GPU workers load into it, so a worker imports neither torch (seconds) nor cupy (0.4-0.6 s with
    the numpy it imports, on an H200 host) before its load.
    """

    kind = "cuda"
    uses_torch = False

    def __init__(self, index: int = 0):
        from . import driver

        self.driver = driver
        self.index = index

    def empty(self, nbytes: int) -> Any:
        return self.driver.allocate(self.index, nbytes)

    def address(self, buf: Any) -> int:
        return int(buf.ptr)

    def activate(self) -> None:
        self.driver.current(self.index)

    def synchronize(self) -> None:
        self.activate()
        self.driver.check(self.driver.lib().cuCtxSynchronize(), "cuCtxSynchronize")

    def stream(self, which: int = 0) -> Stream:
        import ctypes

        self.activate()
        with _KEPT_LOCK:
            handle = _KEPT.get((type(self), self.index, which))
            if handle is None:
                s = ctypes.c_void_p()
                self.driver.check(
                    self.driver.lib().cuStreamCreate(ctypes.byref(s), self.driver.CU_STREAM_NON_BLOCKING),
                    "cuStreamCreate",
                )
                handle = _KEPT[type(self), self.index, which] = int(s.value or 0)

        def synchronize() -> None:
            self.activate()
            self.driver.check(self.driver.lib().cuStreamSynchronize(handle), "cuStreamSynchronize")

        return Stream(handle, synchronize, contextlib.nullcontext)

    def to_host(self, buf: Any) -> np.ndarray:
        import numpy as np

        out = np.empty(buf.nbytes, dtype=np.uint8)
        if buf.nbytes:
            self.activate()
            self.driver.check(self.driver.lib().cuMemcpyDtoH_v2(out.ctypes.data, buf.ptr, buf.nbytes), "cuMemcpyDtoH")
        return out

    def copy(self, dst: Any, src: Any) -> None:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into a buffer of {dst.nbytes}")
        if src.nbytes:
            self.activate()  # queued on the context's default stream; synchronize() waits for it
            self.driver.check(
                self.driver.lib().cuMemcpyDtoDAsync_v2(dst.ptr, src.ptr, src.nbytes, None), "cuMemcpyDtoDAsync"
            )

    def facts(self) -> dict[str, Any]:
        """Name, UUID (formatted as torch formats it) and memory of this GPU, from the driver."""
        import ctypes

        cuda, name, total = self.driver.lib(), ctypes.create_string_buffer(256), ctypes.c_size_t()
        self.driver.check(cuda.cuDeviceGetName(name, 256, self.index), "cuDeviceGetName")
        self.driver.check(cuda.cuDeviceTotalMem_v2(ctypes.byref(total), self.index), "cuDeviceTotalMem")
        return {
            "name": name.value.decode(errors="replace"),
            "uuid": device_uuid(self.index),
            "total_memory": int(total.value),
        }

    def ipc_handle(self, buf: Any) -> bytes:
        """The CUDA IPC handle of a buffer this device allocated (the base of its own ``cuMemAlloc``)."""
        import ctypes

        self.activate()
        handle = ctypes.create_string_buffer(64)
        self.driver.check(self.driver.lib().cuIpcGetMemHandle(handle, buf.ptr), "cuIpcGetMemHandle")
        return handle.raw

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of this GPU's memory (``cuMemGetInfo``)."""
        import ctypes

        self.activate()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.driver.check(self.driver.lib().cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return int(free.value), int(total.value)


def device_uuid(index: int = 0) -> str:
    """The GPU's UUID from the driver (``cuDeviceGetUuid``), as ``str(torch...props.uuid)`` prints it.

    cupy's device properties carry the UUID as a C string, cut at its first zero byte; the
    driver hands all 16 bytes.
    """
    import ctypes
    import uuid

    cuda = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    raw = (ctypes.c_ubyte * 16)()
    get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), index) != 0 or get_uuid(raw, dev) != 0:
        raise RuntimeError(f"the CUDA driver could not report the UUID of device {index}")
    return str(uuid.UUID(bytes=bytes(raw)))


def _check_shm_room(nbytes: int, shm: str = "/dev/shm") -> None:
    """Refuse a shared allocation that ``/dev/shm`` has no room for: its pages are only claimed when
    first written, and a write past the file system's size kills the process (SIGBUS)."""
    import os

    try:
        st = os.statvfs(shm)
    except OSError:
        return  # no /dev/shm to measure; torch's allocation reports its own error
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        from .errors import DeviceMemoryError

        raise DeviceMemoryError(
            f"{nbytes} bytes of shared memory are needed and {shm} has {free} free; "
            f"give it more room (a container's --shm-size, or a larger tmpfs on {shm})"
        )


def as_device(device: str | torch.device | Device) -> Device:
    """``device`` as a :class:`Device`: torch device names and objects become :class:`TorchDevice`.

    >>> str(as_device("cpu"))
    'cpu'
    """
    if isinstance(device, Device):
        return device
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r} is not a torch device ({e}); use 'cpu', 'cuda' or 'cuda:N'") from None
    return TorchDevice(dev)


def torch_free_unavailable(backend: str = "auto", *, probe: bool = True) -> str | None:
    """Why a GPU rank cannot load without torch here (None when it can): the one place this is decided.

    The torch-free path loads into a :class:`DriverDevice` with the ``cufile`` backend (cached files through the
    staged reader, others through kvikio: GDS where present); it needs kvikio installed and a CUDA device, and
    runs for ``backend`` ``auto`` or ``cufile``. With ``probe=False`` only the backend and the installed packages
    are looked at (what a server decides before its workers start); ``probe`` also asks the CUDA driver for a
    device. Neither imports kvikio: a rank whose files are cached never does.
    """
    import importlib.util

    if backend not in ("auto", "cufile"):
        return f"backend {backend!r} runs with torch (the torch-free path reads with kvikio, as 'cufile' does)"
    if importlib.util.find_spec("kvikio") is None:
        return "kvikio is not installed (kvikio-cu12 or kvikio-cu13; gdsload[cu12] or gdsload[cu13] bring it)"
    if not probe:
        return None
    from . import driver

    try:
        driver.lib()
    except BackendUnavailableError as e:  # no driver, or one that does not initialize
        return str(e)
    if driver.device_count() < 1:
        return "the CUDA driver reports no device"
    return None
