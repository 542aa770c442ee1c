"""Each pb_utils.TritonError code of a python model reaches the client unchanged (issue 9).

The model ``tests/data/python_models/error_codes`` fails with the code its MODE
names, in a response, raised out of ``execute``, or relayed from a BLS call; each
is checked through ``tritonclient.http`` (the status Triton's HTTP frontend gives the
code) and ``tritonclient.grpc`` (the gRPC status Triton's gRPC frontend gives it), with
the model's message.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, start_server

DATA = Path(__file__).resolve().parents[1] / "data" / "python_models"

#: TritonError code name -> (HTTP status, gRPC status), as Triton answers them
#: (server ``src/http_server.cc`` HttpCodeFromError, ``src/grpc/grpc_utils.cc``).
EXPECTED = {
    "UNKNOWN": ("400", "StatusCode.UNKNOWN"),
    "INTERNAL": ("500", "StatusCode.INTERNAL"),
    "NOT_FOUND": ("404", "StatusCode.NOT_FOUND"),
    "INVALID_ARG": ("400", "StatusCode.INVALID_ARGUMENT"),
    "UNAVAILABLE": ("503", "StatusCode.UNAVAILABLE"),
    "UNSUPPORTED": ("501", "StatusCode.UNIMPLEMENTED"),
    "ALREADY_EXISTS": ("400", "StatusCode.ALREADY_EXISTS"),
    "CANCELLED": ("400", "StatusCode.CANCELLED"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("error_codes") / "models"
    shutil.copytree(DATA / "error_codes", repo / "error_codes")
    proc = start_server(repo, repo.parent / "pdserve.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url)


@pytest.fixture(scope="module")
def grpc(server: ServerProcess) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def _mode(module: type, mode: str) -> list:
    tensor = module.InferInput("MODE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([mode.encode()], dtype=object))
    return [tensor]


def _message(how: str, name: str) -> str:
    if how == "raise":  # the worker names the instance and the exception
        return f"TritonError: error_codes raises {name}"
    if how == "bls":
        return f"BLS: error_codes responds {name}"
    return f"error_codes responds {name}"


def test_the_model_answers(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    assert http.infer("error_codes", _mode(httpclient, "ok")).as_numpy("OUT").tolist() == [0]
    assert grpc.infer("error_codes", _mode(grpcclient, "ok")).as_numpy("OUT").tolist() == [0]


@pytest.mark.parametrize("how", ["respond", "raise", "bls"])
@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_code_reaches_http_and_grpc_clients(
    http: httpclient.InferenceServerClient,
    grpc: grpcclient.InferenceServerClient,
    name: str,
    how: str,
) -> None:
    http_status, grpc_status = EXPECTED[name]
    message = _message(how, name)
    with pytest.raises(InferenceServerException) as info:
        http.infer("error_codes", _mode(httpclient, f"{how}:{name}"))
    assert info.value.status() == http_status, info.value
    assert message in info.value.message(), info.value
    with pytest.raises(InferenceServerException) as info:
        grpc.infer("error_codes", _mode(grpcclient, f"{how}:{name}"))
    assert info.value.status() == grpc_status, info.value
    assert message in info.value.message(), info.value
    if how == "respond":  # a response's error is the model's message, as it is
        assert info.value.message() == message


def test_a_model_error_counts_as_backend_whatever_its_code(
    server: ServerProcess, http: httpclient.InferenceServerClient
) -> None:
    """A model's error response (here INVALID_ARG, HTTP 400) is a model failure: Triton's
    failure metric counts it as reason BACKEND, not REJECTED (a queue timeout)."""
    import urllib.request

    def failures() -> dict[str, float]:
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("nv_inference_request_failure{") and 'model="error_codes"' in line:
                reason = line.split('reason="')[1].split('"')[0]
                out[reason] = float(line.rsplit(" ", 1)[1])
        return out

    before = failures()
    for _ in range(3):
        with pytest.raises(InferenceServerException) as info:
            http.infer("error_codes", _mode(httpclient, "respond:INVALID_ARG"))
        assert info.value.status() == "400"
    after = failures()
    assert after.get("BACKEND", 0) - before.get("BACKEND", 0) == 3
    assert after.get("REJECTED", 0) == before.get("REJECTED", 0)
