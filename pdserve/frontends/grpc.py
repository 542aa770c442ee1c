"""The KServe V2 gRPC frontend: ``inference.GRPCInferenceService`` on ``grpc.aio``.

The service, messages and method names are tritonclient's generated stubs
(``tritonclient.grpc.service_pb2`` / ``service_pb2_grpc``), so ``tritonclient.grpc``,
``perf_analyzer -i grpc`` and KServe's V2 gRPC clients talk to it unchanged. Like the
HTTP frontend this is a thin adapter: wire messages <-> :class:`~pdserve.types.InferRequest`
/ :class:`~pdserve.types.InferResponse`, and every call goes to the protocol-neutral
``InferenceServer``.

RPCs: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig,
ModelInfer, ModelStreamInfer (one response per request; decoupled models are not
streamed), ModelStatistics, RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload.
The shared-memory, trace and log-settings RPCs answer UNIMPLEMENTED.

Tensor data, as Triton's gRPC frontend accepts and sends it:

- inputs come either all in ``raw_input_contents`` (one little-endian, row-major buffer
  per input, in input order; a BYTES element is a uint32 little-endian length and its
  bytes) or each in its typed ``contents`` (``fp32_contents``...; FP16 has no typed
  field and must be raw). Raw fixed-size inputs become zero-copy read-only
  ``np.frombuffer`` views.
- outputs are always sent in ``raw_output_contents``, which is what Triton does and
  what ``tritonclient``'s ``InferResult.as_numpy`` reads first.

Errors: an :class:`~pdserve.types.InferError` is answered with the gRPC status code
Triton uses for the same error (``INVALID_ARGUMENT`` bad request, ``NOT_FOUND``
unknown model / version, ``UNAVAILABLE`` not ready / queue full / shutting down /
model control disabled, ``INTERNAL`` model failure, ``CANCELLED``); anything else is
``INTERNAL`` and logged. A bad request never takes the server down.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

from pdserve.config import config_from_json
from pdserve.datatypes import (
    MAX_DIMS,
    MAX_ELEMENTS,
    V2_TO_NUMPY,
    deserialize_bytes_tensor,
    numpy_to_v2,
    serialize_bytes_tensor,
    shape_element_count,
)
from pdserve.frontends.offload import codec_pool
from pdserve.types import InferError, InferRequest, InferResponse, RequestedOutput

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "GrpcService",
    "add_arguments",
    "decode_infer_request",
    "encode_infer_response",
    "serve_grpc",
    "start",
]

log = logging.getLogger("pdserve.grpc")

#: Default limit on a gRPC message, sent or received: 64 MiB, like the HTTP body limit.
#: A 32x3x224x224 FP32 batch is 19 MB. ``--grpc-max-message-bytes`` raises it (Triton
#: uses 2 GiB - 1).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: V2 datatype -> little-endian numpy dtype (raw contents are little-endian).
_LE_DTYPE: dict[str, np.dtype] = {
    k: v.newbyteorder("<") for k, v in V2_TO_NUMPY.items() if k != "BYTES"
}

#: V2 datatype -> the ``InferTensorContents`` field that carries it (FP16: raw only).
_CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

#: ``InferError.status`` values with no entry in ``types._HTTP_TO_GRPC``.
_EXTRA_CODES = {499: grpc.StatusCode.CANCELLED, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


def grpc_status(error: InferError) -> grpc.StatusCode:
    """The gRPC status code for ``error`` (Triton's ``TRITONSERVER_Error`` mapping)."""
    extra = _EXTRA_CODES.get(error.status)
    if extra is not None:
        return extra
    return getattr(grpc.StatusCode, error.grpc_code, grpc.StatusCode.UNKNOWN)


# --------------------------------------------------------------------------- codec


def _param_value(p: Any) -> Any:
    """The Python value of an ``InferParameter`` / ``ModelRepositoryParameter``."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _set_param(p: Any, value: Any) -> None:
    """Store a Python value in an ``InferParameter``."""
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


def _element_count(shape: list[int], name: str) -> int:
    if len(shape) > MAX_DIMS:
        raise InferError(
            f"input '{name}' has {len(shape)} dimensions; at most {MAX_DIMS} are supported"
        )
    count = 1
    for d in shape:
        if d < 0:
            raise InferError(f"input '{name}' has a negative dimension in shape {shape}")
        count *= d
    if count >= MAX_ELEMENTS or count == 0:
        shape_element_count(shape, name)  # raises when the shape is too large for numpy
    return count


#: Typed contents fields wider than their datatype: values are range-checked.
_NARROW_INTS: dict[str, tuple[np.dtype, int, int]] = {
    dt: (np.dtype(np.int32 if dt[0] == "I" else np.uint32), int(info.min), int(info.max))
    for dt, info in (
        ("INT8", np.iinfo(np.int8)),
        ("INT16", np.iinfo(np.int16)),
        ("UINT8", np.iinfo(np.uint8)),
        ("UINT16", np.iinfo(np.uint16)),
    )
}


def _typed_contents_array(values: Any, datatype: str, name: str) -> np.ndarray:
    """A fixed-size input's typed ``contents`` as a 1-D array, range-checked for the
    datatypes narrower than their field (INT8/INT16 in ``int_contents``, UINT8/UINT16
    in ``uint_contents``)."""
    narrow = _NARROW_INTS.get(datatype)
    if narrow is None:
        return np.array(values, dtype=V2_TO_NUMPY[datatype])
    wide, lo, hi = narrow
    arr = np.array(values, dtype=wide)
    if arr.size:
        low, high = int(arr.min()), int(arr.max())
        if low < lo or high > hi:
            bad = low if low < lo else high
            raise InferError(
                f"input '{name}' value {bad} is out of range for {datatype} [{lo}, {hi}]"
            )
    return arr.astype(V2_TO_NUMPY[datatype])


def decode_infer_request(msg: service_pb2.ModelInferRequest, arrival_ns: int) -> InferRequest:
    """Turn a ``ModelInferRequest`` into an :class:`InferRequest`.

    Raises:
        InferError(400): unknown datatype, data whose size disagrees with the shape,
            a shape of more than 64 dimensions or 2**59 elements or more, typed
            contents out of range for the datatype (INT8/INT16/UINT8/UINT16),
            raw and typed contents mixed, a raw-contents count that is not the input
            count, FP16 sent as typed contents, shared-memory inputs or outputs.
    """
    raw = msg.raw_input_contents
    n_raw = len(raw)
    inputs_msg = msg.inputs
    if n_raw and n_raw != len(inputs_msg):
        raise InferError(
            f"expected {len(inputs_msg)} raw input contents (one per input), got {n_raw}"
        )
    inputs: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(inputs_msg):
        name = tensor.name
        datatype = tensor.datatype
        shape = list(tensor.shape)
        count = _element_count(shape, name)
        if tensor.parameters and "shared_memory_region" in tensor.parameters:
            raise InferError(
                f"input '{name}': the shared-memory extension is not supported by pdserve"
            )
        if name in inputs:
            raise InferError(f"input '{name}' is given more than once")
        if n_raw:
            if tensor.HasField("contents"):
                raise InferError(
                    f"contents field must not be specified when using raw_input_contents "
                    f"for '{name}'"
                )
            data = raw[i]
            if datatype == "BYTES":
                arr = deserialize_bytes_tensor(data, count).reshape(shape)
            else:
                dtype = _LE_DTYPE.get(datatype)
                if dtype is None:
                    raise InferError(f"input '{name}' has unknown datatype '{datatype}'")
                expected = count * dtype.itemsize
                if len(data) != expected:
                    raise InferError(
                        f"unexpected total byte size {len(data)} for input '{name}', "
                        f"expecting {expected}"
                    )
                arr = np.frombuffer(data, dtype=dtype).reshape(shape)
        else:
            field = _CONTENTS_FIELD.get(datatype)
            if field is None:
                if datatype in _LE_DTYPE:
                    raise InferError(
                        f"input '{name}' of datatype {datatype} must be sent in "
                        "raw_input_contents (it has no typed contents field)"
                    )
                raise InferError(f"input '{name}' has unknown datatype '{datatype}'")
            values = getattr(tensor.contents, field)
            if len(values) != count:
                raise InferError(
                    f"unexpected number of elements {len(values)} in the contents of input "
                    f"'{name}', expecting {count} for shape {shape}"
                )
            if datatype == "BYTES":
                arr = np.empty(count, dtype=object)
                arr[:] = list(values)
                arr = arr.reshape(shape)
            else:
                arr = _typed_contents_array(values, datatype, name).reshape(shape)
        inputs[name] = arr
    outputs: list[RequestedOutput] | None = None
    if msg.outputs:
        outputs = []
        for out in msg.outputs:
            params = {k: _param_value(v) for k, v in out.parameters.items()}
            if "shared_memory_region" in params:
                raise InferError(
                    f"output '{out.name}': the shared-memory extension is not supported by pdserve"
                )
            cls = params.pop("classification", 0) or 0
            if not isinstance(cls, int) or isinstance(cls, bool):
                raise InferError(f"output '{out.name}': 'classification' must be an integer")
            params.pop("binary_data", None)
            outputs.append(RequestedOutput(out.name, None, cls, params))
    parameters = {k: _param_value(v) for k, v in msg.parameters.items()} if msg.parameters else {}
    return InferRequest(
        model_name=msg.model_name,
        model_version=msg.model_version,
        inputs=inputs,
        outputs=outputs,
        id=msg.id,
        parameters=parameters,
        arrival_ns=arrival_ns,
    )


def encode_infer_response(response: InferResponse) -> service_pb2.ModelInferResponse:
    """Turn an :class:`InferResponse` into a ``ModelInferResponse`` with raw outputs."""
    msg = service_pb2.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    raw = msg.raw_output_contents
    for name, arr in response.outputs.items():
        out = msg.outputs.add()
        out.name = name
        out.shape.extend(arr.shape)
        if arr.dtype.kind in "OSU":
            out.datatype = "BYTES"
            raw.append(serialize_bytes_tensor(arr))
            continue
        try:
            out.datatype = numpy_to_v2(arr.dtype)
        except InferError as e:
            raise InferError(f"output '{name}': {e.message}", 500) from None
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        raw.append(arr.tobytes())
    for k, v in response.parameters.items():
        _set_param(msg.parameters[k], v)
    return msg


#: Requests whose tensor payload is over this many bytes are decoded, and responses
#: whose outputs are over it encoded, on a worker thread: parsing millions of BYTES
#: elements would otherwise stall every other call on the event loop. Smaller ones
#: stay on the loop (a thread hop costs more than they take).
OFFLOAD_BYTES = 1 << 20


def _payload_bytes(msg: service_pb2.ModelInferRequest) -> int:
    """About how many bytes of tensor data ``msg`` carries (cheap: no element walk)."""
    total = 0
    for raw in msg.raw_input_contents:
        total += len(raw)
    if total:
        return total
    for tensor in msg.inputs:
        field = _CONTENTS_FIELD.get(tensor.datatype)
        if field is not None and tensor.HasField("contents"):
            total += 8 * len(getattr(tensor.contents, field))
    return total


async def _decode_off_loop(msg: service_pb2.ModelInferRequest, arrival_ns: int) -> InferRequest:
    """:func:`decode_infer_request`, on a worker thread when the payload is large."""
    if _payload_bytes(msg) <= OFFLOAD_BYTES:
        return decode_infer_request(msg, arrival_ns)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(codec_pool(), decode_infer_request, msg, arrival_ns)


async def _encode_off_loop(response: InferResponse) -> service_pb2.ModelInferResponse:
    """:func:`encode_infer_response`, on a worker thread when the outputs are large."""
    size = 0
    for arr in response.outputs.values():
        size += getattr(arr, "nbytes", 0)
    if size <= OFFLOAD_BYTES:
        return encode_infer_response(response)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(codec_pool(), encode_infer_response, response)


def _metadata_response(meta: dict[str, Any]) -> service_pb2.ModelMetadataResponse:
    msg = service_pb2.ModelMetadataResponse(
        name=meta["name"], versions=meta.get("versions", []), platform=meta.get("platform", "")
    )
    for key, target in (("inputs", msg.inputs), ("outputs", msg.outputs)):
        for t in meta.get(key, []):
            target.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
    return msg


# --------------------------------------------------------------------------- service


async def _call(func: Callable[..., Any], *args: Any) -> Any:
    """Call a server method that may be sync or async."""
    result = func(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


class GrpcService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` around one ``InferenceServer``.

    Args:
        server: the protocol-neutral core (``live``, ``ready``, ``metadata``,
            ``model_metadata``, ``model_config``, ``model_ready``, ``async infer``,
            ``model_statistics``, ``repository_index``, ``async load_model``,
            ``async unload_model``).
    """

    def __init__(self, server: Any) -> None:
        self.server = server

    async def _guard(
        self, context: grpc.aio.ServicerContext, func: Callable[[], Awaitable[Any]]
    ) -> Any:
        """Run ``func``; answer an error with the gRPC status Triton would use."""
        try:
            return await func()
        except InferError as e:
            await context.abort(grpc_status(e), e.message)
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as e:  # noqa: BLE001 - one request must not take the server down
            log.exception("gRPC call failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

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

    async def ModelReady(  # noqa: N802
        self, request: service_pb2.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelReadyResponse:
        """``ready`` of one model (version); an unknown model is not ready (no error)."""

        async def run() -> service_pb2.ModelReadyResponse:
            ok = await _call(self.server.model_ready, request.name, request.version)
            return service_pb2.ModelReadyResponse(ready=bool(ok))

        return await self._guard(context, run)

    async def ServerMetadata(  # noqa: N802
        self, request: service_pb2.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ServerMetadataResponse:
        """Server name, version and protocol extensions."""
        meta = await _call(self.server.metadata)
        return service_pb2.ServerMetadataResponse(
            name=meta["name"], version=meta["version"], extensions=meta["extensions"]
        )

    async def ModelMetadata(  # noqa: N802
        self, request: service_pb2.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelMetadataResponse:
        """Model metadata: versions, platform, inputs and outputs."""

        async def run() -> service_pb2.ModelMetadataResponse:
            meta = await _call(self.server.model_metadata, request.name, request.version)
            return _metadata_response(meta)

        return await self._guard(context, run)

    async def ModelConfig(  # noqa: N802
        self, request: service_pb2.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelConfigResponse:
        """The model's (auto-completed) configuration as a ``ModelConfig`` message."""

        async def run() -> service_pb2.ModelConfigResponse:
            cfg_json = await _call(self.server.model_config, request.name, request.version)
            cfg = config_from_json(cfg_json)
            return service_pb2.ModelConfigResponse(config=cfg)

        return await self._guard(context, run)

    # -- inference ------------------------------------------------------------

    async def ModelInfer(  # noqa: N802
        self, request: service_pb2.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelInferResponse:
        """One inference request."""
        arrival_ns = time.monotonic_ns()
        try:
            req = await _decode_off_loop(request, arrival_ns)
            req.cancelled = context.cancelled
            return await _encode_off_loop(await self.server.infer(req))
        except InferError as e:
            await context.abort(grpc_status(e), e.message)
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("gRPC ModelInfer failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    async def ModelStreamInfer(  # noqa: N802
        self,
        request_iterator: AsyncIterator[service_pb2.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """Bidirectional stream: one response (or ``error_message``) per request.

        Requests run concurrently, as they arrive; responses are sent as they
        complete (match them by request ``id``, as with Triton). Errors do not end
        the stream: they come back as ``ModelStreamInferResponse.error_message``.
        """
        done: asyncio.Queue[service_pb2.ModelStreamInferResponse | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def one(request: service_pb2.ModelInferRequest, arrival_ns: int) -> None:
            try:
                req = await _decode_off_loop(request, arrival_ns)
                resp = await _encode_off_loop(await self.server.infer(req))
                msg = service_pb2.ModelStreamInferResponse(infer_response=resp)
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
                    task = asyncio.ensure_future(one(request, time.monotonic_ns()))
                    running.add(task)
                    task.add_done_callback(running.discard)
                if running:
                    await asyncio.gather(*list(running), return_exceptions=True)
            finally:
                await done.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (msg := await done.get()) is not None:
                yield msg
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    # -- statistics and repository -------------------------------------------

    async def ModelStatistics(  # noqa: N802
        self, request: service_pb2.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelStatisticsResponse:
        """Triton's statistics extension (all models when no name is given)."""

        async def run() -> service_pb2.ModelStatisticsResponse:
            stats = await _call(self.server.model_statistics, request.name, request.version)
            msg = service_pb2.ModelStatisticsResponse()
            json_format.ParseDict(stats, msg, ignore_unknown_fields=True)
            return msg

        return await self._guard(context, run)

    async def RepositoryIndex(  # noqa: N802
        self, request: service_pb2.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.RepositoryIndexResponse:
        """Every model of the repository: ``{name, version, state, reason}``."""

        async def run() -> service_pb2.RepositoryIndexResponse:
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

        return await self._guard(context, run)

    async def RepositoryModelLoad(  # noqa: N802
        self, request: service_pb2.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.RepositoryModelLoadResponse:
        """Load or reload a model; parameters ``config`` (JSON string) and
        ``file:<version>/<name>`` (bytes) as in Triton's repository extension."""

        async def run() -> service_pb2.RepositoryModelLoadResponse:
            config: str | None = None
            files: dict[str, bytes] = {}
            for key, p in request.parameters.items():
                value = _param_value(p)
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

        return await self._guard(context, run)

    async def RepositoryModelUnload(  # noqa: N802
        self,
        request: service_pb2.RepositoryModelUnloadRequest,
        context: grpc.aio.ServicerContext,
    ) -> service_pb2.RepositoryModelUnloadResponse:
        """Unload a model; parameter ``unload_dependents`` (bool)."""

        async def run() -> service_pb2.RepositoryModelUnloadResponse:
            dependents = False
            p = request.parameters.get("unload_dependents")
            if p is not None:
                dependents = _param_value(p)
                if not isinstance(dependents, bool):
                    raise InferError("unload parameter 'unload_dependents' must be a bool_param")
            await _call(self.server.unload_model, request.model_name, dependents)
            return service_pb2.RepositoryModelUnloadResponse()

        return await self._guard(context, run)


# --------------------------------------------------------------------------- server


async def serve_grpc(
    server: Any,
    host: str = "0.0.0.0",
    port: int = 8001,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.aio.Server:
    """Create and start the gRPC server for ``server`` in the running event loop.

    Args:
        server: the ``InferenceServer``.
        host / port: where to listen.
        max_message_bytes: the largest message received or sent.

    Returns:
        The started ``grpc.aio.Server``; ``await srv.stop(grace)`` stops it, letting
        in-flight RPCs finish for up to ``grace`` seconds.

    Raises:
        RuntimeError: the address could not be bound.
    """
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # A port in use must fail loudly, not be shared with another process.
        ("grpc.so_reuseport", 0),
    ]
    srv = grpc.aio.server(options=options)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(GrpcService(server), srv)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = srv.add_insecure_port(address)
    except RuntimeError:
        raise RuntimeError(f"could not listen for gRPC on {address}: address in use?") from None
    if bound == 0:
        raise RuntimeError(f"could not listen for gRPC on {address}")
    await srv.start()
    return srv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``serve`` flags of the gRPC frontend (``--grpc-port`` is the CLI's own)."""
    parser.add_argument(
        "--grpc-max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest gRPC message received or sent, in bytes (default 64 MiB; "
        "Triton uses 2147483647)",
    )
    parser.add_argument(
        "--allow-grpc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the V2 gRPC protocol on --grpc-port (default on)",
    )


async def start(args: argparse.Namespace, server: Any) -> Callable[[], Awaitable[None]] | None:
    """CLI hook: start gRPC on ``--host``:``--grpc-port``; return its stopper.

    Raises:
        SystemExit(1): the port cannot be bound (logged).
    """
    if not getattr(args, "allow_grpc", True):
        return None
    try:
        srv = await serve_grpc(
            server,
            args.host,
            args.grpc_port,
            max_message_bytes=getattr(args, "grpc_max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES),
        )
    except RuntimeError as e:
        log.error("%s", e)
        raise SystemExit(1) from None
    log.info("gRPC (KServe V2) listening on %s:%d", args.host, args.grpc_port)

    async def stop() -> None:
        await srv.stop(5)

    return stop


def _register() -> None:
    from pdserve import cli

    cli.register_serve_extension(add_arguments, start)


_register()
