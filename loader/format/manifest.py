"""``gdsload.json``: which files each tensor-parallel rank loads, with sizes and digests.

Example::

    {
      "format": "gdsload-manifest",
      "format_version": 1,
      "tp_size": 2,
      "pp_size": 1,
      "ep_size": 1,
      "layout": "vllm",
      "created_by": "gdsload 0.1.0",
      "ranks": {
        "0": [{"path": "model-rank-0-part-0.safetensors", "bytes": 1052672,
               "stored_bytes": 1048576, "logical_bytes": 1048576, "digest": "blake3:..."}],
        "1": [...]
      },
      "extra": {}
    }

Ranks are global ranks of a tensor × pipeline layout, numbered as the engine numbers them
(:mod:`~gdsload.loader.format.ranks`): ``tp_size * pp_size`` of them; ``ep_size`` (1, or ``tp_size``) says
whether the experts are spread over each stage's ranks. A manifest without ``pp_size`` / ``ep_size`` has 1.
``bytes`` is the file size, ``stored_bytes`` its data section, ``logical_bytes`` what the
tensors occupy once decoded (larger than ``stored_bytes`` for compressed files), ``digest`` the
whole file's ``"blake3:<hex>"`` or ``"sha256:<hex>"`` (:mod:`~gdsload.loader.format.digests`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from ..errors import FileUnreadableError, ManifestError
from . import strict_json
from .atomic import atomic_output
from .safetensors import SafetensorsHeader, open_regular, read_header

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "LAYOUTS",
    "ManifestFile",
    "Manifest",
    "logical_bytes",
    "describe_file",
    "write_manifest",
    "redigest",
]

MANIFEST_NAME = "gdsload.json"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
"""Largest ``gdsload.json`` read (a manifest of a million files is a few hundred MB less)."""
MAX_FILES = 1 << 20
"""Most files a manifest may list, all ranks together."""
MAX_RANKS = 4096
"""More ranks than any deployment has: a manifest claiming more is damaged (refused before any allocation)."""
LAYOUTS = ("vllm", "hf", "trtllm", "plain")


class ManifestFile(NamedTuple):
    """One file of one rank, as recorded in the manifest."""

    path: str
    """Relative to the manifest's directory."""
    bytes: int
    stored_bytes: int
    logical_bytes: int
    digest: str | None = None
    """``"blake3:<hex>"`` or ``"sha256:<hex>"`` of the whole file, or None when not recorded."""


