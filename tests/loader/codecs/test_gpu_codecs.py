"""GPU codecs on a CUDA host (`pytest -m gpu`): round trips, ANS chunks, the encoder's CRC-32, corrupt data caught."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.torch
import torch

from gpu_cases import _bench_like, _bits, _check, _reference, _skip_if_missing, gpu_device
from gdsload.loader import CodecError, load_rank, save_file
from gdsload.loader.prepare.compress import compress_dir, compress_file

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("codec", ["ans", "gdeflate", "zstd"])
@pytest.mark.parametrize("backend", ["pinned", "cufile"])
def test_gpu_codecs_round_trip(tmp_path, codec, backend):
    _skip_if_missing(backend)
    src = _bench_like(tmp_path)
    out = tmp_path / f"z-{codec}"
    stats = compress_dir(src, out, codec=codec, device="cuda")
    # Both bf16 weights compress with every codec; fp32 and fp8 may stay raw under --min-gain.
    assert "BF16" in stats.per_dtype and stats.compressed >= 2
    if codec == "ans":
        assert stats.per_dtype["BF16"][0] / stats.per_dtype["BF16"][1] > 1.35
    res = load_rank(out, device="cuda", backend=backend, verify=True)
    _check(res, _reference(sorted(src.glob("*.safetensors"))))
    assert res.report.verified and res.report.stored_bytes < res.report.logical_bytes


def test_ans_compress_runs_without_torch_and_writes_what_the_torch_encoder_writes(tmp_path, monkeypatch):
    """`gdsload compress --codec ans` on a GPU imports no torch: cupy and nvCOMP's C API. Its files hold,
    tensor for tensor, the entries and bytes the torch encoder makes; the
    manifest's digests are the files' blake3; every tensor loads bit-identical to safetensors, from a
    file the safetensors library wrote (tensors at offsets that are not 16-byte aligned)."""
    import subprocess
    import sys

    from gdsload.loader import read_header
    from gdsload.loader.codecs import encode_tensor
    from gdsload.loader.format.compression import parse_compression
    from gdsload.loader.format.digests import file_digest
    from gdsload.loader.format.manifest import Manifest

    src = tmp_path / "w"
    src.mkdir()
    g = torch.Generator().manual_seed(3)
    tensors = {
        "odd.bf16": (0.02 * torch.randn(3, generator=g)).to(torch.bfloat16),  # 6 bytes: what follows is unaligned
        "a.bf16": (0.02 * torch.randn(700_001, generator=g)).to(torch.bfloat16),  # a short last chunk
        "b.f32": 0.02 * torch.randn(300_007, generator=g),
        "c.fp8": torch.randn(400_003, generator=g).to(torch.float8_e4m3fn),
        "noise.u8": torch.randint(0, 256, (300_000,), generator=g, dtype=torch.uint8),  # does not shrink: raw
        "small.bf16": torch.ones(1000, dtype=torch.bfloat16),  # under min_tensor_bytes: raw
    }
    safetensors.torch.save_file(tensors, str(src / "model.safetensors"))
    assert any(t.start % 16 for t in read_header(src / "model.safetensors").tensors if t.nbytes > 1 << 16)
    out = tmp_path / "z"
    code = (
        "import sys; from gdsload.loader.prepare.compress import compress_dir; "
        f"s = compress_dir({str(src)!r}, {str(out)!r}, codec='ans', device='cuda'); "
        "print(s.compressed, s.raw, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    compressed, raw, torch_imported = done.stdout.split()
    assert (compressed, raw, torch_imported) == ("3", "3", "False")

    f = out / "model.safetensors"
    entries = parse_compression(read_header(f))
    assert set(entries) == {"a.bf16", "b.f32", "c.fp8"}
    dtype = {"a.bf16": "BF16", "b.f32": "F32", "c.fp8": "F8_E4M3"}
    stored = safetensors.torch.load_file(str(f))
    for name, entry in entries.items():
        want, blob = encode_tensor(name, tensors[name].cuda(), dtype[name], "ans")
        assert entry.to_json() == want.to_json(), name
        assert np.array_equal(stored[name].numpy(), blob), name
    manifest = Manifest.read(out)
    assert [m.digest for m in manifest.ranks[0]] == [file_digest(f)]
    _check(load_rank(out, device="cuda", verify=True), tensors)
    # sha256 when asked for: the same file, its digest as hashlib computes it.
    import hashlib

    compress_dir(src, tmp_path / "z-sha", codec="ans", device="cuda", digest="sha256")
    assert (tmp_path / "z-sha" / "model.safetensors").read_bytes() == f.read_bytes()
    assert [m.digest for m in Manifest.read(tmp_path / "z-sha").ranks[0]] == [
        "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
    ]
    # A backend the torch-free load cannot run (it reads with kvikio) sends ANS through torch.
    from gdsload.loader.prepare.gpu_compress import torch_free_gpu

    assert torch_free_gpu("ans", "cuda") == 0
    monkeypatch.setenv("GDSLOAD_BACKEND", "pinned")
    assert torch_free_gpu("ans", "cuda") is None


def test_gpu_zstd_frames_load_on_cpu_and_cpu_frames_on_gpu(tmp_path):
    src = _bench_like(tmp_path)
    ref = _reference(sorted(src.glob("*.safetensors")))
    gpu_made, cpu_made = tmp_path / "g", tmp_path / "c"
    compress_dir(src, gpu_made, codec="zstd", device="cuda")
    compress_dir(src, cpu_made, codec="zstd", device="cpu")
    on_cpu = load_rank(gpu_made, device="cpu", verify=True)
    for k, v in ref.items():
        assert _bits(on_cpu.tensors[k]) == _bits(v), k
    _check(load_rank(cpu_made, device="cuda", verify=True), ref)


def test_corrupt_ans_stream_is_caught_with_verify(tmp_path):
    src = tmp_path / "s.safetensors"
    save_file({"w": (0.02 * torch.randn(4096, 1024)).to(torch.bfloat16)}, src)
    dst = tmp_path / "a.safetensors"
    compress_file(src, dst, codec="ans", device="cuda")
    from gdsload.loader import read_header

    h = read_header(dst)
    raw = bytearray(dst.read_bytes())
    mid = h.data_offset + h["w"].start + h["w"].nbytes // 2
    raw[mid : mid + 64] = bytes(64)
    dst.write_bytes(bytes(raw))
    with pytest.raises(CodecError, match="'w'"):
        load_rank(dst, device="cuda", verify=True)


@pytest.mark.parametrize("where", ["torch", "cupy", "driver"])
def test_one_flipped_byte_in_ans_data_is_caught_without_verify(tmp_path, where):
    """ANS bitstreams carry no checksum of their own: a flipped byte decodes, into wrong values.
    The decoded tensors' CRC-32 is checked on the device on every load, verify or not."""
    from gdsload.loader import read_header

    src = tmp_path / "s.safetensors"
    g = torch.Generator().manual_seed(3)
    save_file(
        {
            "a": (0.02 * torch.randn(2048, 1024, generator=g)).to(torch.bfloat16),
            "b": (0.02 * torch.randn(1024, 1024, generator=g)).to(torch.bfloat16),
        },
        src,
    )
    good = tmp_path / "good.safetensors"
    compress_file(src, good, codec="ans", device="cuda")
    device = gpu_device(where)
    assert load_rank(good, device=device, verify=False).report.logical_bytes == 3 * 2 * 1024 * 1024
    h = read_header(good)
    for frac in (0.1, 0.5, 0.9):
        bad = tmp_path / f"bad-{frac}.safetensors"
        raw = bytearray(good.read_bytes())
        pos = h.data_offset + h["b"].start + int(h["b"].nbytes * frac)
        raw[pos] ^= 0x5A
        bad.write_bytes(bytes(raw))
        with pytest.raises(CodecError, match=r"tensor 'b'.*(CRC-32|does not decode)"):
            load_rank(bad, device=device, verify=False)


