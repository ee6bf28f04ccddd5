"""The output directory of ``gdsload shard``: resumable, and loadable only once complete.

Files are written (temp file, fsync, rename) into ``OUT/.gdsload-shard.partial/`` next to a ``state.json``
fingerprint of the command (source files, sizes, mtimes, config and options). Only at the end are they
moved into ``OUT`` and the manifest written; ``OUT`` loads only once the partial directory is gone (one
rename, after the manifest), so a run stopped at any point leaves nothing that loads. After a kill
(SIGKILL, Ctrl-C) rerunning the same command skips every complete file (validated by header and
fingerprint) and writes the rest; an error (bad input, full disk) removes everything the run created.
``OUT`` must be empty, absent, a partial run of the same command, or its finished output.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from ..errors import FormatError, GdsloadError, ManifestError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.atomic import atomic_output
from ..format.safetensors import read_header

__all__ = [
    "PARTIAL_DIR",
    "FINISHED_DIR",
    "OutputExistsError",
    "PlannedOutput",
    "prepare_output",
    "locked",
    "fsync_dir",
    "remove_outputs",
    "publish",
    "write_state",
    "is_complete",
]

log = logging.getLogger(__name__)

PARTIAL_DIR = ".gdsload-shard.partial"
"""Where an unfinished run keeps its complete files and its ``state.json`` (inside OUT). While it is there,
OUT does not load (:data:`gdsload.loader.format.discovery.UNFINISHED_MARKERS`)."""
FINISHED_DIR = ".gdsload-shard.finished"
"""The partial directory after the run: renamed in one step (OUT becomes loadable), then removed."""
STATE = "state.json"

_DESCRIBED = ("source", "tp", "pp", "ep", "layout", "layout_source", "quantize", "max_file_bytes", "compress", "dtype")


class OutputExistsError(GdsloadError, FileExistsError):
    """OUT holds something other than an unfinished or finished run of the same command."""


class PlannedOutput(Protocol):
    """What the output directory needs to know of a plan."""

    fingerprint: str

    def state(self) -> dict[str, Any]:
        """The command's identity, written as ``state.json`` (``fingerprint`` and the options)."""
        ...

    def relpaths(self) -> list[str]:
        """The weight files, relative to OUT."""
        ...

    def aux_files(self) -> list[str]:
        """The other files OUT gets (config.json, tokenizer files)."""
        ...

    def file_identity(self, relpath: str) -> tuple[dict[str, str], set[str]]:
        """The ``__metadata__`` entries that mark a file as this plan's, and its tensor names."""
        ...


def is_complete(path: Path, plan: PlannedOutput, relpath: str) -> bool:
    """True when ``path`` is a whole file of this exact plan (valid header, metadata, tensor names)."""
    if not path.is_file():
        return False
    try:
        header = read_header(path)
    except (FormatError, OSError) as e:
        log.info("rewriting %s: %s", path, e)
        return False
    marks, names = plan.file_identity(relpath)
    if any(header.metadata.get(k) != v for k, v in marks.items()):
        return False
    return {t.name for t in header.tensors} == names


