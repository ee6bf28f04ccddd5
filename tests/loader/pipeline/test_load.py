"""load_rank on the CPU backend: discovery, planning, reading, views, reports, verification."""

from __future__ import annotations

import json
import time
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from tensor_cases import _misaligned_file
from gdsload.loader.pipeline.result import PHASES
from gdsload.loader import (
    BackendUnavailableError,
    ConfigError,
    FileUnreadableError,
    HeaderError,
    IntegrityError,
    LoadConfig,
    ManifestError,
    NoFilesForRankError,
    TruncatedFileError,
    discover,
    load_rank,
    plan_rank,
    save_file,
    write_manifest,
)


def _reference(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(str(f)))
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("rank, backend", [(0, None), (1, None), (1, "cpu")])
def test_load_rank_matches_safetensors(sharded_dir, rank, backend):
    """Host memory: ``auto`` maps cached files (``mmap``); ``cpu`` reads them into an arena. Same bytes either way.
    (The reference is read first, so the files are cached whatever tests that evict them ran before.)"""
    ref = {k: v for k, v in _reference(sharded_dir).items() if k.startswith(f"r{rank}.")}
    start = time.perf_counter()
    result = load_rank(sharded_dir, rank, verify=True, backend=backend)
    wall = time.perf_counter() - start
    assert set(result.tensors) == set(ref)
    for name, t in ref.items():
        assert _same_bits(result.tensors[name], t), name
    r = result.report
    ran = backend or "mmap"
    assert r.rank == rank and r.backend == ran and r.source == "manifest" and r.verified
    assert [Path(f.path).name for f in r.files] == [f"model-rank-{rank}-part-{p}.safetensors" for p in (0, 1)]
    assert all(f.io_mode == ran and f.data_aligned and f.copied_tensors == 0 for f in r.files)
    assert r.logical_bytes == r.stored_bytes == sum(t.nbytes for t in ref.values())
    # the phases are laps of one clock: they add up to the call, set-up and tear-down included
    assert tuple(r.phases) == PHASES and all(v >= 0 for v in r.phases.values())
    assert r.seconds <= wall < r.seconds + 0.05, (r.phases, wall)
    assert r.seconds > 0 and r.gbps > 0
    assert f"rank {rank}:" in r.summary() and f"backend={ran} io={ran} files=2" in r.summary()
    json.dumps(r.to_dict())


def test_tensors_are_views_into_one_arena(sharded_dir):
    result = load_rank(sharded_dir, 0, backend="cpu")
    (arena,) = result.arenas
    base = arena.untyped_storage().data_ptr()
    for name, t in result.tensors.items():
        if t.numel():
            assert t.untyped_storage().data_ptr() == base, name
    plan = plan_rank(discover(sharded_dir, 0))
    assert arena.numel() == plan.arena_bytes


