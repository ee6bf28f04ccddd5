"""The compressed loader's read/decode schedule (``decode._pipeline``), without a GPU.

On a GPU the reads go to staging buffers and nvCOMP decodes them (tests/loader/pipeline/test_gpu.py); here the
same schedule runs with recorded reads and a decoder thread, to pin down its promises: the next
group is read while the last is waited for, a slot is reused only after its decode, every read
in flight is waited for before an error leaves, and a decode error stops further reads. The in-place
layout (``decode.in_place``) and both GPU schedules run here too, on host memory, with ``zstandard``
decoding where nvCOMP would.
"""

from __future__ import annotations

import collections
import queue
import threading

import pytest

from gdsload.loader import codecs
from gdsload.loader.pipeline import decode
from gdsload.loader.pipeline.decode import _pipeline


class _Harness:
    def __init__(self, slots: int = 2, fail_read: int | None = None, fail_decode: int | None = None):
        self.free = [threading.Event() for _ in range(slots)]
        for ev in self.free:
            ev.set()
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.fail_read, self.fail_decode = fail_read, fail_decode
        self.slot_owner: dict[int, int] = {}
        self.work: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._decoder, daemon=True)
        self.thread.start()

    def log(self, what: str, i: int) -> None:
        with self.lock:
            self.events.append((what, i))

    def submit(self, i: int, k: int):
        owner = self.slot_owner.get(k)
        assert owner is None or ("decoded", owner) in self.events, f"slot {k} reused before group {owner} decoded"
        self.slot_owner[k] = i
        self.log("submit", i)

        def wait() -> None:
            self.log("wait", i)
            if i == self.fail_read:
                raise OSError(f"read of group {i} failed")

        return wait

    def hand_off(self, i: int, k: int) -> None:
        self.log("hand_off", i)
        self.work.put((i, k))

    def _decoder(self) -> None:
        while (item := self.work.get()) is not None:
            i, k = item
            if not self.errors:
                if i == self.fail_decode:
                    self.errors.append(ValueError(f"decode of group {i} failed"))
                self.log("decoded", i)
            self.free[k].set()

    def run(self, n: int) -> None:
        try:
            _pipeline(n, self.free, self.submit, self.hand_off, self.errors)
        finally:
            self.work.put(None)
            self.thread.join()


@pytest.mark.parametrize("slots, groups", [(2, 6), (3, 7)])
def test_the_next_groups_are_read_before_the_oldest_is_waited_for(slots, groups):
    """Two slots: group i + 1 is in flight while i is waited for; three: groups i + 1 and i + 2."""
    h = _Harness(slots=slots)
    h.run(groups)
    ev = h.events
    ahead = slots - 1
    for i in range(groups - ahead):
        assert ev.index(("submit", i + ahead)) < ev.index(("wait", i)), (
            f"group {i + ahead} not in flight while {i} waited"
        )
    assert [i for what, i in ev if what == "decoded"] == list(range(groups))
    assert [i for what, i in ev if what == "wait"] == list(range(groups))


def test_a_failed_read_with_three_slots_waits_for_both_reads_in_flight():
    h = _Harness(slots=3, fail_read=2)
    with pytest.raises(OSError, match="group 2"):
        h.run(8)
    submitted = [i for what, i in h.events if what == "submit"]
    waited = [i for what, i in h.events if what == "wait"]
    assert submitted == waited == [0, 1, 2, 3, 4]  # groups 3 and 4 were in flight: waited for
    assert ("hand_off", 2) not in h.events


def test_a_failed_read_waits_for_the_read_in_flight_and_reads_no_further():
    h = _Harness(fail_read=2)
    with pytest.raises(OSError, match="group 2"):
        h.run(6)
    submitted = [i for what, i in h.events if what == "submit"]
    waited = [i for what, i in h.events if what == "wait"]
    assert submitted == [0, 1, 2, 3] and waited == [0, 1, 2, 3]  # group 3 was in flight: waited for
    assert ("hand_off", 2) not in h.events


def test_a_decode_error_stops_the_reads():
    h = _Harness(fail_decode=1)
    h.run(8)
    assert h.errors and "group 1" in str(h.errors[0])
    submitted = [i for what, i in h.events if what == "submit"]
    waited = [i for what, i in h.events if what == "wait"]
    assert sorted(waited) == submitted and max(submitted) < 7  # stopped early; nothing left in flight


