"""Protocol-neutral request, response and error types.

Frontends translate the wire (V2 REST JSON / binary, V2 gRPC) into these and back;
everything below the frontends (server, scheduling, backends) only sees these.
Tensors are numpy arrays; BYTES tensors are numpy object arrays of ``bytes``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# HTTP status -> gRPC status code name, as Triton maps its error codes
# (triton-inference-server/core: TRITONSERVER_Error codes -> grpc::StatusCode).
_HTTP_TO_GRPC = {
    400: "INVALID_ARGUMENT",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    413: "INVALID_ARGUMENT",
    415: "INVALID_ARGUMENT",
    429: "UNAVAILABLE",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
}


class InferError(Exception):
    """An error a client gets back, with the HTTP status Triton would use.

    The V2 REST frontend answers ``{"error": message}`` with ``status``; the gRPC
    frontend maps ``status`` to a gRPC code (:attr:`grpc_code`). Status values
    follow Triton: 400 bad request, 404 unknown model/version, 503 unavailable /
    queue full, 500 internal, 501 unsupported.
    """

    def __init__(self, message: str, status: int = 400, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        #: short machine-readable reason used as a metrics label (e.g. "REJECTED").
        self.reason = reason or ("BACKEND" if status == 500 else "REJECTED")

    @property
    def grpc_code(self) -> str:
        """Name of the ``grpc.StatusCode`` member for this error."""
        return _HTTP_TO_GRPC.get(self.status, "UNKNOWN")

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"InferError({self.message!r}, status={self.status})"

    def fresh(self) -> InferError:
        """A copy with no traceback, cause or context: give each request its own.

        One error object raised in many requests' frames would collect all their
        tracebacks (``raise`` prepends the raising frame to ``__traceback__``), and a
        traceback kept where it references its own frame is a reference cycle that
        holds the request's tensors until the cyclic garbage collector runs.
        """
        err = InferError(self.message, self.status, self.reason)
        err.__dict__.update(self.__dict__)
        return err


def not_found(message: str) -> InferError:
    """An unknown model / version / tensor: HTTP 404, gRPC NOT_FOUND."""
    return InferError(message, 404)


def unavailable(message: str) -> InferError:
    """Not ready, queue full, shutting down: HTTP 503, gRPC UNAVAILABLE."""
    return InferError(message, 503)


def internal(message: str) -> InferError:
    """A model or server fault: HTTP 500, gRPC INTERNAL."""
    return InferError(message, 500, reason="BACKEND")


@dataclass(slots=True)
class RequestedOutput:
    """One entry of a request's ``outputs`` list.

    Attributes:
        name: output tensor name.
        binary_data: HTTP only: return this output in the binary tensor extension.
        classification: top-K classification extension (0 = off): the output is
            returned as BYTES ``"score:index[:label]"`` strings, K per batch row.
        parameters: any other per-output parameters, unchanged.
    """

    name: str
    binary_data: bool | None = None
    classification: int = 0
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferRequest:
    """One inference request, protocol-neutral.

    Attributes:
        model_name: target model.
        model_version: version string; ``""`` lets the version policy pick.
        inputs: input name -> numpy array (full shape, batch dim included when
            the model batches). BYTES inputs are object arrays of ``bytes``.
        outputs: requested outputs; ``None`` means every output of the model.
        id: the client's request id, echoed in the response.
        parameters: request-level parameters (``priority``, ``timeout`` in µs,
            ``binary_data_output``...).
        arrival_ns: ``time.monotonic_ns()`` when the frontend received it.
        cancelled: a callable returning True once the client has gone away.
    """

    model_name: str
    model_version: str = ""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: list[RequestedOutput] | None = None
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    cancelled: Any = None


@dataclass(slots=True)
class InferResponse:
    """The result of one :class:`InferRequest`.

    Attributes:
        model_name / model_version: the model and the version that answered.
        outputs: output name -> numpy array, in the order they should be sent.
        id: the request id echoed.
        parameters: response-level parameters.
    """

    model_name: str
    model_version: str
    outputs: dict[str, np.ndarray]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
