"""Extension details clients depend on, each as Triton's server answers it, against a
real pdserve on the example models with real clients (tritonclient gRPC / HTTP and
requests, which Triton's own generate tests use).

- gRPC ``ModelStreamInfer``: ``triton_final_response`` on every stream response
  (``src/grpc/stream_infer_handler.cc``), for ``tiny`` and the decoupled
  ``document_stream``, with and without ``enable_empty_final_response``;
- ``/generate`` and ``/generate_stream``: the request ``id`` echoed, outputs top-level
  and flat, a model that sends other than one response an error on ``/generate``;
- the response cache: a hit counts in ``success``, ``queue`` and ``cache_hit``, never
  in ``inference_count`` or ``execution_count`` (docs/protocol/extension_statistics.md);
- ``Inference-Header-Content-Length`` past the body: 400, the server carries on.

Shared-memory regions (unknown region: 404 / NOT_FOUND; CUDA status and unregister
without GPUs) are in ``test_shared_memory.py``.
"""

from __future__ import annotations

import json
import queue
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import EXAMPLE_REPO, ServerProcess, copy_models, start_server

FINAL = "triton_final_response"
#: Two sentences: document_stream sends two responses, then the final flag alone.
TWO = "Streaming is useful. Each sentence comes back alone!"
NOT_ONE = (
    "generate expects model to produce exactly 1 response, use generate stream for model "
    "that generates various number of responses"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """tiny, tiny_cached (tiny with ``response_cache``) and the document_stream pipeline."""
    repo = copy_models(
        tmp_path_factory.mktemp("ext") / "models",
        "tiny",
        "document_stream",
        "text_embedding",
        "tokenize",
        "minilm",
        "pool",
    )
    cached = repo / "tiny_cached"
    shutil.copytree(EXAMPLE_REPO / "tiny", cached)
    config = (cached / "config.pbtxt").read_text().replace('name: "tiny"', 'name: "tiny_cached"')
    (cached / "config.pbtxt").unlink()
    (cached / "config.pbtxt").write_text(config + "\nresponse_cache { enable: true }\n")
    proc = start_server(repo, repo.parent / "pdserve.log", "--cache-config", "local,size=1048576")
    yield proc
    proc.stop()


def _tiny_input(mod: Any, x: np.ndarray) -> Any:
    inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def _document(text: str) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("document", [1], "BYTES")
    inp.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return inp


def _stream(
    server: ServerProcess, model: str, inputs: list[Any], empty_final: bool, count: int
) -> list[tuple[Any, Any]]:
    """``count`` (result, error) pairs of one request on a gRPC stream; then checks that
    nothing more comes (a second wait would see an extra response)."""
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer(
            model, inputs, request_id="s1", enable_empty_final_response=empty_final
        )
        items = [got.get(timeout=60) for _ in range(count)]
        with pytest.raises(queue.Empty):
            got.get(timeout=1.0)
        return items
    finally:
        client.stop_stream()
        client.close()


def _params(result: Any) -> dict[str, Any]:
    """A stream response's parameters, as set (a bool parameter as a bool)."""
    params = result.get_response().parameters
    return {k: getattr(v, str(v.WhichOneof("parameter_choice"))) for k, v in params.items()}


# ------------------------------------------------------------------ ModelStreamInfer


@pytest.mark.parametrize("empty_final", [False, True])
def test_stream_response_of_a_non_decoupled_model_is_final(
    server: ServerProcess, empty_final: bool
) -> None:
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    [(result, error)] = _stream(server, "tiny", [_tiny_input(grpcclient, x)], empty_final, count=1)
    assert error is None
    assert result.get_response().id == "s1"
    assert _params(result) == {FINAL: True}  # set as a bool_param, true
    direct = httpclient.InferenceServerClient(server.http_url).infer(
        "tiny", [_tiny_input(httpclient, x)]
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), direct.as_numpy("OUTPUT0"))


def test_stream_responses_of_a_decoupled_model_without_empty_final(
    server: ServerProcess,
) -> None:
    """Triton: the parameter on every response, false on each one sent (the final flag
    that follows alone sends nothing when empty final responses were not asked for)."""
    items = _stream(server, "document_stream", [_document(TWO)], False, count=2)
    assert [e for _, e in items] == [None, None]
    assert [int(r.as_numpy("index")[0]) for r, _ in items] == [0, 1]
    assert [_params(r) for r, _ in items] == [{FINAL: False}, {FINAL: False}]


def test_stream_responses_of_a_decoupled_model_with_empty_final(server: ServerProcess) -> None:
    items = _stream(server, "document_stream", [_document(TWO)], True, count=3)
    assert [e for _, e in items] == [None, None, None]
    assert [_params(r)[FINAL] for r, _ in items] == [False, False, True]
    empty = items[2][0].get_response()
    assert len(empty.outputs) == 0 and empty.id == "s1"
    assert empty.model_name == "document_stream" and empty.model_version == "1"


# ------------------------------------------------------------------ generate extension


def _generate(server: ServerProcess, model: str, doc: dict[str, Any], stream: bool = False) -> Any:
    action = "generate_stream" if stream else "generate"
    url = f"http://{server.http_url}/v2/models/{model}/{action}"
    return requests.post(url, data=json.dumps(doc), timeout=60)