def test_a_load_sets_off_no_garbage_collection_and_leaves_the_collector_as_it_was(tmp_path):
    """Thousands of tensors make enough objects to set off dozens of collections (one per 700 allocations by
    default); only the one the collector runs as it comes back on is seen, and the collector is as the caller
    left it afterwards, threads or not."""
    import gc
    import threading

    from gdsload.loader import save_file

    save_file({f"t{i}": torch.full((3,), float(i)) for i in range(3000)}, tmp_path / "many.safetensors")
    collections: list[int] = []
    record = lambda phase, info: phase == "start" and collections.append(info["generation"])  # noqa: E731
    gc.callbacks.append(record)
    try:
        result = load_rank(tmp_path, 0)
        assert len(collections) <= 1 and gc.isenabled()
        assert torch.equal(result.tensors["t2999"], torch.full((3,), 2999.0))
        gc.disable()
        try:
            load_rank(tmp_path, 0)
            assert not gc.isenabled()
        finally:
            gc.enable()
        threads = [threading.Thread(target=lambda: [load_rank(tmp_path, 0) for _ in range(3)]) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(record)


def test_a_child_forked_while_a_load_runs_has_its_garbage_collector():
    import gc

    from gdsload.loader.config import gc_paused

    with gc_paused():
        assert not gc.isenabled()
        pid = os.fork()
        if pid == 0:  # the child: the load's thread is not there to end the pause
            ok = gc.isenabled()
            with gc_paused():  # and pauses still work there
                ok = ok and not gc.isenabled()
            os._exit(0 if ok and gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and gc.isenabled()


def test_closing_a_plan_twice_closes_its_files_once(sharded_dir):
    plan = plan_rank(discover(sharded_dir, 0))
    fds = list(plan.fds)
    plan.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    reused = [os.open(os.devnull, os.O_RDONLY) for _ in fds]  # likely the same numbers
    try:
        plan.close()
        for fd in reused:
            os.fstat(fd)  # still open
    finally:
        for fd in reused:
            os.close(fd)


def test_many_views_at_once_are_the_views_one_at_a_time():
    from gdsload.loader.devices import as_device

    dev = as_device("cpu")
    arena = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    # A destination that starts inside its storage (an engine's parameter) and one whose size no dtype divides.
    slices = [
        (0, 0, 64, "BF16", (4, 8)),
        (0, 64, 4, "F32", ()),
        (0, 128, 0, "F16", (0, 3)),
        (0, 130, 6, "F16", (3,)),
        (1, 4, 8, "I32", (2,)),
        (2, 8, 16, "F32", (2, 2)),
        (0, 2, 4, "I16", (2,)),
        (3, 2, 4, "I16", (2, 1)),
        (4, 2, 4, "F32", (1,)),
        (5, 2, 6, "U8", (2, 3)),
    ]
    # Buffers the fast path must leave to view(): one starting 2 bytes into its storage, one strided.
    bufs = [arena, arena[4:4099], arena[16:], arena[4:4100], arena[2:4098], arena[::2]]
    many, one = dev.views(bufs, slices), [dev.view(bufs[b][o : o + n], d, s) for b, o, n, d, s in slices]
    for (b, o, n, d, s), x, y in zip(slices, many, one):
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride(), (b, o, d)
        assert torch.equal(x, y) and (not n or x.data_ptr() == y.data_ptr()), (b, o, d)


@pytest.mark.parametrize("threads, chunk", [(1, 4096), (3, 4096), (8, 1 << 20)])
def test_threads_and_chunk_sizes_give_identical_bytes(sharded_dir, threads, chunk):
    done = []
    result = load_rank(sharded_dir, 1, backend="cpu", num_threads=threads, chunk_bytes=chunk, progress=done.append)
    ref = _reference(sharded_dir)
    for name, t in result.tensors.items():
        assert _same_bits(t, ref[name]), name
    assert sum(done) == result.report.stored_bytes
    assert max(done) <= chunk


def test_foreign_misaligned_files_load_and_are_counted(tmp_path):
    path = tmp_path / "foreign.safetensors"
    tensors = _misaligned_file(path)
    ref = safetensors.torch.load_file(str(path))  # the reference reads it too
    result = load_rank(path)
    for name, t in tensors.items():
        assert _same_bits(result.tensors[name], t) and _same_bits(result.tensors[name], ref[name]), name
    (f,) = result.report.files
    assert f.copied_tensors == 3 and not f.data_aligned
    assert "copied=3" in result.report.summary()


def test_vllm_trtllm_and_plain_directories_load_without_manifest(tmp_path, sharded_dir):
    vllm = tmp_path / "vllm"
    shutil.copytree(sharded_dir, vllm)
    (vllm / "gdsload.json").unlink()
    rf = discover(vllm, 1)
    assert (
        rf.source == "vllm"
        and rf.tp_size == 2
        and [Path(p).name for p in rf.files] == ["model-rank-1-part-0.safetensors", "model-rank-1-part-1.safetensors"]
    )
    assert load_rank(vllm, 1).report.source == "vllm"

    trt = tmp_path / "trt"
    trt.mkdir()
    for r in range(3):
        save_file({f"w{r}": torch.full((4,), float(r))}, trt / f"rank{r}.safetensors")
    assert discover(trt, 2).tp_size == 3
    assert torch.equal(load_rank(trt, 2).tensors["w2"], torch.full((4,), 2.0))
    (trt / "rank1.safetensors").unlink()  # a gap: a partial copy, or a host given only some ranks
    assert torch.equal(load_rank(trt, 0).tensors["w0"], torch.zeros(4))
    with pytest.raises(NoFilesForRankError, match="rank 1's files are missing although higher ranks are here"):
        discover(trt, 1)

    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"x": torch.ones(2)}, plain / "model-00001-of-00002.safetensors")
    save_file({"y": torch.zeros(3)}, plain / "model-00002-of-00002.safetensors")
    (plain / ".model.safetensors.tmp-1").write_bytes(b"junk")  # a leftover temp file is ignored
    res = load_rank(plain)
    assert set(res.tensors) == {"x", "y"} and res.report.source == "plain"


