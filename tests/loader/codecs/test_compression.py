"""Compressed safetensors on the CPU path: Zstd round trips, and lies and corruption rejected."""

from __future__ import annotations

import json
import os
import shutil
import time
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from tensor_cases import random_tensor
from gdsload.loader import CodecError, ConfigError, load_rank, read_header, save_file
from gdsload.loader.prepare.build import CompressWriteError
from gdsload.loader.prepare.compress import compress_dir, compress_file
from gdsload.loader.format.compression import METADATA_KEY, parse_compression
from gdsload.loader.format.manifest import write_manifest
from gdsload.loader.prepare.synthetic import make_checkpoint


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "w.bf16": (0.02 * torch.randn(512, 300, generator=g)).to(torch.bfloat16),
        "w.f32": 0.02 * torch.randn(200, 129, generator=g),
        "w.fp8": (torch.randn(400, 257, generator=g)).to(torch.float8_e4m3fn),
        "noise.u8": random_tensor((300_000,), torch.uint8, seed=5),  # incompressible: stays raw
        "small.norm": torch.ones(64, dtype=torch.bfloat16),  # too small: stays raw
        "scalar": torch.tensor(2.5),
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture()
def zfile(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    src = tmp_path / "src.safetensors"
    tensors = _weights()
    save_file(tensors, src, {"format": "pt"})
    dst = tmp_path / "z.safetensors"
    stats = compress_file(src, dst, codec="zstd", device="cpu")
    assert stats.compressed == 3 and stats.raw == 3 and stats.ratio > 1.1
    return dst, tensors


def test_zstd_round_trip_is_bit_exact(zfile):
    dst, tensors = zfile
    res = load_rank(dst, verify=True)
    for name, t in tensors.items():
        assert res.tensors[name].dtype == t.dtype and res.tensors[name].shape == t.shape
        assert _bits(res.tensors[name]) == _bits(t), name
    r = res.report
    assert r.files[0].compressed_tensors == 3 and r.logical_bytes > r.stored_bytes
    assert "ratio=" in r.summary()


def test_compressed_file_is_valid_safetensors_that_fails_loudly_on_shape(zfile):
    dst, tensors = zfile
    with safetensors.safe_open(str(dst), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "pt" and METADATA_KEY in meta
        blob = f.get_tensor("w.bf16")
        assert blob.dtype == torch.uint8 and blob.dim() == 1 and blob.numel() < tensors["w.bf16"].numel() * 2
        assert torch.equal(f.get_tensor("noise.u8"), tensors["noise.u8"])
    with pytest.raises(RuntimeError):
        blob.view(torch.bfloat16).view(512, 300)
    h = read_header(dst)
    assert h.data_aligned and all((h.data_offset + t.start) % t.itemsize == 0 for t in h.tensors)


def test_zstd_frames_decode_with_the_reference_zstandard(zfile):
    import zstandard

    dst, tensors = zfile
    e = parse_compression(read_header(dst))["w.bf16"]
    with safetensors.safe_open(str(dst), framework="pt") as f:
        blob = f.get_tensor("w.bf16").numpy().tobytes()
    out = b"".join(zstandard.ZstdDecompressor().decompress(blob[s : s + n]) for s, n, _, _ in e.chunk_spans())
    assert out == _bits(tensors["w.bf16"])


def test_parsed_chunk_sizes_are_read_only_views_of_what_the_file_records(zfile):
    """Each entry's chunk sizes are a read-only view of the uint32 sizes the file records (no copy, no numpy),
    and its chunk table agrees with numpy's arithmetic on them."""
    import base64

    dst, _ = zfile
    raw = json.loads(read_header(dst).metadata[METADATA_KEY])["tensors"]
    entries = parse_compression(read_header(dst))
    for name, e in entries.items():
        if e.layout != "chunks":
            continue
        recorded = np.frombuffer(base64.b64decode(raw[name]["chunks"]), dtype="<u4").astype(np.int64)
        assert isinstance(e.chunks, memoryview) and e.chunks.readonly and e.chunks.tolist() == recorded.tolist()
        starts, sizes, dec_at, dec_len = e.chunk_table()
        a = e.chunk_align
        want = np.concatenate(([0], np.cumsum((recorded[:-1] + a - 1) // a * a)))
        assert list(starts) == want.tolist() and list(sizes) == recorded.tolist()
        assert starts[-1] + sizes[-1] == e.stored_bytes
        assert list(dec_at) == [i * e.chunk_bytes for i in range(len(recorded))]
        assert sum(dec_len) == e.nbytes and set(dec_len[:-1]) <= {e.chunk_bytes}
    assert any(e.layout == "chunks" and len(e.chunks) > 1 for e in entries.values())


def test_chunk_offsets_of_a_run_start_from_its_first_chunk():
    from gdsload.loader.format.compression import CompressedEntry, encode_chunk_sizes

    e = CompressedEntry("a", "BF16", (300_000,), 600_000, "ans", "chunks", 0, {}, 262144, (1000, 2001, 5), None, 16)
    assert list(e.chunk_offsets()) == [0, 1008, 3024]
    assert list(e.chunk_offsets(1, 3, 100)) == [100, 2116]
    assert list(e.chunk_offsets(2, None, 7)) == [7] and list(e.chunk_offsets(3)) == []
    assert e.chunk_spans() == [(0, 1000, 0, 262144), (1008, 2001, 262144, 262144), (3024, 5, 524288, 600_000 - 524288)]
    assert encode_chunk_sizes([1, 2**32 - 1]) == "AQAAAP////8="
    with pytest.raises(OverflowError):
        encode_chunk_sizes([2**32])


def _rewrite_metadata(path: Path, mutate) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    doc = json.loads(header["__metadata__"][METADATA_KEY])
    mutate(doc["tensors"])
    header["__metadata__"][METADATA_KEY] = json.dumps(doc)
    text = json.dumps(header).encode()
    assert len(text) <= n, "test mutation must not grow the header"
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t: t["w.bf16"].update(codec="lzma"), "codec 'lzma'"),
        (lambda t: t["w.bf16"].update(nbytes=12), "is not the recorded 12 bytes"),
        (lambda t: t["w.bf16"].update(shape=[512, 301]), "is not the recorded"),
        (lambda t: t["w.bf16"].update(dtype="Q4"), "unknown dtype 'Q4'"),
        (lambda t: t["w.bf16"].update(chunk_bytes=1024), "chunks cannot hold"),
        (lambda t: t["w.bf16"].update(chunks="!!"), "not base64"),
        (lambda t: t.update(ghost=dict(t["w.bf16"])), "not stored in the file"),
        (lambda t: t.update({"scalar": dict(t["w.bf16"])}), "must be stored as 1-D U8"),
        (lambda t: t["w.bf16"].update(crc32=-1), "crc32 -1"),
        (lambda t: t["w.bf16"].update(nbytes=float(t["w.bf16"]["nbytes"])), "must be an integer"),
        (lambda t: t["w.bf16"].update(params="fast"), "params 'fast'"),
        (lambda t: t["w.bf16"].update(dtype=["BF16"]), "unknown dtype"),
        (lambda t: t["w.bf16"].update(chunk_align=3), "chunk_align 3 must be a power of two"),
        (lambda t: t["w.bf16"].update(chunk_align=64), "chunk sizes add up to"),  # the gaps are not there
        (lambda t: t["w.bf16"].update(codec="ans"), "chunk_align 1 must be .* a multiple of 16"),
    ],
)
def test_lying_metadata_is_rejected_before_reading(zfile, mutate, match):
    dst, _ = zfile
    _rewrite_metadata(dst, mutate)
    with pytest.raises(CodecError, match=match) as err:
        load_rank(dst)
    assert "z.safetensors" in str(err.value)


def test_chunk_sizes_that_lie_about_stored_bytes(zfile):
    dst, _ = zfile

    def shift(t):
        import numpy as np
        import base64

        sizes = np.frombuffer(base64.b64decode(t["w.bf16"]["chunks"]), dtype="<u4").copy()
        sizes[0] += 1
        t["w.bf16"]["chunks"] = base64.b64encode(sizes.tobytes()).decode()

    _rewrite_metadata(dst, shift)
    with pytest.raises(CodecError, match="add up to"):
        load_rank(dst)


def test_recorded_crc32_is_checked_with_verify(zfile):
    """Zstd frames check themselves; the crc32 beside them is checked as well when verify is on."""
    dst, _ = zfile
    _rewrite_metadata(dst, lambda t: t["w.bf16"].update(crc32=(t["w.bf16"]["crc32"] + 1) % 2**32))
    assert "w.bf16" in load_rank(dst, verify=False).tensors
    with pytest.raises(CodecError, match=r"tensor 'w.bf16'.*CRC-32 0x[0-9a-f]{8} where the file records"):
        load_rank(dst, verify=True)


def test_corrupted_chunk_is_a_codec_error(zfile):
    dst, _ = zfile
    h = read_header(dst)
    t = h["w.bf16"]
    raw = bytearray(dst.read_bytes())
    mid = h.data_offset + t.start + t.nbytes // 2
    raw[mid : mid + 16] = bytes(16)
    dst.write_bytes(bytes(raw))
    with pytest.raises(CodecError, match="w.bf16"):
        load_rank(dst)


def _realign(src: Path, dst: Path, align: int, codec: str | None = None) -> None:
    """Rewrite ``src``'s chunked tensors with every chunk at a multiple of ``align``, zeros in the gaps
    (optionally relabelled as ``codec``), through the reference writer."""
    entries = parse_compression(read_header(src))
    with safetensors.safe_open(src, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    doc = json.loads(metadata[METADATA_KEY])
    for name, e in entries.items():
        moved = e._replace(chunk_align=align)
        starts, sizes, _, _ = moved.chunk_table()
        blob = np.zeros(int(starts[-1] + sizes[-1]), dtype=np.uint8)
        for (old, n, _, _), new in zip(e.chunk_spans(), starts):
            blob[new : new + n] = tensors[name][old : old + n].numpy()
        tensors[name] = torch.from_numpy(blob)
        doc["tensors"][name]["chunk_align"] = align
        if codec:
            doc["tensors"][name].update(codec=codec, params={"data_type": "<f2"})
    metadata[METADATA_KEY] = json.dumps(doc)
    safetensors.torch.save_file(tensors, dst, metadata)


def test_chunks_at_aligned_offsets_decode(zfile, tmp_path):
    """``chunk_align``: each chunk starts at a multiple of it, zeros between; the decoder finds them there."""
    src, tensors = zfile
    dst = tmp_path / "aligned.safetensors"
    _realign(src, dst, 64)
    entries = parse_compression(read_header(dst))
    assert {e.chunk_align for e in entries.values()} == {64}
    starts = entries["w.bf16"].chunk_table()[0]
    assert len(starts) > 1 and all(s % 64 == 0 for s in starts)
    res = load_rank(dst, verify=True)
    for k, v in tensors.items():
        assert _bits(res.tensors[k]) == _bits(v), k


def test_ans_on_a_cpu_host_names_the_fix(tmp_path):
    src = tmp_path / "s.safetensors"
    save_file(_weights(), src)
    with pytest.raises(CodecError, match="GPU only.*zstd"):
        compress_file(src, tmp_path / "a.safetensors", codec="ans", device="cpu")
    # An ANS-compressed file (metadata written by hand: no GPU here to encode) fails to load on CPU
    # with the fix in the message, after its metadata validated.
    z = tmp_path / "z.safetensors"
    compress_file(src, z, codec="zstd", device="cpu")
    _rewrite_metadata(
        z,
        lambda t: [
            e.update(codec="ans", layout="native", params={"data_type": "<f2"})
            or e.pop("chunks")
            or e.pop("chunk_bytes")
            for e in t.values()
        ],
    )
    with pytest.raises(CodecError, match="only a GPU decodes.*device='cuda'.*--codec zstd"):
        load_rank(z)
    assert not (tmp_path / "a.safetensors").exists()
    # ANS as compress writes it now: raw chunks, 16-byte aligned.
    compress_file(src, z2 := tmp_path / "z2.safetensors", codec="zstd", device="cpu")
    _realign(z2, chunked := tmp_path / "ans-chunks.safetensors", 16, codec="ans")
    assert {(e.codec, e.layout) for e in parse_compression(read_header(chunked)).values()} == {("ans", "chunks")}
    with pytest.raises(CodecError, match="only a GPU decodes"):
        load_rank(chunked)


def test_ans_chunk_tables_point_at_every_chunk():
    """What the batched decoder is handed: one row per chunk, at the stored and arena addresses."""
    from gdsload.loader.format.compression import CompressedEntry
    from gdsload.loader.codecs.nvcomp_c import AnsChunks

    a = CompressedEntry("a", "BF16", (300_000,), 600_000, "ans", "chunks", 0, {}, 262144, (1000, 2001, 5), None, 16)
    b = CompressedEntry("b", "BF16", (10,), 20, "ans", "chunks", 0, {}, 262144, (30,), None, 16)
    c = AnsChunks.build([(a, 1 << 20, 1 << 30, "f: a", 0, None), (b, 5 << 20, 7 << 30, "f: b", 0, None)])
    assert c.src.tolist() == [1 << 20, (1 << 20) + 1008, (1 << 20) + 3024, 5 << 20]
    assert c.src_bytes.tolist() == [1000, 2001, 5, 30]
    assert c.dst.tolist() == [1 << 30, (1 << 30) + 262144, (1 << 30) + 524288, 7 << 30]
    assert c.dst_bytes.tolist() == [262144, 262144, 600_000 - 524288, 20]
    assert list(c.counts) == [3, 1] and c.names == ["f: a", "f: b"] and c.decoded_bytes == 600_020
    assert [c.owner(i) for i in range(4)] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert len(c.crc_dst) == 0  # neither records a crc32: nothing to check on the device


def test_ans_chunk_tables_name_each_tensor_checked_by_crc32():
    """Tensors that record a crc32 are checked on the device after decoding: one message per
    tensor, over its whole decoded bytes, against the recorded value."""
    from gdsload.loader.codecs.nvcomp_c import AnsChunks
    from gdsload.loader.format.compression import CompressedEntry

    a = CompressedEntry(
        "a", "BF16", (300_000,), 600_000, "ans", "chunks", 0, {}, 262144, (1000, 2001, 5), 0xDEADBEEF, 16
    )
    b = CompressedEntry("b", "BF16", (10,), 20, "ans", "chunks", 0, {}, 262144, (30,), None, 16)
    e = CompressedEntry("e", "BF16", (0,), 0, "ans", "chunks", 0, {}, 262144, (), 0, 16)
    c = AnsChunks.build(
        [
            (a, 1 << 20, 1 << 30, "f: a", 0, None),
            (b, 5 << 20, 7 << 30, "f: b", 0, None),
            (e, 9 << 20, 9 << 30, "f: e", 0, None),
        ]
    )
    assert c.crc_dst.tolist() == [1 << 30] and c.crc_bytes.tolist() == [600_000]
    assert c.crc_expected.tolist() == [0xDEADBEEF] and list(c.crc_owner) == [0]


def test_ans_chunk_tables_for_a_tensor_decoded_a_run_of_chunks_at_a_time():
    """A tensor larger than a staging buffer is decoded in runs of chunks: each run's stored bytes
    start at its own source address, each chunk lands at its place in the whole tensor, and the
    tensor's CRC-32 is checked with its last run only."""
    from gdsload.loader.codecs.nvcomp_c import AnsChunks
    from gdsload.loader.format.compression import CompressedEntry

    a = CompressedEntry(
        "a", "BF16", (300_000,), 600_000, "ans", "chunks", 0, {}, 262144, (1000, 2001, 5), 0xDEADBEEF, 16
    )
    head = AnsChunks.build([(a, 1 << 20, 1 << 30, "f: a", 0, 1)])
    assert head.src.tolist() == [1 << 20] and head.dst.tolist() == [1 << 30] and len(head.crc_dst) == 0
    assert head.dst_bytes.tolist() == [262144] and head.decoded_bytes == 262144
    tail = AnsChunks.build([(a, 3 << 20, 1 << 30, "f: a", 1, 3)])
    assert tail.src.tolist() == [3 << 20, (3 << 20) + 2016]  # the second chunk's offset less the first's
    assert tail.src_bytes.tolist() == [2001, 5]
    assert tail.dst.tolist() == [(1 << 30) + 262144, (1 << 30) + 524288]
    assert tail.dst_bytes.tolist() == [262144, 600_000 - 524288]
    assert tail.crc_dst.tolist() == [1 << 30] and tail.crc_bytes.tolist() == [600_000]
    assert list(tail.first_chunk) == [1] and tail.decoded_bytes == 600_000 - 262144
    assert tail.owner(1) == (0, 2)  # named in messages by its index within the tensor


def test_ans_batch_results_name_the_chunk_or_tensor_that_failed():
    """What comes back from a batch (nvCOMP's sizes and statuses, the CRC-32 kernel's results) is checked byte for
    byte, and a failure names the tensor, the chunk within it, and why."""
    import struct

    from gdsload.loader.codecs.nvcomp_c import AnsChunks, _check_results
    from gdsload.loader.format.compression import CompressedEntry

    a = CompressedEntry(
        "a", "BF16", (300_000,), 600_000, "ans", "chunks", 0, {}, 262144, (1000, 2001, 5), 0xDEADBEEF, 16
    )
    b = CompressedEntry("b", "BF16", (10,), 20, "ans", "chunks", 0, {}, 262144, (30,), 0x12345678, 16)
    c = AnsChunks.build([(a, 1 << 20, 1 << 30, "f: a", 1, None), (b, 5 << 20, 7 << 30, "f: b", 0, None)])
    n, m = 3, 2
    crc_at = 8 * 5 * n + 4 * n + (4 * n) % 8

    def table(sizes, statuses, crcs):
        t = bytearray(crc_at + 20 * m)
        t[32 * n : 40 * n] = struct.pack(f"<{n}Q", *sizes)
        t[40 * n : 44 * n] = struct.pack(f"<{n}i", *statuses)
        t[crc_at + 16 * m : crc_at + 20 * m] = struct.pack(f"<{m}I", *crcs)
        return t

    good = [262144, 600_000 - 524288, 20]
    _check_results(c, table(good, [0, 0, 0], [0xDEADBEEF, 0x12345678]), crc_at, m)
    with pytest.raises(
        CodecError,
        match=r"f: a: chunk 2 does not decode \(status 15 \(output buffer too small\); "
        r"2 bad chunk\(s\)",
    ):
        _check_results(c, table(good, [0, 15, 12], [0xDEADBEEF, 0x12345678]), crc_at, m)
    with pytest.raises(CodecError, match=r"f: b: chunk 0 does not decode \(19 bytes decoded where 20 were expected"):
        _check_results(c, table([262144, 600_000 - 524288, 19], [0, 0, 0], [0, 0]), crc_at, m)
    with pytest.raises(
        CodecError,
        match=r"f: b: decoded bytes have CRC-32 0x00000001 where the file records "
        r"0x12345678 \(1 tensor",
    ):
        _check_results(c, table(good, [0, 0, 0], [0xDEADBEEF, 1]), crc_at, m)


@pytest.mark.parametrize("piece", [0, 4096, 5000, 1 << 20])
def test_long_ranges_checked_in_pieces_give_each_ranges_own_crc32(piece):
    """A GPU checks long ranges in pieces side by side; the pieces' CRCs fold back into each range's CRC-32,
    the value zlib computes over the whole range (short, empty, exact-multiple and ragged ranges)."""
    import zlib

    from gdsload.loader.codecs.nvcomp_c import combine_pieces, crc_pieces
    from gdsload.loader.format.checksums import crc32_combiner

    spans = [(0, 0), (7, 1), (100, 4096), (5000, 8192), (20_000, 12_345), (50_000, 3_000_000), (3_050_000, 1 << 20)]
    data = os.urandom(max(a + n for a, n in spans))
    addresses, sizes, counts = crc_pieces(spans, piece)
    assert sum(counts) == len(sizes) == len(addresses)
    assert all(0 <= n <= piece for n in sizes) if piece else sizes == [n for _, n in spans]
    i = 0
    for (start, n), k in zip(spans, counts):  # a range's pieces tile it, the short one first
        assert addresses[i] == start and sum(sizes[i : i + k]) == n
        assert all(addresses[j + 1] == addresses[j] + sizes[j] for j in range(i, i + k - 1))
        assert all(sizes[j] == piece for j in range(i + 1, i + k))
        i += k
    crcs = [zlib.crc32(data[a : a + n]) for a, n in zip(addresses, sizes)]
    combine = crc32_combiner()
    assert combine is not None, "isal is a dependency of gdsload"
    assert combine_pieces(crcs, sizes, counts, combine) == [zlib.crc32(data[a : a + n]) for a, n in spans]


@pytest.mark.gpu
@pytest.mark.parametrize("piece", [None, 1000])
def test_the_gpus_crc32_of_long_ranges_checked_in_pieces_is_zlibs(piece):
    """nvCOMP's CRC kernel over device ranges longer than a piece (the default piece, and a ragged small one):
    each range's CRC-32 is what zlib computes over the same bytes on the host."""
    import zlib

    from gdsload.loader.codecs import GpuCodecs
    from gdsload.loader.codecs.nvcomp_c import CRC_PIECE_BYTES, device_crc32
    from gdsload.loader.devices import as_device

    dev = as_device("cuda:0")
    buf = torch.randint(0, 256, (40 << 20,), dtype=torch.uint8, device="cuda:0")
    host = buf.cpu().numpy().tobytes()
    spans = [(0, 0), (3, 1), (100, 9 << 20), ((10 << 20) + 1, (17 << 20) + 5), (30 << 20, 8 << 20), (39 << 20, 4097)]
    stream = torch.cuda.current_stream().cuda_stream
    codecs = GpuCodecs(dev, stream)
    got = device_crc32(
        [(buf.data_ptr() + a, n) for a, n in spans],
        codecs._stream_bytes(),
        stream,
        "test",
        piece=piece or CRC_PIECE_BYTES,
    )
    codecs.close()
    assert got == [zlib.crc32(host[a : a + n]) for a, n in spans]


def test_compress_dir_keeps_names_rewrites_manifest_and_is_atomic(tmp_path, monkeypatch):
    src = make_checkpoint(tmp_path / "m", "tiny", tp=2)
    out = tmp_path / "mz"
    import gdsload.loader.format.digests as digests_mod

    hashed: list[str] = []
    real_digest = digests_mod.file_digest

    def once(path, *algorithm):  # the writer hashes each finished file once, before it takes its name
        hashed.append(os.path.basename(path))
        return real_digest(path, *algorithm)

    monkeypatch.setattr(digests_mod, "file_digest", once)
    stats = compress_dir(src, out, codec="zstd", device="cpu")
    monkeypatch.undo()
    assert stats.files == 2 and 1.1 < stats.ratio < 1.5
    assert len(hashed) == 2 and all(".tmp-" in h for h in hashed), hashed  # not again for the manifest
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    manifest = json.loads((out / "gdsload.json").read_text())
    assert manifest["tp_size"] == 2 and manifest["extra"]["compression"]["codec"] == "zstd"
    from gdsload.loader.format.digests import file_digest

    files = [f for fs in manifest["ranks"].values() for f in fs]
    assert len(files) == 2 and all(f["digest"] == file_digest(out / f["path"]) for f in files)
    assert stats.digests == {str(out / f["path"]): f["digest"] for f in files}
    import gdsload.loader.prepare.compress as mod

    real_manifest = mod.write_manifest

    def slow_manifest(*a, **kw):  # the stats' seconds are the whole call, the manifest's writing included
        time.sleep(0.3)
        return real_manifest(*a, **kw)

    monkeypatch.setattr(mod, "write_manifest", slow_manifest)
    undigested = compress_dir(src, tmp_path / "nd", codec="zstd", device="cpu", digest=False)
    monkeypatch.setattr(mod, "write_manifest", real_manifest)
    assert undigested.stored_bytes == stats.stored_bytes and undigested.seconds >= 0.3
    nd = json.loads((tmp_path / "nd" / "gdsload.json").read_text())
    assert [f["digest"] for fs in nd["ranks"].values() for f in fs] == [None, None]
    shutil.rmtree(tmp_path / "nd")
    for rank in (0, 1):
        a, b = load_rank(src, rank), load_rank(out, rank, verify=True)
        assert b.report.verified and set(a.tensors) == set(b.tensors)
        for k in a.tensors:
            assert _bits(a.tensors[k]) == _bits(b.tensors[k]), k
    with pytest.raises(ConfigError, match="already exists"):
        compress_dir(src, out, codec="zstd", device="cpu")

    # A failure part-way (a full disk, simulated) leaves neither the output nor the partial directory.
    real = mod.compress_file
    calls = []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **kw)

    monkeypatch.setattr(mod, "compress_file", failing)
    with pytest.raises(CompressWriteError, match="No space left.*nothing partial was kept — free space") as err:
        compress_dir(src, tmp_path / "mz2", codec="zstd", device="cpu")
    assert isinstance(err.value, OSError) and err.value.errno == 28 and err.value.filename == str(tmp_path / "mz2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "mz"]


def test_compress_dir_keeps_subdirectories(tmp_path):
    """A manifest may list files in subdirectories; they are compressed in place, other files copied."""
    src = tmp_path / "m"
    (src / "weights").mkdir(parents=True)
    (src / "tokenizer").mkdir()
    for r in range(2):
        save_file({"w": (0.02 * torch.randn(256, 256)).to(torch.bfloat16)}, src / "weights" / f"rank{r}.safetensors")
    (src / "tokenizer" / "tokenizer.json").write_text("{}")
    write_manifest(src, {r: [f"weights/rank{r}.safetensors"] for r in range(2)}, tp_size=2, layout="vllm")
    out = tmp_path / "mz"
    stats = compress_dir(src, out, codec="zstd", device="cpu")
    assert stats.files == 2 and (out / "tokenizer" / "tokenizer.json").read_text() == "{}"
    for rank in (0, 1):
        a, b = load_rank(src, rank), load_rank(out, rank, verify=True)
        assert b.report.verified and _bits(a.tensors["w"]) == _bits(b.tensors["w"])


def test_compressed_vllm_directory_without_manifest(tmp_path):
    d = tmp_path / "v"
    d.mkdir()
    for r in range(2):
        save_file({"w": (0.02 * torch.randn(256, 256)).to(torch.bfloat16)}, d / f"model-rank-{r}-part-0.safetensors")
    compress_dir(d, tmp_path / "vz", codec="zstd", device="cpu")
    m = json.loads((tmp_path / "vz" / "gdsload.json").read_text())
    assert m["layout"] == "vllm" and m["tp_size"] == 2
    assert load_rank(tmp_path / "vz", 1).tensors["w"].shape == (256, 256)


def test_bad_options(tmp_path):
    src = tmp_path / "s.safetensors"
    save_file({"x": torch.ones(4)}, src)
    with pytest.raises(ConfigError, match="codec='lz4'"):
        compress_file(src, tmp_path / "o.safetensors", codec="lz4")
    with pytest.raises(ConfigError, match="min_gain=1.5"):
        compress_file(src, tmp_path / "o.safetensors", codec="zstd", min_gain=1.5)
    with pytest.raises(ConfigError, match="not a directory"):
        compress_dir(src, tmp_path / "o", codec="zstd")
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(src, d / "s.safetensors")
    for gain in (1.2, -0.1):  # a directory's options are checked as a file's, before anything is written
        with pytest.raises(ConfigError, match=f"min_gain={gain}"):
            compress_dir(d, tmp_path / "o", codec="zstd", min_gain=gain, device="cpu")
    assert not (tmp_path / "o").exists()


def test_cpu_load_reports_decoding_as_decode_not_read(zfile):
    report = load_rank(zfile[0], device="cpu").report
    # On the CPU, reads and decodes take turns: all the decoder's time is the decode phase's.
    assert report.decode_busy_seconds > 0
    assert report.phases["decode"] >= report.decode_busy_seconds
    assert report.phases["read"] + report.phases["decode"] <= report.seconds + 1e-6


def test_compress_stopped_by_sigterm_leaves_nothing_and_a_killed_runs_leftover_goes(tmp_path):
    import os
    import subprocess
    import sys
    import time

    src = make_checkpoint(tmp_path / "m", "tiny")
    out = tmp_path / "mz"
    code = (
        "import os, signal, time, gdsload.loader.prepare.compress as c\n"
        "def stop(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)\n"
        "c.compress_file = stop\n"
        f"from gdsload.server.cli import main; main(['compress', {str(src)!r}, {str(out)!r}, '--codec', 'zstd'])"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 143, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m"]  # no .mz.partial-* beside it
    # A run killed outright (SIGKILL) leaves its staging directory; the next run removes it
    code = code.replace("os.kill(os.getpid(), signal.SIGTERM)", "os.kill(os.getpid(), signal.SIGKILL)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    (left,) = tmp_path.glob(".mz.partial-*")
    assert p.returncode == -9, p.stderr
    os.utime(left, (time.time() - 60, time.time() - 60))  # not one a writer just made
    compress_dir(src, out, codec="zstd", device="cpu")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m", "mz"]


def test_compressed_files_keep_the_sources_permissions(tmp_path):
    src = make_checkpoint(tmp_path / "m", "tiny")
    for f in src.iterdir():
        f.chmod(0o600)
    out = tmp_path / "mz"
    compress_dir(src, out, codec="zstd", device="cpu")
    assert {f.name: f.stat().st_mode & 0o777 for f in out.glob("*.safetensors")} == {
        f.name: 0o600 for f in src.glob("*.safetensors")
    }


def test_only_ans_on_a_gpu_is_compressed_without_torch(monkeypatch):
    """The torch-free compressor takes ANS on a CUDA device; the CPU, other codecs and a registry whose
    ANS writes another layout go through torch. Device names parse as the CLI gives them."""
    from gdsload.loader.codecs import registry
    from gdsload.loader.prepare import gpu_compress

    assert gpu_compress._parse_device("cuda:3") == ("cuda", 3)
    assert gpu_compress._parse_device(torch.device("cuda", 2)) == ("cuda", 2)
    assert gpu_compress._parse_device("cpu") == ("cpu", 0)
    assert gpu_compress.torch_free_gpu("ans", "cpu") is None
    assert gpu_compress.torch_free_gpu("zstd", "cuda") is None
    monkeypatch.setitem(registry._CODECS, "ans", registry.codec("ans").replace(layouts=("native", "chunks")))
    assert gpu_compress.torch_free_gpu("ans", "cuda") is None


def test_a_file_is_preallocated_in_one_call(tmp_path):
    """The compressor reserves a file's blocks before writing it (fallocate: no zeros written)."""
    from gdsload.loader.prepare.gpu_compress import _preallocate

    with open(tmp_path / "f", "wb") as f:
        _preallocate(f.fileno(), 3 << 20)
        st = os.fstat(f.fileno())
    assert st.st_size == 3 << 20 and st.st_blocks * 512 >= 3 << 20


def test_chunks_packed_from_their_slots_sit_where_the_format_says_with_zeros_between():
    """The batched encoder leaves chunk i in the first sizes[i] bytes of slot i; one masked copy lays them end to
    end, each at its aligned offset, and zeroes the gaps whatever the slots held past each bitstream."""
    from gdsload.loader.codecs.gpu import pack_slots
    from gdsload.loader.codecs.nvcomp_c import AnsSlots
    from gdsload.loader.format.compression import CompressedEntry

    g = torch.Generator().manual_seed(2)
    sizes = (17, 4096, 1, 31, 48, 250)
    slot = 4352  # a multiple of 256, as the encoder sizes them
    slots = torch.randint(1, 256, (len(sizes) * slot,), generator=g, dtype=torch.uint8)  # no zero byte anywhere
    packed = pack_slots(AnsSlots(slots, slots.data_ptr(), slot, np.array(sizes, np.uint64)), 16)
    entry = CompressedEntry("w", "U8", (6 << 12,), 6 << 12, "ans", "chunks", 0, {}, 1 << 12, sizes, None, 16)
    starts = entry.chunk_table()[0]
    want = torch.zeros(starts[-1] + sizes[-1], dtype=torch.uint8)
    for i, (at, n) in enumerate(zip(starts, sizes)):
        want[at : at + n] = slots[i * slot : i * slot + n]
    assert torch.equal(packed, want)