class Manifest(NamedTuple):
    """The parsed ``gdsload.json`` of a model directory."""

    tp_size: int
    layout: str
    ranks: dict[int, tuple[ManifestFile, ...]]
    created_by: str = ""
    extra: Mapping[str, Any] = MappingProxyType({})
    pp_size: int = 1
    ep_size: int = 1

    @property
    def world_size(self) -> int:
        """Ranks in all: ``tp_size * pp_size``."""
        return self.tp_size * self.pp_size

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> Manifest:
        """Parse and validate ``directory/gdsload.json``; raises :class:`ManifestError`, or
        :class:`FileUnreadableError` when it cannot be read (permissions, not a regular file)."""
        path = str(Path(directory) / MANIFEST_NAME)
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
            if size > MAX_MANIFEST_BYTES:
                raise ManifestError(
                    f"{path!r} is {size} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may be; "
                    "it is damaged or not a gdsload manifest: rewrite it (gdsload shard and compress "
                    "write one) or remove it"
                )
            raw = _read_all(fd, path, size)
        finally:
            os.close(fd)
        doc = strict_json.loads(raw, ManifestError, repr(path))
        return cls.from_dict(doc, where=path)

    @classmethod
    def from_dict(cls, doc: Any, *, where: str = MANIFEST_NAME) -> Manifest:
        def bad(msg: str) -> ManifestError:
            return ManifestError(f"{where!r}: {msg}")

        strict_json.check_value(doc, ManifestError, repr(where))  # nesting bounded, before anything walks it
        if not isinstance(doc, dict) or doc.get("format") != "gdsload-manifest":
            raise bad('not a gdsload manifest (missing "format": "gdsload-manifest")')
        version = doc.get("format_version")
        if version != MANIFEST_VERSION:
            raise bad(
                f"format_version {strict_json.brief(version)} is not supported (this gdsload reads "
                f"{MANIFEST_VERSION}); upgrade gdsload"
            )
        sizes = {}
        for key in ("tp_size", "pp_size", "ep_size"):
            value = doc.get(key, 1 if key != "tp_size" else None)
            if type(value) is not int or not 1 <= value <= MAX_RANKS:
                raise bad(f"{key} must be an integer in 1..{MAX_RANKS}, got {strict_json.brief(value)}")
            sizes[key] = value
        tp, pp, ep = sizes["tp_size"], sizes["pp_size"], sizes["ep_size"]
        world = tp * pp
        if world > MAX_RANKS:
            raise bad(f"tp_size={tp} x pp_size={pp} is more than {MAX_RANKS} ranks")
        if ep not in (1, tp):
            raise bad(f"ep_size={ep} must be 1 or tp_size={tp} (experts spread over a stage's tensor-parallel ranks)")
        layout = doc.get("layout")
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise bad(f"layout {strict_json.brief(layout)} is not one of {LAYOUTS}")
        raw_ranks = doc.get("ranks")
        if not isinstance(raw_ranks, dict):
            raise bad("'ranks' must map rank numbers to lists of files")
        ranks: dict[int, tuple[ManifestFile, ...]] = {}
        listed = sum(len(files) for files in raw_ranks.values() if isinstance(files, list))
        if listed > MAX_FILES:
            raise bad(f"the ranks list {listed} files, more than the {MAX_FILES} a manifest may list")
        for key, files in raw_ranks.items():
            if not (isinstance(key, str) and re.fullmatch(r"0|[1-9][0-9]{0,8}", key)) or int(key) >= world:
                raise bad(
                    f"rank key {strict_json.brief(key)} is not a rank in 0..{world - 1} (written without leading zeros)"
                )
            if not isinstance(files, list) or not files:
                raise bad(f"rank {key} must list at least one file")
            entries = []
            for f in files:
                try:
                    entry = ManifestFile(**f)
                except TypeError as e:
                    raise bad(f"rank {key}: file entry {strict_json.brief(f)} is malformed ({e})") from None
                if (
                    not isinstance(entry.path, str)
                    or "\x00" in entry.path
                    or os.path.isabs(entry.path)
                    or ".." in Path(entry.path).parts
                ):
                    raise bad(
                        f"rank {key}: file path {strict_json.brief(entry.path)} must be relative and stay inside "
                        "the directory"
                    )
                for field in ("bytes", "stored_bytes", "logical_bytes"):
                    value = getattr(entry, field)
                    if type(value) is not int or not 0 <= value < 2**63:
                        raise bad(
                            f"rank {key}: file {entry.path!r}: {field} {strict_json.brief(value)} must be an "
                            "integer in [0, 2**63)"
                        )
                if entry.digest is not None and not isinstance(entry.digest, str):
                    raise bad(
                        f"rank {key}: file {entry.path!r}: digest {strict_json.brief(entry.digest)} must be a "
                        "string '<algorithm>:<hex>' (or null: none recorded)"
                    )
                entries.append(entry._replace(path=os.path.normpath(entry.path)))  # "./a" and "a" name one file
            ranks[int(key)] = tuple(entries)
        missing = sorted(set(range(world)) - set(ranks))
        if missing:
            raise bad(
                f"the layout has {world} ranks (tp_size={tp} x pp_size={pp}) but ranks {missing[:8]} have no files"
            )
        extra = doc.get("extra") or {}
        if not isinstance(extra, dict):
            raise bad(f"'extra' must be an object, got {strict_json.brief(extra)}; fix or remove it")
        return cls(
            tp_size=tp,
            layout=layout,
            ranks=ranks,
            created_by=str(doc.get("created_by", "")),
            extra=dict(extra),
            pp_size=pp,
            ep_size=ep,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "gdsload-manifest",
            "format_version": MANIFEST_VERSION,
            "tp_size": self.tp_size,
            **({"pp_size": self.pp_size} if self.pp_size != 1 else {}),
            **({"ep_size": self.ep_size} if self.ep_size != 1 else {}),
            "layout": self.layout,
            "created_by": self.created_by,
            "ranks": {str(r): [f._asdict() for f in files] for r, files in sorted(self.ranks.items())},
            "extra": dict(self.extra),
        }


def _read_all(fd: int, path: str, size: int) -> bytes:
    """Up to ``size`` bytes of ``fd`` from its start; :class:`FileUnreadableError` naming ``path`` on a read error."""
    out = bytearray()
    try:
        while len(out) < size:
            piece = os.pread(fd, size - len(out), len(out))
            if not piece:
                break
            out += piece
    except OSError as e:
        raise FileUnreadableError(e.errno, f"{path!r} cannot be read ({e.strerror or e})") from None
    return bytes(out)


