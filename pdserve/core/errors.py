"""The errors the core raises; each frontend maps them to its protocol's status."""

from __future__ import annotations

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