def test_load_config_parses_sizes_exactly_and_names_the_variable():
    from gdsload.loader.config import parse_size
    from gdsload.loader.pipeline.config import LoadConfig

    assert (parse_size("2.01GB"), parse_size("2.03KB"), parse_size("16MiB"), parse_size(5)) == (
        2_010_000_000,
        2030,
        16 << 20,
        5,
    )
    for bad in (-5, True, 1.5, "\u0663MB"):
        with pytest.raises(ConfigError, match="is not a size"):
            parse_size(bad)
    for env, words in (
        ({"GDSLOAD_NUM_THREADS": "0"}, "GDSLOAD_NUM_THREADS: num_threads=0"),
        ({"GDSLOAD_CHUNK_BYTES": "4M"}, "GDSLOAD_CHUNK_BYTES: chunk_bytes=4000000"),
        ({"GDSLOAD_NUM_THREADS": "\u00b2"}, "is not an integer"),
    ):
        with pytest.raises(ConfigError, match=words):
            LoadConfig.resolve(env=env)
    assert LoadConfig.resolve(env={"GDSLOAD_NUM_THREADS": "0"}, num_threads=4).num_threads == 4  # the flag wins


def test_a_file_replaced_or_removed_after_planning_is_still_the_file_loaded(tmp_path, sharded_dir):
    """The plan holds every file open from its header read on: the data is that file's, whatever the path
    becomes meanwhile, and no descriptor is left open."""
    d = tmp_path / "m"
    shutil.copytree(sharded_dir, d)
    victim = d / "model-rank-0-part-1.safetensors"
    want = {k: v.clone() for k, v in safetensors.torch.load_file(str(victim)).items()}
    other = tmp_path / "other.safetensors"
    save_file({k: torch.zeros_like(v) for k, v in want.items()}, other)
    before = len(os.listdir("/proc/self/fd"))
    for change in ("remove", "replace"):

        def swap(plan, change=change):
            if change == "remove":
                victim.rename(victim.with_suffix(".gone"))
            else:
                os.replace(other, victim)

        result = load_rank(d, 0, on_plan=swap)
        for name, t in want.items():
            assert _same_bits(result.tensors[name], t), (change, name)
        result.close()
        if change == "remove":
            victim.with_suffix(".gone").rename(victim)
    assert len(os.listdir("/proc/self/fd")) == before


def test_an_unreadable_file_is_typed(tmp_path, sharded_dir):
    d = tmp_path / "m"
    shutil.copytree(sharded_dir, d)
    victim = d / "model-rank-0-part-1.safetensors"
    victim.chmod(0)
    try:
        if os.access(victim, os.R_OK):
            pytest.skip("this user reads files whatever their mode (root without dropped capabilities)")
        with pytest.raises(FileUnreadableError, match="model-rank-0-part-1.safetensors.*cannot be opened"):
            load_rank(d, 0)
    finally:
        victim.chmod(0o644)


def test_bad_arguments_are_config_errors(sharded_dir):
    for kwargs, words in (
        ({"rank": -1}, "rank must be a non-negative integer"),
        ({"rank": True}, "got True"),
        ({"device": "gpu"}, "device='gpu' is not a torch device"),
    ):
        with pytest.raises(ConfigError, match=words):
            load_rank(sharded_dir, **{"rank": 0, **kwargs})


