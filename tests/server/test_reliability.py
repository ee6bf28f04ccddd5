"""The standing reliability suite: hostile input, swapped files, slow and idle clients, corrupt data.

Each test is bounded in count and time; the figures each one measures are printed (``pytest -s``)
and asserted where they are a property (no untyped error, no hang, a cut-off within its bound).
Kills at every commit point of shard and compress are in ``tests/loader/prepare/test_shard.py``
(``test_a_kill_at_any_rename_...``), of checkpoint saves in ``tests/loader/checkpoints/test_checkpoint.py``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from gdsload.loader import GdsloadError, load_rank, parse_header, save_file, write_manifest
from gdsload.loader.format.compression import parse_compression
from gdsload.loader.prepare.synthetic import LlamaShape, make_checkpoint
from sidecar_proc import Server

TOKEN = "reliability-token-7d2c9a4e"


# ------------------------------------------------------------------------------------------ header fuzz


def _seed_files(tmp: Path) -> list[bytes]:
    from gdsload.loader.prepare.compress import compress_dir

    src = tmp / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            "w": (0.02 * torch.randn(256, 300, generator=g)).to(torch.bfloat16),
            "b": torch.arange(5),
            "s": torch.tensor(1.5),
            "e": torch.empty(0, 3),
        },
        src / "model.safetensors",
    )
    compress_dir(src, tmp / "z", codec="zstd", device="cpu")
    return [(src / "model.safetensors").read_bytes(), (tmp / "z" / "model.safetensors").read_bytes()]


_NUMBER = re.compile(rb"\d+")
_HOSTILE = [
    b"0",
    b"-1",
    b"9223372036854775807",
    b"9223372036854775808",
    b"18446744073709551616",
    b"1e308",
    b"NaN",
    b"2199023255552",
    b"4096",
    b"3",
]


def _mutate(rng: random.Random, buf: bytes) -> bytes:
    (n,) = struct.unpack("<Q", buf[:8])
    header, data = bytearray(buf[8 : 8 + n]), buf[8 + n :]
    kind = rng.randrange(6)
    if kind == 0:  # flip bytes of the header text
        for _ in range(rng.randint(1, 4)):
            header[rng.randrange(len(header))] = rng.randrange(256)
    elif kind == 1:  # a number of the header (offsets, sizes, shapes, chunk fields) made hostile
        spans = [m.span() for m in _NUMBER.finditer(bytes(header))]
        a, b = rng.choice(spans)
        header[a:b] = rng.choice(_HOSTILE)
    elif kind == 2:  # the header cut short, or the data cut short
        if rng.random() < 0.5:
            header = header[: rng.randrange(len(header))]
        else:
            data = data[: rng.randrange(max(1, len(data)))]
    elif kind == 3:  # a stretch of the header deleted
        a = rng.randrange(len(header))
        del header[a : a + rng.randint(1, 40)]
    elif kind == 4:  # inside the compression metadata (escaped JSON): numbers again
        text = bytes(header)
        at = text.find(b"gdsload.compression")
        spans = [m.span() for m in _NUMBER.finditer(text, at if at >= 0 else 0)]
        if spans:
            a, b = rng.choice(spans)
            header[a:b] = rng.choice(_HOSTILE)
    else:  # the length prefix itself
        n = rng.choice([0, 1, len(header) - 1, len(header) + 1, 2**63, len(header) * 3])
        return struct.pack("<Q", n % 2**64) + bytes(header) + data
    return struct.pack("<Q", len(header)) + bytes(header) + data


def test_header_and_metadata_fuzz_raises_only_typed_errors(tmp_path):
    """10,000 mutants of real files (plain and Zstd-compressed): each parses, or fails with a GdsloadError."""
    seeds = _seed_files(tmp_path)
    rng = random.Random(20261201)
    counts = {"cases": 0, "accepted": 0, "typed": 0, "untyped": 0, "loads": 0}
    untyped: list[str] = []
    start = time.monotonic()
    for i in range(10_000):
        buf = _mutate(rng, rng.choice(seeds))
        counts["cases"] += 1
        try:
            header = parse_header(buf, len(buf), path="fuzz.safetensors")
            parse_compression(header)
            counts["accepted"] += 1
            if i % 40 == 0:  # now the whole load, from a file
                f = tmp_path / "fuzz.safetensors"
                f.write_bytes(buf)
                counts["loads"] += 1
                load_rank(f).close()
        except GdsloadError:
            counts["typed"] += 1
        except Exception as e:  # the defect this suite exists to catch
            counts["untyped"] += 1
            untyped.append(f"{type(e).__name__}: {e}"[:200])
    counts["seconds"] = round(time.monotonic() - start, 1)
    print("header fuzz:", json.dumps(counts))
    assert counts["untyped"] == 0, untyped[:5]
    assert counts["typed"] > 1000 and counts["accepted"] > 100  # the mutants reach both sides


# ----------------------------------------------------------------------------- a file swapped after the check


def test_a_rank_file_swapped_for_a_link_out_of_the_root_is_refused_at_the_open(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    model = make_checkpoint(
        root / "m", LlamaShape(hidden=64, intermediate=128, heads=4, kv_heads=4, vocab=256, layers=1), tp=2
    )
    outside = tmp_path / "outside.safetensors"
    victim = model / "model-rank-1-part-0.safetensors"
    shutil.copy(victim, outside)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    srv = Server(
        [
            str(model),
            "--allow-root",
            str(root),
            "--token-file",
            str(token_file),
            "--device-map",
            "cpu",
            "--restart-backoff",
            "0.2",
        ],
        tmp_path / "serve.log",
    )
    try:
        srv.poll_ready(timeout=120)
        victim.unlink()
        victim.symlink_to(outside)  # after the path check: the next open must refuse it
        pid = srv.status()["ranks"]["1"]["pid"]
        os.kill(pid, 9)  # the worker restarts, and opens its files again
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            err = srv.status()["ranks"]["1"]["error"]
            if err and err.get("type") == "PathEscapesRootError":
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"rank 1 did not fail at the open: {srv.status()['ranks']['1']}")
        assert "leads out of" in err["message"]
        r = httpx.get(srv.url + "/v1/ipc/1", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code in (404, 409, 503), r.text  # nothing read from outside is handed out
    finally:
        srv.close()


def test_open_beneath_without_openat2_walks_without_following_links(tmp_path, monkeypatch):
    from gdsload.loader.format import confine

    monkeypatch.setattr(confine, "_openat2_missing", True)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    (tmp_path / "d" / "link").symlink_to("/etc/hostname")
    (tmp_path / "dirlink").symlink_to(tmp_path / "d")
    assert os.read(confine.open_beneath(str(tmp_path / "d" / "f"), [str(tmp_path)]), 1) == b"x"
    for bad in (tmp_path / "d" / "link", tmp_path / "dirlink" / "f"):
        with pytest.raises(confine.PathEscapesRootError):
            confine.open_beneath(str(bad), [str(tmp_path)])


# --------------------------------------------------------------------------------------- HTTP floods


@pytest.fixture
def served(tmp_path):
    model = make_checkpoint(
        tmp_path / "m", LlamaShape(hidden=64, intermediate=128, heads=4, kv_heads=4, vocab=256, layers=1), tp=1
    )
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    srv = Server(
        [
            str(model),
            "--token-file",
            str(token_file),
            "--device-map",
            "cpu",
            "--request-timeout",
            "1",
            "--lease-grace",
            "60",
        ],
        tmp_path / "serve.log",
    )
    srv.poll_ready(timeout=120)
    yield srv
    srv.close()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:
        return True


def test_token_is_checked_before_the_body_and_slow_or_idle_clients_are_cut_off(served):
    # An unauthenticated POST that declares a body and sends none: answered at once, from its headers.
    s = _connect(served.url)
    s.sendall(
        b"POST /v1/reload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 60000\r\n\r\n{"
    )
    s.settimeout(5)
    t = time.monotonic()
    answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:100]
    first_answer_s = time.monotonic() - t
    s.close()
    # 200 half-sent requests and 50 slow bodies, while /readyz is polled.
    idle = [_connect(served.url) for _ in range(200)]
    for c in idle:
        c.sendall(b"GET /v1/status HTTP/1.1\r\nHost: 127.0")
    slow = [_connect(served.url) for _ in range(50)]
    for c in slow:
        c.sendall(
            b"POST /v1/unload HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
    latencies, codes = [], set()
    with httpx.Client(base_url=served.url, timeout=5) as client:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:
            t = time.monotonic()
            r = client.get("/readyz")
            latencies.append(time.monotonic() - t)
            codes.add(r.status_code)
    cut = time.monotonic()
    closed = sum(_closed_by_server(c, 4.0) for c in idle + slow)
    cut_s = time.monotonic() - cut
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(
        f"http floods: 401 after {first_answer_s * 1000:.1f} ms; {closed} of {len(idle) + len(slow)} stalled "
        f"connections cut off (timeout 1 s, all within {cut_s + 2.0:.1f} s of opening); /readyz "
        f"{len(latencies)} answers, p50 {statistics.median(latencies) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
        f"codes {sorted(codes)}"
    )
    assert first_answer_s < 2.0
    assert closed == len(idle) + len(slow)
    assert codes == {200}
    for c in idle + slow:
        c.close()


def test_waiting_reloads_do_not_hold_up_the_release_they_wait_for(served):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=served.url, timeout=30) as client:
        doc = client.get("/v1/ipc/0", headers=auth).json()
        results: list[int] = []

        def wait_then_unload() -> None:
            with httpx.Client(base_url=served.url, timeout=60) as c:
                results.append(c.post("/v1/unload", json={"wait_s": 30}, headers=auth).status_code)

        threads = [threading.Thread(target=wait_then_unload) for _ in range(45)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # every one of them is waiting for the lease now
        t = time.monotonic()
        r = client.post("/v1/ipc/0/release", json={"lease": doc["lease"]}, headers=auth)
        release_s = time.monotonic() - t
        assert r.status_code == 200, r.text
        for th in threads:
            th.join(60)
    print(
        f"starvation: release answered in {release_s * 1000:.0f} ms with 45 unloads waiting; codes {sorted(set(results))}"
    )
    assert release_s < 5.0 and len(results) == 45 and set(results) == {200}


def test_host_header_and_offline_docs(served):
    with httpx.Client(base_url=served.url, timeout=5) as client:
        r = client.get("/v1/status", headers={"Host": "attacker.example"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "HostNotAllowed"
        assert client.get("/readyz", headers={"Host": "attacker.example"}).status_code == 200  # probes answer anyone
        page = client.get("/docs")
        assert page.status_code == 200 and "/v1/reload" in page.text
        assert not re.search(r"(src|href)=['\"]https?://", page.text), "the docs page must load nothing from outside"


# --------------------------------------------------------------------------------------- corrupt data


def test_corrupt_bytes_are_caught(tmp_path):
    from gdsload.loader import CodecError, IntegrityError
    from gdsload.loader.prepare.compress import compress_dir

    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(1)
    save_file({"w": (0.02 * torch.randn(512, 256, generator=g)).to(torch.bfloat16)}, src / "model.safetensors")
    write_manifest(src, {0: ["model.safetensors"]}, tp_size=1, layout="plain")
    compress_dir(src, tmp_path / "z", codec="zstd", device="cpu")

    def flip(path: Path, at_fraction: float) -> None:
        raw = bytearray(path.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        at = 8 + n + int((len(raw) - 8 - n) * at_fraction)
        raw[at] ^= 0x40
        path.write_bytes(bytes(raw))

    flip(src / "model.safetensors", 0.5)
    with pytest.raises(IntegrityError, match="blake3 digest"):  # raw tensors: the manifest's digests, when asked for
        load_rank(src, verify=True)
    flip(tmp_path / "z" / "model.safetensors", 0.5)
    with pytest.raises(CodecError, match="model.safetensors.*'w'"):  # Zstd: its frames' checksums, always
        load_rank(tmp_path / "z")


def test_a_header_claiming_more_memory_than_there_is_is_a_typed_error(tmp_path):
    """A compressed tensor that says it decodes to 2 TB: the load fails typed, naming the files, before reading."""
    import base64

    import numpy as np

    from gdsload.loader import DeviceMemoryError

    chunk, count = 1 << 30, 2048  # 2 TiB in chunks of 1 GiB
    sizes = np.ones(count, dtype="<u4")
    meta = {
        "version": 1,
        "tensors": {
            "w": {
                "dtype": "U8",
                "shape": [chunk * count],
                "nbytes": chunk * count,
                "codec": "zstd",
                "layout": "chunks",
                "params": {},
                "chunk_bytes": chunk,
                "chunks": base64.b64encode(sizes.tobytes()).decode(),
            }
        },
    }
    header = {
        "__metadata__": {"gdsload.compression": json.dumps(meta)},
        "w": {"dtype": "U8", "shape": [count], "data_offsets": [0, count]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(count))
    with pytest.raises(DeviceMemoryError, match=r"big.safetensors.*cannot be\s+allocated"):
        load_rank(path)


# --------------------------------------------------------------------------------------- leases


_FORKING_ENGINE = r"""
import json, os, sys, time
from gdsload.loader.handoff.sidecar_client import SidecarClient

