"""Decoupled models (issue 15 item 1): responses streamed over gRPC ``ModelStreamInfer``
and HTTP ``generate`` / ``generate_stream`` (SSE), and the faults of such a model.

The model ``tests/data/python_models/decoupled_repeat`` sends one response per element
of ``IN``; its request parameter ``mode`` picks a fault (see its model.py). Every test
talks to a real pdserve with a real client (tritonclient.grpc streams, httpx for SSE).
"""

from __future__ import annotations

import http.client
import json
import queue
import shutil
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, copy_models, start_server

DATA = Path(__file__).resolve().parents[1] / "data" / "python_models"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODEL = "decoupled_repeat"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("decoupled") / "models"
    for name in (MODEL, "identity", "decoupled_bls", "double_int", "decoupled_ens"):
        shutil.copytree(DATA / name, repo / name)
    proc = start_server(repo, repo.parent / "pdserve.log")
    yield proc
    proc.stop()


def _inputs(values: list[int]) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("IN", [len(values)], "INT32")
    inp.set_data_from_numpy(np.array(values, dtype=np.int32))
    return [inp]


def stream(
    server: ServerProcess,
    values: list[int],
    *,
    empty_final: bool = True,
    timeout_s: float = 30.0,
    request_id: str = "r1",
    **params: Any,
) -> list[tuple[Any, Any]]:
    """One request on a gRPC stream: every (result, error) until the final flag (with
    ``empty_final``) or until ``timeout_s`` passes without a response (3 s once an error
    came: a client cannot read the final flag an error carries)."""
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    request_timeout = params.pop("timeout", None)
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer(
            MODEL,
            _inputs(values),
            request_id=request_id,
            parameters=params or None,
            enable_empty_final_response=empty_final,
            timeout=request_timeout,
        )
        items = []
        while True:
            try:
                result, error = got.get(timeout=timeout_s)
            except queue.Empty:
                break
            items.append((result, error))
            if error is not None:
                timeout_s = min(timeout_s, 3.0)
            if empty_final:
                final = (
                    result.get_response().parameters["triton_final_response"].bool_param
                    if result is not None
                    else False
                )
                if final or (error is not None and "Request timeout" in str(error)):
                    break
        return items
    finally:
        client.stop_stream()
        client.close()


def _final(result: Any) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def test_grpc_stream_repeats_each_element_then_empty_final(server: ServerProcess) -> None:
    items = stream(server, [5, 6, 7])
    assert [e for _, e in items] == [None] * 4
    results = [r for r, _ in items]
    assert [int(r.as_numpy("OUT")[0]) for r in results[:3]] == [5, 6, 7]
    assert [int(r.as_numpy("IDX")[0]) for r in results[:3]] == [0, 1, 2]
    assert [_final(r) for r in results] == [False, False, False, True]
    empty = results[3].get_response()
    assert len(empty.outputs) == 0 and empty.id == "r1" and empty.model_name == MODEL
    assert all(r.get_response().id == "r1" for r in results)


def test_grpc_stream_without_empty_final_sends_only_responses(server: ServerProcess) -> None:
    items = stream(server, [1, 2], empty_final=False, timeout_s=3.0)
    assert [int(r.as_numpy("OUT")[0]) for r, _ in items] == [1, 2]
    # as Triton: the parameter is on every response; the final flag sent alone is not
    assert all("triton_final_response" in r.get_response().parameters for r, _ in items)
    assert [_final(r) for r, _ in items] == [False, False]


def test_grpc_final_flag_on_last_response(server: ServerProcess) -> None:
    items = stream(server, [3, 4], final_alone=False)
    results = [r for r, _ in items]
    assert [int(r.as_numpy("OUT")[0]) for r in results] == [3, 4]
    assert [_final(r) for r in results] == [False, True]


def test_grpc_zero_responses_only_final(server: ServerProcess) -> None:
    items = stream(server, [])
    assert len(items) == 1 and items[0][1] is None
    assert _final(items[0][0]) and len(items[0][0].get_response().outputs) == 0


def test_grpc_responses_from_a_thread(server: ServerProcess) -> None:
    items = stream(server, [9, 8, 7], mode="thread", delay_ms=20)
    assert [int(r.as_numpy("OUT")[0]) for r, _ in items[:3]] == [9, 8, 7]
    assert _final(items[-1][0])


