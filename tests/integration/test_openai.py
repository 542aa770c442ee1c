"""The OpenAI-compatible front end end to end: the official ``openai`` client, unchanged
(``base_url`` pointed at pdserve), against a real pdserve with API keys configured,
serving the example ``text_embedding`` pipeline, the example generator
(``examples/generator_repository/text_generator``), a copy of it that ships a
``tokenizer_config.json`` chat template, and ``tiny`` (not an OpenAI model). The tests
that depend on where the routes run (model lists filtered by key, chat templates, model
objects, streaming, cancellation) run on one process and on ``--http-workers 2``; every
error case is checked for OpenAI's exact error shape and status."""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import numpy as np
import openai
import pytest

from tests.conftest import ROOT, ServerProcess, copy_models, start_server
from tests.traffic_keys import sha256_hash

KEY = "openai-test-secret-5e1f"
#: A key that may use text_embedding only.
EMBED_KEY = "openai-embed-only-77c2"
GENERATOR = ROOT / "examples" / "generator_repository" / "text_generator"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def _repository(base: Path) -> tuple[Path, Path]:
    """The model repository and the auth config the servers of this module serve."""
    repo = copy_models(base / "models", "text_embedding", "tokenize", "minilm", "pool", "tiny")
    shutil.copytree(GENERATOR, repo / "text_generator")
    chat = repo / "chat_generator"
    shutil.copytree(GENERATOR, chat)
    config = (chat / "config.pbtxt").read_text()
    (chat / "config.pbtxt").write_text(config.replace('"text_generator"', '"chat_generator"'))
    tokenizer = {"chat_template": TEMPLATE, "bos_token": "<s>"}
    (chat / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    auth = base / "auth.yaml"
    auth.write_text(
        f"keys:\n  - name: app\n    hash: {sha256_hash(KEY)}\n    apis: ['*']\n"
        f"  - name: retrieval\n    hash: {sha256_hash(EMBED_KEY)}\n"
        "    models: [text_embedding]\n    apis: [metadata, inference]\n"
    )
    return repo, auth


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _repository(tmp_path_factory.mktemp("openai"))


@pytest.fixture(scope="module")
def server(repository: tuple[Path, Path]) -> Iterator[ServerProcess]:
    """One process: the HTTP transport in the main process (native, or asgi)."""
    repo, auth = repository
    proc = start_server(repo, repo.parent / "pdserve.log", "--auth-config", str(auth))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def workers_server(repository: tuple[Path, Path]) -> Iterator[ServerProcess]:
    """``--http-workers 2``: the OpenAI routes run in front-end processes that forward
    to the main process (the gate, the models and their files are there)."""
    repo, auth = repository
    proc = start_server(
        repo, repo.parent / "workers.log", "--auth-config", str(auth), "--http-workers", "2"
    )
    yield proc
    proc.stop()


@pytest.fixture(params=["one-process", "http-workers"])
def each_server(request: pytest.FixtureRequest) -> ServerProcess:
    """Each of the module's servers in turn (the same behaviour is expected of both)."""
    name = "server" if request.param == "one-process" else "workers_server"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def _client(server: ServerProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return _client(server)


def _post(server: ServerProcess, path: str, doc: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"http://{server.http_url}{path}", json=doc, headers=headers, timeout=60)


def _v2_embeddings(server: ServerProcess, texts: list[str]) -> np.ndarray:
    doc = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts), 1], "data": texts}]
    }
    r = _post(server, "/v2/models/text_embedding/infer", doc)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.array(out["data"], dtype=np.float32).reshape(out["shape"])


def test_lists_the_models_that_qualify(each_server: ServerProcess) -> None:
    client = _client(each_server)
    ids = [m.id for m in client.models.list()]
    assert ids == ["chat_generator", "text_embedding", "text_generator"]
    model = client.models.retrieve("text_embedding")
    assert (model.id, model.object, model.owned_by) == ("text_embedding", "model", "pdserve")
    assert model.created > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tiny")


