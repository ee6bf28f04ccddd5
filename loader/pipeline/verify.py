"""The verify phase: each loaded tensor checked against the checksum its file records, on the bytes that were loaded.

Files gdsload writes record the CRC-32 of every tensor (:mod:`gdsload.loader.format.checksums`); compressed
tensors also record the CRC-32 of their decoded bytes, which the decode stage checks. What is checked, where:

- on the CPU, **beside the read**: a reader that reports each finished read (:attr:`Backend.on_chunk`) has the
  CRC of each tensor's pieces computed by the thread that read them (or, the ``mmap`` reader, mapped them in),
  in file order, while the other threads read on; whatever no read reported is checked once the reads are done;
- on a GPU, **as the bytes land**: a reader whose waits return once the copies are complete has the rank read
  in groups, all in flight at once (:func:`~gdsload.loader.plan.landing_groups`), and as each group lands,
  nvCOMP's CRC kernel checks the tensors it completed, on a stream of its own, while the later groups are
  still being read; with other readers, one batch after the last copy. Either way the results come back
  once, at the end (without nvCOMP's library: from host copies, which costs a copy of the rank).

``verify`` is ``None`` by default: every recorded checksum is checked. ``True`` asks for more: each file's
whole-file manifest digest is also computed over the loaded bytes (the header as parsed, the data section as
loaded: on a GPU, copied back to the host for it), and a load that leaves any tensor unchecked fails with
:class:`IntegrityError` instead of reporting ``verified=False``. ``False`` checks nothing beyond what a codec checks by itself. No path is ever read again
to verify: a file replaced during the load cannot make it look verified.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import IntegrityError
from ..format.checksums import crc32, parse_checksums, require

if TYPE_CHECKING:
    from ..devices import Device
    from ..format.discovery import RankFiles
    from ..plan import Extent, LoadPlan

__all__ = ["Check", "Verifier", "VerifyOutcome"]

log = logging.getLogger(__name__)

_HOST_PIECE = 64 << 20
"""Bytes checked per task when a tensor's bytes are checked after the read (a large tensor in pieces)."""


class Check(NamedTuple):
    """One tensor to check: where its loaded bytes lie (``buffer``, ``offset``, ``nbytes``) and the CRC-32 its
    file records for them (of the tensor's table entry, or, ``decoded``, of a compressed tensor's own entry)."""

    name: str
    file_index: int
    buffer: int
    offset: int
    nbytes: int
    expected: int
    decoded: bool = False


class VerifyOutcome(NamedTuple):
    """What the verify phase found: whether every loaded tensor was checked, and how."""

    verified: bool
    checked: list[int]
    """Per file of the plan, its tensors checked (by a checksum, a decoded-bytes CRC, or its whole-file digest)."""
    how: list[str]
    """Per file, what checked it (``""``: nothing)."""
    summary: dict[str, Any]


class _Progress:
    """A tensor checked beside the read: its CRC so far over its first ``at`` bytes, and the pieces read beyond."""

    __slots__ = ("lock", "at", "crc", "ready", "draining")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at = 0
        self.crc = 0
        self.ready: dict[int, int] = {}
        """Pieces read but not yet folded in: start (relative to the tensor) -> length."""
        self.draining = False


