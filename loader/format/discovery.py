"""Find the files one rank loads.

Order: ``gdsload.json`` if present; else vLLM's ``model-rank-{rank}-part-{part}.safetensors`` or, with
pipeline parallel, ``model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors`` (what ``save_sharded_state``
writes); else TensorRT-LLM's ``rank{rank}.safetensors``; else, for rank 0 only, every ``*.safetensors``
(an ordinary TP=1 checkpoint). A path to a single ``.safetensors`` file is a TP=1 checkpoint of one file.
Without a manifest, a vLLM rank missing parts is refused: a gap in its part numbers, or fewer parts than another
rank of its stage along with tensor names that rank holds and it does not (:func:`_check_last_part` says what
cannot be told without a manifest).
Ranks are global ranks, numbered as the engine numbers them (:mod:`~gdsload.loader.format.ranks`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable
from typing import NamedTuple
from pathlib import Path

from ..errors import (
    ConfigError,
    FileUnreadableError,
    GdsloadError,
    ManifestError,
    NoFilesForRankError,
    UnfinishedOutputError,
)
from .manifest import MANIFEST_NAME, Manifest, ManifestFile
from .ranks import PP_TP_PATTERN, parse_rank_file, rank_ranges

__all__ = ["RankFiles", "ScannedLayout", "discover", "list_ranks", "scan_layout", "VLLM_PATTERN", "TRTLLM_PATTERN"]

VLLM_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
TRTLLM_PATTERN = "rank{rank}.safetensors"
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
    pp_size: int = 1

    def manifest_entry(self, path: str) -> ManifestFile | None:
        if self.manifest is None:
            return None
        rel = os.path.relpath(path, self.root)
        return next((f for f in self.manifest.ranks[self.rank] if f.path == rel), None)


UNFINISHED_MARKERS = {".gdsload-shard.partial": "shard", ".gdsload-writing": "compress"}
"""Entries a gdsload writer keeps in a directory until its output is complete: such a directory never loads."""


def _kind(p: Path, shown: str) -> str | None:
    """``"file"``, ``"dir"``, ``"other"`` (a FIFO, a socket...) or None when nothing is at ``p`` (links followed);
    :class:`FileUnreadableError` when the question cannot be answered (a directory on the way cannot be searched)."""
    try:
        mode = p.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None
        raise FileUnreadableError(
            e.errno,
            f"{shown!r} cannot be looked up ({e.strerror or e}); check the permissions of the directories on its path",
        ) from None
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "other"


def _lexists(p: Path) -> bool:
    try:
        p.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise FileUnreadableError(
            e.errno,
            f"{str(p)!r} cannot be looked up ({e.strerror or e}); check the permissions of the directories on its path",
        ) from None
    return True


def _safetensors_in(root: Path) -> list[str]:
    try:
        return sorted(
            p.name for p in root.iterdir() if p.suffix == ".safetensors" and not p.name.startswith(".") and p.is_file()
        )
    except OSError as e:
        raise FileUnreadableError(
            e.errno, f"model directory {str(root)!r} cannot be listed ({e.strerror or e}); check its permissions"
        ) from None


class ScannedLayout(NamedTuple):
    """What a model path holds: how its files were found, the parallel sizes, and each rank's files."""

    source: str
    tp_size: int
    pp_size: int
    ep_size: int
    ranks: dict[int, tuple[str, ...]]
    """Global rank -> absolute paths."""
    manifest: Manifest | None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


def list_ranks(path: str | os.PathLike[str]) -> tuple[str, int, dict[int, tuple[str, ...]]]:
    """Every rank a model directory holds: ``(source, number of ranks, {rank: absolute paths})``."""
    scanned = scan_layout(path)
    return scanned.source, scanned.world_size, scanned.ranks


def scan_layout(path: str | os.PathLike[str], *, check: Iterable[int] | None = None) -> ScannedLayout:
    """The layout of a model path (see the module docstring for the order of lookups).

    With a manifest, the files of the ranks in ``check`` (None: every rank) must be there with the sizes it
    records; a node that holds only its own ranks' files checks those.

    >>> scan_layout("/models/mixtral-tp2-pp2")  # doctest: +SKIP
    ScannedLayout(source='manifest', tp_size=2, pp_size=2, ep_size=1, ranks={0: (...), ...}, manifest=...)
    """
    root = Path(path).resolve()
    kind = _kind(root, str(path))
    if kind == "file":
        if root.suffix != ".safetensors":
            raise NoFilesForRankError(f"{str(path)!r} is not a .safetensors file or a model directory")
        return ScannedLayout("plain", 1, 1, 1, {0: (str(root),)}, None)
    if kind != "dir":
        raise NoFilesForRankError(f"model path {str(path)!r} does not exist")
    for marker, command in UNFINISHED_MARKERS.items():
        if _lexists(root / marker):
            raise UnfinishedOutputError(
                f"{str(path)!r} is the output of a `gdsload {command}` run that has not finished ({marker} is there): "
                f"it is still running, or it was stopped; rerun the same `gdsload {command}` command to finish it "
                "(finished files are kept), or delete the directory"
            )

    if _kind(root / MANIFEST_NAME, str(root / MANIFEST_NAME)) is not None:
        manifest = Manifest.read(root)
        files = {r: tuple(str(root / f.path) for f in entries) for r, entries in manifest.ranks.items()}
        for r, entries in manifest.ranks.items():
            if check is not None and r not in check:
                continue
            for f in entries:
                p = root / f.path
                size = p.stat().st_size if _kind(p, str(p)) == "file" else None
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
        return ScannedLayout("manifest", manifest.tp_size, manifest.pp_size, manifest.ep_size, files, manifest)

    names = _safetensors_in(root)
    vllm: dict[tuple[int | None, int], dict[int, str]] = {}
    trt: dict[int, str] = {}
    for name in names:
        if parsed := parse_rank_file(name):
            pp_rank, tp_rank, part = parsed
            vllm.setdefault((pp_rank, tp_rank), {})[part] = str(root / name)
        elif m := _TRTLLM_RE.match(name):
            trt[int(m[1])] = str(root / name)
    if vllm:
        return _vllm_layout(root, vllm)
    if trt:
        return ScannedLayout("trtllm", max(trt) + 1, 1, 1, {r: (p,) for r, p in trt.items()}, None)
    if names:
        return ScannedLayout("plain", 1, 1, 1, {0: tuple(str(root / n) for n in names)}, None)
    raise NoFilesForRankError(f"no .safetensors files under {str(path)!r}")