def test_grpc_model_raises_after_some_responses(server: ServerProcess) -> None:
    items = stream(server, [1, 2], mode="raise_after")
    assert [int(r.as_numpy("OUT")[0]) for r, _ in items[:2]] == [1, 2]
    result, error = items[2]
    assert result is None and "boom after 2 responses" in str(error)
    assert "ValueError" in str(error)
    assert len(items) == 3  # the error is the final outcome
    # the worker survived
    assert [int(r.as_numpy("OUT")[0]) for r, _ in stream(server, [4])[:1]] == [4]


def test_send_after_final_raises_in_the_model(server: ServerProcess) -> None:
    items = stream(server, [], mode="after_final")
    assert len(items) == 1 and int(items[0][0].as_numpy("OUT")[0]) == 7
    assert _final(items[0][0])
    (result, error), *_ = stream(server, [], mode="last_error")
    assert "Unable to send response. Response sender has been closed." in str(error)


def test_never_final_is_bounded_by_the_request_timeout(server: ServerProcess) -> None:
    start = time.monotonic()
    items = stream(server, [1, 2], mode="never_final", timeout=1_500_000, timeout_s=20.0)
    assert time.monotonic() - start < 15
    assert [int(r.as_numpy("OUT")[0]) for r, _ in items[:2]] == [1, 2]
    assert items[-1][0] is None and "Request timeout expired" in str(items[-1][1])
    assert [int(r.as_numpy("OUT")[0]) for r, _ in stream(server, [3])[:1]] == [3]


def test_undeclared_output_is_an_error(server: ServerProcess) -> None:
    items = stream(server, [], mode="bad_output")
    # the worker drops outputs nobody asked for (as Triton); the requested ones are missing
    assert items[0][0] is None and "did not return requested output 'OUT'" in str(items[0][1])
    assert len(items) == 1


def test_plain_infer_on_decoupled_model_is_refused(server: ServerProcess) -> None:
    http = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([1], dtype=np.int32))
    with pytest.raises(InferenceServerException) as err:
        http.infer(MODEL, [inp])
    assert err.value.status() == "501" and "decoupled" in err.value.message()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        grpc.infer(MODEL, _inputs([1]))
    assert err.value.status() == "StatusCode.UNIMPLEMENTED" and "generate_stream" in str(err.value)


def test_stream_to_a_normal_model_still_one_response(server: ServerProcess) -> None:
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
    client.async_stream_infer("identity", [inp], request_id="n")
    result, error = got.get(timeout=30)
    client.stop_stream()
    assert error is None and result.as_numpy("OUTPUT0").tolist() == [[0, 1, 2, 3]]
    assert _final(result)  # its one response is its last (the parameter set, true)


# --------------------------------------------------------------------------- HTTP generate


def _post(server: ServerProcess, path: str, doc: dict[str, Any]) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("POST", path, body=json.dumps(doc), headers={"content-type": "application/json"})
    return conn.getresponse()


def _events(resp: http.client.HTTPResponse) -> list[dict[str, Any]]:
    """Every SSE ``data:`` event of a whole response body."""
    body = resp.read().decode()
    return [json.loads(chunk[6:]) for chunk in body.split("\n\n") if chunk.startswith("data: ")]


def test_generate_stream_sends_one_sse_event_per_response(server: ServerProcess) -> None:
    resp = _post(server, f"/v2/models/{MODEL}/generate_stream", {"IN": [5, 6, 7]})
    assert resp.status == 200
    assert resp.getheader("content-type") == "text/event-stream; charset=utf-8"
    events = _events(resp)
    assert events == [
        {"model_name": MODEL, "model_version": "1", "OUT": v, "IDX": i}
        for i, v in enumerate([5, 6, 7])
    ]  # the empty final response sends no event


def test_generate_answers_one_json_response(server: ServerProcess) -> None:
    resp = _post(server, f"/v2/models/{MODEL}/versions/1/generate", {"IN": 4})
    assert resp.status == 200 and resp.getheader("content-type") == "application/json"
    assert json.loads(resp.read()) == {
        "model_name": MODEL,
        "model_version": "1",
        "OUT": 4,
        "IDX": 0,
    }
    # a model that is not decoupled answers through generate too
    resp = _post(server, "/v2/models/identity/generate", {"INPUT0": [1.5, 2.5]})
    doc = json.loads(resp.read())
    assert resp.status == 200 and doc["OUTPUT0"] == [1.5, 2.5]  # flat, as Triton


