"""deploy/: container image, entry point, health check, bare-metal unit, Lustre and cuFile set-up, docs.

There is no Docker engine here (nor in CI), so the image is not built: the Dockerfiles are linted
(hadolint) and checked for what they must contain, and the scripts the image runs are run directly
(the entry point with a fake ``gdsload`` on PATH, the health check against a local HTTP server).
Shell scripts must pass shellcheck. The Kubernetes manifests are tested in test_deploy_k8s.py.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

from gdsload.loader.io.cpu import CpuBackend
from gdsload.loader.io.cufile import CuFileBackend
from gdsload.loader.io.pinned import PinnedBackend

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"
HEALTHCHECK = DOCKER / "healthcheck.py"
STRIPING = DEPLOY / "lustre" / "setup-striping.sh"
CUFILE = DEPLOY / "cufile" / "cufile.json"
UNIT = DEPLOY / "systemd" / "gdsload.service"
UNIT_ENV = DEPLOY / "systemd" / "gdsload.env"
README = DEPLOY / "README.md"
DOCKERFILES = sorted(DOCKER.glob("*Dockerfile"))
_SH_SHEBANG = re.compile(rb"#!\s*(/usr/bin/env\s+)?(/usr)?(/bin/)?(ba|da|k)?sh\b")
SHELL_SCRIPTS = sorted(p for p in DEPLOY.rglob("*") if p.is_file() and _SH_SHEBANG.match(p.open("rb").readline()))
EX_USAGE, EX_NOINPUT, EX_UNAVAILABLE, EX_SOFTWARE, EX_CONFIG = 64, 66, 69, 70, 78


def _tool(name: str) -> str:
    """A linter binary: from the venv that runs the tests (the test extras install it), or PATH."""
    found = shutil.which(name, path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]' provides it)")
    return found


# ----------------------------------------------------------------------------------------------
# Linters
# ----------------------------------------------------------------------------------------------


def test_shell_scripts_found():
    assert {p.name for p in SHELL_SCRIPTS} == {"entrypoint.sh", "setup-striping.sh"}
    assert all(os.access(p, os.X_OK) for p in SHELL_SCRIPTS)


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script: Path):
    out = subprocess.run([_tool("shellcheck"), "--severity=style", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile: Path):
    out = subprocess.run(
        [_tool("hadolint"), "--format", "json", "--failure-threshold", "style", str(dockerfile)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and json.loads(out.stdout or "[]") == [], out.stdout + out.stderr


# ----------------------------------------------------------------------------------------------
# Dockerfiles: what an image build would rely on
# ----------------------------------------------------------------------------------------------


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#") and not pending:
            continue
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            if pending.strip():
                word, _, rest = pending.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def _final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    ins = _instructions(dockerfile)
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last_from:]


def _dockerignore_allows(ignore: Path, rel: str) -> bool:
    """Docker's rule: the last matching pattern wins, `!` re-includes; a directory covers its files."""
    allowed = True
    for raw in ignore.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        else:
            hit = any(fnmatch.fnmatchcase(p, pattern) for p in prefixes)
        if hit:
            allowed = negate
    return allowed


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_only_files_that_exist_and_reach_the_context(dockerfile: Path):
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore.is_file(), f"{ignore.name} keeps .venv/, .git/ and stray model files out of the build context"
    copies = [args for word, args in _instructions(dockerfile) if word == "COPY" and "--from=" not in args]
    assert copies
    for args in copies:
        sources = [a for a in args.split() if not a.startswith("--")][:-1]
        for src in sources:
            path = ROOT / src.rstrip("/").removeprefix("./")
            assert path.exists(), src
            files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
            for f in files:
                rel = f.relative_to(ROOT).as_posix()
                assert _dockerignore_allows(ignore, rel), f"{rel} is excluded by {ignore.name}"
    assert not _dockerignore_allows(ignore, ".venv/bin/python")
    assert not _dockerignore_allows(ignore, "loader/__pycache__/api.cpython-311.pyc")


