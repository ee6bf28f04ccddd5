"""Malformed headers and files: each is rejected with the right typed error, never a crash or hang."""

from __future__ import annotations

import json
import math
import os
import random
import re
import struct
import time
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdsload.loader import (
    FormatError,
    GdsloadError,
    HeaderError,
    TruncatedFileError,
    load_rank,
    parse_header,
    read_header,
    save_file,
)
from gdsload.loader.format.checksums import parse_checksums
from gdsload.loader.format.compression import parse_compression
from gdsload.loader.dtypes import ITEMSIZE
from gdsload.loader.format.safetensors import MAX_HEADER_BYTES

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12).filter(
    lambda s: s != "__metadata__"
)
dtypes = st.sampled_from(sorted(ITEMSIZE))
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def valid_tensors(draw) -> list[tuple[str, str, tuple[int, ...]]]:
    entries = draw(st.lists(st.tuples(names, dtypes, shapes), min_size=1, max_size=6, unique_by=lambda e: e[0]))
    return entries


def build(entries, *, metadata=None) -> tuple[dict, int]:
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    off = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    return header, off


def encode(header: dict | bytes, data_len: int, *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + bytes(data_len)


def check(buf: bytes, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse_header(buf, len(buf), path="fuzz.safetensors")


@FUZZ
@given(valid_tensors())
def test_valid_headers_parse(entries):
    header, data_len = build(entries, metadata={"format": "pt"})
    h = parse_header(encode(header, data_len), len(encode(header, data_len)))
    assert {t.name for t in h.tensors} == {e[0] for e in entries}
    assert sum(t.nbytes for t in h.tensors) == h.data_len == data_len


@FUZZ
@given(valid_tensors(), st.data())
def test_truncated_files(entries, data):
    header, data_len = build(entries)
    buf = encode(header, data_len)
    cut = data.draw(st.integers(0, len(buf) - 1))
    with pytest.raises(FormatError):
        parse_header(buf[:cut], cut)
    if data_len:  # cut inside the data section: the header still parses, the file is short
        short = len(buf) - data.draw(st.integers(1, data_len))
        with pytest.raises(TruncatedFileError, match="truncated"):
            parse_header(buf[:short], short)


@FUZZ
@given(valid_tensors(), st.integers(1, 10**6))
def test_header_longer_than_file(entries, extra):
    header, data_len = build(entries)
    raw = json.dumps(header).encode()
    check(encode(raw, 0, length=len(raw) + data_len + extra), TruncatedFileError, "runs past the end")


@FUZZ
@given(st.integers(MAX_HEADER_BYTES + 1, 2**64 - 1))
def test_giant_header_length(n):
    check(struct.pack("<Q", n) + b"{}", HeaderError, "exceeds")


@FUZZ
@given(valid_tensors(), st.integers(1, 1000))
def test_offsets_out_of_range(entries, beyond):
    header, data_len = build(entries)
    name = list(header)[-1]
    begin, end = header[name]["data_offsets"]
    shape_bytes = end - begin
    header[name]["data_offsets"] = [data_len + beyond, data_len + beyond + shape_bytes]
    buf = encode(header, data_len)
    with pytest.raises(FormatError, match="truncated|hole"):
        parse_header(buf, len(buf))


@FUZZ
@given(valid_tensors().filter(lambda e: len(e) >= 2), st.integers(1, 8))
def test_overlapping_tensors(entries, by):
    entries = [(n, "U8", (by + 1,)) for n, _, _ in entries[:2]]
    header, data_len = build(entries)
    second = list(header)[1]
    begin, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [begin - by, end - by]
    check(encode(header, data_len - by), HeaderError, "overlaps")


@FUZZ
@given(valid_tensors(), st.integers(1, 64))
def test_holes(entries, gap):
    entries = [(n, "U8", (2,)) for n, _, _ in entries]
    header, data_len = build(entries)
    last = list(header)[-1]
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + gap, end + gap]
    check(encode(header, data_len + gap), HeaderError, "hole")


@FUZZ
@given(valid_tensors(), st.data())
def test_trailing_bytes(entries, data):
    header, data_len = build(entries)
    check(encode(header, data_len + data.draw(st.integers(1, 100))), HeaderError, "trailing bytes")


@FUZZ
@given(valid_tensors(), st.integers(1, 7))
def test_size_disagrees_with_dtype_times_shape(entries, delta):
    header, data_len = build(entries)
    name = list(header)[0]
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end + delta]
    check(encode(header, data_len + delta), HeaderError, "lies about this tensor")