def test_ans_is_written_as_aligned_chunks_and_old_native_streams_still_load(tmp_path, monkeypatch):
    """ANS now goes to disk as raw nvCOMP chunks, each 16-byte aligned, decoded many tensors per call;
    files written before that (one nvCOMP container per tensor) keep loading, bit-identical."""
    from gdsload.loader import read_header

    from gdsload.loader.codecs import registry
    from gdsload.loader.format.compression import parse_compression

    src = _bench_like(tmp_path)
    ref = _reference(sorted(src.glob("*.safetensors")))
    compress_dir(src, tmp_path / "chunks", codec="ans", device="cuda")
    # What compress wrote before: the first layout is the one written.
    monkeypatch.setitem(registry._CODECS, "ans", registry.codec("ans").replace(layouts=("native", "chunks")))
    compress_dir(src, tmp_path / "native", codec="ans", device="cuda")
    for name, layout in (("chunks", "chunks"), ("native", "native")):
        files = sorted((tmp_path / name).glob("*.safetensors"))
        entries = [e for f in files for e in parse_compression(read_header(f)).values()]
        assert entries and {(e.codec, e.layout) for e in entries} == {("ans", layout)}
        if layout == "chunks":
            assert all(e.chunk_align == 16 and all(at % 16 == 0 for at in e.chunk_table()[0]) for e in entries)
        for backend in ("pinned", "cufile"):
            _check(load_rank(tmp_path / name, device="cuda", backend=backend, verify=True), ref)