def test_sidecar_image():
    dockerfile = DOCKER / "Dockerfile"
    text = dockerfile.read_text()
    ins = _instructions(dockerfile)
    # CUDA 12 by default, 13 through the build argument; each maps to a pip extra that exists.
    assert re.search(r"^ARG CUDA_VERSION=12\.\d+\.\d+$", text, re.M)
    froms = [args for word, args in ins if word == "FROM"]
    assert all(f.startswith("nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu") or f.startswith("python AS") for f in froms)
    extras = importlib.metadata.metadata("gdsload").get_all("Provides-Extra")
    assert '"${wheel}[cu${major}]"' in text and {"cu12", "cu13"} <= set(extras)
    assert re.search(r"^\s+12\) default_index=\S+/cu12\d ;;", text, re.M)
    assert re.search(r"^\s+13\) default_index=\S+/cu13\d ;;", text, re.M)
    # The torch it installs is the project's own pin (the README's set-up command).
    pin = re.search(r"torch==([\d.]+)", (ROOT / "README.md").read_text()).group(1)
    assert f"ARG TORCH_VERSION={pin}" in text
    final = dict(_final_stage(dockerfile))
    # Non-root, numeric (runAsNonRoot can verify it), the uid the manifests run as.
    assert final["USER"] == "10001:10001"
    assert "--uid 10001" in text
    assert json.loads(final["ENTRYPOINT"]) == ["/usr/local/bin/gdsload-entrypoint"]
    assert json.loads(final["CMD"]) == ["serve"]
    assert "deploy/docker/entrypoint.sh /usr/local/bin/gdsload-entrypoint" in text
    assert final["EXPOSE"] == "8471"
    # The health check is the liveness endpoint, through the script shipped in the image.
    assert "deploy/docker/healthcheck.py /usr/local/lib/gdsload/healthcheck.py" in text
    assert final["HEALTHCHECK"].endswith('CMD ["/opt/gdsload/bin/python", "/usr/local/lib/gdsload/healthcheck.py"]')
    # cuFile reads the shipped configuration.
    assert "deploy/cufile/cufile.json /etc/gdsload/cufile.json" in text
    assert "CUFILE_ENV_PATH_JSON=/etc/gdsload/cufile.json" in final["ENV"]


def test_engine_image_keeps_vllms_torch_and_checks_the_plugin():
    text = (DOCKER / "engine.Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v[\d.]+$", text, re.M)
    assert "torch_after" in text and "torch_before" in text
    assert 'entry_points(group="vllm.general_plugins")' in text


