"""Batching requests of different lengths (issue 16 item 3) in a real pdserve.

The example ``text_embedding`` pipeline (tokenize -> minilm -> pool) with ``minilm``'s
``padding`` policy (buckets 16..256): real sentences of mixed length, sent together,
give the embeddings of unpadded single requests (cosine >= 0.9999), and ``minilm``'s
statistics show they ran in batches. ``minilm_plain`` (the same model file, no
policy) gives the unpadded references. Bad input: padded inputs of different lengths
(400), requests longer than every bucket (served unpadded), and configurations that
do not load (padding a fixed dimension, a pad value of the wrong datatype).
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, ServerProcess, copy_models, start_server

#: Sentences of mixed length (4 to 60-odd word pieces): the example goldens' and
#: scikit-learn's dataset descriptions'.
SENTENCES = [
    b"Cats sleep.",
    b"A man is playing a guitar on stage.",
    b"The cat sleeps on the warm windowsill.",
    b"Someone performs music with a guitar in front of an audience.",
    b"This reduces dimensionality and gives invariance to small distortions.",
    b"Quarterly revenue grew by twelve percent.",
    b"An alternative task, Face Recognition or Face Identification is: given the picture "
    b"of the face of an unknown person, identify the name of the person by referring to a "
    b"gallery of previously seen pictures of identified persons.",
    b"The data set contains 3 classes of 50 instances each, where each class refers to a "
    b"type of iris plant. One class is linearly separable from the other 2; the latter are "
    b"NOT linearly separable from each other.",
    b"Ok.",
    b"The target variable is the median house value for California districts, expressed in "
    b"hundreds of thousands of dollars.",
]


def _strip_padding(config: str) -> str:
    """``config`` without its ``padding`` parameter block."""
    return re.sub(r'parameters \{\s*key: "padding".*?\}\s*\}\n', "", config, flags=re.S)


def _variant(repo: Path, src: str, name: str, config: str) -> None:
    """Model ``name``: ``src``'s version folder (linked, not copied) with ``config``."""
    (repo / name).mkdir()
    (repo / name / "1").symlink_to((repo / src / "1").resolve(), target_is_directory=True)
    (repo / name / "config.pbtxt").write_text(config.replace(f'name: "{src}"', f'name: "{name}"'))


def _set_padding(config: str, policy: str) -> str:
    return _strip_padding(config) + (
        f'parameters {{ key: "padding" value: {{ string_value: "{policy}" }} }}\n'
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("padding")
    repo = copy_models(tmp / "repo", "tokenize", "minilm", "pool", "text_embedding", "tiny")
    minilm = (repo / "minilm" / "config.pbtxt").read_text()
    assert 'key: "padding"' in minilm  # the example ships the policy
    # A queue delay, so that concurrent requests meet in minilm's queue whatever the
    # machine's speed (the example's `dynamic_batching { }` batches only what queues
    # while an execution runs, which on a quiet machine may be nothing).
    assert "dynamic_batching { }" in minilm
    minilm = minilm.replace(
        "dynamic_batching { }", "dynamic_batching { max_queue_delay_microseconds: 50000 }"
    )
    (repo / "minilm" / "config.pbtxt").write_text(minilm)
    _variant(repo, "minilm", "minilm_plain", _strip_padding(minilm))
    ids3 = "inputs=input_ids:0:0, attention_mask:0:0, token_type_ids:0:0"
    # buckets smaller than some requests: those are served unpadded
    _variant(
        repo,
        "minilm",
        "minilm_small",
        _set_padding(minilm, f"{ids3}; outputs=token_embeddings:0; pad_to=8,16"),
    )
    # a pad value of the wrong datatype: 0.5 for INT64 token ids
    _variant(
        repo,
        "minilm",
        "minilm_float_pad",
        _set_padding(minilm, "inputs=input_ids:0:0.5; pad_to=max"),
    )
    # padding asked for an input without a variable dimension (INPUT0 is [64])
    tiny = (repo / "tiny" / "config.pbtxt").read_text()
    _variant(
        repo,
        "tiny",
        "tiny_fixed_pad",
        tiny + 'dynamic_batching { }\nparameters { key: "padding" value: { string_value: '
        '"inputs=INPUT0:0:0; pad_to=max" } }\n',
    )
    srv = start_server(repo, tmp / "pdserve.log")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, concurrency=32, network_timeout=120)


