"""OpenAI's wire shapes: request fields checked (:func:`embedding_request`,
:func:`completion_request`), response objects, and the error body
``{"error": {"message", "type", "param", "code"}}`` (:class:`OpenAIError`) with the
status OpenAI's API gives it.

Errors follow OpenAI's API: a bad field is 400 ``invalid_request_error`` naming the field
in ``param``; an unknown model 404 ``model_not_found``; a refused credential 401 / 403;
a rate limit 429 ``rate_limit_exceeded``; a body over the size limit 413.
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from pdserve.core.errors import ErrorCode, InferError

#: OpenAI's limit on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048

#: OpenAI's limit on the stop sequences of one request.
MAX_STOP = 4

#: Request fields that are part of the OpenAI request itself, not passed to the model.
_CLIENT_ONLY = frozenset(("model", "prompt", "messages", "stream", "stream_options", "user"))

#: OpenAI's error ``type`` for each HTTP status an error can have.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_exceeded",
    499: "cancelled",
    501: "not_implemented",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error answered with OpenAI's body: ``status``, ``message``, ``param`` (the
    request field at fault, or None), ``code`` (OpenAI's code word, or None) and
    ``type`` (from the status when not given)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "server_error")

    def body(self) -> bytes:
        """The JSON error body."""
        error = {"message": self.message, "type": self.type, "param": self.param}
        error["code"] = self.code
        return orjson.dumps({"error": error})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400 ``invalid_request_error``."""
    return OpenAIError(400, message, param, code)


def model_not_found(model: str) -> OpenAIError:
    """404 ``model_not_found``, OpenAI's message."""
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "model",
        "model_not_found",
    )


#: OpenAI's code word for the pdserve error codes that have one.
_CODES = {
    ErrorCode.UNAUTHENTICATED: "invalid_api_key",
    ErrorCode.RESOURCE_EXHAUSTED: "rate_limit_exceeded",
}


def from_infer_error(error: InferError, status: int) -> OpenAIError:
    """An :class:`InferError` (with its HTTP ``status``) as an OpenAI error."""
    return OpenAIError(status, error.message, None, _CODES.get(error.code))


def _text_list(value: Any, param: str) -> list[str]:
    """A string or a non-empty list of non-empty strings, as a list.

    Raises:
        OpenAIError(400): anything else, naming ``param``.
    """
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{param}' must be a string or a non-empty list of strings", param)
    for item in value:
        if not isinstance(item, str):
            kind = "token ids" if isinstance(item, int | list) else type(item).__name__
            raise bad_request(
                f"'{param}' holds {kind}: this server takes text (strings) only", param
            )
        if not item:
            raise bad_request(f"'{param}' cannot hold an empty string", param)
    return value


def _positive_int(doc: dict[str, Any], key: str) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise bad_request(f"'{key}' must be an integer of at least 1, got {value!r:.40}", key)
    return value


def _require_model(doc: dict[str, Any]) -> str:
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: a model name (GET /v1/models lists them)", "model")
    return model


@dataclass
class EmbeddingRequest:
    """A checked ``POST /v1/embeddings`` body."""

    model: str
    texts: list[str]
    base64: bool
    dimensions: int | None


def embedding_request(doc: dict[str, Any]) -> EmbeddingRequest:
    """Check an embeddings request: ``model``; ``input`` a string or a list of 1 to
    :data:`MAX_EMBEDDING_INPUTS` non-empty strings (token-id arrays are refused: the
    models take text); ``encoding_format`` ``float`` (default) or ``base64``;
    ``dimensions`` a positive integer; ``user`` ignored.

    Raises:
        OpenAIError(400): a missing or invalid field, naming it in ``param``.
    """
    model = _require_model(doc)
    if "input" not in doc:
        raise bad_request("'input' is required", "input")
    texts = _text_list(doc["input"], "input")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise bad_request(
            f"'input' holds {len(texts)} items: at most {MAX_EMBEDDING_INPUTS} per request",
            "input",
        )
    fmt = doc.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_request(
            f"'encoding_format' must be 'float' or 'base64', got {fmt!r:.40}", "encoding_format"
        )
    return EmbeddingRequest(model, texts, fmt == "base64", _positive_int(doc, "dimensions"))


def embedding_item(vector: np.ndarray, index: int, as_base64: bool) -> dict[str, Any]:
    """One ``data`` item: the vector as floats, or as base64 of its little-endian
    float32 bytes (what OpenAI's ``encoding_format: base64`` sends)."""
    vec = np.asarray(vector, dtype="<f4")
    if as_base64:
        value: Any = base64.b64encode(vec.tobytes()).decode()
    else:  # written once here, then as it is: cheaper than inside the whole body
        value = orjson.Fragment(orjson.dumps(vec, option=orjson.OPT_SERIALIZE_NUMPY))
    return {"object": "embedding", "index": index, "embedding": value}


def embeddings_body(model: str, items: list[dict[str, Any]], prompt_tokens: int) -> bytes:
    """The embeddings response object (``usage`` as reported by the model, else 0)."""
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    doc = {"object": "list", "data": items, "model": model, "usage": usage}
    return orjson.dumps(doc)


@dataclass
class CompletionRequest:
    """A checked ``POST /v1/completions`` or ``/v1/chat/completions`` body."""

    model: str
    #: the prompt, or the chat messages (``[{role, content}]``, content as text).
    prompt: str
    messages: list[dict[str, str]] | None
    stream: bool
    stop: list[str]
    #: what the model gets as request parameters (``max_tokens``, sampling ...).
    parameters: dict[str, Any] = field(default_factory=dict)
    include_usage: bool = False


