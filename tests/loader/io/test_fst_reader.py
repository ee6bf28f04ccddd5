"""Cold ranks read by fastsafetensors' native reader: the run merging on the CPU, the loads on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from gdsload.loader import save_file
from gdsload.loader.io.fst_reader import file_runs, fst_reader_unavailable
from gdsload.loader.io.pagecache import evict, resident_fraction
from gdsload.loader.plan import Extent


def test_neighbouring_extents_go_as_one_request():
    extents = [
        Extent(0, 4096, 100, 0),
        Extent(0, 4196, 50, 100),  # contiguous in the file and the buffer: merged
        Extent(0, 5000, 10, 150),  # a gap in the file
        Extent(0, 5010, 10, 4096),  # contiguous in the file, not in the buffer
        Extent(1, 5020, 10, 4106),  # another file
        Extent(1, 6000, 0, 9000),  # empty: dropped
    ]
    assert file_runs(extents) == [
        Extent(0, 4096, 150, 0),
        Extent(0, 5000, 10, 150),
        Extent(0, 5010, 10, 4096),
        Extent(1, 5020, 10, 4106),
    ]


def test_without_fastsafetensors_the_reason_names_the_fix():
    try:
        import fastsafetensors  # noqa: F401
    except ImportError:
        assert "pip install 'gdsload[cu12]'" in fst_reader_unavailable()
    else:
        assert fst_reader_unavailable() is None


def _cold_model(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Three files on the machine's disk (odd sizes, several dtypes), evicted from the page cache."""
    d = tmp_path / "cold"  # tmp_path lies on the machine's disk, which accepts O_DIRECT
    d.mkdir()
    g = torch.Generator().manual_seed(3)
    ref: dict[str, torch.Tensor] = {}
    for part in range(3):
        t = {
            f"p{part}.w": (0.02 * torch.randn(1000 + part, 777, generator=g)).to(torch.bfloat16),
            f"p{part}.f32": torch.randn(333, 17, generator=g),
            f"p{part}.i8": torch.arange(1001, dtype=torch.int8),
        }
        save_file(t, d / f"model-rank-0-part-{part}.safetensors")
        ref.update(t)
    files = [str(p) for p in sorted(d.glob("*.safetensors"))]
    evict(files)
    if resident_fraction(files) > 0.1:
        pytest.skip("could not evict the files from the page cache here")
    return d, ref


def _cold_copy(tmp_path: Path, d: Path, codec: str) -> Path:
    """``d`` compressed with ``codec`` on the GPU, the copy evicted from the page cache."""
    from gdsload.loader.prepare.compress import compress_dir

    compress_dir(d, tmp_path / codec, codec=codec, device="cuda")
    files = [str(p) for p in sorted((tmp_path / codec).glob("*.safetensors"))]
    evict(files)
    if resident_fraction(files) > 0.1:
        pytest.skip("could not evict the files from the page cache here")
    return tmp_path / codec


def _spy(monkeypatch, module) -> list:
    """Record what make_fst_reader gave the backend (the real reader, observed)."""
    made: list = []
    real = module.make_fst_reader

    def spy(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.setattr(module, "make_fst_reader", spy)
    return made


@pytest.mark.gpu
@pytest.mark.parametrize("codec,in_place", [(None, True), ("ans", True), ("ans", False)])
def test_cold_rank_through_the_pinned_backend(tmp_path, monkeypatch, codec, in_place):
    pytest.importorskip("fastsafetensors")
    import gdsload.loader.io.pinned as pinned
    import gdsload.loader.pipeline.decode as decode
    from gdsload.loader import load_rank

    d, ref = _cold_model(tmp_path)
    if codec:
        d = _cold_copy(tmp_path, d, codec)
    monkeypatch.setattr(decode, "IN_PLACE", in_place)  # compressed: read in place, or through staging buffers
    made = _spy(monkeypatch, pinned)
    files = [str(p) for p in sorted(d.glob("*.safetensors"))]
    res = load_rank(d, device="cuda", backend="pinned")
    assert made and made[0][0] is not None, made
    assert all(f.direct_io for f in res.report.files) and resident_fraction(files) < 0.5  # O_DIRECT ran
    assert {f.reader for f in res.report.files} == {"fastsafetensors"}  # every read, a compressed group's too
    for k, v in ref.items():
        got = res.tensors[k]
        assert got.is_cuda and torch.equal(got.cpu(), v), k
    res.close()


@pytest.mark.gpu
@pytest.mark.parametrize("codec", [None, "ans"])
def test_cold_rank_through_the_torch_free_path(tmp_path, monkeypatch, codec):
    pytest.importorskip("fastsafetensors")
    import gdsload.loader.io.cufile as cufile
    from gdsload.loader.devices import DriverDevice
    from gdsload.loader.pipeline.load import load_rank

    d, ref = _cold_model(tmp_path)
    if codec:
        d = _cold_copy(tmp_path, d, codec)
    made = _spy(monkeypatch, cufile)
    res = load_rank(str(d), 0, device=DriverDevice(0))
    assert made and made[0][0] is not None, made
    assert all(f.direct_io for f in res.report.files)
    assert {f.reader for f in res.report.files} == {"fastsafetensors"}  # every read, a compressed group's too
    arena = res.device.to_host(res.arena)
    for s in res.slots:
        want = ref[s.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert arena[s.offset : s.offset + s.nbytes].tobytes() == want, s.name
    res.close()


@pytest.mark.gpu
def test_cold_reads_go_back_to_kvikio_when_asked(tmp_path, monkeypatch):
    pytest.importorskip("fastsafetensors")
    import gdsload.loader.io.cufile as cufile
    import gdsload.loader.io.pinned as pinned
    from gdsload.loader import load_rank

    d, ref = _cold_model(tmp_path)
    monkeypatch.setattr(cufile.CuFileBackend, "COLD_READER", "kvikio")
    made = _spy(monkeypatch, pinned)
    res = load_rank(d, device="cuda", backend="pinned")
    assert made == []
    ref_loaded = safetensors.torch.load_file(str(sorted(d.glob("*.safetensors"))[0]))
    for k, v in ref_loaded.items():
        assert torch.equal(res.tensors[k].cpu(), v), k
    assert set(res.tensors) == set(ref)