def _ans_chunks_after(fill: int) -> list[bytes]:
    """ANS chunks of the same bf16 data, compressed through nvCOMP's C API right after cupy's memory pool
    took back a buffer full of ``fill`` bytes (which the encoder's output then reuses)."""
    import cupy

    from gdsload.loader.codecs.gpu import CupyStreamBytes
    from gdsload.loader.codecs.nvcomp_c import ans_encode

    g = torch.Generator().manual_seed(7)
    host = (0.02 * torch.randn(3 * 65536 + 100, generator=g)).to(torch.bfloat16).view(torch.uint8).numpy()
    data = cupy.asarray(host)
    junk = cupy.full(16 << 20, fill, dtype=cupy.uint8)
    cupy.cuda.Device().synchronize()
    del junk
    stream = cupy.cuda.Stream(non_blocking=True)
    starts = range(0, host.size, 1 << 17)
    slots = ans_encode(
        np.array([data.data.ptr + a for a in starts], np.uint64),
        np.array([min(1 << 17, host.size - a) for a in starts], np.uint64),
        "<f2",
        CupyStreamBytes(stream.ptr),
        stream.ptr,
        "test",
    )
    return [
        slots.array[i * slots.slot_bytes : i * slots.slot_bytes + int(n)].get().tobytes()
        for i, n in enumerate(slots.sizes)
    ]