# without encoding_format the client asks for base64 and decodes it itself
@pytest.mark.parametrize("fmt", [{"encoding_format": "float"}, {}], ids=["float", "base64"])
def test_embeddings_equal_the_v2_routes(each_server: ServerProcess, fmt: dict) -> None:
    client, server = _client(each_server), each_server
    texts = ["A man is eating food.", "The new movie is awesome.", "pdserve"]
    want = _v2_embeddings(server, texts)
    got = client.embeddings.create(model="text_embedding", input=texts, **fmt)
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == "text_embedding"
    vectors = np.array([d.embedding for d in got.data], dtype=np.float32)
    assert vectors.shape == (3, 384) and np.allclose(vectors, want, atol=1e-6)
    assert got.usage.prompt_tokens == 0 and got.usage.total_tokens == 0
    one = client.embeddings.create(model="text_embedding", input=texts[1], **fmt)
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, want[1], atol=1e-6)


def test_base64_is_little_endian_float32_on_the_wire(server: ServerProcess) -> None:
    r = _post(
        server,
        "/v1/embeddings",
        {"model": "text_embedding", "input": "hello", "encoding_format": "base64"},
    )
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert np.allclose(
        np.frombuffer(raw, dtype="<f4"), _v2_embeddings(server, ["hello"])[0], atol=1e-6
    )


def test_streams_a_chat_completion(each_server: ServerProcess) -> None:
    stream = _client(each_server).chat.completions.create(
        model="text_generator",
        messages=[{"role": "user", "content": "hello big world"}],
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    # the default template: "user: hello big world\nassistant: ", words reversed
    assert pieces == ["assistant:", " world", " big", " hello", " user:"]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_chat_uses_the_models_chat_template(each_server: ServerProcess) -> None:
    reply = _client(each_server).chat.completions.create(
        model="chat_generator", messages=[{"role": "user", "content": "hi there"}]
    )
    # "<s>[user] hi there [assistant]" reversed word by word
    assert reply.choices[0].message.content == "[assistant] there hi <s>[user]"
    assert reply.choices[0].message.role == "assistant"
    assert reply.object == "chat.completion"


def test_completion_stream_and_whole(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="text_generator", prompt="one two three four", max_tokens=2, stream=True
    )
    chunks = list(stream)
    assert [c.choices[0].text for c in chunks] == ["four", " three", ""]
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(
        model="text_generator", prompt="one two three four", stop=[" two"]
    )
    assert whole.choices[0].text == "four three"
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.total_tokens == 0


def test_stream_ends_with_done(server: ServerProcess) -> None:
    doc = {"model": "text_generator", "prompt": "a b", "stream": True}
    r = _post(server, "/v1/completions", doc)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 4


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_client_disconnect_cancels_the_generation(each_server: ServerProcess, chat: bool) -> None:
    """A streaming client that goes away after the first event cancels the request in
    the model (its sender's ``is_cancelled()``), through every transport."""
    server = each_server
    words = " ".join(["w"] * 40)
    slow: dict = {"model": "text_generator", "stream": True, "delay_ms": 200}
    if chat:
        slow["messages"] = [{"role": "user", "content": words}]
    else:
        slow["prompt"] = words
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"http://{server.http_url}{path}", json=slow, headers=headers) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    # the model has one instance: had the 8 s generation gone on, this would wait for it
    start = time.monotonic()
    r = _post(server, "/v1/completions", {"model": "text_generator", "prompt": "quick"})
    assert r.json()["choices"][0]["text"] == "quick"
    assert time.monotonic() - start < 3


def _error(r: httpx.Response, status: int, param: str | None, code: str | None) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["param"], body["error"]["code"]) == (param, code)
    assert body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["message"])


def test_unknown_model_is_404(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    message = _error(
        _post(server, "/v1/embeddings", {"model": "nope", "input": "x"}),
        404,
        "model",
        "model_not_found",
    )
    assert message == "The model `nope` does not exist or you do not have access to it."
    r = _post(
        server,
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    )
    _error(r, 404, "model", "model_not_found")


@pytest.mark.parametrize(
    ("doc", "param", "code"),
    [
        ({"input": [[1, 2, 3]]}, "input", None),  # token ids: the models take text
        ({"input": 42}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ["x"] * 2049}, "input", None),  # over OpenAI's 2048 inputs
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
        ({"input": "x", "dimensions": 128}, "dimensions", None),  # the model does not allow it
        ({"input": "x", "model": "text_generator"}, "model", "model_not_supported"),
    ],
)
def test_bad_embedding_requests_are_400(
    client: openai.OpenAI, server: ServerProcess, doc: dict, param: str, code: str | None
) -> None:
    doc = {"model": "text_embedding", **doc}
    _error(_post(server, "/v1/embeddings", doc), 400, param, code)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(**doc)