def test_one_group_one_slot():
    h = _Harness(slots=1)
    h.run(1)
    assert h.events == [("submit", 0), ("wait", 0), ("hand_off", 0), ("decoded", 0)]


def test_a_decoder_that_cannot_start_fails_the_load_instead_of_hanging(tmp_path, monkeypatch):
    """No stream or codecs for the decoder: load_compressed raises that error, with any number of groups."""

    import torch

    from gdsload.loader import discover, plan_rank, save_file
    from gdsload.loader.pipeline import decode
    from gdsload.loader.prepare.compress import compress_dir

    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file(
        {f"w{i}": (0.02 * torch.randn(256, 256, generator=g)).to(torch.bfloat16) for i in range(5)},
        src / "model.safetensors",
    )
    compress_dir(src, tmp_path / "z", codec="zstd", device="cpu")
    plan = plan_rank(discover(tmp_path / "z", 0))
    assert len(plan.compressed) == 5

    class NoStreams:  # a GPU device whose decoder cannot get a stream
        kind, index, uses_torch = "cuda", 0, True

        def stream(self):
            raise RuntimeError("no CUDA stream here")

    class Reader:  # stands in for a GPU backend: staging is host memory, reads finish at once
        device = NoStreams()

        def allocate(self, n: int) -> bytearray:
            return bytearray(n)

        def submit(self, extents, dsts, progress=None):
            return lambda: None

    monkeypatch.setattr(codecs, "nvcomp_available", lambda **_: None)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            decode.load_compressed(plan, Reader(), [bytearray(plan.arena_bytes)], verify=False, staging_bytes=4096)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "load_compressed hung waiting for a decoder that never started"
    assert len(outcome) == 1 and "no CUDA stream here" in str(outcome[0])


