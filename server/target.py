"""What a model directory offers the sidecar, checked before anything starts serving it.

``gdsload serve`` checks its target before it binds a port or starts a worker, and ``POST
/v1/reload`` checks the new one before the current model stops: the path is a model directory (or
one ``.safetensors`` file), files are there, ``--tp`` and ``--ranks`` (or the reload's ``ranks``) name
ranks the directory holds, no more ranks than one host serves, and every served rank has a device.
A bad target is one typed error whose message names the fix.

A reload's check (``strict``) also reads every served file's header, through the same confined opens
the workers use (nothing outside ``--allow-root`` is opened, whatever a symlink swapped in meanwhile
points at), and its error messages never carry file bytes or paths outside the allowed roots: the
full text goes to the server's log, the caller gets the error type, the file and the fix.

>>> target = check_target("/models/llama-tp2", ServeConfig.resolve(tp=2))  # doctest: +SKIP
>>> target.ranks, target.source
((0, 1), 'manifest')
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..loader.format.ranks import rank_ranges
from ..loader.errors import (
    ConfigError,
    FileUnreadableError,
    GdsloadError,
    ManifestError,
    NoFilesForRankError,
    UnfinishedOutputError,
)

from .settings import MAX_LOCAL_RANKS, PathNotAllowedError, ServeConfig, confine_path
from .workers import assign_devices, visible_gpus

__all__ = [
    "Target",
    "check_target",
    "ModelNotFoundError",
    "ModelUnreadableError",
    "TensorParallelMismatchError",
    "TooManyRanksError",
]

log = logging.getLogger(__name__)

_MANIFEST_LIMIT = 64 << 20
"""Largest ``gdsload.json`` a reload's check reads."""


class ModelNotFoundError(GdsloadError, FileNotFoundError):
    """The model path does not exist."""


class ModelUnreadableError(GdsloadError, OSError):
    """The model directory cannot be listed or read (permissions, I/O error), or its files are not valid."""


class TensorParallelMismatchError(GdsloadError, ValueError):
    """``--tp`` differs from the tensor-parallel size the model directory was sharded for."""


class TooManyRanksError(ConfigError):
    """More ranks than one host serves (one worker process each)."""


@dataclass(frozen=True)
class Target:
    """A model directory checked for serving: its layout, every rank's files, and the ranks served here."""

    path: str
    """The path as given."""
    real_path: str
    """``path`` with symlinks and ``..`` resolved."""
    source: str
    """How the files were found: ``manifest``, ``vllm``, ``trtllm`` or ``plain``."""
    tp_size: int
    files: dict[int, tuple[str, ...]]
    """Every rank's files (absolute paths), served or not."""
    ranks: tuple[int, ...]
    """The ranks this host serves."""
    devices: dict[int, tuple[str, bool]]
    """``{rank: (CUDA_VISIBLE_DEVICES of its worker, explicit?)}``, see :func:`~gdsload.server.workers.assign_devices`."""


def check_target(path: str, config: ServeConfig, ranks: Sequence[int] | None = None, *, strict: bool = False) -> Target:
    """Check ``path`` for serving with ``config`` (``ranks``: a reload's own list); a :class:`Target` or a typed error.

    ``strict`` (a reload): the path must lie under an allowed root, and every served file's header is
    read through confined opens; errors name no file bytes and no path outside the roots.

    >>> check_target("/nonexistent", ServeConfig.resolve())  # doctest: +SKIP
    Traceback (most recent call last):
    ModelNotFoundError: model directory '/nonexistent' does not exist; give the directory ...
    """
    roots = config.allow_roots
    try:
        real = confine_path(path, roots) if strict or roots else os.path.realpath(path)
        return _check(path, real, config, ranks, strict)
    except GdsloadError as e:
        if not strict:
            raise
        public = _public_error(e, roots)
        if public is not e:
            log.warning("reload target %r refused: %s: %s", path, type(e).__name__, e)
        raise public from None
    except Exception as e:  # a malformed file the loader's checks did not name
        if not strict:
            raise ModelUnreadableError(f"model directory {path!r} cannot be served ({type(e).__name__}: {e})") from None
        log.warning("reload target %r refused: %s: %s", path, type(e).__name__, e)
        raise ModelUnreadableError(
            f"model directory {path!r} cannot be served ({type(e).__name__}); the details are in the server's log"
        ) from None