def test_missing_rank_names_what_is_there(tmp_path, sharded_dir):
    with pytest.raises(
        NoFilesForRankError, match=r"No files for rank 3 .* holds ranks 0-1 — was it sharded for tp=2\?"
    ):
        load_rank(sharded_dir, 3)
    vllm = tmp_path / "vllm"
    shutil.copytree(sharded_dir, vllm)
    (vllm / "gdsload.json").unlink()
    with pytest.raises(NoFilesForRankError, match="model-rank-\\{rank\\}-part-\\{part\\}"):
        load_rank(vllm, 2)
    (vllm / "model-rank-1-part-0.safetensors").unlink()
    with pytest.raises(NoFilesForRankError, match=r"rank 1 .* has parts \[1\] but not \[0\]"):
        discover(vllm, 1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rank(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoFilesForRankError, match="no .safetensors files"):
        load_rank(tmp_path / "empty")
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"x": torch.ones(1)}, plain / "model.safetensors")
    with pytest.raises(NoFilesForRankError, match="gdsload shard"):
        load_rank(plain, 1)


def test_manifest_problems_are_typed(tmp_path, sharded_dir):
    d = tmp_path / "m"
    shutil.copytree(sharded_dir, d)
    doc = json.loads((d / "gdsload.json").read_text())
    (d / "gdsload.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_rank(d)
    for mutate, match in [
        (lambda m: m.update(format_version=99), "format_version 99"),
        (lambda m: m.update(tp_size=3), r"ranks \[2\] have no files"),
        (lambda m: m["ranks"]["0"][0].update(path="../escape.safetensors"), "inside the directory"),
        (lambda m: m.update(layout="weird"), "layout 'weird'"),
        (lambda m: m.update(extra="x"), "'extra' must be an object"),
        (lambda m: m["ranks"].__setitem__("00", m["ranks"]["0"]), "rank key '00' is not a rank"),
        (lambda m: m["ranks"].__setitem__("\u00b2", m["ranks"]["0"]), "is not a rank"),
        (lambda m: m["ranks"]["0"].__setitem__(0, "x.safetensors"), "file entry 'x.safetensors' is malformed"),
    ]:
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        (d / "gdsload.json").write_text(json.dumps(bad))
        with pytest.raises(ManifestError, match=match):
            load_rank(d)
    (d / "gdsload.json").write_text(json.dumps(doc))
    (d / "model-rank-0-part-1.safetensors").unlink()
    with pytest.raises(ManifestError, match="file is missing"):
        load_rank(d, 0)


def test_verify_matches_manifest_paths_written_with_dot_slash(tmp_path, sharded_dir):
    d = tmp_path / "dot"
    shutil.copytree(sharded_dir, d)
    doc = json.loads((d / "gdsload.json").read_text())
    for files in doc["ranks"].values():
        for f in files:
            f["path"] = "./" + f["path"]
    (d / "gdsload.json").write_text(json.dumps(doc))
    assert load_rank(d, 0, verify=True).report.verified is True
    victim = d / "model-rank-0-part-1.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="does not match"):
        load_rank(d, 0, verify=True)


def test_verify_catches_a_changed_file(tmp_path, sharded_dir):
    d = tmp_path / "v"
    shutil.copytree(sharded_dir, d)
    victim = d / "model-rank-0-part-1.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF  # flip bits in the last tensor's data: the header still parses
    victim.write_bytes(bytes(raw))
    assert load_rank(d, 0, verify=False).report.verified is False
    with pytest.raises(IntegrityError, match="model-rank-0-part-1.safetensors.*does not match"):
        load_rank(d, 0, verify=True)
    assert load_rank(d, 1, verify=True).report.verified


def test_verify_without_digests_or_checksums(tmp_path):
    """A file of another writer, no manifest: the default load says nothing was checked; verify=True refuses it."""
    import safetensors.torch

    safetensors.torch.save_file({"x": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    report = load_rank(tmp_path).report
    assert report.verified is False and report.verification["unchecked_tensors"] == 1
    with pytest.raises(IntegrityError, match=r"model.safetensors.*verify was asked for, but 1 of its tensors cannot"):
        load_rank(tmp_path, verify=True)
    save_file({"x": torch.ones(2)}, tmp_path / "model.safetensors")  # gdsload's writer records a checksum
    assert load_rank(tmp_path, verify=True).report.verified is True


def test_duplicate_tensor_across_files_of_a_rank(tmp_path):
    save_file({"x": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"x": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(HeaderError, match="appears in both"):
        load_rank(tmp_path)


def test_backend_selection(sharded_dir):
    with pytest.raises(ConfigError, match="backend='nope' is not known"):
        load_rank(sharded_dir, backend="nope")
    with pytest.raises(BackendUnavailableError, match="no backend can load to 'meta'.*'cpu' or 'cuda:N'"):
        load_rank(sharded_dir, backend="cpu", device="meta")
    with pytest.raises(BackendUnavailableError, match="no backend can load to 'meta'"):
        load_rank(sharded_dir, device="meta")
    with pytest.raises(BackendUnavailableError, match="backend 'pinned' cannot load to 'cpu'.*auto"):
        load_rank(sharded_dir, backend="pinned", device="cpu")


def test_config_precedence_and_validation():
    env = {
        "GDSLOAD_NUM_THREADS": "3",
        "GDSLOAD_CHUNK_BYTES": "1MiB",
        "GDSLOAD_VERIFY": "yes",
        "GDSLOAD_STAGING_BYTES": "2GiB",
    }
    cfg = LoadConfig.resolve(env)
    assert (cfg.num_threads, cfg.chunk_bytes, cfg.verify, cfg.backend, cfg.staging_bytes) == (
        3,
        1 << 20,
        True,
        "auto",
        2 << 30,
    )
    assert LoadConfig.resolve({}).staging_bytes == 960 << 20
    assert LoadConfig.resolve(env, num_threads=5, verify=None).num_threads == 5
    assert LoadConfig.resolve({}) == LoadConfig()
    for env, match in [
        ({"GDSLOAD_NUM_THREADS": "many"}, "not an integer"),
        ({"GDSLOAD_NUM_THREADS": "0"}, r"num_threads=0 must be an integer in 1..256"),
        ({"GDSLOAD_CHUNK_BYTES": "lots"}, "GDSLOAD_CHUNK_BYTES 'lots' is not a size"),
        ({"GDSLOAD_CHUNK_BYTES": "1"}, "between 4 KiB and 1 GiB"),
        ({"GDSLOAD_VERIFY": "maybe"}, "not a boolean"),
        ({"GDSLOAD_BACKEND": "warp"}, "backend='warp' is not known"),
        ({"GDSLOAD_STAGING_BYTES": "64KiB"}, r"GDSLOAD_STAGING_BYTES: staging_bytes=65536 must be at least 1 MiB"),
    ]:
        with pytest.raises(ConfigError, match=match):
            LoadConfig.resolve(env)
    with pytest.raises(TypeError, match="unknown load option"):
        LoadConfig.resolve({}, threads=2)


def test_file_shrinking_during_read_is_an_error(tmp_path, monkeypatch):
    save_file({"x": torch.ones(4096)}, tmp_path / "model.safetensors")
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: 0)
    with pytest.raises(TruncatedFileError, match="shrank while it was being loaded"):
        load_rank(tmp_path, backend="cpu")


@pytest.mark.parametrize("backend", ["mmap", "cpu"])
def test_file_cut_short_after_its_header_was_read_is_an_error(tmp_path, backend):
    """A file truncated in place between planning and reading: a typed error, never tensors over pages that
    are gone (a mapped tensor there would kill the process with SIGBUS when read)."""
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4096), "b": torch.ones(4096)}, path)

    def cut(plan):
        os.truncate(path, plan.files[0].header.data_offset + 4096)

    with pytest.raises(TruncatedFileError, match="shrank while it was being loaded|cut short after its header"):
        load_rank(tmp_path, backend=backend, on_plan=cut)


def test_empty_file_set_and_zero_byte_tensors(tmp_path):
    save_file({"e": torch.empty(0), "s": torch.tensor(3.0)}, tmp_path / "model.safetensors")
    res = load_rank(tmp_path)
    assert res.tensors["e"].shape == (0,) and res.tensors["s"].item() == 3.0
    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({}, empty / "model.safetensors")  # a file that holds no tensors at all
    res = load_rank(empty)
    assert res.tensors == {} and res.report.logical_bytes == 0


def test_manifest_round_trip(tmp_path):
    save_file({"x": torch.ones(8)}, tmp_path / "model-rank-0-part-0.safetensors")
    m = write_manifest(tmp_path, {0: ["model-rank-0-part-0.safetensors"]}, tp_size=1, layout="hf", extra={"k": 1})
    (entry,) = m.ranks[0]
    assert entry.bytes == (tmp_path / "model-rank-0-part-0.safetensors").stat().st_size
    assert entry.stored_bytes == entry.logical_bytes == 32 and entry.digest.startswith("blake3:")
    from gdsload.loader import Manifest

    assert Manifest.read(tmp_path) == m


def test_sampled_residency_tracks_the_exact_count(tmp_path):
    """The pinned backend's O_DIRECT decision uses a sampled mincore; it must agree with the full scan."""
    from gdsload.loader.io.pagecache import evict, resident_fraction

    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(1 << 20) * 64)  # 64 MiB: 16384 pages, sampled at 64 windows of 16 pages
    files = [str(path)]
    evict(files)
    if resident_fraction(files) > 0.05:
        pytest.skip("this file system keeps the file cached after eviction (tmpfs)")
    assert resident_fraction(files, samples=64) < 0.05
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead landing pages while the scans run
        os.pread(fd, 32 << 20, 0)  # the first half into the page cache
    finally:
        os.close(fd)
    exact, sampled = resident_fraction(files), resident_fraction(files, samples=64)
    assert 0.45 < exact < 0.75 and abs(sampled - exact) < 0.1
    # More samples than windows: the exact scan (within what the kernel moved between the scans around it)
    full, after = resident_fraction(files, samples=10_000), resident_fraction(files)
    assert min(exact, after) - 0.01 <= full <= max(exact, after) + 0.01