def test_generate_stream_error_after_responses_is_an_event(server: ServerProcess) -> None:
    resp = _post(
        server,
        f"/v2/models/{MODEL}/generate_stream",
        {"IN": [1, 2], "parameters": {"mode": "raise_after"}},
    )
    assert resp.status == 200
    events = _events(resp)
    assert [e["OUT"] for e in events[:2]] == [1, 2]
    assert "boom after 2 responses" in events[2]["error"] and len(events) == 3


def test_generate_errors_before_the_first_response_have_a_status(server: ServerProcess) -> None:
    resp = _post(server, "/v2/models/nope/generate_stream", {"IN": [1]})
    assert resp.status == 404 and "error" in json.loads(resp.read())
    resp = _post(server, f"/v2/models/{MODEL}/generate_stream", {"IN": [], "mode": "raise_after"})
    assert resp.status == 500 and "boom after 0" in json.loads(resp.read())["error"]
    resp = _post(server, f"/v2/models/{MODEL}/generate", {"IN": ["x"]})
    assert resp.status == 400 and "INT32" in json.loads(resp.read())["error"]
    resp = _post(
        server,
        f"/v2/models/{MODEL}/generate",
        {"IN": [1], "mode": "never_final", "timeout": 500000},
    )
    # a response, then the timeout: not exactly one response (Triton's message)
    message = json.loads(resp.read())["error"]
    assert resp.status == 500 and message.startswith("generate expects model to produce exactly 1")
    assert "sent 1 response(s) and 1 error(s), the first: Request timeout expired" in message


