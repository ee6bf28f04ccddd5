"""The CUDA driver API through ctypes: GPU memory, copies, streams and events without torch, cupy or numpy.

What a GPU load needs from CUDA besides its readers and codecs is small: allocate one arena, copy
bytes, make streams and events, export an IPC handle. cupy does all of it, but importing cupy (and
the numpy it imports) took 0.4-0.6 s in a fresh process on an H200 host, several times a 9 GB load
from tmpfs. :class:`~gdsload.loader.devices.DriverDevice` drives the GPU through this module instead.

Every call that needs a context makes GPU ``index``'s primary context current on the calling thread
first (:func:`current`): the loader's reader and decoder threads call in without one. A buffer is freed
in its own context, pushed for the call, whatever thread collects it.

>>> buf = DeviceBuffer(0x7F0000000000, 4096, None)
>>> buf[1024:2048].nbytes, hex(buf[1024:].ptr)
(1024, '0x7f0000000400')
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

from .errors import BackendUnavailableError, DeviceMemoryError

__all__ = ["DeviceBuffer", "lib", "check", "primary", "current", "allocate", "device_count", "error_name"]

_u64, _size, _vp, _int, _uint = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [_uint],
    "cuDeviceGet": [ctypes.POINTER(_int), _int],
    "cuDeviceGetCount": [ctypes.POINTER(_int)],
    "cuDeviceGetName": [ctypes.c_char_p, _int, _int],
    "cuDeviceTotalMem_v2": [ctypes.POINTER(_size), _int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_vp), _int],
    "cuCtxGetCurrent": [ctypes.POINTER(_vp)],
    "cuCtxSetCurrent": [_vp],
    "cuCtxPushCurrent_v2": [_vp],
    "cuCtxPopCurrent_v2": [ctypes.POINTER(_vp)],
    "cuCtxSynchronize": [],
    "cuMemAlloc_v2": [ctypes.POINTER(_u64), _size],
    "cuMemFree_v2": [_u64],
    "cuMemGetInfo_v2": [ctypes.POINTER(_size), ctypes.POINTER(_size)],
    "cuMemcpyHtoDAsync_v2": [_u64, _vp, _size, _vp],
    "cuMemcpyDtoH_v2": [_vp, _u64, _size],
    "cuMemcpyDtoDAsync_v2": [_u64, _u64, _size, _vp],
    "cuMemsetD8Async": [_u64, ctypes.c_ubyte, _size, _vp],
    "cuStreamCreate": [ctypes.POINTER(_vp), _uint],
    "cuStreamSynchronize": [_vp],
    "cuStreamWaitEvent": [_vp, _vp, _uint],
    "cuEventCreate": [ctypes.POINTER(_vp), _uint],
    "cuEventRecord": [_vp, _vp],
    "cuEventSynchronize": [_vp],
    "cuEventDestroy_v2": [_vp],
    "cuIpcGetMemHandle": [ctypes.c_char_p, _u64],
    "cuGetErrorName": [_int, ctypes.POINTER(ctypes.c_char_p)],
}
CU_STREAM_NON_BLOCKING = 1
CU_EVENT_DISABLE_TIMING = 2
CUDA_ERROR_OUT_OF_MEMORY = 2

_lib: ctypes.CDLL | None = None
_contexts: dict[int, int] = {}
_lock = threading.RLock()  # check() inside it may load the driver for the error name


def lib() -> ctypes.CDLL:
    """The CUDA driver (``libcuda.so.1``), loaded and initialized once, with the signatures this module calls."""
    global _lib
    with _lock:
        if _lib is None:
            try:
                cuda = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise BackendUnavailableError(
                    f"the CUDA driver (libcuda.so.1) does not load: {e}; install the "
                    "NVIDIA driver, or load with torch on the CPU"
                ) from None
            for name, args in _SIGNATURES.items():
                fn = getattr(cuda, name)
                fn.argtypes, fn.restype = args, _int
            check(cuda.cuInit(0), "cuInit", cuda)
            _lib = cuda
        return _lib


def error_name(result: int, cuda: ctypes.CDLL | None = None) -> str:
    """``CUDA_ERROR_...`` for a CUresult (``cuda``: the loaded driver, else :func:`lib`); ``CUresult N`` where
    no driver loads."""
    try:
        cuda = cuda or lib()
    except BackendUnavailableError:
        return f"CUresult {result}"
    name = ctypes.c_char_p()
    if cuda.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value:
        return f"{name.value.decode()} ({result})"
    return f"CUresult {result}"


def check(result: int, what: str, cuda: ctypes.CDLL | None = None) -> None:
    """Raise :class:`BackendUnavailableError` naming ``what`` and the driver's error when ``result`` is not 0."""
    if result:
        raise BackendUnavailableError(f"the CUDA driver failed {what}: {error_name(result, cuda)}")