mapped = SidecarClient(sys.argv[1], token=sys.argv[2]).map_rank(0, private=True)
mapped.hold()
child = os.fork()  # a compile or data worker, forked after the hold
if child == 0:
    time.sleep(120)
    os._exit(0)
print(json.dumps({"engine": os.getpid(), "child": child}), flush=True)
time.sleep(120)
"""


def _lease_server(tmp_path: Path, *extra: str) -> Server:
    model = make_checkpoint(
        tmp_path / "m", LlamaShape(hidden=64, intermediate=128, heads=4, kv_heads=4, vocab=256, layers=1), tp=1
    )
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    srv = Server([str(model), "--token-file", str(token_file), "--device-map", "cpu", *extra], tmp_path / "serve.log")
    srv.poll_ready(timeout=120)
    return srv


def _rank0(srv: Server) -> dict:
    return srv.http.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}).json()["ranks"]["0"]


def test_a_child_forked_by_the_engine_does_not_keep_its_lease(tmp_path):
    """The engine holds its lease, forks a worker, and is killed: the lease goes with the engine, although the
    child (which inherited the hold connection's descriptor) lives on."""
    import subprocess
    import sys

    srv = _lease_server(tmp_path)
    engine = subprocess.Popen(
        [sys.executable, "-c", _FORKING_ENGINE, srv.url, TOKEN], stdout=subprocess.PIPE, text=True
    )
    child = None
    try:
        pids = json.loads(engine.stdout.readline())
        child = pids["child"]
        assert [h["pid"] for h in _rank0(srv)["held_by"]] == [pids["engine"]]
        engine.kill()
        engine.wait(10)
        t = time.monotonic()
        while _rank0(srv)["leases"] and time.monotonic() - t < 10:
            time.sleep(0.05)
        freed = time.monotonic() - t
        print(f"leases: a killed engine's lease released {freed:.2f} s after its exit, its forked child alive")
        assert os.path.exists(f"/proc/{child}") and _rank0(srv)["leases"] == 0 and freed < 5.0
    finally:
        for pid in (engine.pid, child):
            if pid:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        engine.wait(10)
        srv.close()


def test_a_lease_no_engine_holds_is_released_within_seconds(tmp_path):
    """An engine killed between ``GET /v1/ipc/{rank}`` and the hold leaves a lease nobody holds: it blocks an
    unload only until it expires (default grace), and /v1/status shows its age meanwhile."""
    srv = _lease_server(tmp_path)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        t = time.monotonic()
        lease = srv.http.get("/v1/ipc/0", headers=auth).json()["lease"]
        assert srv.http.post("/v1/unload", json={}, headers=auth).status_code == 409
        (row,) = _rank0(srv)["lease_table"]
        assert row["lease"] == lease and row["held_by"] is None and 0 <= row["age_s"] < 5
        ages = [row["age_s"]]
        while _rank0(srv)["leases"] and time.monotonic() - t < 10:
            ages += [r["age_s"] for r in _rank0(srv)["lease_table"]]
            time.sleep(0.05)
        freed = time.monotonic() - t
        print(f"leases: an export nobody held released {freed:.2f} s after it was made")
        assert _rank0(srv)["leases"] == 0 and freed < 5.0 and ages == sorted(ages)
        assert "no engine held it" in srv.log()
        assert srv.http.post("/v1/unload", json={}, headers=auth).status_code == 200
    finally:
        srv.close()


def test_a_peer_that_stops_reading_keeps_no_lease_and_stalls_nothing(tmp_path):
    """An engine asks for a rank's export and then stops reading, its connection left open (a hung or stopped
    client): the lease it never held is released within seconds, and the rest of the API answers meanwhile."""
    import socket
    from urllib.parse import urlsplit

    srv = _lease_server(tmp_path)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = urlsplit(srv.url)
    peer = socket.create_connection((url.hostname, url.port), timeout=5)
    try:
        t = time.monotonic()
        peer.sendall(
            f"GET /v1/ipc/0 HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Connection: keep-alive\r\n\r\n".encode()
        )  # ... and never reads the answer
        while not _rank0(srv)["leases"] and time.monotonic() - t < 5:
            time.sleep(0.02)
        assert _rank0(srv)["leases"] == 1, "the export was made"
        slowest = 0.0
        while _rank0(srv)["leases"] and time.monotonic() - t < 10:
            for path in ("/healthz", "/readyz"):
                start = time.monotonic()
                assert srv.http.get(path, timeout=2).status_code == 200
                slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.05)
        freed = time.monotonic() - t
        print(f"leases: an export whose peer stopped reading released {freed:.2f} s after it was asked for")
        assert _rank0(srv)["leases"] == 0 and freed < 5.0, freed
        assert slowest < 1.0, slowest
        assert srv.http.post("/v1/unload", json={}, headers=auth).status_code == 200
    finally:
        peer.close()
        srv.close()