def test_sse_client_disconnect_mid_stream_cancels_the_request(server: ServerProcess) -> None:
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    body = json.dumps({"IN": [0], "parameters": {"mode": "until_cancelled", "delay_ms": 20}})
    sock.sendall(
        f"POST /v2/models/{MODEL}/generate_stream HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(65536)
    assert b" 200 " in received.split(b"\r\n")[0]
    sock.close()  # mid-stream
    deadline = time.monotonic() + 20
    message = ""
    while time.monotonic() < deadline:
        message = (
            _post(server, f"/v2/models/{MODEL}/generate", {"IN": [0], "mode": "last_error"})
            .read()
            .decode()
        )
        if "cancelled after" in message:
            break
        time.sleep(0.2)
    assert "cancelled after" in message  # the model saw is_cancelled() and ended
    assert [int(r.as_numpy("OUT")[0]) for r, _ in stream(server, [11])[:1]] == [11]


def test_grpc_client_disconnect_mid_stream(server: ServerProcess) -> None:
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer(
        MODEL, _inputs([0]), parameters={"mode": "until_cancelled", "delay_ms": 20}
    )
    for _ in range(3):
        result, error = got.get(timeout=30)
        assert error is None
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 20
    message = ""
    while time.monotonic() < deadline and "cancelled after" not in message:
        message = str(stream(server, [], mode="last_error")[0][1])
        time.sleep(0.2)
    assert "cancelled after" in message
    # other requests and the worker carry on
    assert [int(r.as_numpy("OUT")[0]) for r, _ in stream(server, [12, 13])[:2]] == [12, 13]


# --------------------------------------------------------------------------- BLS


def _bls(server: ServerProcess, values: list[int], mode: str = "repeat") -> Any:
    http = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("IN", [len(values)], "INT32")
    inp.set_data_from_numpy(np.array(values, dtype=np.int32))
    return http.infer("decoupled_bls", [inp], parameters={"mode": mode})


def test_bls_exec_decoupled_iterates_every_response(server: ServerProcess) -> None:
    result = _bls(server, [4, 5, 6])
    assert result.as_numpy("VALUES").tolist() == [4, 5, 6]
    assert result.as_numpy("EMPTY").tolist() == [1]  # the empty final response, as Triton
    result = _bls(server, [3], mode="thread")
    assert result.as_numpy("VALUES").tolist() == [3]


def test_bls_exec_decoupled_relays_the_targets_error(server: ServerProcess) -> None:
    with pytest.raises(InferenceServerException) as err:
        _bls(server, [1, 2], mode="raise_after")
    assert "relayed:" in err.value.message() and "boom after 2 responses" in err.value.message()
    assert _bls(server, [8]).as_numpy("VALUES").tolist() == [8]


# --------------------------------------------------------------------------- ensembles


def test_decoupled_ensemble_feeds_each_response_downstream(server: ServerProcess) -> None:
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer(
        "decoupled_ens", _inputs([3, 4, 5]), request_id="e", enable_empty_final_response=True
    )
    items = []
    while True:
        result, error = got.get(timeout=30)
        assert error is None
        items.append(result)
        if _final(result):
            break
    client.stop_stream()
    assert [int(r.as_numpy("Y")[0]) for r in items[:3]] == [6, 8, 10]
    assert [int(r.as_numpy("IDX")[0]) for r in items[:3]] == [0, 1, 2]
    assert len(items) == 4 and len(items[3].get_response().outputs) == 0
    assert all(r.get_response().model_name == "decoupled_ens" for r in items)


def test_decoupled_ensemble_step_error_ends_the_stream(server: ServerProcess) -> None:
    resp = _post(
        server,
        "/v2/models/decoupled_ens/generate_stream",
        {"IN": [1, 2], "parameters": {"mode": "raise_after"}},
    )
    events = _events(resp)
    assert [e["Y"] for e in events[:2]] == [2, 4]
    assert "boom after 2 responses" in events[2]["error"] and len(events) == 3


def _failures(server: ServerProcess, model: str, reason: str) -> float:
    """``nv_inference_request_failure`` of ``model`` with ``reason`` (0 when absent)."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("nv_inference_request_failure{")
        and f'model="{model}"' in line
        and f'reason="{reason}"' in line
    )


def test_a_failed_decoupled_ensemble_request_counts_as_any_ensemble_failure(
    server: ServerProcess,
) -> None:
    """Every failure of an ensemble counts with reason OTHER (pdserve.core.stats), on the
    decoupled path as on the normal one: a step's BACKEND error is not the ensemble's."""
    before = _failures(server, "decoupled_ens", "OTHER")
    resp = _post(
        server,
        "/v2/models/decoupled_ens/generate_stream",
        {"IN": [1, 2], "parameters": {"mode": "raise_after"}},
    )
    assert "boom after 2 responses" in _events(resp)[-1]["error"]
    assert _failures(server, "decoupled_ens", "OTHER") == before + 1
    assert _failures(server, "decoupled_ens", "BACKEND") == 0


# --------------------------------------------------------------------------- the example


@pytest.fixture(scope="module")
def document_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The text pipeline of the example repository plus the document_stream example from
    its source folder (examples/pipelines/; build_pipelines.py installs it too)."""
    repo = copy_models(
        tmp_path_factory.mktemp("document_stream") / "models",
        "text_embedding",
        "tokenize",
        "minilm",
        "pool",
    )
    shutil.copytree(EXAMPLES / "pipelines" / "document_stream", repo / "document_stream")
    proc = start_server(repo, repo.parent / "pdserve.log")
    yield proc
    proc.stop()


def test_example_document_stream_sends_one_embedding_per_sentence(
    document_server: ServerProcess,
) -> None:
    """examples/pipelines/document_stream: each sentence's embedding, in order, equal to
    the text_embedding pipeline's for that sentence."""
    doc = "Streaming is useful. Each sentence comes back alone!   Is this the last one?"
    sentences = ["Streaming is useful.", "Each sentence comes back alone!", "Is this the last one?"]
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(document_server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    inp = grpcclient.InferInput("document", [1], "BYTES")
    inp.set_data_from_numpy(np.array([doc.encode()], dtype=object))
    client.async_stream_infer("document_stream", [inp], enable_empty_final_response=True)
    results = []
    while True:
        result, error = got.get(timeout=60)
        assert error is None
        if _final(result):
            break
        results.append(result)
    client.stop_stream()
    assert [r.as_numpy("sentence")[0].decode() for r in results] == sentences
    assert [int(r.as_numpy("index")[0]) for r in results] == [0, 1, 2]
    http = httpclient.InferenceServerClient(document_server.http_url)
    for sentence, r in zip(sentences, results, strict=True):
        emb = r.as_numpy("embedding")
        assert emb.shape == (384,) and abs(float(np.linalg.norm(emb)) - 1.0) < 1e-4
        text = httpclient.InferInput("text", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[sentence.encode()]], dtype=object))
        direct = http.infer("text_embedding", [text]).as_numpy("embedding")[0]
        np.testing.assert_allclose(emb, direct, atol=1e-5)