def logical_bytes(header: SafetensorsHeader) -> int:
    """Bytes the file's tensors occupy once decoded."""
    from .compression import parse_compression

    compressed = parse_compression(header)
    return sum(compressed[t.name].nbytes if t.name in compressed else t.nbytes for t in header.tensors)


def describe_file(
    directory: str | os.PathLike[str], relpath: str, *, digest: bool | str = True, known_digest: str | None = None
) -> ManifestFile:
    """Build the manifest entry of an existing file (reads its header, and its bytes for the digest
    unless ``known_digest``, the one its writer computed, is given and of the algorithm asked for).
    ``digest``: True or ``"blake3"``, ``"sha256"``, or False for none."""
    from . import digests  # here: a load imports no hashing

    full = Path(directory) / relpath
    header = read_header(full)
    algorithm = digests.digest_algorithm(digest)
    return ManifestFile(
        path=relpath,
        bytes=header.file_size,
        stored_bytes=header.data_len,
        logical_bytes=logical_bytes(header),
        digest=(
            known_digest
            if known_digest and known_digest.startswith(f"{algorithm}:")
            else digests.file_digest(full, algorithm)
        )
        if algorithm
        else None,
    )


_HASH_THREADS = 8
"""Files hashed at once, at most."""


def _describe_all(
    directory: str | os.PathLike[str],
    ranks: Mapping[int, Iterable[str]],
    *,
    digest: bool | str,
    known: Mapping[str, str],
) -> dict[int, tuple[ManifestFile, ...]]:
    """:func:`describe_file` of every rank's files, those without a ``known`` digest hashed up to a file per
    core at once (the hashes let go of the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    listed = {r: list(paths) for r, paths in ranks.items()}
    every = [p for paths in listed.values() for p in paths]
    with ThreadPoolExecutor(max(1, min(len(every), os.cpu_count() or 1, _HASH_THREADS))) as pool:
        described = dict(
            zip(every, pool.map(lambda p: describe_file(directory, p, digest=digest, known_digest=known.get(p)), every))
        )
    return {r: tuple(described[p] for p in paths) for r, paths in listed.items()}


def write_manifest(
    directory: str | os.PathLike[str],
    ranks: Mapping[int, Iterable[str]],
    *,
    tp_size: int,
    layout: str,
    extra: Mapping[str, Any] | None = None,
    digest: bool | str = True,
    digests: Mapping[str, str] | None = None,
    pp_size: int = 1,
    ep_size: int = 1,
) -> Manifest:
    """Describe the files of every rank and write ``directory/gdsload.json`` atomically.

    With ``digest`` (True: blake3; or ``"sha256"``), each file's digest is taken from ``digests`` (relative
    path -> ``"<algorithm>:<hex>"``, as :class:`~.writer.AlignedWriter` computes while writing) or else
    read from the file.

    >>> write_manifest("out", {0: ["model-rank-0-part-0.safetensors"]}, tp_size=1, layout="hf")  # doctest: +SKIP
    """
    from ..version import __version__

    manifest = Manifest(
        tp_size=tp_size,
        layout=layout,
        ranks=_describe_all(directory, ranks, digest=digest, known=digests or {}),
        created_by=f"gdsload {__version__}",
        extra=dict(extra or {}),
        pp_size=pp_size,
        ep_size=ep_size,
    )
    Manifest.from_dict(manifest.to_dict())  # validate what we are about to write
    with atomic_output(Path(directory) / MANIFEST_NAME) as f:
        f.write(json.dumps(manifest.to_dict(), indent=2).encode("utf-8") + b"\n")
    return manifest


def redigest(directory: str | os.PathLike[str], digest: bool | str = True) -> bool:
    """Rewrite ``directory``'s manifest when the digests it records are not the kind ``digest`` asks for (True or
    ``"blake3"``, ``"sha256"``, False for none), hashing its files; True when it did. What else the manifest
    says is kept.

    >>> redigest("llama3-tp2", "sha256")  # doctest: +SKIP
    True
    """
    from .digests import digest_algorithm

    algorithm = digest_algorithm(digest)
    manifest = Manifest.read(directory)
    recorded = [f.digest for files in manifest.ranks.values() for f in files]
    if all(d is None if algorithm is None else (d or "").startswith(f"{algorithm}:") for d in recorded):
        return False
    write_manifest(
        directory,
        {r: [f.path for f in files] for r, files in manifest.ranks.items()},
        tp_size=manifest.tp_size,
        layout=manifest.layout,
        extra=manifest.extra,
        digest=digest,
        pp_size=manifest.pp_size,
        ep_size=manifest.ep_size,
    )
    return True
