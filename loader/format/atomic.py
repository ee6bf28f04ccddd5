"""Files and directories that appear whole or not at all.

:class:`atomic_output` writes beside the final name and renames on success; :func:`create_locked` makes a
writer's temporary entry under an ``flock`` so :func:`remove_dead_leftovers` can tell a killed writer's
leftovers (unlocked) from a live one's, across processes and PID namespaces.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import BinaryIO


__all__ = ["atomic_output", "create_locked", "remove_dead_leftovers", "LEFTOVER_MIN_AGE_S"]


class atomic_output:
    """Write to a temporary file beside ``path``; fsync and rename on success, delete on failure.

    A killed or failing writer never leaves a partial file under the final name. Each writer has
    its own temporary file (``.NAME.tmp-RANDOM``, locked while it writes), so two writers of one
    name never mix their bytes: the last rename wins. A writer killed outright (SIGKILL, SIGTERM
    without a handler, power loss) leaves its temporary file; the next write of that name removes
    the ones no writer holds locked any more.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.tmp = Path()
        """The temporary file, named when the block is entered."""
        self.file: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        stem = f".{self.path.name}.tmp-"
        remove_dead_leftovers(self.path.parent, stem)
        self.tmp, fd = create_locked(stem, self.path.parent)
        self.file = os.fdopen(fd, "wb")
        return self.file

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self.file is not None
        try:
            try:
                if exc_type is None:
                    self.file.flush()
                    os.fsync(self.file.fileno())
            finally:
                self.file.close()
            if exc_type is None:
                os.replace(self.tmp, self.path)
        except OSError as e:  # e.g. the disk filled at the last flush: nothing stays behind
            self.tmp.unlink(missing_ok=True)
            raise OSError(
                e.errno, f"{self.path}: could not finish writing it ({e.strerror}); nothing was written under that name"
            ) from e
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            return
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


LEFTOVER_MIN_AGE_S = 10.0
"""An entry still under its creating name this long was left by a writer killed in the instant between making
and locking it (a live writer spends microseconds there); it is removed too."""


def _creating_stem(stem: str) -> str:
    return stem.rstrip("-.") + ".creating-"


def create_locked(stem: str, parent: Path, *, directory: bool = False) -> tuple[Path, int]:
    """Create ``parent/STEM RANDOM`` (a new file, or a directory) and hold an exclusive ``flock`` on it.

    Returns the path and the locked descriptor; closing the descriptor (or the process ending, however it
    ends) releases the lock, which is how :func:`remove_dead_leftovers` tells a live writer's temporary
    from a killed one's, across processes and PID namespaces. The entry is made under another name,
    locked, then renamed: nothing named ``STEM*`` is ever unlocked while its writer lives.
    """
    import secrets  # here: a load never creates files, and the module imports hmac

    while True:
        token = secrets.token_hex(3)
        making, path = parent / f"{_creating_stem(stem)}{token}", parent / f"{stem}{token}"
        if path.exists():
            continue
        try:
            if directory:
                making.mkdir()
                fd = os.open(making, os.O_RDONLY | os.O_DIRECTORY)
            else:
                fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without flock: the leftover will look live, and stay
            pass
        try:
            os.rename(making, path)
        except BaseException:
            os.close(fd)
            (making.rmdir if directory else making.unlink)()
            raise
        return path, fd


def remove_dead_leftovers(parent: Path, stem: str) -> None:
    """Best effort: delete ``parent``'s entries named ``STEM*`` (made by :func:`create_locked`) that no process
    holds locked any more (their writer was killed), and entries left under their creating name."""
    import glob
    import shutil

    try:
        leftovers = list(parent.glob(f"{glob.escape(stem)}*"))
        making = list(parent.glob(f"{glob.escape(_creating_stem(stem))}*"))
    except OSError:
        return
    now = time.time()
    for item in leftovers + [m for m in making if _older(m, now)]:
        try:
            if item.is_symlink():
                continue
            fd = os.open(item, os.O_RDONLY | (os.O_DIRECTORY if item.is_dir() else 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live writer holds it
            if item.is_dir():
                shutil.rmtree(item)
            else:
                item.unlink()
        except OSError:  # held, not ours to delete, or gone meanwhile: leave it
            pass
        finally:
            os.close(fd)


def _older(item: Path, now: float) -> bool:
    try:
        return now - item.lstat().st_mtime > LEFTOVER_MIN_AGE_S
    except OSError:
        return False