def device_count() -> int:
    """How many CUDA devices this process sees (0 when there is no driver)."""
    try:
        cuda = lib()
    except BackendUnavailableError:
        return 0
    n = _int()
    return n.value if cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0


def primary(index: int) -> int:
    """GPU ``index``'s primary context, retained once per process (as torch and cupy retain it)."""
    ctx = _contexts.get(index)
    if ctx is None:
        cuda = lib()
        with _lock:
            ctx = _contexts.get(index)
            if ctx is None:
                dev, handle = _int(), _vp()
                check(cuda.cuDeviceGet(ctypes.byref(dev), index), f"cuDeviceGet({index})")
                check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(handle), dev), f"cuDevicePrimaryCtxRetain({index})")
                ctx = _contexts[index] = int(handle.value or 0)
    return ctx


def current(index: int) -> int:
    """Make GPU ``index``'s primary context current on the calling thread (asked of the driver each time:
    another library may have made another GPU's current); its handle."""
    ctx, cuda, now = primary(index), lib(), _vp()
    if cuda.cuCtxGetCurrent(ctypes.byref(now)) != 0 or (now.value or 0) != ctx:
        check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


class _Allocation:
    """One ``cuMemAlloc``, freed in its context when the last buffer over it is collected."""

    def __init__(self, index: int, nbytes: int):
        self.index = index
        current(index)
        ptr = _u64()
        rc = lib().cuMemAlloc_v2(ctypes.byref(ptr), max(nbytes, 1))
        if rc == CUDA_ERROR_OUT_OF_MEMORY:
            raise DeviceMemoryError(f"cuMemAlloc of {nbytes} bytes on CUDA device {index}: out of memory")
        check(rc, f"cuMemAlloc of {nbytes} bytes on device {index}")
        self.ptr = int(ptr.value)
        fin = weakref.finalize(self, _free, index, self.ptr)
        fin.atexit = False  # at exit the process's teardown frees it; the driver may already be gone


def _free(index: int, ptr: int) -> None:
    # Any thread may collect a buffer: its context is pushed for the call and the thread's own restored.
    cuda, popped = lib(), _vp()
    if cuda.cuCtxPushCurrent_v2(primary(index)) == 0:
        cuda.cuMemFree_v2(ptr)
        cuda.cuCtxPopCurrent_v2(ctypes.byref(popped))


class DeviceBuffer:
    """Bytes of GPU memory: an address and a size, sliced like a 1-D uint8 array.

    Slices share the allocation, which is freed when the last buffer over it goes. The CUDA array
    interface lets kvikio and nvCOMP's Python package read and write it.
    """

    __slots__ = ("ptr", "nbytes", "_mem", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, mem: Any):
        self.ptr, self.nbytes, self._mem = ptr, nbytes, mem

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: slice) -> DeviceBuffer:
        if not isinstance(key, slice):
            raise TypeError(f"a DeviceBuffer is sliced with [start:stop], not indexed with {key!r}")
        start, stop, step = key.indices(self.nbytes)
        if step != 1:
            raise ValueError(f"a DeviceBuffer slice has step 1, not {step}")
        return DeviceBuffer(self.ptr + start, max(stop - start, 0), self._mem)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "strides": None, "version": 3}

    def __repr__(self) -> str:
        return f"DeviceBuffer(ptr={self.ptr:#x}, nbytes={self.nbytes})"


def allocate(index: int, nbytes: int) -> DeviceBuffer:
    """``nbytes`` of new memory on GPU ``index`` (its own ``cuMemAlloc``, so a CUDA IPC handle maps exactly it)."""
    mem = _Allocation(index, nbytes)
    return DeviceBuffer(mem.ptr, nbytes, mem)
