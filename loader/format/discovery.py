"""Find the files one tensor-parallel rank loads.

Order: ``gdsload.json`` if present; else vLLM's ``model-rank-{rank}-part-{part}.safetensors``
(what ``save_sharded_state`` writes); else TensorRT-LLM's ``rank{rank}.safetensors``; else, for
rank 0 only, every ``*.safetensors`` (an ordinary TP=1 checkpoint). A path to a single
``.safetensors`` file is a TP=1 checkpoint of one file.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple
from pathlib import Path

from gdsload.loader.errors import ConfigError, FileUnreadableError, ManifestError, NoFilesForRankError, UnfinishedOutputError
from gdsload.loader.format.manifest import MANIFEST_NAME, Manifest, ManifestFile

__all__ = ["RankFiles", "discover", "list_ranks", "VLLM_PATTERN", "TRTLLM_PATTERN"]

VLLM_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
TRTLLM_PATTERN = "rank{rank}.safetensors"
_VLLM_RE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")
_TRTLLM_RE = re.compile(r"^rank(\d+)\.safetensors$")


class RankFiles(NamedTuple):
    """The files of one rank, in load order, and how they were found."""

    root: str
    rank: int
    tp_size: int
    source: str
    """``manifest``, ``vllm``, ``trtllm`` or ``plain``."""
    files: tuple[str, ...]
    """Absolute paths."""
    manifest: Manifest | None = None

    def manifest_entry(self, path: str) -> ManifestFile | None:
        if self.manifest is None:
            return None
        rel = os.path.relpath(path, self.root)
        return next((f for f in self.manifest.ranks[self.rank] if f.path == rel), None)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'"""
    out, ranks = [], sorted(set(ranks))
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


UNFINISHED_MARKERS = {".gdsload-shard.partial": "shard", ".gdsload-writing": "compress"}
"""Entries a gdsload writer keeps in a directory until its output is complete: such a directory never loads."""


def _safetensors_in(root: Path) -> list[str]:
    try:
        return sorted(p.name for p in root.iterdir()
                      if p.suffix == ".safetensors" and not p.name.startswith(".") and p.is_file())
    except OSError as e:
        raise FileUnreadableError(f"model directory {str(root)!r} cannot be listed ({e.strerror or e}); check its "
                                  "permissions") from None


def list_ranks(path: str | os.PathLike[str]) -> tuple[str, int, dict[int, tuple[str, ...]]]:
    """Every rank a model directory holds: ``(source, tp_size, {rank: absolute paths})``."""
    source, tp, files, _ = _scan(path)
    return source, tp, files


def _scan(path: str | os.PathLike[str]) -> tuple[str, int, dict[int, tuple[str, ...]], Manifest | None]:
    root = Path(path).resolve()
    if root.is_file():
        if root.suffix != ".safetensors":
            raise NoFilesForRankError(f"{str(path)!r} is not a .safetensors file or a model directory")
        return "plain", 1, {0: (str(root),)}, None
    if not root.is_dir():
        raise NoFilesForRankError(f"model path {str(path)!r} does not exist")
    for marker, command in UNFINISHED_MARKERS.items():
        if os.path.lexists(root / marker):
            raise UnfinishedOutputError(
                f"{str(path)!r} is the output of a `gdsload {command}` run that has not finished ({marker} is there): "
                f"it is still running, or it was stopped; rerun the same `gdsload {command}` command to finish it "
                "(finished files are kept), or delete the directory"
            )

    if (root / MANIFEST_NAME).exists():
        manifest = Manifest.read(root)
        files = {r: tuple(str(root / f.path) for f in entries) for r, entries in manifest.ranks.items()}
        for r, entries in manifest.ranks.items():
            for f in entries:
                p = root / f.path
                try:
                    size = p.stat().st_size if p.is_file() else None
                except OSError:
                    size = None
                if size is None:
                    raise ManifestError(
                        f"{str(root / MANIFEST_NAME)!r} lists {f.path!r} for rank {r}, "
                        "but the file is missing; the copy is incomplete (re-copy the directory)"
                    )
                if size != f.bytes:
                    raise ManifestError(
                        f"{str(root / MANIFEST_NAME)!r} records {f.bytes} bytes for {f.path!r} (rank {r}), the file "
                        f"has {size}; it was cut short or replaced — re-copy the directory"
                    )
        return "manifest", manifest.tp_size, files, manifest

    names = _safetensors_in(root)
    vllm: dict[int, dict[int, str]] = {}
    trt: dict[int, str] = {}
    for name in names:
        if m := _VLLM_RE.match(name):
            vllm.setdefault(int(m[1]), {})[int(m[2])] = str(root / name)
        elif m := _TRTLLM_RE.match(name):
            trt[int(m[1])] = str(root / name)
    if vllm:
        out = {}
        for r, parts in vllm.items():
            gaps = sorted(set(range(max(parts) + 1)) - set(parts))
            if gaps:
                raise NoFilesForRankError(
                    f"rank {r} under {str(root)!r} has parts {sorted(parts)} but not {gaps} "
                    f"('{VLLM_PATTERN}'); the copy is incomplete"
                )
            out[r] = tuple(parts[p] for p in sorted(parts))
        return "vllm", max(out) + 1, out, None
    if trt:
        return "trtllm", max(trt) + 1, {r: (p,) for r, p in trt.items()}, None
    if names:
        return "plain", 1, {0: tuple(str(root / n) for n in names)}, None
    raise NoFilesForRankError(f"no .safetensors files under {str(path)!r}")


def discover(path: str | os.PathLike[str], rank: int = 0) -> RankFiles:
    """The files rank ``rank`` loads from ``path`` (a model directory or one .safetensors file).

    >>> discover("/models/llama-tp2", rank=1).files  # doctest: +SKIP
    ('/models/llama-tp2/model-rank-1-part-0.safetensors',)
    """
    if type(rank) is not int or rank < 0:
        raise ConfigError(f"rank must be a non-negative integer, got {rank!r}")
    source, tp, ranks, manifest = _scan(path)
    root = Path(path).resolve()
    root_dir = str(root if root.is_dir() else root.parent)
    if rank not in ranks:
        pattern = {
            "manifest": MANIFEST_NAME,
            "vllm": VLLM_PATTERN,
            "trtllm": TRTLLM_PATTERN,
            "plain": "*.safetensors",
        }[source]
        if source == "plain":
            hint = "it is a TP=1 checkpoint; shard it with `gdsload shard SRC OUT --tp N`"
        elif rank < max(ranks):  # a gap: higher ranks are here, this one is not
            hint = (f"rank {rank}'s files are missing although higher ranks are here; the copy is incomplete "
                    "(re-copy it), or this host was given only some of the ranks")
        else:
            hint = f"was it sharded for tp={max(ranks) + 1}?"
        raise NoFilesForRankError(
            f"No files for rank {rank} under {str(path)!r} matching {pattern!r}; "
            f"the directory holds rank{'s' if len(ranks) > 1 else ''} {_ranges(list(ranks))} — {hint}"
        )
    return RankFiles(root=root_dir, rank=rank, tp_size=tp, source=source, files=ranks[rank], manifest=manifest)
