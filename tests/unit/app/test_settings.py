"""Unit tests: ``pdserve serve`` flags (pdserve.app.settings) and their checks."""

from __future__ import annotations

import dataclasses
import os
import resource
from pathlib import Path

import pytest
import trustme

from pdserve.app import cli
from pdserve.app.flag_syntax import show_default
from pdserve.app.settings import (
    EXAMPLE_REPOSITORY,
    Settings,
    SettingsError,
)
from pdserve.frontends.http.server import HttpLimits
from tests.tls_certs import CertFiles, issue

#: Every ``serve`` flag (Triton's names where Triton has the flag).
FLAGS = {
    "--instance-hang-timeout",
    "--server-timing",
    "--model-repository",
    "--model-repository-cache",
    "--host",
    "--log-verbose",
    "--exit-timeout-secs",
    "--strict-readiness",
    "--max-instance-count",
    "--host-policy",
    "--http-port",
    "--http-server",
    "--max-request-bytes",
    "--http-body-timeout-secs",
    "--http-body-min-bytes-per-sec",
    "--http-max-json-bytes",
    "--http-max-header-bytes",
    "--http-max-header-count",
    "--http-header-timeout-secs",
    "--http-idle-timeout-secs",
    "--http-write-timeout-secs",
    "--http-max-connections",
    "--http-workers",
    "--allow-grpc",
    "--grpc-port",
    "--grpc-max-message-bytes",
    "--grpc-keepalive-time",
    "--grpc-keepalive-timeout",
    "--grpc-keepalive-permit-without-calls",
    "--grpc-http2-max-pings-without-data",
    "--grpc-http2-min-recv-ping-interval-without-data",
    "--grpc-http2-max-ping-strikes",
    "--grpc-server",
    "--allow-metrics",
    "--metrics-port",
    "--allow-gpu-metrics",
    "--allow-cpu-metrics",
    "--allow-client-shm",
    "--model-control-mode",
    "--load-model",
    "--model-memory-budget",
    "--pin-model",
    "--model-load-wait-secs",
    "--repository-poll-secs",
    "--response-cache-byte-size",
    "--cache-config",
    "--log-info",
    "--log-warning",
    "--log-error",
    "--log-format",
    "--version-ready-marker",
    "--auth-config",
    "--http-restricted-api",
    "--grpc-restricted-protocol",
    "--rate-limit-storage",
    "--rate-limit-strategy",
    "--rate-limit-fail-mode",
    "--circuit-breaker",
    "--payload-log",
    "--trace-config",
    # TLS
    "--grpc-use-ssl",
    "--grpc-use-ssl-mutual",
    "--grpc-server-cert",
    "--grpc-server-key",
    "--grpc-root-cert",
    "--http-use-ssl",
    "--http-use-ssl-mutual",
    "--http-server-cert",
    "--http-server-key",
    "--http-root-cert",
    "--metrics-use-ssl",
    "--rate-limit",
    "--rate-limit-resource",
}
#: tritonserver's flags for settings pdserve has (Triton's names).
FLAGS |= {
    "--id",
    "--backend-config",
    "--exit-on-error",
    "--disable-auto-complete-config",
    "--strict-model-config",
    "--log-file",
    "--allow-http",
    "--http-address",
    "--grpc-address",
    "--metrics-address",
}
#: Settings fields that are no flag of their own.
NOT_FLAGS = {"ignored_flags"}


def parse(repo: Path, *argv: str) -> Settings:
    """Settings of ``pdserve serve --model-repository repo *argv`` (validated)."""
    args = cli.build_parser().parse_args(["serve", "--model-repository", str(repo), *argv])
    return Settings.from_namespace(args)


