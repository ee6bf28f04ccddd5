"""Planning: from validated headers to one arena per rank and the byte ranges that fill it.

The arena is one flat byte buffer. Each file's data section is mirrored into it at a
4096-aligned offset, so a backend fills it with large sequential reads (one extent per file)
and every naturally aligned tensor is a view at ``mirror + tensor.start`` — no per-tensor copy.
A tensor whose offset is not a multiple of its element size (foreign files) cannot be a view
of the mirror; it gets its own aligned slot after the mirrors and is copied there after the
read (``Placement.copy_from``), and the report counts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .discover import RankFiles
from .errors import HeaderError
from .format import DATA_ALIGNMENT, SafetensorsHeader, read_header
from .manifest import logical_bytes

__all__ = ["Extent", "Placement", "FilePlan", "LoadPlan", "plan_rank", "align_up"]

_COPY_ALIGNMENT = 64


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
class FilePlan:
    path: str
    header: SafetensorsHeader
    mirror_offset: int
    extents: tuple[Extent, ...]
    logical_bytes: int
    copied: int
    """Tensors of this file that are copied rather than viewed."""

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
        """Every extent cut into reads of at most ``chunk_bytes``, files interleaved so that
        all of a rank's files are in flight together."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        per_file = []
        for e in self.extents:
            per_file.append(
                [
                    Extent(e.file_index, e.file_offset + off, min(chunk_bytes, e.length - off), e.arena_offset + off)
                    for off in range(0, e.length, chunk_bytes)
                ]
            )
        out: list[Extent] = []
        for i in range(max((len(c) for c in per_file), default=0)):
            out.extend(c[i] for c in per_file if i < len(c))
        return out


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

    cursor = 0
    mirrors = []
    for h in headers:
        cursor = align_up(cursor, DATA_ALIGNMENT)
        mirrors.append(cursor)
        cursor += h.data_len

    files: list[FilePlan] = []
    placements: list[Placement] = []
    for i, (h, mirror) in enumerate(zip(headers, mirrors)):
        extents = (Extent(i, h.data_offset, h.data_len, mirror),) if h.data_len else ()
        copied = 0
        for t in h.tensors:
            if t.start % t.itemsize == 0:
                placements.append(Placement(t.name, t.dtype, t.shape, i, mirror + t.start, t.nbytes))
            else:
                cursor = align_up(cursor, _COPY_ALIGNMENT)
                placements.append(Placement(t.name, t.dtype, t.shape, i, cursor, t.nbytes, copy_from=mirror + t.start))
                cursor += t.nbytes
                copied += 1
        files.append(FilePlan(h.path, h, mirror, extents, logical_bytes(h), copied))
    return LoadPlan(rank=rank_files.rank, files=tuple(files), placements=tuple(placements), arena_bytes=cursor)