# ----------------------------------------------------------------------------------------------
# The entry point, run directly with a fake gdsload
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gdsload(tmp_path: Path) -> Path:
    """A `gdsload` that records its argv (one per line) and its pid."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "gdsload"
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$FAKE_ARGV"\necho $$ > "$FAKE_PID"\n')
    fake.chmod(0o755)
    return bin_dir


def run_entrypoint(bin_dir: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    argv_file = bin_dir / "argv"
    argv_file.unlink(missing_ok=True)
    full_env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_ARGV": str(argv_file),
        "FAKE_PID": str(bin_dir / "pid"),
        **env,
    }
    proc = subprocess.Popen(
        [str(ENTRYPOINT), *args], env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stdout, stderr = proc.communicate(timeout=30)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    argv = argv_file.read_text().splitlines() if argv_file.exists() else []
    if argv:  # exec, not a child: the fake ran as the entry point's own process
        assert int((bin_dir / "pid").read_text()) == proc.pid
    return out, argv


def test_entrypoint_defaults_to_serve_with_model_dir_from_env(fake_gdsload: Path):
    out, argv = run_entrypoint(fake_gdsload, GDSLOAD_MODEL_DIR="/models/m")
    assert out.returncode == 0, out.stderr
    assert argv == ["serve", "/models/m"]


def test_entrypoint_passes_serve_arguments_unchanged(fake_gdsload: Path):
    args = ["serve", "/models/with space", "--tp", "8", "--backend=auto", "--port", "9000", "--verbose"]
    out, argv = run_entrypoint(fake_gdsload, *args, GDSLOAD_MODEL_DIR="/models/other")
    assert out.returncode == 0, out.stderr
    assert argv == args  # the command line's MODEL_DIR wins over GDSLOAD_MODEL_DIR


def test_entrypoint_inserts_model_dir_before_options(fake_gdsload: Path):
    out, argv = run_entrypoint(fake_gdsload, "serve", "--tp", "2", GDSLOAD_MODEL_DIR="/models/m")
    assert out.returncode == 0, out.stderr
    assert argv == ["serve", "/models/m", "--tp", "2"]
    out, argv = run_entrypoint(fake_gdsload, "serve", "--", "/models/x")
    assert out.returncode == 0 and argv == ["serve", "--", "/models/x"]


def test_entrypoint_knows_every_serve_option_that_takes_a_value():
    from gdsload.server.cmd_serve import serve

    takes_value = {
        opt
        for p in serve.params
        if not getattr(p, "is_flag", False) and p.param_type_name == "option"
        for opt in p.opts
    }
    case = re.search(r"^\s+(--tp \|.*?)\)$", ENTRYPOINT.read_text(), re.M | re.S).group(1)
    known = {o.strip() for o in case.replace("\\", " ").split("|")}
    assert takes_value <= known, sorted(takes_value - known)


def test_entrypoint_does_not_take_an_option_value_for_the_model_dir(fake_gdsload: Path):
    args = ["serve", "--log-level", "debug", "--device-map", "auto", "--max-restarts", "3"]
    out, argv = run_entrypoint(fake_gdsload, *args, GDSLOAD_MODEL_DIR="/models/m")
    assert out.returncode == 0, out.stderr
    assert argv == ["serve", "/models/m", *args[1:]]


def test_entrypoint_needs_a_model_dir(fake_gdsload: Path):
    out, argv = run_entrypoint(fake_gdsload, "serve", "--tp", "8")
    assert out.returncode == EX_USAGE and argv == []
    assert "GDSLOAD_MODEL_DIR" in out.stderr


def test_entrypoint_passes_other_subcommands_through(fake_gdsload: Path):
    for args in (["doctor"], ["inspect", "/models/m", "--json"], ["--version"]):
        out, argv = run_entrypoint(fake_gdsload, *args, GDSLOAD_HOST="0.0.0.0")
        assert out.returncode == 0, out.stderr
        assert argv == args


@pytest.mark.parametrize(
    ("index", "gpus", "ranks"),
    [("0", "8", "0-7"), ("1", "8", "8-15"), ("3", "4", "12-15"), ("08", "2", "16-17"), ("0", "1", "0-0")],
)
def test_entrypoint_derives_this_nodes_ranks(fake_gdsload: Path, index: str, gpus: str, ranks: str):
    out, argv = run_entrypoint(fake_gdsload, "serve", "/models/m", GDSLOAD_NODE_INDEX=index, GDSLOAD_GPUS_PER_NODE=gpus)
    assert out.returncode == 0, out.stderr
    assert argv == ["serve", "/models/m", "--ranks", ranks]


@pytest.mark.parametrize(
    "env",
    [
        {"GDSLOAD_NODE_INDEX": "1"},
        {"GDSLOAD_GPUS_PER_NODE": "8"},
        {"GDSLOAD_NODE_INDEX": "-1", "GDSLOAD_GPUS_PER_NODE": "8"},
        {"GDSLOAD_NODE_INDEX": "x", "GDSLOAD_GPUS_PER_NODE": "8"},
        {"GDSLOAD_NODE_INDEX": "1", "GDSLOAD_GPUS_PER_NODE": "0"},
        {"GDSLOAD_NODE_INDEX": "1", "GDSLOAD_GPUS_PER_NODE": "8 "},
    ],
)
def test_entrypoint_rejects_half_or_bad_node_settings(fake_gdsload: Path, env: dict[str, str]):
    out, argv = run_entrypoint(fake_gdsload, "serve", "/models/m", **env)
    assert out.returncode == EX_USAGE and argv == [], out.stderr
    assert "GDSLOAD_" in out.stderr


@pytest.mark.parametrize(
    ("args", "env"),
    [(["--ranks", "0-3"], {}), (["--tp=4"], {}), ([], {"GDSLOAD_RANKS": "0-3"}), ([], {"GDSLOAD_TP": "4"})],
)
def test_explicit_ranks_win_over_the_node_index(fake_gdsload: Path, args: list[str], env: dict[str, str]):
    out, argv = run_entrypoint(
        fake_gdsload, "serve", "/models/m", *args, GDSLOAD_NODE_INDEX="1", GDSLOAD_GPUS_PER_NODE="8", **env
    )
    assert out.returncode == 0, out.stderr
    assert argv == ["serve", "/models/m", *args]
    assert "ignored" in out.stderr


def test_entrypoint_checks_the_token_file(fake_gdsload: Path, tmp_path: Path):
    missing = tmp_path / "nope"
    out, argv = run_entrypoint(fake_gdsload, "serve", "/models/m", GDSLOAD_TOKEN_FILE=str(missing))
    assert out.returncode == EX_CONFIG and argv == [] and str(missing) in out.stderr
    empty = tmp_path / "empty"
    empty.write_text("")
    out, argv = run_entrypoint(fake_gdsload, "serve", "/models/m", f"--token-file={empty}")
    assert out.returncode == EX_CONFIG and argv == [] and "empty" in out.stderr
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789")
    out, argv = run_entrypoint(fake_gdsload, "serve", "/models/m", "--token-file", str(token))
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("args", "env"),
    [
        ([], {"GDSLOAD_HOST": "0.0.0.0"}),
        (["--host", "10.0.0.5"], {}),
        (["--host=::"], {}),
        ([], {"GDSLOAD_HOST": "0.0.0.0", "GDSLOAD_TOKEN": ""}),
    ],
)
def test_entrypoint_refuses_an_open_port_without_a_token(fake_gdsload: Path, args: list[str], env: dict[str, str]):
    out, argv = run_entrypoint(fake_gdsload, "serve", "/models/m", *args, **env)
    assert out.returncode == EX_CONFIG and argv == []
    assert "without a token" in out.stderr


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"GDSLOAD_HOST": "127.0.0.1"},
        {"GDSLOAD_HOST": "::1"},
        {"GDSLOAD_HOST": "0.0.0.0", "GDSLOAD_TOKEN": "s3cret-token-0123456789"},
    ],
)
def test_entrypoint_allows_loopback_or_a_token(fake_gdsload: Path, env: dict[str, str]):
    out, argv = run_entrypoint(fake_gdsload, "serve", "/models/m", **env)
    assert out.returncode == 0, out.stderr
    assert argv == ["serve", "/models/m"]


def test_entrypoint_reports_a_missing_option_value(fake_gdsload: Path):
    out, argv = run_entrypoint(fake_gdsload, "serve", "/models/m", "--ranks")
    assert out.returncode == EX_USAGE and "--ranks needs a value" in out.stderr


# ----------------------------------------------------------------------------------------------
# The health check, against a local HTTP server
# ----------------------------------------------------------------------------------------------


class _Sidecar(http.server.BaseHTTPRequestHandler):
    status = 200
    paths: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        type(self).paths.append(self.path)
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def sidecar_server() -> Iterator[http.server.ThreadingHTTPServer]:
    _Sidecar.status, _Sidecar.paths = 200, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sidecar)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run_healthcheck(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK)],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_healthcheck_passes_on_healthz_200(sidecar_server: http.server.ThreadingHTTPServer):
    port = str(sidecar_server.server_address[1])
    # A wildcard bind is checked through loopback; a proxy in the environment is ignored.
    out = run_healthcheck(GDSLOAD_HOST="0.0.0.0", GDSLOAD_PORT=port, http_proxy="http://127.0.0.1:9")
    assert out.returncode == 0, out.stderr
    assert _Sidecar.paths == ["/healthz"]


def test_healthcheck_fails_on_an_error_status(sidecar_server: http.server.ThreadingHTTPServer):
    _Sidecar.status = 503
    out = run_healthcheck(GDSLOAD_PORT=str(sidecar_server.server_address[1]))
    assert out.returncode == 1 and "503" in out.stderr


def test_healthcheck_fails_when_nothing_listens(sidecar_server: http.server.ThreadingHTTPServer):
    port = sidecar_server.server_address[1]
    sidecar_server.shutdown()
    sidecar_server.server_close()
    out = run_healthcheck(GDSLOAD_HOST="127.0.0.1", GDSLOAD_PORT=str(port))
    assert out.returncode == 1 and "unhealthy" in out.stderr


def test_healthcheck_url():
    sys.path.insert(0, str(DOCKER))
    try:
        from healthcheck import healthz_url
    finally:
        sys.path.remove(str(DOCKER))
    assert healthz_url({}) == "http://127.0.0.1:8471/healthz"
    assert healthz_url({"GDSLOAD_HOST": "::", "GDSLOAD_PORT": "9000"}) == "http://[::1]:9000/healthz"
    assert healthz_url({"GDSLOAD_HOST": "10.1.2.3"}) == "http://10.1.2.3:8471/healthz"
    assert healthz_url({"GDSLOAD_HOST": "fd00::5"}) == "http://[fd00::5]:8471/healthz"


# ----------------------------------------------------------------------------------------------
# Lustre striping, against a fake `lfs`
# ----------------------------------------------------------------------------------------------

FAKE_LFS = r'''#!{python}
"""A fake lfs: layouts kept in a JSON file; -1 on a file reads back as the OST count."""
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
with open(os.environ["FAKE_LFS_LOG"], "a") as log:
    log.write(" ".join(args) + "\n")
state_file = Path(os.environ["FAKE_LFS_STATE"])
state = json.loads(state_file.read_text()) if state_file.exists() else {{}}
osts = int(os.environ.get("FAKE_LFS_OSTS", "4"))
units = {{"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}}
def size(s): return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)
if args[0] == "osts":
    for i in range(osts):
        print(f"{{i}}: fs-OST{{i:04x}}_UUID ACTIVE")
    sys.exit(0)
path = args[-1]
if os.environ.get("FAKE_LFS_NOT_LUSTRE"):
    print(f"lfs {{args[0]}}: {{path}}: not on a Lustre filesystem", file=sys.stderr)
    sys.exit(25)
if args[0] == "getstripe":
    count, stripe = state.get(path, (1, 1 << 20))
    if "-c" in args: print(count)
    elif "-S" in args: print(stripe)
    else: print(f"stripe_count: {{count}} stripe_size: {{stripe}}")
elif args[0] in ("setstripe", "migrate") and not os.environ.get("FAKE_LFS_IGNORE_SET"):
    count, stripe = int(args[args.index("-c") + 1]), size(args[args.index("-S") + 1])
    if args[0] == "migrate" and count == -1:
        count = osts
    state[path] = (count, stripe)
    state_file.write_text(json.dumps(state))
'''


class Lustre:
    def __init__(self, tmp_path: Path) -> None:
        self.bin = tmp_path / "lfsbin"
        self.bin.mkdir()
        lfs = self.bin / "lfs"
        lfs.write_text(FAKE_LFS.format(python=sys.executable))
        lfs.chmod(0o755)
        self.log = tmp_path / "lfs.log"
        self.state = tmp_path / "lfs.json"
        self.dir = tmp_path / "shards"
        (self.dir / "sub").mkdir(parents=True)

    def run(self, *args: str, lfs: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
        path = f"{self.bin}:/usr/bin:/bin" if lfs else "/usr/bin:/bin"
        return subprocess.run(
            [str(STRIPING), *args],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": path, "FAKE_LFS_LOG": str(self.log), "FAKE_LFS_STATE": str(self.state), **env},
        )

    def calls(self, verb: str) -> list[str]:
        return [c for c in self.log.read_text().splitlines() if c.split()[0] == verb] if self.log.exists() else []

    def layout(self, path: Path) -> list[int]:
        return json.loads(self.state.read_text())[str(path)]


@pytest.fixture
def lustre(tmp_path: Path) -> Lustre:
    return Lustre(tmp_path)


def test_striping_sets_every_directory_and_checks_it(lustre: Lustre):
    out = lustre.run(str(lustre.dir))
    assert out.returncode == 0, out.stderr
    assert lustre.calls("setstripe") == [
        f"setstripe -c -1 -S 16M {lustre.dir}",
        f"setstripe -c -1 -S 16M {lustre.dir}/sub",
    ]
    assert lustre.layout(lustre.dir) == [-1, 16 << 20]
    assert "-c" in " ".join(lustre.calls("getstripe")) and "ok: 2 directories" in out.stdout


def test_striping_and_cufile_sizes_fit_gdsloads_reads():
    assert re.search(r"^size=(\S+)$", STRIPING.read_text(), re.M).group(1) == "16M"
    stripe = 16 << 20
    reads = {
        CuFileBackend.DEFAULT_TASK,
        CuFileBackend.COLD_TASK,
        PinnedBackend.RING_CHUNK,
        PinnedBackend.KVIKIO_TASK,
        PinnedBackend.KVIKIO_COLD_TASK,
        CpuBackend.DEFAULT_CHUNK,
    }
    # Every default read size divides the stripe (no read spans more than two OSTs)...
    assert all(stripe % r == 0 for r in reads), reads
    # ...and cuFile never splits one of them.
    assert _cufile()["properties"]["max_direct_io_size_kb"] * 1024 >= max(reads)


def test_striping_fails_when_the_layout_does_not_stick(lustre: Lustre):
    out = lustre.run(str(lustre.dir), FAKE_LFS_IGNORE_SET="1")
    assert out.returncode == EX_SOFTWARE and "reads back" in out.stderr


def test_striping_dry_run_changes_nothing(lustre: Lustre):
    out = lustre.run("--dry-run", str(lustre.dir))
    assert out.returncode == 0, out.stderr
    assert lustre.calls("setstripe") == [] and f"would run: lfs setstripe -c -1 -S 16M {lustre.dir}" in out.stdout


def test_striping_refuses_what_is_not_lustre(lustre: Lustre):
    out = lustre.run(str(lustre.dir), FAKE_LFS_NOT_LUSTRE="1")
    assert out.returncode == EX_CONFIG and "not on a Lustre" in out.stderr
    assert lustre.calls("setstripe") == []


def test_striping_preconditions(lustre: Lustre, tmp_path: Path):
    assert lustre.run(str(tmp_path / "missing")).returncode == EX_NOINPUT
    out = lustre.run(str(lustre.dir), lfs=False)
    assert out.returncode == EX_UNAVAILABLE and "lfs" in out.stderr
    for bad in (
        ["--size", "100K"],
        ["--size", "16MB"],
        ["--size", "0"],
        ["--count", "0"],
        ["--count", "x"],
        ["--bogus"],
        [],
    ):
        out = lustre.run(*bad, str(lustre.dir)) if bad != [] else lustre.run()
        assert out.returncode == EX_USAGE, bad
    assert lustre.calls("setstripe") == []


def test_striping_reports_and_migrates_existing_files(lustre: Lustre):
    shard = lustre.dir / "model-rank-0-part-0.safetensors"
    shard.write_bytes(b"x")
    out = lustre.run(str(lustre.dir))
    assert out.returncode == 0 and str(shard) in out.stderr and "--migrate" in out.stderr
    assert lustre.calls("migrate") == []
    out = lustre.run("--migrate", str(lustre.dir))
    assert out.returncode == 0, out.stderr
    assert lustre.calls("migrate") == [f"migrate -c -1 -S 16M {shard}"]
    assert lustre.layout(shard) == [4, 16 << 20]  # -1 = all 4 OSTs
    out = lustre.run(str(lustre.dir))
    assert out.returncode == 0 and "all striped over 4 OSTs" in out.stdout


# ----------------------------------------------------------------------------------------------
# cufile.json
# ----------------------------------------------------------------------------------------------

# The cuFile keys this template may use (cufile.json reference, GDS configuration guide).
CUFILE_KEYS = {
    "logging": {"dir", "level"},
    "profile": {"cufile_stats", "nvtx"},
    "execution": {
        "parallel_io",
        "max_io_threads",
        "max_request_parallelism",
        "min_io_threshold_size_kb",
        "max_io_queue_depth",
    },
    "properties": {
        "max_direct_io_size_kb",
        "max_device_cache_size_kb",
        "max_device_pinned_mem_size_kb",
        "use_poll_mode",
        "poll_mode_max_size_kb",
        "allow_compat_mode",
        "use_pci_p2pdma",
        "rdma_dev_addr_list",
    },
    "fs": {"generic", "lustre"},
    "denylist": {"drivers", "devices", "mounts", "filesystems"},
}


def _cufile() -> dict:
    lines = CUFILE.read_text().splitlines()
    for line in lines:
        if "//" in line and not line.lstrip().startswith("//"):
            pytest.fail(f"comments must be on their own line in {CUFILE.name}: {line!r}")
    return json.loads("\n".join(line for line in lines if not line.lstrip().startswith("//")))


def test_cufile_template_parses_and_uses_known_keys():
    doc = _cufile()
    assert set(doc) == set(CUFILE_KEYS)
    for section, keys in CUFILE_KEYS.items():
        assert set(doc[section]) <= keys, section
    assert doc["fs"]["lustre"] == {"posix_gds_min_kb": 0}
    assert isinstance(doc["properties"]["allow_compat_mode"], bool)
    assert doc["logging"]["dir"] == "/tmp"  # writable under a read-only root file system


def test_cufile_template_explains_each_setting():
    text = CUFILE.read_text().splitlines()
    for i, line in enumerate(text):
        m = re.match(r'\s+"(\w+)": (?![{\[]{1}\s*$)', line)
        if m and not line.rstrip().endswith("{"):
            context = "\n".join(text[max(0, i - 4) : i])
            assert "//" in context, f"{m.group(1)} has no comment above it"


# ----------------------------------------------------------------------------------------------
# systemd unit
# ----------------------------------------------------------------------------------------------


def _unit() -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for line in UNIT.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = []
        else:
            key, _, value = line.partition("=")
            sections[current].append((key, value))
    return sections


def test_unit_runs_doctor_first_then_serve_as_a_system_user():
    service = _unit()["Service"]
    keys = [k for k, _ in service]
    values = dict(service)
    assert values["User"] == "gdsload" and values["Group"] == "gdsload"
    assert keys.index("ExecStartPre") < keys.index("ExecStart")
    assert values["ExecStartPre"] == "-/opt/gdsload/bin/gdsload doctor"
    assert values["ExecStart"] == "/opt/gdsload/bin/gdsload-entrypoint serve"
    assert values["EnvironmentFile"] == "/etc/gdsload/gdsload.env"
    assert values["LoadCredential"] == "token:/etc/gdsload/token"
    envs = [v for k, v in service if k == "Environment"]
    assert "GDSLOAD_TOKEN_FILE=%d/token" in envs and "CUFILE_ENV_PATH_JSON=/etc/gdsload/cufile.json" in envs
    # Settings that would take the GPUs or GDS away from the service.
    assert "PrivateDevices" not in values and "MemoryDenyWriteExecute" not in values
    assert values["LimitMEMLOCK"] == "infinity" and values["NoNewPrivileges"] == "yes"


def test_unit_verifies(tmp_path: Path):
    analyze = _tool("systemd-analyze")
    root = tmp_path / "root"
    (root / "opt/gdsload/bin").mkdir(parents=True)
    for exe in ("gdsload", "gdsload-entrypoint"):
        (root / "opt/gdsload/bin" / exe).write_text("#!/bin/sh\n")
        (root / "opt/gdsload/bin" / exe).chmod(0o755)
    (root / "etc/systemd/system").mkdir(parents=True)
    system_units = next(
        (p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if (p / "sysinit.target").exists()),
        None,
    )
    if system_units is None:
        pytest.skip("systemd-analyze is here but the system's unit files are not")
    shutil.copytree(system_units, root / "usr/lib/systemd/system", ignore_dangling_symlinks=True)
    unit = root / "etc/systemd/system" / UNIT.name
    shutil.copy(UNIT, unit)
    out = subprocess.run([analyze, f"--root={root}", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # Unknown keys and bad values are only warnings to systemd: any output is a failure here.
    assert out.returncode == 0 and out.stdout + out.stderr == "", out.stdout + out.stderr


def test_unit_environment_starts_the_entrypoint(fake_gdsload: Path, tmp_path: Path):
    env = dict(line.split("=", 1) for line in UNIT_ENV.read_text().splitlines() if line and not line.startswith("#"))
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789")
    out, argv = run_entrypoint(fake_gdsload, "serve", **env, GDSLOAD_TOKEN_FILE=str(token))
    assert out.returncode == 0, out.stderr
    assert argv == ["serve", env["GDSLOAD_MODEL_DIR"], "--ranks", "0-7"]
    assert env["GDSLOAD_HOST"] == "127.0.0.1"


# ----------------------------------------------------------------------------------------------
# deploy/README.md
# ----------------------------------------------------------------------------------------------


def test_readme_paths_exist():
    text = README.read_text()
    paths = set(re.findall(r"\bdeploy/[\w./-]+[\w/]", text))
    assert len(paths) > 10
    missing = [p for p in sorted(paths) if not (ROOT / p).exists()]
    assert not missing, missing


def test_readme_walks_from_doctor_to_a_ready_pod():
    text = README.read_text()
    assert text.index("gdsload doctor") < text.index("kubectl apply -k")
    overlays = sorted(p.parent.name for p in (DEPLOY / "k8s" / "overlays").glob("*/kustomization.yaml"))
    for name in overlays:
        assert f"kubectl apply -k deploy/k8s/overlays/{name}" in text, name
    # The Secret the manifests mount, created under the name and key they use.
    assert re.search(r"kubectl -n llm create secret generic gdsload-token\s+\\?\s*--from-literal=token=", text)
    assert "kubectl create namespace llm" in text
    assert "/readyz" in text and "/v1/status" in text


def test_readme_says_how_to_confirm_gds():
    text = README.read_text()
    section = text[text.index("## Is GDS really on?") :]
    for needle in ("gdsload doctor", "/v1/status", "compat", "nvidia-fs", "gds_stats", "allow_compat_mode"):
        assert needle in section, needle


def test_readme_documents_the_entrypoint_variables():
    text = README.read_text()
    for var in sorted(set(re.findall(r"GDSLOAD_[A-Z_]+", ENTRYPOINT.read_text()))):
        assert f"`{var}`" in text, var
