"""``triton_python_backend_utils`` for pdserve's python workers (``import ... as pb_utils``).

A python model written for Triton's python backend imports this module by its Triton
name; each worker registers it in ``sys.modules`` under that name (:func:`install`)
before it imports ``model.py``. It provides what Triton's module provides to such models
(triton-inference-server/python_backend ``triton_python_backend_utils.py``, ``pb_stub.cc``,
``pb_tensor.cc``): :class:`Tensor`, :class:`InferenceRequest` (with BLS ``exec`` /
``async_exec``), :class:`InferenceResponse`, :class:`InferenceResponseSender` (decoupled
models), :class:`TritonError` with Triton's codes (they reach the client unchanged, as
Triton maps them to gRPC and HTTP status), :class:`ModelConfig` (auto-complete),
:class:`Logger`, and the type and lookup helpers.

Not supported: GPU tensors, custom metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

# ModelConfig is part of this module's public API (pb_utils.ModelConfig).
from pdserve.backends.python.model_config import ModelConfig as ModelConfig
from pdserve.core import datatypes
from pdserve.core.errors import ErrorCode

#: Triton ``TYPE_*`` names -> numpy types (Triton's table: ``TYPE_BOOL`` is Python's
#: ``bool``, the others numpy scalar types).
TRITON_STRING_TO_NUMPY: dict[str, type] = {
    datatypes.V2_TO_CONFIG[v2]: (bool if v2 == "BOOL" else dtype.type)
    for v2, dtype in datatypes.V2_TO_NUMPY.items()
}

#: ``TRITONSERVER_DataType`` value (tritonserver.h numbers the V2 datatypes in the
#: core table's order, BOOL = 1 to BYTES = 13) -> numpy type.
_TRITON_TO_NUMPY: dict[int, type] = {
    code: dtype.type for code, dtype in enumerate(datatypes.V2_TO_NUMPY.values(), start=1)
}
_NUMPY_TO_TRITON: dict[np.dtype, int] = {np.dtype(v): k for k, v in _TRITON_TO_NUMPY.items()}

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1


# --------------------------------------------------------------------------- errors


class TritonError(Exception):
    """An error a model attaches to a response (``InferenceResponse(error=...)``).

    Args:
        message: what went wrong; the client sees it as the error message.
        code: one of the class constants (Triton's ``TRITONSERVER_Error_Code``
            values); decides the client's gRPC / HTTP status (module docstring).
            Triton's default is ``INTERNAL`` (HTTP 500).

    (In Triton this is not an exception class; pdserve also lets a model *raise*
    it from ``execute``, which fails every request of that call with its code.)
    """

    UNKNOWN = ErrorCode.UNKNOWN.value
    INTERNAL = ErrorCode.INTERNAL.value
    NOT_FOUND = ErrorCode.NOT_FOUND.value
    INVALID_ARG = ErrorCode.INVALID_ARG.value
    UNAVAILABLE = ErrorCode.UNAVAILABLE.value
    UNSUPPORTED = ErrorCode.UNSUPPORTED.value
    ALREADY_EXISTS = ErrorCode.ALREADY_EXISTS.value
    CANCELLED = ErrorCode.CANCELLED.value

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = int(code)

    def message(self) -> str:
        """The error message."""
        return self._message

    def code(self) -> int:
        """The error code (``TritonError.INVALID_ARG``...)."""
        return self._code

    def __str__(self) -> str:
        return str(self._message)


class TritonModelException(Exception):
    """Raised by pb_utils when a model uses it wrongly; a model may raise it too.

    Raised out of ``execute`` it fails that call's requests with ``INTERNAL`` (HTTP 500).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self._message = message

    def message(self) -> str:
        """The exception message."""
        return self._message


# --------------------------------------------------------------------------- types


def triton_to_numpy_type(data_type: int) -> type | None:
    """numpy type of a ``TRITONSERVER_DataType`` value (None when unknown)."""
    return _TRITON_TO_NUMPY.get(data_type)