@FUZZ
@given(valid_tensors())
def test_duplicate_names(entries):
    header, data_len = build(entries)
    first = next(iter(header))
    raw = json.dumps(header)[:-1] + ", " + json.dumps(first) + ": " + json.dumps(header[first]) + "}"
    check(encode(raw.encode(), data_len), HeaderError, "appears twice")


@FUZZ
@given(valid_tensors(), st.text(min_size=1, max_size=8).filter(lambda s: s not in ITEMSIZE))
def test_unknown_dtype(entries, dtype):
    header, data_len = build(entries)
    header[next(iter(header))]["dtype"] = dtype
    # FP4/FP6 (F4, F6_E2M3, F6_E3M2) are known to safetensors: their error says gdsload does not read them yet
    check(encode(header, data_len), HeaderError, "unknown dtype|fractions of a byte")


def _is_json(b: bytes) -> bool:
    try:
        json.loads(b.decode())
        return True
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


@FUZZ
@given(st.binary(max_size=64).map(lambda b: b"{" + b).filter(lambda b: not _is_json(b)))
def test_bad_json(junk):
    check(encode(junk, 0), HeaderError, "not valid UTF-8 JSON")


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"[]", "starting with"),
        (b'{"a": 1}', "must be an object"),
        (b'{"a": {"dtype": "F32", "shape": [1]}}', r"lacks \['data_offsets'\]"),
        (b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', r"integers in \[0, 2\*\*63\)"),
        (b'{"a": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', r"integers in \[0, 2\*\*63\)"),
        (
            b'{"a": {"dtype": "F32", "shape": [0, 100000000000000000000000], "data_offsets": [0, 0]}}',
            r"integers in \[0, 2\*\*63\)",
        ),
        (b'{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "lone surrogate"),
        (b'{"a": {"dtype": "F4", "shape": [8], "data_offsets": [0, 4]}}', "fractions of a byte"),
        (b'{"__metadata__": {"k": "\\udc00"}}', "metadata value of 'k' is not valid Unicode"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}', "begin <= end"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}', "begin, end"),
        (b'{"__metadata__": {"k": 1}}', "strings to strings"),
        (b'{"__metadata__": "x"}', "strings to strings"),
        (b"{" * 100_000, "not valid UTF-8 JSON"),
    ],
)
def test_specific_malformations(raw, match):
    check(encode(raw, 4), HeaderError, match)


@pytest.mark.parametrize(
    "raw",
    [
        b' {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',  # JSON whitespace before the object
        b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}',  # a key of some other writer
    ],
)
def test_what_safetensors_reads_gdsload_reads(tmp_path, raw):
    path = tmp_path / "t.safetensors"
    path.write_bytes(encode(raw, 0) + struct.pack("<f", 1.5))
    with safetensors.safe_open(str(path), "pt") as f:  # the oracle reads it
        want = f.get_tensor("a")
    h = read_header(path)
    assert [(t.name, t.dtype, t.shape) for t in h.tensors] == [("a", "F32", (1,))] and want.tolist() == [1.5]


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes_never_crash(buf):
    try:
        parse_header(buf, len(buf))
    except FormatError:
        pass


@FUZZ
@given(valid_tensors(), st.sampled_from(["truncate", "overlap_length", "bad_dtype"]))
def test_load_rank_rejects_before_returning_tensors(tmp_path, entries, how):
    header, data_len = build(entries)
    if how == "bad_dtype":
        header[next(iter(header))]["dtype"] = "Q7"
    buf = encode(header, data_len)
    if how == "truncate":
        buf = buf[: len(buf) - 1] if data_len else buf[:7]
    if how == "overlap_length":
        buf = struct.pack("<Q", len(buf)) + buf[8:]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(buf)
    with pytest.raises(FormatError) as err:
        load_rank(path)
    assert "bad.safetensors" in str(err.value)
    with pytest.raises(FormatError):
        read_header(path)


