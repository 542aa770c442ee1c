"""The V2 REST ASGI application: routing, body reading, calls into the core."""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import importlib.resources
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import orjson

from pdserve.core.api import InferenceCore
from pdserve.core.cancel import CancelToken
from pdserve.core.errors import InferError, client_gone, not_found
from pdserve.core.types import InferRequest, InferResponse
from pdserve.frontends.admission import PIN_HEADER, ROUTE_KEY_HEADER, admit
from pdserve.frontends.http.codec import (
    decode_infer_request,
    encode_error,
    encode_infer_response_parts,
    json_output_names,
    output_data_json,
)
from pdserve.frontends.http.compression import decompress, parse_encoding
from pdserve.frontends.http.generate import serve_generate
from pdserve.frontends.http.status import (
    HTTP_STATUS,
    BodyTimeoutError,
    BodyTooLargeError,
    HttpError,
    MethodNotAllowedError,
)
from pdserve.frontends.offload import off_loop, off_process
from pdserve.frontends.shared_memory import (
    SharedMemoryRegistry,
    cuda_unsupported,
    infer_with_shm,
    shm_output_names,
    with_shm_extension,
)
from pdserve.frontends.traffic.apis import classify_http
from pdserve.frontends.traffic.gate import header_getter
from pdserve.observability import logs

if TYPE_CHECKING:
    from pdserve.frontends.traffic.gate import TrafficGate