def numpy_to_triton_type(data_type: npt.DTypeLike) -> int | None:
    """``TRITONSERVER_DataType`` value of a numpy type (``bytes_``/``object_`` -> 13)."""
    try:
        dt = np.dtype(data_type)
    except TypeError:
        return None
    if dt.kind in "OS":
        return 13
    return _NUMPY_TO_TRITON.get(dt)


def triton_string_to_numpy(triton_type_string: str) -> type:
    """numpy type of a configuration type name (``"TYPE_FP32"`` -> ``np.float32``).

    Raises:
        KeyError: unknown name.
    """
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | tuple[()] | None:
    """Length-prefixed (uint32 LE) concatenation of a BYTES tensor's elements, C order.

    Returns ``()`` for an empty tensor and None for a tensor that is neither ``object``
    nor ``S`` (as Triton). The encoding is
    :func:`pdserve.core.datatypes.serialize_bytes_tensor`'s (``str`` elements UTF-8,
    other non-``bytes`` objects as ``str(obj)``, as Triton).
    """
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype == np.object_ or input_tensor.dtype.type == np.bytes_:
        return datatypes.serialize_bytes_tensor(input_tensor)
    return None


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """Inverse of :func:`serialize_byte_tensor`: a 1-D object array of ``bytes``.

    Raises:
        pdserve.core.errors.InferError: the data is truncated (an element or a length
            prefix runs past its end; Triton's raises ``struct.error`` there).
    """
    return datatypes.deserialize_bytes_tensor(encoded_tensor)


# --------------------------------------------------------------------------- tensors


class Tensor:
    """A named tensor: a request input, a response output or a BLS input.

    Args:
        name: tensor name.
        numpy_array: the data. BYTES tensors are ``np.object_`` arrays of ``bytes``
            (or ``np.bytes_`` arrays); ``np.str_`` arrays are refused, as in Triton.
        triton_dtype: optional ``TRITONSERVER_DataType`` to reinterpret the array as.

    Raises:
        TritonModelException: unsupported dtype.
    """

    __slots__ = ("_name", "_array", "_triton_dtype")

    def __init__(
        self, name: str, numpy_array: npt.ArrayLike, triton_dtype: int | None = None
    ) -> None:
        if not isinstance(numpy_array, np.ndarray):
            numpy_array = np.asarray(numpy_array)
        if numpy_array.dtype.type == np.str_ or numpy_array.dtype.kind == "V":
            raise TritonModelException(
                "Tensor dtype used for numpy_array is not supported by Python backend. "
                "Please use np.object_ instead."
            )
        if triton_dtype is not None:
            wanted = triton_to_numpy_type(triton_dtype)
            if wanted is not None and numpy_array.dtype != np.dtype(wanted):
                numpy_array = numpy_array.view(wanted)
        else:
            triton_dtype = _NUMPY_TO_TRITON.get(numpy_array.dtype)  # the common case, fast
            if triton_dtype is None:
                triton_dtype = numpy_to_triton_type(numpy_array.dtype)
            if triton_dtype is None:
                raise TritonModelException(
                    f"tensor '{name}': numpy dtype {numpy_array.dtype} has no Triton datatype"
                )
        self._name = name
        self._array = numpy_array
        self._triton_dtype = triton_dtype

    def name(self) -> str:
        """The tensor's name."""
        return self._name

    def as_numpy(self) -> np.ndarray:
        """The data as a numpy array (a view of shared memory for request inputs)."""
        return self._array

    def triton_dtype(self) -> int:
        """The ``TRITONSERVER_DataType`` value (11 for FP32...)."""
        return self._triton_dtype

    def shape(self) -> list[int]:
        """The shape as a list of ints."""
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        """Always True: pdserve's python tensors live in CPU memory."""
        return True

    def to_dlpack(self) -> object:
        """A DLPack capsule of the data (not for BYTES)."""
        return self._array.__dlpack__()

    def __dlpack__(self, stream: object = None) -> object:
        return self._array.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()

    @staticmethod
    def from_dlpack(name: str, dlpack_object: Any) -> Tensor:
        """A tensor from any object with ``__dlpack__`` (a torch CPU tensor...).

        Raises:
            TritonModelException: the object is not on the CPU.
        """
        try:
            array = np.from_dlpack(dlpack_object)
        except (TypeError, RuntimeError, BufferError) as e:
            raise TritonModelException(f"tensor '{name}': cannot import DLPack data: {e}") from e
        return Tensor(name, array)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._array.shape)}, dtype={self._array.dtype})"