def test_on_plan_is_called_once_with_the_plan_before_any_bytes_are_read(sharded_dir):
    events: list = []
    result = load_rank(
        sharded_dir, 1, device="cpu", on_plan=lambda plan: events.append(plan), progress=lambda n: events.append(n)
    )
    plan = events[0]
    assert [type(e) for e in events].count(type(plan)) == 1 and len(events) > 1
    assert all(isinstance(e, int) for e in events[1:]) and sum(events[1:]) == sum(f.stored_bytes for f in plan.files)
    assert [f.path for f in plan.files] == [f.path for f in result.report.files]
    assert {p.name for p in plan.placements} == set(result.tensors)


def test_sampled_residency_weighs_files_by_size(tmp_path):
    """A small cached file must not make a large cold one look half warm (the sampled estimate)."""
    from gdsload.loader.io.pagecache import RESIDENCY_SAMPLES, evict, is_cold, resident_fraction

    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    big.write_bytes(os.urandom(64 << 20))
    small.write_bytes(os.urandom(RESIDENCY_SAMPLES * 16 * 4096 + 4096))  # just large enough to be sampled
    evict([str(big)])
    small.read_bytes()
    exact = resident_fraction([str(big), str(small)])
    if resident_fraction([str(big)]) > 0.05 or resident_fraction([str(small)]) < 0.9:
        pytest.skip("the page cache could not be set up here")
    sampled = resident_fraction([str(big), str(small)], samples=RESIDENCY_SAMPLES)
    assert abs(sampled - exact) < 0.05, (sampled, exact)
    assert is_cold(str(big), str(small))


