"""The sidecar's configuration and placement rules, in-process: env parsing, precedence, validation, confinement."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from gdsload.loader.errors import ConfigError, GdsloadError
from gdsload.server.cmd_serve import serve
from gdsload.server.settings import (
    ENV_VARS,
    JsonFormatter,
    PathNotAllowedError,
    ServeConfig,
    configure_logging,
    confine_path,
    parse_device_map,
    parse_ranks,
)
from gdsload.server.worker_protocol import WorkerSpec, describe_exit
from gdsload.server.workers import assign_devices, visible_gpus


def test_defaults():
    c = ServeConfig.resolve(env={})
    assert (c.model_dir, c.ranks, c.device_map, c.backend) == (None, None, "auto", "auto")
    assert (c.host, c.port, c.token, c.allow_roots) == ("127.0.0.1", 8471, None, ())
    assert (c.log_format, c.log_level, c.max_restarts) == ("text", "info", 5)
    assert c.is_loopback


def test_every_env_var_is_read(tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret-token-0123456789 \n")
    token_file.chmod(0o600)
    roots = [tmp_path / "r1", tmp_path / "r2"]
    for r in roots:
        r.mkdir()
    env = {
        "GDSLOAD_MODEL_DIR": str(roots[0] / "m"),
        "GDSLOAD_RANKS": "0-3,6",
        "GDSLOAD_DEVICE_MAP": "CPU",
        "GDSLOAD_BACKEND": "cpu",
        "GDSLOAD_HOST": "::1",
        "GDSLOAD_PORT": "9000",
        "GDSLOAD_TOKEN_FILE": str(token_file),
        "GDSLOAD_ALLOW_ROOT": os.pathsep.join(map(str, roots)),
        "GDSLOAD_LOG_FORMAT": "json",
        "GDSLOAD_LOG_LEVEL": "DEBUG",
        "GDSLOAD_RESTART_BACKOFF": "0.5",
        "GDSLOAD_RESTART_BACKOFF_MAX": "8",
        "GDSLOAD_MAX_RESTARTS": "2",
        "GDSLOAD_STOP_TIMEOUT": "3",
        "GDSLOAD_WORKER_START": "Spawn",
        "GDSLOAD_ALLOWED_HOSTS": "Sidecar.local, 10.0.0.7",
        "GDSLOAD_REQUEST_TIMEOUT": "2.5",
        "GDSLOAD_LEASE_GRACE": "7.5",
    }
    assert set(env) | {"GDSLOAD_TP"} == set(ENV_VARS.values())
    c = ServeConfig.resolve(env=env)
    assert c.model_dir == str(roots[0] / "m") and c.ranks == (0, 1, 2, 3, 6) and c.device_map == "cpu"
    assert (c.backend, c.host, c.port, c.is_loopback) == ("cpu", "::1", 9000, True)
    assert c.token == "s3cret-token-0123456789" and c.token_source == f"file:{token_file}"
    assert c.allow_roots == tuple(os.path.realpath(r) for r in roots)
    assert (c.log_format, c.log_level, c.restart_backoff, c.restart_backoff_max, c.max_restarts, c.stop_timeout) == (
        "json",
        "debug",
        0.5,
        8.0,
        2,
        3.0,
    )
    assert c.worker_start == "spawn" and ServeConfig.resolve(env={}).worker_start == "auto"
    assert c.allowed_hosts == ("sidecar.local", "10.0.0.7") and c.request_timeout == 2.5
    assert c.lease_grace == 7.5 and ServeConfig.resolve(env={}).lease_grace == 3.0
    assert ServeConfig.resolve(env={}).http_hosts() == ("127.0.0.1", "localhost", "::1")  # loopback: loopback names
    assert ServeConfig.resolve(env={"GDSLOAD_HOST": "0.0.0.0"}).http_hosts() == ("*",)
    assert ServeConfig.resolve(env={"GDSLOAD_TP": "4"}).ranks == (0, 1, 2, 3)
    assert ServeConfig.resolve(env={"GDSLOAD_TOKEN": "abc123abc123abc123"}).token_source == "GDSLOAD_TOKEN"


def test_flags_win_over_env(tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file-0123456789")
    env = {
        "GDSLOAD_PORT": "9000",
        "GDSLOAD_TP": "8",
        "GDSLOAD_TOKEN": "from-env-0123456789",
        "GDSLOAD_LOG_LEVEL": "error",
    }
    c = ServeConfig.resolve(env=env, port=9100, ranks="2-3", token_file=str(token_file))
    assert (c.port, c.ranks, c.token, c.log_level) == (9100, (2, 3), "from-file-0123456789", "error")
    c = ServeConfig.resolve(env={"GDSLOAD_RANKS": "0-7"}, tp=2)  # --tp hides GDSLOAD_RANKS: one setting
    assert c.ranks == (0, 1)
    assert ServeConfig.resolve(env=env, port=None).port == 9000  # None means "flag not given"
    with pytest.raises(TypeError, match="unknown serve option"):
        ServeConfig.resolve(env={}, prot=1)


@pytest.mark.parametrize(
    "env, words",
    [
        ({"GDSLOAD_PORT": "http"}, "GDSLOAD_PORT='http' is not a valid port"),
        ({"GDSLOAD_PORT": "70000"}, "port=70000 must be an integer in 0..65535"),
        ({"GDSLOAD_RANKS": "3-1"}, "GDSLOAD_RANKS='3-1': range '3-1' must go upwards"),
        ({"GDSLOAD_RANKS": "0,x"}, "'x' is not a rank or range"),
        ({"GDSLOAD_RANKS": "0,0-1"}, "names a rank twice"),
        ({"GDSLOAD_TP": "0"}, "GDSLOAD_TP=0 must be an integer in 1..4096"),
        ({"GDSLOAD_TP": "2", "GDSLOAD_RANKS": "0"}, "either --ranks or --tp"),
        ({"GDSLOAD_DEVICE_MAP": "0=1"}, "'0=1' is not RANK:GPU"),
        ({"GDSLOAD_DEVICE_MAP": "0:0,0:1"}, "maps rank 0 twice"),
        ({"GDSLOAD_DEVICE_MAP": "0:0", "GDSLOAD_RANKS": "0-1"}, "does not place ranks [1]"),
        ({"GDSLOAD_BACKEND": "warp"}, "backend='warp' is not known"),
        ({"GDSLOAD_HOST": "bad host"}, "host='bad host' is not an IP address or host name"),
        ({"GDSLOAD_LOG_FORMAT": "xml"}, "log_format='xml' must be one of ('text', 'json')"),
        ({"GDSLOAD_LOG_LEVEL": "loud"}, "log_level='loud'"),
        ({"GDSLOAD_RESTART_BACKOFF": "0"}, "restart_backoff=0.0 must be"),
        ({"GDSLOAD_RESTART_BACKOFF": "nan"}, "restart_backoff=nan"),
        (
            {"GDSLOAD_RESTART_BACKOFF": "5", "GDSLOAD_RESTART_BACKOFF_MAX": "2"},
            "restart_backoff_max=2.0 must be seconds between",
        ),
        ({"GDSLOAD_MAX_RESTARTS": "-1"}, "max_restarts=-1 must be an integer in 0..1000"),
        ({"GDSLOAD_STOP_TIMEOUT": "soon"}, "GDSLOAD_STOP_TIMEOUT='soon' is not a valid stop timeout"),
        ({"GDSLOAD_WORKER_START": "fork"}, "worker_start='fork' must be one of ('auto', 'forkserver', 'spawn')"),
        ({"GDSLOAD_ALLOW_ROOT": "/no/such/root"}, "allow_root '/no/such/root' is not an existing directory"),
        ({"GDSLOAD_TOKEN": "two words"}, "from GDSLOAD_TOKEN is empty or holds spaces"),
        ({"GDSLOAD_TOKEN": " "}, "is empty or holds spaces"),
        ({"GDSLOAD_TOKEN": "x"}, "from GDSLOAD_TOKEN has 1 characters; use at least 16"),
        ({"GDSLOAD_ALLOWED_HOSTS": "ok.example,bad host"}, "allowed host 'bad host' is not a host name"),
        ({"GDSLOAD_TOKEN_FILE": "/no/such/token"}, "token file '/no/such/token' does not exist"),
        ({"GDSLOAD_MODEL_DIR": "/srv/elsewhere", "GDSLOAD_ALLOW_ROOT": "/"}, None),
        ({"GDSLOAD_MODEL_DIR": ""}, "GDSLOAD_MODEL_DIR is empty"),  # as templates render an unset value
        ({"GDSLOAD_PORT": "99999"}, "GDSLOAD_PORT: port=99999"),  # range errors name the variable too
        ({"GDSLOAD_STOP_TIMEOUT": "0"}, "GDSLOAD_STOP_TIMEOUT: stop_timeout=0.0"),
    ],
)
def test_bad_values_are_typed_errors_naming_the_value(env: dict[str, str], words: str | None):
    if words is None:  # a model under the allowed root (here "/") is fine
        assert ServeConfig.resolve(env=env).model_dir == "/srv/elsewhere"
        return
    with pytest.raises(ConfigError) as e:
        ServeConfig.resolve(env=env)
    assert isinstance(e.value, ValueError) and isinstance(e.value, GdsloadError)
    assert words in str(e.value)


def test_edge_values_resolve_sensibly():
    # A first restart delay above the default ceiling raises the ceiling, rather than failing on a setting not given.
    assert ServeConfig.resolve(env={"GDSLOAD_RESTART_BACKOFF": "60"}).restart_backoff_max == 60.0
    assert ServeConfig.resolve(env={"GDSLOAD_HOST": "LOCALHOST"}).is_loopback
    with pytest.raises(ConfigError, match="must be a string like '0-7' or a sequence of ranks"):
        ServeConfig.resolve(env={}, ranks=3)
    for kwargs in ({"token": "secret\n"}, {"host": "localhost\n"}):  # a trailing newline is not a valid value
        with pytest.raises(ConfigError):
            ServeConfig(**kwargs)


def test_model_dir_must_lie_under_allowed_roots(tmp_path: Path):
    with pytest.raises(ConfigError, match="MODEL_DIR contradicts --allow-root"):
        ServeConfig.resolve(env={}, model_dir=str(tmp_path.parent / "x"), allow_roots=[str(tmp_path)])


def test_empty_token_file_and_loose_permissions(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    f = tmp_path / "token"
    f.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        ServeConfig.resolve(env={}, token_file=str(f))
    f.write_text("tok123tok123tok123")
    f.chmod(0o440)  # a Kubernetes Secret shared through fsGroup: fine
    with caplog.at_level(logging.WARNING):
        assert ServeConfig.resolve(env={}, token_file=str(f)).token == "tok123tok123tok123"
    assert caplog.text == ""
    f.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert ServeConfig.resolve(env={}, token_file=str(f)).token == "tok123tok123tok123"
    assert "accessible to every user (mode 644); chmod o-rwx it" in caplog.text


def test_token_never_shown():
    c = ServeConfig.resolve(env={"GDSLOAD_TOKEN": "very-secret-value"})
    assert "very-secret-value" not in repr(c) and "very-secret-value" not in json.dumps(c.public_dict())
    assert c.public_dict()["auth"] == "token"


def test_parse_ranks_and_device_map():
    assert parse_ranks("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_ranks(" 5 ") == (5,)
    with pytest.raises(ConfigError, match="within 0..4095"):
        parse_ranks("0-5000")
    assert parse_device_map("AUTO") == "auto"
    assert parse_device_map("0:1, 1:cpu") == {0: 1, 1: None}


def test_confine_path(tmp_path: Path):
    root = tmp_path / "models"
    (root / "v1").mkdir(parents=True)
    (root / "v2").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "out-link").symlink_to(outside)
    (root / "in-link").symlink_to(root / "v2")
    (tmp_path / "models-evil").mkdir()
    roots = [os.path.realpath(root)]
    assert confine_path(str(root / "v1"), roots) == os.path.realpath(root / "v1")
    assert confine_path(str(root / "v1" / ".." / "v2"), roots) == os.path.realpath(root / "v2")
    assert confine_path(str(root / "in-link"), roots) == os.path.realpath(root / "v2")  # links inside are fine
    assert confine_path(str(root), roots) == roots[0]
    for bad in (root / ".." / "outside", root / "out-link", tmp_path / "models-evil", Path("/")):
        with pytest.raises(PathNotAllowedError, match="outside the allowed roots") as e:
            confine_path(str(bad), roots)
        assert isinstance(e.value, PermissionError)
    with pytest.raises(PathNotAllowedError, match="not absolute"):
        confine_path("models/v1", roots)
    with pytest.raises(
        PathNotAllowedError, match="no allowed roots are configured; start the server with --allow-root"
    ):
        confine_path(str(root / "v1"), [])


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8a1b, 1"}) == ["GPU-8a1b", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ["0"]  # CUDA stops at the first invalid entry
    if not Path("/proc/driver/nvidia/gpus").exists() and not list(Path("/dev").glob("nvidia[0-9]*")):
        assert visible_gpus({}) == []  # this host: no NVIDIA driver, so workers load to host memory


def test_assign_devices():
    assert assign_devices([4, 5], "auto", ["0", "1"]) == {4: ("0", False), 5: ("1", False)}
    assert assign_devices([0, 1], "auto", []) == {0: ("", False), 1: ("", False)}
    assert assign_devices([0, 1], "cpu", ["0", "1"]) == {0: ("", False), 1: ("", False)}
    assert assign_devices([0, 1], "0:1,1:cpu", ["GPU-a", "GPU-b"]) == {0: ("GPU-b", True), 1: ("", True)}
    with pytest.raises(ConfigError, match=r"3 ranks to serve \(\[0, 1, 2\]\) but only 2 GPU\(s\) visible"):
        assign_devices([0, 1, 2], "auto", ["0", "1"])
    with pytest.raises(ConfigError, match="puts rank 1 on GPU 2, but this host shows 2 GPU"):
        assign_devices([0, 1], "0:0,1:2", ["0", "1"])
    with pytest.raises(ConfigError, match="does not place rank 1"):
        assign_devices([0, 1], "0:0", ["0", "1"])


def test_worker_spec_travels_to_a_spawned_child_and_exits_are_described():
    spec = WorkerSpec(rank=3, model_dir="/m", backend="auto", cuda_visible_devices="1", gpu_explicit=False)
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert describe_exit(-9) == "was killed by SIGKILL" and describe_exit(3) == "exited with status 3"


def test_json_logs(capsys: pytest.CaptureFixture[str]):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("json", "info", rank=2)
        log = logging.getLogger("gdsload.test")
        log.info("hello %s", "world")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
        log.debug("not shown")
        lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    assert [x["message"] for x in lines] == ["hello world", "failed"]
    assert all(x["rank"] == 2 and x["logger"] == "gdsload.test" and x["pid"] == os.getpid() for x in lines)
    assert lines[0]["level"] == "info" and lines[0]["ts"].endswith("Z") and "ValueError: boom" in lines[1]["exc"]
    assert "exc" not in lines[0]
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "m", None, None)
    assert json.loads(JsonFormatter().format(record))["level"] == "warning"


def test_serve_command_refuses_bad_flags_before_starting_anything():
    runner = CliRunner()
    env = {k: v for k, v in os.environ.items() if k.startswith("GDSLOAD_")}
    result = runner.invoke(serve, ["/m", "--ranks", "0-1", "--tp", "2"], env=dict.fromkeys(env))
    assert result.exit_code == 2 and "either --ranks or --tp" in result.output
    result = runner.invoke(serve, ["/m", "--port", "99999"], env=dict.fromkeys(env))
    assert result.exit_code == 2 and "port=99999 must be an integer in 0..65535" in result.output
    result = runner.invoke(serve, ["--help"], terminal_width=200)
    assert result.exit_code == 0
    named = set(re.findall(r"GDSLOAD_[A-Z_]+", result.output))  # whole names, not prefixes of longer ones
    assert [v for v in ENV_VARS.values() if v not in named] == []  # every flag names its variable


def test_bad_port_binding_is_a_clear_error():
    import socket

    from click import ClickException

    from gdsload.server.cmd_serve import _bind

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ClickException, match=f"cannot listen on 127.0.0.1:{port}"):
            _bind("127.0.0.1", port)