# --------------------------------------------------------------------------- BLS hook

#: Set by the worker: ``submit(request) -> concurrent.futures.Future[InferenceResponse]``.
_bls_submit: Callable[[InferenceRequest], Future[InferenceResponse]] | None = None
#: Set by the worker: ``wait(future)`` blocks until it resolves (reading the channel).
_bls_wait: Callable[[Future[InferenceResponse]], None] | None = None
#: Set by the worker: ``stream(request)`` -> iterator of every response (``exec(decoupled=True)``).
_bls_stream: Callable[[InferenceRequest], Iterator[InferenceResponse]] | None = None


class InferenceTrace:
    """The trace context of a request (Triton python backend's ``InferenceTrace``).

    ``request.trace()`` returns one for each request ``execute`` receives. When the
    request is traced, :meth:`get_context` gives the W3C trace context of the model's
    ``execute`` span as Triton's JSON string, ``{"traceparent": "00-<trace>-<span>-01"}``,
    so the model can add its own OpenTelemetry spans under it::

        import json
        from opentelemetry import trace
        from opentelemetry.propagate import extract

        ctx = request.trace().get_context()
        parent = extract(json.loads(ctx)) if ctx else None
        with trace.get_tracer("my_model").start_as_current_span("tokenize", context=parent):
            ...

    (the model exports those spans with its own OpenTelemetry SDK setup). Pass it on to a
    BLS request, ``pb_utils.InferenceRequest(..., trace=request.trace())``, and the BLS
    call's spans join the request's trace; without it a BLS call is not traced (Triton's
    rule, docs/user_guide/trace.md "Tracing for BLS models").
    """

    def __init__(self, context: str | None = None) -> None:
        self._context = context or None

    @classmethod
    def from_traceparent(cls, traceparent: str) -> InferenceTrace:
        """The trace of a request whose execute span is ``traceparent`` ("" : untraced)."""
        if not traceparent:
            return _NO_TRACE
        return cls(json.dumps({"traceparent": traceparent}))

    def get_context(self) -> str | None:
        """Triton's JSON trace context (``{"traceparent": ...}``), or None when the
        request is not traced."""
        return self._context

    def __repr__(self) -> str:
        return f"InferenceTrace({self._context!r})"


_NO_TRACE = InferenceTrace()


