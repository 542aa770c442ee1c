"""The V2 REST handlers (:class:`HttpApp`): a request's method, path, headers and body
in, an :class:`~pdserve.frontends.http.answer.Answer` out, through one entry point
(:meth:`HttpApp.handle`) that both transports call: the native one
(:mod:`~pdserve.frontends.http.native`) and ASGI (:mod:`~pdserve.frontends.http.asgi`,
under uvicorn; an ``HttpApp`` is itself the ASGI callable). One exception: the native
transport runs a small inference request's steps (:meth:`HttpApp.decode_inline`,
:meth:`~HttpApp.run_decoded`, :meth:`~HttpApp.encode_inline`) from its own task, without
``handle``'s routing (its route is cached). Inference is handled here; the other routes
are in :mod:`~pdserve.frontends.http.routes` and :mod:`~pdserve.frontends.http.generate`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from pdserve.core import timing as timing_mod
from pdserve.core.api import InferenceCore
from pdserve.core.cancel import CancelToken
from pdserve.core.errors import InferError, not_found
from pdserve.core.types import InferRequest, InferResponse
from pdserve.frontends.admission import PIN_HEADER, ROUTE_KEY_HEADER, admit
from pdserve.frontends.http import routes
from pdserve.frontends.http.answer import (
    JSON,
    OCTETS,
    Answer,
    Exchange,
    Headers,
    check_method,
    json_answer,
)
from pdserve.frontends.http.asgi import Receive, Scope, Send, serve_asgi
from pdserve.frontends.http.body import PROCESS_JSON_BYTES, BodyLimits, read_json_object
from pdserve.frontends.http.decode import decode_infer_request
from pdserve.frontends.http.encode import (
    encode_infer_response_parts,
    json_output_names,
    output_data_json,
)
from pdserve.frontends.http.generate import serve_generate
from pdserve.frontends.offload import off_loop, off_process
from pdserve.frontends.openai import routes as openai_routes
from pdserve.frontends.shared_memory import (
    SharedMemoryRegistry,
    infer_with_shm,
    shm_output_names,
)
from pdserve.frontends.traffic.apis import classify_http
from pdserve.frontends.traffic.gate import header_getter

if TYPE_CHECKING:
    from pdserve.frontends.traffic.gate import TrafficGate


#: Default limit on a request body, compressed and decompressed: 64 MiB.
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024

#: Default limit on the JSON of an inference request (the whole body, or the part
#: before the binary data that ``Inference-Header-Content-Length`` announces): 16 MiB.
#: Parsing JSON tensor data takes 5-20 times the body's size in memory (a Python
#: object per number): large tensors belong in the binary tensor data extension.
DEFAULT_MAX_JSON_BYTES = 16 * 1024 * 1024

#: Default longest wait for the next piece of a request body, in seconds; a client
#: that stalls longer gets 408 and the connection is closed.
DEFAULT_BODY_TIMEOUT_SECS = 60.0

#: Request bodies (after decompression) over this many bytes are decoded, and
#: responses whose outputs hold more than this many bytes are encoded, on a worker
#: thread so that the event loop keeps answering other requests. Smaller ones stay
#: on the loop: a thread hop costs more than they take.
OFFLOAD_BYTES = 1 << 20

#: A response output sent as JSON ``data`` whose array holds more than this many bytes
#: is written to JSON in a decode process (:func:`encode_json_off_loop`): as when
#: parsing, the encoder holds the GIL for the whole array, so a worker thread would
#: stall the event loop too.
PROCESS_JSON_OUTPUT_BYTES = 256 * 1024

#: Above this many bytes a response with binary outputs is sent part by part (the JSON
#: header, then each output's buffer) instead of being joined into one bytes object.
JOIN_LIMIT = 64 * 1024

_ROUTE_KEY = ROUTE_KEY_HEADER.encode()
_PIN = PIN_HEADER.encode()
_TIMING = timing_mod.HEADER.encode()
_SERVER_TIMING = timing_mod.RESPONSE_KEY.encode()
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
        _TIMING,
    )
}


#: What may follow ``/v2/models/{m}[/versions/{v}]``.
_MODEL_ACTIONS = frozenset(
    ("", "ready", "config", "stats", "infer", "traffic", "rollout", "generate", "generate_stream")
)

#: The parts of an encoded inference response, the ``Inference-Header-Content-Length``
#: (None: JSON only, one part) and the total byte count.
Encoded = tuple[list[Any], "int | None", int]


class HttpApp:
    """The V2 REST handlers around one core, and its ASGI application.

    Args:
        server: the protocol-neutral core (:class:`~pdserve.core.api.InferenceCore`). A
            core without ``model_statistics``, ``repository_index``, ``load_model`` or
            ``unload_model`` gets 404 on their routes. Methods may be sync or async.
        max_request_bytes: the largest request body, before and after
            ``Content-Encoding`` decompression; larger ones get 413.
        body_timeout: the longest wait, in seconds, for the next piece of a request
            body (408 and close after it); ``None`` or 0 waits forever.
        max_json_bytes: the largest JSON part of an inference request (the whole body
            without binary data, else the ``Inference-Header-Content-Length`` part).
        gate: restricted APIs, auth and rate limits
            (:class:`~pdserve.frontends.traffic.gate.TrafficGate`), checked at each
            request's entry; None (or a gate with nothing configured): no check.
        shared_memory: the system shared-memory regions (shared with gRPC); None: a
            disabled one (the endpoints answer 501).
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
        self.body = BodyLimits(max_request_bytes, max_json_bytes, body_timeout or None)
        self._infer = server.infer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI 3 entry point (:func:`~pdserve.frontends.http.asgi.serve_asgi`)."""
        await serve_asgi(self, scope, receive, send)

    async def handle(self, method: str, path: str, headers: Headers, exchange: Exchange) -> Answer:
        """Answer one request: ``path`` percent-decoded, ``headers`` ``(lower-case name,
        value)`` pairs, the body read through ``exchange`` by the route that takes one.

        Raises:
            InferError, HttpError: answered with :func:`~pdserve.frontends.http.answer.error_answer`.
        """
        if path.startswith("/v1/"):  # the OpenAI routes: their own gate check and errors
            return await openai_routes.handle(
                self.server, self.gate, method, path, headers, exchange
            )
        if self.gate is not None:
            await self.check_gate(path, headers)
        if method == "POST" and path.endswith("/infer") and path.startswith("/v2/models/"):
            parts = path.split("/")
            n = len(parts)
            if n == 5:
                return await self.infer(parts[3], "", headers, exchange)
            if n == 7 and parts[4] == "versions" and parts[5]:
                return await self.infer(parts[3], parts[5], headers, exchange)
        return await self._route(method, path, headers, exchange)

    async def check_gate(self, path: str, headers: Headers) -> None:
        """Restricted APIs, auth and rate limits for a request to ``path`` with these
        ``(lower-case name, value)`` headers (raises InferError when refused)."""
        assert self.gate is not None
        category, model = classify_http(path)
        await self.gate.check("http", category, model, header_getter(headers))

    # ----------------------------------------------------------------- inference

    async def infer(self, model: str, version: str, headers: Headers, exchange: Exchange) -> Answer:
        """``POST /v2/models/{m}[/versions/{v}]/infer`` [V2 "Inference"], with Triton's
        binary tensor extension and gzip/deflate request bodies."""
        arrival_ns = time.monotonic_ns()
        if not model:
            raise InferError("missing model name in the inference request path")
        head = parse_infer_headers(headers)
        header_length = head[2]
        if header_length is not None:  # 400 past the body, 413 over the JSON limit
            self.body.check_header_length(header_length, -1 if head[1] else head[0])
        body = await exchange.read_body(head[0], head[1], header_length is None)
        timing: list[timing_mod.Entry] | None = [] if timing_mod.state.enabled else None
        encoded = await self.infer_body(
            body, head, model, version, arrival_ns, exchange.cancel_token(), timing
        )
        answer = infer_answer(*encoded)
        if timing:
            answer.headers.append((_SERVER_TIMING, timing_mod.server_timing(timing).encode()))
        return answer

    async def infer_body(
        self,
        body: bytes,
        head: InferHeaders,
        model: str,
        version: str,
        arrival_ns: int,
        token: CancelToken,
        timing: list[timing_mod.Entry] | None = None,
    ) -> Encoded:
        """The transport-neutral body of an inference request: decode the (read and
        decompressed) ``body``, run it (with the shared-memory extension), encode the
        response. The ASGI app and the native transport
        (:mod:`pdserve.frontends.http.native`) both call it.

        Args:
            body: the whole request body, decompressed (bytes or bytearray).
            head: :func:`parse_infer_headers` of the request's headers.
            model / version: from the path (version "" for the policy's choice).
            arrival_ns: ``time.monotonic_ns()`` when the request arrived.
            token: the request's :class:`~pdserve.core.cancel.CancelToken` (cancelled
                when the client goes), handed to the request once it is decoded.
            timing: with ``--server-timing``, the list the request's timing entries go
                into when it asks for them (:mod:`pdserve.core.timing`); else None.

        Returns:
            ``(parts, json_length, total)``: the response body's parts (bytes-like),
            None or the ``Inference-Header-Content-Length`` (binary outputs), and the
            total byte count. JSON-only responses have one part.

        Raises:
            InferError: bad request or failed inference (mapped with
                :data:`~pdserve.frontends.http.status.HTTP_STATUS`).
        """
        request = self.decode_inline(body, head, model, version, arrival_ns, token, timing)
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
            admit(request, "HTTP", token, head[3], head[4], head[5])
            if timing is not None and timing_mod.asked(head[6], request.parameters):
                request.timing = timing
        response = await self.run_decoded(request)
        encoded = self.encode_inline(response, request)
        if encoded is None:
            encoded = await self.encode_large(response, request)
        return encoded

    # infer_body's steps, which the native transport also calls one by one (its request
    # task then awaits run_decoded's coroutine itself: one coroutine level fewer)

    def decode_inline(
        self,
        body: bytes,
        head: InferHeaders,
        model: str,
        version: str,
        arrival_ns: int,
        token: CancelToken,
        timing: list[timing_mod.Entry] | None = None,
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
        request = decode_infer_request(body, header_length, model, version, arrival_ns, True)
        admit(request, "HTTP", token, head[3], head[4], head[5])
        if timing is not None and timing_mod.asked(head[6], request.parameters):
            request.timing = timing  # --server-timing on and the request asks
        return request

    def run_decoded(self, request: InferRequest) -> Coroutine[Any, Any, InferResponse]:
        """The server's coroutine for a decoded request (with the shared-memory
        extension when the request uses it): ``await app.run_decoded(request)``."""
        shm_outputs = shm_output_names(request) if request.outputs else None
        if request.shm_inputs is None and shm_outputs is None:
            return self._infer(request)
        # Triton's system shared-memory extension
        return infer_with_shm(self.shm, request, self._infer, shm_outputs)

    def encode_inline(self, response: InferResponse, request: InferRequest) -> Encoded | None:
        """:meth:`infer_body`'s result for a response small enough to encode on the
        event loop at once; None for a larger one (see :meth:`encode_large`)."""
        size = _outputs_nbytes(response)
        if size > PROCESS_JSON_OUTPUT_BYTES or size > OFFLOAD_BYTES:
            return None
        encoded = encode_infer_response_parts(response, request)
        if request.answered is not None:
            _answered(request, response, encoded)
        return encoded

    async def encode_large(self, response: InferResponse, request: InferRequest) -> Encoded:
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
            parts = encode_infer_response_parts(response, request, encoded)
        else:
            parts = await off_loop(encode_infer_response_parts, response, request, encoded)
        if request.answered is not None:
            _answered(request, response, parts)
        return parts

    # ----------------------------------------------------------------- other routes

    async def _route(self, method: str, path: str, headers: Headers, exchange: Exchange) -> Answer:
        """Everything but the inference fast path; see the package docstring's table."""
        parts = path.split("/")
        n = len(parts)
        if n < 2 or parts[0] != "" or parts[1] != "v2":
            raise not_found(f"no route for {path}")
        core = self.server
        if n == 2:
            check_method(method, "GET")
            return await routes.server_metadata(core, self.shm)
        section = parts[2]
        if section == "logging" and n == 3:
            return await routes.logging_settings(core, method, headers, exchange)
        if section == "openapi.json" and n == 3:
            check_method(method, "GET")
            return json_answer(routes.openapi_document())
        if section == "health" and n == 4 and parts[3] in ("live", "ready"):
            check_method(method, "GET")
            return await routes.health(core, parts[3])
        if (section == "trace" and n == 4 and parts[3] == "setting") or (
            section == "models" and n == 6 and parts[4] == "trace" and parts[5] == "setting"
        ):
            model = parts[3] if n == 6 else ""
            return await routes.trace_setting(core, method, model, headers, exchange)
        if section == "models" and n >= 4:
            if n == 4 and parts[3] == "stats":
                check_method(method, "GET")
                return await routes.model_get(core, "stats", "", "")
            return await self._model_route(parts, method, path, headers, exchange)
        if section in ("systemsharedmemory", "cudasharedmemory"):
            return await routes.shared_memory(self.shm, parts, method, path, headers, exchange)
        if section == "repository":
            answer = await routes.repository(core, parts, method, headers, exchange)
            if answer is not None:
                return answer
        raise not_found(f"no route for {path}")

    async def _model_route(
        self, parts: list[str], method: str, path: str, headers: Headers, exchange: Exchange
    ) -> Answer:
        """``/v2/models/{m}[/versions/{v}][/ready|/config|/stats|/infer|...]``."""
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
            return await routes.traffic(self.server, model, action, method, headers, exchange)
        if action == "infer":
            check_method(method, "POST")
            return await self.infer(model, version, headers, exchange)
        if action in ("generate", "generate_stream"):  # Triton's generate extension
            check_method(method, "POST")
            doc = await read_json_object(exchange, headers)
            streaming = action == "generate_stream"
            return await serve_generate(self.server, doc, model, version, streaming)
        check_method(method, "GET")
        return await routes.model_get(self.server, action, model, version)