def test_errors_are_also_builtins():
    assert issubclass(HeaderError, ValueError) and issubclass(TruncatedFileError, ValueError)


# ------------------------------------------------------------------ seeded fuzz against the reference library

HEADER_CASES = 10_000
"""Mutants per run (fixed seed): CI runs them all."""
_NUMBER = re.compile(rb"-?\d+")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_HOSTILE_NUMBERS = [
    b"0",
    b"-0",
    b"-1",
    b"1.0",
    b"1e2",
    b"9223372036854775807",
    b"9223372036854775808",
    b"18446744073709551615",
    b"18446744073709551616",
    b"4611686018427387904",
    b"1e308",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"2199023255552",
    b"7" * 5000,
    b"4096",
    b"3",
    b"true",
    b"null",
]
_HOSTILE_STRINGS = [
    b'"\\ud800"',
    b'"a\\udfff"',
    b'"\\ud800\\udc00"',
    b'"\\u0000"',
    b'"\\\\ud800"',
    b'""',
    b'"F32"',
    b'"U8"',
    b'"BF16"',
    b'"I4"',
    b'"__metadata__"',
    b'"\\"',
    b'"\x7f"',
    b'"\xed\xa0\x80"',
]


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _fuzz_seeds(tmp: Path) -> list[bytes]:
    """Real files to mutate: gdsload's writer, the reference writer, and a Zstd-compressed file."""
    from gdsload.loader.prepare.compress import compress_dir

    src = tmp / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": (0.02 * torch.randn(256, 300, generator=g)).to(torch.bfloat16),
        "b": torch.arange(5),
        "s": torch.tensor(1.5),
        "e": torch.empty(0, 3),
        "é": torch.ones(3, dtype=torch.float16),
    }
    save_file(tensors, src / "model.safetensors", {"format": "pt"})
    compress_dir(src, tmp / "z", codec="zstd", device="cpu")
    safetensors.torch.save_file(tensors, str(tmp / "ref.safetensors"), metadata={"format": "pt", "k": "\u00e9"})
    return [
        (src / "model.safetensors").read_bytes(),
        (tmp / "z" / "model.safetensors").read_bytes(),
        (tmp / "ref.safetensors").read_bytes(),
    ]


def _splice(
    rng: random.Random, header: bytearray, pattern: re.Pattern[bytes], choices: list[bytes], start: int = 0
) -> None:
    spans = [m.span() for m in pattern.finditer(bytes(header), start)]
    if spans:
        a, b = rng.choice(spans)
        header[a:b] = rng.choice(choices)


