"""Malformed headers and files: each is rejected with the right typed error, never a crash or hang."""

from __future__ import annotations

import json
import math
import struct

import pytest
import safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdsload.loader import FormatError, HeaderError, TruncatedFileError, load_rank, parse_header, read_header
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
        (b'{"a": {"dtype": "F32", "shape": [0, 100000000000000000000000], "data_offsets": [0, 0]}}',
         r"integers in \[0, 2\*\*63\)"),
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


@pytest.mark.parametrize("raw", [
    b' {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',  # JSON whitespace before the object
    b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}',  # a key of some other writer
])
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