def test_warns_once_when_nvcomp_will_touch_gpu0(monkeypatch, caplog):
    from types import SimpleNamespace

    monkeypatch.setattr(codecs, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(decode, "_WARNED", set())
    on = lambda i: SimpleNamespace(index=i)  # noqa: E731 - a device's shape
    with caplog.at_level("WARNING", logger="gdsload.loader.pipeline.decode"):
        decode._warn_if_other_gpus(on(0))  # GPU 0 itself: nothing to say
        decode._warn_if_other_gpus(on(1))
        decode._warn_if_other_gpus(on(1))
    (record,) = caplog.records
    assert "GPU 1" in record.getMessage() and "CUDA_VISIBLE_DEVICES" in record.getMessage()
    monkeypatch.setattr(codecs, "cuda_device_count", lambda: 1)
    caplog.clear()
    decode._warn_if_other_gpus(on(2))
    assert not caplog.records


def _tensor(name: str, chunks: tuple[int, ...], layout: str = "chunks", offset: int = 0):
    from gdsload.loader.format.compression import CompressedEntry
    from gdsload.loader.plan import CompressedTensor

    entry = CompressedEntry(
        name, "BF16", (len(chunks) * 131072,), len(chunks) * 262144, "ans", layout, 0, {}, 262144, chunks, None, 16
    )
    starts, sizes, _, _ = entry.chunk_table()
    entry = CompressedEntry(
        name,
        entry.dtype,
        entry.shape,
        entry.nbytes,
        "ans",
        layout,
        int(starts[-1] + sizes[-1]),
        {},
        262144,
        chunks,
        None,
        16,
    )
    return CompressedTensor(0, offset, 0, entry)


def test_a_tensor_larger_than_a_staging_buffer_goes_a_run_of_chunks_per_group():
    """On a GPU, staging stays at its size whatever the tensors: a chunked tensor that does not fit
    in what is left of a group fills it and goes on in the next ones, every chunk exactly once, each
    run contiguous in the file and 16-byte aligned in staging; one that fits stays whole."""
    staging = 64 << 10
    small = _tensor("small", (5000, 7001))
    big = _tensor("big", tuple(9000 + 17 * i for i in range(40)), offset=1 << 20)  # ~360 KB: six groups or so
    last = _tensor("last", (3000,), offset=4 << 20)
    groups = decode._groups((small, big, last), staging, split=True)
    for g in groups:
        assert sum(decode.align_up(p.nbytes, 4096) for p, _ in g) <= staging
        assert all(off % 4096 == 0 and off + p.nbytes <= staging for p, off in g)
    pieces = [p for g in groups for p, _ in g]
    assert [p.tensor.entry.name for p in pieces if p.tensor is not big] == ["small", "last"]
    assert all(
        p.first == 0 and p.stop is None and p.nbytes == p.tensor.entry.stored_bytes
        for p in pieces
        if p.tensor is not big
    )
    runs = [p for p in pieces if p.tensor is big]
    assert len(runs) >= 5 and runs[0].first == 0 and runs[-1].stop is None
    starts, sizes, _, _ = big.entry.chunk_table()
    for a, b in zip(runs, runs[1:]):
        assert a.stop == b.first  # no chunk left out, none twice
    for p in runs:
        stop = p.stop if p.stop is not None else len(sizes)
        assert p.start == starts[p.first] and p.start + p.nbytes == starts[stop - 1] + sizes[stop - 1]
    assert runs[-1].start + runs[-1].nbytes == big.entry.stored_bytes
    # The first run fills the group "small" started.
    assert groups[0][-1][0] is runs[0]


def test_whole_tensors_on_the_cpu_and_for_native_streams():
    """The CPU decoder and ``layout: native`` streams take whole tensors: such a tensor larger than
    what is left starts a group, and staging is sized to hold the largest."""
    staging = 64 << 10
    big = _tensor("big", tuple(9000 for _ in range(10)))
    native = _tensor("native", (20000, 20000), layout="native")
    for split, tensors in ((False, (big,)), (True, (native,))):
        t = tensors[0]
        unit = decode._unit(t, split)
        assert unit == decode.align_up(t.entry.stored_bytes, 4096)
        groups = decode._groups((_tensor("a", (30000,)), t), max(staging, unit), split=split)
        assert len(groups) == 2 and groups[1] == [(decode._Piece(t, 0, t.entry.stored_bytes), 0)]
    assert decode._unit(big, True) == decode.align_up(9000, 4096)


def _zstd_rank(tmp_path, shapes):
    """A CPU-compressed (Zstd chunks) copy of a model with tensors of ``shapes``, and its reference tensors."""
    import torch

    from gdsload.loader import save_file
    from gdsload.loader.prepare.compress import compress_dir

    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(len(shapes))
    tensors = {f"t{i:02d}": (0.02 * torch.randn(*s, generator=g)).to(torch.bfloat16) for i, s in enumerate(shapes)}
    half = len(shapes) // 2
    save_file(dict(list(tensors.items())[:half]), src / "model-00001-of-00002.safetensors")
    save_file(dict(list(tensors.items())[half:]), src / "model-00002-of-00002.safetensors")
    compress_dir(src, tmp_path / "z", codec="zstd", device="cpu", digest=False)
    return tmp_path / "z", tensors


def _outputs(run):
    """The arena ranges a group of the in-place schedule decodes or copies into, from its pieces alone."""
    out = []
    for p, _ in run.pieces:
        if p.first == 0 and p.stop is None:  # the whole tensor
            out.append((p.tensor.offset, p.tensor.offset + p.tensor.entry.nbytes))
            continue
        _, _, dec_at, dec_len = p.tensor.entry.chunk_table()
        stop = len(dec_at) if p.stop is None else p.stop
        out.append(
            (p.tensor.offset + int(dec_at[p.first]), p.tensor.offset + int(dec_at[stop - 1] + dec_len[stop - 1]))
        )
    out += [(e.offset, e.offset + e.length) for e, _ in run.copies]
    return out


def _assert_in_place_holds(plan, layout) -> None:
    """What the in-place schedule promises, checked from the groups' pieces (not from what it computed): no
    group writes over the stored bytes of itself or of a later group in the arena, nor below what the
    uncompressed files hold; the stored bytes fit in the arena or the spill buffer, every chunk's address
    aligned as its codec needs."""
    stored = []  # (group, lo, hi) of each piece and raw tensor read into the arena
    for k, r in enumerate(layout.runs):
        base, top = (layout.base, plan.arena_bytes) if k < layout.split else (-layout.spill_from, layout.spill)
        for p, s in r.pieces:  # each tensor from a 256-byte boundary, each chunk as its codec needs
            assert (base + s - p.start) % 256 == 0 and (base + s) % p.tensor.entry.chunk_align == 0
            assert 0 <= base + s and base + s + p.nbytes <= top
            if k < layout.split:
                stored.append((k, base + s, base + s + p.nbytes))
        for e, s in r.copies:
            assert 0 <= base + s and base + s + e.length <= top
            if k < layout.split:
                stored.append((k, base + s, base + s + e.length))
    floor = max((e.offset + e.length for f in plan.files if not f.compressed for e in f.extents), default=0)
    assert all(lo >= floor for _, lo, _ in stored)
    for k, r in enumerate(layout.runs):
        for lo, hi in _outputs(r):
            assert lo >= floor
            clash = [(j, a, b) for j, a, b in stored if j >= k and a < hi and lo < b]
            assert not clash, (k, lo, hi, clash[:3])


def _emulate_in_place(plan, layout, decode_as_read: bool) -> bytearray:
    """Run the in-place schedule on host memory after the uncompressed files' reads: each group read from its
    file into the arena's top (or the spill buffer), then decoded chunk by chunk with ``zstandard`` into its
    places; either every read first and then every decode (``decode_as_read`` False), or each group decoded as
    soon as it is read."""
    import zstandard

    arena, spill = bytearray(plan.arena_bytes), bytearray(layout.spill)
    for f in plan.files:  # the uncompressed files, read by the load before the decode stage
        if not f.compressed:
            for e in f.extents:
                with open(f.path, "rb") as fh:
                    fh.seek(e.file_offset)
                    arena[e.offset : e.offset + e.length] = fh.read(e.length)

    def where(k, s):
        return (arena, layout.base + s) if k < layout.split else (spill, s - layout.spill_from)

    def read(k):
        r = layout.runs[k]
        buf, at = where(k, r.start)
        for e in r.reads(at):
            with open(plan.files[e.file_index].path, "rb") as f:
                f.seek(e.file_offset)
                buf[e.offset : e.offset + e.length] = f.read(e.length)

    def decode(k):
        r = layout.runs[k]
        # On a GPU a group's chunks decode at once: spoil every byte it writes first, so that reading any of
        # them as stored bytes (of this group or a later one) shows.
        for lo, hi in _outputs(r):
            arena[lo:hi] = b"\xee" * (hi - lo)
        for p, s in r.pieces:
            src, o = where(k, s)
            starts, sizes, dec_at, dec_len = p.tensor.entry.chunk_table()
            stop = len(sizes) if p.stop is None else p.stop
            for j in range(p.first, stop):
                at = o + int(starts[j] - starts[p.first])
                out = zstandard.ZstdDecompressor().decompress(bytes(src[at : at + int(sizes[j])]))
                assert len(out) == dec_len[j]
                d = p.tensor.offset + int(dec_at[j])
                arena[d : d + len(out)] = out
        for e, s in r.copies:
            src, o = where(k, s)
            arena[e.offset : e.offset + e.length] = src[o : o + e.length]

    if decode_as_read:
        for k in range(len(layout.runs)):
            read(k)
            decode(k)
    else:
        for k in range(len(layout.runs)):
            read(k)
        for k in range(len(layout.runs)):
            decode(k)
    return arena


_SHAPES = {
    "mixed": [(384, 1024), (16,), (1400, 512), (64,), (2048, 1024), (8,), (600, 256), (1024, 700), (32,), (512, 256)],
    # the second file's tensors all stay raw: an uncompressed file the stored bytes must stay above
    "one file plain": [(2048, 1024), (0, 16), (1400, 512), (1024, 700), (16,), (64,), (32,), (8, 8)],
    "one tensor": [(2048, 1024), (8,)],
}


@pytest.mark.parametrize("decode_as_read", [False, True])
@pytest.mark.parametrize("shapes", _SHAPES)
@pytest.mark.parametrize("min_run, staging", [(256 << 10, 3 << 20), (64 << 10, 1 << 20), (16 << 20, 960 << 20)])
def test_in_place_groups_never_decode_over_stored_bytes_still_to_come(
    tmp_path, monkeypatch, decode_as_read, shapes, min_run, staging
):
    """On a GPU the compressed files are read into the top of the arena and decode from there into the
    tensors' places below. No group writes over stored bytes of its own or of a later group, whatever the
    groups' sizes; emulated on host memory (a group's writes spoil their bytes before it decodes), whether
    every read lands before any decode or each group decodes as soon as it is read, every tensor comes out
    bit-identical; every chunk is decoded once, every raw tensor copied once."""
    import torch

    from gdsload.loader import discover, plan_rank

    monkeypatch.setattr(decode, "_MIN_RUN", min_run)
    model, ref = _zstd_rank(tmp_path, _SHAPES[shapes])
    with plan_rank(discover(model, 0)) as plan:
        assert plan.compressed and any(f.extents for f in plan.files)  # compressed tensors and raw ones
        assert (shapes != "mixed") == any(not f.compressed for f in plan.files)
        layout = decode.in_place(plan, staging)
        if layout is None:  # the spill would exceed the staging allowed
            assert staging < 3 << 20
            return
        assert layout.spill <= staging
        _assert_in_place_holds(plan, layout)
        runs = layout.runs
        chunks = collections.Counter()
        for r in runs:
            for p, _ in r.pieces:
                stop = len(p.tensor.entry.chunks) if p.stop is None else p.stop
                chunks.update((p.tensor.entry.name, j) for j in range(p.first, stop))
        assert sorted(chunks.values()) == [1] * sum(len(t.entry.chunks) for t in plan.compressed)
        assert sorted(e.offset for r in runs for e, _ in r.copies) == sorted(
            e.offset for f in plan.files if f.compressed for e in f.extents
        )
        arena = _emulate_in_place(plan, layout, decode_as_read)
        for p in plan.placements:
            want = ref[p.name].contiguous().view(torch.uint8).numpy().tobytes()
            assert bytes(arena[p.offset : p.offset + p.nbytes]) == want, p.name


def _random_plan(rng):
    """A plan as ``plan_rank`` lays one out, without files: uncompressed files first, then compressed ones whose
    tensors (raw, ANS chunks of several sizes and ratios, nvCOMP containers, empty) get slots in file order,
    then slots for misaligned tensors at the arena's end."""
    from types import SimpleNamespace

    from gdsload.loader.format.compression import CompressedEntry
    from gdsload.loader.plan import CompressedTensor, Extent, align_up

    files, compressed, cursor = [], [], 0
    for i in range(rng.randint(0, 2)):
        n = rng.randint(0, 5 << 20)
        files.append(SimpleNamespace(compressed=0, extents=(Extent(i, 4096, n, cursor),) if n else ()))
        cursor = align_up(cursor + n, 4096)
    for i in range(len(files), len(files) + rng.randint(1, 3)):
        raw, at = [], 4096
        for j in range(rng.randint(1, 12)):
            cursor = align_up(cursor, 256)
            kind, n = rng.choice(["raw", "chunks", "chunks", "native", "empty"]), rng.randint(1, 12 << 20)
            if kind == "raw":
                raw.append(Extent(i, at, n, cursor))
                cursor, at = cursor + n, at + n
                continue
            if kind == "empty":
                continue
            ratio = rng.uniform(0.3, 1.05)
            if kind == "chunks":
                cb = rng.choice([64 << 10, 256 << 10, 1 << 20])
                sizes = tuple(max(1, int(min(cb, n - c) * ratio)) for c in range(0, n, cb))
                e = CompressedEntry(
                    f"t{i}.{j}",
                    "BF16",
                    (n // 2,),
                    n - n % 2,
                    "ans",
                    "chunks",
                    0,
                    chunk_bytes=cb,
                    chunks=sizes,
                    chunk_align=16,
                )
                starts, lens, _, _ = e.chunk_table()
                e = e._replace(nbytes=n, shape=(n,), dtype="U8", stored_bytes=int(starts[-1] + lens[-1]))
            else:
                e = CompressedEntry(f"t{i}.{j}", "U8", (n,), n, "gdeflate", "native", max(1, int(n * ratio)))
            compressed.append(CompressedTensor(i, at, cursor, e))
            cursor, at = cursor + n, at + e.stored_bytes
        files.append(SimpleNamespace(compressed=1, extents=tuple(raw)))
    cursor += sum(rng.randint(0, 2 << 20) for _ in range(rng.randint(0, 3)))
    return SimpleNamespace(files=files, compressed=tuple(compressed), arena_bytes=cursor)


def test_in_place_holds_for_random_plans(monkeypatch):
    """The in-place promises (see ``_assert_in_place_holds``) for 400 random plans and group sizes."""
    import random

    rng = random.Random(29)
    used = 0
    for _ in range(400):
        monkeypatch.setattr(decode, "_MIN_RUN", rng.choice([1 << 20, 4 << 20, 64 << 20]))
        plan = _random_plan(rng)
        if not plan.compressed:
            continue
        layout = decode.in_place(plan, rng.choice([3 << 20, 12 << 20, 960 << 20]))
        if layout is not None:
            used += 1
            _assert_in_place_holds(plan, layout)
            assert layout.spill == 0 or layout.split < len(layout.runs)
    assert used > 200


def test_in_place_reads_only_what_is_loaded_and_leaves_the_callers_buffers_to_staging(tmp_path):
    """A partial load (``only``) reads just its tensors; loads into the caller's buffers (``into``), and those
    whose spill would exceed the staging allowed, go through staging buffers."""
    import torch

    from gdsload.loader import discover, plan_rank

    model, ref = _zstd_rank(tmp_path, [(512, 512), (16,), (512, 512), (300, 300)])
    rank = discover(model, 0)
    with plan_rank(rank) as plan:
        layout = decode.in_place(plan, 960 << 20)
        assert layout is not None and layout.spill > 0  # a group as large as all cannot decode where it lies
        assert decode.in_place(plan, 3 * 4096) is None  # no group is smaller than a chunk (256 KiB)
    with plan_rank(rank, only=["t00", "t01"]) as plan:
        layout = decode.in_place(plan, 960 << 20)
        read = sorted((e.file_index, e.file_offset, e.length) for r in layout.runs for e in r.reads(0))
        h = plan.files[0].header
        assert read == sorted((0, h.data_offset + h[n].start, h[n].nbytes) for n in ("t00", "t01"))
        arena = _emulate_in_place(plan, layout, True)
        for p in plan.placements:
            assert (
                bytes(arena[p.offset : p.offset + p.nbytes])
                == ref[p.name].contiguous().view(torch.uint8).numpy().tobytes()
            )
    with plan_rank(rank, targets={"t02": ("BF16", (512, 512))}) as plan:
        assert decode.in_place(plan, 960 << 20) is None


def test_raw_tensors_of_a_compressed_file_load_alone_and_with_the_others(tmp_path):
    """The tensors a compressed file stores raw are read with its compressed ones; loaded without any of
    those (``only``), they are read all the same."""
    import torch

    from gdsload.loader import load_rank

    model, ref = _zstd_rank(tmp_path, [(512, 512), (16,), (512, 512), (8,)])
    for only in (["t01"], ["t01", "t03"], ["t00", "t03"], None):
        got = load_rank(model, device="cpu", only=only).tensors
        assert sorted(got) == sorted(only or ref)
        for name, t in got.items():
            assert torch.equal(t.view(torch.uint8), ref[name].view(torch.uint8)), (only, name)


class _HostGpu:
    """A GPU stand-in for the decode schedule: buffers are numpy arrays, streams do nothing, and reads run on
    a thread of their own (so they land while the decoder works)."""

    kind, index, uses_torch = "cuda", 0, False

    def stream(self, which: int = 0):
        import contextlib

        from gdsload.loader.devices import Stream

        return Stream(0, lambda: None, contextlib.nullcontext)


class _HostReader:
    def __init__(self, plan):
        from concurrent.futures import ThreadPoolExecutor

        self.device, self.plan, self.pool = _HostGpu(), plan, ThreadPoolExecutor(1)

    def allocate(self, nbytes):
        import numpy as np

        return np.full(nbytes, 0xEE, np.uint8)  # bytes never written show up

    def submit(self, extents, dsts, progress=None):
        import os

        def run():
            for e in extents:
                dsts[e.buffer][e.offset : e.offset + e.length] = memoryview(
                    os.pread(self.plan.fds[e.file_index], e.length, e.file_offset)
                )

        return self.pool.submit(run).result

    def read(self, extents, dsts, progress=None):
        self.submit(extents, dsts, progress)()


class _HostCodecs:
    """Decodes Zstd chunks with ``zstandard`` into numpy arrays, where nvCOMP would on a GPU."""

    def __init__(self, device, stream=None, *, verify=False):
        pass

    def decode_many(self, jobs):
        import numpy as np
        import zstandard

        for j in jobs:
            starts, sizes, dec_at, dec_len = j.entry.chunk_table()
            stop = len(sizes) if j.stop is None else j.stop
            for c in range(j.first, stop):
                at = int(starts[c] - starts[j.first])
                out = zstandard.ZstdDecompressor().decompress(j.src[at : at + int(sizes[c])].tobytes())
                assert len(out) == dec_len[c]
                j.dst[int(dec_at[c]) : int(dec_at[c]) + len(out)] = np.frombuffer(out, np.uint8)

    def copy(self, dst, src):
        dst[...] = src

    def finish(self, *, but_last=False):
        pass

    def close(self):
        pass

    def checked_on_device(self, entry):
        return True


@pytest.mark.parametrize("in_place", [True, False])
def test_the_gpu_schedules_put_every_tensor_in_its_place(tmp_path, monkeypatch, in_place):
    """The GPU decode stage end to end, on host memory: groups read on a thread of their own, decoded on the
    decoder thread, raw tensors copied from the stream; in place and through staging buffers, every tensor
    comes out bit-identical, and the staging the report names is what was allocated."""
    import numpy as np
    import torch

    from gdsload.loader import discover, plan_rank

    monkeypatch.setattr(decode, "_MIN_RUN", 256 << 10)
    monkeypatch.setattr(decode, "IN_PLACE", in_place)
    monkeypatch.setattr(codecs, "GpuCodecs", _HostCodecs)
    monkeypatch.setattr(codecs, "nvcomp_available", lambda **_: None)
    shapes = [(384, 1024), (16,), (1400, 512), (64,), (2048, 1024), (8,), (600, 256), (1024, 700), (32,), (512, 256)]
    model, ref = _zstd_rank(tmp_path, shapes)
    with plan_rank(discover(model, 0)) as plan:
        reader = _HostReader(plan)
        allocated = []
        real_allocate = reader.allocate
        reader.allocate = lambda n: allocated.append(n) or real_allocate(n)
        arena = np.full(plan.arena_bytes, 0xEE, np.uint8)
        stats = decode.load_compressed(plan, reader, [arena], verify=False, staging_bytes=3 << 20)
        assert stats.staging_bytes == sum(allocated) and (stats.staging_bytes < 3 << 20) == in_place
        for p in plan.placements:
            got = torch.from_numpy(arena[p.offset : p.offset + p.nbytes].copy())
            assert torch.equal(got, ref[p.name].contiguous().view(torch.uint8).flatten()), p.name


def test_a_failed_kvikio_read_is_raised_after_every_other_read_is_done():
    """kvikio's reads of a group write into the load's buffers until each is done: the waiter waits for all
    of them before it raises the first failure (an error, or a short read naming the file)."""
    from types import SimpleNamespace

    from gdsload.loader import TruncatedFileError
    from gdsload.loader.io import wait_preads
    from gdsload.loader.plan import Extent

    waited = []

    class Future:
        def __init__(self, i, result):
            self.i, self.result = i, result

        def get(self):
            waited.append(self.i)
            if isinstance(self.result, Exception):
                raise self.result
            return self.result

    plan = SimpleNamespace(files=[SimpleNamespace(path="/m/a.safetensors")])
    extents = [Extent(0, 4096 * i, 4096, 4096 * i) for i in range(4)]
    with pytest.raises(OSError, match="disk gone"):
        wait_preads(
            plan, [(e, Future(i, OSError("disk gone") if i == 1 else 4096)) for i, e in enumerate(extents)], None
        )
    assert waited == [0, 1, 2, 3]
    waited.clear()
    done = []
    with pytest.raises(TruncatedFileError, match="a.safetensors.*read 100 of 4096"):
        wait_preads(plan, [(e, Future(i, 100 if i == 2 else 4096)) for i, e in enumerate(extents)], done.append)
    assert waited == [0, 1, 2, 3] and done == [4096, 4096]