def _header_mutant(rng: random.Random, buf: bytes) -> bytes:
    """One hostile variant of the file ``buf``: its header text, length or data changed in one of many ways."""
    (n,) = struct.unpack("<Q", buf[:8])
    header, data = bytearray(buf[8 : 8 + n]), buf[8 + n :]
    body = bytes(header).rstrip(b" ")
    kind = rng.randrange(12)
    if kind == 0:  # bytes of the header text flipped
        for _ in range(rng.randint(1, 4)):
            header[rng.randrange(len(header))] = rng.randrange(256)
    elif kind == 1:  # a number made hostile (offsets, sizes, shapes, metadata fields)
        _splice(rng, header, _NUMBER, _HOSTILE_NUMBERS)
    elif kind == 2:  # a string (name, dtype, key, metadata) made hostile
        _splice(rng, header, _STRING, _HOSTILE_STRINGS)
    elif kind == 3:  # header or data cut short
        if rng.random() < 0.5:
            header = header[: rng.randrange(len(header))]
        else:
            data = data[: rng.randrange(max(1, len(data)))]
    elif kind == 4:  # a stretch of the header deleted, or repeated
        a = rng.randrange(len(header))
        piece = header[a : a + rng.randint(1, 40)]
        if rng.random() < 0.5:
            del header[a : a + len(piece)]
        else:
            header[a:a] = piece
    elif kind == 5:  # numbers inside the escaped metadata JSON
        at = bytes(header).find(b"gdsload.")
        _splice(rng, header, _NUMBER, _HOSTILE_NUMBERS, max(at, 0))
    elif kind == 6:  # a key of another writer added to an entry, nested or hostile
        value = rng.choice(
            [
                _nested(rng.choice([1, 10, 63, 64, 65, 127, 128, 2000, 100_000])),
                b"NaN",
                b"-0",
                b'"\\ud800"',
                b'{"\\udc00": 1}',
                b"[1, [2, [3]]]",
                b'{"a": {"b": {}}}',
                b"7" * 5000,
            ]
        )
        at = bytes(header).find(b'"dtype"')
        if at > 0:
            header[at:at] = b'"x": ' + value + b", "
    elif kind == 7:  # metadata value replaced by deep JSON text (what the compression metadata parser reads)
        deep = _nested(rng.choice([100, 1000, 100_000])).decode()
        meta = json.dumps({"gdsload.compression": deep, "gdsload.checksums": deep})
        header = (
            bytearray(body[:-1] + b', "__metadata__": ' + meta.encode() + b"}")
            if b"__metadata__" not in body
            else bytearray(re.sub(rb'"__metadata__":\{[^}]*\}', b'"__metadata__":' + meta.encode(), body, count=1))
        )
    elif kind == 8:  # the shape of an entry made huge (sizes at and past 2**63, overflow on the way)
        big = rng.choice(
            [
                b"[4294967296, 4294967296, 0]",
                b"[0, 4294967296, 4294967296]",
                b"[9223372036854775807]",
                b"[2305843009213693952]",
                b"[1, 2305843009213693951]",
                b"[3037000500, 3037000500]",
            ]
        )
        header = bytearray(re.sub(rb'"shape":\[[^\]]*\]', b'"shape":' + big, bytes(header), count=1))
    elif kind == 9:  # whitespace or junk around the JSON
        header = bytearray(
            rng.choice([b" ", b"\n", b"\t", b"\x00", b"x", b"\xef\xbb\xbf"])
            + body
            + rng.choice([b"", b" ", b"\n", b"\x00", b"}", b"junk"])
        )
    elif kind == 10:  # a key repeated at some level
        m = rng.choice(list(re.finditer(rb'"(dtype|shape|data_offsets|format)":[^,}]*', body)) or [None])
        if m is not None:
            header = bytearray(body[: m.end()] + b"," + m.group(0) + body[m.end() :])
    else:  # the length prefix itself
        n = rng.choice([0, 1, len(header) - 1, len(header) + 1, 2**63, len(header) * 3, 100_000_001])
        return struct.pack("<Q", n % 2**64) + bytes(header) + data
    return struct.pack("<Q", len(header)) + bytes(header) + data


def _reference_accepts(buf: bytes) -> bool:
    try:
        safetensors.deserialize(buf)
    except Exception:  # the reference's own error (SafetensorError), whatever it says
        return False
    return True


def test_header_fuzz_typed_errors_only_and_nothing_the_reference_rejects(tmp_path):
    """10,000 mutants of real files: each parses (and then the reference library accepts it too, and it loads)
    or fails with a GdsloadError; none takes more than a few seconds."""
    seeds = _fuzz_seeds(tmp_path)
    rng = random.Random(20261207)
    counts = {"tried": 0, "accepted": 0, "typed": 0, "untyped": 0, "hung": 0, "wrongly_accepted": 0, "loads": 0}
    bad: list[str] = []
    slowest = 0.0
    start = time.monotonic()
    target = tmp_path / "fuzz.safetensors"
    for i in range(HEADER_CASES):
        buf = _header_mutant(rng, rng.choice(seeds))
        counts["tried"] += 1
        t0 = time.monotonic()
        try:
            header = parse_header(buf, len(buf), path="fuzz.safetensors")
            parse_compression(header)
            parse_checksums(header)
            if not _reference_accepts(buf):
                counts["wrongly_accepted"] += 1
                bad.append(f"accepted, the reference rejects: {buf[8:208]!r}")
            if i % 25 == 0:  # the whole load too, from a file
                target.write_bytes(buf)
                counts["loads"] += 1
                load_rank(target).close()
            counts["accepted"] += 1
        except GdsloadError:
            counts["typed"] += 1
        except Exception as e:  # the defect this test exists to catch
            counts["untyped"] += 1
            bad.append(f"{type(e).__name__}: {e}"[:300])
        took = time.monotonic() - t0
        slowest = max(slowest, took)
        counts["hung"] += took > 5.0
    counts["seconds"] = round(time.monotonic() - start, 1)
    counts["slowest_case_s"] = round(slowest, 3)
    print("header fuzz:", json.dumps(counts))
    assert counts["untyped"] == 0 and counts["wrongly_accepted"] == 0 and counts["hung"] == 0, bad[:5]
    assert counts["typed"] > 2000 and counts["accepted"] > 500 and counts["loads"] > 20  # both sides reached