def test_ans_through_the_c_api_stores_what_nvcomps_python_codec_stores(monkeypatch):
    """A CUDA tensor's ANS chunks come from one call of nvCOMP's C API, laid end to end on the device in one
    masked copy; nvCOMP's Python codec (one array per chunk, one copy per chunk), which runs where the C library
    cannot be loaded, stores the same entries and the same bytes, the zeros between chunks included."""
    from gdsload.loader import codecs
    from gdsload.loader.codecs import encode_tensor

    g = torch.Generator().manual_seed(11)
    n = 5 * (256 << 10) + 1234  # five whole chunks and a short one
    cases = {
        "BF16": (0.02 * torch.randn(n // 2, generator=g)).to(torch.bfloat16).cuda(),
        "F32": (0.02 * torch.randn(n // 4, generator=g)).cuda(),
        "U8": torch.randint(0, 40, (n,), generator=g, dtype=torch.uint8).cuda(),
    }
    c_api = {dtype: encode_tensor("w", t, dtype, "ans", keep_on_device=True) for dtype, t in cases.items()}
    monkeypatch.setattr(codecs, "_c_library_unavailable", lambda: "stood down for the comparison")
    gaps = 0
    for dtype, t in cases.items():
        entry, blob = c_api[dtype]
        assert entry.layout == "chunks" and len(entry.chunks) == 6 and blob.numel() == entry.stored_bytes, dtype
        gaps += sum(size % 16 != 0 for size in entry.chunks[:-1])
        entry_py, blob_py = encode_tensor("w", t, dtype, "ans", keep_on_device=True)
        assert entry_py.to_json() == entry.to_json(), dtype
        assert torch.equal(blob_py, blob), dtype
    assert gaps  # some chunk was followed by zeros up to the next one's aligned start


def test_ans_chunks_are_the_same_bytes_whatever_the_memory_held_before():
    """nvCOMP leaves some bytes of an ANS bitstream unwritten: the encoder zeroes its output first, so that
    the same model always compresses to the same files, in a fresh process or in one that reuses memory."""
    pytest.importorskip("cupy")
    first = _ans_chunks_after(0x7C)
    assert len(first) == 4 and all(first)  # three chunks of 128 KiB and one of 200 bytes
    assert _ans_chunks_after(0x00) == first == _ans_chunks_after(0xA5)


@pytest.mark.parametrize("codec", ["ans", "zstd", "gdeflate"])
def test_gpu_encoder_records_zlibs_crc32_and_places_every_chunk(codec):
    """The encoder's CRC-32, computed on the GPU, is zlib's of the tensor's bytes; each stored chunk sits at
    its start in the blob, zeros between, and decodes alone to its slice of the tensor (nvCOMP's Python
    package, not the loader's batch decoder)."""
    import zlib

    from nvidia import nvcomp

    from gdsload.loader.codecs import encode_tensor
    from gdsload.loader.codecs.registry import codec as codec_spec

    t = (0.02 * torch.randn(700_001, device="cuda")).to(torch.bfloat16)  # odd size: a short last chunk
    entry, blob = encode_tensor("w", t, "BF16", codec)
    host = t.view(torch.uint8).cpu().numpy()
    assert entry.crc32 == zlib.crc32(host)
    assert blob.size == entry.stored_bytes
    if entry.layout != "chunks":
        return
    starts, sizes, d_off, d_len = entry.chunk_table()
    assert len(sizes) == -(-entry.nbytes // entry.chunk_bytes) > 1 and all(at % entry.chunk_align == 0 for at in starts)
    gaps = np.ones(blob.size, bool)
    dec = nvcomp.Codec(
        algorithm=codec_spec(codec).nvcomp_algorithm,
        bitstream_kind=nvcomp.BitstreamKind.RAW,
        **({"data_type": entry.params["data_type"]} if "data_type" in entry.params else {}),
    )
    srcs = [torch.from_numpy(blob[s : s + n].copy()).cuda() for s, n in zip(starts, sizes)]
    outs = [torch.empty(int(n), dtype=torch.uint8, device="cuda") for n in d_len]
    dec.decode(nvcomp.as_arrays(srcs), out=nvcomp.as_arrays(outs))
    torch.cuda.synchronize()
    for s, n, d, m, o in zip(starts, sizes, d_off, d_len, outs):
        gaps[s : s + n] = False
        assert np.array_equal(o.cpu().numpy(), host[d : d + m])
    assert not blob[gaps].any()


def test_ans_chunk_that_cannot_decode_names_the_tensor_and_status(tmp_path):
    """nvCOMP's per-chunk status reaches the user: an output slot one byte short fails the batch, naming
    the tensor and the chunk."""
    from gdsload.loader.codecs import GpuCodecs, encode_tensor
    from gdsload.loader.devices import as_device

    t = (0.02 * torch.randn(300_000, device="cuda")).to(torch.bfloat16)
    entry, blob = encode_tensor("w", t, "BF16", "ans")
    assert entry.layout == "chunks" and len(entry.chunks) == 3
    src = torch.from_numpy(blob).cuda()
    out = torch.empty(entry.nbytes, dtype=torch.uint8, device="cuda")
    codecs = GpuCodecs(as_device("cuda:0"), torch.cuda.current_stream().cuda_stream)
    codecs.decode(entry, src, out, path="f.safetensors")
    assert _bits(out) == _bits(t)
    short = entry._replace(nbytes=entry.nbytes - 2)
    with pytest.raises(
        CodecError,
        match=r"'f.safetensors': tensor 'w': chunk 2 does not decode \(status 15 \(output buffer too small\)",
    ):
        codecs.decode(short, src, out[: short.nbytes], path="f.safetensors")
    codecs.close()
