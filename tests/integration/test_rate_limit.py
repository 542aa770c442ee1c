"""Rate limits in the server (issue 12, item 2): per model, per key and global, 429
with Retry-After / RESOURCE_EXHAUSTED, metrics, and Redis: two replicas sharing one
budget, Redis down at start, Redis killed under load (fail open: no request lost).

Redis is Debian's ``redis-server`` (``make sysdeps``), started here on a free
loopback port without persistence and stopped by its PID.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, copy_models, free_port, start_server
from tests.traffic_keys import sha256_hash

KEY = "rl-key-5e1f"
INFER_BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}
).encode()


class Redis:
    """A redis-server child process on 127.0.0.1:port (no persistence)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is missing: run `make sysdeps`")
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=0.5).ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def redis_server() -> Iterator[Redis]:
    r = Redis(free_port())
    r.start()
    yield r
    r.kill()


def write_config(
    path: Path, model_limit: str, key_limit: str | None = None, glob: str | None = None
) -> Path:
    lines = ["keys:", "  - name: rl", f"    hash: {sha256_hash(KEY)}"]
    if key_limit:
        lines.append(f"    rate_limit: {key_limit}")
    lines += ["anonymous:", "  models: ['*']", "  apis: [inference, metadata]", "rate_limits:"]
    if glob:
        lines.append(f"  global: {glob}")
    lines += ["  models:", f"    tiny: {model_limit}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def infer(
    server: ServerProcess, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/tiny/infer",
        data=INFER_BODY,
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metrics_text(server: ServerProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def grpc_input() -> list[grpcclient.InferInput]:
    x = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    return [x]


def test_model_and_key_limits_in_memory(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "tiny")
    cfg = write_config(tmp_path / "auth.yaml", "4/hour", key_limit="2/hour")
    server = start_server(repo, tmp_path / "pdserve.log", "--auth-config", str(cfg))
    try:
        keyed = {"authorization": f"Bearer {KEY}"}
        assert [infer(server, keyed)[0] for _ in range(2)] == [200, 200]
        status, headers, body = infer(server, keyed)
        assert status == 429
        # a token bucket of 2 refilled at 2 per hour: the next token in 30 minutes
        assert 1790 <= int(headers["retry-after"]) <= 1800
        assert "rate limit of key 'rl' exceeded" in json.loads(body)["error"]
        assert infer(server)[0] == 200  # anonymous: only the model's limit (2 of 4 used)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            client.infer("tiny", grpc_input())  # the 4th of the model's budget
            with pytest.raises(InferenceServerException) as e:
                client.infer("tiny", grpc_input())
            assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
            assert "rate limit of model 'tiny' exceeded" in e.value.message()
        finally:
            client.close()
        status, headers, _ = infer(server)
        assert status == 429 and "retry-after" in headers
        # the raw gRPC call: RESOURCE_EXHAUSTED with retry-after trailing metadata
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        with grpc.insecure_channel(server.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            request = service_pb2.ModelInferRequest(model_name="tiny")
            with pytest.raises(grpc.RpcError) as rpc:
                stub.ModelInfer(request, timeout=30)
            assert rpc.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            trailers = dict(rpc.value.trailing_metadata() or ())
            assert int(trailers["retry-after"]) >= 1
        assert urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready").status == 200
        text = metrics_text(server)
        assert 'pdserve_rate_limited_total{scope="key",model="",key="rl"} 1' in text
        assert 'pdserve_rate_limited_total{scope="model",model="tiny",key=""} 3' in text
        assert KEY not in text
    finally:
        server.stop()


def test_two_replicas_share_one_budget_in_redis(tmp_path: Path, redis_server: Redis) -> None:
    repo = copy_models(tmp_path / "models", "tiny")
    cfg = write_config(tmp_path / "auth.yaml", "6/minute")
    flags = ("--auth-config", str(cfg), "--rate-limit-storage", redis_server.url)
    a = start_server(repo, tmp_path / "a.log", *flags)
    b = start_server(repo, tmp_path / "b.log", *flags)
    try:
        statuses = [infer(server)[0] for _ in range(5) for server in (a, b)]
        assert statuses.count(200) == 6, statuses
        assert statuses.count(429) == 4, statuses
        assert statuses[:6] == [200] * 6
    finally:
        a.stop()
        b.stop()


def test_redis_down_at_start_fails_open_or_closed(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "tiny")
    cfg = write_config(tmp_path / "auth.yaml", "1/minute")
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    server = start_server(
        repo, tmp_path / "open.log", "--auth-config", str(cfg), "--rate-limit-storage", nowhere
    )
    try:
        assert [infer(server)[0] for _ in range(5)] == [200] * 5  # default: fail open
        assert "failing open" in server.log()
        assert "pdserve_rate_limit_storage_errors_total 5" in metrics_text(server)
    finally:
        server.stop()
    server = start_server(
        repo,
        tmp_path / "closed.log",
        "--auth-config",
        str(cfg),
        "--rate-limit-storage",
        nowhere,
        "--rate-limit-fail-mode",
        "closed",
    )
    try:
        status, _, body = infer(server)
        assert status == 503 and b"rate limit storage unavailable" in body
        assert urllib.request.urlopen(f"http://{server.http_url}/v2/health/live").status == 200
    finally:
        server.stop()


def test_redis_killed_under_load_loses_no_request(tmp_path: Path, redis_server: Redis) -> None:
    repo = copy_models(tmp_path / "models", "tiny")
    cfg = write_config(tmp_path / "auth.yaml", "100000/second")
    server = start_server(
        repo,
        tmp_path / "pdserve.log",
        "--auth-config",
        str(cfg),
        "--rate-limit-storage",
        redis_server.url,
    )
    statuses: list[int] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            statuses.append(infer(server)[0])

    threads = [threading.Thread(target=client) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.5)
        before = len(statuses)
        redis_server.kill()
        time.sleep(2.0)
        during = len(statuses) - before
        redis_server.start()  # back on the same port
        time.sleep(2.5)
        stop.set()
        for t in threads:
            t.join(30)
        assert before > 0 and during > 0
        assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
        log = server.log()
        assert "failed (" in log and "failing open" in log
        assert "is back" in log
        assert server.proc.poll() is None
    finally:
        stop.set()
        server.stop()
