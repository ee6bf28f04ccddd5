"""Hostile ``gdsload.json`` manifests and model directories: every one is read, or refused with a GdsloadError
naming the manifest, in bounded time. Seeded, so CI runs the same cases each time."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gdsload.loader import GdsloadError, ManifestError, discover, load_rank, save_file, write_manifest
from gdsload.loader.errors import FileUnreadableError
from gdsload.loader.format.manifest import Manifest

MANIFEST_CASES = 2_000
_NUMBER = re.compile(r"-?\d+")
_HOSTILE_NUMBERS = [
    "0",
    "-0",
    "-1",
    "1.5",
    "1e2",
    "4096",
    "4097",
    "1000000000",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551616",
    "1e308",
    "NaN",
    "Infinity",
    "7" * 5000,
    "true",
    "null",
    '"1"',
    "[]",
    "{}",
]
_HOSTILE_VALUES = [
    "null",
    "123",
    "[]",
    "{}",
    '"\\ud800"',
    '"blake3:"',
    '"md5:00"',
    '"/etc/passwd"',
    '"../x"',
    '"a\\u0000b"',
    '"."',
    '""',
    "true",
    "-0",
    "NaN",
    "[" * 100 + "]" * 100,
    "[" * 5000 + "]" * 5000,
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("manifest-fuzz") / "m"
    root.mkdir()
    ranks = {}
    for rank in range(2):
        ranks[rank] = []
        for part in range(2):
            name = f"model-rank-{rank}-part-{part}.safetensors"
            save_file(
                {f"r{rank}.p{part}.w": torch.full((4, 8), float(rank + part)), f"r{rank}.p{part}.b": torch.arange(3)},
                root / name,
            )
            ranks[rank].append(name)
    write_manifest(root, ranks, tp_size=2, layout="vllm", extra={"note": "seed"})
    return root


def _mutant(rng: random.Random, text: str) -> str:
    """One hostile variant of a manifest's text."""
    kind = rng.randrange(9)
    if kind == 0:  # characters flipped
        chars = list(text)
        for _ in range(rng.randint(1, 4)):
            chars[rng.randrange(len(chars))] = chr(rng.randrange(32, 127))
        return "".join(chars)
    if kind == 1:  # a number made hostile (sizes, ranks, bytes)
        spans = [m.span() for m in _NUMBER.finditer(text)]
        a, b = rng.choice(spans)
        return text[:a] + rng.choice(_HOSTILE_NUMBERS) + text[b:]
    if kind == 2:  # a value of a known key replaced by one of another type
        keys = [
            "digest",
            "path",
            "bytes",
            "stored_bytes",
            "logical_bytes",
            "tp_size",
            "pp_size",
            "ep_size",
            "layout",
            "ranks",
            "extra",
            "format",
            "format_version",
        ]
        key = rng.choice(keys)
        m = rng.choice(list(re.finditer(rf'"{key}": ("[^"]*"|[^,\n}}]*)', text)) or [None])
        if m is None:
            return text
        return text[: m.start(1)] + rng.choice(_HOSTILE_VALUES) + text[m.end(1) :]
    if kind == 3:  # cut short
        return text[: rng.randrange(len(text))]
    if kind == 4:  # a stretch deleted or repeated
        a = rng.randrange(len(text))
        piece = text[a : a + rng.randint(1, 60)]
        return text[:a] + text[a + len(piece) :] if rng.random() < 0.5 else text[:a] + piece + text[a:]
    doc = json.loads(text)
    if kind == 5:  # many ranks or files
        doc[rng.choice(["tp_size", "pp_size"])] = rng.choice([3, 64, 4096, 4097, 10**9])
        if rng.random() < 0.5:
            doc["ranks"]["0"] = doc["ranks"]["0"] * rng.choice([2, 50, 3000])
    elif kind == 6:  # deep nesting where values are free or expected flat
        deep: object = []
        for _ in range(rng.choice([10, 63, 65, 200, 900])):
            deep = [deep]
        where = rng.choice(["extra", "ranks", "file", "digest"])
        if where == "extra":
            doc["extra"] = {"x": deep}
        elif where == "ranks":
            doc["ranks"]["1"] = deep
        elif where == "file":
            doc["ranks"]["0"][0] = deep
        else:
            doc["ranks"]["0"][0]["digest"] = deep
    elif kind == 7:  # keys removed or added
        entry = doc["ranks"][rng.choice(["0", "1"])][0]
        if rng.random() < 0.5:
            entry.pop(rng.choice(list(entry)))
        else:
            entry[rng.choice(["sha", "digest2", "\ud800"])] = 1
    else:  # the digests nulled or deleted
        for files in doc["ranks"].values():
            for f in files:
                if rng.random() < 0.5:
                    f["digest"] = None
                else:
                    f.pop("digest", None)
    try:
        return json.dumps(doc, indent=1)
    except (UnicodeEncodeError, RecursionError, ValueError):
        return text


