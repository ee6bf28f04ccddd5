"""The pinned backend's staging ring, on the CPU: chunking, O_DIRECT rounding, groups, errors.

On a GPU the ring copies through pinned buffers on CUDA streams (tests/loader/io/test_gpu_readers.py); here the
same threads, queue, alignment and error bookkeeping run with a host destination.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from gdsload.loader.io.ring import PAGE, RingFile, StagingRing, stream_order
from gdsload.loader.errors import TruncatedFileError
from gdsload.loader.plan import Extent, split_extents


def _files(tmp_path, sizes, direct):
    out, data = [], []
    for i, n in enumerate(sizes):
        p = tmp_path / f"f{i}.bin"
        blob = os.urandom(n)
        p.write_bytes(blob)
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(p, flags)
        except OSError:
            pytest.skip("this file system refuses O_DIRECT")
        out.append(RingFile(fd, direct, str(p)))
        data.append(blob)
    return out, data


def _close(files):
    for f in files:
        os.close(f.fd)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_groups_land_byte_exact_at_unaligned_offsets(tmp_path, direct):
    files, data = _files(tmp_path, [3 * (1 << 20) + 123, 1 << 20], direct)
    ring = StagingRing(torch.device("cpu"), files, threads=3, chunk=64 << 10)
    try:
        # Odd offsets and lengths: O_DIRECT reads must round out to pages and drop the lead.
        first = [Extent(0, 7, 1_000_001, 0), Extent(1, 4095, 500_000, 1_000_001)]
        second = [Extent(0, 2_000_003, 1 << 20, 0), Extent(1, 0, 1 << 20, 1 << 20)]
        dst1 = torch.zeros(1_500_001, dtype=torch.uint8)
        dst2 = torch.zeros(2 << 20, dtype=torch.uint8)
        seen = []
        lock = threading.Lock()

        def progress(n):
            with lock:
                seen.append(n)

        wait1 = ring.submit(first, [dst1], progress)
        wait2 = ring.submit(second, [dst2], progress)  # queued behind the first, no drain in between
        wait2()
        wait1()
        for dst, extents in ((dst1, first), (dst2, second)):
            for e in extents:
                got = bytes(dst[e.offset : e.offset + e.length].numpy())
                assert got == data[e.file_index][e.file_offset : e.file_offset + e.length]
        assert sum(seen) == sum(e.length for e in first + second)
        assert max(seen) <= 64 << 10
        assert len(ring._workers) == 3
    finally:
        ring.close()
        _close(files)
    assert ring._workers == []


def test_a_truncated_file_fails_its_group_only(tmp_path):
    files, data = _files(tmp_path, [1 << 20], direct=False)
    ring = StagingRing(torch.device("cpu"), files, threads=2, chunk=PAGE * 4)
    try:
        os.truncate(files[0].path, 100_000)
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        with pytest.raises(TruncatedFileError, match=r"f0\.bin.*shrank"):
            ring.submit([Extent(0, 0, 1 << 20, 0)], [dst])()
        ok = torch.zeros(50_000, dtype=torch.uint8)
        ring.submit([Extent(0, 10, 50_000, 0)], [ok])()  # the ring still serves the next group
        assert bytes(ok.numpy()) == data[0][10:50_010]
    finally:
        ring.close()
        _close(files)


def test_staging_is_bounded_and_threads_start_with_work(tmp_path):
    files, data = _files(tmp_path, [PAGE * 10], direct=False)
    ring = StagingRing(torch.device("cpu"), files, threads=8, chunk=PAGE * 4, buffers=2)
    try:
        assert ring.staging_bytes == 8 * 2 * (PAGE * 4 + 2 * PAGE)
        ring.submit([], [torch.zeros(0, dtype=torch.uint8)])()  # nothing to do: no thread starts
        assert ring._workers == []
        dst = torch.zeros(PAGE * 10, dtype=torch.uint8)
        ring.submit([Extent(0, 0, PAGE * 10, 0)], [dst])()  # three chunks: three threads, not eight
        assert len(ring._workers) == 3 and bytes(dst.numpy()) == data[0]
    finally:
        ring.close()
        _close(files)
    with pytest.raises(ValueError, match="bad ring shape"):
        StagingRing(torch.device("cpu"), files, threads=0, chunk=PAGE)


def test_reads_go_file_by_file_or_interleaved():
    extents = [Extent(0, 0, 3 * PAGE, 0), Extent(1, 0, 2 * PAGE, 3 * PAGE)]
    order = [(c.file_index, c.file_offset) for c in split_extents(extents, PAGE, interleave=False)]
    assert order == [(0, 0), (0, PAGE), (0, 2 * PAGE), (1, 0), (1, PAGE)]
    order = [(c.file_index, c.file_offset) for c in split_extents(extents, PAGE)]
    assert order == [(0, 0), (1, 0), (0, PAGE), (1, PAGE), (0, 2 * PAGE)]


def test_stream_order_keeps_that_many_sequential_streams():
    chunks = [Extent(0, i * PAGE, PAGE, i * PAGE) for i in range(7)]
    assert [c.file_offset // PAGE for c in stream_order(chunks, 1)] == list(range(7))
    # Three stripes (0-1, 2-3, 4-6) take turns: each stripe's chunks stay in order.
    assert [c.file_offset // PAGE for c in stream_order(chunks, 3)] == [0, 2, 4, 1, 3, 5, 6]
    assert [c.file_offset // PAGE for c in stream_order(chunks, 99)] == list(range(7))
    assert stream_order([], 4) == []


def test_aligned_split_cuts_at_multiples_of_the_chunk():
    from gdsload.loader.plan import Extent, split_extents

    e = Extent(file_index=0, file_offset=100, length=3 * PAGE, offset=7)
    pieces = split_extents([e], PAGE, interleave=False, aligned=True)
    assert [(p.file_offset, p.length, p.offset) for p in pieces] == [
        (100, PAGE - 100, 7),
        (PAGE, PAGE, 7 + PAGE - 100),
        (2 * PAGE, PAGE, 7 + 2 * PAGE - 100),
        (3 * PAGE, 100, 7 + 3 * PAGE - 100),
    ]
    # Aligned already: the same cuts as without ``aligned``; empty extents give no reads.
    f = Extent(file_index=1, file_offset=2 * PAGE, length=2 * PAGE + 5, offset=0)
    assert split_extents([f], PAGE, interleave=False, aligned=True) == split_extents([f], PAGE, interleave=False)
    assert split_extents([Extent(0, 100, 0, 0)], PAGE, aligned=True) == []


def test_pinned_ring_reader_count_follows_what_it_serves():
    from gdsload.loader.io import ReadOptions
    from gdsload.loader.io.pinned import PinnedBackend

    def wanted(readers, direct, threads=None):
        b = PinnedBackend(torch.device("cuda"), ReadOptions(num_threads=threads))
        b._reader_of, b._direct = readers, direct
        return b.ring_threads()

    assert wanted(["ring", "ring"], [True, True]) == PinnedBackend.RING_THREADS_COLD == 4
    assert wanted(["ring", "kvikio"], [True, False]) == 4  # the cached file goes to kvikio
    assert wanted(["ring", "ring"], [True, False]) == PinnedBackend.RING_THREADS_CACHED == 16
    assert wanted(["ring"], [True], threads=9) == 9  # asked for: taken as is


@pytest.mark.parametrize("switch", [True, False])
def test_pinned_reads_an_all_cold_rank_through_kvikio_with_o_direct_when_kvikio_can(tmp_path, monkeypatch, switch):
    from kvikio_stand_in import stand_in_kvikio as _stand_in_kvikio

    from gdsload.loader import discover, plan_rank, save_file
    from gdsload.loader.io import ReadOptions
    from gdsload.loader.io.pinned import PinnedBackend
    from gdsload.loader.io.iomode import o_direct_supported
    from gdsload.loader.io.pagecache import evict, resident_fraction

    seen = _stand_in_kvikio(monkeypatch, direct_switch=switch)
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(4 << 20, dtype=torch.int32), "b": torch.ones(3)}, path)
    if not o_direct_supported(str(path)):
        pytest.skip("this file system refuses O_DIRECT")
    evict([str(path)])
    if resident_fraction([str(path)]) > 0.1:
        pytest.skip("the page cache could not be emptied here")
    plan = plan_rank(discover(path, 0))
    b = PinnedBackend(torch.device("cuda"), ReadOptions())
    b.open(plan)
    b.close()
    assert b.direct_io() == [True]
    if switch:  # kvikio's reader, O_DIRECT, the cold shape
        assert b.kvikio_direct and b.readers() == ["kvikio"]
        assert seen["settings"] == [
            {
                "compat_mode": "ON",
                "num_threads": 4,
                "task_size": 2 << 20,
                "bounce_buffer_size": 2 << 20,
                "auto_direct_io_read": True,
            }
        ]
    else:  # a kvikio without the switch: our O_DIRECT ring
        assert not b.kvikio_direct and b.readers() == ["ring"] and seen["settings"] == []

    path.read_bytes()  # cached now: kvikio reads through the page cache
    seen["settings"].clear()
    b = PinnedBackend(torch.device("cuda"), ReadOptions())
    b.open(plan)
    b.close()
    assert not b.kvikio_direct and b.readers() == ["kvikio"] and b.direct_io() == [False]
    assert seen["settings"][0]["num_threads"] == 16 and seen["settings"][0].get("auto_direct_io_read") in (
        (False,) if switch else (None,)
    )
