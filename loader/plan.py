"""Planning: from validated headers to one arena per rank and the byte ranges that fill it.

The arena is one flat byte buffer. Each file's data section is mirrored into it at a
4096-aligned offset, so a backend fills it with large sequential reads (one extent per file)
and every naturally aligned tensor is a view at ``mirror + tensor.start`` — no per-tensor copy.
A tensor whose offset is not a multiple of its element size (foreign files) cannot be a view
of the mirror; it gets its own aligned slot after the mirrors and is copied there after the
read (``Placement.copy_from``), and the report counts it.

Compressed files (see :mod:`.compression`) are not mirrored: every tensor gets a 256-byte
aligned slot of its decoded size. Raw tensors of such files are read straight into their slots;
compressed ones are read into a staging buffer and decoded into their slots
(``LoadPlan.compressed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .compression import CompressedEntry, parse_compression
from .discovery import RankFiles
from .errors import HeaderError
from .format import DATA_ALIGNMENT, SafetensorsHeader, read_header
from .manifest import logical_bytes

__all__ = ["Extent", "Placement", "CompressedTensor", "FilePlan", "LoadPlan", "plan_rank", "align_up", "split_extents", "stream_order", "direct_read_order"]

_COPY_ALIGNMENT = 64
_SLOT_ALIGNMENT = 256


def split_extents(extents: Sequence[Extent], chunk_bytes: int, *, interleave: bool = True,
                  aligned: bool = False) -> list[Extent]:
    """Cut extents into reads of at most ``chunk_bytes``.

    With ``interleave`` the files take turns (round-robin), so that all of a rank's files are in
    flight together; without it, one file's reads come after the other's, in file order. With
    ``aligned``, cuts fall on file offsets that are multiples of ``chunk_bytes`` (the first read of
    an extent is shorter), so that only an extent's own ends can be unaligned for O_DIRECT.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    per_file: dict[int, list[Extent]] = {}
    for e in extents:
        first = chunk_bytes - e.file_offset % chunk_bytes if aligned else chunk_bytes
        cuts = [0, *range(first, e.length, chunk_bytes)] if e.length else []
        per_file.setdefault(e.file_index, []).extend(
            Extent(e.file_index, e.file_offset + off, min(e.length, nxt) - off, e.arena_offset + off)
            for off, nxt in zip(cuts, [*cuts[1:], e.length])
        )
    queues = list(per_file.values())
    if not interleave:
        return [c for q in queues for c in q]
    out: list[Extent] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def stream_order(chunks: Sequence[Extent], streams: int) -> list[Extent]:
    """Queue order for ``chunks`` (given in file order) that keeps ``streams`` sequential streams going.

    The chunks are cut into ``streams`` contiguous stripes of about equal count, and the stripes
    take turns. Readers take chunks from the queue in that order, so the disk sees ``streams``
    positions, each moving forward one chunk at a time (as ``streams`` readers of one file each
    would).
    """
    n = len(chunks)
    k = max(1, min(streams, n))
    bounds = [i * n // k for i in range(k + 1)]
    stripes = [chunks[bounds[i] : bounds[i + 1]] for i in range(k)]
    return [s[j] for j in range(max((len(s) for s in stripes), default=0)) for s in stripes if j < len(s)]


def direct_read_order(extents: Sequence[Extent], chunk_bytes: int, streams: int) -> list[Extent]:
    """O_DIRECT reads of a cold rank: cut at ``chunk_bytes``-aligned file offsets, queued as
    ``streams`` sequential streams (what kvikio's thread pool then works through in order)."""
    reads = [e for e in extents if e.length]
    return stream_order(split_extents(reads, chunk_bytes, interleave=False, aligned=True), streams)


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class Extent:
    """A contiguous range of a file that lands contiguously in the arena."""

    file_index: int
    file_offset: int
    length: int
    arena_offset: int


@dataclass(frozen=True)
class Placement:
    """Where one tensor lives in the arena."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file_index: int
    arena_offset: int
    nbytes: int
    copy_from: int | None = None
    """Arena offset of the tensor's raw (misaligned) bytes, copied to ``arena_offset`` after the read."""


@dataclass(frozen=True)
class CompressedTensor:
    """A compressed tensor: its stored bytes go to staging, and decode into ``arena_offset``."""

    file_index: int
    file_offset: int
    """Absolute file offset of the stored (compressed) bytes."""
    arena_offset: int
    entry: CompressedEntry


@dataclass(frozen=True)
class FilePlan:
    path: str
    header: SafetensorsHeader
    mirror_offset: int
    """Arena offset of the mirrored data section (uncompressed files), else -1."""
    extents: tuple[Extent, ...]
    logical_bytes: int
    copied: int
    """Tensors of this file that are copied rather than viewed."""
    compressed: int = 0
    """Tensors of this file that are stored compressed."""

    @property
    def stored_bytes(self) -> int:
        return self.header.data_len


@dataclass(frozen=True)
class LoadPlan:
    """Everything a backend needs: the arena size, what to read where, where each tensor ends up."""

    rank: int
    files: tuple[FilePlan, ...]
    placements: tuple[Placement, ...]
    arena_bytes: int
    compressed: tuple[CompressedTensor, ...] = ()

    @property
    def extents(self) -> list[Extent]:
        return [e for f in self.files for e in f.extents]

    @property
    def stored_bytes(self) -> int:
        return sum(f.stored_bytes for f in self.files)

    @property
    def logical_bytes(self) -> int:
        return sum(f.logical_bytes for f in self.files)

    @property
    def copied(self) -> int:
        return sum(f.copied for f in self.files)

    def chunks(self, chunk_bytes: int) -> list[Extent]:
        """Every direct extent cut into reads of at most ``chunk_bytes`` (see :func:`split_extents`)."""
        return split_extents(self.extents, chunk_bytes)


def plan_rank(rank_files: RankFiles) -> LoadPlan:
    """Read and validate every header of the rank, then lay out the arena.

    Raises :class:`HeaderError` for any malformed header, or a tensor name found in two files,
    before anything is read or allocated.
    """
    headers = [read_header(p) for p in rank_files.files]
    seen: dict[str, str] = {}
    for h in headers:
        for t in h.tensors:
            if t.name in seen:
                raise HeaderError(
                    f"tensor {t.name!r} appears in both {seen[t.name]!r} and {h.path!r}; "
                    "a rank's files must not repeat tensor names"
                )
            seen[t.name] = h.path

    entries = [parse_compression(h) for h in headers]
    files: list[FilePlan | None] = [None] * len(headers)
    placements: list[Placement] = []
    compressed: list[CompressedTensor] = []
    cursor = 0
    # Plain files: mirror the data section, tensors are views of it.
    for i, (h, comp) in enumerate(zip(headers, entries)):
        if comp:
            continue
        cursor = align_up(cursor, DATA_ALIGNMENT)
        mirror = cursor
        cursor += h.data_len
        extents = (Extent(i, h.data_offset, h.data_len, mirror),) if h.data_len else ()
        copied = 0
        for t in h.tensors:
            if t.start % t.itemsize == 0:
                placements.append(Placement(t.name, t.dtype, t.shape, i, mirror + t.start, t.nbytes))
            else:
                copied += 1
                placements.append(Placement(t.name, t.dtype, t.shape, i, -1, t.nbytes, copy_from=mirror + t.start))
        files[i] = FilePlan(h.path, h, mirror, extents, logical_bytes(h), copied)
    # Compressed files: every tensor gets its own aligned slot of its decoded size.
    for i, (h, comp) in enumerate(zip(headers, entries)):
        if not comp:
            continue
        extents_c: list[Extent] = []
        logical = 0
        for t in h.tensors:
            e = comp.get(t.name)
            cursor = align_up(cursor, _SLOT_ALIGNMENT)
            if e is None:
                if t.nbytes:
                    extents_c.append(Extent(i, h.data_offset + t.start, t.nbytes, cursor))
                placements.append(Placement(t.name, t.dtype, t.shape, i, cursor, t.nbytes))
                size = t.nbytes
            else:
                compressed.append(CompressedTensor(i, h.data_offset + t.start, cursor, e))
                placements.append(Placement(t.name, e.dtype, e.shape, i, cursor, e.nbytes))
                size = e.nbytes
            cursor += size
            logical += size
        files[i] = FilePlan(h.path, h, -1, tuple(extents_c), logical, 0, compressed=len(comp))
    # Misaligned tensors of foreign files get their own slots, filled by a copy after the read.
    final: list[Placement] = []
    for p in placements:
        if p.copy_from is not None:
            cursor = align_up(cursor, _COPY_ALIGNMENT)
            p = Placement(p.name, p.dtype, p.shape, p.file_index, cursor, p.nbytes, copy_from=p.copy_from)
            cursor += p.nbytes
        final.append(p)
    assert all(f is not None for f in files)
    return LoadPlan(rank=rank_files.rank, files=tuple(f for f in files if f is not None), placements=tuple(final), arena_bytes=cursor,
                    compressed=tuple(compressed))
