"""Planning: from validated headers to one arena per rank and the byte ranges that fill it.

The arena is one flat byte buffer. Each file's data section is mirrored into it at a
4096-aligned offset, so a backend fills it with large sequential reads (one extent per file)
and every naturally aligned tensor is a view at ``mirror + tensor.start`` — no per-tensor copy.

A caller may give destinations of its own (``targets``: an engine's parameters, a training
checkpoint's tensors): those tensors are read, or decoded, straight into them and take no arena
space; the rest of such a file is read in runs of neighbouring tensors. Extents and placements
name their buffer: 0 is the arena, ``i`` the ``i``-th target.
A tensor whose offset is not a multiple of its element size (foreign files) cannot be a view
of the mirror; it gets its own aligned slot after the mirrors and is copied there after the
read (``Placement.copy_from``), and the report counts it.

Compressed files (see :mod:`.compression`) are not mirrored: every tensor gets a 256-byte
aligned slot of its decoded size. Raw tensors of such files are read straight into their slots;
compressed ones are read into a staging buffer and decoded into their slots
(``LoadPlan.compressed``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from .format.compression import CompressedEntry, parse_compression
from .format.discovery import RankFiles
from .errors import FileUnreadableError, GdsloadError, HeaderError
from .format.safetensors import DATA_ALIGNMENT, SafetensorsHeader, TensorInfo, read_header
from .format.manifest import logical_bytes

__all__ = [
    "Extent",
    "Placement",
    "CompressedTensor",
    "FilePlan",
    "LoadPlan",
    "PlanError",
    "TensorMeta",
    "rank_index",
    "open_file",
    "fd_path",
    "plan_rank",
    "align_up",
    "landing_groups",
    "LANDING_GROUPS",
    "LANDING_MIN_BYTES",
    "split_extents",
    "stream_order",
    "direct_read_order",
]

MAX_ARENA_BYTES = 1 << 62
"""A rank whose tensors add up to this much is refused at planning (sizes stay far from 64-bit overflow)."""
_COPY_ALIGNMENT = 64
_SLOT_ALIGNMENT = 256


def split_extents(
    extents: Sequence[Extent], chunk_bytes: int, *, interleave: bool = True, aligned: bool = False
) -> list[Extent]:
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
            Extent(e.file_index, e.file_offset + off, min(e.length, nxt) - off, e.offset + off, e.buffer)
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


LANDING_GROUPS = 16
"""Groups a rank is read in when a GPU checks each as it lands: the last group's check is what is left after
the last copy."""
LANDING_MIN_BYTES = 64 << 20
"""No landing group is smaller (a small rank is read in fewer groups, or one)."""


def landing_groups(
    extents: Sequence[Extent], groups: int | None = None, min_bytes: int | None = None
) -> list[list[Extent]]:
    """Cut ``extents`` (in their order) into at most ``groups`` consecutive groups of about equal bytes, none
    smaller than ``min_bytes`` (but the last), cutting an extent where a boundary falls inside it (by default
    :data:`LANDING_GROUPS` and :data:`LANDING_MIN_BYTES`).

    A load that checks its bytes on a GPU reads the groups all at once and checks each group's tensors as soon
    as that group has landed, while the later groups are still being read.
    """
    groups = LANDING_GROUPS if groups is None else groups
    min_bytes = LANDING_MIN_BYTES if min_bytes is None else min_bytes
    reads = [e for e in extents if e.length]
    total = sum(e.length for e in reads)
    k = max(1, min(groups, total // max(min_bytes, 1)))
    size = -(-total // k) if total else 0
    out: list[list[Extent]] = [[]]
    room = size
    for e in reads:
        at = 0
        while at < e.length:
            if room == 0:
                out.append([])
                room = size
            n = min(room, e.length - at)
            out[-1].append(Extent(e.file_index, e.file_offset + at, n, e.offset + at, e.buffer))
            at += n
            room -= n
    return [g for g in out if g]


def direct_read_order(extents: Sequence[Extent], chunk_bytes: int, streams: int) -> list[Extent]:
    """O_DIRECT reads of a cold rank: cut at ``chunk_bytes``-aligned file offsets, queued as
    ``streams`` sequential streams (what kvikio's thread pool then works through in order)."""
    reads = [e for e in extents if e.length]
    return stream_order(split_extents(reads, chunk_bytes, interleave=False, aligned=True), streams)


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class Extent(NamedTuple):
    """A contiguous range of a file that lands contiguously in one destination buffer."""

    file_index: int
    file_offset: int
    length: int
    offset: int
    """Byte offset in the destination buffer."""
    buffer: int = 0
    """Which destination: 0 the arena (or a staging buffer), ``i`` the caller's ``i``-th target (``LoadPlan.targets``)."""


class Placement(NamedTuple):
    """Where one tensor ends up: a place in the arena, or the whole of a caller's target."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file_index: int
    offset: int
    nbytes: int
    copy_from: int | None = None
    """Arena offset of the tensor's raw (misaligned) bytes, copied to ``offset`` after the read."""
    buffer: int = 0
    """0: the arena; ``i``: the caller's ``i``-th target."""


class CompressedTensor(NamedTuple):
    """A compressed tensor: its stored bytes go to staging, and decode into its placement."""

    file_index: int
    file_offset: int
    """Absolute file offset of the stored (compressed) bytes."""
    offset: int
    entry: CompressedEntry
    buffer: int = 0


class FilePlan(NamedTuple):
    path: str
    header: SafetensorsHeader
    mirror_offset: int
    """Arena offset of the mirrored data section (uncompressed files read whole), else -1."""
    extents: tuple[Extent, ...]
    logical_bytes: int
    copied: int
    """Tensors of this file that are copied rather than viewed."""
    compressed: int = 0
    """Tensors of this file that are stored compressed."""

    @property
    def stored_bytes(self) -> int:
        return self.header.data_len


class LoadPlan(NamedTuple):
    """Everything a backend needs: the arena size, what to read where, where each tensor ends up."""

    rank: int
    files: tuple[FilePlan, ...]
    placements: tuple[Placement, ...]
    arena_bytes: int
    compressed: tuple[CompressedTensor, ...] = ()
    targets: tuple[str, ...] = ()
    """Tensors read into buffers the caller provides (``into``), in buffer order: ``targets[i - 1]`` is buffer ``i``."""
    mapped: tuple[int, ...] = ()
    """Files whose mapping holds their tensors (a mapping backend), in buffer order after the targets:
    file ``mapped[k]`` is buffer ``1 + len(targets) + k``."""
    fds: tuple[int, ...] = ()
    """A read-only descriptor per file, opened when the headers were read: backends read through these
    (or :func:`fd_path`), so the data is that of the files the headers described."""
    owned: list[bool] | tuple[bool, ...] = ()
    """Which of ``fds`` the plan opened (and :meth:`close` closes); the others are the caller's. ``plan_rank``
    makes it a list, which :meth:`close` clears, the one field that changes (a tuple cannot be cleared: such a
    plan closes its descriptors at each :meth:`close`)."""

    @property
    def open_paths(self) -> list[str]:
        """A path per file that opens the very file the plan holds (see :func:`fd_path`)."""
        return [fd_path(fd) for fd in self.fds]

    def close(self) -> None:
        """Close the descriptors the plan opened (idempotent)."""
        for i, (fd, mine) in enumerate(zip(self.fds, self.owned)):
            if mine:
                if isinstance(self.owned, list):
                    self.owned[i] = False
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __enter__(self) -> LoadPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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


class PlanError(GdsloadError, ValueError):
    """A destination the caller gave does not fit the tensor it is for, or names no tensor of the rank."""


class TensorMeta(NamedTuple):
    """What a rank's file says of one tensor, before any data is read (its decoded dtype and shape)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    path: str
    compressed: bool = False


def open_file(path: str, confine: Sequence[str] | None = None) -> int:
    """Open one of a rank's files for reading; :class:`FileUnreadableError` naming it and the fix.

    With ``confine``, the open itself stays inside those directories
    (:func:`~gdsload.loader.format.confine.open_beneath`).
    """
    if confine:
        from .format.confine import open_beneath  # only confined loads (the sidecar's) need it

        fd = open_beneath(path, confine)
    else:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise FileUnreadableError(
                f"{path!r} cannot be opened ({e.strerror or e}); check that it exists and this user may read it"
            ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileUnreadableError(f"{path!r} is not a regular file; point the load at safetensors files")
    return fd


def fd_path(fd: int) -> str:
    """A path that opens the very file ``fd`` is open on (for libraries that take a path), even after a rename."""
    return f"/proc/self/fd/{fd}"


def _open_all(
    rank_files: RankFiles, opened: Mapping[str, int] | None, confine: Sequence[str] | None = None
) -> tuple[list[int], list[bool]]:
    """A descriptor per file (the caller's, where given): ``(fds, owned)``; on failure nothing stays open."""
    fds: list[int] = []
    owned: list[bool] = []
    try:
        for p in rank_files.files:
            if opened and p in opened:
                fds.append(opened[p])
                owned.append(False)
            else:
                fds.append(open_file(p, confine))
                owned.append(True)
    except BaseException:
        for fd, mine in zip(fds, owned):
            if mine:
                os.close(fd)
        raise
    return fds, owned


def _read_headers(rank_files: RankFiles, fds: Sequence[int]) -> list[SafetensorsHeader]:
    headers = []
    for p, fd in zip(rank_files.files, fds):
        with os.fdopen(fd, "rb", closefd=False) as f:
            headers.append(read_header(p, file=f))
    seen: dict[str, str] = {}
    for h in headers:
        for t in h.tensors:
            if t.name in seen:
                raise HeaderError(
                    f"tensor {t.name!r} appears in both {seen[t.name]!r} and {h.path!r}; "
                    "a rank's files must not repeat tensor names"
                )
            seen[t.name] = h.path
    return headers


def rank_index(rank_files: RankFiles) -> dict[str, TensorMeta]:
    """Every tensor of the rank, from its validated headers (compressed tensors as they decode); reads no data.

    >>> rank_index(discover("/models/llama-tp2", 1))["lm_head.weight"].shape  # doctest: +SKIP
    (64128, 4096)
    """
    out: dict[str, TensorMeta] = {}
    fds, owned = _open_all(rank_files, None)
    try:
        headers = _read_headers(rank_files, fds)
    finally:
        for fd in fds:
            os.close(fd)
    for h in headers:
        comp = parse_compression(h)
        for t in h.tensors:
            e = comp.get(t.name)
            out[t.name] = (
                TensorMeta(t.name, t.dtype, t.shape, t.nbytes, h.path)
                if e is None
                else TensorMeta(t.name, e.dtype, e.shape, e.nbytes, h.path, True)
            )
    return out


def plan_rank(
    rank_files: RankFiles,
    *,
    targets: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    only: Collection[str] | None = None,
    map_files: bool = False,
    opened: Mapping[str, int] | None = None,
    confine: Sequence[str] | None = None,
) -> LoadPlan:
    """Read and validate every header of the rank, then lay out the arena and the reads.

    ``targets`` maps tensor names to the ``(dtype, shape)`` of a buffer the caller provides:
    those tensors are read (or decoded) straight into it and take no arena space. With ``only``,
    every other tensor is left unread. With ``map_files`` (a backend that maps files into memory),
    the tensors of uncompressed files are views of their file's mapping (``LoadPlan.mapped``),
    except those not aligned for their dtype there, which are read into the arena.

    Every file is opened once, here, and the plan holds the descriptors until :meth:`LoadPlan.close`:
    the headers and the data come from the same files even when a path is replaced or removed
    meanwhile. ``opened`` gives descriptors the caller already holds for some of the paths (they
    stay the caller's to close); with ``confine``, every open stays inside those directories. Raises :class:`FileUnreadableError` for a file that cannot be opened, :class:`HeaderError` for any malformed header, or a
    tensor name found in two files, and :class:`PlanError` for a target that does not fit, before
    anything is read or allocated.
    """
    fds, owned = _open_all(rank_files, opened, confine)
    try:
        return _plan(rank_files, fds, owned, targets, only, map_files)
    except BaseException:
        for fd, mine in zip(fds, owned):
            if mine:
                os.close(fd)
        raise


def _plan(
    rank_files: RankFiles,
    fds: list[int],
    owned: list[bool],
    targets: Mapping[str, tuple[str, tuple[int, ...]]] | None,
    only: Collection[str] | None,
    map_files: bool,
) -> LoadPlan:
    headers = _read_headers(rank_files, fds)
    seen = {t.name for h in headers for t in h.tensors}
    targets = dict(targets or {})
    wanted = None if only is None else set(only) | set(targets)
    unknown = sorted(n for n in (wanted or targets) if n not in seen)
    if unknown:
        raise PlanError(
            f"{len(unknown)} requested tensor(s) are not in rank {rank_files.rank} under "
            f"{str(rank_files.root)!r}: {', '.join(map(repr, unknown[:8]))}; "
            "ask only for names the rank's files hold"
        )
    order = list(targets)
    buffer_of = {name: i + 1 for i, name in enumerate(order)}
    entries = [parse_compression(h) for h in headers]

    def check_target(name: str, dtype: str, shape: tuple[int, ...], path: str) -> None:
        want = targets[name]
        if (want[0], tuple(want[1])) != (dtype, tuple(shape)):
            raise PlanError(
                f"{path!r}: tensor {name!r} is {dtype}{list(shape)} but its destination is "
                f"{want[0]}{list(want[1])}; give a destination of the tensor's own dtype and shape "
                "(or leave the tensor out of `into` and copy it)"
            )

    files: list[FilePlan | None] = [None] * len(headers)
    placements: list[Placement] = []
    compressed: list[CompressedTensor] = []
    mapped: list[int] = []
    cursor = 0
    for i, (h, comp) in enumerate(zip(headers, entries)):
        if comp:
            continue
        logical = logical_bytes(h)
        if map_files:
            buf = 1 + len(order) + len(mapped)
            mapped.append(i)
            extents_m: list[Extent] = []
            logical = copied_m = 0
            mine = len(placements)
            for t in h.tensors:
                if wanted is not None and t.name not in wanted:
                    continue
                logical += t.nbytes
                at = h.data_offset + t.start
                if t.name in buffer_of:
                    check_target(t.name, t.dtype, t.shape, h.path)
                    if t.nbytes:
                        extents_m.append(Extent(i, at, t.nbytes, 0, buffer_of[t.name]))
                    placements.append(Placement(t.name, t.dtype, t.shape, i, 0, t.nbytes, buffer=buffer_of[t.name]))
                elif at % t.itemsize == 0:
                    placements.append(Placement(t.name, t.dtype, t.shape, i, at, t.nbytes, buffer=buf))
                else:  # not aligned in the mapping: read into an aligned arena slot
                    copied_m += 1
                    cursor = align_up(cursor, _COPY_ALIGNMENT)
                    if t.nbytes:
                        extents_m.append(Extent(i, at, t.nbytes, cursor))
                    placements.append(Placement(t.name, t.dtype, t.shape, i, cursor, t.nbytes))
                    cursor += t.nbytes
            if not any(p.buffer == buf for p in placements[mine:]):
                mapped.pop()  # no tensor views this file (all read into targets, or left out): nothing to map
            files[i] = FilePlan(h.path, h, -1, tuple(extents_m), logical, copied_m)
            continue
        if wanted is None and not any(t.name in buffer_of for t in h.tensors):
            # The whole data section is mirrored into the arena: one sequential read, tensors are views.
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
            files[i] = FilePlan(h.path, h, mirror, extents, logical, copied)
            continue
        # Targets read into their own buffers; the tensors left for the arena are read in runs of
        # neighbours, each run placed at its file offset modulo 4096 (so each tensor stays aligned).
        extents_t: list[Extent] = []
        run: list[TensorInfo] = []
        copied = 0
        logical = 0

        def flush_run() -> None:
            nonlocal cursor, copied
            if not run:
                return
            start = run[0].start
            cursor = align_up(cursor, DATA_ALIGNMENT) + start % DATA_ALIGNMENT
            base = cursor
            length = run[-1].start + run[-1].nbytes - start
            if length:
                extents_t.append(Extent(i, h.data_offset + start, length, base))
            for t in run:
                at = base + t.start - start
                if t.start % t.itemsize == 0:
                    placements.append(Placement(t.name, t.dtype, t.shape, i, at, t.nbytes))
                else:
                    copied += 1
                    placements.append(Placement(t.name, t.dtype, t.shape, i, -1, t.nbytes, copy_from=at))
            cursor = base + length
            run.clear()

        for t in sorted(h.tensors, key=lambda t: t.start):
            if wanted is not None and t.name not in wanted:
                flush_run()
                continue
            logical += t.nbytes
            if t.name in buffer_of:
                flush_run()
                check_target(t.name, t.dtype, t.shape, h.path)
                if t.nbytes:
                    extents_t.append(Extent(i, h.data_offset + t.start, t.nbytes, 0, buffer_of[t.name]))
                placements.append(Placement(t.name, t.dtype, t.shape, i, 0, t.nbytes, buffer=buffer_of[t.name]))
                continue
            if run and run[-1].start + run[-1].nbytes != t.start:
                flush_run()
            run.append(t)
        flush_run()
        files[i] = FilePlan(h.path, h, -1, tuple(extents_t), logical, copied)
    # Compressed files: every tensor gets its own aligned slot of its decoded size (or its target).
    for i, (h, comp) in enumerate(zip(headers, entries)):
        if not comp:
            continue
        extents_c: list[Extent] = []
        logical = 0
        for t in h.tensors:
            if wanted is not None and t.name not in wanted:
                continue
            e = comp.get(t.name)
            dtype, shape, size = (t.dtype, t.shape, t.nbytes) if e is None else (e.dtype, e.shape, e.nbytes)
            if t.name in buffer_of:
                check_target(t.name, dtype, shape, h.path)
                buf, at = buffer_of[t.name], 0
            else:
                cursor = align_up(cursor, _SLOT_ALIGNMENT)
                buf, at = 0, cursor
                cursor += size
            if e is None:
                if t.nbytes:
                    extents_c.append(Extent(i, h.data_offset + t.start, t.nbytes, at, buf))
            else:
                compressed.append(CompressedTensor(i, h.data_offset + t.start, at, e, buf))
            placements.append(Placement(t.name, dtype, shape, i, at, size, buffer=buf))
            logical += size
        files[i] = FilePlan(h.path, h, -1, tuple(extents_c), logical, 0, compressed=len(comp))
    # Misaligned tensors of foreign files get their own slots, filled by a copy after the read.
    final: list[Placement] = []
    for p in placements:
        if p.copy_from is not None:
            cursor = align_up(cursor, _COPY_ALIGNMENT)
            p = p._replace(offset=cursor)
            cursor += p.nbytes
        final.append(p)
    assert all(f is not None for f in files)
    if cursor >= MAX_ARENA_BYTES:
        raise HeaderError(
            f"rank {rank_files.rank} under {str(rank_files.root)!r}: its tensors add up to {cursor} bytes, "
            f"more than any device holds (2**62 or more); the headers of {', '.join(repr(h.path) for h in headers[:3])} "
            "are damaged"
        )
    return LoadPlan(
        rank=rank_files.rank,
        files=tuple(f for f in files if f is not None),
        placements=tuple(final),
        arena_bytes=cursor,
        compressed=tuple(compressed),
        targets=tuple(order),
        mapped=tuple(mapped),
        fds=tuple(fds),
        owned=list(owned),
    )
