"""Triton's generate extension (docs/protocol/extension_generate.md; ``http_server.cc``
``GenerateRequestClass``): ``POST /v2/models/{m}[/versions/{v}]/generate`` answers one
JSON object, ``.../generate_stream`` one SSE ``data: {...}`` event per response.

Request: ``"id"`` (a string) is the request id, echoed in each response (and, as any
other key, a request parameter); a key naming a model input becomes that input (a scalar
shape ``[1]``, an array its nesting's shape, a batch dim of 1 in front for a batching
model); ``"parameters"`` and other keys are request parameters. Response: ``{"id"?,
"model_name", "model_version", <parameter>..., <output>...}``, each output a top-level
field: one element as that element, more as a flat row-major array. An error before the
first response is ``{"error": message}`` with its code's status, after it an SSE event.
An empty final response sends no event; ``/generate`` needs exactly one response.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
import orjson

from pdserve.core.api import InferenceCore
from pdserve.core.datatypes import v2_to_numpy
from pdserve.core.errors import InferError, internal, invalid_arg
from pdserve.core.streaming import StreamResponse
from pdserve.core.types import InferRequest, InferResponse
from pdserve.frontends.http.answer import Answer, json_answer
from pdserve.frontends.http.routes import call
from pdserve.frontends.parameters import check_request_parameters

#: ``/generate``'s answer (``INTERNAL``) when a model sent no response or more than one,
#: Triton's message (``GenerateRequestClass::SendChunkResponse``).
NOT_ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model "
    "that generates various number of responses"
)

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


def generate_request(
    doc: dict[str, Any],
    model: str,
    version: str,
    metadata: dict[str, Any],
    batching: bool,
    arrival_ns: int,
) -> InferRequest:
    """The :class:`InferRequest` of a generate request object.

    Args:
        doc: the request JSON object.
        metadata: the model's V2 metadata (its ``inputs`` with datatype and shape).
        batching: the model batches (``max_batch_size > 0``): a batch dim of 1 is added.

    Raises:
        InferError(INVALID_ARG): ``parameters`` is not an object, or a value does not
            convert to its input's datatype.
    """
    inputs_meta = {i["name"]: i for i in metadata.get("inputs", [])}
    params: dict[str, Any] = {}
    given = doc.get("parameters", {})
    if not isinstance(given, dict):
        raise invalid_arg("generate request: 'parameters' must be a JSON object")
    request_id = doc.get("id", "")
    if "id" not in inputs_meta and type(request_id) is not str:
        raise invalid_arg("Unable to parse 'id': the request id must be a JSON string")
    inputs: dict[str, np.ndarray] = {}
    for key, value in doc.items():
        if key == "parameters":
            continue
        meta = inputs_meta.get(key)
        if meta is None:
            params[key] = value
            continue
        datatype = meta["datatype"]
        _check_json_types(key, value, datatype)
        try:
            if datatype == "BYTES":
                arr = np.array(_to_bytes(value), dtype=object)
            else:
                arr = np.array(value, dtype=v2_to_numpy(datatype))
        except (TypeError, ValueError, OverflowError) as e:
            raise invalid_arg(
                f"generate request: input '{key}' does not convert to {datatype}: {e}"
            ) from None
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if batching:
            arr = arr[np.newaxis, ...]
        inputs[key] = arr
    params.update(given)
    check_request_parameters(params)  # as /infer: timeout, priority, sequence_* ...
    return InferRequest(
        model_name=model,
        model_version=version,
        inputs=inputs,
        parameters=params,
        id=request_id if type(request_id) is str else "",
        arrival_ns=arrival_ns,
    )


#: JSON value types each V2 datatype accepts in a generate request (as in a V2 ``data``
#: array: numbers for numeric tensors, booleans for BOOL, strings for BYTES; a bool is
#: not a number here, and a fraction is not an integer).
_JSON_TYPES: dict[str, tuple[type, ...]] = {"BOOL": (bool,), "BYTES": (str,)}
_JSON_TYPES.update({t: (int,) for t in ("INT8", "INT16", "INT32", "INT64")})
_JSON_TYPES.update({t: (int,) for t in ("UINT8", "UINT16", "UINT32", "UINT64")})
_JSON_TYPES.update({t: (int, float) for t in ("FP16", "FP32", "FP64", "BF16")})


def _check_json_types(key: str, value: Any, datatype: str) -> None:
    """Refuse a generate input value whose JSON type does not fit ``datatype``.

    Raises:
        InferError(INVALID_ARG): naming the input, the datatype and the value's type.
    """
    allowed = _JSON_TYPES.get(datatype)
    if allowed is None:
        return
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is list:
            stack.extend(v)
        elif type(v) not in allowed:
            kind = "null" if v is None else type(v).__name__
            raise invalid_arg(
                f"generate request: input '{key}' is {datatype}: a value of JSON type "
                f"{kind} ({v!r:.40}) does not fit"
            )


def _to_bytes(value: Any) -> Any:
    if isinstance(value, list):
        return [_to_bytes(v) for v in value]
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    return str(value).encode("utf-8")


def _json_value(arr: np.ndarray) -> Any:
    """An output as a generate response holds it (Triton's ``ExactMappingOutput``): one
    element as that element, more as a flat list in row-major order, whatever the
    shape (``[1, 3]`` and ``[3]`` both give ``[a, b, c]``); BYTES as strings."""
    flat = arr.reshape(-1)
    if arr.dtype == object or arr.dtype.kind in "SU":
        values: list[Any] = [
            v.decode("utf-8", errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)
            for v in flat
        ]
    else:
        values = flat.tolist()
    return values[0] if len(values) == 1 else values


#: Response parameter types a generate response carries as fields (Triton's bool, int,
#: string and double parameters; a bytes parameter is refused there).
_PARAM_TYPES = (bool, int, str, float)


def response_json(response: InferResponse) -> bytes:
    """A generate response object: ``id`` (when the request had one), ``model_name``,
    ``model_version``, then each response parameter and each output as a top-level
    field (:func:`_json_value`), as Triton's ``FinalizeResponse`` lays them out."""
    doc: dict[str, Any] = {}
    if response.id:
        doc["id"] = response.id
    doc["model_name"] = response.model_name
    doc["model_version"] = response.model_version
    for name, value in response.parameters.items():
        if isinstance(value, _PARAM_TYPES):
            doc[name] = value
    for name, arr in response.outputs.items():
        doc[name] = _json_value(np.asarray(arr))
    return orjson.dumps(doc)


def _error_json(message: str) -> bytes:
    return orjson.dumps({"error": message})


async def serve_generate(
    server: InferenceCore,
    doc: dict[str, Any],
    model: str,
    version: str,
    streaming: bool,
) -> Answer:
    """The answer to one ``generate`` (``streaming`` False) or ``generate_stream``
    request (then a stream of SSE events, which the transport writes as they come).

    Raises:
        InferError: the request fails before its first response (answered as JSON
            with the code's HTTP status).
    """
    arrival_ns = time.monotonic_ns()
    metadata = await call(server.model_metadata, model, version)
    config = await call(server.model_config, model, version)
    batching = config.get("max_batch_size", 0) > 0
    request = generate_request(doc, model, version, metadata, batching, arrival_ns)
    if streaming:
        return Answer(200, _SSE_HEADERS, stream=_sse_events(server.infer_stream(request)))
    # as Triton, the request runs to its end; only the first answer and error are kept
    first: InferResponse | InferError | None = None
    first_error: InferError | None = None
    responses = errors = 0
    async with contextlib.aclosing(server.infer_stream(request)) as items:
        async for item in items:
            if item.error is not None:
                errors += 1
                first_error = first_error or item.error
                first = first or item.error
            elif item.response is not None:  # (an empty final response is none)
                responses += 1
                first = first or item.response
    if responses + errors != 1 or first is None:
        raise not_one_response(responses, errors, first_error)
    if isinstance(first, InferError):
        raise first
    return json_answer(response_json(first))


def not_one_response(responses: int, errors: int, first_error: InferError | None) -> InferError:
    """``/generate``'s error (``INTERNAL``, 500) for a model that sent no response or
    more than one (``responses`` responses and ``errors`` error responses): Triton's
    message (:data:`NOT_ONE_RESPONSE`), then what was sent and the first error's message.

    Triton starts its chunked reply at the first response, so it sends this message with
    status 200 when that response succeeded; pdserve answers ``/generate`` once the model
    is done, and gives the error its own status.
    """
    sent = f"{responses} response(s)"
    if first_error is not None:
        sent += f" and {errors} error(s), the first: {first_error.message}"
    return internal(f"{NOT_ONE_RESPONSE} (the model sent {sent})")


async def _sse_events(items: AsyncGenerator[StreamResponse, None]) -> AsyncGenerator[bytes, None]:
    """The SSE events of a stream's items; an error before the first event is raised
    (answered with its status), one after it is an event."""
    async with contextlib.aclosing(items):
        started = False
        async for item in items:
            if item.error is not None:
                if not started:
                    raise item.error
                event = _error_json(item.error.message)
            elif item.response is not None:
                event = response_json(item.response)
            else:
                continue  # an empty final response: nothing to say
            started = True
            yield b"data: " + event + b"\n\n"
