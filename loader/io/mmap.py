"""``mmap``: tensors that are views of the files' own pages in the page cache — nothing is copied.

For a CPU destination whose tensors are only read once more (an engine's ``load_weights`` copies
each into its parameters), reading them into an arena first is one copy too many: every byte
would cross memory twice. Here each uncompressed file is mapped (``MAP_PRIVATE``: a write to a
tensor copies that page, the file never changes) and its tensors are views of the mapping, as
``safetensors.safe_open`` hands them out. Tensors not aligned for their dtype in the file, and
compressed tensors, are read into the arena as the ``cpu`` backend reads.

Never picked by ``auto``: a mapping lives as long as its tensors, and a file truncated while
mapped makes a later access fail (``SIGBUS``); the engine adapters ask for it only where they copy
the tensors right away. During the load itself a truncated file is a :class:`TruncatedFileError`, never a
``SIGBUS``: each file's size is checked against its header under the mapping, its pages are mapped in with
``MADV_POPULATE_READ`` (which fails where an access would fault), and the load's own reads of mapped bytes (its
checksums, a digest) go through :func:`mapped_pieces`, which copies them with ``process_vm_readv`` (a fault
there is an error code, not a signal).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Iterator
from typing import Any

from gdsload.loader.devices import Device
from gdsload.loader.errors import FileUnreadableError, TruncatedFileError
from gdsload.loader.plan import LoadPlan
from gdsload.loader.io.cpu import CpuBackend

__all__ = ["MmapBackend", "mapped_pieces"]

_MADV_POPULATE_READ = 22
"""Linux 5.14+: map every page of a range in one call (fewer faults than touching them one by one); fails with
EFAULT where an access would raise SIGBUS (the file is shorter than the mapping)."""
_PIECE = 4 << 20
"""Bytes :func:`mapped_pieces` copies at a time (a buffer per thread, reused)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc: Any = None
_vm_read_works: bool | None = None
_local = threading.local()


def _vm_read(address: int, buf: Any, n: int) -> int:
    """Copy ``n`` bytes at ``address`` of this process into ``buf`` with ``process_vm_readv``: the bytes copied
    before the first page that cannot be read (no signal), or -errno."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                                          ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        libc.process_vm_readv.restype = ctypes.c_ssize_t
        _libc = libc
    local, remote = _Iovec(ctypes.addressof(buf), n), _Iovec(address, n)
    got = _libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return got if got >= 0 else -ctypes.get_errno()


def mapped_pieces(address: int, nbytes: int, path: str) -> Iterator[memoryview]:
    """The ``nbytes`` mapped bytes at ``address`` (of ``path``'s mapping), in pieces a reader can take without
    the risk of ``SIGBUS``: copies into a buffer of this thread's, reused for the next piece (use each piece
    before asking for the next). A page the file no longer holds is a :class:`TruncatedFileError` naming it.

    Where ``process_vm_readv`` is not allowed (a sandbox), each piece is mapped in with ``MADV_POPULATE_READ``
    first, which fails instead of faulting, and then read where it lies (a truncation in the instant between
    the two would still fault).
    """
    global _vm_read_works
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = ctypes.create_string_buffer(_PIECE)
    view = memoryview(buf).cast("B")
    at = 0
    while at < nbytes:
        n = min(_PIECE, nbytes - at)
        if _vm_read_works is not False:
            got = _vm_read(address + at, buf, n)
            if got == -errno.EPERM or got == -errno.ENOSYS:
                _vm_read_works = False
            elif got < n:
                raise _truncated(path, at + max(got, 0))
            else:
                _vm_read_works = True
                yield view[:n]
                at += n
                continue
        _populate(address + at, n, path, at)
        yield memoryview((ctypes.c_char * n).from_address(address + at)).cast("B")
        at += n


def _populate(address: int, n: int, path: str, at: int) -> None:
    global _libc
    if _libc is None:
        _vm_read(address, ctypes.create_string_buffer(1), 0)  # loads libc
    page = mmap.PAGESIZE
    start = address // page * page
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + n - start), _MADV_POPULATE_READ):
        if ctypes.get_errno() == errno.EFAULT:
            raise _truncated(path, at)


def _truncated(path: str, at: int) -> TruncatedFileError:
    return TruncatedFileError(f"{path!r} was cut short while it was mapped and loaded (its bytes from about "
                              f"{at} on of the checked range are gone); re-copy it, and do not change model "
                              "files while they load")


class MmapBackend(CpuBackend):
    name = "mmap"
    maps_files = True

    @classmethod
    def probe(cls, device: Device) -> str | None:
        if device.kind != "cpu":
            return f"it maps files into host memory only, not {str(device)!r}"
        return None

    def open(self, plan: LoadPlan) -> None:
        super().open(plan)
        self._maps: list[Any] = []
        import torch

        for i in plan.mapped:
            path, fd = plan.files[i].path, self._fds[i]  # the descriptors the cpu backend opened
            want = plan.files[i].header.file_size
            size = os.fstat(fd).st_size
            if size < want:  # shorter than its header says: its tensors would lie past the end
                raise TruncatedFileError(f"{path!r} is {size} bytes now, its header described {want}: it was cut "
                                         "short after its header was read; re-copy it")
            try:
                m = mmap.mmap(fd, want, access=mmap.ACCESS_COPY) if want else None
            except (OSError, ValueError) as e:
                raise FileUnreadableError(f"{path!r} cannot be mapped ({e}); load it with backend='cpu'") from None
            if m is not None:
                try:
                    m.madvise(_MADV_POPULATE_READ)
                except OSError as e:
                    if e.errno == errno.EFAULT:  # a page past the end of the file: touching it would raise SIGBUS
                        m.close()
                        raise TruncatedFileError(f"{path!r} was cut short while it was mapped; re-copy it") from None
                except (ValueError, AttributeError):
                    pass  # an older kernel: the pages come in as they are touched
            self._maps.append(torch.frombuffer(m, dtype=torch.uint8) if m is not None
                              else torch.empty(0, dtype=torch.uint8))

    def io_modes(self) -> list[str]:
        assert self.plan is not None
        mapped = set(self.plan.mapped)
        return ["mmap" if i in mapped else "cpu" for i in range(len(self.plan.files))]

    def file_buffers(self) -> list[Any]:
        """The mapped files as 1-D uint8 tensors, in ``plan.mapped`` order (they keep their mappings alive)."""
        return list(self._maps)

    def close(self) -> None:
        super().close()
        self._maps = []  # the tensors viewing a mapping keep it; it goes with the last of them