def _stop_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, list)
        or len(value) > MAX_STOP
        or not all(isinstance(s, str) and s for s in value)
    ):
        raise bad_request(
            f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings", "stop"
        )
    return value


#: OpenAI's ranges of the sampling fields (inclusive).
_RANGES = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}

#: Fields that ask for what this front end does not do: refused while set (a value
#: other than these), so a client never takes their silent absence for an answer.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


def _check_sampling(doc: dict[str, Any]) -> None:
    """The sampling fields' types and ranges, and no unsupported field set.

    Raises:
        OpenAIError(400): naming the field.
    """
    for key, (low, high) in _RANGES.items():
        value = doc.get(key)
        if value is None:
            continue
        if type(value) not in (int, float) or not low <= value <= high:
            raise bad_request(
                f"'{key}' must be a number from {low:g} to {high:g}, got {value!r:.40}", key
            )
    seed = doc.get("seed")
    if seed is not None and type(seed) is not int:
        raise bad_request(f"'seed' must be an integer, got {seed!r:.40}", "seed")
    for key, allowed in _UNSUPPORTED.items():
        if key in doc and doc[key] not in allowed:
            raise bad_request(f"'{key}' is not supported by this server", key)


def _message_text(content: Any, where: str) -> str:
    """A message's content: a string, or the ``text`` parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(f"'{where}': only text content parts are served", where)
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    if content is None:
        return ""
    raise bad_request(f"'{where}' must be a string or a list of text parts", where)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad_request(f"'messages[{i}]' must be an object with a 'role'", "messages")
        where = f"messages[{i}].content"
        if msg.get("content") is None and msg["role"] != "assistant":
            # OpenAI allows null content only on an assistant turn (one with tool calls)
            raise bad_request(f"'{where}' is required for role '{msg['role']}'", where)
        text = _message_text(msg.get("content"), where)
        out.append({"role": msg["role"], "content": text})
    return out


def completion_request(doc: dict[str, Any], chat: bool) -> CompletionRequest:
    """Check a (chat) completion request: ``model``; ``prompt`` one string (or a list
    of one) / ``messages``; ``stream`` a boolean; ``stop`` up to 4 strings; ``n`` 1;
    ``max_tokens`` (or ``max_completion_tokens``) a positive integer; ``temperature``,
    ``top_p``, ``presence_penalty`` and ``frequency_penalty`` numbers in OpenAI's
    ranges, ``seed`` an integer; ``logprobs``, ``echo``, ``tools``, ``response_format``
    (other than text) and the like refused while set. Every other
    field whose value is a string, number or boolean (``temperature``, ``top_p``,
    ``seed`` ...) is passed to the model as a request parameter of that name; ``stop``
    as a JSON array string.

    Raises:
        OpenAIError(400): a missing or invalid field, naming it in ``param``.
    """
    model = _require_model(doc)
    messages = None
    prompt = ""
    if chat:
        messages = _messages(doc.get("messages"))
    else:
        prompts = _text_list(doc.get("prompt"), "prompt")
        if len(prompts) != 1:
            raise bad_request("this server takes one prompt per request", "prompt")
        prompt = prompts[0]
    stream = doc.get("stream", False)
    if stream is None:
        stream = False
    if type(stream) is not bool:
        raise bad_request("'stream' must be true or false", "stream")
    n = doc.get("n", 1)
    if n not in (1, None) or type(n) is bool:
        raise bad_request("'n' must be 1: this server returns one choice", "n")
    stop = _stop_list(doc.get("stop"))
    _check_sampling(doc)
    params: dict[str, Any] = {}
    for key, value in doc.items():
        if key not in _CLIENT_ONLY and isinstance(value, str | int | float) and key != "n":
            params[key] = value
    max_tokens = _positive_int(doc, "max_tokens")  # both checked: either may be given
    max_completion_tokens = _positive_int(doc, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = max_completion_tokens
    params.pop("max_completion_tokens", None)
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if stop:
        params["stop"] = orjson.dumps(stop).decode()
    options = doc.get("stream_options")
    usage = isinstance(options, dict) and options.get("include_usage") is True
    return CompletionRequest(model, prompt, messages, stream, stop, params, usage)


def new_id(chat: bool) -> str:
    """A completion id as OpenAI's (``chatcmpl-...`` / ``cmpl-...``)."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": total,
    }


def completion_body(
    cid: str, model: str, chat: bool, text: str, finish: str, usage: dict[str, int]
) -> bytes:
    """A whole (not streamed) ``text_completion`` / ``chat.completion`` object."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    doc = {
        "id": cid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
    return orjson.dumps(doc)


def chunk_event(
    cid: str,
    model: str,
    chat: bool,
    delta: dict[str, str] | str | None,
    finish: str | None,
    usage: dict[str, int] | None = None,
) -> bytes:
    """One SSE event of a streamed completion: ``delta`` the new text (chat: the
    ``delta`` object); ``finish`` the finish reason of the last chunk; with ``usage``
    (and ``delta`` None) the usage chunk of ``stream_options.include_usage``."""
    choices: list[dict[str, Any]] = []
    if delta is not None:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choices.append(choice)
    doc: dict[str, Any] = {
        "id": cid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        doc["usage"] = usage
    return b"data: " + orjson.dumps(doc) + b"\n\n"


#: The event that ends a stream.
DONE_EVENT = b"data: [DONE]\n\n"
