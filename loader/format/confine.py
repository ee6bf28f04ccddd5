"""Opening files confined to directories at the moment of the open, not only when a path was checked.

A sidecar checks that a model path lies under an allowed root when it is asked to load it; its worker
opens the files later, and again after every restart. Between the two, a file or directory could be
swapped for a symlink that leads elsewhere. :func:`open_beneath` closes that gap: the open itself
refuses any path that leaves the root, by ``openat2(..., RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)``
where the kernel has it (Linux 5.6+), else by walking the path one component at a time with
``O_NOFOLLOW`` (no symlink at all is followed then).

>>> fd = open_beneath("/models/llama/model-rank-0-part-0.safetensors", ["/models"])  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Sequence

from ..errors import FileUnreadableError, GdsloadError

__all__ = ["open_beneath", "PathEscapesRootError"]

_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08


class PathEscapesRootError(GdsloadError, PermissionError):
    """A path leaves the directories it must stay in (``..``, an absolute symlink, a symlink out)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_openat2_missing = _SYS_OPENAT2 is None


def _openat2(dirfd: int, rel: str, flags: int) -> int:
    how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, rel.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), rel)
    return fd


def _walk(dirfd: int, rel: str, flags: int) -> int:
    """``openat`` component by component, following no symlink (the fallback without openat2)."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise OSError(errno.EXDEV, "path leaves its root", rel)
    fd = os.dup(dirfd)
    try:
        for i, part in enumerate(parts):
            try:
                is_link = stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
            except FileNotFoundError:
                is_link = False  # the open below says so
            if is_link:
                raise OSError(errno.ELOOP, "a symlink on the way", rel)
            if i == len(parts) - 1:
                return os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        raise AssertionError("unreachable")
    finally:
        os.close(fd)


def open_beneath(path: str, roots: Sequence[str], flags: int = os.O_RDONLY | os.O_CLOEXEC) -> int:
    """Open ``path`` (absolute) so that resolving it never leaves the root it lies under; a descriptor.

    Raises :class:`PathEscapesRootError` when ``path`` is under none of ``roots`` or its resolution would
    leave that root, :class:`FileUnreadableError` for a file that cannot be opened.
    """
    global _openat2_missing
    path = os.path.abspath(path)
    root = next(
        (r for r in sorted(roots, key=len, reverse=True) if path == r or path.startswith(r.rstrip("/") + "/")), None
    )
    if root is None:
        raise PathEscapesRootError(
            f"{path!r} is not under the allowed directories {list(roots)}; "
            "give a path inside one, or add its directory with --allow-root"
        )
    rel = os.path.relpath(path, root)
    try:
        rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise FileUnreadableError(f"allowed directory {root!r} cannot be opened ({e.strerror})") from None
    try:
        if not _openat2_missing:
            try:
                return _openat2(rootfd, rel, flags)
            except OSError as e:
                if e.errno != errno.ENOSYS:
                    raise
                _openat2_missing = True
        return _walk(rootfd, rel, flags)
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.ELOOP):
            raise PathEscapesRootError(
                f"{path!r} leads out of {root!r} ({'a symlink on the way' if e.errno == errno.ELOOP else 'it escapes'});"
                " files are opened only inside the allowed directories — replace the link by the file"
            ) from None
        raise FileUnreadableError(
            f"{path!r} cannot be opened ({e.strerror or e}); check that it exists and this user may read it"
        ) from None
    finally:
        os.close(rootfd)