def _read_state(partial: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((partial / STATE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    diffs = [f"{k}={old.get(k)!r} (now {new.get(k)!r})" for k in _DESCRIBED if old.get(k) != new.get(k)]
    return ", ".join(diffs) or "the source files changed since (sizes or modification times differ)"


def _stale_manifest_temps(out: Path) -> list[Path]:
    return [*out.glob(f".{MANIFEST_NAME}.tmp-*"), *out.glob(f".{MANIFEST_NAME}.tmp.creating-*")]


def prepare_output(out: Path, plan: PlannedOutput) -> tuple[bool, bool]:
    """Check OUT may receive ``plan``; returns ``(created_out, already_complete)``."""
    state_now = plan.state()
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"output {str(out)!r} is a file; give a directory path for OUT")
    if not out.exists():
        out.mkdir(parents=True)
        return True, False
    entries = {p.name for p in out.iterdir()}
    if MANIFEST_NAME in entries:
        try:
            shard = Manifest.read(out).extra.get("shard", {})
        except ManifestError:
            shard = {}
        if shard.get("fingerprint") == plan.fingerprint:
            damaged = [r for r in plan.relpaths() if not is_complete(out / r, plan, r)]
            if not damaged:
                return False, True
            raise OutputExistsError(
                f"{str(out)!r} holds this command's output, but {', '.join(map(repr, damaged[:3]))} "
                "is missing or damaged; delete the directory and rerun"
            )
        made_by = _differences(shard, state_now) if shard else "it was not written by `gdsload shard`"
        raise OutputExistsError(
            f"{str(out)!r} already holds a sharded checkpoint ({MANIFEST_NAME}) that differs from this command: "
            f"{made_by}; choose another OUT or delete it first"
        )
    ours = set(plan.relpaths()) | set(plan.aux_files()) | {PARTIAL_DIR, FINISHED_DIR}
    partial = out / PARTIAL_DIR
    if PARTIAL_DIR in entries:
        state = _read_state(partial)
        if state is None and not any(partial.glob("*.safetensors")):
            state = state_now  # killed before it wrote its state: nothing to keep, take it over
        if state is None or state.get("fingerprint") != plan.fingerprint:
            why = _differences(state, state_now) if state else "its state.json is unreadable"
            raise OutputExistsError(
                f"{str(out)!r} holds an unfinished `gdsload shard` run of a different command: {why}. "
                f"Rerun that command to finish it, or delete {str(out)!r} (or its {PARTIAL_DIR}/) to start over"
            )
        # A run killed while it wrote its manifest leaves the manifest's temporary file: ours, remove it.
        for stale in _stale_manifest_temps(out):
            stale.unlink(missing_ok=True)
            entries.discard(stale.name)
        stray = sorted(entries - ours)
    else:
        stray = sorted(entries - {FINISHED_DIR})
    if stray:
        raise OutputExistsError(
            f"output directory {str(out)!r} is not empty (holds {', '.join(map(repr, stray[:4]))}"
            f"{', ...' if len(stray) > 4 else ''}) and is not an unfinished run of this command; "
            "choose an empty or new directory, or delete its contents"
        )
    return False, False


@contextmanager
def locked(partial: Path) -> Iterator[None]:
    """Hold OUT's lock: a second ``gdsload shard`` into the same OUT is refused while this one runs."""
    fd = os.open(partial / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputExistsError(
                f"another `gdsload shard` is writing {str(partial.parent)!r} right now; wait for it or pick another OUT"
            ) from None
        yield
    finally:
        os.close(fd)


def write_state(partial: Path, plan: PlannedOutput) -> None:
    """Record the command in the partial directory, and remove temporaries an interrupted run left."""
    with atomic_output(partial / STATE) as fh:
        fh.write(json.dumps(plan.state(), indent=2).encode())
    for stale in partial.glob(".*.tmp-*"):
        log.info("removing %s left by an interrupted run", stale)
        stale.unlink()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_outputs(out: Path, names: Sequence[str], created: bool) -> None:
    """Undo a run: the partial directory, the files it moved into OUT (``names``), OUT itself if it made it."""
    shutil.rmtree(out / PARTIAL_DIR, ignore_errors=True)
    shutil.rmtree(out / FINISHED_DIR, ignore_errors=True)
    for name in [*names, MANIFEST_NAME]:
        (out / name).unlink(missing_ok=True)
    for stale in _stale_manifest_temps(out):
        stale.unlink(missing_ok=True)
    if created:
        try:
            out.rmdir()
        except OSError:
            pass


def publish(out: Path, partial: Path) -> None:
    """The step that makes OUT loadable: the partial directory renamed away, then removed."""
    done = out / FINISHED_DIR
    shutil.rmtree(done, ignore_errors=True)
    os.rename(partial, done)
    fsync_dir(out)
    shutil.rmtree(done, ignore_errors=True)
