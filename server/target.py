"""What a model directory offers the sidecar, checked before anything starts serving it.

``gdsload serve`` checks its target before it binds a port or starts a worker, and ``POST
/v1/reload`` checks the new one before the current model stops: the path is a model directory (or
one ``.safetensors`` file), files are there, ``--tp`` and ``--ranks`` (or the reload's ``ranks``) name
ranks the directory holds, no more ranks than one host serves, and every served rank has a device.
A bad target is one typed error whose message names the fix.

A reload's check (``strict``) also reads every served file's header, so a bad target is refused while
the current model still serves.

>>> target = check_target("/models/llama-tp2", ServeConfig.resolve(tp=2))  # doctest: +SKIP
>>> target.ranks, target.source
((0, 1), 'manifest')
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from gdsload.loader.errors import (
    GdsloadError,
    NoFilesForRankError,
    UnfinishedOutputError,
)

from .settings import ServeConfig, confine_path
from .workers import assign_devices, visible_gpus

__all__ = [
    "Target",
    "check_target",
    "ModelNotFoundError",
    "ModelUnreadableError",
    "TensorParallelMismatchError",
    "ranges",
]

log = logging.getLogger(__name__)

class ModelNotFoundError(GdsloadError, FileNotFoundError):
    """The model path does not exist."""


class ModelUnreadableError(GdsloadError, OSError):
    """The model directory cannot be listed or read (permissions, I/O error), or its files are not valid."""


class TensorParallelMismatchError(GdsloadError, ValueError):
    """``--tp`` differs from the tensor-parallel size the model directory was sharded for."""


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


def ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    out, rs = [], sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


def check_target(path: str, config: ServeConfig, ranks: Sequence[int] | None = None, *,
                 strict: bool = False) -> Target:
    """Check ``path`` for serving with ``config`` (``ranks``: a reload's own list); a :class:`Target` or a typed error.

    ``strict`` (a reload): the path must lie under an allowed root, and every served file's header is read.

    >>> check_target("/nonexistent", ServeConfig.resolve())  # doctest: +SKIP
    Traceback (most recent call last):
    ModelNotFoundError: model directory '/nonexistent' does not exist; give the directory ...
    """
    roots = config.allow_roots
    try:
        real = confine_path(path, roots) if strict or roots else os.path.realpath(path)
        return _check(path, real, config, ranks, strict)
    except GdsloadError:
        raise
    except Exception as e:  # a malformed file the loader's checks did not name
        raise ModelUnreadableError(f"model directory {path!r} cannot be served ({type(e).__name__}: {e})") from None


def _check(path: str, real: str, config: ServeConfig, ranks: Sequence[int] | None, strict: bool) -> Target:
    from gdsload.loader.format.discovery import discover, list_ranks

    if not os.path.exists(real):
        raise ModelNotFoundError(f"model directory {path!r} does not exist; give the directory that holds the "
                                 "model's .safetensors files (and its gdsload.json, if it has one)")
    if not os.path.isdir(real) and not real.endswith(".safetensors"):
        raise ModelNotFoundError(f"model path {path!r} is not a directory or a .safetensors file; give the directory "
                                 "that holds the model's .safetensors files")
    try:
        source, tp, files = list_ranks(real)
    except (NoFilesForRankError, UnfinishedOutputError) as e:
        if "no .safetensors files" in str(e):
            raise type(e)(f"{e}; serve the directory `gdsload shard` or vLLM's save_sharded_state wrote, or a "
                          "Hugging Face model directory") from None
        raise
    except GdsloadError:
        raise
    except OSError as e:
        raise ModelUnreadableError(f"model directory {path!r} cannot be read ({e.strerror or type(e).__name__}); "
                                   "check that it exists and this user may read it") from None
    held = f"{path!r} holds rank{'s' if len(files) > 1 else ''} {ranges(list(files))} ({_layout(source)}, tp={tp})"

    if ranks is not None:
        served, asked = tuple(sorted(set(ranks))), f"ranks {sorted(set(ranks))}"
    elif config.tp is not None:
        if config.tp != tp:
            if source == "plain":
                fix = (f"serve it without --tp (or with --tp 1), or shard it first: gdsload shard {path} OUT "
                       f"--tp {config.tp}")
            else:
                fix = f"serve it with --tp {tp}, or reshard its source: gdsload shard SRC OUT --tp {config.tp}"
            raise TensorParallelMismatchError(f"--tp {config.tp} does not match the model: {held}; {fix}"
                                              + ("; to serve part of its ranks on this host, use --ranks"
                                                 if config.tp < tp and source != "plain" else ""))
        served, asked = tuple(range(tp)), f"--tp {config.tp}"
    elif config.ranks is not None:
        served, asked = config.ranks, f"--ranks {ranges(config.ranks)}"
    else:
        served, asked = tuple(sorted(files)), ""
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
        from gdsload.loader.plan import plan_rank

        for r in served:
            # Every header and the compression metadata (HeaderError, CodecError, ...); the plan holds a
            # descriptor per file until it is closed.
            with plan_rank(discover(real, r)):
                pass
    devices = assign_devices(served, config.device_map, visible_gpus())
    return Target(path=path, real_path=real, source=source, tp_size=tp, files=dict(files), ranks=served,
                  devices=devices)


def _layout(source: str) -> str:
    return {"manifest": "gdsload manifest", "vllm": "vLLM rank files", "trtllm": "TensorRT-LLM rank files",
            "plain": "one unsharded checkpoint"}.get(source, source)
