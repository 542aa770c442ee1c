"""Circuit breaker per model version (issue 12, item 3) in a real server.

The python model ``error_codes`` fails on demand (its MODE input); its config gets a
``circuit_breaker`` parameter (3 consecutive failures, 2 s open). ``--circuit-breaker``
puts the default breaker on every other model (here ``tiny``).
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import EXAMPLE_REPO, ServerProcess, require_examples, start_server

DATA = Path(__file__).resolve().parents[1] / "data" / "python_models"
POLICY = "consecutive_failures=3,failure_rate=0,open_secs=2,half_open_probes=1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_examples()
    repo = tmp_path_factory.mktemp("breaker") / "models"
    shutil.copytree(DATA / "error_codes", repo / "error_codes")
    shutil.copytree(EXAMPLE_REPO / "tiny", repo / "tiny", symlinks=True)
    cfg = repo / "error_codes" / "config.pbtxt"
    cfg.write_text(
        cfg.read_text()
        + f'parameters {{ key: "circuit_breaker" value {{ string_value: "{POLICY}" }} }}\n'
    )
    proc = start_server(repo, repo.parent / "pdserve.log", "--circuit-breaker", "on")
    yield proc
    proc.stop()


def call(server: ServerProcess, mode: str) -> tuple[int, dict[str, str], str]:
    body = json.dumps(
        {"inputs": [{"name": "MODE", "shape": [1], "datatype": "BYTES", "data": [mode]}]}
    ).encode()
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/error_codes/infer",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def metrics(server: ServerProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def grpc_ok(client: grpcclient.InferenceServerClient) -> None:
    x = grpcclient.InferInput("MODE", [1], "BYTES")
    x.set_data_from_numpy(np.array([b"ok"], dtype=object))
    client.infer("error_codes", [x])


def test_bad_requests_do_not_trip_the_breaker(server: ServerProcess) -> None:
    for _ in range(5):
        assert call(server, "respond:INVALID_ARG")[0] == 400
    assert call(server, "ok")[0] == 200


def test_trips_answers_fast_503_probes_and_closes(server: ServerProcess) -> None:
    labels = 'model="error_codes",version="1"'
    for _ in range(3):
        assert call(server, "respond:INTERNAL")[0] == 500
    t0 = time.monotonic()
    status, headers, body = call(server, "ok")  # a good request, refused: the circuit is open
    assert status == 503
    assert "circuit breaker open for model 'error_codes' version 1" in json.loads(body)["error"]
    assert 1 <= int(headers["retry-after"]) <= 2
    assert time.monotonic() - t0 < 1.0
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as e:
            grpc_ok(client)
        assert e.value.status() == "StatusCode.UNAVAILABLE"
        assert "circuit breaker open" in e.value.message()
        text = metrics(server)
        assert f"pdserve_circuit_state{{{labels}}} 1" in text
        assert f'pdserve_circuit_transitions_total{{{labels},to="open"}} 1' in text
        assert f"pdserve_circuit_rejected_total{{{labels}}} 2" in text
        time.sleep(2.2)
        # half-open: a failing probe opens the circuit again
        assert call(server, "respond:INTERNAL")[0] == 500
        assert call(server, "ok")[0] == 503
        time.sleep(2.2)
        grpc_ok(client)  # the probe succeeds: closed
    finally:
        client.close()
    assert call(server, "ok")[0] == 200
    text = metrics(server)
    assert f"pdserve_circuit_state{{{labels}}} 0" in text
    assert f'pdserve_circuit_transitions_total{{{labels},to="open"}} 2' in text
    assert f'pdserve_circuit_transitions_total{{{labels},to="half_open"}} 2' in text
    assert f'pdserve_circuit_transitions_total{{{labels},to="closed"}} 1' in text
    log = server.log()
    assert "circuit breaker error_codes version 1: closed -> open (3 consecutive failures)" in log
    assert (
        "circuit breaker error_codes version 1: half_open -> open (a half-open probe failed)" in log
    )
    assert "circuit breaker error_codes version 1: half_open -> closed" in log


def test_default_breaker_on_other_models(server: ServerProcess) -> None:
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [1.0] * 64}]}
    ).encode()
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/tiny/infer",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    assert 'pdserve_circuit_state{model="tiny",version="2"} 0' in metrics(server)
