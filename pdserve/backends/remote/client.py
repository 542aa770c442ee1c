"""Clients of a remote KServe V2 server: gRPC (default) and HTTP with the binary extension.

Both speak the plain V2 protocol, with Triton's model-configuration extension where
the target has it. :class:`GrpcClient` calls ``GRPCInferenceService`` on ``pool_size``
``grpc.aio`` channels (round-robin), every tensor in ``raw_input_contents``, answers
read with ``np.frombuffer``; it builds ``tritonclient.grpc.service_pb2`` messages
itself rather than ``tritonclient.grpc.aio``'s ``InferInput`` objects, which re-pack
every tensor per call. :class:`HttpClient` posts the V2 JSON header plus the binary
tensor extension with ``aiohttp`` on at most ``pool_size`` keep-alive connections.

Failures become :class:`RemoteError`: an :class:`~pdserve.core.errors.InferError` whose
code follows the target's status, plus whether the target answered at all and whether
the call may be repeated.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import numpy as np
import orjson

from pdserve.core.datatypes import GRPC_CONTENTS_FIELD, V2_TO_NUMPY, array_from_raw, raw_tensor
from pdserve.core.errors import ErrorCode, InferError

if TYPE_CHECKING:
    import aiohttp
    import grpc
    from google.protobuf.message import Message
    from tritonclient.grpc import model_config_pb2, service_pb2


class TensorMetadata(TypedDict):
    """One tensor of V2 model metadata."""

    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(TypedDict, total=False):
    """V2 model metadata (``GET /v2/models/<name>``, gRPC ``ModelMetadata``)."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


#: Reconnect backoff of a gRPC channel whose target went away, ms: the channel tries
#: again at most this long after a failure, so a target that comes back is used within
#: about a second (gRPC's default backs off up to 120 s).
MAX_RECONNECT_BACKOFF_MS = 1000

#: The target's gRPC status -> pdserve's code. ``NOT_FOUND`` (the target does not serve
#: the model, or lost it) and a missed deadline are UNAVAILABLE here: the local model
#: exists, its backing model does not answer.
_GRPC_CODES: dict[str, ErrorCode] = {
    "INVALID_ARGUMENT": ErrorCode.INVALID_ARG,
    "OUT_OF_RANGE": ErrorCode.INVALID_ARG,
    "FAILED_PRECONDITION": ErrorCode.INVALID_ARG,
    "NOT_FOUND": ErrorCode.UNAVAILABLE,
    "UNAVAILABLE": ErrorCode.UNAVAILABLE,
    "DEADLINE_EXCEEDED": ErrorCode.UNAVAILABLE,
    "RESOURCE_EXHAUSTED": ErrorCode.UNAVAILABLE,
    "UNIMPLEMENTED": ErrorCode.UNSUPPORTED,
    "ALREADY_EXISTS": ErrorCode.ALREADY_EXISTS,
    "CANCELLED": ErrorCode.CANCELLED,
}
#: The target's HTTP status -> pdserve's code (others: INTERNAL).
_HTTP_CODES: dict[int, ErrorCode] = {
    400: ErrorCode.INVALID_ARG,
    404: ErrorCode.UNAVAILABLE,
    408: ErrorCode.UNAVAILABLE,
    429: ErrorCode.UNAVAILABLE,
    499: ErrorCode.CANCELLED,
    501: ErrorCode.UNSUPPORTED,
    502: ErrorCode.UNAVAILABLE,
    503: ErrorCode.UNAVAILABLE,
    504: ErrorCode.UNAVAILABLE,
}


class RemoteError(InferError):
    """A failed call to the target.

    Attributes:
        answered: the target answered (with an error status); False: no answer
            (connection refused or reset, timeout).
        retryable: repeating the call cannot run the inference twice: the target
            refused it (UNAVAILABLE, queue full, not ready) or it never reached
            the target (connection refused).
        status: the target's status (gRPC code name or HTTP number), or ``""``.
    """

    def __init__(
        self,
        message: str,
        code: ErrorCode,
        *,
        answered: bool,
        retryable: bool,
        status: str = "",
    ) -> None:
        super().__init__(message, code)
        self.answered = answered
        self.retryable = retryable
        self.status = status


