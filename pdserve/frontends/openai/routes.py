"""The OpenAI routes (:func:`handle`): ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/embeddings``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

Every request passes the traffic gate (category ``metadata`` for the model routes,
``inference`` for the others, with the model the body names, so model-scoped keys and
per-model rate limits apply as on V2), and an inference request the admission step
(``traceparent``, route key, pinned version, cancellation token) before the core's
``infer`` (embeddings; concurrent requests batch in the model's scheduler) or
``infer_stream`` (completions). Every error is OpenAI's body (:mod:`.codec`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from pdserve.core.api import InferenceCore
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.streaming import StreamResponse
from pdserve.core.types import InferRequest, RequestedOutput
from pdserve.frontends.admission import PIN_HEADER, ROUTE_KEY_HEADER, admit
from pdserve.frontends.http.answer import (
    CLOSE,
    JSON,
    Answer,
    Exchange,
    Headers,
    WrongMethodError,
    json_answer,
)
from pdserve.frontends.http.body import read_json_object
from pdserve.frontends.http.routes import call
from pdserve.frontends.http.status import HTTP_STATUS, HttpError
from pdserve.frontends.openai import catalog, codec
from pdserve.frontends.openai.codec import OpenAIError, bad_request
from pdserve.frontends.parameters import check_request_parameters
from pdserve.frontends.traffic.apis import INFERENCE, METADATA, MODEL_REPOSITORY
from pdserve.frontends.traffic.gate import header_getter

if TYPE_CHECKING:
    from pdserve.frontends.traffic.gate import TrafficGate

log = logging.getLogger("pdserve.openai")

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_POST_ROUTES = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions")


async def handle(
    core: InferenceCore,
    gate: TrafficGate | None,
    method: str,
    path: str,
    headers: Headers,
    exchange: Exchange,
) -> Answer:
    """Answer one request to a ``/v1/...`` path; every error as OpenAI's body."""
    try:
        return await _route(core, gate, method, path, headers, exchange)
    except Exception as exc:  # noqa: BLE001 - each answered in OpenAI's shape
        return error_answer(exc, method, path)


def error_answer(exc: BaseException, method: str = "", path: str = "") -> Answer:
    """OpenAI's error answer for an exception: :class:`OpenAIError` as it is; an
    :class:`InferError` with its V2 status (and its ``WWW-Authenticate`` /
    ``Retry-After``); an HTTP error (405, 408, 413, 415) with its own; anything else
    500, logged."""
    extra: Headers = []
    if isinstance(exc, OpenAIError):
        error = exc
    elif isinstance(exc, InferError):
        error = codec.from_infer_error(exc, HTTP_STATUS[exc.code])
        extra.extend(getattr(exc, "http_headers", None) or ())
        retry = getattr(exc, "retry_after", None)
        if retry is not None:
            extra.append((b"retry-after", b"%d" % retry))
    elif isinstance(exc, HttpError):
        error = OpenAIError(exc.status, exc.message)
        allow = getattr(exc, "allow", None)
        if allow:
            extra.append((b"allow", allow.encode("latin-1")))
        if exc.close:
            extra.append(CLOSE)
    else:
        log.error("error serving %s %s", method, path, exc_info=exc)
        error = OpenAIError(500, f"{type(exc).__name__}: {exc}", type_="server_error")
    body = error.body()
    return Answer(error.status, [JSON, (b"content-length", b"%d" % len(body)), *extra], body)


async def _route(
    core: InferenceCore,
    gate: TrafficGate | None,
    method: str,
    path: str,
    headers: Headers,
    exchange: Exchange,
) -> Answer:
    parts = path.split("/")
    if len(parts) >= 3 and parts[2] == "models":
        model = "/".join(parts[3:])
        if len(parts) == 3 or (len(parts) == 4 and model):
            if method != "GET":
                raise WrongMethodError("GET")
            may_use: Callable[[str], bool] | None = None
            if gate is not None:
                principal = await gate.check("http", METADATA, model, header_getter(headers))
                may_use = getattr(principal, "may_use_model", None)
            return await (get_model(core, model) if model else list_models(core, may_use))
    if path not in _POST_ROUTES:
        if gate is not None:  # as an unknown V2 path: the admin category's check first
            await gate.check("http", MODEL_REPOSITORY, "", header_getter(headers))
        raise OpenAIError(404, f"Invalid URL ({method} {path})", code="unknown_url")
    if method != "POST":
        raise WrongMethodError("POST")
    doc = await read_json_object(exchange, headers)
    if gate is not None:
        named = doc.get("model")
        name = named if isinstance(named, str) else ""
        await gate.check("http", INFERENCE, name, header_getter(headers))
    if path == "/v1/embeddings":
        return await embeddings(core, doc, headers, exchange)
    return await completions(core, doc, headers, exchange, path.endswith("chat/completions"))


