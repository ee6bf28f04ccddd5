"""Does polling ``/readyz`` hard slow a load down? The sidecar's load time with and without 1000 polls/s.

One ``gdsload serve`` process serves a synthetic checkpoint (CPU backend). Each round reloads the
same model (``POST /v1/reload``: fresh workers, warm page cache) twice: once with only the
benchmark's own 10 Hz readiness poll (``idle``), once while a separate load-generator process
sends ``GET /readyz`` at ``--rate`` requests per second over keep-alive connections
(``polled``). The order alternates between rounds. Per load it records the ranks' load seconds
(``load_rank``'s phases, from ``/v1/status``), the read phase, and the time from the reload
request to ``/readyz`` 200; per polled load, the achieved request rate, latencies and the
server's CPU time per request.

    python -m gdsload.bench.readyz_load --size 2GB --tp 2 --repeat 7 --rate 1000 --out /tmp/readyz-bench
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

_URL_RE = re.compile(r"listening on (http://[^\s\"]+:\d+)")


# ------------------------------------------------------------------------------------------ load generator


def _connection(host: str, port: int, first: float, interval: float, stop: threading.Event,
                latencies: list[float], codes: dict[int, int]) -> None:
    """One keep-alive connection sending GET /readyz on a fixed schedule (blocking socket: cheap per request)."""
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = f"GET /readyz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    due = first
    buf = b""
    try:
        while not stop.is_set():
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            elif delay < -1.0:  # fell more than a second behind: do not burst to catch up
                due = time.monotonic()
            t0 = time.perf_counter()
            sock.sendall(request)
            while (end := buf.find(b"\r\n\r\n")) < 0:
                buf += sock.recv(65536)
            head = buf[:end].decode("latin-1").split("\r\n")
            length = next(int(h.split(":", 1)[1]) for h in head[1:] if h.lower().startswith("content-length:"))
            while len(buf) < end + 4 + length:
                buf += sock.recv(65536)
            buf = buf[end + 4 + length:]
            latencies.append(time.perf_counter() - t0)
            code = int(head[0].split()[1])
            codes[code] = codes.get(code, 0) + 1
            due += interval
    finally:
        sock.close()


def _generate(url: str, rate: float, connections: int) -> dict[str, Any]:
    """Poll ``url``/readyz at ``rate`` per second over ``connections`` threads until SIGTERM; return statistics."""
    m = re.match(r"http://([^:/]+):(\d+)", url)
    assert m, url
    host, port = m[1], int(m[2])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    per_thread: list[tuple[list[float], dict[int, int]]] = [([], {}) for _ in range(connections)]
    interval = connections / rate
    start = time.monotonic()
    threads = [threading.Thread(target=_connection, args=(host, port, start + k / rate, interval, stop, *per_thread[k]),
                                daemon=True) for k in range(connections)]
    for t in threads:
        t.start()
    print("generating", flush=True)
    while not stop.wait(0.5):
        pass
    seconds = time.monotonic() - start
    for t in threads:
        t.join(5)
    latencies = sorted(x for lat, _ in per_thread for x in lat)
    codes: dict[int, int] = {}
    for _, c in per_thread:
        for k, v in c.items():
            codes[k] = codes.get(k, 0) + v
    n = len(latencies)
    return {
        "requests": n,
        "seconds": seconds,
        "rate": n / seconds if seconds else 0.0,
        "codes": {str(k): v for k, v in sorted(codes.items())},
        "p50_ms": latencies[n // 2] * 1e3 if n else None,
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1e3 if n else None,
        "max_ms": latencies[-1] * 1e3 if n else None,
    }


# ------------------------------------------------------------------------------------------ the benchmark


def _http(method: str, url: str, token: str | None = None, body: dict[str, Any] | None = None,
          timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:  # noqa: S310 (loopback)
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _wait_ready(url: str, timeout: float, period: float = 0.1) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            code, doc = _http("GET", url + "/readyz", timeout=2.0)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            code, doc = 0, {}
        if code == 200:
            return time.monotonic() - start
        if "failed" in doc.get("ranks", {}).values():
            raise SystemExit(f"a rank failed: {_http('GET', url + '/v1/status')[1]['ranks']}")
        time.sleep(period)
    raise SystemExit(f"not ready within {timeout} s")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        after = f.read().rsplit(")", 1)[1].split()
    return (int(after[11]) + int(after[12])) / os.sysconf("SC_CLK_TCK")


def _one_load(url: str, token: str, model: str, server_pid: int, rate: float, connections: int,
              polled: bool, settle: float) -> dict[str, Any]:
    generator = None
    cpu_before = _cpu_seconds(server_pid)
    if polled:
        quiet_cpu = _cpu_seconds(server_pid)  # the server's own background CPU, with nothing polling it
        time.sleep(settle / 2)
        quiet_cpu = _cpu_seconds(server_pid) - quiet_cpu
        generator = subprocess.Popen(
            [sys.executable, "-m", "gdsload.bench.readyz_load", "--generator", url, "--rate", str(rate),
             "--connections", str(connections)], stdout=subprocess.PIPE, text=True)
        assert generator.stdout is not None
        generator.stdout.readline()  # "generating"
        time.sleep(settle / 2)  # let the rate settle, then take the server's CPU for polls alone
        polls_cpu = _cpu_seconds(server_pid)
        time.sleep(settle / 2)
        polls_cpu = _cpu_seconds(server_pid) - polls_cpu
        cpu_before = _cpu_seconds(server_pid)
    t0 = time.monotonic()
    code, doc = _http("POST", url + "/v1/reload", token, {"model_dir": model, "force": True}, timeout=60)
    if code != 202:
        raise SystemExit(f"reload answered {code}: {doc}")
    ready_s = _wait_ready(url, 300)
    elapsed = time.monotonic() - t0
    cpu = _cpu_seconds(server_pid) - cpu_before
    load = None
    if generator is not None:
        generator.send_signal(signal.SIGTERM)
        out, _ = generator.communicate(timeout=30)
        load = json.loads(out.strip().splitlines()[-1])
    _, status = _http("GET", url + "/v1/status")
    ranks = status["ranks"].values()
    row = {
        "condition": "polled" if polled else "idle",
        "time_to_ready_s": status["load"]["time_to_ready_s"],
        "reload_to_200_s": ready_s,
        "load_seconds_max": max(r["seconds"] for r in ranks),
        "load_seconds_mean": statistics.mean(r["seconds"] for r in ranks),
        "read_seconds_max": max(r["phases"]["read"] for r in ranks),
        "gbps_sum": sum(r["gbps"] for r in ranks),
        "logical_bytes": sum(r["logical_bytes"] for r in ranks),
        "devices": sorted({r["device"] for r in ranks}),
        "backends": sorted({r["backend"] for r in ranks}),
        "server_cpu_s": cpu,
        "window_s": elapsed,
        "poller": load,
    }
    if load and load["requests"] and settle > 0:
        # Over the second half of the settle window: polls only, no load (the reload's own CPU is not
        # theirs), less the server's background CPU over as long a window before the polls began.
        row["server_cpu_us_per_request"] = max(0.0, polls_cpu - quiet_cpu) / (load["rate"] * settle / 2) * 1e6
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generator", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="2GB", help="synthetic checkpoint size, all ranks together (default 2GB)")
    ap.add_argument("--tp", type=int, default=2, help="ranks, one worker each (default 2)")
    ap.add_argument("--repeat", type=int, default=7, help="rounds; each loads once idle and once polled (default 7)")
    ap.add_argument("--rate", type=float, default=1000.0, help="/readyz requests per second while polled")
    ap.add_argument("--connections", type=int, default=8, help="keep-alive connections of the poller (default 8)")
    ap.add_argument("--device-map", default="cpu", help="the server's --device-map (default cpu; auto uses the GPUs)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of polling before each polled load starts "
                    "(the server's CPU per request is taken over its second half, less its CPU over as long a quiet window before)")
    ap.add_argument("--out", default="readyz-bench", help="where the checkpoint and results.json go")
    args = ap.parse_args(argv)
    if args.generator:
        print(json.dumps(_generate(args.generator, args.rate, args.connections)), flush=True)
        return

    from gdsload.loader import parse_size
    from gdsload.loader.prepare.synthetic import make_checkpoint, shape_for_size
    from gdsload.server.cmd_demo import serve_command

    out = Path(args.out).resolve()
    model = out / "model"
    if not (model / "gdsload.json").exists():
        print(f"building a {args.size} synthetic checkpoint, tp={args.tp}, in {model} ...", flush=True)
        make_checkpoint(model, shape_for_size(parse_size(args.size)), tp=args.tp)
    token = secrets.token_hex(16)
    log_path = out / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSLOAD_")}
    env.update(GDSLOAD_TOKEN=token, PYTHONUNBUFFERED="1")
    cmd = serve_command(str(model), "--tp", str(args.tp), "--port", "0", "--allow-root", str(out),
                        "--device-map", args.device_map)
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (m := _URL_RE.search(log_path.read_text(errors="replace"))):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        url = m[1]
        _wait_ready(url, 300)
        print(f"server {url} ready; {args.repeat} round(s) of reloads, idle vs {args.rate:.0f} /readyz per second",
              flush=True)
        runs = []
        for i in range(args.repeat):
            order = (False, True) if i % 2 == 0 else (True, False)
            for polled in order:
                row = _one_load(url, token, str(model), server.pid, args.rate, args.connections, polled, args.settle)
                row["round"] = i
                runs.append(row)
                p = row["poller"]
                extra = (f"  poll {p['rate']:.0f}/s p50 {p['p50_ms']:.2f} ms p99 {p['p99_ms']:.2f} ms "
                         + (f" server {row['server_cpu_us_per_request']:.0f} us CPU/request"
                            if "server_cpu_us_per_request" in row else "") if p else "")
                print(f"round {i} {row['condition']:6}  load {row['load_seconds_max']:.3f} s  "
                      f"read {row['read_seconds_max']:.3f} s  ready after {row['time_to_ready_s']:.3f} s{extra}",
                      flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()

    summary: dict[str, Any] = {}
    for key in ("load_seconds_max", "read_seconds_max", "time_to_ready_s"):
        idle = statistics.median(r[key] for r in runs if r["condition"] == "idle")
        polled = statistics.median(r[key] for r in runs if r["condition"] == "polled")
        summary[key] = {"idle_median": idle, "polled_median": polled, "slowdown_pct": (polled / idle - 1) * 100}
    polls = [r["poller"] for r in runs if r["poller"]]
    summary["poller"] = {
        "rate_median": statistics.median(p["rate"] for p in polls),
        "p50_ms_median": statistics.median(p["p50_ms"] for p in polls),
        "p99_ms_median": statistics.median(p["p99_ms"] for p in polls),
        "non_2xx_5xx": sum(n for p in polls for c, n in p["codes"].items() if c not in ("200", "503")),
    }
    per_request = [r["server_cpu_us_per_request"] for r in runs if "server_cpu_us_per_request" in r]
    summary["poller"]["server_cpu_us_per_request_median"] = statistics.median(per_request) if per_request else None
    print(f"\n{'median over ' + str(args.repeat) + ' rounds':32} {'idle':>9} {'polled':>9} {'slowdown':>9}")
    for key in ("load_seconds_max", "read_seconds_max", "time_to_ready_s"):
        s = summary[key]
        print(f"{key:32} {s['idle_median']:9.3f} {s['polled_median']:9.3f} {s['slowdown_pct']:8.1f}%")
    p = summary["poller"]
    print(f"poller: {p['rate_median']:.0f} req/s achieved, p50 {p['p50_ms_median']:.2f} ms, p99 "
          f"{p['p99_ms_median']:.2f} ms; server CPU "
          + (f"{p['server_cpu_us_per_request_median']:.0f} us per request"
             if p["server_cpu_us_per_request_median"] is not None else "not measured (--settle 0)"))
    facts = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "cpus": os.cpu_count(),
             "python": platform.python_version(), "size": args.size, "tp": args.tp, "rate": args.rate,
             "connections": args.connections, "repeat": args.repeat, "settle": args.settle,
             "device_map": args.device_map, "devices": runs[0]["devices"], "backends": runs[0]["backends"],
             "logical_bytes": runs[0]["logical_bytes"]}
    (out / "results.json").write_text(json.dumps({"facts": facts, "summary": summary, "runs": runs}, indent=2))
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