def _vllm_layout(root: Path, found: dict[tuple[int | None, int], dict[int, str]]) -> ScannedLayout:
    """The ranks of a directory of vLLM ``sharded_state`` files (no manifest)."""
    staged = {pp for pp, _ in found if pp is not None}
    if staged and any(pp is None for pp, _ in found):
        raise NoFilesForRankError(
            f"{str(root)!r} mixes {VLLM_PATTERN!r} and {PP_TP_PATTERN!r} files: two shardings in one directory; "
            "keep one of them"
        )
    tp = max(t for _, t in found) + 1
    pp = max(staged) + 1 if staged else 1
    out: dict[int, tuple[str, ...]] = {}
    for (pp_rank, tp_rank), parts in found.items():
        rank = (pp_rank or 0) * tp + tp_rank
        gaps = sorted(set(range(max(parts) + 1)) - set(parts))
        if gaps:
            pattern = VLLM_PATTERN if pp_rank is None else PP_TP_PATTERN
            raise NoFilesForRankError(
                f"rank {rank} under {str(root)!r} has parts {sorted(parts)} but not {gaps} "
                f"({pattern!r}); the copy is incomplete"
            )
        out[rank] = tuple(parts[p] for p in sorted(parts))
    return ScannedLayout("vllm", tp, pp, 1, out, None)


def discover(path: str | os.PathLike[str], rank: int = 0) -> RankFiles:
    """The files rank ``rank`` loads from ``path`` (a model directory or one .safetensors file).

    >>> discover("/models/llama-tp2", rank=1).files  # doctest: +SKIP
    ('/models/llama-tp2/model-rank-1-part-0.safetensors',)
    """
    if type(rank) is not int or rank < 0:
        raise ConfigError(f"rank must be a non-negative integer, got {rank!r}")
    scanned = scan_layout(path, check=(rank,))
    source, ranks, manifest = scanned.source, scanned.ranks, scanned.manifest
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
            hint = (
                f"rank {rank}'s files are missing although higher ranks are here; the copy is incomplete "
                "(re-copy it), or this host was given only some of the ranks"
            )
        else:
            layout = f"tp={scanned.tp_size}" + (f" x pp={scanned.pp_size}" if scanned.pp_size > 1 else "")
            hint = f"was it sharded for {layout}?"
        raise NoFilesForRankError(
            f"No files for rank {rank} under {str(path)!r} matching {pattern!r}; "
            f"the directory holds rank{'s' if len(ranks) > 1 else ''} {rank_ranges(list(ranks))} — {hint}"
        )
    if source == "vllm":
        _check_last_part(path, scanned, rank)
    return RankFiles(
        root=root_dir,
        rank=rank,
        tp_size=scanned.tp_size,
        source=source,
        files=ranks[rank],
        manifest=manifest,
        pp_size=scanned.pp_size,
    )


def _check_last_part(path: str | os.PathLike[str], scanned: ScannedLayout, rank: int) -> None:
    """Without a manifest, the closest honest check that a vLLM rank's last part is there.

    Gaps in the part numbers are found when the directory is scanned; a missing *last* part leaves none. In
    vLLM's ``sharded_state`` layout every tensor-parallel rank of a pipeline stage holds the same tensor names
    (each its own slice), so when this rank has fewer parts than another rank of its stage, the names in their
    headers are compared: names the other rank holds and this one does not mean this rank's last part(s) are
    missing. What cannot be told without a manifest: the last part missing from every rank of a stage alike
    (or from a single-rank model); a manifest (``gdsload.json``, which gdsload's writers write) lists every
    file with its size.
    """
    from .safetensors import read_header

    tp = scanned.tp_size
    stage = [r for r in range(rank // tp * tp, rank // tp * tp + tp) if r in scanned.ranks]
    mine = scanned.ranks[rank]
    longest = max(stage, key=lambda r: len(scanned.ranks[r]))
    if len(scanned.ranks[longest]) <= len(mine):
        return
    try:
        theirs = {t.name for p in scanned.ranks[longest] for t in read_header(p).tensors}
    except GdsloadError:
        return  # the other rank's files cannot tell (they are damaged themselves): its own load will say so
    held = {t.name for p in mine for t in read_header(p).tensors}
    missing = sorted(theirs - held)
    if missing:
        raise NoFilesForRankError(
            f"rank {rank} under {str(path)!r} has {len(mine)} part(s), rank {longest} of the same pipeline stage has "
            f"{len(scanned.ranks[longest])}, and {len(missing)} tensor(s) rank {longest} holds are in none of rank "
            f"{rank}'s files (e.g. {', '.join(map(repr, missing[:3]))}): its last part is missing — the copy is "
            "incomplete; re-copy the directory (a manifest, gdsload.json, lists every file and its size)"
        )