# --------------------------------------------------------------------------------------- control plane


def test_the_control_plane_answers_while_every_worker_is_stopped(tmp_path):
    """Every worker SIGSTOPped, and 45 exports waiting on them: health, readiness, status, a release and a
    forced unload still answer at once; the exports end with 503 when the unload voids them, none later
    than the export timeout."""
    from concurrent.futures import ThreadPoolExecutor

    from gdsload.server.supervisor import EXPORT_TIMEOUT_S

    model = make_checkpoint(
        tmp_path / "m", LlamaShape(hidden=64, intermediate=128, heads=4, kv_heads=4, vocab=256, layers=1), tp=2
    )
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    srv = Server(
        [str(model), "--token-file", str(token_file), "--device-map", "cpu", "--stop-timeout", "1"],
        tmp_path / "serve.log",
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    pids: list[int] = []
    try:
        srv.poll_ready(timeout=120)
        pids = [r["pid"] for r in srv.http.get("/v1/status", headers=auth).json()["ranks"].values()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

        def export(i: int) -> tuple[int, float]:
            t = time.monotonic()
            with httpx.Client(base_url=srv.url, timeout=EXPORT_TIMEOUT_S + 20) as c:
                code = c.get(f"/v1/ipc/{i % 2}", headers=auth).status_code
            return code, time.monotonic() - t

        with ThreadPoolExecutor(45) as pool:
            waiting = [pool.submit(export, i) for i in range(45)]
            time.sleep(1.0)  # every export is waiting on a stopped worker now
            took: dict[str, float] = {}
            with httpx.Client(base_url=srv.url, timeout=10) as c:
                for name, method, path, body in (
                    ("healthz", "GET", "/healthz", None),
                    ("readyz", "GET", "/readyz", None),
                    ("status", "GET", "/v1/status", None),
                    ("release", "POST", "/v1/ipc/1/release", {}),
                    ("unload", "POST", "/v1/unload", {"force": True}),
                ):
                    t = time.monotonic()
                    r = c.request(method, path, json=body, headers=auth)
                    took[name] = time.monotonic() - t
                    assert r.status_code == 200, (name, r.text)
            exports = [f.result() for f in waiting]
        print(
            "control plane with every worker stopped: "
            + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in took.items())
            + f"; 45 exports ended {sorted({c for c, _ in exports})} within {max(s for _, s in exports):.1f} s"
        )
        assert max(took.values()) < 1.0, took
        assert {code for code, _ in exports} == {503} and max(s for _, s in exports) < EXPORT_TIMEOUT_S + 5
        deadline = time.monotonic() + 15  # the stopped workers are killed past the stop timeout
        while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        status = srv.http.get("/v1/status", headers=auth).json()
        assert status["state"] == "unloaded" and "sending SIGKILL" in srv.log()
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        srv.close()


# --------------------------------------------------------------------------------------- descriptors


def test_reloads_leave_no_file_descriptors_open(tmp_path):
    """Refused reloads (their target checked, every header read), and reloads that switch models, leave the
    server with as many open descriptors as before."""
    root = tmp_path / "root"
    root.mkdir()
    shape = LlamaShape(hidden=64, intermediate=128, heads=4, kv_heads=4, vocab=256, layers=1)
    a = make_checkpoint(root / "a", shape, tp=2, max_file_bytes=64 << 10)  # several files per rank
    b = make_checkpoint(root / "b", shape, tp=2, max_file_bytes=64 << 10)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    srv = Server(
        [
            str(a),
            "--token-file",
            str(token_file),
            "--device-map",
            "cpu",
            "--allow-root",
            str(root),
            "--lease-grace",
            "600",
        ],
        tmp_path / "serve.log",
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def fds() -> int:
        return len(os.listdir(f"/proc/{srv.proc.pid}/fd"))

    try:
        srv.poll_ready(timeout=120)
        files = len(list(b.glob("*.safetensors")))
        lease = srv.http.get("/v1/ipc/0", headers=auth).json()["lease"]
        before = fds()
        for _ in range(5):  # checked (every header of b read), then refused: the export is outstanding
            r = srv.http.post("/v1/reload", json={"model_dir": str(b)}, headers=auth)
            assert r.status_code == 409, r.text
        refused = fds()
        srv.http.post("/v1/ipc/0/release", json={"lease": lease}, headers=auth)
        for model in (b, a, b):
            assert srv.http.post("/v1/reload", json={"model_dir": str(model)}, headers=auth).status_code == 202
            srv.poll_ready(timeout=120)
        deadline = time.monotonic() + 15
        while srv.status()["stopping_workers"] and time.monotonic() < deadline:
            time.sleep(0.05)
        switched = fds()
        print(
            f"descriptors: {before} before, {refused} after 5 refused reloads of {files} files, "
            f"{switched} after 3 reloads"
        )
        assert refused == before and switched <= before
    finally:
        srv.close()


# --------------------------------------------------------------------------------------- reload confinement


def _garbage_rank_file(path: Path, marker: bytes) -> None:
    """A file named like a rank file whose header is not JSON: a header error quoting it would show ``marker``."""
    body = marker * 8
    path.write_bytes(struct.pack("<Q", len(body)) + body)


def test_reload_checks_its_target_through_confined_opens_and_echoes_nothing(tmp_path):
    """A directory under --allow-root swapped back and forth for a symlink to a directory outside it while
    reloads to it are checked: no header outside the root is read (its files' access times stay as set),
    and no answer carries the outside files' bytes, their path, or the server's own paths."""
    import subprocess
    import sys

    root = tmp_path / "root"
    root.mkdir()
    shape = LlamaShape(hidden=64, intermediate=128, heads=4, kv_heads=4, vocab=256, layers=1)
    served = make_checkpoint(root / "served", shape, tp=1)
    flip = root / "flip"
    shutil.copytree(served, flip)
    (flip / "gdsload.json").unlink()  # found by its vLLM file name, like the outside one
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = b"SECRET-OUTSIDE-8"
    _garbage_rank_file(outside / "model-rank-0-part-0.safetensors", secret)
    os.utime(outside / "model-rank-0-part-0.safetensors", (0, time.time()))  # read -> atime moves (relatime)
    corrupt = root / "corrupt"  # inside the root, but not a valid file: its bytes are not echoed either
    corrupt.mkdir()
    _garbage_rank_file(corrupt / "model-rank-0-part-0.safetensors", b"SECRET-INSIDE-88")
    (root / "to-cwd").symlink_to("/proc/self/cwd")
    (root / "to-exe").symlink_to("/proc/self/exe")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    srv = Server(
        [
            str(served),
            "--token-file",
            str(token_file),
            "--device-map",
            "cpu",
            "--allow-root",
            str(root),
            "--lease-grace",
            "600",
        ],
        tmp_path / "serve.log",
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    stop = threading.Event()

    def flipper() -> None:  # `flip` is the directory, then a symlink out, then the directory again
        parked = root / ".parked"
        rng = random.Random(7)
        while not stop.is_set():
            os.rename(flip, parked)
            flip.symlink_to(outside, target_is_directory=True)
            time.sleep(rng.uniform(0, 0.003))
            flip.unlink()
            os.rename(parked, flip)
            time.sleep(rng.uniform(0, 0.006))

    try:
        srv.poll_ready(timeout=120)
        srv.http.get("/v1/ipc/0", headers=auth)  # an export outstanding: checked reloads are refused with 409
        answers: dict[int, int] = {}
        texts: list[str] = []
        thread = threading.Thread(target=flipper)
        thread.start()
        try:
            for _ in range(300):
                r = srv.http.post("/v1/reload", json={"model_dir": str(flip)}, headers=auth)
                key = f"{r.status_code} {r.json()['error']['type'] if r.status_code >= 400 else ''}".strip()
                answers[key] = answers.get(key, 0) + 1
                texts.append(r.text)
        finally:
            stop.set()
            thread.join(10)
        for name in ("to-cwd", "to-exe", "corrupt"):
            r = srv.http.post("/v1/reload", json={"model_dir": str(root / name)}, headers=auth)
            assert r.status_code in (400, 403), (name, r.text)
            texts.append(r.text)
        assert "model-rank-0-part-0.safetensors" in texts[-1] and "HeaderError" in texts[-1], texts[-1]
        print(f"reload confinement: 300 reloads while the target flips: {answers}")
        server_cwd = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getcwd())"], capture_output=True, text=True
        ).stdout.strip()  # the server runs in the tests' working directory
        assert os.stat(outside / "model-rank-0-part-0.safetensors").st_atime == 0, "an outside header was read"
        for text in texts:
            assert "SECRET" not in text and str(outside) not in text, text
            assert f"'{server_cwd}'" not in text and f"'{sys.executable}'" not in text, text
            assert "/proc/" not in text.replace(str(root), ""), text
        assert answers.get("409 ExportsOutstandingError", 0) > 0  # checks that ran to the end, on the inside files
    finally:
        stop.set()
        srv.close()


# --------------------------------------------------------------------------------------- what the public sees


def _scalars(doc: object) -> list[object]:
    if isinstance(doc, dict):
        return [v for x in doc.values() for v in _scalars(x)]
    if isinstance(doc, list):
        return [v for x in doc for v in _scalars(x)]
    return [doc]


def test_status_and_readiness_without_the_token_tell_states_and_phases_only(tmp_path):
    """Anyone who reaches the port reads states, phases, byte counts and timings; pids, paths, the token file,
    engines (pids, peers) and lease ids need the token. A wrong token is refused, not downgraded."""
    from gdsload.loader.handoff.sidecar_client import SidecarClient

    srv = _lease_server(tmp_path, "--allow-root", str(tmp_path))
    mapped = SidecarClient(srv.url, token=TOKEN).map_rank(0, private=True)
    try:
        mapped.hold()
        full = srv.http.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        rank = full["ranks"]["0"]
        pids = {srv.proc.pid, rank["pid"], os.getpid()}  # the server, its worker, the engine (this process)
        words = {str(tmp_path), mapped.lease, rank["held_by"][0]["peer"]}  # paths (the token file's too), lease, peer
        assert pids <= set(_scalars(full)) and all(w in json.dumps(full) for w in words)  # what the token shows
        public = srv.http.get("/v1/status")
        readyz = srv.http.get("/readyz")
        assert public.status_code == 200 and readyz.status_code == 200
        for r in (public, readyz):
            assert not pids & set(_scalars(r.json())), r.text
            assert not [w for w in words if w in r.text], r.text
        doc = public.json()
        assert doc["state"] == "ready" and doc["ranks"]["0"]["state"] == "ready" and doc["ranks"]["0"]["leases"] == 1
        assert set(doc["ranks"]["0"]["phases"]) == set(rank["phases"]) and doc["ranks"]["0"]["seconds"] > 0
        assert not {"model", "config", "fork_server"} & set(doc) and "pid" not in doc["process"]
        assert srv.http.get("/v1/status", headers={"Authorization": "Bearer wrong-token-0123456789"}).status_code == 401
        print(f"public status: {len(public.text)} bytes, {len(json.dumps(full))} with the token")
    finally:
        mapped.release()
        srv.close()


# --------------------------------------------------------------------------------------- worker count


def test_an_unreasonable_rank_count_on_one_host_is_refused_before_anything_starts(tmp_path):
    """A 32-rank directory served whole, ``--ranks 0-31``, or a reload asking for 17 ranks: a clear error
    naming the limit and the fix, and no worker started."""
    import subprocess
    import sys

    from gdsload.server.settings import MAX_LOCAL_RANKS

    root = tmp_path / "root"
    model = root / "tp32"
    model.mkdir(parents=True)
    for r in range(32):  # vLLM's per-rank file names, no manifest
        save_file({"w": torch.full((4,), float(r))}, model / f"model-rank-{r}-part-0.safetensors")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")}
    for extra in ([], ["--ranks", "0-31"]):
        t = time.monotonic()
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "gdsload.server.cmd_serve",
                str(model),
                "--port",
                "0",
                "--device-map",
                "cpu",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        out = p.stdout + p.stderr
        print(f"worker count: serve {' '.join(extra) or '(all ranks)'} refused in {time.monotonic() - t:.2f} s")
        assert p.returncode == 2 and f"at most {MAX_LOCAL_RANKS}" in out and "--ranks" in out, out
        assert "listening on" not in out and "started worker" not in out, out
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    srv = Server(
        [str(model), "--ranks", "0", "--device-map", "cpu", "--token-file", str(token_file), "--allow-root", str(root)],
        tmp_path / "serve.log",
    )
    try:
        srv.poll_ready(timeout=120)
        r = srv.http.post(
            "/v1/reload",
            json={"model_dir": str(model), "ranks": list(range(MAX_LOCAL_RANKS + 1))},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "TooManyRanksError", r.text
        assert srv.status()["ranks"].keys() == {"0"} and srv.http.get("/readyz").status_code == 200
    finally:
        srv.close()


def test_a_stalled_head_after_a_response_is_cut_off_and_a_long_answer_is_not(served):
    """The header deadline runs again after each response (a keep-alive connection that starts its next request
    and stalls is closed), and never while a request is answered (a held lease streams past it)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    s = _connect(served.url)
    s.sendall(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    s.settimeout(5)
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: 127.")  # the next request, stalled
    t = time.monotonic()
    assert _closed_by_server(s, 5.0)
    stalled_s = time.monotonic() - t
    s.close()
    lease = httpx.get(served.url + "/v1/ipc/0", headers=auth).json()["lease"]
    h = _connect(served.url)
    h.sendall(
        f"GET /v1/ipc/0/hold?lease={lease} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
    )
    h.settimeout(5)
    head = b""
    while b"held" not in head:  # the head, then the first chunk
        head += h.recv(4096)
    assert not _closed_by_server(h, 3.0)  # three times the request timeout (1 s), still held
    assert httpx.get(served.url + "/v1/status", headers=auth).json()["ranks"]["0"]["held_by"]
    h.close()
    print(f"http deadlines: a stalled second head cut off after {stalled_s:.2f} s (timeout 1 s); a hold kept 3 s")
    assert stalled_s < 3.0