def test_bad_completion_requests_are_400(client: openai.OpenAI, server: ServerProcess) -> None:
    r = _post(server, "/v1/completions", {"model": "text_embedding", "prompt": "x"})
    _error(r, 400, "model", "model_not_supported")
    _error(
        _post(server, "/v1/completions", {"model": "text_generator", "prompt": "x", "n": 3}),
        400,
        "n",
        None,
    )
    r = _post(server, "/v1/chat/completions", {"model": "text_generator", "messages": "hi"})
    _error(r, 400, "messages", None)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="text_generator", prompt="x", max_tokens=0)
    r = _post(server, "/v1/completions", {"model": "text_generator", "prompt": "x", "triton_x": 1})
    _error(r, 400, None, None)  # a parameter name reserved for Triton, as on V2


def test_api_key_is_required(server: ServerProcess) -> None:
    r = _post(server, "/v1/embeddings", {"model": "text_embedding", "input": "x"}, key=None)
    _error(r, 401, None, "invalid_api_key")
    assert r.headers["www-authenticate"] == 'Bearer realm="pdserve"'
    r = httpx.get(f"http://{server.http_url}/v1/bogus", timeout=30)
    _error(r, 401, None, "invalid_api_key")  # an unknown route is checked as V2's are
    wrong = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_a_model_scoped_key_sees_and_uses_its_models_only(each_server: ServerProcess) -> None:
    server = each_server
    scoped = _client(server, EMBED_KEY)
    assert [m.id for m in scoped.models.list()] == ["text_embedding"]
    assert len(scoped.embeddings.create(model="text_embedding", input="x").data) == 1
    with pytest.raises(openai.PermissionDeniedError):
        scoped.completions.create(model="text_generator", prompt="x")
    r = _post(server, "/v1/completions", {"model": "text_generator", "prompt": "x"}, EMBED_KEY)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


def _minilm_counts(server: ServerProcess) -> tuple[int, int]:
    r = httpx.get(
        f"http://{server.http_url}/v2/models/minilm/stats",
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    stats = r.json()["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def test_concurrent_embedding_calls_batch_dynamically(server: ServerProcess) -> None:
    """16 concurrent one-sentence calls run through the pipeline's schedulers: the
    predictor (dynamic_batching) runs fewer batches than it got rows."""
    before = _minilm_counts(server)
    doc = {"model": "text_embedding", "input": "The cat sleeps on the warm windowsill."}
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda _: _post(server, "/v1/embeddings", doc), range(16)))
    assert all(r.status_code == 200 for r in replies)
    first = replies[0].json()["data"][0]["embedding"]
    assert all(r.json()["data"][0]["embedding"] == first for r in replies)
    after = _minilm_counts(server)
    rows, batches = after[0] - before[0], after[1] - before[1]
    assert rows == 16 and batches < rows, (rows, batches)


_CHAT = {"model": "text_generator", "messages": [{"role": "user", "content": "x"}]}
_COMPLETION = {"model": "text_generator", "prompt": "x"}
_EMBED = {"model": "text_embedding", "input": "x"}


