"""The staged reader (loader/io/_staged.c) driven into host memory: the same threads, buffers, queue and
error paths as on a GPU, with memcpy in place of the device copy. On a GPU: tests/loader/io/test_gpu_readers.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import safetensors.torch
import torch

from gdsload.loader import TruncatedFileError, discover, plan_rank, save_file
from gdsload.loader.devices import as_device
from gdsload.loader.errors import FileUnreadableError
from gdsload.loader.io import staged
from gdsload.loader.io.staged import StagedPool, StagedReader

pytestmark = pytest.mark.skipif(staged.library_path() is None, reason="the staged reader was not built (no C compiler)")


@pytest.fixture
def blob(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, 9_000_001, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    yield data, fd, str(path)
    os.close(fd)


@pytest.mark.parametrize("threads,chunk,buffers", [(1, 4096, 1), (3, 1 << 20, 2), (8, 65536, 4), (2, 16 << 20, 3)])
def test_every_byte_lands_where_its_extent_says(blob, threads, chunk, buffers):
    data, fd, path = blob
    rng = np.random.default_rng(threads * 31 + buffers)
    cuts = np.sort(rng.choice(np.arange(1, data.size), 40, replace=False))
    bounds = [0, *cuts.tolist(), data.size]
    pieces = [(a, b - a) for a, b in zip(bounds, bounds[1:])]
    rng.shuffle(pieces)  # destinations in another order than the file: each extent goes to its own place
    out = np.zeros(data.size, np.uint8)
    expect = np.zeros(data.size, np.uint8)
    items, at = [], 0
    for off, n in pieces:
        items.append((fd, off, n, out.ctypes.data + at))
        expect[at : at + n] = data[off : off + n]
        at += n
    done: list[int] = []
    with StagedPool(None, threads=threads, chunk=chunk, buffers=buffers) as eng:
        eng.submit(items, [path] * len(items), done.append)()
    assert np.array_equal(out, expect)
    assert sum(done) == data.size and all(d > 0 for d in done)


def test_tickets_in_flight_together_finish_each_with_its_own_bytes(blob):
    data, fd, path = blob
    outs = [np.zeros(3_000_000, np.uint8) for _ in range(3)]
    with StagedPool(None, threads=4, chunk=256 << 10, buffers=2) as eng:
        waits = [eng.submit([(fd, i * 3_000_000, 3_000_000, o.ctypes.data)], [path]) for i, o in enumerate(outs)]
        for w in reversed(waits):  # waited for out of order
            w()
    for i, o in enumerate(outs):
        assert np.array_equal(o, data[i * 3_000_000 : (i + 1) * 3_000_000])


def test_a_range_past_the_end_names_the_file_and_the_pool_goes_on(blob):
    data, fd, path = blob
    out = np.zeros(data.size + 5000, np.uint8)
    with StagedPool(None, threads=2, chunk=1 << 20, buffers=2) as eng:
        with pytest.raises(TruncatedFileError, match=rf"'{path}'.*ends at byte 9000001.*shrank"):
            eng.submit([(fd, 0, data.size + 5000, out.ctypes.data)], [path])()
        eng.submit([(fd, 0, data.size, out.ctypes.data)], [path])()  # the next ticket is read in full
    assert np.array_equal(out[: data.size], data)


def test_a_read_error_names_the_file_and_errno(tmp_path):
    out = np.zeros(10, np.uint8)
    r, w = os.pipe()  # pread on a pipe fails with ESPIPE
    try:
        with StagedPool(None, threads=1, chunk=4096, buffers=1) as eng:
            with pytest.raises(FileUnreadableError, match=r"'/models/a.safetensors' at byte 0: .*ESPIPE"):
                eng.submit([(r, 0, 10, out.ctypes.data)], ["/models/a.safetensors"])()
    finally:
        os.close(r)
        os.close(w)


def test_bad_shapes_and_the_off_switch(monkeypatch):
    with pytest.raises(ValueError, match="threads=0"):
        StagedPool(None, threads=0, chunk=1 << 20)
    with pytest.raises(ValueError, match="chunk=100"):
        StagedPool(None, threads=1, chunk=100)
    assert staged.unavailable() is None
    monkeypatch.setenv("GDSLOAD_STAGED", "0")
    assert "GDSLOAD_STAGED" in staged.unavailable()


def test_a_plan_read_through_the_pool_matches_safetensors(tmp_path):
    tensors = {f"w{i}": torch.randn(1000 + 37 * i, 65).to(torch.bfloat16) for i in range(6)}
    tensors["ids"] = torch.arange(12345, dtype=torch.int64)
    save_file(dict(list(tensors.items())[:3]), tmp_path / "model-00001-of-00002.safetensors")
    save_file(dict(list(tensors.items())[3:]), tmp_path / "model-00002-of-00002.safetensors")
    plan = plan_rank(discover(tmp_path, 0))
    try:
        dev = as_device("cpu")
        arena = torch.empty(plan.arena_bytes, dtype=torch.uint8)
        reader = StagedReader(dev, plan, threads=3, chunk=64 << 10, buffers=2)
        try:
            reader.submit(plan.extents, [arena])()
        finally:
            reader.close()
        ref = {}
        for f in sorted(tmp_path.glob("*.safetensors")):
            ref.update(safetensors.torch.load_file(f))
        for p in plan.placements:
            assert p.copy_from is None
            got = arena[p.offset : p.offset + p.nbytes].view(ref[p.name].dtype).reshape(ref[p.name].shape)
            assert torch.equal(got.view(torch.uint8), ref[p.name].view(torch.uint8)), p.name
        with pytest.raises(ValueError, match="does not fit"):
            StagedReader(dev, plan, threads=1).submit(plan.extents, [arena[:100]])
    finally:
        plan.close()


def test_loads_share_the_process_pool_until_it_is_released(blob):
    data, fd, path = blob
    first = staged.shared_pool(None, threads=2, chunk=1 << 20, buffers=2)
    assert staged.shared_pool(None, threads=2, chunk=1 << 20, buffers=2) is first
    assert staged.shared_pool(None, threads=3, chunk=1 << 20, buffers=2) is not first  # another shape
    out = np.zeros(data.size, np.uint8)
    first.submit([(fd, 0, data.size, out.ctypes.data)], [path])()
    assert np.array_equal(out, data)
    staged.release()
    assert first._handle is None  # stopped, its buffers freed
    again = staged.shared_pool(None, threads=2, chunk=1 << 20, buffers=2)
    assert again is not first
    out[:] = 0
    again.submit([(fd, 0, data.size, out.ctypes.data)], [path])()
    assert np.array_equal(out, data)
    staged.release()


def test_a_forked_child_makes_its_own_pool(blob):
    data, fd, path = blob
    parent = staged.shared_pool(None, threads=2, chunk=1 << 20, buffers=2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's threads are not here, so it must not reuse the parent's pool
        ok = 0
        try:
            child = staged.shared_pool(None, threads=2, chunk=1 << 20, buffers=2)
            out = np.zeros(data.size, np.uint8)
            child.submit([(fd, 0, data.size, out.ctypes.data)], [path])()
            ok = int(child is not parent and np.array_equal(out, data))
        finally:
            os.write(w, bytes([ok]))
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"\x01"
    staged.release()


def test_threads_started_ahead_of_the_first_ticket_read_it_whole(blob):
    data, fd, path = blob
    out = np.zeros(data.size, np.uint8)
    with StagedPool(None, threads=4, chunk=1 << 20, buffers=2) as eng:
        eng.start()
        eng.start()  # a second start changes nothing
        eng.submit([(fd, 0, data.size, out.ctypes.data)], [path])()
    assert np.array_equal(out, data)


class _Cuda:
    """Just what ``staged.prepare`` asks of a device."""

    kind, index = "cuda", 3


def test_prepare_starts_the_pool_only_where_it_will_read(monkeypatch, blob):
    _, _, path = blob
    started: list[tuple] = []

    class Recorder:
        def __init__(self, *key):
            self.key = key

        def start(self):
            started.append(self.key)

    monkeypatch.setattr(staged, "shared_pool", lambda index, **shape: Recorder(index, *sorted(shape.items())))
    cold = {"value": False}
    monkeypatch.setattr("gdsload.loader.io.pagecache.is_cold", lambda *paths: cold["value"])

    staged.prepare(_Cuda(), [path], threads=5)
    assert started == [(3, ("buffers", staged.DEFAULT_BUFFERS), ("chunk", staged.DEFAULT_CHUNK), ("threads", 5))]
    staged.prepare(as_device("cpu"), [path])  # host memory: the reader makes its own pool when it needs one
    staged.prepare(_Cuda(), [])
    cold["value"] = True
    staged.prepare(_Cuda(), [path])  # a cold rank is read with O_DIRECT by another pool
    monkeypatch.setenv("GDSLOAD_STAGED", "0")
    cold["value"] = False
    staged.prepare(_Cuda(), [path])
    assert len(started) == 1


def test_a_load_prepares_its_reader_with_the_rank_files(monkeypatch, tmp_path):
    from gdsload.loader import load_rank
    from gdsload.loader.io.cpu import CpuBackend

    save_file({"w": torch.arange(10, dtype=torch.float32)}, tmp_path / "model.safetensors")
    seen: list[tuple[str, ...]] = []
    monkeypatch.setattr(CpuBackend, "prepare", lambda self, paths: seen.append(tuple(paths)), raising=False)
    result = load_rank(tmp_path, 0, device="cpu", backend="cpu")
    assert seen == [(str(tmp_path / "model.safetensors"),)]
    assert torch.equal(result.tensors["w"], torch.arange(10, dtype=torch.float32))


def test_a_gpu_pool_without_a_driver_says_which_call_failed():
    """The pool, the decoder's streams and a sidecar worker retain a GPU's primary context through one helper;
    where the driver does not load or refuses, the pool's error names the driver call."""
    import ctypes

    from gdsload.loader.devices import PrimaryContext, _driver_stream

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(staged.StagedReaderError, match=r"libcuda\.so\.1\) does not load"):
            StagedPool(0, threads=1, chunk=1 << 16)
        assert _driver_stream(0) is None  # torch makes the stream then
        return
    ctx = PrimaryContext(0)
    assert ctx.handle and ctx.new_stream() != ctx.new_stream()
    ctx.release()
    assert ctx.handle is None
    with pytest.raises(
        staged.StagedReaderError, match=r"cuDeviceGet failed for CUDA device 4096: CUDA_ERROR_INVALID_DEVICE"
    ):
        StagedPool(4096, threads=1, chunk=1 << 16)