def traceparent_of(request: InferenceRequest) -> str:
    """The ``traceparent`` a BLS request carries (its ``trace=`` argument), "" if none."""
    trace = request._trace
    context = trace.get_context() if isinstance(trace, InferenceTrace) else None
    if not context:
        return ""
    try:
        value = json.loads(context).get("traceparent", "")
    except (ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


class InferenceRequest:
    """An inference request: one of those ``execute`` receives, or a BLS request.

    A BLS request is built by the model and run on any loaded model of the same
    server with :meth:`exec` (blocking) or :meth:`async_exec` (awaitable)::

        request = pb_utils.InferenceRequest(
            model_name="efficientnet_lite0",
            requested_output_names=["logits"],
            inputs=[pb_utils.Tensor("input", batch)],
        )
        response = request.exec()
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())

    Args:
        model_name: the target model (BLS).
        requested_output_names: outputs to return (all when empty).
        inputs: :class:`Tensor` list.
        request_id: client request id.
        correlation_id: sequence correlation id (0: none). A BLS request sends it as the
            ``sequence_id`` parameter; a request to a sequence model has its own here.
        model_version: BLS target version, -1 for the version policy's choice.
        flags: request flags: ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START`` / ``_END``
            (sent as ``sequence_start`` / ``sequence_end``; read back from them).
        timeout: BLS timeout in microseconds (0 = none).
        trace: the :class:`InferenceTrace` of the request this BLS call serves
            (``request.trace()``): the call then joins its trace.
        parameters: request parameters, a dict or a JSON string.
    """

    def __init__(
        self,
        model_name: str = "",
        requested_output_names: list[str] | None = None,
        inputs: list[Tensor] | None = None,
        request_id: str = "",
        correlation_id: int | str = 0,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: object = None,
        trace: object = None,
        parameters: Mapping[str, object] | str | None = None,
    ) -> None:
        self.model_name = model_name
        self._requested_output_names = list(requested_output_names or [])
        self._inputs = list(inputs or [])
        self._request_id = request_id
        self._correlation_id = correlation_id
        self.model_version = model_version
        self._flags = flags
        self._timeout = timeout
        self._trace = trace if isinstance(trace, InferenceTrace) else _NO_TRACE
        if isinstance(parameters, str):
            parameters = json.loads(parameters) if parameters else {}
        self._parameters: dict[str, Any] = dict(parameters or {})
        # the sequence batcher's parameters <-> Triton's correlation id and flags
        params = self._parameters
        if correlation_id:
            params.setdefault("sequence_id", correlation_id)
            if flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                params.setdefault("sequence_start", True)
            if flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                params.setdefault("sequence_end", True)
        elif params.get("sequence_id"):
            self._correlation_id = params["sequence_id"]
            self._flags |= (
                TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if params.get("sequence_start") else 0
            ) | (TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if params.get("sequence_end") else 0)

    def inputs(self) -> list[Tensor]:
        """The input tensors."""
        return self._inputs

    def requested_output_names(self) -> list[str]:
        """Names of the outputs to compute."""
        return self._requested_output_names

    def request_id(self) -> str:
        """The client's request id (``""`` when none)."""
        return self._request_id

    def correlation_id(self) -> int | str:
        """The correlation id (0 when none)."""
        return self._correlation_id

    def flags(self) -> int:
        """Request flags."""
        return self._flags

    def timeout(self) -> int:
        """Timeout in microseconds (0 = none)."""
        return self._timeout

    def trace(self) -> InferenceTrace:
        """The request's :class:`InferenceTrace` (its context is None when not traced)."""
        return self._trace

    def parameters(self) -> str:
        """The request parameters as a JSON string (as Triton returns them)."""
        return json.dumps(self._parameters)

    #: Set by the worker on the requests of ``execute``: polls the server's
    #: cancellations; None (a BLS request the model built): never cancelled.
    _cancel_probe: Callable[[], bool] | None = None

    def is_cancelled(self) -> bool:
        """Whether the request was cancelled (as Triton's): the client went away, its
        gRPC call was cancelled or passed its deadline, or its ``timeout`` expired.
        A model may check it while it works and stop early, answering e.g.
        ``TritonError("...", TritonError.CANCELLED)``."""
        probe = self._cancel_probe
        return bool(probe is not None and probe())

    #: Set by the worker on the requests of a decoupled model's ``execute``.
    _response_sender: InferenceResponseSender | None = None

    def get_response_sender(self) -> InferenceResponseSender:
        """The sender of this request's responses (decoupled models).

        Raises:
            TritonModelException: the model is not decoupled (pdserve answers a
                non-decoupled request with the list ``execute`` returns), or this is
                a BLS request built by the model.
        """
        if self._response_sender is None:
            raise TritonModelException(
                "get_response_sender() is only available for the requests of a decoupled "
                "model (model_transaction_policy { decoupled: true }) in pdserve"
            )
        return self._response_sender

    @overload
    def exec(self, decoupled: Literal[False] = False) -> InferenceResponse: ...

    @overload
    def exec(self, decoupled: Literal[True]) -> Iterator[InferenceResponse]: ...

    @overload
    def exec(self, decoupled: bool) -> InferenceResponse | Iterator[InferenceResponse]: ...

    def exec(self, decoupled: bool = False) -> InferenceResponse | Iterator[InferenceResponse]:
        """Run this request on ``model_name`` and wait for the response (BLS).

        Errors of the target model come back as a response with an error (check
        :meth:`InferenceResponse.has_error`), as in Triton.

        With ``decoupled=True`` (Triton's decoupled BLS): returns an iterator of the
        target's responses as they come — a decoupled model's several ones, any other
        model's one; the last one is empty (no output tensors) when the model sent its
        final flag alone, as in Triton, so check ``len(r.output_tensors()) > 0``.

        Raises:
            TritonModelException: called outside a pdserve worker.
        """
        if decoupled:
            if not self.model_name:
                raise TritonModelException("a BLS InferenceRequest needs a model_name")
            if _bls_stream is None:
                raise TritonModelException("BLS is only available inside a pdserve python worker")
            return _bls_stream(self)
        future = self._submit(decoupled)
        if _bls_wait is not None:
            _bls_wait(future)
        return future.result()

    def async_exec(self, decoupled: bool = False) -> Awaitable[InferenceResponse]:
        """Start this request on ``model_name``; await the result (BLS, ``async def execute``).

        Raises:
            TritonModelException: ``decoupled=True`` (not supported by pdserve in
                ``async_exec``: use ``exec(decoupled=True)``), or called outside a pdserve
                worker.
        """
        future = self._submit(decoupled)
        return asyncio.wrap_future(future)

    def _submit(self, decoupled: bool) -> Future[InferenceResponse]:
        if decoupled:
            raise TritonModelException(
                "async_exec(decoupled=True) is not supported by pdserve: use exec(decoupled=True)"
            )
        if not self.model_name:
            raise TritonModelException("a BLS InferenceRequest needs a model_name")
        if _bls_submit is None:
            raise TritonModelException("BLS is only available inside a pdserve python worker")
        return _bls_submit(self)

    def __repr__(self) -> str:
        return (
            f"InferenceRequest(model_name={self.model_name!r}, "
            f"inputs={[t.name() for t in self._inputs]}, "
            f"requested_output_names={self._requested_output_names})"
        )


class InferenceResponse:
    """The response to one request: output tensors, or an error.

    Args:
        output_tensors: :class:`Tensor` list (must be a list, as in Triton).
        error: a :class:`TritonError` to fail this request only.
        parameters: response parameters (dict or JSON string).

    Raises:
        TritonModelException: ``output_tensors`` is not a list.
    """

    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: Mapping[str, object] | str | None = None,
    ) -> None:
        if output_tensors is None:
            output_tensors = []
        if not isinstance(output_tensors, list):
            raise TritonModelException('"output_tensors" must be a list.')
        self._output_tensors = output_tensors
        if error is not None and not isinstance(error, TritonError):
            error = TritonError(str(error))
        self._error = error
        if isinstance(parameters, str):
            parameters = json.loads(parameters) if parameters else {}
        self._parameters = dict(parameters or {})

    def output_tensors(self) -> list[Tensor]:
        """The output tensors."""
        return self._output_tensors

    def has_error(self) -> bool:
        """True when the response carries an error."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The error, or None."""
        return self._error

    def parameters(self) -> str:
        """Response parameters as a JSON string."""
        return json.dumps(self._parameters)


