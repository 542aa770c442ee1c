"""The V2 gRPC servicer: each RPC calls the protocol-neutral core; errors mapped at this edge."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, NoReturn, TypeVar, cast

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from tritonclient.grpc import service_pb2, service_pb2_grpc

from pdserve.config import config_from_json
from pdserve.core import timing as timing_mod
from pdserve.core.api import InferenceCore
from pdserve.core.cancel import CancelToken
from pdserve.core.errors import ErrorCode, InferError, client_gone, unavailable
from pdserve.core.streaming import StreamRequired
from pdserve.core.types import InferRequest
from pdserve.frontends.admission import admit, metadata_admission
from pdserve.frontends.grpc.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ParamValue,
    decode_inline,
    decode_off_loop,
    empty_final_requested,
    encode_inline,
    encode_off_loop,
    metadata_response,
    param_value,
    set_param,
)
from pdserve.frontends.shared_memory import (
    SharedMemoryRegistry,
    infer_with_shm,
    shm_output_names,
    with_shm_extension,
)
from pdserve.frontends.traffic.apis import INFERENCE, classify_grpc
from pdserve.frontends.traffic.gate import TrafficGate, metadata_getter
from pdserve.observability import logs

log = logging.getLogger("pdserve.grpc")

#: ErrorCode -> gRPC status: the one table of the gRPC frontend. Triton's codes as
#: Triton's gRPC frontend maps them (triton-inference-server/server
#: ``src/grpc/grpc_utils.cc``, ``ToGrpcStatusCode``); pdserve's extensions as their
#: Triton code (:attr:`ErrorCode.triton_code`).
GRPC_STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.CLIENT_GONE: grpc.StatusCode.CANCELLED,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


#: Response parameter: this is the request's last response (Triton's name).
_FINAL_PARAM = "triton_final_response"
#: ``ModelStreamInfer``: responses that may wait for the client before a decoupled
#: request takes its model's next one (what waits beyond is bounded by the core:
#: :data:`pdserve.core.streaming.MAX_PENDING_RESPONSES` and the bounds beside it).
STREAM_BACKLOG = 64


def grpc_status(error: InferError) -> grpc.StatusCode:
    """The gRPC status code for ``error``, from :data:`GRPC_STATUS`."""
    return GRPC_STATUS[error.code]


async def _call(func: Callable[..., object], *args: object) -> Any:
    """Call a server method that may be sync or async."""
    result = func(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


SERVICE_NAME = "inference.GRPCInferenceService"


class MalformedMessage:
    """What a request deserializer returns for bytes that are not the RPC's protobuf
    message: the servicer answers it (unary: ``INVALID_ARGUMENT``; the stream: an
    ``error_message`` response) instead of grpc's ``UNKNOWN`` "Unexpected <class ...>".

    Attributes:
        message: a client-facing description naming the expected message type.
    """

    def __init__(self, message: str) -> None:
        self.message = message


#: A unary servicer method as a handler calls it: ``(request, context) -> response``.
UnaryBehavior = Callable[[Message | MalformedMessage, grpc.aio.ServicerContext], Awaitable[Message]]
#: A streaming servicer method: ``(request iterator, context) -> response iterator``.
StreamBehavior = Callable[
    [AsyncIterator[Message | MalformedMessage], grpc.aio.ServicerContext],
    AsyncIterator[Message],
]


def _safe_deserializer(
    deserializer: Callable[[bytes], Message], method: str
) -> Callable[[bytes], Message | MalformedMessage]:
    """``deserializer`` returning a :class:`MalformedMessage` where it raises ``DecodeError``."""

    def deserialize(data: bytes) -> Message | MalformedMessage:
        try:
            return deserializer(data)
        except DecodeError as e:
            return MalformedMessage(f"malformed {method} request: {e}")

    return deserialize


def _refuse_malformed(behavior: UnaryBehavior) -> UnaryBehavior:
    """A unary ``behavior`` answering a :class:`MalformedMessage` with ``INVALID_ARGUMENT``."""

    async def handle(
        request: Message | MalformedMessage, context: grpc.aio.ServicerContext
    ) -> Message:
        if isinstance(request, MalformedMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    handle.direct = behavior  # type: ignore[attr-defined]  # read by direct_unary
    return handle


def direct_unary(handler: object) -> UnaryBehavior | None:
    """The servicer method under a unary handler of :func:`method_handlers` that no
    gate wraps: a transport that checks for :class:`MalformedMessage` itself may await
    it directly (the native transport: one coroutine level fewer per call). None for
    a gated or streaming handler (or anything that is not a handler)."""
    return getattr(getattr(handler, "unary_unary", None), "direct", None)


#: The request field naming the model, per RPC (for the gate's model grants and limits).
_MODEL_FIELD = {
    "ModelInfer": "model_name",
    "ModelMetadata": "name",
    "ModelConfig": "name",
    "ModelReady": "name",
    "ModelStatistics": "name",
    "RepositoryModelLoad": "model_name",
    "RepositoryModelUnload": "model_name",
}


async def _abort_refused(context: grpc.aio.ServicerContext, error: InferError) -> None:
    """Abort with the gate's status; ``retry-after`` trailing metadata for 429-likes."""
    retry = getattr(error, "retry_after", None)
    if retry is not None:
        context.set_trailing_metadata((("retry-after", str(int(retry))),))
    await context.abort(grpc_status(error), error.message)