def _check(path: str, real: str, config: ServeConfig, ranks: Sequence[int] | None, strict: bool) -> Target:
    from ..loader.format.discovery import discover, scan_layout

    if not os.path.exists(real):
        raise ModelNotFoundError(
            f"model directory {path!r} does not exist; give the directory that holds the "
            "model's .safetensors files (and its gdsload.json, if it has one)"
        )
    if not os.path.isdir(real) and not real.endswith(".safetensors"):
        raise ModelNotFoundError(
            f"model path {path!r} is not a directory or a .safetensors file; give the directory "
            "that holds the model's .safetensors files"
        )
    try:
        # Only the served ranks' files must be here: a node holds its own ranks of a multi-node layout.
        scanned = scan_layout(real, check=tuple(ranks if ranks is not None else config.ranks or ()) or None)
        source, tp, files = scanned.source, scanned.world_size, scanned.ranks
    except (NoFilesForRankError, UnfinishedOutputError) as e:
        if "no .safetensors files" in str(e):
            raise type(e)(
                f"{e}; serve the directory `gdsload shard` or vLLM's save_sharded_state wrote, or a "
                "Hugging Face model directory"
            ) from None
        raise
    except GdsloadError:
        raise
    except OSError as e:
        raise ModelUnreadableError(
            f"model directory {path!r} cannot be read ({e.strerror or type(e).__name__}); "
            "check that it exists and this user may read it"
        ) from None
    sizes = f"tp={scanned.tp_size}" + (f" x pp={scanned.pp_size}" if scanned.pp_size > 1 else "")
    held = f"{path!r} holds rank{'s' if len(files) > 1 else ''} {rank_ranges(list(files))} ({_layout(source)}, {sizes})"

    if ranks is not None:
        served, asked = tuple(sorted(set(ranks))), f"ranks {sorted(set(ranks))}"
    elif config.tp is not None:
        if config.tp != tp:
            if source == "plain":
                fix = (
                    f"serve it without --tp (or with --tp 1), or shard it first: gdsload shard {path} OUT "
                    f"--tp {config.tp}"
                )
            elif scanned.pp_size > 1:
                fix = f"--tp counts the ranks one host serves; serve all {tp} (no --tp), or a node's own with --ranks"
            else:
                fix = f"serve it with --tp {tp}, or reshard its source: gdsload shard SRC OUT --tp {config.tp}"
            raise TensorParallelMismatchError(
                f"--tp {config.tp} does not match the model: {held}; {fix}"
                + (
                    "; to serve part of its ranks on this host, use --ranks"
                    if config.tp < tp and source != "plain"
                    else ""
                )
            )
        served, asked = tuple(range(tp)), f"--tp {config.tp}"
    elif config.ranks is not None:
        served, asked = config.ranks, f"--ranks {rank_ranges(config.ranks)}"
    else:
        served, asked = tuple(sorted(files)), ""
    if len(served) > MAX_LOCAL_RANKS:
        raise TooManyRanksError(
            f"{asked or repr(path) + f' (tp={tp})'} asks this host to serve {len(served)} ranks, one worker process "
            f"each; one host serves at most {MAX_LOCAL_RANKS} — split the ranks across hosts with --ranks (e.g. "
            f"--ranks 0-{MAX_LOCAL_RANKS - 1} here, the rest on the next)"
        )
    for r in served:
        if r not in files:
            try:
                discover(real, r)  # raises NoFilesForRankError, naming the ranks the directory does hold
            except NoFilesForRankError as e:
                raise NoFilesForRankError(f"{asked}: {e}" if asked else str(e)) from None
    roots = config.allow_roots
    if roots:  # a file may be a symlink out of the root even when its directory is not
        for r in served:
            for f in files[r]:
                confine_path(f, roots)
    if strict:
        if source == "manifest":
            _same_manifest(real, roots, files)
        from ..loader.plan import plan_rank

        for r in served:
            # Every header and the compression metadata (HeaderError, CodecError, ...), opened as the workers
            # open them; the plan holds a descriptor per file until it is closed.
            with plan_rank(discover(real, r), confine=roots or None):
                pass
    devices = assign_devices(served, config.device_map, visible_gpus())
    return Target(
        path=path, real_path=real, source=source, tp_size=tp, files=dict(files), ranks=served, devices=devices
    )