# ----------------------------------------------------------------------------- destinations the caller owns


def _empty_like_all(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, 0) if v.dtype != torch.bool else torch.zeros_like(v) for k, v in ref.items()}


def test_into_reads_straight_into_the_callers_tensors(sharded_dir):
    ref = {k: v for k, v in _reference(sharded_dir).items() if k.startswith("r0.")}
    mine = _empty_like_all(ref)
    half = dict(list(mine.items())[: len(mine) // 2])  # the other half lands in the arena
    result = load_rank(sharded_dir, 0, into=half)
    assert set(result.tensors) == set(ref)
    for name, t in ref.items():
        assert _same_bits(result.tensors[name], t), name
    for name, t in half.items():
        assert result.tensors[name] is t and _same_bits(t, ref[name]), name  # the caller's own tensor, filled
    assert result.report.direct_tensors == len(half) and f"direct={len(half)}" in result.report.summary()
    whole = load_rank(sharded_dir, 0, into=_empty_like_all(ref))
    assert whole.arena.numel() == 0  # nothing left for an arena
    # nor for a mapping: every file's bytes were read into the caller's tensors, none mapped
    assert whole.arenas == [whole.arena] and {f.io_mode for f in whole.report.files} == {"cpu"}


def test_into_misaligned_and_compressed_tensors(tmp_path):
    from gdsload.loader.prepare.compress import compress_dir

    foreign = tmp_path / "foreign.safetensors"
    tensors = _misaligned_file(foreign)
    mine = {k: torch.empty_like(v) for k, v in tensors.items()}
    result = load_rank(foreign, into=mine)
    assert all(_same_bits(mine[k], v) for k, v in tensors.items())
    # every tensor read straight into its own destination: none of them is copied into place afterwards
    assert result.report.files[0].copied_tensors == 0 and result.report.direct_tensors == len(mine)
    assert load_rank(foreign).report.files[0].copied_tensors == 3  # without destinations, three are
    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    big = {"w": (0.02 * torch.randn(512, 256, generator=g)).to(torch.bfloat16), "n": torch.ones(7)}
    save_file(big, src / "model.safetensors")
    compress_dir(src, tmp_path / "z", codec="zstd", device="cpu")
    mine = {"w": torch.empty_like(big["w"])}
    result = load_rank(tmp_path / "z", into=mine)
    assert result.report.files[0].compressed_tensors == 1 and result.tensors["w"] is mine["w"]
    assert _same_bits(mine["w"], big["w"]) and _same_bits(result.tensors["n"], big["n"])


def test_staging_bytes_sizes_the_compressed_reads(tmp_path, monkeypatch):
    """``staging_bytes`` (argument or ``GDSLOAD_STAGING_BYTES``) is what the decode stage stages through:
    on the CPU one buffer of a third of it, never smaller than the largest stored tensor."""
    from gdsload.loader.prepare.compress import compress_dir

    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": (0.02 * torch.randn(256, 256, generator=g)).to(torch.bfloat16) for i in range(4)}
    save_file(tensors, src / "model.safetensors")
    compress_dir(src, tmp_path / "z", codec="zstd", device="cpu")
    assert load_rank(tmp_path / "z").report.staging_bytes == (960 << 20) // 3
    res = load_rank(tmp_path / "z", staging_bytes=3 << 20)
    assert res.report.staging_bytes == 1 << 20 and all(_same_bits(res.tensors[k], v) for k, v in tensors.items())
    monkeypatch.setenv("GDSLOAD_STAGING_BYTES", "6MiB")
    assert load_rank(tmp_path / "z").report.staging_bytes == 2 << 20
    assert load_rank(tmp_path / "z", staging_bytes=3 << 20).report.staging_bytes == 1 << 20  # the argument wins


def test_into_and_only_refuse_what_does_not_fit(sharded_dir):
    from gdsload.loader.plan import PlanError

    ref = {k: v for k, v in _reference(sharded_dir).items() if k.startswith("r0.")}
    name = "r0.p0.weight.bf16"
    with pytest.raises(PlanError, match=r"'r0.p0.weight.bf16' is BF16\[64, 33\] but its destination is F32\[64, 33\]"):
        load_rank(sharded_dir, 0, into={name: torch.empty(64, 33)})
    with pytest.raises(PlanError, match=r"not in rank 0 .*'nope'"):
        load_rank(sharded_dir, 0, into={"nope": torch.empty(1)})
    with pytest.raises(PlanError, match="'nope'"):
        load_rank(sharded_dir, 0, only=["nope"])
    with pytest.raises(ConfigError, match=r"into\['r0.p0.weight.bf16'\] is not contiguous"):
        load_rank(sharded_dir, 0, into={name: torch.empty(33, 64, dtype=torch.bfloat16).t()})
    with pytest.raises(ConfigError, match="must be a torch tensor"):
        load_rank(sharded_dir, 0, into={name: [1, 2]})
    only = load_rank(sharded_dir, 0, only=[name])
    assert list(only.tensors) == [name] and _same_bits(only.tensors[name], ref[name])
    assert only.report.logical_bytes == ref[name].numel() * ref[name].element_size()


def test_mmap_backend_hands_out_views_of_the_files(tmp_path, sharded_dir):
    result = load_rank(sharded_dir, 1, backend="mmap")
    ref = {k: v for k, v in _reference(sharded_dir).items() if k.startswith("r1.")}
    assert all(_same_bits(result.tensors[k], v) for k, v in ref.items())
    assert {f.io_mode for f in result.report.files} == {"mmap"} and result.arena.numel() == 0
    foreign = tmp_path / "foreign.safetensors"
    tensors = _misaligned_file(foreign)
    mapped = load_rank(foreign, backend="mmap")  # the misaligned ones are read into the arena
    assert all(_same_bits(mapped.tensors[k], v) for k, v in tensors.items())
    assert mapped.arena.numel() > 0
    mapped.tensors["b.f32"].add_(1)  # a private mapping: the file stays as it was
    assert _same_bits(load_rank(foreign).tensors["b.f32"], tensors["b.f32"])


def test_mmap_backend_reads_a_cold_rank_and_maps_a_cached_one(tmp_path):
    """Picked by ``auto``, the mmap backend reads a rank evicted from the page cache into an arena with the cpu
    backend's threads and maps it once cached; named explicitly, it maps a cold rank too. Same bytes as
    safetensors every time, every byte reported to ``progress``."""
    from gdsload.loader.io.pagecache import evict, resident_fraction

    path = tmp_path / "model.safetensors"
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(256, 1024 + i, generator=g) for i in range(6)}
    save_file(tensors, path)
    evict([str(path)])
    if resident_fraction([str(path)]) > 0.1:
        pytest.skip("this file system keeps the file cached after eviction (tmpfs)")
    for backend, mode in ((None, "cpu"), (None, "mmap"), ("mmap", "mmap")):  # cold, then cached by the first load
        if backend:  # named explicitly, it maps a cold rank too
            evict([str(path)])
        done: list[int] = []
        result = load_rank(tmp_path, backend=backend, progress=done.append)
        assert all(_same_bits(result.tensors[k], v) for k, v in tensors.items())
        assert sum(done) == result.report.stored_bytes
        assert result.report.backend == "mmap" and {f.io_mode for f in result.report.files} == {mode}
        assert (len(result.arenas) == 1) == (mode == "cpu")


def test_a_fresh_process_reports_torchs_import_apart_from_the_load(sharded_dir):
    """The first load in a process imports torch for its device: the report's ``import`` phase holds it, the phases
    still add up to the call, and GB/s are of the load's own time."""
    code = (
        "import json, sys; from gdsload.loader import load_rank; assert 'torch' not in sys.modules; "
        f"r = load_rank({str(sharded_dir)!r}, 0).report; "
        "print(json.dumps({'phases': r.phases, 'seconds': r.seconds, 'load': r.load_seconds, 'gbps': r.gbps, "
        "'bytes': r.logical_bytes, 'summary': r.summary()}))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["phases"]["import"] > 0.01, doc["phases"]  # torch's import: tens of ms at least
    assert abs(sum(doc["phases"].values()) - doc["seconds"]) < 1e-9
    assert abs(doc["load"] - (doc["seconds"] - doc["phases"]["import"])) < 1e-9
    assert abs(doc["gbps"] - doc["bytes"] / doc["load"] / 1e9) < 1e-9
    assert "importing the device's libraries first" in doc["summary"]