@pytest.mark.parametrize(
    ("path", "doc", "status", "param", "code"),
    [
        # unknown model, a model not served on these routes, the wrong kind of model
        ("/v1/completions", {**_COMPLETION, "model": "nope"}, 404, "model", "model_not_found"),
        ("/v1/embeddings", {**_EMBED, "model": "tiny"}, 400, "model", "model_not_supported"),
        ("/v1/chat/completions", {**_CHAT, "model": "tiny"}, 400, "model", "model_not_supported"),
        (
            "/v1/chat/completions",
            {**_CHAT, "model": "text_embedding"},
            400,
            "model",
            "model_not_supported",
        ),
        # missing or mistyped fields
        ("/v1/embeddings", {"input": "x"}, 400, "model", None),
        ("/v1/embeddings", {**_EMBED, "model": 42}, 400, "model", None),
        ("/v1/embeddings", {"model": "text_embedding"}, 400, "input", None),
        ("/v1/embeddings", {**_EMBED, "input": ["ok", ""]}, 400, "input", None),
        ("/v1/embeddings", {**_EMBED, "input": ["ok", 3]}, 400, "input", None),
        ("/v1/embeddings", {**_EMBED, "input": {"text": "x"}}, 400, "input", None),
        ("/v1/embeddings", {**_EMBED, "dimensions": -1}, 400, "dimensions", None),
        ("/v1/embeddings", {**_EMBED, "dimensions": "384"}, 400, "dimensions", None),
        ("/v1/embeddings", {**_EMBED, "dimensions": 384.5}, 400, "dimensions", None),
        ("/v1/embeddings", {**_EMBED, "encoding_format": None}, 400, "encoding_format", None),
        ("/v1/completions", {**_COMPLETION, "max_tokens": -5}, 400, "max_tokens", None),
        ("/v1/completions", {**_COMPLETION, "max_tokens": "ten"}, 400, "max_tokens", None),
        (
            "/v1/chat/completions",
            {**_CHAT, "max_completion_tokens": 0},
            400,
            "max_completion_tokens",
            None,
        ),
        ("/v1/completions", {**_COMPLETION, "prompt": []}, 400, "prompt", None),
        ("/v1/completions", {**_COMPLETION, "prompt": ["a", "b"]}, 400, "prompt", None),
        ("/v1/completions", {**_COMPLETION, "prompt": [1, 2]}, 400, "prompt", None),
        ("/v1/completions", {**_COMPLETION, "stream": "yes"}, 400, "stream", None),
        ("/v1/completions", {**_COMPLETION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
        ("/v1/completions", {**_COMPLETION, "temperature": 2.5}, 400, "temperature", None),
        ("/v1/completions", {**_COMPLETION, "top_p": "high"}, 400, "top_p", None),
        ("/v1/completions", {**_COMPLETION, "presence_penalty": -3}, 400, "presence_penalty", None),
        ("/v1/completions", {**_COMPLETION, "seed": 1.5}, 400, "seed", None),
        ("/v1/completions", {**_COMPLETION, "logprobs": 2}, 400, "logprobs", None),
        ("/v1/completions", {**_COMPLETION, "echo": True}, 400, "echo", None),
        ("/v1/chat/completions", {**_CHAT, "messages": []}, 400, "messages", None),
        ("/v1/chat/completions", {**_CHAT, "messages": [{"content": "x"}]}, 400, "messages", None),
        (
            "/v1/chat/completions",
            {**_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0].content",
            None,
        ),
        ("/v1/chat/completions", {**_CHAT, "tools": [{"type": "function"}]}, 400, "tools", None),
        (
            "/v1/chat/completions",
            {**_CHAT, "response_format": {"type": "json_object"}},
            400,
            "response_format",
            None,
        ),
    ],
)
def test_bad_requests_get_openais_error_shape(
    server: ServerProcess, path: str, doc: dict, status: int, param: str | None, code: str | None
) -> None:
    _error(_post(server, path, doc), status, param, code)


def test_malformed_bodies_and_wrong_methods_get_openais_error_shape(
    server: ServerProcess,
) -> None:
    url = f"http://{server.http_url}"
    auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    for body in (b"{not json", b"[1, 2]", b'"text"'):
        r = httpx.post(f"{url}/v1/embeddings", content=body, headers=auth, timeout=30)
        _error(r, 400, None, None)
    r = httpx.get(f"{url}/v1/embeddings", headers=auth, timeout=30)
    _error(r, 405, None, None)
    assert r.headers["allow"] == "POST"
    r = httpx.post(f"{url}/v1/models", headers=auth, timeout=30)
    _error(r, 405, None, None)
    _error(
        httpx.get(f"{url}/v1/models/nope", headers=auth, timeout=30),
        404,
        "model",
        "model_not_found",
    )
    _error(httpx.get(f"{url}/v1/bogus", headers=auth, timeout=30), 404, None, "unknown_url")


def test_a_model_error_keeps_openais_shape(server: ServerProcess) -> None:
    """The model fails on a parameter it cannot read: a 500 ``server_error`` in
    OpenAI's shape (a model's failure, not a bad request to the front end), and the
    server carries on."""
    r = _post(server, "/v1/completions", {**_COMPLETION, "delay_ms": "soon"})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and "soon" in error["message"]
    assert _post(server, "/v1/completions", _COMPLETION).json()["choices"][0]["text"] == "x"