def _layout(source: str) -> str:
    return {
        "manifest": "gdsload manifest",
        "vllm": "vLLM rank files",
        "trtllm": "TensorRT-LLM rank files",
        "plain": "one unsharded checkpoint",
    }.get(source, source)


def _same_manifest(real: str, roots: Sequence[str], files: dict[int, tuple[str, ...]]) -> None:
    """Read ``gdsload.json`` again through a confined open: the files discovery found must be the ones it lists."""
    from ..loader.format.confine import open_beneath
    from ..loader.format.manifest import MANIFEST_NAME, Manifest

    where = os.path.join(real, MANIFEST_NAME)
    fd = open_beneath(where, roots)
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(_MANIFEST_LIMIT + 1)
    except OSError as e:
        raise FileUnreadableError(f"{where!r} cannot be read ({e.strerror or e})") from None
    if len(raw) > _MANIFEST_LIMIT:
        raise ManifestError(f"{where!r} is larger than {_MANIFEST_LIMIT} bytes; it is not a gdsload manifest")
    try:
        manifest = Manifest.from_dict(json.loads(raw), where=where)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, GdsloadError):
            raise
        raise ManifestError(f"{where!r} is not valid JSON; rewrite it with `gdsload shard`") from None
    listed = {r: tuple(os.path.join(real, f.path) for f in entries) for r, entries in manifest.ranks.items()}
    if listed != files:
        raise ManifestError(
            f"{where!r} changed while the model was checked; try the reload again once the directory is complete"
        )


# Errors whose text is built from the request and the directory's names, never from file contents.
_VERBATIM = (
    NoFilesForRankError,
    UnfinishedOutputError,
    PathNotAllowedError,
    ConfigError,
    ModelNotFoundError,
    TensorParallelMismatchError,
    FileUnreadableError,
    ModelUnreadableError,
)
_QUOTED_PATH = re.compile(r"'(/[^']*)'")
_QUOTED_NAME = re.compile(r"'([^'/]+\.(?:safetensors|json))'")


def _public_error(e: GdsloadError, roots: Sequence[str]) -> GdsloadError:
    """``e`` as a reload's caller may see it: no file bytes, no path outside ``roots``."""
    from ..loader.format.confine import PathEscapesRootError

    def inside(p: str) -> bool:
        p = os.path.normpath(p)
        return any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)

    text = str(e)
    if isinstance(e, (*_VERBATIM, PathEscapesRootError)):
        clean = _QUOTED_PATH.sub(lambda m: m[0] if inside(m[1]) else "'<outside the allowed roots>'", text)
        if clean == text:
            return e
        message = clean
    else:
        named = [m for m in _QUOTED_PATH.findall(text) if inside(m)] + _QUOTED_NAME.findall(text)
        named = list(dict.fromkeys(named))[:3]
        where = " and ".join(repr(n) for n in named) if named else "a file of the model"
        message = (
            f"{where}: not a valid model ({type(e).__name__}); the details are in the server's log — fix or "
            "re-copy the files, then reload again"
        )
    try:
        out = type(e)(message)
    except Exception:  # an error type with another constructor
        out = ModelUnreadableError(message)
    return out
