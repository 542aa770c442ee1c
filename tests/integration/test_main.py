"""The composition root (pdserve.app.main) on a real process: start order, failures
to start, and a feature whose module cannot be imported."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import ROOT, copy_models, free_port, start_server

#: Runs the CLI with the modules named in argv[1] (comma-separated) made unimportable.
WITHOUT_MODULES = (
    "import sys\n"
    "for name in filter(None, sys.argv[1].split(',')):\n"
    "    sys.modules[name] = None  # `import name` now raises ImportError\n"
    "from pdserve.app.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def run_without(
    modules: str, repo: Path, log: Path, *args: str, ports: tuple[int, int, int] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``pdserve serve`` on ``repo`` with ``modules`` unimportable."""
    http_port, grpc_port, metrics_port = ports or (free_port(), free_port(), free_port())
    cmd = [sys.executable, "-c", WITHOUT_MODULES, modules, "serve"]
    cmd += ["--model-repository", str(repo), "--http-port", str(http_port)]
    cmd += ["--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def http_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.parametrize(
    ("modules", "feature", "flag"),
    [
        ("pdserve.frontends.grpc.server", "gRPC", "--no-allow-grpc"),
        ("pdserve.frontends.metrics_http", "metrics", "--no-allow-metrics"),
    ],
)
def test_feature_that_cannot_be_imported_stops_serve(
    tmp_path: Path, modules: str, feature: str, flag: str
) -> None:
    repo = copy_models(tmp_path / "repo", "tiny")
    log = tmp_path / "log"
    proc = run_without(modules, repo, log)
    assert proc.wait(60) == 1
    text = log.read_text()
    assert f"{feature} is asked for but cannot be imported ({modules}:" in text
    assert f"start with {flag}" in text
    assert "listening" not in text  # nothing started


def test_feature_turned_off_needs_no_module(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "repo", "tiny")
    log = tmp_path / "log"
    ports = (free_port(), free_port(), free_port())
    proc = run_without(
        "pdserve.frontends.grpc.server,pdserve.frontends.metrics_http",
        repo,
        log,
        "--no-allow-grpc",
        "--no-allow-metrics",
        ports=ports,
    )
    try:
        deadline = time.monotonic() + 60
        while not http_ready(ports[0]):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        with pytest.raises(OSError):  # no gRPC or metrics listener
            socket.create_connection(("127.0.0.1", ports[1]), timeout=1).close()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", ports[2]), timeout=1).close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()


def test_parts_start_in_order_and_stop_in_reverse(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "repo", "tiny")
    server = start_server(repo, tmp_path / "log", "--model-control-mode=poll")
    try:
        c = grpcclient.InferenceServerClient(server.grpc_url)
        assert c.is_model_ready("tiny")
    finally:
        assert server.stop() == 0
    text = server.log()
    steps = [
        "HTTP (KServe V2) listening",
        "gRPC (KServe V2) listening",
        "metrics (Prometheus) at",
        "model control mode poll: scanning the repository every 15s",
        "model repository",
        "shutting down: finishing in-flight requests",
        "pdserve stopped",
    ]
    at = [text.find(step) for step in steps]
    assert -1 not in at, text
    assert at == sorted(at), text


def test_grpc_port_in_use_stops_what_started(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "repo", "tiny")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        grpc_port = busy.getsockname()[1]
        http_port = free_port()
        log = tmp_path / "log"
        proc = run_without("", repo, log, ports=(http_port, grpc_port, free_port()))
        assert proc.wait(60) == 1
    text = log.read_text()
    assert f"could not listen for gRPC on 127.0.0.1:{grpc_port}" in text
    assert "HTTP (KServe V2) listening" in text and "pdserve stopped" in text
    assert "model repository" not in text  # no model was loaded


def test_http_port_in_use_exits_1(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "repo", "tiny")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        http_port = busy.getsockname()[1]
        log = tmp_path / "log"
        proc = run_without("", repo, log, ports=(http_port, free_port(), free_port()))
        assert proc.wait(60) == 1
    text = log.read_text()
    assert f"could not listen for HTTP on 127.0.0.1:{http_port}" in text
    assert "gRPC (KServe V2) listening" not in text