def test_generate_echoes_the_id_and_puts_outputs_top_level_and_flat(
    server: ServerProcess,
) -> None:
    x = np.linspace(0, 1, 64, dtype=np.float32)
    expected = (
        httpclient.InferenceServerClient(server.http_url)
        .infer("tiny", [_tiny_input(httpclient, x.reshape(1, 64))])
        .as_numpy("OUTPUT0")
    )
    r = _generate(server, "tiny", {"id": "42", "INPUT0": x.tolist()})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert sorted(doc) == ["OUTPUT0", "id", "model_name", "model_version"]
    assert (doc["id"], doc["model_name"], doc["model_version"]) == ("42", "tiny", "2")
    # a [1, 64] output: a flat array of 64 numbers, as Triton's WriteDataToJson writes it
    assert len(doc["OUTPUT0"]) == 64 and all(type(v) is float for v in doc["OUTPUT0"])
    np.testing.assert_allclose(doc["OUTPUT0"], expected.reshape(-1), rtol=1e-6)
    # no id, or an empty one: no id field (Triton's generate tests)
    assert "id" not in _generate(server, "tiny", {"INPUT0": x.tolist()}).json()
    assert "id" not in _generate(server, "tiny", {"id": "", "INPUT0": x.tolist()}).json()
    r = _generate(server, "tiny", {"id": 42, "INPUT0": x.tolist()})
    assert r.status_code == 400 and "Unable to parse 'id'" in r.json()["error"]
    # generate_stream: the same object as one SSE event
    r = _generate(server, "tiny", {"id": "43", "INPUT0": x.tolist()}, stream=True)
    assert r.status_code == 200
    events = [json.loads(c[6:]) for c in r.text.split("\n\n") if c.startswith("data: ")]
    assert len(events) == 1 and events[0]["id"] == "43" and len(events[0]["OUTPUT0"]) == 64


def test_generate_on_a_model_that_sends_one_response(server: ServerProcess) -> None:
    r = _generate(server, "document_stream", {"id": "d1", "document": "Just one sentence."})
    assert r.status_code == 200
    doc = r.json()
    assert doc["id"] == "d1" and doc["sentence"] == "Just one sentence." and doc["index"] == 0
    assert len(doc["embedding"]) == 384


def test_generate_on_a_model_that_sends_several_responses_is_an_error(
    server: ServerProcess,
) -> None:
    """Triton's answer (its message; the status the error's code gives: see
    ``pdserve.frontends.http.generate.not_one_response``), never one response of them."""
    r = _generate(server, "document_stream", {"id": "d2", "document": TWO})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    message = r.json()["error"]
    assert message.startswith(NOT_ONE) and "sent 2 response(s)" in message
    # generate_stream sends them all, and the server carries on
    r = _generate(server, "document_stream", {"id": "d3", "document": TWO}, stream=True)
    events = [json.loads(c[6:]) for c in r.text.split("\n\n") if c.startswith("data: ")]
    assert [(e["id"], e["index"]) for e in events] == [("d3", 0), ("d3", 1)]
    # no response at all (an empty document: the final flag alone): the same error on
    # /generate (Triton's test_zero_response); an event stream without events
    r = _generate(server, "document_stream", {"document": ""})
    assert r.status_code == 500
    assert r.json()["error"] == f"{NOT_ONE} (the model sent 0 response(s))"
    r = _generate(server, "document_stream", {"document": ""}, stream=True)
    assert r.status_code == 200 and r.text == ""
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"


# ------------------------------------------------------------------ statistics


def test_a_cache_hit_is_not_an_inference(server: ServerProcess) -> None:
    """extension_statistics.md: "The 'inference_count' value DOES NOT include cache
    hits" (nor ``execution_count``); ``success`` and ``queue`` do; compute_* do not."""
    h = httpclient.InferenceServerClient(server.http_url)
    x = np.full((1, 64), 0.25, dtype=np.float32)
    first = h.infer("tiny_cached", [_tiny_input(httpclient, x)]).as_numpy("OUTPUT0")
    second = h.infer("tiny_cached", [_tiny_input(httpclient, x)]).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(first, second)
    stats = h.get_inference_statistics("tiny_cached")["model_stats"][0]
    inf = stats["inference_stats"]
    assert (stats["inference_count"], stats["execution_count"]) == (1, 1)
    assert inf["success"]["count"] == 2 and inf["queue"]["count"] == 2
    assert (inf["cache_hit"]["count"], inf["cache_miss"]["count"]) == (1, 1)
    assert inf["compute_infer"]["count"] == 1 and inf["fail"]["count"] == 0
    g = grpcclient.InferenceServerClient(server.grpc_url)
    gs = g.get_inference_statistics("tiny_cached").model_stats[0]
    assert (gs.inference_count, gs.execution_count) == (1, 1)
    assert gs.inference_stats.success.count == 2 and gs.inference_stats.cache_hit.count == 1


# ------------------------------------------------------------------ binary data extension


def test_an_inference_header_length_past_the_body_is_a_bad_request(
    server: ServerProcess,
) -> None:
    """Triton (``GetInferenceHeaderLength``): 400, "inference header size should be in
    range (0, <content length>), got: <value>" -- not 413, however large."""
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]}
    ).encode()
    url = f"http://{server.http_url}/v2/models/tiny/infer"
    with requests.Session() as session:  # one connection: it stays usable
        for announced in (len(body) + 1, 1 << 30):
            r = session.post(
                url, data=body, headers={"Inference-Header-Content-Length": str(announced)}
            )
            assert r.status_code == 400
            assert r.json() == {
                "error": f"inference header size should be in range (0, {len(body)}), "
                f"got: {announced}"
            }
        r = session.post(url, data=body)
        assert r.status_code == 200 and len(r.json()["outputs"][0]["data"]) == 64