@dataclass(frozen=True)
class Endpoint:
    """Where and how to reach the target's model.

    Attributes:
        address: ``host:port``.
        protocol: ``grpc`` or ``http``.
        model_name / model_version: the model on the target (version ``""``: the
            target's default).
        pool_size: gRPC channels / HTTP connections.
        connect_timeout_s: the longest wait for a TCP connection (and for a probe).
    """

    address: str
    protocol: str
    model_name: str
    model_version: str = ""
    pool_size: int = 4
    connect_timeout_s: float = 1.0


class RemoteClient(abc.ABC):
    """A connection pool to one target model."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.where = f"{endpoint.protocol}://{endpoint.address}"

    @abc.abstractmethod
    async def ready(self, timeout_s: float) -> tuple[bool, str]:
        """Whether the target's model answers ready, and why not (``""`` when ready).
        Never raises."""

    @abc.abstractmethod
    async def config(self, timeout_s: float) -> model_config_pb2.ModelConfig | None:
        """The target's model configuration (Triton's extension), or None when the
        target has no configuration endpoint.

        Raises:
            RemoteError: the target did not answer or refused.
        """

    @abc.abstractmethod
    async def metadata(self, timeout_s: float) -> ModelMetadata:
        """The target's V2 model metadata ``{name, versions, platform, inputs, outputs}``
        (each tensor ``{name, datatype, shape}``).

        Raises:
            RemoteError: the target did not answer or refused.
        """

    @abc.abstractmethod
    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        request_id: str,
        timeout_s: float,
        traceparent: str = "",
    ) -> dict[str, np.ndarray]:
        """Run one inference on the target.

        Args:
            inputs: input name -> array (full shape, batch dim first when batching;
                BYTES as object arrays).
            outputs: output names to ask for.
            request_id: sent as the V2 request ``id`` (may be empty).
            timeout_s: the whole call's deadline.
            traceparent: the W3C ``traceparent`` of the call's span, sent as the HTTP
                header / gRPC metadata so the target's spans are its children ("": none).

        Returns:
            output name -> array, for each name of ``outputs``.

        Raises:
            RemoteError: no answer, an error status, or an answer missing an output.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Close every connection."""


def _raw_input(name: str, arr: np.ndarray) -> tuple[str, bytes]:
    """The V2 datatype and raw contents of input ``name`` (:func:`raw_tensor`).

    Raises:
        InferError(INVALID_ARG): its dtype has no V2 datatype.
    """
    try:
        return raw_tensor(arr)
    except InferError as e:
        raise InferError(f"input '{name}': {e.message}") from None


def _from_bytes(buf: bytes | memoryview, datatype: str, shape: list[int], name: str) -> np.ndarray:
    """Output ``name`` of an answer from its raw contents (:func:`array_from_raw`).

    Raises:
        InferError(INTERNAL): unknown datatype, or not as many bytes as ``shape`` calls for.
    """
    count = int(np.prod(shape)) if shape else 1
    try:
        return array_from_raw(buf, datatype, shape, count, f"output '{name}'")
    except InferError as e:
        raise InferError(e.message, ErrorCode.INTERNAL) from None


# --------------------------------------------------------------------------- gRPC


class GrpcClient(RemoteClient):
    """V2 gRPC client on ``pool_size`` ``grpc.aio`` channels (see the module doc).

    Channel options: unlimited message sizes; reconnect backoff 100 ms to
    :data:`MAX_RECONNECT_BACKOFF_MS`; the connect deadline is ``connect_timeout_s``
    (gRPC's ``min_reconnect_backoff``, 20 s by default); each channel its own
    subchannel pool (its own TCP connection). Calls do not wait for a connection
    (``wait_for_ready`` false): while the target is down they fail at once with
    UNAVAILABLE instead of hanging until their deadline.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        super().__init__(endpoint)
        import grpc
        from tritonclient.grpc import service_pb2

        self._grpc = grpc
        self._pb = service_pb2
        connect_ms = max(100, int(endpoint.connect_timeout_s * 1000))
        options = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", connect_ms),
            ("grpc.max_reconnect_backoff_ms", max(connect_ms, MAX_RECONNECT_BACKOFF_MS)),
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.enable_retries", 0),
        ]
        self._channels = [
            grpc.aio.insecure_channel(endpoint.address, options=options)
            for _ in range(max(1, endpoint.pool_size))
        ]
        prefix = "/inference.GRPCInferenceService/"

        def method(
            name: str, req: type[Message], resp: type[Message]
        ) -> list[grpc.aio.UnaryUnaryMultiCallable]:
            return [
                ch.unary_unary(
                    prefix + name,
                    request_serializer=req.SerializeToString,
                    response_deserializer=resp.FromString,
                )
                for ch in self._channels
            ]

        self._infer = method("ModelInfer", service_pb2.ModelInferRequest, service_pb2.ModelInferResponse)  # fmt: skip
        self._ready = method("ModelReady", service_pb2.ModelReadyRequest, service_pb2.ModelReadyResponse)  # fmt: skip
        self._config = method("ModelConfig", service_pb2.ModelConfigRequest, service_pb2.ModelConfigResponse)[0]  # fmt: skip
        self._metadata = method("ModelMetadata", service_pb2.ModelMetadataRequest, service_pb2.ModelMetadataResponse)[0]  # fmt: skip
        self._next = itertools.cycle(range(len(self._channels)))

    def _error(self, e: grpc.aio.AioRpcError, what: str) -> RemoteError:
        code = e.code()
        name = code.name if code is not None else "UNKNOWN"
        details = e.details() or name
        refused = name == "UNAVAILABLE"
        return RemoteError(
            f"remote {self.where} model '{self.endpoint.model_name}': {what} failed: "
            f"{name}: {details}",
            _GRPC_CODES.get(name, ErrorCode.INTERNAL),
            # gRPC reports a connection failure as UNAVAILABLE with the transport's
            # words; anything else came from the target
            answered=not (refused and _is_transport_failure(details)),
            retryable=refused,
            status=name,
        )

    async def ready(self, timeout_s: float) -> tuple[bool, str]:
        """Ready only when the target answers ready on **every** channel of the pool: a
        channel still waiting out its reconnect backoff after the target came back
        would fail the calls sent to it."""
        req = self._pb.ModelReadyRequest(
            name=self.endpoint.model_name, version=self.endpoint.model_version
        )
        answers = await asyncio.gather(
            *(call(req, timeout=timeout_s) for call in self._ready), return_exceptions=True
        )
        for resp in answers:
            if isinstance(resp, self._grpc.aio.AioRpcError):
                return False, str(self._error(resp, "ModelReady"))
            if isinstance(resp, BaseException):
                return False, f"remote {self.where}: ModelReady failed: {resp!r}"
            if not resp.ready:
                return False, f"remote {self.where} answers model '{self.endpoint.model_name}' not ready"  # fmt: skip
        return True, ""

    async def config(self, timeout_s: float) -> model_config_pb2.ModelConfig | None:
        req = self._pb.ModelConfigRequest(
            name=self.endpoint.model_name, version=self.endpoint.model_version
        )
        try:
            resp = await self._config(req, timeout=timeout_s)
        except self._grpc.aio.AioRpcError as e:
            if e.code() == self._grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise self._error(e, "ModelConfig") from None
        return resp.config

    async def metadata(self, timeout_s: float) -> ModelMetadata:
        req = self._pb.ModelMetadataRequest(
            name=self.endpoint.model_name, version=self.endpoint.model_version
        )
        try:
            resp = await self._metadata(req, timeout=timeout_s)
        except self._grpc.aio.AioRpcError as e:
            raise self._error(e, "ModelMetadata") from None

        def tensors(
            ts: Iterable[service_pb2.ModelMetadataResponse.TensorMetadata],
        ) -> list[TensorMetadata]:
            return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in ts]

        return {
            "name": resp.name,
            "versions": list(resp.versions),
            "platform": resp.platform,
            "inputs": tensors(resp.inputs),
            "outputs": tensors(resp.outputs),
        }

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        request_id: str,
        timeout_s: float,
        traceparent: str = "",
    ) -> dict[str, np.ndarray]:
        pb = self._pb
        req = pb.ModelInferRequest(
            model_name=self.endpoint.model_name,
            model_version=self.endpoint.model_version,
            id=request_id,
        )
        raw = req.raw_input_contents
        for name, arr in inputs.items():
            datatype, data = _raw_input(name, arr)
            t = req.inputs.add()
            t.name = name
            t.datatype = datatype
            t.shape.extend(arr.shape)
            raw.append(data)
        for name in outputs:
            req.outputs.add().name = name
        call = self._infer[next(self._next)]
        try:
            metadata = (("traceparent", traceparent),) if traceparent else None
            resp = await call(req, timeout=timeout_s, metadata=metadata)
        except self._grpc.aio.AioRpcError as e:
            raise self._error(e, "ModelInfer") from None
        result: dict[str, np.ndarray] = {}
        raw_out = resp.raw_output_contents
        for i, t in enumerate(resp.outputs):
            shape = list(t.shape)
            if i < len(raw_out):
                result[t.name] = _from_bytes(raw_out[i], t.datatype, shape, t.name)
            else:
                result[t.name] = self._typed(t, shape)
        return _check_outputs(result, outputs, self.where)

    @staticmethod
    def _typed(t: service_pb2.ModelInferResponse.InferOutputTensor, shape: list[int]) -> np.ndarray:
        field = GRPC_CONTENTS_FIELD.get(t.datatype)
        if field is None:
            raise InferError(
                f"output '{t.name}' of datatype {t.datatype} came without raw contents",
                ErrorCode.INTERNAL,
            )
        values = list(getattr(t.contents, field))
        if t.datatype == "BYTES":
            return np.array(values, dtype=object).reshape(shape)
        return np.asarray(values, dtype=V2_TO_NUMPY[t.datatype]).reshape(shape)

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self._channels), return_exceptions=True)