def test_manifest_fuzz_typed_errors_only(model, tmp_path):
    """2,000 mutants of a real manifest: each is read (and the rank discovered, and now and then loaded) or refused
    with a GdsloadError; none takes more than a few seconds."""
    d = tmp_path / "m"
    shutil.copytree(model, d)
    seed_text = (model / "gdsload.json").read_text()
    rng = random.Random(20261207)
    counts = {"tried": 0, "accepted": 0, "typed": 0, "untyped": 0, "hung": 0, "loads": 0}
    bad: list[str] = []
    slowest = 0.0
    start = time.monotonic()
    for i in range(MANIFEST_CASES):
        text = _mutant(rng, seed_text)
        (d / "gdsload.json").write_text(text, encoding="utf-8", errors="surrogatepass")
        counts["tried"] += 1
        t0 = time.monotonic()
        try:
            m = Manifest.read(d)
            Manifest.from_dict(json.loads(json.dumps(m.to_dict())))  # what was accepted survives a round trip
            found = discover(d, rng.randrange(2))
            if i % 20 == 0:
                counts["loads"] += 1
                load_rank(d, found.rank, verify=rng.random() < 0.5).close()
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
    print("manifest fuzz:", json.dumps(counts))
    assert counts["untyped"] == 0 and counts["hung"] == 0, bad[:5]
    assert counts["typed"] > 500 and counts["accepted"] > 100 and counts["loads"] > 5


@pytest.mark.parametrize(
    "patch, match",
    [
        (lambda m: m["ranks"]["0"][0].__setitem__("digest", 123), r"digest 123 must be a string"),
        (lambda m: m["ranks"]["0"][0].__setitem__("bytes", 2**63), r"bytes 9223372036854775808 must be an integer"),
        (lambda m: m["ranks"]["0"][0].__setitem__("path", "a\u0000b"), "must be relative"),
        (lambda m: m.__setitem__("extra", {"x": json.loads("[" * 100 + "]" * 100)}), "more than 64 levels deep"),
        (lambda m: m.__setitem__("tp_size", 10**9), r"tp_size must be an integer in 1..4096"),
    ],
)
def test_specific_manifest_malformations(model, tmp_path, patch, match):
    d = tmp_path / "m"
    shutil.copytree(model, d)
    doc = json.loads((model / "gdsload.json").read_text())
    patch(doc)
    (d / "gdsload.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=match) as e:
        load_rank(d, 0)
    assert str(d / "gdsload.json") in str(e.value)


def test_a_deeply_nested_manifest_is_a_typed_error(model, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(model, d)
    (d / "gdsload.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ManifestError, match="gdsload.json.*nested too deeply"):
        load_rank(d, 0)
    (d / "gdsload.json").write_text('{"format": "gdsload-manifest", "format_version": NaN}')
    with pytest.raises(ManifestError, match="literal NaN"):
        discover(d, 0)


def test_an_oversized_or_odd_manifest_is_refused_without_reading_it_all(model, tmp_path):
    from gdsload.loader.format.manifest import MAX_MANIFEST_BYTES

    d = tmp_path / "m"
    shutil.copytree(model, d)
    manifest = d / "gdsload.json"
    with open(manifest, "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: nothing is written
    with pytest.raises(ManifestError, match="more than the"):
        load_rank(d, 0)
    manifest.unlink()
    manifest.mkdir()  # a directory where the manifest should be
    with pytest.raises(FileUnreadableError, match="gdsload.json.*not a regular file"):
        load_rank(d, 0)
    manifest.rmdir()
    os.mkfifo(manifest)  # a FIFO: reading it would wait for a writer forever
    with pytest.raises(FileUnreadableError, match="gdsload.json.*not a regular file"):
        load_rank(d, 0)


_AS_NOBODY = """
import sys
from gdsload.loader import load_rank, GdsloadError
from gdsload.loader.errors import FileUnreadableError
try:
    load_rank(sys.argv[1], 0)
except FileUnreadableError as e:
    print("typed", e)
except Exception as e:
    print("untyped", type(e).__name__, e)
else:
    print("loaded")
"""


def _without_dac_override() -> None:
    """In the child before exec: drop the capabilities that let root read and search past permissions
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) from the bounding set, so the new program runs without them."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0):  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _load_as_unprivileged(path: Path) -> str:
    """Load rank 0 of ``path`` in a process that permissions stop (root reads everything: its child drops that)."""
    out = subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_without_dac_override if os.geteuid() == 0 else None,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_unreadable_manifest_and_unsearchable_directory_are_typed(model, tmp_path):
    """Permissions that stop the reader: FileUnreadableError naming the path, not a bare PermissionError."""
    d = tmp_path / "m"
    shutil.copytree(model, d)
    (d / "gdsload.json").chmod(0)
    try:
        got = _load_as_unprivileged(d)
    finally:
        (d / "gdsload.json").chmod(0o644)
    assert got.startswith("typed") and "gdsload.json" in got and "cannot be opened" in got, got
    d.chmod(0o600)  # the model directory cannot be searched
    try:
        got = _load_as_unprivileged(d)
    finally:
        d.chmod(0o755)
    assert got.startswith("typed") and str(d) in got and "cannot be looked up" in got, got