logger = logging.getLogger("pdserve.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Default limit on a request body, compressed and decompressed: 64 MiB.
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024

#: Default limit on the JSON of an inference request (the whole body, or the part
#: before the binary data that ``Inference-Header-Content-Length`` announces): 16 MiB.
#: Parsing JSON tensor data takes 5-20 times the body's size in memory (a Python
#: object per number) and about 40 ms of CPU per MB: large tensors belong in the
#: binary tensor data extension, which costs neither.
DEFAULT_MAX_JSON_BYTES = 16 * 1024 * 1024

#: Default longest wait for the next piece of a request body, in seconds; a client
#: that stalls longer gets 408 and the connection is closed.
DEFAULT_BODY_TIMEOUT_SECS = 60.0

#: Request bodies (after decompression) over this many bytes are decoded, and
#: responses whose outputs hold more than this many bytes are encoded, on a worker
#: thread so that the event loop keeps answering other requests. Smaller ones stay
#: on the loop: a thread hop costs more than they take.
OFFLOAD_BYTES = 1 << 20

#: Request JSON (an inference request's, or a repository request's body) over this
#: many bytes is parsed in a decode process (:func:`~pdserve.frontends.offload.off_process`):
#: the parser holds the GIL for the whole parse, so a worker thread would stall the
#: event loop as much as parsing on it (about 10 ms at this size).
PROCESS_JSON_BYTES = 256 * 1024

#: A response output sent as JSON ``data`` whose array holds more than this many bytes
#: is written to JSON in a decode process (:func:`encode_json_off_loop`): as when
#: parsing, the encoder holds the GIL for the whole array (about 10 ms at this size,
#: 0.3 s for 8 MiB of FP32), so a worker thread would stall the event loop too.
PROCESS_JSON_OUTPUT_BYTES = 256 * 1024

#: Compressed bodies over this many bytes are decompressed on a worker thread (zlib
#: expands up to ~1000:1, so 8 KiB may become 8 MiB).
_INLINE_DECOMPRESS_BYTES = 8 * 1024

#: Above this many bytes a response with binary outputs is sent part by part (the JSON
#: header, then each output's buffer) instead of being joined into one bytes object.
_JOIN_LIMIT = 64 * 1024

_JSON = (b"content-type", b"application/json")
_OCTETS = (b"content-type", b"application/octet-stream")
_CLOSE = (b"connection", b"close")
_EMPTY_JSON_HEADERS = [_JSON, (b"content-length", b"0")]
_EMPTY_HEADERS = [(b"content-length", b"0")]
_METHOD_NOT_ALLOWED = encode_error("Method Not Allowed")
_ROUTE_KEY = ROUTE_KEY_HEADER.encode()
_PIN = PIN_HEADER.encode()
#: The (lower-case) header names :func:`parse_infer_headers` reads, each to itself.
_INFER_HEADER_KINDS = {
    name: name
    for name in (
        b"content-length",
        _ROUTE_KEY,
        _PIN,
        b"inference-header-content-length",
        b"content-encoding",
        b"traceparent",
    )
}

_D = TypeVar("_D", int, None)  # _int_header's default: an int, or None


class _ClientGoneError(Exception):
    """The client disconnected before the whole body arrived: nothing to answer."""


#: What may follow ``/v2/models/{m}[/versions/{v}]``.
_MODEL_ACTIONS = frozenset(
    ("", "ready", "config", "stats", "infer", "traffic", "rollout", "generate", "generate_stream")
)


class HttpApp:
    """The V2 REST ASGI application around one ``InferenceServer``.

    Args:
        server: the protocol-neutral core (:class:`~pdserve.core.api.InferenceCore`:
            ``live``, ``ready``, ``metadata``, ``model_metadata``, ``model_config``,
            ``model_ready``, ``async infer``, ``model_statistics``, ``repository_index``,
            ``async load_model``, ``async unload_model``). A core without the last four
            (an embedding that implements only health, metadata and inference) gets 404
            on their routes. Methods may be sync or async.
        max_request_bytes: the largest request body accepted, in bytes, before and
            after ``Content-Encoding`` decompression; larger ones get 413.
        body_timeout: the longest wait, in seconds, for the next piece of a request
            body; a client that stalls longer gets 408 and the connection is closed.
            ``None`` or 0 waits forever.
        max_json_bytes: the largest JSON part of an inference request, in bytes (the
            whole body, after decompression, when it has no binary data; the
            ``Inference-Header-Content-Length`` part when it has); larger ones get 413.
            Binary tensor data counts only against ``max_request_bytes``.
        gate: restricted APIs, auth and rate limits
            (:class:`~pdserve.frontends.traffic.gate.TrafficGate`), checked at each
            request's entry; None (or a gate with nothing configured): no check.
        shared_memory: the system shared-memory regions
            (:class:`~pdserve.frontends.shared_memory.SharedMemoryRegistry`, shared with
            gRPC); None: a disabled one (the endpoints answer 501).
    """

    def __init__(
        self,
        server: InferenceCore,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        body_timeout: float | None = DEFAULT_BODY_TIMEOUT_SECS,
        max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
        gate: TrafficGate | None = None,
        shared_memory: SharedMemoryRegistry | None = None,
    ) -> None:
        self.server = server
        self.shm = shared_memory if shared_memory is not None else SharedMemoryRegistry()
        self.gate = gate if gate is not None and gate.active else None
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout or None
        self.max_json_bytes = max_json_bytes
        self._infer = server.infer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI 3 entry point: ``http`` scopes are served, ``lifespan`` acknowledged."""
        kind = scope["type"]
        if kind != "http":
            if kind == "lifespan":
                await _lifespan(receive, send)
            return
        path: str = scope["path"]
        method: str = scope["method"]
        try:
            if self.gate is not None:
                await self._check_gate(scope, path)
            if method == "POST" and path.endswith("/infer") and path.startswith("/v2/models/"):
                parts = path.split("/")
                n = len(parts)
                if n == 5:
                    await self._handle_infer(scope, receive, send, parts[3], "")
                    return
                if n == 7 and parts[4] == "versions" and parts[5]:
                    await self._handle_infer(scope, receive, send, parts[3], parts[5])
                    return
            await self._route(scope, receive, send, path, method)
        except _ClientGoneError:
            return
        except Exception as exc:  # noqa: BLE001 - one request must not take the server down
            if connection_closed(receive):
                # nobody to answer (e.g. the answer's own write failed: the client left
                # while a pipelined request waited, which uvicorn does not flag); flag
                # it, or uvicorn logs "ASGI callable returned without completing
                # response" at ERROR for a response begun and not ended
                mark_disconnected(receive)
                logger.debug(
                    "%s %s: the connection closed before the answer: %r", method, path, exc
                )
                return
            status, body, headers = error_answer(exc, method, path)
            try:
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            except RuntimeError as e:  # the response had started: the error cannot be sent
                logger.warning("%s %s failed after its answer began (%s): %r", method, path, e, exc)
        finally:
            release_disconnect_hook(receive)

    async def _check_gate(self, scope: Scope, path: str) -> None:
        """Restricted APIs, auth and rate limits for this request (raises when refused)."""
        await self.check_gate(path, scope["headers"])

    async def check_gate(self, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        """Restricted APIs, auth and rate limits for a request to ``path`` with these
        ``(lower-case name, value)`` headers (raises InferError when refused)."""
        assert self.gate is not None
        category, model = classify_http(path)
        await self.gate.check("http", category, model, header_getter(headers))

    # ----------------------------------------------------------------- inference

    async def _handle_infer(
        self, scope: Scope, receive: Receive, send: Send, model: str, version: str
    ) -> None:
        """``POST /v2/models/{m}[/versions/{v}]/infer`` [V2 "Inference"], with Triton's
        binary tensor extension and gzip/deflate request bodies (the ASGI side of
        :meth:`infer_body`)."""
        arrival_ns = time.monotonic_ns()
        if not model:
            raise InferError("missing model name in the inference request path")
        head = parse_infer_headers(scope["headers"])
        content_length, encoding, header_length = head[0], head[1], head[2]
        if header_length is None:
            body = await self._read_body(receive, content_length, encoding, json=True)
        else:
            if header_length > self.max_json_bytes:
                raise BodyTooLargeError(self._json_limit_message(header_length, "of"))
            body = await self._read_body(receive, content_length, encoding)
        parts, json_length, total = await self.infer_body(
            body, head, model, version, arrival_ns, functools.partial(disconnect_token, receive)
        )
        if json_length is None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [_JSON, (b"content-length", b"%d" % total)],
                }
            )
            await send({"type": "http.response.body", "body": parts[0]})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    _OCTETS,
                    (b"inference-header-content-length", b"%d" % json_length),
                    (b"content-length", b"%d" % total),
                ],
            }
        )
        if total <= _JOIN_LIMIT:
            await send({"type": "http.response.body", "body": b"".join(parts)})
            return
        last = len(parts) - 1
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i != last})

    async def infer_body(
        self,
        body: bytes,
        head: InferHeaders,
        model: str,
        version: str,
        arrival_ns: int,
        cancel_token: Callable[[], CancelToken],
    ) -> tuple[list[Any], int | None, int]:
        """The transport-neutral body of an inference request: decode the (read and
        decompressed) ``body``, run it (with the shared-memory extension), encode the
        response. The ASGI app and the native transport
        (:mod:`pdserve.frontends.http.native`) both call it.

        Args:
            body: the whole request body, decompressed (bytes or bytearray).
            head: :func:`parse_infer_headers` of the request's headers.
            model / version: from the path (version "" for the policy's choice).
            arrival_ns: ``time.monotonic_ns()`` when the request arrived.
            cancel_token: called once the body is decoded; returns the request's
                :class:`~pdserve.core.cancel.CancelToken` (cancelled when the client goes).

        Returns:
            ``(parts, json_length, total)``: the response body's parts (bytes-like),
            None or the ``Inference-Header-Content-Length`` (binary outputs), and the
            total byte count. JSON-only responses have one part.

        Raises:
            InferError: bad request or failed inference (mapped with
                :data:`~pdserve.frontends.http.status.HTTP_STATUS`).
        """
        request = self.decode_inline(body, head, model, version, arrival_ns, cancel_token)
        if request is None:  # a large body: decoded off the loop
            header_length = head[2]
            json_size = len(body) if header_length is None else header_length
            if json_size > PROCESS_JSON_BYTES:
                request = await off_process(
                    decode_infer_request, body, header_length, model, version, arrival_ns
                )
            else:
                request = await off_loop(
                    decode_infer_request, body, header_length, model, version, arrival_ns
                )
            admit(request, "HTTP", cancel_token(), head[3], head[4], head[5])
        response = await self.run_decoded(request)
        encoded = self.encode_inline(response, request)
        if encoded is None:
            encoded = await self.encode_large(response, request)
        return encoded

    # infer_body's steps, which the native transport also calls one by one: its
    # request task then awaits run_decoded's coroutine itself, one coroutine level
    # fewer than awaiting infer_body (each level is walked when the request suspends
    # on the batcher and again when it resumes: ~0.4 CPU-us per request, measured).

    def decode_inline(
        self,
        body: bytes,
        head: InferHeaders,
        model: str,
        version: str,
        arrival_ns: int,
        cancel_token: Callable[[], CancelToken],
    ) -> InferRequest | None:
        """:meth:`infer_body`'s decoding of a body small enough to decode on the event
        loop (the request then has its token and log ids); None for a larger one.

        Raises:
            InferError: a bad request (as :func:`decode_infer_request`).
        """
        header_length = head[2]
        json_size = len(body) if header_length is None else header_length
        if json_size > PROCESS_JSON_BYTES or len(body) > OFFLOAD_BYTES:
            return None
        request = decode_infer_request(body, header_length, model, version, arrival_ns)
        admit(request, "HTTP", cancel_token(), head[3], head[4], head[5])
        return request

    def run_decoded(self, request: InferRequest) -> Coroutine[Any, Any, InferResponse]:
        """The server's coroutine for a decoded request (with the shared-memory
        extension when the request uses it): ``await app.run_decoded(request)``."""
        shm_outputs = shm_output_names(request) if request.outputs else None
        if request.shm_inputs is None and shm_outputs is None:
            return self._infer(request)
        # Triton's system shared-memory extension
        return infer_with_shm(self.shm, request, self._infer, shm_outputs)

    def encode_inline(
        self, response: InferResponse, request: InferRequest
    ) -> tuple[list[Any], int | None, int] | None:
        """:meth:`infer_body`'s result for a response small enough to encode on the
        event loop at once; None for a larger one (see :meth:`encode_large`)."""
        size = _outputs_nbytes(response)
        if size > PROCESS_JSON_OUTPUT_BYTES or size > OFFLOAD_BYTES:
            return None
        return encode_infer_response_parts(response, request)

    async def encode_large(
        self, response: InferResponse, request: InferRequest
    ) -> tuple[list[Any], int | None, int]:
        """:meth:`infer_body`'s result for any response: large JSON outputs encoded in
        a process, a large response encoded off the event loop."""
        size = _outputs_nbytes(response)
        # No output can pass PROCESS_JSON_OUTPUT_BYTES when they all hold less together:
        # the common small response skips that coroutine and its output scan.
        encoded = (
            await encode_json_off_loop(response, request)
            if size > PROCESS_JSON_OUTPUT_BYTES
            else None
        )
        if size <= OFFLOAD_BYTES:
            return encode_infer_response_parts(response, request, encoded)
        return await off_loop(encode_infer_response_parts, response, request, encoded)

    def _json_limit_message(self, size: int, qualifier: str) -> str:
        return (
            f"request JSON {qualifier} {size} bytes exceeds the limit of {self.max_json_bytes} "
            "bytes for JSON; send large tensors as binary data (the binary tensor data "
            "extension: Inference-Header-Content-Length)"
        )

    async def _read_body(
        self, receive: Receive, content_length: int, encoding: bytes, json: bool = False
    ) -> bytes:
        """Read the request body, at most ``max_request_bytes`` of it, and decompress it.

        ``json``: the body is all JSON, so ``max_json_bytes`` applies too.

        Raises:
            BodyTooLargeError: the declared, received or decompressed size is over the limit
                (reading stops there; the rest is never held in memory).
            BodyTimeoutError: no part of the body came for ``body_timeout`` seconds.
            _ClientGoneError: ``http.disconnect`` came before the end of the body.
            InferError(INVALID_ARG): a corrupt or truncated compressed body.
            UnsupportedMediaTypeError: an unsupported ``Content-Encoding``.
        """
        limit = self.max_request_bytes
        json_limit = json and self.max_json_bytes < limit
        if json_limit:
            limit = self.max_json_bytes
        if content_length > limit:
            raise BodyTooLargeError(
                self._json_limit_message(content_length, "of")
                if json_limit
                else f"request body of {content_length} bytes exceeds the limit of {limit} bytes"
            )
        # uvicorn's cycle sets ``message_event`` once body bytes are buffered: then
        # ``receive()`` returns at once and needs no timer (the small-request path).
        event = getattr(getattr(receive, "__self__", None), "message_event", None)
        timeout = self.body_timeout
        if timeout is None or (event is not None and event.is_set()):
            message = await receive()
        else:
            message = await _receive_within(receive, timeout)
        if message["type"] != "http.request":
            raise _ClientGoneError()
        body: bytes = message.get("body", b"")
        if message.get("more_body", False):
            # Grown piece by piece: joining a list of pieces at the end would copy the
            # whole body into fresh memory in one step (~40 ms for 50 MB, during which
            # the loop answers nothing). Everything that reads the body (the codec,
            # decompress, orjson) takes any buffer, so the bytearray stands for bytes.
            buf = bytearray(body)
            total = len(body)
            while True:
                if total > limit:
                    raise BodyTooLargeError(
                        self._json_limit_message(total, "of at least")
                        if json_limit
                        else f"request body of at least {total} bytes exceeds the limit of "
                        f"{limit} bytes"
                    )
                if timeout is None:
                    message = await receive()
                else:
                    message = await _receive_within(receive, timeout)
                if message["type"] != "http.request":
                    raise _ClientGoneError()
                chunk = message.get("body", b"")
                if chunk:
                    buf += chunk
                    total += len(chunk)
                if not message.get("more_body", False):
                    break
            body = cast(bytes, buf)
        return await self.finish_body(body, encoding, json)

    def body_limit(self, json: bool) -> int:
        """The most bytes a request body may hold (``json``: all of it is JSON)."""
        if json and self.max_json_bytes < self.max_request_bytes:
            return self.max_json_bytes
        return self.max_request_bytes

    def body_too_large(self, size: int, json: bool, qualifier: str = "of") -> BodyTooLargeError:
        """The 413 for a body of ``size`` bytes over :meth:`body_limit`."""
        if json and self.max_json_bytes < self.max_request_bytes:
            return BodyTooLargeError(self._json_limit_message(size, qualifier))
        return BodyTooLargeError(
            f"request body {qualifier} {size} bytes exceeds the limit of "
            f"{self.max_request_bytes} bytes"
        )

    async def finish_body(self, body: bytes, encoding: bytes, json: bool = False) -> bytes:
        """Check a whole received ``body`` against :meth:`body_limit` and undo its
        ``Content-Encoding`` (``encoding``: the header's value, b"" for none); shared by
        the ASGI app and the native transport.

        Raises:
            BodyTooLargeError: over the limit, before or after decompression.
            InferError(INVALID_ARG): a corrupt or truncated compressed body.
            UnsupportedMediaTypeError: an unsupported ``Content-Encoding``.
        """
        limit = self.body_limit(json)
        if len(body) > limit:
            raise self.body_too_large(len(body), json)
        if encoding:
            codings = parse_encoding(encoding)
            if codings:
                if len(body) <= _INLINE_DECOMPRESS_BYTES:
                    body = decompress(body, codings, limit)
                else:
                    body = await off_loop(decompress, body, codings, limit)
        return body

    # ----------------------------------------------------------------- other routes

    async def _route(
        self, scope: Scope, receive: Receive, send: Send, path: str, method: str
    ) -> None:
        """Everything but the inference fast path; see the module docstring's table."""
        parts = path.split("/")
        n = len(parts)
        if n < 2 or parts[0] != "" or parts[1] != "v2":
            raise not_found(f"no route for {path}")
        if n == 2:
            _check_method(method, "GET")
            meta = with_shm_extension(await _call(self.server.metadata), self.shm)
            await _send_json(send, 200, _dumps(meta))
            return
        section = parts[2]
        if section == "logging" and n == 3:
            await self._logging(receive, send, scope, method)
            return
        if section == "openapi.json" and n == 3:
            _check_method(method, "GET")
            await _send_json(send, 200, openapi_document())
            return
        if section == "health" and n == 4 and parts[3] in ("live", "ready"):
            _check_method(method, "GET")
            probe = self.server.live if parts[3] == "live" else self.server.ready
            ok = bool(await _call(probe))
            await send(
                {
                    "type": "http.response.start",
                    "status": 200 if ok else 400,
                    "headers": _EMPTY_HEADERS,
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        if (section == "trace" and n == 4 and parts[3] == "setting") or (
            section == "models" and n == 6 and parts[4] == "trace" and parts[5] == "setting"
        ):
            await self._trace_setting(receive, send, scope, method, parts[3] if n == 6 else "")
            return
        if section == "models" and n >= 4:
            if n == 4 and parts[3] == "stats":
                _check_method(method, "GET")
                stats = self._optional("model_statistics", "the statistics extension")
                await _send_json(send, 200, _dumps(await _call(stats, "", "")))
                return
            await self._model_route(scope, receive, send, parts, method, path)
            return
        if section in ("systemsharedmemory", "cudasharedmemory"):
            await self._shared_memory(receive, send, scope, parts, method, path)
            return
        if section == "repository":
            if n == 4 and parts[3] == "index":
                _check_method(method, "POST")
                await self._repository_index(receive, send, scope)
                return
            if n == 6 and parts[3] == "models" and parts[5] in ("load", "unload"):
                _check_method(method, "POST")
                if not parts[4]:
                    raise InferError("missing model name in the repository request path")
                doc = await self._read_json_object(receive, scope)
                if parts[5] == "load":
                    await self._load(parts[4], doc)
                else:
                    await self._unload(parts[4], doc)
                await send(
                    {"type": "http.response.start", "status": 200, "headers": _EMPTY_JSON_HEADERS}
                )
                await send({"type": "http.response.body", "body": b""})
                return
        raise not_found(f"no route for {path}")

    async def _model_route(
        self, scope: Scope, receive: Receive, send: Send, parts: list[str], method: str, path: str
    ) -> None:
        """``/v2/models/{m}[/versions/{v}][/ready|/config|/stats|/infer]``."""
        n = len(parts)
        model = parts[3]
        version = ""
        rest = 4
        if n >= 6 and parts[4] == "versions":
            version = parts[5]
            if not version:
                raise InferError(f"empty model version in the request path {path}")
            rest = 6
        if n == rest:
            action = ""
        elif n == rest + 1:
            action = parts[rest]
        else:
            raise not_found(f"no route for {path}")
        if action not in _MODEL_ACTIONS:
            raise not_found(f"no route for {path}")
        if not model:
            raise InferError("missing model name in the request path")
        if action in ("traffic", "rollout") and rest == 4:
            await self._traffic_route(scope, receive, send, model, action, method)
            return
        if action == "infer":
            _check_method(method, "POST")
            await self._handle_infer(scope, receive, send, model, version)
            return
        if action in ("generate", "generate_stream"):  # Triton's generate extension
            _check_method(method, "POST")
            doc = await self._read_json_object(receive, scope)
            await serve_generate(
                self.server, doc, receive, send, model, version, action == "generate_stream"
            )
            return
        _check_method(method, "GET")
        server = self.server
        if action == "":
            body = _dumps(await _call(server.model_metadata, model, version))
        elif action == "config":
            body = _dumps(await _call(server.model_config, model, version))
        elif action == "stats":
            stats = self._optional("model_statistics", "the statistics extension")
            body = _dumps(await _call(stats, model, version))
        else:  # ready
            if not await _call(server.model_ready, model, version):
                raise InferError("Model version not ready")
            body = b""
        await _send_json(send, 200, body)

    async def _shared_memory(
        self, receive: Receive, send: Send, scope: Scope, parts: list[str], method: str, path: str
    ) -> None:
        """Triton's shared-memory extension: ``/v2/systemsharedmemory[/region/{r}]/status``
        (GET), ``.../register`` (POST ``{key, offset, byte_size}``),
        ``[/region/{r}]/unregister`` (POST; no region: all). CUDA shared memory
        (``/v2/cudasharedmemory/...``) answers 501 (:func:`cuda_unsupported`)."""
        n = len(parts)
        if n == 4:
            region, action = "", parts[3]
        elif n == 6 and parts[3] == "region" and parts[4]:
            region, action = parts[4], parts[5]
        else:
            raise not_found(f"no route for {path}")
        if action not in ("status", "register", "unregister") or (
            action == "register" and not region
        ):
            raise not_found(f"no route for {path}")
        _check_method(method, "GET" if action == "status" else "POST")
        if parts[2] == "cudasharedmemory":
            raise cuda_unsupported()
        shm = self.shm
        body = b""
        if action == "status":
            body = _dumps(await _call(shm.status, region))
        elif action == "register":
            doc = await self._read_json_object(receive, scope)
            args = (region, doc.get("key"), doc.get("offset", 0), doc.get("byte_size"))
            await _call(shm.register, *args)  # awaitable in an --http-workers worker
        else:
            await _call(shm.unregister, region)
        await _send_json(send, 200, body)

    async def _logging(self, receive: Receive, send: Send, scope: Scope, method: str) -> None:
        """``GET /v2/logging`` (the settings) and ``POST /v2/logging`` (change some,
        answer all): Triton's logging extension (:mod:`pdserve.observability.logs`).
        A bad name or type is a 400 and changes nothing."""
        if method not in ("GET", "POST"):
            raise _WrongMethodError("GET, POST")
        update = await self._read_json_object(receive, scope) if method == "POST" else None
        hook = getattr(self.server, "log_settings", None)  # an --http-workers worker's core
        if hook is not None:
            body = _dumps(await hook(update))
        elif update is not None:
            body = _dumps(logs.update_settings(update))
        else:
            body = _dumps(logs.settings_dict())
        await _send_json(send, 200, body)

    async def _traffic_route(
        self, scope: Scope, receive: Receive, send: Send, model: str, action: str, method: str
    ) -> None:
        """``GET|POST /v2/models/{m}/traffic`` and ``/v2/models/{m}/rollout``: traffic
        control's admin endpoints (:mod:`pdserve.repository.rollout`). Admin requests:
        an auth layer classifies them as the ``model-repository`` API."""
        if method not in ("GET", "POST"):
            raise _WrongMethodError("GET, POST")
        control = getattr(self.server, "traffic", None)
        if control is None:
            raise not_found("this server does not support traffic control")
        if method == "GET":
            describe = control.describe_traffic if action == "traffic" else control.describe_rollout
            body = _dumps(await _call(describe, model))
        else:
            doc = await self._read_json_object(receive, scope)
            change = control.set_traffic if action == "traffic" else control.rollout_action
            body = _dumps(await _call(change, model, doc))
        await _send_json(send, 200, body)

    async def _repository_index(self, receive: Receive, send: Send, scope: Scope) -> None:
        """``POST /v2/repository/index`` with an optional ``{"ready": bool}`` body."""
        index = self._optional("repository_index", "the model repository extension")
        doc = await self._read_json_object(receive, scope)
        ready = doc.get("ready", False)
        if type(ready) is not bool:
            raise InferError("repository index 'ready' must be true or false")
        await _send_json(send, 200, _dumps(await _call(index, ready)))

    async def _load(self, model: str, doc: dict[str, Any]) -> None:
        """Load request body (Triton model repository extension):
        ``{"parameters": {"config": "<json>", "file:<path>": "<base64>"}}``.

        The server gets ``config`` (str or None) and ``files`` mapping ``<path>`` (the
        part after ``file:``, e.g. ``1/model.onnx``) to the decoded bytes.
        """
        load = self._optional("load_model", "model control")
        params = doc.get("parameters", {})
        if type(params) is not dict:
            raise InferError("load request 'parameters' must be a JSON object")
        config: str | None = None
        files: dict[str, bytes] = {}
        for key, value in params.items():
            if type(value) is not str:
                raise InferError(f"load parameter '{key}' must be a string")
            if key == "config":
                config = value
            elif key.startswith("file:"):
                try:
                    files[key[5:]] = base64.b64decode(value, validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise InferError(f"load parameter '{key}' is not valid base64: {exc}") from None
            else:
                raise InferError(
                    f"unknown load parameter '{key}'; expected 'config' or 'file:<path>'"
                )
        await _call(load, model, config, files)

    async def _unload(self, model: str, doc: dict[str, Any]) -> None:
        """Unload request body: ``{"parameters": {"unload_dependents": bool}}``."""
        unload = self._optional("unload_model", "model control")
        params = doc.get("parameters", {})
        if type(params) is not dict:
            raise InferError("unload request 'parameters' must be a JSON object")
        dependents = params.get("unload_dependents", False)
        if type(dependents) is not bool:
            raise InferError("unload parameter 'unload_dependents' must be true or false")
        await _call(unload, model, dependents)

    async def _read_json_object(self, receive: Receive, scope: Scope) -> dict[str, Any]:
        """Read a small JSON-object body; an empty body is ``{}``."""
        content_length = -1
        encoding = b""
        for key, value in scope["headers"]:
            if key == b"content-length":
                content_length = _int_header(value, -1)
            elif key == b"content-encoding":
                encoding = value if not encoding else encoding + b"," + value
        body = await self._read_body(receive, content_length, encoding)
        if not body.strip():
            return {}
        if len(body) <= PROCESS_JSON_BYTES:
            return parse_json_object(body)
        doc: dict[str, Any] = await off_process(parse_json_object, body)
        return doc

    async def _trace_setting(
        self, receive: Receive, send: Send, scope: Scope, method: str, model: str
    ) -> None:
        """``GET/POST /v2[/models/{m}]/trace/setting``: Triton's trace extension."""
        if method not in ("GET", "POST"):
            raise _WrongMethodError("GET, POST")
        setting = self._optional("trace_setting", "the trace extension")
        update = await self._read_json_object(receive, scope) if method == "POST" else None
        await _send_json(send, 200, _dumps(await _call(setting, model, update)))

    def _optional(self, name: str, what: str) -> Callable[..., Any]:
        method = getattr(self.server, name, None)
        if method is None:
            raise not_found(f"this server does not support {what}")
        return method


#: :func:`parse_infer_headers`'s result: ``(content_length, content_encoding,
#: inference_header_content_length, traceparent, route_key, pinned_version)``
#: (-1 / b"" / None / None / b"" / b"" when absent).
InferHeaders = tuple[int, bytes, "int | None", "bytes | None", bytes, bytes]


def _outputs_nbytes(response: InferResponse) -> int:
    """The bytes a response's output arrays hold together (an output that is not an
    array, which the encoder converts, counts as small)."""
    size = 0
    try:
        for arr in response.outputs.values():
            size += arr.nbytes
    except AttributeError:
        pass
    return size


def parse_infer_headers(headers: list[tuple[bytes, bytes]]) -> InferHeaders:
    """The headers an inference request uses, from ASGI-style ``(lower-case name,
    value)`` pairs (see :data:`InferHeaders`); repeated ``Content-Encoding`` values
    are joined with commas.

    Raises:
        InferError(INVALID_ARG): ``Inference-Header-Content-Length`` is not a
            non-negative integer.
    """
    header_length: int | None = None
    content_length = -1
    encoding = b""
    traceparent: bytes | None = None
    route_key = pinned = b""
    kinds = _INFER_HEADER_KINDS
    for key, value in headers:
        # one dict lookup passes over the headers not used here (Host, Content-Type,
        # User-Agent...) rather than a comparison with each name used
        kind = kinds.get(key)
        if kind is None:
            continue
        if kind == b"content-length":
            content_length = _int_header(value, -1)
        elif kind == _ROUTE_KEY:  # traffic control (frontends.admission)
            route_key = value
        elif kind == _PIN:
            pinned = value
        elif kind == b"inference-header-content-length":
            header_length = _int_header(value, None)
            if header_length is None or header_length < 0:
                raise InferError(
                    "Inference-Header-Content-Length must be a non-negative integer, "
                    f"got {value.decode('latin-1')!r}"
                )
        elif kind == b"content-encoding":
            encoding = value if not encoding else encoding + b"," + value
        else:  # traceparent
            traceparent = value
    return content_length, encoding, header_length, traceparent, route_key, pinned


def error_answer(
    exc: BaseException, method: str = "", path: str = ""
) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """The HTTP answer to an exception raised while serving ``method path``:
    ``(status, body, headers)``, the body ``{"error": message}`` and the headers
    including ``content-type`` and ``content-length`` (and ``connection: close``
    for an :class:`~pdserve.frontends.http.status.HttpError` that closes).
    InferError: :data:`~pdserve.frontends.http.status.HTTP_STATUS` of its code (with
    its ``http_headers`` and ``Retry-After``); HttpError: its own status (405 with
    ``Allow``); anything else: 500, logged with its traceback. Shared by the ASGI app
    and the native transport."""
    extra: list[tuple[bytes, bytes]] | None = None
    close = False
    if isinstance(exc, InferError):
        status = HTTP_STATUS[exc.code]
        body = encode_error(exc.message)
        extra = getattr(exc, "http_headers", None)
        retry = getattr(exc, "retry_after", None)
        if retry is not None:  # 429 (rate limit), 503 (open circuit breaker)
            extra = [*(extra or ()), (b"retry-after", b"%d" % retry)]
    elif isinstance(exc, HttpError):  # 405, 408, 413, 415: HTTP's own errors
        status = exc.status
        body = encode_error(exc.message)
        close = exc.close
        allow = getattr(exc, "allow", None)  # 405 names the method the path takes
        if allow:
            extra = [(b"allow", allow.encode("latin-1"))]
    else:
        logger.error("error serving %s %s", method, path, exc_info=exc)
        status = 500
        body = encode_error(f"{type(exc).__name__}: {exc}")
    headers = [_JSON, (b"content-length", b"%d" % len(body))]
    if close:
        headers.append(_CLOSE)
    if extra:
        headers.extend(extra)
    return status, body, headers


async def encode_json_off_loop(
    response: InferResponse, request: InferRequest
) -> dict[str, bytes] | None:
    """The JSON text of each large output sent as JSON ``data``, written in decode
    processes (:func:`~pdserve.frontends.http.codec.output_data_json`), for
    :func:`~pdserve.frontends.http.codec.encode_infer_response_parts`'s ``encoded``.

    Outputs whose array holds more than :data:`PROCESS_JSON_OUTPUT_BYTES` are
    encoded there (arrays travel as out-of-band buffers); smaller ones and binary ones
    are left to the caller. The bytes are those the in-process encoder writes.

    Returns:
        output name -> JSON text, or None when no output is that large.

    Raises:
        InferError: as the encoder (a BYTES element that is not UTF-8), or
            UNAVAILABLE when a decode process died during the call.
    """
    large = [
        name
        for name in json_output_names(response, request)
        if getattr(response.outputs[name], "nbytes", 0) > PROCESS_JSON_OUTPUT_BYTES
    ]
    if not large:
        return None
    texts = await asyncio.gather(
        *(off_process(output_data_json, response.outputs[name], name) for name in large)
    )
    return dict(zip(large, texts, strict=True))


@functools.cache
def openapi_document() -> bytes:
    """The OpenAPI 3.0 description of this API (``openapi.json`` next to this module),
    served at ``GET /v2/openapi.json``."""
    return (importlib.resources.files(__package__) / "openapi.json").read_bytes()


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Parse a request body that must be a JSON object (repository requests).

    Raises:
        InferError(INVALID_ARG): not JSON, or not an object.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InferError(f"failed to parse the request JSON: {exc}") from None
    if type(doc) is not dict:
        raise InferError("the request body must be a JSON object")
    return doc


def create_http_app(
    server: InferenceCore,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT_SECS,
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
    gate: TrafficGate | None = None,
    shared_memory: SharedMemoryRegistry | None = None,
) -> HttpApp:
    """Build the V2 REST ASGI application for ``server``.

    Args:
        server: the core (:class:`~pdserve.core.api.InferenceCore`; see :class:`HttpApp`).
        max_request_bytes: request body limit in bytes (compressed and decompressed);
            default 64 MiB. Larger bodies get 413 and the connection is closed.
        body_timeout: seconds to wait for each next piece of a request body (default
            60); a stalled client gets 408 and the connection is closed. ``None`` or 0:
            no limit.
        max_json_bytes: limit in bytes on the JSON part of an inference request
            (default 16 MiB; see :class:`HttpApp`); larger ones get 413.
        gate: restricted APIs, auth and rate limits (see :class:`HttpApp`).
        shared_memory: the system shared-memory registry (see :class:`HttpApp`).

    Returns:
        An ASGI 3 callable ``app(scope, receive, send)``.
    """
    return HttpApp(server, max_request_bytes, body_timeout, max_json_bytes, gate, shared_memory)


# --------------------------------------------------------------------------- helpers


async def _send_json(
    send: Send,
    status: int,
    body: bytes,
    close: bool = False,
    allow: str | None = None,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Send a whole ``application/json`` response (``allow``: the ``Allow`` header of a
    405; ``extra``: more headers, e.g. ``WWW-Authenticate``, ``Retry-After``)."""
    headers = [_JSON, (b"content-length", b"%d" % len(body))]
    if close:
        headers.append(_CLOSE)
    if allow:
        headers.append((b"allow", allow.encode("latin-1")))
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


async def _call(func: Callable[..., Any], *args: Any) -> Any:
    """Call a server method that may be sync or async."""
    result = func(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


class _WrongMethodError(MethodNotAllowedError):
    """405 with the method the path takes, for the ``Allow`` header RFC 9110 requires."""

    def __init__(self, allow: str) -> None:
        super().__init__("Method Not Allowed")
        self.allow = allow


def _check_method(method: str, allowed: str) -> None:
    if method != allowed:
        raise _WrongMethodError(allowed)


def _int_header(value: bytes, default: _D) -> int | _D:
    try:
        return int(value)
    except ValueError:
        return default


def _disconnect_probe(receive: Receive) -> Callable[[], bool] | None:
    """A zero-cost "has the client gone?" callable, or ``None``.

    uvicorn hands the app ``RequestResponseCycle.receive``; the cycle's ``disconnected``
    flag turns true when the connection is lost before the response completes. Other
    ASGI servers: ``None`` (a background ``receive()`` task per request would cost
    more than the check is worth on small models).
    """
    cycle = getattr(receive, "__self__", None)
    if cycle is not None and hasattr(cycle, "disconnected"):
        return functools.partial(getattr, cycle, "disconnected")
    return None


class _DisconnectEvent(asyncio.Event):
    """uvicorn's per-request ``message_event``, which also cancels the request's token
    the moment uvicorn marks the connection lost (``connection_lost`` sets
    ``cycle.disconnected`` then this event): a push, no task or poll per request."""

    def __init__(self, cycle: Any, token: CancelToken) -> None:
        super().__init__()
        self._cycle: Any = cycle
        self._token: Any = token

    def set(self) -> None:
        super().set()
        cycle, token = self._cycle, self._token
        if cycle is not None and cycle.disconnected and not token.finished:
            token.cancel(client_gone())

    def release(self) -> None:
        """The request is answered: drop the cycle and the token. The cycle holds this
        event and the token's probe holds the cycle, so keeping them would leave a
        reference cycle per request for the garbage collector (measured under wrk: ~12
        objects per request, gen-0 collections of ~40,000 objects taking ~90 ms)."""
        self._cycle = self._token = None


def connection_closed(receive: Receive) -> bool:
    """Whether the request's connection is gone, under uvicorn (``receive`` is
    ``RequestResponseCycle.receive``: its ``disconnected`` flag, or its transport closing);
    False under other ASGI servers."""
    cycle = getattr(receive, "__self__", None)
    if getattr(cycle, "disconnected", False):
        return True
    transport = getattr(cycle, "transport", None)
    return transport is not None and bool(transport.is_closing())


def mark_disconnected(receive: Receive) -> None:
    """Under uvicorn, set the request cycle's ``disconnected`` flag (the client is gone:
    a response begun and not ended is then not logged as the app's error)."""
    cycle = getattr(receive, "__self__", None)
    if cycle is not None and hasattr(cycle, "disconnected"):
        cycle.disconnected = True


def release_disconnect_hook(receive: Receive) -> None:
    """Release the request's :class:`_DisconnectEvent`, if :func:`disconnect_token`
    installed one on uvicorn's cycle (called once the request is answered)."""
    hook = getattr(getattr(receive, "__self__", None), "message_event", None)
    if type(hook) is _DisconnectEvent:
        hook.release()


def disconnect_token(receive: Receive) -> CancelToken:
    """The request's :class:`~pdserve.core.cancel.CancelToken`, cancelled with
    ``CLIENT_GONE`` as soon as the client disconnects.

    Under uvicorn (``receive`` is ``RequestResponseCycle.receive``) the cycle's
    ``message_event`` is swapped for :class:`_DisconnectEvent` once the body has been
    read, and reading resumes, so the disconnect is pushed; the ``disconnected`` flag
    stays the token's probe. Other ASGI servers: a token without a probe (timeouts only).
    """
    probe = _disconnect_probe(receive)
    token = CancelToken(probe)
    cycle = getattr(receive, "__self__", None)
    event = getattr(cycle, "message_event", None)
    if probe is not None and isinstance(event, asyncio.Event):
        hook = _DisconnectEvent(cycle, token)
        if event.is_set():
            asyncio.Event.set(hook)
        cycle.message_event = hook  # type: ignore[union-attr]  # uvicorn's cycle
        # uvicorn pauses reading while a large body waits in its buffer; the body is
        # read now: read on, or a client's close would go unseen (as uvicorn does when
        # an app awaits ``http.disconnect``; a pipelined request pauses it again)
        flow = getattr(cycle, "flow", None)
        if flow is not None and not getattr(cycle, "disconnected", False):
            flow.resume_reading()
    return token


async def _receive_within(receive: Receive, timeout: float) -> Message:
    """``await receive()``, giving up after ``timeout`` seconds with 408."""
    try:
        async with asyncio.timeout(timeout):
            return await receive()
    except TimeoutError:
        raise BodyTimeoutError(
            f"the request body did not arrive: nothing received for {timeout:g} seconds"
        ) from None


async def _lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge ASGI lifespan events (the server's lifecycle is the CLI's job)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
