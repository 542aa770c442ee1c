"""Shared fixtures: start a real pdserve process on free loopback ports.

Integration tests talk to it with ``tritonclient.http`` / ``tritonclient.grpc``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_REPO = ROOT / "examples" / "model_repository"
GOLDENS = ROOT / "examples" / "goldens"


#: Ports :func:`free_port` has given in this process.
_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now and that this process was not given
    before: the kernel may hand back a port just released, so that two calls in a row
    (a server's HTTP and metrics ports) would otherwise collide now and then."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


@dataclass
class ServerProcess:
    """A running ``pdserve serve`` child process and its addresses."""

    proc: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path

    @property
    def http_url(self) -> str:
        """``host:port`` for ``tritonclient.http``."""
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` for ``tritonclient.grpc``."""
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        """Everything the server has logged so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send ``sig`` and wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(
    repo: Path,
    log_path: Path,
    *args: str,
    ready_timeout: float = 120,
    wait_ready: bool = True,
    new_session: bool = False,
) -> ServerProcess:
    """Start ``python -m pdserve serve`` on free ports and wait until it is ready.

    ``new_session``: the server leads its own session and process group (as under
    systemd or a container runtime), so a test may signal the whole group.

    Raises:
        RuntimeError: the server exited or did not become ready in time (its log
            is in the message).
    """
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "serve",
        "--model-repository",
        str(repo),
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        *args,
    ]
    logf = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd,
        stdout=logf,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=env,
        start_new_session=new_session,
    )
    server = ServerProcess(proc, http_port, grpc_port, metrics_port, log_path)
    if not wait_ready:
        return server
    deadline = time.monotonic() + ready_timeout
    url = f"http://127.0.0.1:{http_port}/v2/health/ready"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"pdserve not ready after {ready_timeout}s:\n{server.log()}")


def require_examples() -> None:
    """Fail clearly when the example repository has not been built."""
    if not EXAMPLE_REPO.is_dir():
        pytest.fail("examples/model_repository is missing: run `python examples/build.py`")


@pytest.fixture(scope="session")
def example_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One pdserve serving the example repository, shared by the session."""
    require_examples()
    log_path = tmp_path_factory.mktemp("server") / "pdserve.log"
    server = start_server(EXAMPLE_REPO, log_path)
    yield server
    server.stop()


def copy_models(dst: Path, *models: str) -> Path:
    """Copy the named example models into a new repository ``dst`` a test may change."""
    require_examples()
    dst.mkdir(parents=True, exist_ok=True)
    for name in models:
        shutil.copytree(EXAMPLE_REPO / name, dst / name, symlinks=True)
    return dst


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (workers are children of the fork server)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found