async def _fail(context: grpc.aio.ServicerContext, error: Exception, method: str) -> NoReturn:
    """Answer ``error``, raised by RPC ``method``, with the gRPC status Triton would use:
    an :class:`InferError` its code's status (:func:`grpc_status`; ``retry-after`` for
    429-likes, :func:`_abort_refused`), gRPC's own errors (an abort already made) as
    they are, anything else ``INTERNAL`` with its type and message (and logged): one
    request must not take the server down.

    Call it from an ``except Exception`` block; it always raises.
    """
    if isinstance(error, InferError):
        await _abort_refused(context, error)
    elif isinstance(error, (grpc.aio.AbortError, grpc.RpcError)):
        raise error
    else:
        log.exception("gRPC %s failed", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
    raise AssertionError("unreachable")  # pragma: no cover - abort raises


_Handler = TypeVar("_Handler", bound=Callable[..., Awaitable[object]])


def _guarded(method: _Handler) -> _Handler:
    """A unary servicer method ``method(self, request, context)`` whose errors are
    answered by :func:`_fail`."""
    name = method.__name__

    @functools.wraps(method)
    async def handle(
        self: GrpcService, request: Message, context: grpc.aio.ServicerContext
    ) -> object:
        try:
            return await method(self, request, context)
        except Exception as e:  # noqa: BLE001 - _fail answers every error
            await _fail(context, e, name)

    return cast(_Handler, handle)


def _gated_unary(behavior: UnaryBehavior, method: str, gate: TrafficGate) -> UnaryBehavior:
    """A unary ``behavior`` that the gate admits first (auth, restricted APIs, limits)."""
    category = classify_grpc(method)
    field = _MODEL_FIELD.get(method)

    async def handle(
        request: Message | MalformedMessage, context: grpc.aio.ServicerContext
    ) -> Message:
        model = ""
        if field is not None and not isinstance(request, MalformedMessage):
            model = getattr(request, field, "")
        try:
            await gate.check(
                "grpc", category, model, metadata_getter(context.invocation_metadata())
            )
        except InferError as e:
            await _abort_refused(context, e)
        return await behavior(request, context)

    return handle


def _gated_stream(behavior: StreamBehavior, method: str, gate: TrafficGate) -> StreamBehavior:
    """A streaming ``behavior`` whose stream the gate admits when it opens (each
    request on it is checked again, with its model, by the servicer)."""
    category = classify_grpc(method)

    async def handle(
        request_iterator: AsyncIterator[Message | MalformedMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Message]:
        try:
            await gate.check("grpc", category, "", metadata_getter(context.invocation_metadata()))
        except InferError as e:
            await _abort_refused(context, e)
        async for response in behavior(request_iterator, context):
            yield response

    return handle


class HandlerRecorder:
    """Stands in for a server to capture the generated ``add_..._to_server`` handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(
        self, name: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.handlers = dict(handlers)


def method_handlers(servicer: GrpcService) -> dict[str, grpc.RpcMethodHandler]:
    """The service's method handlers (by method name), as tritonclient's generated
    ``add_GRPCInferenceServiceServicer_to_server`` builds them, except that bytes
    that do not parse as the request message reach the servicer as a
    :class:`MalformedMessage`: a unary RPC answers ``INVALID_ARGUMENT`` naming the
    problem, ``ModelStreamInfer`` an ``error_message`` response (as Triton answers a
    request it cannot use) while the stream goes on.
    """
    recorder = HandlerRecorder()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, recorder)
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method, h in recorder.handlers.items():
        deserializer = _safe_deserializer(h.request_deserializer, method)
        if h.unary_unary is not None:
            h = h._replace(unary_unary=_refuse_malformed(h.unary_unary))
        gate = servicer.gate
        if gate is not None:
            if h.unary_unary is not None:
                h = h._replace(unary_unary=_gated_unary(h.unary_unary, method, gate))
            elif h.stream_stream is not None:
                h = h._replace(stream_stream=_gated_stream(h.stream_stream, method, gate))
        handlers[method] = h._replace(request_deserializer=deserializer)
    return handlers


def log_settings_response(settings: Mapping[str, object]) -> service_pb2.LogSettingsResponse:
    """The logging extension's settings as a ``LogSettingsResponse`` (bools as
    ``bool_param``, ``log_verbose_level`` as ``uint32_param``, strings as ``string_param``)."""
    msg = service_pb2.LogSettingsResponse()
    for name, value in settings.items():
        set_param(msg.settings[name], value, "uint32_param")
    return msg


def _shm_status(regions: list[dict[str, Any]]) -> service_pb2.SystemSharedMemoryStatusResponse:
    """The status response of the system regions ``regions`` (the registry's ``status``)."""
    msg = service_pb2.SystemSharedMemoryStatusResponse()
    for r in regions:
        slot = msg.regions[r["name"]]
        slot.name, slot.key = r["name"], r["key"]
        slot.offset, slot.byte_size = r["offset"], r["byte_size"]
    return msg


#: The shared-memory extension's RPCs, each one call of the registry
#: (:class:`~pdserve.frontends.shared_memory.SharedMemoryRegistry`): a status of the
#: system regions (``name`` empty: all; unknown: NOT_FOUND), register ``byte_size``
#: bytes at ``offset`` of the object ``key`` as ``name``, unregister ``name`` (empty:
#: all); CUDA regions: never any (status: empty or NOT_FOUND; register:
#: INVALID_ARGUMENT saying why; unregister: success). Installed by :func:`_shm_rpc`.
_SHM_RPCS: dict[str, Callable[[SharedMemoryRegistry, Any], object]] = {
    "SystemSharedMemoryStatus": lambda shm, r: _shm_status(shm.status(r.name)),
    "SystemSharedMemoryRegister": lambda shm, r: shm.register(r.name, r.key, r.offset, r.byte_size),
    "SystemSharedMemoryUnregister": lambda shm, r: shm.unregister(r.name),
    "CudaSharedMemoryStatus": lambda shm, r: shm.cuda_status(r.name),
    "CudaSharedMemoryRegister": lambda shm, r: shm.cuda_register(r.name),
    "CudaSharedMemoryUnregister": lambda shm, r: shm.cuda_unregister(r.name),
}


def _shm_rpc(
    rpc: str, call: Callable[[SharedMemoryRegistry, Any], object]
) -> Callable[..., Awaitable[object]]:
    """The servicer method of the shared-memory RPC ``rpc``: ``call(registry, request)``;
    it answers the response message ``call`` gives, else the RPC's empty response,
    and its errors as every RPC's (:func:`_guarded`)."""
    empty = getattr(service_pb2, f"{rpc}Response")

    async def handle(
        self: GrpcService, request: Message, context: grpc.aio.ServicerContext
    ) -> object:
        answer = call(self.shm, request)
        return answer if isinstance(answer, Message) else empty()

    handle.__name__ = handle.__qualname__ = rpc
    return _guarded(handle)


class GrpcService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` around one ``InferenceServer``.

    Args:
        server: the protocol-neutral core (:class:`~pdserve.core.api.InferenceCore`:
            ``live``, ``ready``, ``metadata``, ``model_metadata``, ``model_config``,
            ``model_ready``, ``async infer``, ``model_statistics``, ``repository_index``,
            ``async load_model``, ``async unload_model``).
        max_message_bytes: the server's ``grpc.max_send_message_length``: a
            ``ModelStreamInfer`` response larger than this is sent as an
            ``error_message`` response instead (grpc would end the whole stream).
        gate: restricted APIs, auth and rate limits
            (:class:`~pdserve.frontends.traffic.gate.TrafficGate`), applied by
            :func:`method_handlers` to every RPC and by ``ModelStreamInfer`` to each
            request on the stream; None (or an inactive gate): no check.
        shared_memory: the system shared-memory regions (shared with HTTP); None: a
            disabled one (the shared-memory RPCs answer UNIMPLEMENTED).
    """

    def __init__(
        self,
        server: InferenceCore,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        gate: TrafficGate | None = None,
        shared_memory: SharedMemoryRegistry | None = None,
    ) -> None:
        self.server = server
        self.shm = shared_memory if shared_memory is not None else SharedMemoryRegistry()
        self.max_message_bytes = max_message_bytes
        self.gate = gate if gate is not None and gate.active else None

    # -- health and metadata --------------------------------------------------

    async def ServerLive(  # noqa: N802 - gRPC method name
        self, request: service_pb2.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ServerLiveResponse:
        """``live``: the process serves requests."""
        return service_pb2.ServerLiveResponse(live=bool(await _call(self.server.live)))

    async def ServerReady(  # noqa: N802
        self, request: service_pb2.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ServerReadyResponse:
        """``ready``: the server's readiness (see ``--strict-readiness``)."""
        return service_pb2.ServerReadyResponse(ready=bool(await _call(self.server.ready)))

    @_guarded
    async def ModelReady(  # noqa: N802
        self, request: service_pb2.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelReadyResponse:
        """``ready`` of one model (version); an unknown model is not ready (no error)."""
        ok = await _call(self.server.model_ready, request.name, request.version)
        return service_pb2.ModelReadyResponse(ready=bool(ok))

    async def ServerMetadata(  # noqa: N802
        self, request: service_pb2.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ServerMetadataResponse:
        """Server name, version and protocol extensions."""
        meta = with_shm_extension(await _call(self.server.metadata), self.shm)
        return service_pb2.ServerMetadataResponse(
            name=meta["name"], version=meta["version"], extensions=meta["extensions"]
        )

    @_guarded
    async def ModelMetadata(  # noqa: N802
        self, request: service_pb2.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelMetadataResponse:
        """Model metadata: versions, platform, inputs and outputs."""
        meta = await _call(self.server.model_metadata, request.name, request.version)
        return metadata_response(meta)

    @_guarded
    async def ModelConfig(  # noqa: N802
        self, request: service_pb2.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelConfigResponse:
        """The model's (auto-completed) configuration as a ``ModelConfig`` message."""
        cfg_json = await _call(self.server.model_config, request.name, request.version)
        cfg = config_from_json(cfg_json)
        return service_pb2.ModelConfigResponse(config=cfg)

    # -- inference ------------------------------------------------------------

    async def ModelInfer(  # noqa: N802
        self, request: service_pb2.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelInferResponse:
        """One inference request."""
        arrival_ns = time.monotonic_ns()
        try:
            # small requests and responses are decoded and encoded here, without the
            # coroutine of decode_off_loop / encode_off_loop (one level fewer each)
            req = decode_inline(request, arrival_ns)
            if req is None:
                req = await decode_off_loop(request, arrival_ns)
            admit(
                req,
                "gRPC",
                grpc_cancel_token(context),
                *metadata_admission(context.invocation_metadata()),
            )
            if timing_mod.state.enabled:
                return await self._infer_timed(req, context)
            shm_outputs = shm_output_names(req) if req.outputs else None
            if req.shm_inputs is None and shm_outputs is None:
                result = await self.server.infer(req)
                msg = encode_inline(result)
                return msg if msg is not None else await encode_off_loop(result)
            resp = await infer_with_shm(self.shm, req, self.server.infer, shm_outputs)
            return await encode_off_loop(resp, shm_outputs)
        except Exception as e:  # noqa: BLE001 - _fail answers every error
            await _fail(context, e, "ModelInfer")  # (not @_guarded: one frame less per call)

    async def _infer_timed(
        self, req: InferRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelInferResponse:
        """:meth:`ModelInfer` with ``--server-timing``: a request that asks for its
        timing (metadata :data:`~pdserve.core.timing.HEADER` or the request parameter)
        gets it as the trailing metadata ``server-timing`` (:mod:`pdserve.core.timing`)."""
        header = None
        for key, value in context.invocation_metadata() or ():
            if key == timing_mod.HEADER:
                header = value
        timing: list[timing_mod.Entry] = []
        if timing_mod.asked(header, req.parameters):
            req.timing = timing
        shm_outputs = shm_output_names(req) if req.outputs else None
        if req.shm_inputs is None and shm_outputs is None:
            result = await self.server.infer(req)
            inline = encode_inline(result)
            msg = inline if inline is not None else await encode_off_loop(result)
        else:
            result = await infer_with_shm(self.shm, req, self.server.infer, shm_outputs)
            msg = await encode_off_loop(result, shm_outputs)
        if timing:
            context.set_trailing_metadata(
                ((timing_mod.RESPONSE_KEY, timing_mod.server_timing(timing)),)
            )
        return msg

    async def ModelStreamInfer(  # noqa: N802
        self,
        request_iterator: AsyncIterator[service_pb2.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """Bidirectional stream: one response (or ``error_message``) per request.

        Requests run concurrently, as they arrive; responses are sent as they
        complete (match them by request ``id``, as with Triton). Errors do not end
        the stream: they come back as ``ModelStreamInferResponse.error_message``,
        a message that is not a ``ModelInferRequest`` included (no ``id`` then: it
        could not be read). Every request read gets its response; the stream ends
        (OK) once the client has closed its side and all of them are answered.

        Each response carries the parameter ``triton_final_response`` as Triton's
        stream handler sets it (``params["triton_final_response"].set_bool_param(
        is_complete)``): true on a non-decoupled model's one response; a decoupled
        model's as :meth:`_stream_decoupled` says. A non-decoupled request's error
        carries none: Triton sets none on an error before the request reaches the model
        (its ``Process`` path: ``error_message`` and ``id`` only), true on one the
        model's execution gave; pdserve does not tell the two apart here.
        """
        done: asyncio.Queue[service_pb2.ModelStreamInferResponse | None] = asyncio.Queue()
        # set while fewer than STREAM_BACKLOG responses wait for the client: a decoupled
        # request takes its model's next response only then, so a client that stops
        # reading leaves the backlog in the core's ResponseStream, which cancels the
        # request past its bounds (pdserve.core.streaming.MAX_PENDING_RESPONSES)
        room = asyncio.Event()
        room.set()
        traceparent, route_key, pinned = metadata_admission(context.invocation_metadata())
        running: set[asyncio.Task[None]] = set()
        gate = self.gate
        headers = metadata_getter(context.invocation_metadata()) if gate is not None else None

        async def one(request: service_pb2.ModelInferRequest, arrival_ns: int) -> None:
            try:
                if gate is not None and headers is not None:  # this model's grant and limits
                    await gate.check("grpc", INFERENCE, request.model_name, headers)
                req = await decode_off_loop(request, arrival_ns)
                admit(req, "gRPC", req.cancelled, traceparent, route_key, pinned)
                shm_outputs = shm_output_names(req) if req.outputs else None
                try:
                    if req.shm_inputs is None and shm_outputs is None:
                        resp = await encode_off_loop(await self.server.infer(req))
                    else:
                        result = await infer_with_shm(self.shm, req, self.server.infer, shm_outputs)
                        resp = await encode_off_loop(result, shm_outputs)
                except StreamRequired:  # a decoupled model: its responses as they come
                    await self._stream_decoupled(
                        req, request.id, done, empty_final_requested(request), room
                    )
                    return
                msg = service_pb2.ModelStreamInferResponse(infer_response=resp)
                msg = self._fit_stream_response(msg, request.id)
                # a non-decoupled request's one response is its last (Triton sets the
                # parameter on every response its stream handler writes)
                msg.infer_response.parameters[_FINAL_PARAM].bool_param = True
            except InferError as e:
                msg = service_pb2.ModelStreamInferResponse(error_message=e.message)
                msg.infer_response.id = request.id
            except Exception as e:  # noqa: BLE001
                log.exception("gRPC ModelStreamInfer request failed")
                msg = service_pb2.ModelStreamInferResponse(error_message=f"{type(e).__name__}: {e}")
                msg.infer_response.id = request.id
            await done.put(msg)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    if isinstance(request, MalformedMessage):
                        # as Triton: an error response on the stream, which goes on
                        await done.put(
                            service_pb2.ModelStreamInferResponse(error_message=request.message)
                        )
                        continue
                    task = asyncio.ensure_future(one(request, time.monotonic_ns()))
                    running.add(task)
                    task.add_done_callback(running.discard)
            except Exception as e:  # noqa: BLE001 - the requests already read still answer
                log.warning("gRPC ModelStreamInfer: reading the stream failed: %s", e)
            if running:
                await asyncio.gather(*list(running), return_exceptions=True)
            await done.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (msg := await done.get()) is not None:
                if done.qsize() < STREAM_BACKLOG:
                    room.set()
                yield msg
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def _stream_decoupled(
        self,
        req: InferRequest,
        request_id: str,
        done: asyncio.Queue[service_pb2.ModelStreamInferResponse | None],
        enable_empty: bool,
        room: asyncio.Event,
    ) -> None:
        """Send the responses of one request to a decoupled model on the stream, as
        Triton's stream handler does (``src/grpc/stream_infer_handler.cc``,
        ``StreamInferResponseComplete``): each response as it comes, an error as an
        ``error_message`` response with the request's id, model and version, and on
        every response written ``params["triton_final_response"].set_bool_param(
        is_complete)``: true on the request's last one, false on the others, whether or
        not the client asked for empty final responses. A final flag sent alone
        (``empty_final = !iresponse && is_decoupled && is_complete``) becomes an empty
        response (id, model, version and ``triton_final_response: true``) only with the
        request parameter ``triton_enable_empty_final_response`` (tritonclient's
        ``enable_empty_final_response=True``); without it nothing is sent for it
        (``enable_empty``: the request's parameter,
        :func:`~pdserve.frontends.grpc.codec.empty_final_requested`; the codec checked
        it and keeps it out of ``req.parameters``, as Triton's frontend does).
        ``room``: the next response is taken only while it is set (set by the stream's
        sender while fewer than :data:`STREAM_BACKLOG` responses wait)."""
        async with contextlib.aclosing(self.server.infer_stream(req)) as items:
            async for item in items:
                if item.error is not None:
                    msg = service_pb2.ModelStreamInferResponse(error_message=item.error.message)
                elif item.response is not None:
                    resp = await encode_off_loop(item.response)
                    msg = service_pb2.ModelStreamInferResponse(infer_response=resp)
                    msg = self._fit_stream_response(msg, request_id)
                elif enable_empty:
                    msg = service_pb2.ModelStreamInferResponse()
                else:
                    continue
                infer_response = msg.infer_response
                infer_response.id = request_id
                if not infer_response.model_name:
                    infer_response.model_name = item.model[0] or req.model_name
                    infer_response.model_version = item.model[1]
                infer_response.parameters[_FINAL_PARAM].bool_param = item.final
                await done.put(msg)
                if done.qsize() >= STREAM_BACKLOG:
                    room.clear()
                    await room.wait()  # the client reads again (or the call ends)

    # -- logging extension -----------------------------------------------------

    @_guarded
    async def LogSettings(  # noqa: N802
        self, request: service_pb2.LogSettingsRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.LogSettingsResponse:
        """Triton's logging extension: change the settings given, answer all of them
        (:func:`pdserve.observability.logs.update_settings`; a bad name or value type is
        ``INVALID_ARGUMENT`` and changes nothing)."""
        changes = {}
        for name, value in request.settings.items():
            which = value.WhichOneof("parameter_choice")
            changes[name] = None if which is None else getattr(value, which)
        return log_settings_response(logs.update_settings(changes))

    def _fit_stream_response(
        self, msg: service_pb2.ModelStreamInferResponse, request_id: str
    ) -> service_pb2.ModelStreamInferResponse:
        """``msg``, or an ``error_message`` response when it is over the send limit.

        grpc fails the whole call (``RESOURCE_EXHAUSTED``) when one message is larger
        than ``grpc.max_send_message_length``; on a stream that would end every
        other request too, so the over-size response becomes a per-request error,
        as other per-request errors are (Triton sends no such error: its limit is
        2 GiB - 1).
        """
        size = msg.ByteSize()
        if size <= self.max_message_bytes:
            return msg
        error = service_pb2.ModelStreamInferResponse(
            error_message=f"the response of {size} bytes is larger than the gRPC message "
            f"limit of {self.max_message_bytes} bytes (--grpc-max-message-bytes): ask for "
            "fewer or smaller outputs, or raise the limit"
        )
        error.infer_response.id = request_id
        error.infer_response.model_name = msg.infer_response.model_name
        error.infer_response.model_version = msg.infer_response.model_version
        return error

    # -- statistics and repository -------------------------------------------

    @_guarded
    async def ModelStatistics(  # noqa: N802
        self, request: service_pb2.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelStatisticsResponse:
        """Triton's statistics extension (all models when no name is given)."""
        stats = await _call(self.server.model_statistics, request.name, request.version)
        msg = service_pb2.ModelStatisticsResponse()
        json_format.ParseDict(stats, msg, ignore_unknown_fields=True)
        return msg

    @_guarded
    async def TraceSetting(  # noqa: N802
        self, request: service_pb2.TraceSettingRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.TraceSettingResponse:
        """Triton's trace extension: get (no settings) or update the trace settings of
        a model (``model_name``) or the global ones; an empty value list clears a setting."""
        setting = getattr(self.server, "trace_setting", None)
        if setting is None:
            raise unavailable("the server does not support tracing")
        update = None
        if request.settings:
            update = {k: list(v.value) for k, v in request.settings.items()}
        doc = await _call(setting, request.model_name, update)
        msg = service_pb2.TraceSettingResponse()
        for key, value in doc.items():
            values = value if isinstance(value, list) else [value]
            msg.settings[key].value.extend(values)
        return msg

    @_guarded
    async def RepositoryIndex(  # noqa: N802
        self, request: service_pb2.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.RepositoryIndexResponse:
        """Every model of the repository: ``{name, version, state, reason}``."""
        rows = await _call(self.server.repository_index, request.ready)
        msg = service_pb2.RepositoryIndexResponse()
        for row in rows:
            msg.models.add(
                name=row.get("name", ""),
                version=row.get("version", ""),
                state=row.get("state", ""),
                reason=row.get("reason", ""),
            )
        return msg

    @_guarded
    async def RepositoryModelLoad(  # noqa: N802
        self, request: service_pb2.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.RepositoryModelLoadResponse:
        """Load or reload a model; parameters ``config`` (JSON string) and
        ``file:<version>/<name>`` (bytes) as in Triton's repository extension."""
        config: str | None = None
        files: dict[str, bytes] = {}
        for key, p in request.parameters.items():
            value = param_value(p)
            if key == "config":
                if not isinstance(value, str):
                    raise InferError("load parameter 'config' must be a string_param")
                config = value
            elif key.startswith("file:"):
                if not isinstance(value, bytes):
                    raise InferError(f"load parameter '{key}' must be a bytes_param")
                files[key[5:]] = value
            else:
                raise InferError(
                    f"unknown load parameter '{key}'; expected 'config' or 'file:<path>'"
                )
        await _call(self.server.load_model, request.model_name, config, files)
        return service_pb2.RepositoryModelLoadResponse()

    @_guarded
    async def RepositoryModelUnload(  # noqa: N802
        self,
        request: service_pb2.RepositoryModelUnloadRequest,
        context: grpc.aio.ServicerContext,
    ) -> service_pb2.RepositoryModelUnloadResponse:
        """Unload a model; parameter ``unload_dependents`` (bool)."""
        dependents: ParamValue = False
        p = request.parameters.get("unload_dependents")
        if p is not None:
            dependents = param_value(p)
            if not isinstance(dependents, bool):
                raise InferError("unload parameter 'unload_dependents' must be a bool_param")
        await _call(self.server.unload_model, request.model_name, dependents)
        return service_pb2.RepositoryModelUnloadResponse()


for _rpc, _shm_call in _SHM_RPCS.items():
    setattr(GrpcService, _rpc, _shm_rpc(_rpc, _shm_call))
del _rpc, _shm_call


def grpc_cancel_token(context: grpc.aio.ServicerContext) -> CancelToken:
    """The request's :class:`~pdserve.core.cancel.CancelToken`: cancelled with
    ``CLIENT_GONE`` when the call ends before the answer (the client cancelled it or
    its deadline passed: ``context.add_done_callback``); ``context.cancelled`` is the
    token's probe, except on the native transport, which runs the done callbacks on every
    early end itself (its context's ``native_loop``): there the token polls nothing and
    carries the loop."""
    loop = getattr(context, "native_loop", None)
    token = CancelToken(None, loop) if loop is not None else CancelToken(context.cancelled)

    def done(_ctx: grpc.aio.ServicerContext) -> None:
        if not token.finished:
            token.cancel(
                client_gone(
                    "request was cancelled: the gRPC call was cancelled or its deadline passed"
                )
            )

    try:
        context.add_done_callback(done)
    except (AttributeError, NotImplementedError):  # an older grpcio: the probe only
        pass
    return token