@pytest.mark.parametrize(
    "raw, match",
    [
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": NaN}}', "literal NaN"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": -Infinity}}', "literal -Infinity"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": "\\ud800"}}', "lone UTF-16 surrogate"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "\\udc00": 1}}', "lone UTF-16 surrogate"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [-0, 4]}}', r"data_offsets must be \[begin, end\]"),
        (b'{"a": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}}', "shape must be a list of integers"),
        (
            b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": ' + b"[" * 200 + b"]" * 200 + b"}}",
            "more than 64 levels deep",
        ),
        (
            b'{"a": {"dtype": "U8", "shape": [4294967296, 4294967296, 0], "data_offsets": [0, 0]}}',
            "2\\*\\*63 elements or more",
        ),
        (b'{"a": {"dtype": "F64", "shape": [2305843009213693952], "data_offsets": [0, 0]}}', "2\\*\\*61 bytes or more"),
        (
            b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": ' + b"7" * 5000 + b"}}",
            "not valid UTF-8 JSON",
        ),
    ],
)
def test_what_the_reference_rejects_gdsload_rejects(raw, match):
    buf = encode(raw, 4)
    assert not _reference_accepts(buf)
    with pytest.raises(HeaderError, match=match) as e:
        parse_header(buf, len(buf), path="odd.safetensors")
    assert "'odd.safetensors'" in str(e.value)


def test_nesting_the_reference_reads_gdsload_reads():
    """Keys of other writers nested a little are read by both (and ignored)."""
    raw = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": ' + _nested(20) + b', "-0": -0}}'
    buf = encode(raw, 4)
    assert _reference_accepts(buf)
    assert parse_header(buf, len(buf)).tensors[0].name == "a"


def test_deep_compression_metadata_is_a_typed_error(tmp_path):
    """JSON inside __metadata__ nested past the parser's limit: a CodecError naming the file, not RecursionError."""
    from gdsload.loader import CodecError

    header = {
        "__metadata__": {"gdsload.compression": _nested(100_000).decode()},
        "w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
    }
    path = tmp_path / "deep.safetensors"
    path.write_bytes(encode(header, 4))
    with pytest.raises(CodecError, match=r"deep.safetensors.*gdsload.compression.*not valid JSON"):
        load_rank(path)


def test_a_decoded_size_past_2_63_is_a_typed_error(tmp_path):
    """A compressed tensor declaring 2**63 decoded bytes: refused at parse time, not a TypeError from torch."""
    from gdsload.loader import CodecError

    meta = {
        "version": 1,
        "tensors": {
            "w": {"dtype": "U8", "shape": [2**62, 2], "nbytes": 2**63, "codec": "ans", "layout": "native", "params": {}}
        },
    }
    header = {
        "__metadata__": {"gdsload.compression": json.dumps(meta)},
        "w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
    }
    path = tmp_path / "huge.safetensors"
    path.write_bytes(encode(header, 4))
    with pytest.raises(CodecError, match=r"huge.safetensors.*'w'.*nbytes 9223372036854775808"):
        load_rank(path)


def test_a_fifo_or_directory_in_place_of_a_file_is_typed(tmp_path):
    """read_header of a FIFO returns at once (it does not wait for a writer), as of a directory: both typed."""
    from gdsload.loader import FileUnreadableError

    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    (tmp_path / "dir.safetensors").mkdir()
    for p in (fifo, tmp_path / "dir.safetensors", tmp_path / "none.safetensors"):
        with pytest.raises(FileUnreadableError, match=re.escape(repr(str(p)))):
            read_header(p)
