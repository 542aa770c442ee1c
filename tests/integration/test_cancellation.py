"""Cancellation end to end against a real pdserve (issue 15 items 2 and 5).

The models (``tests/data/python_models``): ``cancel_loop`` works X seconds checking
``request.is_cancelled()`` and records each run in ``runs.log`` (one instance, a
queue of at most 2); ``cancel_after`` records its runs; ``ens_cancel`` runs one then
the other (``max_inflight_requests: 1``); ``cancel_bls`` calls ``cancel_loop`` by BLS.

Cancellations come from real clients: an HTTP client that closes its socket, a
gRPC call past its deadline (``client_timeout``) or cancelled, and the V2
``timeout`` parameter.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, start_server

DATA = Path(__file__).resolve().parents[1] / "data" / "python_models"
MODELS = ("cancel_loop", "cancel_after", "cancel_bls", "ens_cancel")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("cancellation") / "models"
    for name in MODELS:
        shutil.copytree(DATA / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[ServerProcess]:
    proc = start_server(repo, repo.parent / "pdserve.log")
    yield proc
    proc.stop()


@pytest.fixture(autouse=True)
def idle(server: ServerProcess, repo: Path) -> Iterator[None]:
    """Each test starts with no request left and empty run logs."""
    wait_idle(server)
    for name in MODELS:
        (repo / name / "runs.log").unlink(missing_ok=True)
    yield


def body(seconds: float, batch: bool = True, **parameters: object) -> bytes:
    shape = [1, 1]
    doc: dict[str, object] = {
        "inputs": [{"name": "X", "datatype": "FP32", "shape": shape, "data": [seconds]}]
    }
    if parameters:
        doc["parameters"] = parameters
    return json.dumps(doc).encode()


def open_request(server: ServerProcess, model: str, payload: bytes) -> socket.socket:
    """Send an infer request on a raw socket and leave it waiting for the answer."""
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=60)
    head = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def answer(sock: socket.socket) -> tuple[int, str]:
    """Read the HTTP answer on ``sock`` (status, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before an answer"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    sock.close()
    return int(head.split(b" ", 2)[1]), rest.decode()


def http_infer(server: ServerProcess, model: str, payload: bytes) -> tuple[int, str]:
    return answer(open_request(server, model, payload))


def metric(server: ServerProcess, name: str, model: str, extra: str = "") -> float:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    prefix = f'{name}{{model="{model}",'
    for line in text.splitlines():
        if line.startswith(prefix) and extra in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {model} ({extra}) in /metrics")


def pending(server: ServerProcess, model: str) -> int:
    return int(metric(server, "nv_inference_pending_request_count", model))


def stats(server: ServerProcess, model: str) -> dict[str, dict[str, int]]:
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())["model_stats"][0]["inference_stats"]


def runs(repo: Path, model: str) -> list[str]:
    path = repo / model / "runs.log"
    return path.read_text().split("\n")[:-1] if path.exists() else []