# ------------------------------------------------------------------------- models


async def _resolve(core: InferenceCore, model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model's config (JSON form) and V2 metadata; 404 OpenAI-style when unknown."""
    try:
        config = await call(core.model_config, model, "")
        metadata = await call(core.model_metadata, model, "")
    except InferError as e:
        if e.code is ErrorCode.NOT_FOUND:
            raise codec.model_not_found(model) from None
        raise
    return config, metadata


async def _model_folders(core: InferenceCore, model: str) -> list[Path]:
    """The model's served version folder and model folder (the core's
    ``model_folders``, in this process or the main one); none for a core without it."""
    lookup = getattr(core, "model_folders", None)
    if lookup is None:
        return []
    try:
        return [Path(p) for p in await call(lookup, model, "")]
    except InferError:  # unloaded meanwhile
        return []


async def _model_object(core: InferenceCore, model: str) -> dict[str, Any]:
    """OpenAI's model object; ``created`` the served version folder's modification
    time (0 when unknown)."""
    created = 0
    folders = await _model_folders(core, model)
    if folders:
        with contextlib.suppress(OSError):
            created = int(folders[0].stat().st_mtime)
    return {"id": model, "object": "model", "created": created, "owned_by": "pdserve"}


async def _served_kind(core: InferenceCore, model: str) -> str | None:
    config, metadata = await _resolve(core, model)
    return catalog.model_kind(config, metadata)


async def list_models(core: InferenceCore, may_use: Callable[[str], bool] | None = None) -> Answer:
    """``GET /v1/models``: ``{"object": "list", "data": [model objects]}``, the ready
    models that qualify (:mod:`.catalog`) and that the caller's credential may use
    (``may_use``; None: all), sorted by name."""
    rows = await call(core.repository_index, True)
    names = sorted({row["name"] for row in rows if row.get("state", "READY") == "READY"})
    if may_use is not None:
        names = [name for name in names if may_use(name)]
    data = []
    for name in names:
        try:
            kind = await _served_kind(core, name)
        except (OpenAIError, InferError):  # unloaded meanwhile
            continue
        if kind is not None:
            data.append(await _model_object(core, name))
    return json_answer(orjson.dumps({"object": "list", "data": data}))


async def get_model(core: InferenceCore, model: str) -> Answer:
    """``GET /v1/models/{id}``: the model object; 404 when the model is unknown or
    not served on this front end."""
    if await _served_kind(core, model) is None:
        raise codec.model_not_found(model)
    return json_answer(orjson.dumps(await _model_object(core, model)))


# ----------------------------------------------------------------- admission


def _admission(headers: Headers) -> tuple[bytes | None, bytes, bytes]:
    """``(traceparent, route key, pinned version)`` from the request's headers."""
    traceparent: bytes | None = None
    route_key = pinned = b""
    route_name, pin_name = ROUTE_KEY_HEADER.encode(), PIN_HEADER.encode()
    for key, value in headers:
        if key == b"traceparent":
            traceparent = value
        elif key == route_name:
            route_key = value
        elif key == pin_name:
            pinned = value
    return traceparent, route_key, pinned


def _text_tensor(texts: list[str], meta: dict[str, Any], batching: bool) -> np.ndarray:
    """BYTES input of ``texts``: one element per row, shaped as the input's dims of 1."""
    item = [1] * max(len(meta.get("shape", [])) - (1 if batching else 0), 1)
    arr = np.array([t.encode("utf-8") for t in texts], dtype=object)
    return arr.reshape([len(texts), *item] if batching else item)


# --------------------------------------------------------------------- embeddings


async def embeddings(
    core: InferenceCore, doc: dict[str, Any], headers: Headers, exchange: Exchange
) -> Answer:
    """``POST /v1/embeddings``: the texts in one request per ``max_batch_size`` rows
    (one per text for a model that does not batch), run concurrently."""
    req = codec.embedding_request(doc)
    config, metadata = await _resolve(core, req.model)
    kind = catalog.model_kind(config, metadata)
    if kind != catalog.EMBEDDINGS:
        what = "a text generator (use /v1/completions)" if kind else "not an embedding model"
        raise bad_request(
            f"The model `{req.model}` is {what}: it does not serve /v1/embeddings",
            "model",
            "model_not_supported",
        )
    max_batch = int(config.get("max_batch_size", 0))
    io = catalog.embedding_io(metadata, max_batch > 0)
    assert io is not None
    in_meta = metadata["inputs"][0]
    out_meta = next(o for o in metadata["outputs"] if o["name"] == io[1])
    size = int(out_meta["shape"][-1])
    keep = _dimensions(req.dimensions, size, config)
    step = max_batch if max_batch > 0 else 1
    chunks = [req.texts[i : i + step] for i in range(0, len(req.texts), step)]
    head = _admission(headers)
    arrival = time.monotonic_ns()
    requests = []
    for chunk in chunks:
        request = InferRequest(
            model_name=req.model,
            inputs={io[0]: _text_tensor(chunk, in_meta, max_batch > 0)},
            outputs=[RequestedOutput(io[1])],
            arrival_ns=arrival,
        )
        token = exchange.cancel_token() if len(chunks) == 1 else None
        admit(request, "HTTP", token, *head)
        requests.append(request)
    responses = await asyncio.gather(*(core.infer(r) for r in requests))
    items: list[dict[str, Any]] = []
    tokens = 0
    for response in responses:
        vectors = np.asarray(response.outputs[io[1]], dtype=np.float32).reshape(-1, size)
        for vec in vectors:
            items.append(codec.embedding_item(_shorten(vec, keep), len(items), req.base64))
        reported = response.parameters.get("prompt_tokens")
        if type(reported) is int:
            tokens += reported
    return json_answer(codec.embeddings_body(req.model, items, tokens))


def _dimensions(asked: int | None, size: int, config: dict[str, Any]) -> int | None:
    """How many values to keep (None: all) for a request's ``dimensions``.

    Raises:
        OpenAIError(400): ``dimensions`` differs from the model's size and the model
            does not allow shortening, or is larger than it.
    """
    if asked is None or asked == size:
        return None
    if catalog.config_parameter(config, "openai_dimensions") != "truncate":
        raise bad_request("This model does not support specifying dimensions.", "dimensions")
    if asked > size:
        raise bad_request(f"'dimensions' must be at most {size} for this model", "dimensions")
    return asked


def _shorten(vec: np.ndarray, keep: int | None) -> np.ndarray:
    if keep is None:
        return vec
    head = vec[:keep]
    norm = float(np.linalg.norm(head))
    return head / norm if norm > 0 else head


# -------------------------------------------------------------------- completions


async def completions(
    core: InferenceCore, doc: dict[str, Any], headers: Headers, exchange: Exchange, chat: bool
) -> Answer:
    """``POST /v1/completions`` / ``/v1/chat/completions`` over a generator: one
    ``infer_stream`` request, its ``text_output`` pieces as the completion (SSE chunks
    then ``data: [DONE]`` when ``stream``; one object otherwise). Closing the stream
    (the client went away, or a stop sequence was met) cancels the request."""
    req = codec.completion_request(doc, chat)
    config, metadata = await _resolve(core, req.model)
    if catalog.model_kind(config, metadata) != catalog.COMPLETIONS:
        raise bad_request(
            f"The model `{req.model}` is not a text generator: it does not serve "
            f"/v1/{'chat/' if chat else ''}completions",
            "model",
            "model_not_supported",
        )
    prompt = req.prompt
    if req.messages is not None:
        tokenizer = catalog.chat_template(await _model_folders(core, req.model))
        try:
            prompt = catalog.render_chat(req.messages, tokenizer)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
    batching = int(config.get("max_batch_size", 0)) > 0
    meta = next(i for i in metadata["inputs"] if i["name"] == "text_input")
    cid = codec.new_id(chat)
    try:
        check_request_parameters(req.parameters)
    except InferError as e:
        raise bad_request(e.message) from None
    request = InferRequest(
        model_name=req.model,
        inputs={"text_input": _text_tensor([prompt], meta, batching)},
        outputs=[RequestedOutput("text_output")],
        parameters=req.parameters,
        id=cid,
    )
    admit(request, "HTTP", exchange.cancel_token(), *_admission(headers))
    pieces = _pieces(core.infer_stream(request), req.stop, req.parameters.get("max_tokens"))
    if not req.stream:
        return await _whole(pieces, cid, req, chat)
    events = _events(pieces, cid, req, chat)
    try:
        first = await events.__anext__()  # an error before it is answered as such
    except BaseException:
        await events.aclose()
        raise
    return Answer(200, _SSE_HEADERS, stream=_prepend(first, events))


#: :func:`_pieces`' items: new text, or at the end ``(finish reason, prompt tokens,
#: completion tokens)``.
Piece = str | tuple[str, int, int]


async def _pieces(
    items: AsyncGenerator[StreamResponse, None], stop: list[str], max_tokens: Any
) -> AsyncGenerator[Piece, None]:
    """The completion's text as it comes, cut before the first stop sequence (text
    that could begin one is held back until it cannot), then the finish: the model's
    ``finish_reason`` response parameter when it sends one, else ``stop`` at a stop
    sequence, ``length`` when ``max_tokens`` responses came, ``stop`` otherwise. An
    error response is raised (InferError)."""
    hold = max((len(s) for s in stop), default=1) - 1
    text, sent, count, finish = "", 0, 0, ""
    usage = [0, 0]
    async with contextlib.aclosing(items):
        async for item in items:
            if item.error is not None:
                raise item.error
            if item.response is None:
                continue
            params = item.response.parameters
            finish = str(params.get("finish_reason") or finish)
            for i, key in enumerate(("prompt_tokens", "completion_tokens")):
                if type(params.get(key)) is int:
                    usage[i] = params[key]
            out = item.response.outputs.get("text_output")
            if out is None:
                continue
            count += 1
            text += "".join(_decode(v) for v in np.asarray(out).reshape(-1))
            cut = min((p for p in (text.find(s) for s in stop) if p >= 0), default=-1)
            if cut >= 0:
                if cut > sent:
                    yield text[sent:cut]
                yield ("stop", usage[0], usage[1])
                return
            safe = len(text) - hold
            if safe > sent:
                yield text[sent:safe]
                sent = safe
    if len(text) > sent:
        yield text[sent:]
    if not finish:
        finish = "length" if type(max_tokens) is int and count >= max_tokens else "stop"
    yield (finish, usage[0], usage[1])


def _decode(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return value.decode("utf-8", errors="replace")
    return str(value)


async def _whole(
    pieces: AsyncGenerator[Piece, None], cid: str, req: codec.CompletionRequest, chat: bool
) -> Answer:
    texts: list[str] = []
    finish: tuple[str, int, int] = ("stop", 0, 0)
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            if isinstance(piece, str):
                texts.append(piece)
            else:
                finish = piece
    usage = codec.usage_of(finish[1], finish[2])
    return json_answer(
        codec.completion_body(cid, req.model, chat, "".join(texts), finish[0], usage)
    )


async def _events(
    pieces: AsyncGenerator[Piece, None], cid: str, req: codec.CompletionRequest, chat: bool
) -> AsyncGenerator[bytes, None]:
    """The SSE events of a streamed completion; an error after the first event is an
    ``{"error": {...}}`` event that ends the stream."""
    model = req.model
    started = False
    async with contextlib.aclosing(pieces):
        try:
            async for piece in pieces:
                if chat and not started:
                    yield codec.chunk_event(
                        cid, model, chat, {"role": "assistant", "content": ""}, None
                    )
                started = True
                if isinstance(piece, str):
                    delta: dict[str, str] | str = {"content": piece} if chat else piece
                    yield codec.chunk_event(cid, model, chat, delta, None)
                    continue
                yield codec.chunk_event(cid, model, chat, {} if chat else "", piece[0])
                if req.include_usage:
                    usage = codec.usage_of(piece[1], piece[2])
                    yield codec.chunk_event(cid, model, chat, None, None, usage)
            yield codec.DONE_EVENT
        except InferError as e:
            if not started:
                raise
            yield b"data: " + codec.from_infer_error(e, HTTP_STATUS[e.code]).body() + b"\n\n"


async def _prepend(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    async with contextlib.aclosing(rest):
        yield first
        async for event in rest:
            yield event