def _is_transport_failure(details: str) -> bool:
    """gRPC's own words for a call that never reached a server."""
    d = details.lower()
    return any(
        w in d
        for w in (
            "failed to connect",
            "connection refused",
            "connect failed",
            "socket closed",
            "connection reset",
            "no connection",
            "empty address list",
            "dns resolution failed",
            "ipv4:",
            "ipv6:",
        )
    )


def _check_outputs(
    result: dict[str, np.ndarray], wanted: list[str], where: str
) -> dict[str, np.ndarray]:
    missing = [n for n in wanted if n not in result]
    if missing:
        raise InferError(
            f"remote {where} answered without output(s) {', '.join(missing)}", ErrorCode.INTERNAL
        )
    return result


# --------------------------------------------------------------------------- HTTP


class HttpClient(RemoteClient):
    """V2 REST client with the binary tensor extension (``aiohttp``; see the module doc).

    At most ``pool_size`` connections (calls beyond wait for one); the TCP connect
    times out after ``connect_timeout_s``.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        super().__init__(endpoint)
        import aiohttp

        self._aiohttp = aiohttp
        self._session: aiohttp.ClientSession | None = None
        name = endpoint.model_name
        base = f"/v2/models/{name}"
        if endpoint.model_version:
            base += f"/versions/{endpoint.model_version}"
        self._base = base
        self._url = f"http://{endpoint.address}"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            aiohttp = self._aiohttp
            self._session = aiohttp.ClientSession(
                self._url,
                connector=aiohttp.TCPConnector(
                    limit=max(1, self.endpoint.pool_size), force_close=False
                ),
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    def _timeout(self, timeout_s: float) -> aiohttp.ClientTimeout:
        return self._aiohttp.ClientTimeout(
            total=timeout_s, sock_connect=self.endpoint.connect_timeout_s
        )

    def _no_answer(self, e: BaseException, what: str, timeout_s: float) -> RemoteError:
        aiohttp = self._aiohttp
        if isinstance(e, TimeoutError):
            detail = f"no answer within {timeout_s * 1000:.0f} ms"
            connect_failed = False
        else:
            detail = f"{type(e).__name__}: {e}"
            connect_failed = isinstance(e, aiohttp.ClientConnectorError)
        return RemoteError(
            f"remote {self.where} model '{self.endpoint.model_name}': {what} failed: {detail}",
            ErrorCode.UNAVAILABLE,
            answered=False,
            retryable=connect_failed,
        )

    def _status_error(self, status: int, body: bytes, what: str) -> RemoteError:
        try:
            message = str(orjson.loads(body).get("error", ""))
        except (orjson.JSONDecodeError, AttributeError):
            message = body[:200].decode("utf-8", "replace")
        return RemoteError(
            f"remote {self.where} model '{self.endpoint.model_name}': {what} failed: HTTP "
            f"{status}: {message}",
            _HTTP_CODES.get(status, ErrorCode.INTERNAL),
            answered=True,
            retryable=status == 503,
            status=str(status),
        )

    async def _get(self, path: str, timeout_s: float, what: str) -> tuple[int, bytes]:
        try:
            async with self._client().get(path, timeout=self._timeout(timeout_s)) as resp:
                return resp.status, await resp.read()
        except (TimeoutError, self._aiohttp.ClientError, OSError) as e:
            raise self._no_answer(e, what, timeout_s) from None

    async def ready(self, timeout_s: float) -> tuple[bool, str]:
        try:
            status, _ = await self._get(self._base + "/ready", timeout_s, "ready")
        except RemoteError as e:
            return False, e.message
        if status != 200:
            return (
                False,
                f"remote {self.where} answers model '{self.endpoint.model_name}' not ready "
                f"(HTTP {status})",
            )
        return True, ""

    async def config(self, timeout_s: float) -> model_config_pb2.ModelConfig | None:
        from pdserve import config as cfgmod

        status, body = await self._get(self._base + "/config", timeout_s, "config")
        if status in (404, 501) and b"config" not in body.lower():
            return None  # no configuration extension on this target
        if status != 200:
            raise self._status_error(status, body, "config")
        return cfgmod.config_from_json(orjson.loads(body), f"{self.where}{self._base}/config")

    async def metadata(self, timeout_s: float) -> ModelMetadata:
        status, body = await self._get(self._base, timeout_s, "metadata")
        if status != 200:
            raise self._status_error(status, body, "metadata")
        meta: ModelMetadata = orjson.loads(body)
        return meta

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        request_id: str,
        timeout_s: float,
        traceparent: str = "",
    ) -> dict[str, np.ndarray]:
        chunks: list[bytes] = []
        header_inputs = []
        for name, arr in inputs.items():
            datatype, data = _raw_input(name, arr)
            chunks.append(data)
            header_inputs.append(
                {
                    "name": name,
                    "shape": list(arr.shape),
                    "datatype": datatype,
                    "parameters": {"binary_data_size": len(data)},
                }
            )
        header: dict[str, object] = {
            "inputs": header_inputs,
            "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in outputs],
        }
        if request_id:
            header["id"] = request_id
        head = orjson.dumps(header)
        body = b"".join([head, *chunks])
        headers = {
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        }
        if traceparent:
            headers["traceparent"] = traceparent
        try:
            async with self._client().post(
                self._base + "/infer",
                data=body,
                headers=headers,
                timeout=self._timeout(timeout_s),
            ) as resp:
                status = resp.status
                data_in = await resp.read()
                header_len = resp.headers.get("Inference-Header-Content-Length")
        except (TimeoutError, self._aiohttp.ClientError, OSError) as e:
            raise self._no_answer(e, "infer", timeout_s) from None
        if status != 200:
            raise self._status_error(status, data_in, "infer")
        return _check_outputs(self._decode(data_in, header_len), outputs, self.where)

    def _decode(self, body: bytes, header_len: str | None) -> dict[str, np.ndarray]:
        hl = int(header_len) if header_len else len(body)
        answer = orjson.loads(body[:hl])
        view = memoryview(body)
        offset = hl
        result: dict[str, np.ndarray] = {}
        for out in answer.get("outputs", []):
            name, datatype, shape = out["name"], out["datatype"], list(out["shape"])
            size = (out.get("parameters") or {}).get("binary_data_size")
            if size is not None:
                result[name] = _from_bytes(view[offset : offset + size], datatype, shape, name)
                offset += size
            elif datatype == "BYTES":
                values = [
                    v.encode() if isinstance(v, str) else bytes(v) for v in out.get("data", [])
                ]
                result[name] = np.array(values, dtype=object).reshape(shape)
            else:
                result[name] = np.asarray(out.get("data", []), dtype=V2_TO_NUMPY[datatype]).reshape(
                    shape
                )
        return result

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def make_client(endpoint: Endpoint) -> RemoteClient:
    """The client for ``endpoint.protocol`` (``grpc`` or ``http``)."""
    return GrpcClient(endpoint) if endpoint.protocol == "grpc" else HttpClient(endpoint)