def infer_answer(parts: list[Any], json_length: int | None, total: int) -> Answer:
    """The answer of an encoded inference response (small binary ones joined)."""
    if json_length is None:
        return Answer(200, [JSON, (b"content-length", b"%d" % total)], parts[0])
    headers = [
        OCTETS,
        (b"inference-header-content-length", b"%d" % json_length),
        (b"content-length", b"%d" % total),
    ]
    if total <= JOIN_LIMIT:
        return Answer(200, headers, b"".join(parts))
    return Answer(200, headers, parts[0], parts)


#: :func:`parse_infer_headers`'s result: ``(content_length, content_encoding,
#: inference_header_content_length, traceparent, route_key, pinned_version,
#: server_timing)`` (-1 / b"" / None / None / b"" / b"" / b"" when absent).
InferHeaders = tuple[int, bytes, "int | None", "bytes | None", bytes, bytes, bytes]


def _answered(request: InferRequest, response: InferResponse, encoded: Encoded) -> None:
    """Call ``request.answered`` with the response body when it is one JSON document
    (no binary outputs, none written into shared memory), else with None."""
    parts, json_length, _ = encoded
    body = None
    if json_length is None and len(parts) == 1 and not shm_output_names(request):
        body = bytes(parts[0])
    assert request.answered is not None
    request.answered(request, response.outputs, body)


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
    route_key = pinned = timing = b""
    kinds = _INFER_HEADER_KINDS
    for key, value in headers:
        # one dict lookup passes over the headers not used here (Host, Content-Type,
        # User-Agent...) rather than a comparison with each name used
        kind = kinds.get(key)
        if kind is None:
            continue
        if kind == b"content-length":
            try:
                content_length = int(value)
            except ValueError:
                content_length = -1
        elif kind == _ROUTE_KEY:  # traffic control (frontends.admission)
            route_key = value
        elif kind == _PIN:
            pinned = value
        elif kind == _TIMING:
            timing = value
        elif kind == b"inference-header-content-length":
            try:
                header_length = int(value)
            except ValueError:
                header_length = -1
            if header_length < 0:
                raise InferError(
                    "Inference-Header-Content-Length must be a non-negative integer, "
                    f"got {value.decode('latin-1')!r}"
                )
        elif kind == b"content-encoding":
            encoding = value if not encoding else encoding + b"," + value
        else:  # traceparent
            traceparent = value
    return content_length, encoding, header_length, traceparent, route_key, pinned, timing


async def encode_json_off_loop(
    response: InferResponse, request: InferRequest
) -> dict[str, bytes] | None:
    """The JSON text of each large output sent as JSON ``data``, written in decode
    processes (:func:`~pdserve.frontends.http.encode.output_data_json`), for
    :func:`~pdserve.frontends.http.encode.encode_infer_response_parts`'s ``encoded``.

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


#: Build the V2 REST application for a core (the arguments are :class:`HttpApp`'s;
#: defaults: 64 MiB body, 16 MiB JSON, 60 s body timeout): an ASGI 3 callable, and what
#: :class:`~pdserve.frontends.http.native.NativeHttpServer` serves.
create_http_app = HttpApp