def _stats(server: ServerProcess, model: str) -> dict:
    url = f"http://{server.http_url}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)["model_stats"][0]


def _text(sentence: bytes) -> list[httpclient.InferInput]:
    tensor = httpclient.InferInput("text", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[sentence]], dtype=object))
    return [tensor]


def _tokens(client: httpclient.InferenceServerClient, sentence: bytes) -> dict[str, np.ndarray]:
    """The tokenize step alone: ids, mask, type ids of the sentence's own length."""
    r = client.infer("tokenize", _text(sentence))
    return {n: r.as_numpy(n) for n in ("input_ids", "attention_mask", "token_type_ids")}


def _token_inputs(tokens: dict[str, np.ndarray]) -> list[httpclient.InferInput]:
    out = []
    for name, arr in tokens.items():
        t = httpclient.InferInput(name, list(arr.shape), "INT64")
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _reference(client: httpclient.InferenceServerClient, sentence: bytes) -> tuple:
    """An unpadded single request: tokenize -> minilm_plain -> pool, one at a time."""
    tokens = _tokens(client, sentence)
    emb = client.infer("minilm_plain", _token_inputs(tokens)).as_numpy("token_embeddings")
    t = httpclient.InferInput("token_embeddings", list(emb.shape), "FP32")
    t.set_data_from_numpy(emb)
    m = httpclient.InferInput("attention_mask", list(tokens["attention_mask"].shape), "INT64")
    m.set_data_from_numpy(tokens["attention_mask"])
    pooled = client.infer("pool", [t, m]).as_numpy("embedding")[0]
    return tokens, emb, pooled


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def references(client: httpclient.InferenceServerClient) -> list[tuple]:
    return [_reference(client, s) for s in SENTENCES]


def test_the_sentences_have_mixed_lengths(references: list[tuple]) -> None:
    lengths = sorted(tokens["input_ids"].shape[1] for tokens, _, _ in references)
    assert lengths[0] <= 8 and lengths[-1] > 40, lengths
    buckets = {next(b for b in (16, 32, 64, 128, 256) if b >= n) for n in lengths}
    assert len(buckets) >= 3, lengths


def test_mixed_lengths_through_text_embedding_match_unpadded_single_requests(
    server: ServerProcess, client: httpclient.InferenceServerClient, references: list[tuple]
) -> None:
    rounds = 4
    pending = [
        (i, client.async_infer("text_embedding", _text(s)))
        for _ in range(rounds)
        for i, s in enumerate(SENTENCES)
    ]
    for i, p in pending:
        got = p.get_result().as_numpy("embedding")
        assert got.shape == (1, 384)
        cos = _cosine(got, references[i][2])
        assert cos >= 0.9999, (SENTENCES[i], cos)
    # Whether these requests meet in minilm's queue depends on the tokenize step's
    # timing; that minilm batches different lengths is asserted on direct requests in
    # test_minilm_token_embeddings_are_cut_back_to_each_requests_length.


def test_requests_of_several_texts_join_batches_too(
    client: httpclient.InferenceServerClient, references: list[tuple]
) -> None:
    """A request of 3 texts (tokenized to its longest) batched with single ones."""
    several = [SENTENCES[0], SENTENCES[6], SENTENCES[2]]
    tensor = httpclient.InferInput("text", [3, 1], "BYTES")
    tensor.set_data_from_numpy(np.array(several, dtype=object).reshape(3, 1))
    pending = [client.async_infer("text_embedding", [tensor])]
    pending += [client.async_infer("text_embedding", _text(s)) for s in SENTENCES]
    got = pending[0].get_result().as_numpy("embedding")
    assert got.shape == (3, 384)
    for row, i in enumerate((0, 6, 2)):
        assert _cosine(got[row], references[i][2]) >= 0.9999
    for i, p in enumerate(pending[1:]):
        assert _cosine(p.get_result().as_numpy("embedding"), references[i][2]) >= 0.9999