def serve_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``pdserve serve *argv``, expect exit code 2; return its stderr."""
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", *argv])
    assert e.value.code == 2
    return capsys.readouterr().err


# -- one declaration per flag -------------------------------------------------------------


def test_every_field_is_one_flag_and_every_flag_a_field() -> None:
    fields = [f for f in dataclasses.fields(Settings) if f.name not in NOT_FLAGS]
    assert {f.metadata["flag"] for f in fields} == FLAGS
    assert len(fields) == len(FLAGS)
    assert {f.name for f in dataclasses.fields(Settings)} - {f.name for f in fields} == NOT_FLAGS


def test_defaults_come_only_from_the_dataclass(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(["serve"])
    # no flag given: argparse holds no value, so no second copy of any default
    assert not {f.name for f in dataclasses.fields(Settings)} & set(vars(args))
    settings = parse(tmp_path)
    assert settings == Settings(model_repository=tmp_path)
    assert (settings.host, settings.http_port, settings.grpc_port, settings.metrics_port) == (
        "127.0.0.1",
        8000,
        8001,
        8002,
    )
    assert settings.exit_timeout_secs == 30.0 and settings.strict_readiness is False
    assert settings.max_request_bytes == 64 * 1024 * 1024
    assert settings.grpc_max_message_bytes == 64 * 1024 * 1024
    assert settings.http_body_timeout_secs == 60.0
    assert settings.allow_grpc and settings.allow_metrics
    assert settings.allow_cpu_metrics and settings.allow_gpu_metrics
    assert settings.model_control_mode == "none" and settings.load_models is None
    assert settings.repository_poll_secs == 15.0
    assert settings.response_cache_bytes == 0 and settings.host_policies() == {}
    assert Settings().repository == EXAMPLE_REPOSITORY


def test_help_shows_the_field_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in FLAGS:
        assert flag in out, flag
    assert "V2 HTTP port (default 8000)" in out
    assert "after decompression (default 64 MiB)" in out
    assert "seconds to wait for in-flight requests (default 30)" in out
    assert "on --grpc-port (default on)" in out
    assert "not ready (default off)" in out
    assert "a request for a model not loaded loads it (default none)" in out
    assert "(default: True)" not in out  # argparse's own suffix would repeat the default


def test_show_default() -> None:
    assert show_default(True) == "on" and show_default(False) == "off"
    assert show_default(30.0) == "30" and show_default(0.5) == "0.5"
    assert show_default(64 * 1024 * 1024) == "64 MiB" and show_default(8000) == "8000"
    assert show_default(None) == "None"


def test_given_flags_reach_settings(tmp_path: Path) -> None:
    core = min(os.sched_getaffinity(0))
    s = parse(
        tmp_path,
        "--host=0.0.0.0",
        "--http-port=9000",
        "--grpc-port=9001",
        "--metrics-port=9002",
        "--log-verbose=1",
        "--exit-timeout-secs=2.5",
        "--strict-readiness",
        "--max-request-bytes=4096",
        "--http-body-timeout-secs=0",
        "--no-allow-grpc",
        "--grpc-max-message-bytes=1000",
        "--no-allow-metrics",
        "--no-allow-gpu-metrics",
        "--no-allow-cpu-metrics",
        "--model-control-mode=explicit",
        "--load-model=a",
        "--load-model=b",
        "--load-model=a",
        "--repository-poll-secs=0",
        "--response-cache-byte-size=100",
        f"--host-policy=cpu,cpu-cores={core}",
    )
    assert (s.host, s.http_port, s.grpc_port, s.metrics_port) == ("0.0.0.0", 9000, 9001, 9002)
    assert s.log_verbose == 1 and s.exit_timeout_secs == 2.5 and s.strict_readiness
    assert s.max_request_bytes == 4096 and s.http_body_timeout_secs == 0.0
    assert not s.allow_grpc and s.grpc_max_message_bytes == 1000
    assert not (s.allow_metrics or s.allow_gpu_metrics or s.allow_cpu_metrics)
    assert s.load_models == ("a", "b", "a")
    assert s.startup_models == ["a", "b"]
    assert s.repository_poll_secs == 0.0  # only checked in poll mode, as before
    assert s.response_cache_bytes == 100
    assert s.host_policies() == {"cpu": frozenset({core})}


def test_http_limit_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = parse(
        tmp_path,
        "--http-max-json-bytes=1000",
        "--http-max-header-bytes=4096",
        "--http-max-header-count=10",
        "--http-header-timeout-secs=2.5",
        "--http-idle-timeout-secs=0",
        "--http-max-connections=7",
    )
    assert s.http_max_json_bytes == 1000
    assert s.http_workers == 1  # default: the server process serves HTTP itself
    assert parse(tmp_path, "--http-workers=3").http_workers == 3
    assert s.http_limits == HttpLimits(4096, 10, 2.5, 0.0, 7)
    assert s.http_limits.connection_limit() == 7
    assert parse(tmp_path).http_limits == HttpLimits()
    assert HttpLimits().body_min_rate == 500.0  # Apache's mod_reqtimeout MinRate default
    rate = parse(tmp_path, "--http-body-min-bytes-per-sec=0").http_limits.body_min_rate
    assert rate == 0.0
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY:
        assert HttpLimits().connection_limit() == max(1, soft // 2)
    for argv, needle in [
        ("--http-max-json-bytes=0", "--http-max-json-bytes: must be >= 1 bytes, got 0"),
        ("--http-max-header-bytes=100", "--http-max-header-bytes: must be >= 256 bytes, got 100"),
        ("--http-max-header-count=0", "--http-max-header-count: must be >= 1, got 0"),
        ("--http-max-connections=-1", "--http-max-connections: must be >= 0, got -1"),
        ("--http-header-timeout-secs=-1", "--http-header-timeout-secs: must be a number of"),
        ("--http-idle-timeout-secs=inf", "--http-idle-timeout-secs: must be a number of"),
        ("--http-body-min-bytes-per-sec=-1", "--http-body-min-bytes-per-sec: must be a number"),
    ]:
        assert needle in serve_error(capsys, "--model-repository", str(tmp_path), argv)


def test_models_loaded_at_start(tmp_path: Path) -> None:
    assert parse(tmp_path).startup_models is None  # none mode: every model
    assert parse(tmp_path, "--model-control-mode=poll").startup_models is None
    assert parse(tmp_path, "--model-control-mode=explicit").startup_models == []
    explicit_all = parse(tmp_path, "--model-control-mode=explicit", "--load-model=*")
    assert explicit_all.startup_models is None


def test_cache_config_wins_over_byte_size(tmp_path: Path) -> None:
    s = parse(tmp_path, "--response-cache-byte-size=100", "--cache-config", "local,size=200")
    assert s.response_cache_bytes == 200
    s = parse(tmp_path, "--response-cache-byte-size=100", "--cache-config", "local,other=1")
    assert s.response_cache_bytes == 100
    assert s.cache_config == ("local,other=1",)


# -- checks before anything starts: exit 2 naming the flag ------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--http-port=-1"], "argument --http-port: must be a port number 0-65535, got -1"),
        (["--grpc-port=65536"], "argument --grpc-port: must be a port number 0-65535, got 65536"),
        (["--metrics-port=-5"], "argument --metrics-port: must be a port number 0-65535, got -5"),
        (
            ["--http-port=9000", "--grpc-port=9000"],
            "argument --grpc-port: the server cannot listen to HTTP requests and gRPC "
            "requests at the same port 9000 (--http-port)",
        ),
        (
            ["--grpc-port=9000", "--metrics-port=9000"],
            "argument --metrics-port: the server cannot listen to gRPC requests and metrics "
            "requests at the same port 9000 (--grpc-port)",
        ),
        (
            ["--load-model=tiny"],
            "argument --load-model: Use of '--load-model' requires setting "
            "'--model-control-mode=explicit' as well",
        ),
        (
            ["--model-control-mode=poll", "--load-model=tiny"],
            "requires setting '--model-control-mode=explicit'",
        ),
        (
            ["--model-control-mode=poll", "--repository-poll-secs=0"],
            "argument --repository-poll-secs: must be > 0 in poll mode, got 0.0",
        ),
        (
            ["--model-control-mode=sometimes"],
            "argument --model-control-mode: invalid choice: 'sometimes'",
        ),
        (["--host-policy", "cpu"], "argument --host-policy: --host-policy option format is"),
        (
            ["--host-policy", "cpu,cpu-cores=4096"],
            "argument --host-policy: host policy 'cpu': cpu-cores 4096 not available",
        ),
        (
            ["--cache-config", "redis,size=10"],
            "argument --cache-config: unknown redis setting 'size'",
        ),
        (
            ["--cache-config", "memcached,size=10"],
            "argument --cache-config: only the 'local' and 'redis' caches are supported, "
            "got 'memcached'",
        ),
        (
            ["--cache-config", "local,size=ten"],
            "argument --cache-config: size must be an integer, got 'ten'",
        ),
        (
            ["--cache-config", "local,size=-1"],
            "argument --cache-config: size must be >= 0 bytes, got -1",
        ),
        (
            ["--response-cache-byte-size=-1"],
            "argument --response-cache-byte-size: must be >= 0 bytes, got -1",
        ),
        (
            ["--exit-timeout-secs=-1"],
            "argument --exit-timeout-secs: must be a number of seconds >= 0, got -1.0",
        ),
        (
            ["--http-body-timeout-secs=nan"],
            "argument --http-body-timeout-secs: must be a number of seconds >= 0, got nan",
        ),
        (["--max-request-bytes=0"], "argument --max-request-bytes: must be > 0 bytes, got 0"),
        (
            ["--grpc-max-message-bytes=2147483648"],
            "argument --grpc-max-message-bytes: must be 1-2147483647 bytes, got 2147483648",
        ),
        (["--log-verbose=-1"], "argument --log-verbose: must be >= 0, got -1"),
        (["--max-instance-count=0"], "argument --max-instance-count: must be >= 1, got 0"),
        (["--http-workers=0"], "argument --http-workers: must be >= 1, got 0"),
        # a huge count is refused before a worker starts (it once spawned until OOM)
        (
            ["--http-workers=99999999999999999999999"],
            "argument --http-workers: must be 1-256, got 99999999999999999999999",
        ),
        # grpc core takes its channel arguments as C ints (Triton's flags are ints)
        (
            ["--grpc-keepalive-time=2147483648"],
            "argument --grpc-keepalive-time: must be 1-2147483647 milliseconds, got 2147483648",
        ),
        (
            ["--grpc-http2-max-ping-strikes=99999999999999999999999"],
            "argument --grpc-http2-max-ping-strikes: must be 0-2147483647, "
            "got 99999999999999999999999",
        ),
        (["--http-port=eighty"], "argument --http-port: invalid int value: 'eighty'"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    err = serve_error(capsys, "--model-repository", str(tmp_path), *argv)
    assert "pdserve serve: error: " in err
    assert needle in err


@pytest.mark.parametrize("flag", ["--model-repository", "--model-store"])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_repository_exits_2(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    # an unset variable in `--model-store=$(DIR)` must not serve the working directory
    err = serve_error(capsys, f"{flag}={value}", "--http-workers=0")  # never serves
    assert "argument --model-repository/--model-store: expected a folder or a URL, got" in err


@pytest.mark.parametrize(
    "flag", ["--http-server-cert", "--grpc-root-cert", "--log-file", "--model-repository-cache"]
)
def test_an_empty_path_exits_2(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    # Path("") is the working folder: an empty value must not mean it
    err = serve_error(capsys, f"{flag}=", "--http-workers=0")  # never serves
    assert f"argument {flag}: expected a path, got ''" in err


def test_missing_repository_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    err = serve_error(capsys, "--model-repository", str(missing))
    assert (
        f"pdserve serve: error: argument --model-repository: model repository {missing} "
        "does not exist or is not a folder"
    ) in err


def test_ports_of_disabled_listeners_may_repeat(tmp_path: Path) -> None:
    s = parse(tmp_path, "--http-port=9000", "--grpc-port=9000", "--no-allow-grpc")
    assert s.grpc_port == s.http_port == 9000
    s = parse(tmp_path, "--metrics-port=9000", "--http-port=9000", "--no-allow-metrics")
    assert s.metrics_port == 9000
    s = parse(tmp_path, "--http-port=0", "--grpc-port=0", "--metrics-port=0")  # any free port
    assert (s.http_port, s.grpc_port, s.metrics_port) == (0, 0, 0)


def test_library_settings_are_checked_too(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as e:
        Settings(model_repository=tmp_path, http_port=70000).validate()
    assert e.value.flag == "--http-port" and "70000" in e.value.message
    with pytest.raises(SettingsError) as e:
        Settings(model_repository=tmp_path, load_models=("x",)).validate()
    assert e.value.flag == "--load-model"
    Settings(model_repository=tmp_path).validate()


def test_subcommands_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert "{serve,rollback,check,perf,analyze,top,ray}" in capsys.readouterr().out


# -- model memory budget (issue 16) ---------------------------------------------------------


def test_memory_budget_flags(tmp_path: Path) -> None:
    s = parse(
        tmp_path,
        "--model-control-mode=on_demand",
        "--model-memory-budget",
        "1.5GiB",
        "--pin-model",
        "a",
        "--pin-model",
        "b",
        "--load-model",
        "c",
    )
    assert s.model_memory_budget == int(1.5 * 1024**3)
    assert s.pin_models == ("a", "b")
    assert s.startup_models == ["c", "a", "b"]  # pinned models load at start
    assert s.model_load_wait_secs == 120.0
    assert parse(tmp_path).model_memory_budget is None


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (["--model-memory-budget", "2GiB"], "--model-memory-budget", "on_demand or explicit"),
        (["--model-control-mode=poll", "--pin-model", "a"], "--pin-model", "on_demand"),
        (
            ["--model-control-mode=on_demand", "--model-load-wait-secs", "0"],
            "--model-load-wait-secs",
            "> 0",
        ),
    ],
)
def test_memory_budget_flag_errors(tmp_path: Path, argv: list[str], flag: str, words: str) -> None:
    with pytest.raises(SettingsError) as e:
        parse(tmp_path, *argv)
    assert e.value.flag == flag
    assert words in e.value.message


def test_memory_budget_bad_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = serve_error(
        capsys,
        "--model-repository",
        str(tmp_path),
        "--model-control-mode=on_demand",
        "--model-memory-budget",
        "lots",
    )
    assert "--model-memory-budget" in err
    assert "is not a size such as 2GiB" in err


# -- traffic control (issue 12) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--http-restricted-api", "inference"],
            "argument --http-restricted-api: --http-restricted-api 'inference': expected",
        ),
        (
            ["--grpc-restricted-protocol", "admin:k=v"],
            "argument --grpc-restricted-protocol: --grpc-restricted-protocol 'admin:k=v': "
            "unknown API 'admin'",
        ),
        (["--rate-limit-storage", "mongodb://x"], "memory:// or redis://host:port"),
        (
            ["--rate-limit-storage", "redis://r:6379", "--rate-limit-strategy", "token-bucket"],
            "token-bucket keeps its state in memory",
        ),
        (["--circuit-breaker", "open_secs=-1"], "argument --circuit-breaker: circuit breaker"),
        (
            ["--payload-log", "sink=csv:/x"],
            "argument --payload-log: sink must be jsonl:PATH, parquet:PATH or kafka://",
        ),
        (["--auth-config", "/nonexistent/auth.yaml"], "auth config file /nonexistent"),
    ],
)
def test_bad_traffic_flags_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    assert message in serve_error(capsys, "--model-repository", str(tmp_path), *argv)


def test_traffic_flags_parse(tmp_path: Path) -> None:
    cfg = tmp_path / "auth.yaml"
    cfg.write_text("keys: []\n")
    s = parse(
        tmp_path,
        "--auth-config", str(cfg),
        "--http-restricted-api", "model-repository,trace:admin-key=x",
        "--grpc-restricted-protocol", "model-repository:admin-key=x",
        "--rate-limit-storage", "redis://127.0.0.1:6379/0",
        "--rate-limit-fail-mode", "closed",
        "--circuit-breaker", "consecutive_failures=5,open_secs=5",
    )  # fmt: skip
    assert s.auth_config == cfg
    assert s.http_restricted_api == ("model-repository,trace:admin-key=x",)
    assert (s.rate_limit_storage, s.rate_limit_fail_mode, s.rate_limit_strategy) == (
        "redis://127.0.0.1:6379/0",
        "closed",
        "auto",
    )
    assert parse(tmp_path).circuit_breaker is None


def test_traffic_control_example_flags_parse(tmp_path: Path) -> None:
    """deploy/traffic-control/serve.sh's flags are flags `pdserve serve` accepts, with the
    values it documents (the example stays true to the code)."""
    import shlex

    script = Path(__file__).resolve().parents[3] / "deploy" / "traffic-control" / "serve.sh"
    text = script.read_text().replace("\\\n", " ")
    command = next(line for line in text.splitlines() if line.startswith("exec "))
    command = command.replace('"${PDSERVE_ADMIN_HEADER:?}"', "secret")
    argv = shlex.split(command)
    argv = argv[argv.index("serve") + 1 :]
    repo = argv.index("--model-repository")
    del argv[repo : repo + 2]
    auth = tmp_path / "auth.yaml"
    auth.write_text("keys: []\n")
    argv[argv.index("--auth-config") + 1] = str(auth)
    s = parse(tmp_path, *argv)
    assert s.model_control_mode == "poll"
    assert s.version_ready_marker == "READY"
    assert s.rate_limit_storage == "redis://redis:6379/0"
    assert s.circuit_breaker is not None and "consecutive_failures=5" in s.circuit_breaker


def test_allow_client_shm_is_off_by_default_and_takes_tritonservers_spelling(
    tmp_path: Path,
) -> None:
    assert parse(tmp_path).allow_client_shm is False
    assert parse(tmp_path, "--allow-client-shm").allow_client_shm is True
    assert parse(tmp_path, "--allow-client-shm=true").allow_client_shm is True
    assert parse(tmp_path, "--allow-client-shm=false").allow_client_shm is False


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], True),
        (["--allow-grpc"], True),
        (["--no-allow-grpc"], False),
        (["--allow-grpc=false"], False),  # tritonserver's spelling
        (["--allow-grpc=true"], True),
        (["--allow-grpc", "0"], False),
        (["--allow-grpc=OFF"], False),
        (["--no-allow-grpc", "--allow-grpc=yes"], True),  # the last one wins
    ],
)
def test_on_off_flags_take_pdserves_and_tritonservers_spellings(
    tmp_path: Path, argv: list[str], expected: bool
) -> None:
    assert parse(tmp_path, *argv).allow_grpc is expected


def test_on_off_flags_refuse_a_bad_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = serve_error(capsys, "--model-repository", str(tmp_path), "--allow-metrics=maybe")
    assert "argument --allow-metrics: expected true or false, got 'maybe'" in err
    err = serve_error(capsys, "--model-repository", str(tmp_path), "--no-allow-metrics=true")
    assert "argument --no-allow-metrics: takes no value (got 'true')" in err


def test_help_lists_both_spellings_of_an_on_off_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--allow-grpc [BOOL], --no-allow-grpc\n" in out
    assert "--strict-readiness [BOOL], --no-strict-readiness\n" in out


def test_a_repository_url_is_served_from_its_cache(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--model-repository",
            "s3://bucket/prefix",
            "--model-repository-cache",
            str(tmp_path),
        ]
    )
    s = Settings.from_namespace(args)  # no network: the store is read when serving starts
    assert s.remote_repository_url == "s3://bucket/prefix"
    assert s.repository == tmp_path / "repository"
    plain = parse(tmp_path)
    assert plain.remote_repository_url is None and plain.repository == tmp_path


def test_grpc_server_default_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.frontends.grpc.engine import default_grpc_server

    monkeypatch.delenv("PDSERVE_GRPC_SERVER", raising=False)
    assert default_grpc_server() == "native"
    monkeypatch.setenv("PDSERVE_GRPC_SERVER", "aio")
    assert default_grpc_server() == "aio"
    monkeypatch.setenv("PDSERVE_GRPC_SERVER", "bogus")  # not a choice: refused, naming the flag
    assert default_grpc_server() == "bogus"
    with pytest.raises(SettingsError, match="--grpc-server.*native, threads, aio.*'bogus'"):
        Settings(grpc_server="bogus").validate()


def test_http_server_defaults_to_native_or_the_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.app import serve_flags as settings_module

    monkeypatch.delenv("PDSERVE_HTTP_SERVER", raising=False)
    assert settings_module.default_http_server() == "native"
    monkeypatch.setenv("PDSERVE_HTTP_SERVER", "asgi")
    assert settings_module.default_http_server() == "asgi"
    assert parse(tmp_path, "--http-server", "native").http_server == "native"
    with pytest.raises(SettingsError, match="--http-server"):
        Settings(model_repository=tmp_path, http_server="bogus").validate()


def test_grpc_keepalive_flags_are_tritons(tmp_path: Path) -> None:
    settings = parse(tmp_path)
    ka = settings.grpc_keepalive
    assert (ka.time_ms, ka.timeout_ms, ka.permit_without_calls) == (7_200_000, 20_000, False)
    assert (ka.max_pings_without_data, ka.min_recv_ping_interval_ms, ka.max_ping_strikes) == (
        2,
        300_000,
        2,
    )
    assert dict(ka.channel_options())["grpc.http2.min_ping_interval_without_data_ms"] == 300_000
    given = parse(
        tmp_path,
        "--grpc-keepalive-time",
        "1000",
        "--grpc-keepalive-permit-without-calls",
        "--grpc-http2-max-ping-strikes",
        "0",
    ).grpc_keepalive
    assert (given.time_ms, given.permit_without_calls, given.max_ping_strikes) == (1000, True, 0)
    for flag, value in (("--grpc-keepalive-timeout", "0"), ("--grpc-http2-max-ping-strikes", "-1")):
        with pytest.raises(SettingsError, match=flag):
            parse(tmp_path, flag, value)


# -- TLS ----------------------------------------------------------------------------------


@pytest.fixture
def pem(tmp_path: Path) -> CertFiles:
    return issue(trustme.CA(), tmp_path / "certs")


@pytest.mark.parametrize(
    ("argv", "use_ssl", "mutual"),
    [
        ([], False, False),
        (["--grpc-use-ssl=true"], True, False),
        (["--grpc-use-ssl-mutual=1"], True, True),
        # tritonserver: --grpc-use-ssl-mutual (any value) sets --grpc-use-ssl too ...
        (["--grpc-use-ssl-mutual=false"], True, False),
        # ... and the flags are read in order
        (["--grpc-use-ssl-mutual=true", "--grpc-use-ssl=false"], False, True),
        (["--no-grpc-use-ssl-mutual"], False, False),
    ],
)
def test_grpc_tls_flags_are_tritons(
    tmp_path: Path, pem: CertFiles, argv: list[str], use_ssl: bool, mutual: bool
) -> None:
    files = [f"--grpc-server-cert={pem.cert}", f"--grpc-server-key={pem.key}"]
    s = parse(tmp_path, *files, f"--grpc-root-cert={pem.ca}", *argv)
    assert (s.grpc_use_ssl, s.grpc_use_ssl_mutual) == (use_ssl, mutual)
    tls = s.grpc_tls
    assert (tls is not None) == use_ssl
    if tls is not None:
        assert (tls.cert, tls.key, tls.root, tls.mutual) == (pem.cert, pem.key, pem.ca, mutual)
    assert parse(tmp_path, *files, "--no-allow-grpc", "--grpc-use-ssl").grpc_tls is None


def test_http_and_metrics_tls_flags(tmp_path: Path, pem: CertFiles) -> None:
    files = [f"--http-server-cert={pem.cert}", f"--http-server-key={pem.key}"]
    s = parse(tmp_path, *files, f"--http-root-cert={pem.ca}", "--http-use-ssl-mutual")
    assert s.http_use_ssl and s.http_tls is not None and s.http_tls.mutual
    assert s.http_tls.flags == "--http" and s.metrics_tls is None and s.grpc_tls is None
    s = parse(tmp_path, *files, "--metrics-use-ssl=true")
    assert s.http_tls is None
    assert s.metrics_tls is not None and not s.metrics_tls.mutual
    # the files alone turn nothing on (tritonserver ignores them without --grpc-use-ssl)
    assert parse(tmp_path, *files).http_tls is None


def test_bad_tls_flags_exit_2_naming_the_flag(
    tmp_path: Path, pem: CertFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = ["--model-repository", str(tmp_path)]
    err = serve_error(capsys, *repo, "--grpc-use-ssl", f"--grpc-server-key={pem.key}")
    assert "argument --grpc-use-ssl: needs --grpc-server-cert (a PEM file)" in err
    err = serve_error(capsys, *repo, "--http-use-ssl=on", f"--http-server-cert={pem.cert}")
    assert "argument --http-use-ssl: needs --http-server-key (a PEM file)" in err
    both = [f"--grpc-server-cert={pem.cert}", f"--grpc-server-key={pem.key}"]
    err = serve_error(capsys, *repo, *both, "--grpc-use-ssl-mutual=true")
    assert "argument --grpc-use-ssl-mutual: needs --grpc-root-cert" in err
    missing = tmp_path / "gone.pem"
    err = serve_error(capsys, *repo, "--grpc-use-ssl", f"--grpc-server-cert={missing}", both[1])
    assert f"--grpc-server-cert {missing}: cannot read it" in err
    other = issue(trustme.CA(), tmp_path / "other")
    err = serve_error(
        capsys,
        *repo,
        "--metrics-use-ssl",
        f"--http-server-cert={pem.cert}",
        f"--http-server-key={other.key}",
    )
    assert "argument --metrics-use-ssl: --http-server-key" in err and "does not match" in err
    err = serve_error(capsys, *repo, "--grpc-use-ssl=maybe")
    assert "argument --grpc-use-ssl: expected true or false, got 'maybe'" in err


def test_help_lists_the_tls_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "TLS options:" in out
    assert "--grpc-use-ssl-mutual [BOOL], --no-grpc-use-ssl-mutual\n" in out
    assert "--grpc-server-cert FILE" in out and "--http-root-cert FILE" in out


# -- the rate limiter's flags ---------------------------------------------------------------


def test_rate_limit_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.scheduling.rate_limiter import ResourceGrant

    assert parse(tmp_path).rate_limit == "off"
    assert parse(tmp_path).rate_limit_resource == ()
    settings = parse(
        tmp_path,
        "--rate-limit=EXECUTION_COUNT",
        "--rate-limit-resource=R:1",
        "--rate-limit-resource",
        "S:2:0",
    )
    assert settings.rate_limit == "execution_count"
    assert settings.rate_limit_resource == (ResourceGrant("R", 1, None), ResourceGrant("S", 2, 0))
    err = serve_error(capsys, "--rate-limit-resource=R:1:x")
    assert "argument --rate-limit-resource: --rate-limit-resource option format is" in err
    assert "got 'R:1:x': count and device are integers" in err