class InferenceResponseSender:
    """Sends the responses of one request of a decoupled model (Triton's
    ``ResponseSender``, python_backend ``src/response_sender.cc``).

    Thread-safe: ``execute`` may hand it to a thread that sends later.

    Args:
        transmit: sends one response (None: only the final flag) and whether it is
            final to the server (the worker's channel).
        cancelled: True once the server no longer wants responses (client gone,
            request timeout).
    """

    def __init__(
        self,
        transmit: Callable[[InferenceResponse | None, bool], None],
        cancelled: Callable[[], bool],
    ) -> None:
        self._transmit = transmit
        self._cancelled = cancelled
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send ``response``; ``flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL`` marks the
        request's last one (``response`` may then be None: an empty final).

        Once the request is cancelled (``is_cancelled()``), responses are dropped.

        Raises:
            TritonModelException: the final flag was already sent ("Unable to send
                response. Response sender has been closed.", Triton's message), flags
                other than 0 / FINAL, no response without the final flag, or
                ``response`` is not an :class:`InferenceResponse`.
        """
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException(f"Invalid flags for response sender: {flags}")
        if response is None and not final:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"send() takes an InferenceResponse, got {type(response).__name__}"
            )
        with self._lock:
            if self._closed:
                raise TritonModelException(
                    "Unable to send response. Response sender has been closed."
                )
            if final:
                self._closed = True
            self._transmit(response, final)

    def is_cancelled(self) -> bool:
        """True once the client went away or the request timed out (Triton's
        ``response_sender.is_cancelled()``): stop and send the final flag."""
        return self._cancelled()

    def _close_with(self, response: InferenceResponse) -> bool:
        """Send ``response`` as the final one unless the sender is closed already
        (the worker's clean-up after ``execute`` raised). Returns whether it sent."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._transmit(response, True)
            return True


# --------------------------------------------------------------------------- lookups


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    """The input tensor called ``name`` of a request, or None."""
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    """The output tensor called ``name`` of a (BLS) response, or None."""
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ``input`` entry called ``name`` of a model configuration dict, or None."""
    for entry in model_config.get("input", []):
        if entry["name"] == name:
            return entry
    return None


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ``output`` entry called ``name`` of a model configuration dict, or None."""
    for entry in model_config.get("output", []):
        if entry["name"] == name:
            return entry
    return None


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    """Whether the configuration asks for the decoupled transaction policy."""
    policy = model_config.get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))


