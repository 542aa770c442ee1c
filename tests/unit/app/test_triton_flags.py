"""Unit tests: tritonserver's command line (pdserve.app.triton_flags, the
``tritonserver`` program of pdserve.app.cli): every flag of tritonserver's --help is
accepted in both value syntaxes, with Triton's booleans, repeats and defaults; no
abbreviations; ignored flags are logged once."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from pdserve.app import cli, triton_flags
from pdserve.app.settings import TRITONSERVER_DEFAULTS, Settings, SettingsError

#: A value of each tritonserver flag, as a user would give it (None: takes no value).
SAMPLES: dict[str, str | None] = {
    "--id": "my-server",
    "--exit-timeout-secs": "5",
    "--log-verbose": "1",
    "--log-info": "true",
    "--log-warning": "on",
    "--log-error": "1",
    "--log-format": "ISO8601",
    "--log-file": "LOGFILE",
    "--model-store": "REPO",
    "--model-repository": "REPO",
    "--exit-on-error": "false",
    "--disable-auto-complete-config": None,
    "--strict-readiness": "false",
    "--model-control-mode": "explicit",
    "--repository-poll-secs": "5",
    "--load-model": "tiny",
    "--model-config-name": "h100",
    "--model-load-thread-count": "4",
    "--model-load-retry-count": "0",
    "--model-namespacing": "false",
    "--enable-peer-access": "true",
    "--allow-http": "true",
    "--http-address": "127.0.0.1",
    "--http-port": "18000",
    "--reuse-http-port": "false",
    "--http-header-forward-pattern": "x-.*",
    "--http-thread-count": "8",
    "--http-max-input-size": "67108864",
    "--http-restricted-api": "model-repository:admin-key=secret",
    "--allow-grpc": "true",
    "--grpc-address": "127.0.0.1",
    "--grpc-port": "18001",
    "--reuse-grpc-port": "false",
    "--grpc-header-forward-pattern": "x-.*",
    "--grpc-infer-thread-count": "2",
    "--grpc-infer-allocation-pool-size": "8",
    "--grpc-max-response-pool-size": "16",
    "--grpc-infer-response-compression-level": "none",
    "--grpc-keepalive-time": "7200000",
    "--grpc-keepalive-timeout": "20000",
    "--grpc-keepalive-permit-without-calls": "0",
    "--grpc-http2-max-pings-without-data": "2",
    "--grpc-http2-min-recv-ping-interval-without-data": "300000",
    "--grpc-http2-max-ping-strikes": "2",
    "--grpc-max-connection-age": "60000",
    "--grpc-max-connection-age-grace": "1000",
    "--grpc-restricted-protocol": "model-repository:admin-key=secret",
    "--allow-sagemaker": "false",
    "--sagemaker-port": "8080",
    "--sagemaker-safe-port-range": "8000-8002",
    "--sagemaker-thread-count": "8",
    "--allow-vertex-ai": "false",
    "--vertex-ai-port": "8080",
    "--vertex-ai-thread-count": "8",
    "--vertex-ai-default-model": "tiny",
    "--allow-metrics": "true",
    "--allow-gpu-metrics": "false",
    "--allow-cpu-metrics": "true",
    "--metrics-address": "127.0.0.1",
    "--metrics-port": "18002",
    "--metrics-interval-ms": "2000",
    "--metrics-config": "summary_latencies=true",
    "--trace-config": "rate=100",
    "--backend-directory": "/opt/tritonserver/backends",
    "--backend-config": "python,shm-default-byte-size=1048576",
    "--repoagent-directory": "/opt/tritonserver/repoagents",
    "--cache-config": "local,size=1048576",
    "--cache-directory": "/opt/tritonserver/caches",
    "--pinned-memory-pool-byte-size": "268435456",
    "--cuda-memory-pool-byte-size": "0:67108864",
    "--cuda-virtual-address-size": "0:1073741824",
    "--min-supported-compute-capability": "6.0",
    "--buffer-manager-thread-count": "0",
    "--host-policy": "cpu,cpu-cores=0",
    "--model-load-gpu-limit": "0:0.8",
    "--allow-client-shm": "false",
    "--strict-model-config": "false",
    "--response-cache-byte-size": "1048576",
    "--trace-level": "TIMESTAMPS",
    "--trace-rate": "100",
    "--trace-count": "10",
    "--trace-log-frequency": "0",
    "--trace-file": "/tmp/trace.json",
}
#: The TLS and rate-limiter flags.
SAMPLES.update(
    {
        "--grpc-use-ssl": "false",
        "--grpc-use-ssl-mutual": "false",
        "--grpc-server-cert": "server.crt",
        "--grpc-server-key": "server.key",
        "--grpc-root-cert": "ca.crt",
        "--rate-limit": "off",
        "--rate-limit-resource": "R1:10:0",
    }
)
#: Flags that parse but that pdserve refuses at start, with what the refusal says.
REFUSED = {"--trace-file": "Triton's JSON trace file is not supported"}
#: Flags a walk gives alone (they need a setting of another flag).
NEEDS = {
    "--load-model": ["--model-control-mode=explicit"],
    # any value of it turns --grpc-use-ssl on (Triton's rule); a later flag turns it off
    "--grpc-use-ssl-mutual": ["--grpc-use-ssl=false"],
}


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    serve = cli.build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return [("pdserve serve", serve), ("tritonserver", cli.build_tritonserver_parser())]


def _argv(flag: str, value: str | None, tmp_path: Path, joined: bool) -> list[str]:
    if value is not None:
        value = value.replace("REPO", str(tmp_path)).replace("LOGFILE", str(tmp_path / "log"))
    words = [flag] if value is None else [f"{flag}={value}"] if joined else [flag, value]
    if flag not in ("--model-store", "--model-repository"):
        words = [f"--model-repository={tmp_path}", *words]
    return [*words, *NEEDS.get(flag, [])]


def test_the_flag_list_is_tritonservers() -> None:
    assert len(TRITONSERVER := triton_flags.TRITONSERVER_FLAGS) == len(set(TRITONSERVER)) == 91
    assert set(SAMPLES) == set(TRITONSERVER) - {"--help"}


@pytest.mark.parametrize("joined", [True, False], ids=["flag=value", "flag value"])
def test_every_tritonserver_flag_is_accepted(tmp_path: Path, joined: bool) -> None:
    for name, parser in _parsers():
        for flag, value in SAMPLES.items():
            if value is None and not joined:
                continue
            args = parser.parse_args(_argv(flag, value, tmp_path, joined))
            if flag in REFUSED:
                with pytest.raises(SettingsError, match=REFUSED[flag]):
                    Settings.from_namespace(args)
                continue
            settings = Settings.from_namespace(args, TRITONSERVER_DEFAULTS)
            assert settings.repository == tmp_path, (name, flag)


def test_flag_rows_cover_every_flag() -> None:
    for _, parser in _parsers():
        rows = triton_flags.flag_rows(parser)
        assert [r.flag for r in rows] == list(triton_flags.TRITONSERVER_FLAGS)
        missing = {r.flag for r in rows if r.status == "missing"}
        assert not missing
        status = {r.flag: r.status for r in rows}
        assert status["--model-store"] == status["--http-max-input-size"] == "mapped"
        assert status["--pinned-memory-pool-byte-size"] == "ignored"
        assert status["--id"] == status["--allow-http"] == status["--help"] == "implemented"
        assert status["--strict-model-config"] == status["--trace-rate"] == "mapped"
        assert status["--allow-grpc"] == "implemented"
        ignored = {r.flag for r in rows if r.status == "ignored"}
        assert ignored == set(triton_flags.IGNORED)
        assert all(r.note for r in rows if r.status in ("mapped", "ignored"))
    table = triton_flags.markdown_table(_parsers()[1][1])
    assert table.count("\n") == 2 + 91
    assert "| `--model-store` | mapped | another name of --model-repository |" in table


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--allow-grp=false"],
        ["tritonserver", "--allow-grp=false"],
        ["serve", "--model-repo=/tmp"],
        ["tritonserver", "--model-store=/tmp", "--exit-on=false"],
        ["check", "/tmp", "--no-golden"],
    ],
)
def test_no_abbreviations(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "value"),
    [("true", True), ("TRUE", True), ("on", True), ("1", True), ("false", False), ("Off", False), ("0", False)],
)  # fmt: skip
def test_booleans_as_triton_reads_them(tmp_path: Path, text: str, value: bool) -> None:
    parser = cli.build_tritonserver_parser()
    for argv in (
        [f"--allow-grpc={text}", f"--exit-on-error={text}", f"--strict-model-config={text}"],
        ["--allow-grpc", text, "--exit-on-error", text, "--strict-model-config", text],
    ):
        s = Settings.from_namespace(parser.parse_args([f"--model-store={tmp_path}", *argv]))
        assert s.allow_grpc is s.exit_on_error is s.strict_model_config is value
        assert s.auto_complete is not value


@pytest.mark.parametrize(
    "argv",
    [
        ["--allow-grpc=maybe"],
        ["--exit-on-error=2"],
        ["--grpc-infer-thread-count=1"],  # Triton: 2 to 128
        ["--cuda-memory-pool-byte-size=5"],  # <device>:<bytes>
        ["--grpc-infer-response-compression-level=max"],
        ["--backend-config=nosetting"],
        ["--backend-config=default-max-batch-size=-1"],
        ["--metrics-config=a,b=c"],
        ["--model-control-mode=sometimes"],
        ["--log-verbose=loud"],
        ["--model-store=/a", "--model-repository=/b"],  # pdserve serves one repository
        ["--model-control-mode=explicit", "--load-model=*", "--load-model=a"],
    ],
)
def test_bad_values_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["tritonserver", "--model-store=/a", *argv])
    assert e.value.code == 2
    assert argv[-1].split("=")[0] in capsys.readouterr().err


def test_triton_spellings_of_values(tmp_path: Path) -> None:
    parser = cli.build_tritonserver_parser()
    args = parser.parse_args(
        [
            f"--model-store={tmp_path}",
            f"--model-repository={tmp_path}",  # the same repository twice is fine
            "--model-control-mode=EXPLICIT",
            "--model-control-mode=explicit",  # repeated: the last one
            "--load-model=a",
            "--load-model",
            "b",
            "--log-verbose=true",
            "--backend-config=python,shm-default-byte-size=1",
            "--backend-config=default-max-batch-size=4",
            "--cuda-memory-pool-byte-size=0:1",
            "--cuda-memory-pool-byte-size=1:2",
            "--model-load-thread-count=2",
            "--model-load-thread-count=8",  # not repeatable: the last one
            "--trace-level=TIMESTAMPS",
            "--trace-rate=10",
        ]
    )
    s = Settings.from_namespace(args, TRITONSERVER_DEFAULTS)
    assert s.model_control_mode == "explicit" and s.load_models == ("a", "b")
    assert s.log_verbose == 1
    assert s.backend_config == ("python,shm-default-byte-size=1", "default-max-batch-size=4")
    assert s.backend_settings() == [
        ("python", "shm-default-byte-size", "1"),
        ("", "default-max-batch-size", "4"),
    ]
    assert s.ignored_flags == (
        ("--cuda-memory-pool-byte-size", "0:1"),
        ("--cuda-memory-pool-byte-size", "1:2"),
        ("--model-load-thread-count", "8"),
    )
    assert s.trace_config == ("level=TIMESTAMPS", "rate=10")
    assert s.tracing().rate == 10


def test_tritonserver_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_tritonserver_parser()
    s = Settings.from_namespace(
        parser.parse_args([f"--model-store={tmp_path}"]), TRITONSERVER_DEFAULTS
    )
    assert (s.http_host, s.grpc_host, s.metrics_host) == ("0.0.0.0",) * 3
    assert (s.http_port, s.grpc_port, s.metrics_port) == (8000, 8001, 8002)
    assert s.strict_readiness and s.exit_on_error and s.allow_http and s.allow_grpc
    assert s.model_control_mode == "none" and s.server_id == "triton" and s.auto_complete
    assert s.grpc_max_message_bytes == 2**31 - 1
    # a flag given wins over the program's default
    s = Settings.from_namespace(
        parser.parse_args([f"--model-store={tmp_path}", "--strict-readiness=false", "--id=x"]),
        TRITONSERVER_DEFAULTS,
    )
    assert not s.strict_readiness and s.server_id == "x"
    # pdserve serve keeps its own
    d = Settings(model_repository=tmp_path)
    assert (d.host, d.strict_readiness, d.exit_on_error, d.server_id) == (
        "127.0.0.1",
        False,
        False,
        "pdserve",
    )
    with pytest.raises(SystemExit) as e:
        cli.main(["tritonserver", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: tritonserver [options]")
    assert "address to listen on (default 0.0.0.0)" in out
    assert "--model-repository MODEL_REPOSITORY, --model-store MODEL_REPOSITORY" in out


def test_tritonserver_needs_a_repository(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["tritonserver", "--http-port=9000"])
    assert e.value.code == 2
    assert "--model-repository must be specified" in capsys.readouterr().err


def test_addresses_and_port_collisions(tmp_path: Path) -> None:
    s = Settings(model_repository=tmp_path, host="0.0.0.0", http_address="127.0.0.1")
    assert (s.http_host, s.grpc_host, s.metrics_host) == ("127.0.0.1", "0.0.0.0", "127.0.0.1")
    # one port on two addresses is no collision (tritonserver's CheckPortCollision)
    Settings(model_repository=tmp_path, grpc_port=8000, grpc_address="127.0.0.2").validate()
    with pytest.raises(SettingsError, match="same port 8000"):
        Settings(model_repository=tmp_path, grpc_port=8000).validate()
    # HTTP off: its port is free for another listener
    Settings(model_repository=tmp_path, allow_http=False, grpc_port=8000).validate()


def test_ignored_flags_log_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test-triton-flags")
    with caplog.at_level(logging.INFO, logger="test-triton-flags"):
        triton_flags.log_ignored(
            [
                ("--allow-sagemaker", "false"),
                ("--allow-sagemaker", "true"),
                ("--pinned-memory-pool-byte-size", "268435456"),
                ("--grpc-max-connection-age", "0"),
            ],
            log,
        )
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "--allow-sagemaker=false ignored: pdserve has no SageMaker front end"),
        ("WARNING", "--allow-sagemaker=true ignored: pdserve has no SageMaker front end"),
        (
            "INFO",
            "--pinned-memory-pool-byte-size=268435456 ignored: pdserve's backends allocate "
            "their own device memory (no server-side pools)",
        ),
        (
            "WARNING",
            "--grpc-max-connection-age=0 ignored: gRPC connections have no maximum age "
            "(GRPC_ARG_MAX_CONNECTION_AGE_MS)",
        ),
    ]


def test_backend_setting() -> None:
    assert triton_flags.backend_setting("python,shm-default-byte-size=1") == (
        "python",
        "shm-default-byte-size",
        "1",
    )
    assert triton_flags.backend_setting("default-max-batch-size=4") == (
        "",
        "default-max-batch-size",
        "4",
    )
    with pytest.raises(argparse.ArgumentTypeError):
        triton_flags.backend_setting("python,=1")


def test_the_docs_table_is_the_parsers() -> None:
    """docs/user-guide/tritonserver.md holds markdown_table()'s rows (regenerate it
    with the command the page gives)."""
    doc = Path(__file__).resolve().parents[3] / "docs" / "user-guide" / "tritonserver.md"
    block = doc.read_text().split("<!-- tritonserver-flags:start -->\n")[1]
    in_doc = block.split("<!-- tritonserver-flags:end -->")[0].splitlines()
    generated = triton_flags.markdown_table(cli.build_tritonserver_parser()).splitlines()
    assert in_doc == generated


@pytest.mark.parametrize(
    ("options", "size"),
    [
        ((), 4),
        (("default-max-batch-size=8",), 8),
        (("onnxruntime,default-max-batch-size=2", "default-max-batch-size=8"), 2),
        (("python,default-max-batch-size=2",), 4),  # another backend's: ignored
    ],
)
def test_default_max_batch_size(tmp_path: Path, options: tuple[str, ...], size: int) -> None:
    s = Settings(model_repository=tmp_path, backend_config=options)
    s.validate()
    assert s.default_max_batch_size == size