def wait_for(what: str, check, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_idle(server: ServerProcess) -> None:
    """No request queued and the instance free: a 0-second run answers."""
    wait_for("the queue to drain", lambda: pending(server, "cancel_loop") == 0, 60)
    status, text = http_infer(server, "cancel_loop", body(0))
    assert status == 200, text


def test_disconnected_clients_free_their_queue_slots(server: ServerProcess, repo: Path) -> None:
    running = open_request(server, "cancel_loop", body(60))
    wait_for("the blocker to start", lambda: runs(repo, "cancel_loop") == ["start 60"])
    # large bodies (JSON padded to 300 kB): uvicorn pauses reading while such a body
    # waits in its buffer, and a close must still be seen once it is read
    queued = [open_request(server, "cancel_loop", body(1 + i) + b" " * 300_000) for i in range(2)]
    wait_for("two queued", lambda: pending(server, "cancel_loop") == 2)
    status, text = http_infer(server, "cancel_loop", body(0.5))
    assert status == 503 and "exceeds maximum queue size" in text  # the queue is full
    before = stats(server, "cancel_loop")["cancel"]["count"]
    for sock in queued:
        sock.close()  # the clients go away while their requests wait
    wait_for("their slots to be freed", lambda: pending(server, "cancel_loop") == 0, 10)
    assert stats(server, "cancel_loop")["cancel"]["count"] == before + 2
    # the freed slots take new requests
    more = [open_request(server, "cancel_loop", body(0.1)) for _ in range(2)]
    wait_for("two queued again", lambda: pending(server, "cancel_loop") == 2)
    running.close()  # the running request is cancelled in the worker: is_cancelled()
    assert [answer(s)[0] for s in more] == [200, 200]
    log = runs(repo, "cancel_loop")
    assert log[:2] == ["start 60", "cancelled 60"], log
    assert log[2:] == ["start 0.1", "done 0.1"] * 2, log  # the abandoned 1 s / 2 s never ran
    assert metric(server, "nv_inference_request_failure", "cancel_loop", 'reason="CANCELED"') >= 3


def test_timeout_parameter_cancels_in_the_worker(server: ServerProcess, repo: Path) -> None:
    start = time.monotonic()
    status, text = http_infer(server, "cancel_loop", body(30, timeout=300_000))  # 0.3 s
    took = time.monotonic() - start
    assert status == 503 and "timeout" in text.lower(), text
    assert took < 10, took
    wait_for("the run to end", lambda: len(runs(repo, "cancel_loop")) == 2)
    assert runs(repo, "cancel_loop") == ["start 30", "cancelled 30"]


def test_ensemble_stops_after_cancellation(server: ServerProcess, repo: Path) -> None:
    before = stats(server, "ens_cancel")["cancel"]["count"]
    sock = open_request(server, "ens_cancel", body(30))
    wait_for("step 1 to start", lambda: runs(repo, "cancel_loop") == ["start 30"])
    sock.close()
    wait_for("step 1 to stop", lambda: len(runs(repo, "cancel_loop")) == 2)
    assert runs(repo, "cancel_loop") == ["start 30", "cancelled 30"]
    wait_for(
        "the ensemble's cancel count",
        lambda: stats(server, "ens_cancel")["cancel"]["count"] == before + 1,
    )
    time.sleep(0.5)
    assert runs(repo, "cancel_after") == []  # no step ran after the cancellation
    # with a timeout: the whole ensemble's remaining time, step 2 never runs
    status, text = http_infer(server, "ens_cancel", body(30, timeout=500_000))
    assert status == 503 and "timeout" in text.lower(), text
    wait_for("step 1 to stop", lambda: len(runs(repo, "cancel_loop")) == 4)
    assert runs(repo, "cancel_loop")[2:] == ["start 30", "cancelled 30"]
    assert runs(repo, "cancel_after") == []
    # and a request that is not cancelled runs both steps
    status, text = http_infer(server, "ens_cancel", body(0))
    assert status == 200, text
    assert runs(repo, "cancel_after") == ["run 0"]


def test_ensemble_max_inflight_requests(server: ServerProcess, repo: Path) -> None:
    socks = [open_request(server, "ens_cancel", body(0.3)) for _ in range(4)]
    # one request at a time in step 1: the others wait in the ensemble, not in the
    # step model's queue (whose limit of 2 would reject the fourth)
    seen = 0
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        seen = max(seen, pending(server, "cancel_loop"))
    assert [answer(s)[0] for s in socks] == [200] * 4
    assert seen <= 1  # (a request is counted queued until its instance takes it)
    assert runs(repo, "cancel_after") == ["run 0.3"] * 4


def test_grpc_deadline_and_cancel(server: ServerProcess, repo: Path) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    x = grpcclient.InferInput("X", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[30]], np.float32))
    before = stats(server, "cancel_loop")["cancel"]["count"]
    with pytest.raises(InferenceServerException) as e:
        client.infer("cancel_loop", [x], client_timeout=0.5)
    assert "Deadline" in str(e.value) or "DEADLINE" in str(e.value)
    wait_for("the deadline to cancel the run", lambda: len(runs(repo, "cancel_loop")) == 2)
    assert runs(repo, "cancel_loop") == ["start 30", "cancelled 30"]
    # a cancelled call (the future tritonclient returns)
    results: list[object] = []
    call = client.async_infer("cancel_loop", [x], callback=lambda r, err: results.append(err))
    wait_for("the run to start", lambda: len(runs(repo, "cancel_loop")) == 3)
    call.cancel()
    wait_for("the cancel to reach the worker", lambda: len(runs(repo, "cancel_loop")) == 4)
    assert runs(repo, "cancel_loop")[2:] == ["start 30", "cancelled 30"]
    wait_for("the stats", lambda: stats(server, "cancel_loop")["cancel"]["count"] == before + 2)
    client.close()


def test_bls_child_is_cancelled_with_its_parent(server: ServerProcess, repo: Path) -> None:
    sock = open_request(server, "cancel_bls", body(30))
    wait_for("the BLS child to start", lambda: runs(repo, "cancel_loop") == ["start 30"])
    sock.close()
    wait_for("the child to stop", lambda: len(runs(repo, "cancel_loop")) == 2)
    assert runs(repo, "cancel_loop") == ["start 30", "cancelled 30"]
