"""Integration: pdserve started the way KServe's stock Triton ServingRuntime starts
tritonserver (``tritonserver --model-store=... --grpc-port=... --http-port=...
--allow-grpc=true --allow-http=true``), answering tritonclient over HTTP and gRPC,
and tritonserver's start-up behaviour (--exit-on-error, --disable-auto-complete-config,
ignored flags logged once).

The ``tritonserver`` console script's entry function is run with ``python -c`` from
the checkout (the script in a virtual environment may point at another checkout);
``test_console_script_is_this_entry`` ties the two together.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import EXAMPLE_REPO, ROOT, free_port, require_examples

#: The ``tritonserver`` console script, as ``python -c`` runs it.
ENTRY = "from pdserve.app.cli import tritonserver_main; raise SystemExit(tritonserver_main())"
#: KServe's kserve-tritonserver runtime's arguments, after the repository and ports.
KSERVE_FLAGS = ["--allow-grpc=true", "--allow-http=true"]


class Tritonserver:
    """A ``tritonserver`` child process on free loopback ports."""

    def __init__(self, repo: Path, log_path: Path, *extra: str) -> None:
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.log_path = log_path
        # KServe's exact start-up command; then only what keeps it on loopback and free
        # ports (tritonserver binds 0.0.0.0 and metrics on 8002 by default).
        self.argv = [
            f"--model-store={repo}",
            f"--grpc-port={self.grpc_port}",
            f"--http-port={self.http_port}",
            *KSERVE_FLAGS,
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            f"--metrics-port={self.metrics_port}",
            *extra,
        ]
        with open(log_path, "wb") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", ENTRY, *self.argv],
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.http_port}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"tritonserver not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def kserve_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tritonserver]:
    """The example repository behind KServe's start-up command, plus two ignored flags."""
    require_examples()
    log_path = tmp_path_factory.mktemp("tritonserver") / "tritonserver.log"
    server = Tritonserver(
        EXAMPLE_REPO,
        log_path,
        "--pinned-memory-pool-byte-size=268435456",
        "--backend-config",
        "python,shm-default-byte-size=1048576",
        "--backend-config=default-max-batch-size=8",
    )
    server.wait_ready()
    yield server
    assert server.stop() == 0


def test_console_script_is_this_entry() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tritonserver"] == "pdserve.app.cli:tritonserver_main"
    assert scripts["pdserve"] == "pdserve.app.cli:main"


def _golden() -> tuple[np.ndarray, np.ndarray]:
    golden = np.load(EXAMPLE_REPO / "tiny" / "2" / "golden.npz")
    return golden["input_0"], golden["output_0"]


def test_http_round_trip(kserve_server: Tritonserver) -> None:
    x, expected = _golden()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{kserve_server.http_port}")
    assert client.is_server_ready() and client.is_model_ready("tiny")
    assert client.get_server_metadata()["name"] == "triton"  # tritonserver's --id default
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    result = client.infer("tiny", [inp])
    assert result.get_response()["model_version"] == "2"
    out = result.as_numpy("OUTPUT0")
    assert out.shape == (4, 64) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_grpc_round_trip(kserve_server: Tritonserver) -> None:
    x, expected = _golden()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{kserve_server.grpc_port}")
    assert client.is_server_ready() and client.is_model_ready("tiny")
    assert client.get_server_metadata().name == "triton"
    inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = client.infer("tiny", [inp]).as_numpy("OUTPUT0")
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    client.close()


def test_ignored_flags_are_logged_once(kserve_server: Tritonserver) -> None:
    log = kserve_server.log()
    assert log.count("--pinned-memory-pool-byte-size=268435456 ignored: ") == 1
    assert log.count("--backend-config=python,shm-default-byte-size=1048576 ignored: ") == 1
    assert "listening on http://127.0.0.1:" in log  # --http-address
    assert "default-max-batch-size=8 ignored" not in log


def test_default_max_batch_size(kserve_server: Tritonserver) -> None:
    """--backend-config=default-max-batch-size=8: the max_batch_size ONNX auto-complete
    gives tiny_autocomplete (no config.pbtxt; Triton's default would be 4)."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{kserve_server.http_port}")
    assert client.get_model_config("tiny_autocomplete")["max_batch_size"] == 8


def _broken_repo(tmp_path: Path) -> Path:
    """``tiny`` and ``tiny_autocomplete`` (no config.pbtxt), and a model whose
    config.pbtxt does not parse."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("tiny", "tiny_autocomplete"):
        shutil.copytree(EXAMPLE_REPO / name, repo / name, symlinks=True)
    broken = repo / "broken" / "1"
    broken.mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text("this is not a config\n")
    return repo


@pytest.mark.parametrize(
    "extra",
    [[], ["--model-control-mode=explicit", "--load-model=tiny", "--load-model=no_such_model"]],
    ids=["broken config", "unknown --load-model"],
)
def test_exit_on_error_exits_when_a_model_fails(tmp_path: Path, extra: list[str]) -> None:
    require_examples()
    server = Tritonserver(_broken_repo(tmp_path), tmp_path / "log", *extra)
    try:
        assert server.proc.wait(120) == 1
    finally:
        server.stop()
    assert "failed to load all models (1 failed) and --exit-on-error is on" in server.log()


def test_disable_auto_complete_config(tmp_path: Path) -> None:
    """--exit-on-error=false keeps serving; without auto-complete the model without a
    config.pbtxt fails to load, the complete one serves."""
    require_examples()
    repo = _broken_repo(tmp_path)
    shutil.rmtree(repo / "broken")
    log_file = tmp_path / "server.log"
    server = Tritonserver(
        repo,
        tmp_path / "log",
        "--exit-on-error=false",
        "--strict-readiness=false",
        "--disable-auto-complete-config",
        f"--log-file={log_file}",
    )
    try:
        server.wait_ready()
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        assert client.is_model_ready("tiny")
        assert not client.is_model_ready("tiny_autocomplete")
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["tiny_autocomplete"]["state"] == "UNAVAILABLE"
        assert "auto-complete is off" in index["tiny_autocomplete"]["reason"]
        # the logging extension reports where the log goes
        assert client.get_log_settings()["log_file"] == str(log_file)
    finally:
        assert server.stop() == 0
    # --log-file: the log goes there, not to stderr
    text = log_file.read_text()
    assert "auto-complete off: every model needs a complete config.pbtxt" in text
    assert "pdserve stopped" in text
    assert "pdserve stopped" not in server.log()


def test_allow_http_false_serves_grpc_only(tmp_path: Path) -> None:
    require_examples()
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(EXAMPLE_REPO / "tiny", repo / "tiny", symlinks=True)
    # the later --allow-http wins over KServe's --allow-http=true, as in tritonserver
    server = Tritonserver(repo, tmp_path / "log", "--allow-http=false", "--id=grpc-only")
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        deadline = time.monotonic() + 120
        while True:
            assert server.proc.poll() is None, server.log()
            try:
                if client.is_server_ready():
                    break
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        assert client.get_server_metadata().name == "grpc-only"
        x, expected = _golden()
        inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        out = client.infer("tiny", [inp]).as_numpy("OUTPUT0")
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
        client.close()
        with pytest.raises(OSError):  # nothing listens on the HTTP port
            urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v2", timeout=2)
    finally:
        assert server.stop() == 0
    assert "HTTP (KServe V2) listening" not in server.log()
