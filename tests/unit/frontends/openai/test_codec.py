"""OpenAI request checks and response shapes (pdserve.frontends.openai.codec)."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.frontends.openai import codec
from pdserve.frontends.openai.codec import OpenAIError


def test_error_body_is_openais_shape() -> None:
    body = orjson.loads(codec.bad_request("bad", "input").body())
    assert body == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "input", "code": None}
    }
    missing = codec.model_not_found("m")
    assert missing.status == 404 and missing.code == "model_not_found"
    denied = codec.from_infer_error(InferError("no key", ErrorCode.UNAUTHENTICATED), 401)
    assert (denied.status, denied.code, denied.type) == (
        401,
        "invalid_api_key",
        "invalid_request_error",
    )


def test_embedding_request_accepts_a_string_or_a_list() -> None:
    one = codec.embedding_request({"model": "m", "input": "hi"})
    assert (one.texts, one.base64, one.dimensions) == (["hi"], False, None)
    many = codec.embedding_request(
        {"model": "m", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 8}
    )
    assert (many.texts, many.base64, many.dimensions) == (["a", "b"], True, 8)


@pytest.mark.parametrize(
    ("doc", "param"),
    [
        ({"input": "x"}, "model"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": [""]}, "input"),
        ({"model": "m", "input": [1, 2, 3]}, "input"),
        ({"model": "m", "input": 5}, "input"),
        ({"model": "m", "input": ["x"] * (codec.MAX_EMBEDDING_INPUTS + 1)}, "input"),
        ({"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "m", "input": "x", "dimensions": 0}, "dimensions"),
        ({"model": "m", "input": "x", "dimensions": "8"}, "dimensions"),
    ],
)
def test_bad_embedding_requests_name_the_field(doc: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        codec.embedding_request(doc)
    assert (info.value.status, info.value.param) == (400, param)


def test_base64_is_little_endian_float32() -> None:
    vec = np.array([1.5, -2.0, 0.25], dtype=np.float32)
    item = codec.embedding_item(vec, 3, True)
    raw = base64.b64decode(item["embedding"])
    assert np.array_equal(np.frombuffer(raw, dtype="<f4"), vec)
    assert item["index"] == 3 and item["object"] == "embedding"


def test_completion_request_passes_sampling_parameters() -> None:
    req = codec.completion_request(
        {
            "model": "g",
            "prompt": "hi",
            "max_tokens": 4,
            "temperature": 0.5,
            "stop": ["x", "y"],
            "stream": True,
            "user": "u",
        },
        chat=False,
    )
    assert req.prompt == "hi" and req.stream and req.stop == ["x", "y"]
    assert req.parameters == {"max_tokens": 4, "temperature": 0.5, "stop": '["x","y"]'}


@pytest.mark.parametrize(
    ("doc", "param"),
    [
        ({"model": "g", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "g", "prompt": "a", "stream": "yes"}, "stream"),
        ({"model": "g", "prompt": "a", "n": 2}, "n"),
        ({"model": "g", "prompt": "a", "max_tokens": -1}, "max_tokens"),
        (
            {"model": "g", "prompt": "a", "max_tokens": 4, "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        ({"model": "g", "prompt": "a", "stop": ["1", "2", "3", "4", "5"]}, "stop"),
    ],
)
def test_bad_completion_requests_name_the_field(doc: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        codec.completion_request(doc, chat=False)
    assert (info.value.status, info.value.param) == (400, param)


def test_chat_messages_take_text_parts() -> None:
    doc = {
        "model": "g",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
    }
    assert codec.completion_request(doc, chat=True).messages == [{"role": "user", "content": "ab"}]
    with pytest.raises(OpenAIError):
        codec.completion_request({"model": "g", "messages": []}, chat=True)


def test_chat_message_content_is_required_except_for_the_assistant() -> None:
    # OpenAI: 400 "Missing required parameter: 'messages[0].content'" for a user turn;
    # an assistant turn (one that made tool calls) may have null content.
    doc = {"model": "g", "messages": [{"role": "user"}]}
    with pytest.raises(OpenAIError) as e:
        codec.completion_request(doc, chat=True)
    assert e.value.status == 400 and e.value.param == "messages[0].content"
    assert "'messages[0].content' is required" in e.value.message
    doc = {
        "model": "g",
        "messages": [{"role": "assistant", "content": None}, {"role": "user", "content": "x"}],
    }
    assert codec.completion_request(doc, chat=True).messages[0] == {
        "role": "assistant",
        "content": "",
    }


def test_stream_chunks_are_sse_events() -> None:
    event = codec.chunk_event("c", "g", True, {"content": "x"}, None)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    doc = orjson.loads(event[6:])
    assert doc["object"] == "chat.completion.chunk"
    assert doc["choices"][0]["delta"] == {"content": "x"}
    usage = orjson.loads(codec.chunk_event("c", "g", False, None, None, codec.usage_of(2, 3))[6:])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5


@pytest.mark.parametrize(
    ("field", "value", "ok"),
    [
        ("temperature", 0, True),
        ("temperature", 2.0, True),
        ("temperature", 2.01, False),
        ("temperature", True, False),
        ("top_p", 1, True),
        ("top_p", -0.1, False),
        ("frequency_penalty", -2, True),
        ("presence_penalty", "0", False),
        ("seed", 7, True),
        ("seed", 7.0, False),
        ("logprobs", False, True),
        ("logprobs", True, False),
        ("best_of", 1, True),
        ("best_of", 2, False),
        ("response_format", {"type": "text"}, True),
        ("response_format", {"type": "json_object"}, False),
        ("tools", [], True),
        ("tools", [{"type": "function"}], False),
    ],
)
def test_sampling_fields_in_openais_ranges_and_unsupported_ones_refused(
    field: str, value: object, ok: bool
) -> None:
    doc = {"model": "g", "prompt": "x", field: value}
    if ok:
        codec.completion_request(doc, chat=False)
        return
    with pytest.raises(OpenAIError) as e:
        codec.completion_request(doc, chat=False)
    assert (e.value.status, e.value.param) == (400, field)
