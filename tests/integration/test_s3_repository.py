"""A model repository on S3 (issue 14 item 4): a real local S3 server (moto_server on
127.0.0.1) read by pdserve through s3fs.

pdserve reaches the store through a small TCP relay owned by the test, so the S3
server can be killed (the store goes away: connections to it fail) and a new one
started and filled before the relay points at it (the store comes back with the
same objects; moto keeps its data in memory only).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import EXAMPLE_REPO, ServerProcess, free_port, require_examples, start_server

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")

BUCKET = "models"
PREFIX = "repo"
CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoServer:
    """``moto_server`` on a free loopback port, stopped by PID."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        self.s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.port}", **_creds())
        self.s3.create_bucket(Bucket=BUCKET)

    def upload_tree(self, src: Path, dst: str) -> None:
        for path in sorted(src.rglob("*")):
            if path.is_file():
                key = f"{PREFIX}/{dst}/{path.relative_to(src).as_posix()}"
                self.s3.upload_file(str(path), BUCKET, key)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _creds() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDS["AWS_DEFAULT_REGION"],
    }


class Relay:
    """A loopback TCP relay to ``upstream`` (a port that may be dead or changed)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.replacement: MotoServer | None = None  # the S3 server started after a kill
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream), timeout=2)
            except OSError:
                client.close()  # the store is gone
                continue
            self.conns += [client, up]
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        """Drop every open connection (kept-alive ones included)."""
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conns.clear()

    def close(self) -> None:
        self.sock.close()
        self.cut()


def fill(moto: MotoServer, versions: dict[str, str]) -> None:
    """Upload the example model ``tiny`` (config and the given versions: name ->
    source version folder)."""
    moto.s3.upload_file(
        str(EXAMPLE_REPO / "tiny" / "config.pbtxt"), BUCKET, f"{PREFIX}/tiny/config.pbtxt"
    )
    for v, src in versions.items():
        moto.upload_tree(EXAMPLE_REPO / "tiny" / src, f"tiny/{v}")


@pytest.fixture(scope="module")
def s3(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[MotoServer, Relay, ServerProcess, Path]]:
    require_examples()
    moto = MotoServer()
    relay = Relay(moto.port)
    fill(moto, {"1": "1", "2": "2"})
    tmp = tmp_path_factory.mktemp("s3")
    env = dict(CREDS, AWS_ENDPOINT_URL=f"http://127.0.0.1:{relay.port}")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        server = start_server(
            f"s3://{BUCKET}/{PREFIX}",  # type: ignore[arg-type]
            tmp / "pdserve.log",
            "--model-repository-cache",
            str(tmp / "cache"),
            "--model-control-mode",
            "poll",
            "--repository-poll-secs",
            "0.5",
        )
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield moto, relay, server, tmp / "cache"
    server.stop()
    relay.close()
    moto.kill()
    if relay.replacement is not None:
        relay.replacement.kill()


def infer(c: httpclient.InferenceServerClient) -> tuple[str, np.ndarray]:
    x = np.ones((1, 64), dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    r = c.infer("tiny", [inp])
    return r.get_response()["model_version"], r.as_numpy("OUTPUT0")


def wait_for(cond, timeout: float = 60, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_initial_load_from_s3(s3: tuple[MotoServer, Relay, ServerProcess, Path]) -> None:
    _, _, server, cache = s3
    c = httpclient.InferenceServerClient(server.http_url)
    assert c.is_model_ready("tiny")
    version, out = infer(c)
    assert version == "2" and out.shape == (1, 64)
    assert (cache / "repository" / "tiny" / "2" / "model.onnx").read_bytes() == (
        EXAMPLE_REPO / "tiny" / "2" / "model.onnx"
    ).read_bytes()
    assert f"model repository s3://{BUCKET}/{PREFIX}: synced into" in server.log()


def test_new_version_uploaded_under_load_is_picked_up_without_failures(
    s3: tuple[MotoServer, Relay, ServerProcess, Path],
) -> None:
    moto, _, server, _ = s3
    c = httpclient.InferenceServerClient(server.http_url)
    results: list[str] = []
    errors: list[str] = []
    stop = threading.Event()

    def load() -> None:
        cl = httpclient.InferenceServerClient(server.http_url)
        while not stop.is_set() and len(results) < 20000:
            try:
                results.append(infer(cl)[0])
            except Exception as e:  # noqa: BLE001 - counted
                errors.append(repr(e))

    t = threading.Thread(target=load)
    t.start()
    try:
        time.sleep(0.5)
        moto.upload_tree(EXAMPLE_REPO / "tiny" / "2", "tiny/3")
        wait_for(lambda: "3" in results[-5:], 60, "version 3 to serve")
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(30)
    assert errors == []
    assert results[0] == "2" and results[-1] == "3"
    first3 = results.index("3")
    assert set(results[first3:]) == {"3"}  # no flapping back
    assert c.is_model_ready("tiny", "3")


def test_store_going_away_keeps_serving_and_resyncs_when_back(
    s3: tuple[MotoServer, Relay, ServerProcess, Path],
) -> None:
    moto, relay, server, cache = s3
    c = httpclient.InferenceServerClient(server.http_url)
    moto.kill()
    relay.cut()
    wait_for(lambda: "is unreachable" in server.log(), 30, "the outage log line")
    for _ in range(20):
        assert infer(c)[0] == "3"
    time.sleep(1.5)  # several polls during the outage: still one line
    log = server.log()
    assert log.count("is unreachable") == 1
    assert "serving from the local cache" in log
    # A new S3 server with the same objects plus a version 4; the relay points at it.
    moto2 = MotoServer()
    relay.replacement = moto2
    fill(moto2, {"1": "1", "2": "2", "3": "2"})
    moto2.upload_tree(EXAMPLE_REPO / "tiny" / "1", "tiny/4")
    relay.upstream = moto2.port
    wait_for(lambda: "is reachable again" in server.log(), 30, "the recovery log line")
    wait_for(lambda: infer(c)[0] == "4", 60, "version 4 to serve")
    assert server.log().count("is reachable again") == 1
    assert (cache / "repository" / "tiny" / "4" / "model.onnx").is_file()
    assert not (cache / "staging").exists()