class Verifier:
    """The checks of one load: built from its plan before any read, fed finished reads (:meth:`on_chunk`), and
    finished (:meth:`finish`) once every byte is in place."""

    def __init__(self, plan: LoadPlan, rank_files: RankFiles, mode: bool | None) -> None:
        require()
        self.plan, self.rank_files, self.mode = plan, rank_files, mode
        self.checks: list[Check] = []
        self.decoded = [0] * len(plan.files)
        """Per file, compressed tensors the decode stage checks against their ``crc32``."""
        self.loaded = [0] * len(plan.files)
        """Per file, tensors the load hands out."""
        compressed = {(t.file_index, t.entry.name): t for t in plan.compressed}
        tables = [parse_checksums(f.header) for f in plan.files]
        for p in plan.placements:
            self.loaded[p.file_index] += 1
            table = tables[p.file_index]
            packed = compressed.get((p.file_index, p.name))
            if packed is not None and packed.entry.crc32 is not None:
                if packed.entry.layout == "chunks":
                    self.decoded[p.file_index] += 1  # the decode stage checks these (verify is on)
                else:  # nvCOMP's own container: its decoded bytes are checked here
                    self.checks.append(
                        Check(p.name, p.file_index, p.buffer, p.offset, p.nbytes, packed.entry.crc32, decoded=True)
                    )
                continue
            if table is None or p.name not in table:
                continue
            # Where its bytes were read (a misaligned tensor's raw copy stays there after its move).
            offset = p.copy_from if p.copy_from is not None else p.offset
            self.checks.append(Check(p.name, p.file_index, p.buffer, offset, p.nbytes, table[p.name]))
        self._decoded_here = {(t.file_index, t.entry.name) for t in plan.compressed}
        """Compressed tensors: their bytes are written by the decoder, not by reads (checked at the end)."""
        first_mapped = 1 + len(plan.targets)
        self._mapped = {first_mapped + k: plan.files[i].path for k, i in enumerate(plan.mapped)}
        """Buffers that are files' mappings (a mapping reader), and the files: read only through
        :func:`~gdsload.loader.io.mmap.mapped_pieces`, where a truncated file is an error and not SIGBUS."""
        self._addresses: list[int] = []
        self._views: list[memoryview] | None = None
        self._index: dict[int, tuple[list[int], list[int]]] = {}
        """Per buffer: the checks lying in it, by start offset (their starts, and their indices)."""
        self._warming: threading.Thread | None = None
        self._progress = [_Progress() for _ in self.checks]
        self._got: list[int | None] = [None] * len(self.checks)
        # On a GPU, checked as the bytes land (attach_device):
        self._device: Device | None = None
        self._dsts: Sequence[Any] = ()
        self._left: list[int] = []
        """Per check, its bytes not landed yet."""
        self._table: tuple[Any, int, int] | None = None
        """The checks' device tables, allocated once for every group's CRC results (:meth:`attach_device`)."""
        self._ready: list[int] = []
        """Checks whose bytes have all landed, not launched yet."""
        self._launched: list[int] = []
        """Checks whose CRC-32 is queued on the device, in launch order."""
        self._gpu: tuple[Any, Any] | None = None
        """The check stream's codecs and their CRC batches (None before the first launch)."""
        self._no_gpu_crc = False
        self.checked_as_landed = 0
        """Tensors whose check was launched while later groups were still being read."""

    def warm_up(self, device: Device) -> None:
        """On a GPU: import the codecs and load nvCOMP's library on a thread of its own while the reads run (a
        plain load would otherwise pay for them after its last read). The reads do not wait for it: they run
        in the reader's threads, without the GIL."""
        if device.kind == "cpu" or not any(c.nbytes for c in self.checks):
            return

        def load() -> None:
            try:
                from ..codecs.nvcomp_c import library_unavailable

                from .. import codecs  # noqa: F401

                library_unavailable()
            except Exception as e:  # finish() meets the same failure, and says what it means there
                log.debug("nvCOMP not loaded ahead of the check: %s", e)

        self._warming = threading.Thread(target=load, name="gdsload-verify-warm", daemon=True)
        self._warming.start()

    # ------------------------------------------------------------------------------------ beside the read

    def attach(self, device: Device, dsts: Sequence[Any]) -> None:
        """Check on the CPU, beside the reads into ``dsts`` (host buffers): :meth:`on_chunk` may be called."""
        self._views = [device.host_memoryview(d) for d in dsts]
        self._addresses = [device.address(d) if k in self._mapped else 0 for k, d in enumerate(dsts)]
        self._build_index()

    def _build_index(self) -> None:
        by_buffer: dict[int, list[tuple[int, int]]] = {}
        for i, c in enumerate(self.checks):
            if not c.nbytes:
                self._got[i] = 0
            elif (c.file_index, c.name) not in self._decoded_here:
                by_buffer.setdefault(c.buffer, []).append((c.offset, i))
        for k, items in by_buffer.items():
            items.sort()
            self._index[k] = ([o for o, _ in items], [i for _, i in items])

    def _overlaps(self, buffer: int, offset: int, length: int) -> Iterator[tuple[int, int, int]]:
        """The checks bytes ``offset:offset+length`` of ``dsts[buffer]`` belong to: (check, start within it, length)."""
        index = self._index.get(buffer)
        if index is None:
            return
        starts, ids = index
        end = offset + length
        k = max(bisect.bisect_right(starts, offset) - 1, 0)
        while k < len(starts) and starts[k] < end:
            c = self.checks[ids[k]]
            a, b = max(offset, c.offset), min(end, c.offset + c.nbytes)
            if a < b:
                yield ids[k], a - c.offset, b - a
            k += 1

    def on_chunk(self, buffer: int, offset: int, length: int) -> None:
        """Bytes ``offset:offset+length`` of ``dsts[buffer]`` are read: fold them into the CRC of the tensors they
        belong to, where they continue what is folded already (else they wait for the bytes before them)."""
        if self._views is None:
            return
        for i, start, n in self._overlaps(buffer, offset, length):
            self._piece(i, start, n)

    def _piece(self, i: int, start: int, length: int) -> None:
        st = self._progress[i]
        with st.lock:
            st.ready[start] = length
            if st.draining:
                return  # the thread folding this tensor in takes this piece when it gets to it
            st.draining = True
        c = self.checks[i]
        assert self._views is not None
        view = self._views[c.buffer]
        while True:
            with st.lock:
                n = st.ready.pop(st.at, None)
                if n is None:
                    st.draining = False
                    return
                at, crc = st.at, st.crc
            crc = crc32(view[c.offset + at : c.offset + at + n], crc)  # unlocked: only the drainer folds
            with st.lock:
                st.crc, st.at = crc, at + n
                if st.at == c.nbytes:
                    self._got[i] = crc

    # ---------------------------------------------------------------------------------- as the bytes land

    def attach_device(self, device: Device, dsts: Sequence[Any]) -> None:
        """Check on a GPU as groups of reads into ``dsts`` land: :meth:`on_landed` may be called.

        The device memory of the checks' tables, and their stream, are made here, once, and not batch by batch
        between the checks' launches while the reads' copies run on other streams."""
        from ..codecs.nvcomp_c import CrcBatches
        from ..plan import LANDING_GROUPS

        self._device, self._dsts = device, dsts
        self._build_index()
        self._left = [c.nbytes for c in self.checks]
        device.stream(1)  # the check stream, kept per device: made now, once
        nbytes = CrcBatches.table_bytes([c.nbytes for c in self.checks], LANDING_GROUPS + 2)
        table = device.empty(nbytes)
        self._table = (table, device.address(table), nbytes)

    def on_landed(self, extents: Sequence[Extent]) -> None:
        """``extents`` are at their destinations (the copies complete): launch the CRC-32 of every tensor whose
        last bytes they were, on the check stream, and return without waiting for it."""
        for e in extents:
            for i, _, n in self._overlaps(e.buffer, e.offset, e.length):
                self._left[i] -= n
                if self._left[i] == 0:
                    self._ready.append(i)
        if self._ready and (self._warming is None or not self._warming.is_alive()):
            self._launch()  # else with the next group, once nvCOMP's library is loaded

    def abandon(self) -> None:
        """The load failed: wait for the checks queued on the device (their tables are freed after) and drop them."""
        if self._gpu is not None:
            codecs, batches = self._gpu
            self._gpu = None
            try:
                batches.results()
            except Exception as e:  # the load's own error is the one to raise
                log.debug("rank %d: queued checks abandoned: %s", self.plan.rank, e)
            finally:
                codecs.close()
        self._table = None  # nothing queued uses it now

    def _launch(self) -> None:
        assert self._device is not None
        if self._no_gpu_crc or not self._ready:
            return
        if self._gpu is None:
            from ..codecs import GpuCodecs

            codecs = GpuCodecs(self._device, self._device.stream(1).handle)
            batches = codecs.crc_batches(f"rank {self.plan.rank}", self._table)
            if batches is None:
                codecs.close()
                self._no_gpu_crc = True
                return
            self._gpu = codecs, batches
        address = self._device.address
        self._gpu[1].launch(
            [
                (address(self._dsts[self.checks[i].buffer]) + self.checks[i].offset, self.checks[i].nbytes)
                for i in self._ready
            ]
        )
        self._launched.extend(self._ready)
        self._ready = []

    # ------------------------------------------------------------------------------------------ finishing

    def finish(self, device: Device, dsts: Sequence[Any], threads: int = 4) -> VerifyOutcome:
        """Check what is left once every byte is in place; raise :class:`IntegrityError` for the first file whose
        loaded bytes differ from what it records (with ``verify=True``: its manifest digest first), or, with
        ``verify=True``, for a file with tensors nothing could check."""
        if device.kind == "cpu":
            self._finish_on_cpu(device, dsts, threads)
            where = "cpu, beside the read" if self._views is not None else "cpu, after the read"
        else:
            where = self._finish_on_gpu(device, dsts, threads)
        digests = self._digests(device, dsts) if self.mode is True else [""] * len(self.plan.files)
        self._raise_on_mismatch()
        checked = list(self.decoded)
        for c in self.checks:
            checked[c.file_index] += 1
        how: list[str] = []
        for i, f in enumerate(self.plan.files):
            parts = []
            if digests[i]:
                parts.append(f"{digests[i]} digest of the loaded file")
                checked[i] = self.loaded[i]
            if any(c.file_index == i and not c.decoded for c in self.checks):
                parts.append(f"crc32 ({where})")
            if any(c.file_index == i and c.decoded for c in self.checks):
                parts.append(f"crc32 of decoded bytes ({where})")
            if self.decoded[i]:
                parts.append("crc32 of decoded bytes")
            how.append("; ".join(parts))
        unchecked = [
            (f.path, self.loaded[i] - checked[i]) for i, f in enumerate(self.plan.files) if checked[i] < self.loaded[i]
        ]
        if self.mode is True and unchecked:
            path, n = unchecked[0]
            entry = self.rank_files.manifest_entry(path)
            why = (
                "there is no manifest"
                if self.rank_files.manifest is None
                else "the manifest records no digest for it"
                if entry is None or entry.digest is None
                else "this load does not hold the file's whole data section to compute its manifest digest from "
                "(the file is compressed, or only part of it was loaded)"
            )
            raise IntegrityError(
                f"{path!r}: verify was asked for, but {n} of its tensors cannot be checked: the file records no "
                f"checksums for them and {why}; rewrite it with `gdsload compress` or `gdsload shard` (they record "
                "checksums), or load with the default verify (checks what is recorded)"
            )
        summary = {
            "mode": {None: "recorded checksums", True: "everything (checksums and manifest digests)"}[self.mode],
            "checked_tensors": sum(checked),
            "unchecked_tensors": sum(n for _, n in unchecked),
            "checksum_tensors": sum(not c.decoded for c in self.checks),
            "checked_on": where if self.checks else "",
            "decoded_crc32_tensors": sum(self.decoded) + sum(c.decoded for c in self.checks),
            "digest_files": sum(1 for d in digests if d),
            "checked_as_landed_tensors": self.checked_as_landed,
        }
        if unchecked:
            log.info(
                "rank %d: %d tensor(s) not checked (their files record no checksums), e.g. in %r",
                self.plan.rank,
                summary["unchecked_tensors"],
                unchecked[0][0],
            )
        return VerifyOutcome(not unchecked and bool(self.loaded), checked, how, summary)

    def _finish_on_cpu(self, device: Device, dsts: Sequence[Any], threads: int) -> None:
        if self._views is None:
            self.attach(device, dsts)
        todo = [i for i, got in enumerate(self._got) if got is None]
        if not todo:
            return
        views = self._views
        assert views is not None

        def rest(i: int) -> None:  # bytes no read reported (a mapped file): from where the folding stopped
            c, st = self.checks[i], self._progress[i]
            crc, at = st.crc, st.at
            if c.buffer in self._mapped:
                from ..io.mmap import mapped_pieces

                for piece in mapped_pieces(
                    self._addresses[c.buffer] + c.offset + at, c.nbytes - at, self._mapped[c.buffer]
                ):
                    crc = crc32(piece, crc)
                self._got[i] = crc
                return
            view = views[c.buffer]
            while at < c.nbytes:
                n = min(_HOST_PIECE, c.nbytes - at)
                crc = crc32(view[c.offset + at : c.offset + at + n], crc)
                at += n
            self._got[i] = crc

        if len(todo) == 1 or threads == 1:
            for i in todo:
                rest(i)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="gdsload-verify") as pool:
            list(pool.map(rest, todo))

    def _finish_on_gpu(self, device: Device, dsts: Sequence[Any], threads: int) -> str:
        if self._warming is not None:
            self._warming.join()
        if not any(c.nbytes for c in self.checks):
            return str(device)
        if self._device is None:  # nothing landed in groups: every tensor is checked now
            self.attach_device(device, dsts)
        launched = set(self._launched)
        self.checked_as_landed = len(launched)
        self._ready = [i for i, c in enumerate(self.checks) if c.nbytes and i not in launched]
        self._launch()
        try:
            if self._gpu is not None:
                for i, crc in zip(self._launched, self._gpu[1].results()):
                    self._got[i] = crc
        finally:
            if self._gpu is not None:
                self._gpu[0].close()
                self._gpu = None
            self._table = None
        todo = [i for i, c in enumerate(self.checks) if c.nbytes and self._got[i] is None]
        if not todo:
            return f"{device}, nvCOMP"
        for i in todo:
            c = self.checks[i]
            self._got[i] = crc32(device.to_host(dsts[c.buffer][c.offset : c.offset + c.nbytes]))
        log.warning(
            "rank %d: nvCOMP's CRC kernel is not available, so the tensors' checksums were checked from host "
            "copies (a copy of the rank); install gdsload[cu12] or gdsload[cu13] to check them on the GPU",
            self.plan.rank,
        )
        return "cpu, from copies of the GPU's bytes"

    def _raise_on_mismatch(self) -> None:
        wrong = [i for i, got in enumerate(self._got) if got != self.checks[i].expected]
        if not wrong:
            return
        c, got = self.checks[wrong[0]], self._got[wrong[0]]
        path = self.plan.files[c.file_index].path
        what = "the decoded bytes have CRC-32" if c.decoded else "the loaded bytes have CRC-32"
        raise IntegrityError(
            f"{path!r}: tensor {c.name!r}: {what} {got:#010x} where the file records "
            f"{c.expected:#010x} ({len(wrong)} tensor(s) of rank {self.plan.rank} differ); the file is corrupt or "
            "changed while it was loaded: re-copy it (verify=False skips the check)"
        )

    def _digests(self, device: Device, dsts: Sequence[Any]) -> list[str]:
        """With ``verify=True``: each file's manifest digest, computed over the bytes the load holds (the header
        as parsed, then the data section where the load holds it whole). Per file, the algorithm checked, or ""."""
        from ..format.digests import algorithm_of, hasher

        out = []
        manifest = os.path.join(self.rank_files.root, "gdsload.json")
        for k, f in enumerate(self.plan.files):
            entry = self.rank_files.manifest_entry(f.path)
            data = self._data_section(k, device, dsts)
            if entry is None or entry.digest is None or data is None or not f.header.raw:
                out.append("")
                continue
            algorithm = algorithm_of(entry.digest, f"{manifest!r}, file {entry.path!r}")
            h = hasher(algorithm, f.header.raw)
            for piece in data:
                h.update(piece)
            got = h.text()
            if got != entry.digest:
                raise IntegrityError(
                    f"{f.path!r}: {algorithm} digest {got!r} does not match the manifest's {entry.digest!r}; "
                    "the file is corrupt or was replaced — re-copy it or rewrite the manifest"
                )
            out.append(algorithm)
        return out

    def _data_section(self, k: int, device: Device, dsts: Sequence[Any]) -> Any:
        """The loaded bytes of file ``k``'s whole data section (an iterable of pieces), or None where the load
        does not hold it whole (compressed, partly loaded, read into the caller's tensors)."""
        f = self.plan.files[k]
        n = f.stored_bytes
        if f.mirror_offset >= 0:
            buf, start = dsts[0], f.mirror_offset
        elif k in self.plan.mapped:
            from ..io.mmap import mapped_pieces

            buf = dsts[1 + len(self.plan.targets) + self.plan.mapped.index(k)]
            return mapped_pieces(device.address(buf) + f.header.data_offset, n, f.path)
        else:
            return None
        if device.kind == "cpu":
            view = device.host_memoryview(buf)
            return (view[start + a : start + min(a + _HOST_PIECE, n)] for a in range(0, n, _HOST_PIECE))
        return (device.to_host(buf[start + a : start + min(a + _HOST_PIECE, n)]) for a in range(0, n, _HOST_PIECE))