def test_minilm_token_embeddings_are_cut_back_to_each_requests_length(
    server: ServerProcess, client: httpclient.InferenceServerClient, references: list[tuple]
) -> None:
    before = _stats(server, "minilm")
    pending = [
        (i, client.async_infer("minilm", _token_inputs(tokens)))
        for _ in range(3)
        for i, (tokens, _, _) in enumerate(references)
    ]
    for i, p in pending:
        tokens, emb, _ = references[i]
        got = p.get_result().as_numpy("token_embeddings")
        assert got.shape == emb.shape == (1, tokens["input_ids"].shape[1], 384)
        np.testing.assert_allclose(got, emb, atol=2e-4)
    after = _stats(server, "minilm")
    requests = after["inference_count"] - before["inference_count"]
    batches = after["execution_count"] - before["execution_count"]
    assert requests == len(pending)
    # requests of different lengths were batched: fewer executions than requests
    assert batches < requests, (batches, requests)
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    assert any(size > 1 for size in sizes), sizes


def test_requests_longer_than_every_bucket_are_served_unpadded(
    server: ServerProcess, client: httpclient.InferenceServerClient, references: list[tuple]
) -> None:
    before = _stats(server, "minilm_small")
    pending = [
        (i, client.async_infer("minilm_small", _token_inputs(tokens)))
        for _ in range(2)
        for i, (tokens, _, _) in enumerate(references)
    ]
    longer = 0
    for i, p in pending:
        tokens, emb, _ = references[i]
        got = p.get_result().as_numpy("token_embeddings")
        assert got.shape == emb.shape
        np.testing.assert_allclose(got, emb, atol=2e-4)
        longer += tokens["input_ids"].shape[1] > 16
    assert longer >= 4  # some requests were longer than the largest bucket (16)
    after = _stats(server, "minilm_small")
    assert after["inference_count"] - before["inference_count"] == len(pending)


def test_padded_inputs_of_different_lengths_are_refused(
    server: ServerProcess, client: httpclient.InferenceServerClient
) -> None:
    tokens = _tokens(client, SENTENCES[1])
    n = tokens["input_ids"].shape[1]
    bad = dict(tokens, attention_mask=np.ones((1, n + 2), np.int64))
    with pytest.raises(InferenceServerException) as info:
        client.infer("minilm", _token_inputs(bad))
    assert info.value.status() == "400"
    assert info.value.message() == (
        f"inputs 'input_ids' and 'attention_mask' are padded together (parameter "
        f"'padding') and must have the same length; got {n} and {n + 2}"
    )
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, arr in bad.items():
        t = grpcclient.InferInput(name, list(arr.shape), "INT64")
        t.set_data_from_numpy(arr)
        inputs.append(t)
    with pytest.raises(InferenceServerException) as ginfo:
        grpc.infer("minilm", inputs)
    assert ginfo.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "must have the same length" in ginfo.value.message()
    # the model carries on
    ok = client.infer("minilm", _token_inputs(tokens)).as_numpy("token_embeddings")
    assert ok.shape == (1, n, 384)


@pytest.mark.parametrize(
    ("model", "words"),
    [
        (
            "tiny_fixed_pad",
            "parameters.padding: input 'INPUT0' has no variable dimension at index 0: its "
            "dims are [64]; only a -1 dimension can be padded",
        ),
        (
            "minilm_float_pad",
            "parameters.padding: input 'input_ids': pad value '0.5' is not an integer, as "
            "INT64 needs",
        ),
    ],
)
def test_bad_padding_configurations_do_not_load(
    server: ServerProcess, client: httpclient.InferenceServerClient, model: str, words: str
) -> None:
    rows = {row["name"]: row for row in client.get_model_repository_index()}
    assert rows[model]["state"] == "UNAVAILABLE", rows[model]
    assert words in rows[model]["reason"], rows[model]
    assert not client.is_model_ready(model)
    assert client.is_model_ready("minilm") and client.is_model_ready("tiny")


def test_the_example_config_is_what_the_readme_shows() -> None:
    """The batching page's copy-paste policy is the one the example minilm ships."""
    readme = (ROOT / "docs" / "user-guide" / "batching.md").read_text()
    config = (ROOT / "examples" / "pipelines" / "minilm" / "config.pbtxt").read_text()
    policy = re.search(r'key: "padding"\s*value: \{ string_value: "([^"]+)" \}', config)
    assert policy is not None
    assert policy.group(1) in readme