# --------------------------------------------------------------------------- logging


class LogLevel:
    """Levels accepted by :meth:`Logger.log`."""

    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_log = logging.getLogger("pdserve.python_model")


def _log_at(level: int, doc: str) -> staticmethod[[str], None]:
    """A ``Logger`` method that logs at ``level``."""

    def log(message: str) -> None:
        Logger.log(message, level)

    log.__doc__ = doc
    return staticmethod(log)


class Logger:
    """Triton's model logger; messages go to the server's log (the worker's stderr)."""

    @staticmethod
    def log(message: str, level: int = LogLevel.INFO) -> None:
        """Log ``message`` at ``level`` (a :class:`LogLevel` value)."""
        py_level = {
            LogLevel.INFO: logging.INFO,
            LogLevel.WARNING: logging.WARNING,
            LogLevel.ERROR: logging.ERROR,
            LogLevel.VERBOSE: logging.DEBUG,
        }.get(level, logging.INFO)
        _log.log(py_level, "%s", message)

    log_info = _log_at(LogLevel.INFO, "Log at INFO.")
    log_warn = _log_at(LogLevel.WARNING, "Log at WARNING.")
    log_error = _log_at(LogLevel.ERROR, "Log at ERROR.")
    log_verbose = _log_at(LogLevel.VERBOSE, "Log at VERBOSE (debug).")


def install() -> None:
    """Make ``import triton_python_backend_utils`` return this module."""
    sys.modules["triton_python_backend_utils"] = sys.modules[__name__]
