"""The errors the core raises, with protocol-neutral codes.

The core, the schedulers and the backends raise :class:`InferError` carrying an
:class:`ErrorCode`; no HTTP or gRPC status is chosen here. Each frontend maps the code
to its protocol's status from one table at its edge:
``pdserve.frontends.http.status.HTTP_STATUS`` and
``pdserve.frontends.grpc.service.GRPC_STATUS``.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """What went wrong, independent of the protocol that reports it.

    The first eight members are Triton's ``TRITONSERVER_Error_Code``
    (triton-inference-server/core ``include/triton/core/tritonserver.h``), with the same
    values; they are also the codes of the python backend's ``pb_utils.TritonError``
    (``TritonError.INVALID_ARG == ErrorCode.INVALID_ARG.value``), so a python model's
    code converts with :meth:`from_triton`.

    Members above 99 are pdserve extensions; each names the Triton code it stands for
    where only Triton's codes can be carried (:attr:`triton_code`, e.g. the code a
    python model sees for a failed BLS call).
    """

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    #: pdserve extension: the client went away (closed the connection) before the
    #: answer, so the request was dropped or stopped. It is ``CANCELLED`` for Triton's
    #: purposes (gRPC ``CANCELLED``), but the HTTP frontend answers 499 (nginx's
    #: "Client Closed Request") where Triton answers ``CANCELLED`` with 400, so that a
    #: request the client abandoned is told apart from one a model cancelled.
    CLIENT_GONE = 100

    #: pdserve extension (traffic control): the request carries no valid credential
    #: (missing, malformed, expired or unknown API key / JWT). HTTP 401 with
    #: ``WWW-Authenticate: Bearer``, gRPC ``UNAUTHENTICATED``.
    UNAUTHENTICATED = 101
    #: pdserve extension (traffic control): the credential is valid but does not grant
    #: this model or API category (or a restricted-API header is missing). HTTP 403,
    #: gRPC ``PERMISSION_DENIED``.
    PERMISSION_DENIED = 102
    #: pdserve extension (traffic control): a rate limit is used up. HTTP 429 with
    #: ``Retry-After``, gRPC ``RESOURCE_EXHAUSTED`` (``retry-after`` trailing metadata).
    RESOURCE_EXHAUSTED = 103

    @property
    def triton_code(self) -> ErrorCode:
        """The ``TRITONSERVER_Error_Code`` this code stands for: itself for Triton's
        codes, the documented one for a pdserve extension."""
        return _TRITON_CODE.get(self, self)

    @classmethod
    def from_triton(cls, code: int) -> ErrorCode:
        """The member for a ``TRITONSERVER_Error_Code`` / ``pb_utils.TritonError`` code
        value (0-7); ``INTERNAL`` for any other value (an unknown code is a model fault).
        """
        member = _BY_TRITON_VALUE.get(code)
        return ErrorCode.INTERNAL if member is None else member


#: pdserve extension -> the Triton code it stands for.
_TRITON_CODE = {
    ErrorCode.CLIENT_GONE: ErrorCode.CANCELLED,
    ErrorCode.UNAUTHENTICATED: ErrorCode.INVALID_ARG,
    ErrorCode.PERMISSION_DENIED: ErrorCode.INVALID_ARG,
    ErrorCode.RESOURCE_EXHAUSTED: ErrorCode.UNAVAILABLE,
}
#: Triton code value -> member (extensions excluded).
_BY_TRITON_VALUE = {c.value: c for c in ErrorCode if c.value < 100}


class InferError(Exception):
    """An error a client gets back: a message and an :class:`ErrorCode`.

    The V2 REST frontend answers ``{"error": message}`` with the HTTP status of
    ``code``; the gRPC frontend aborts the call with the gRPC status of ``code`` and
    ``message`` as its details (the tables at each frontend's edge follow Triton's
    ``http_server.cc`` / ``grpc_utils.cc``).

    Args:
        message: what went wrong, as the client sees it.
        code: the error's code; the default, ``INVALID_ARG``, is a bad request.
        reason: short machine-readable reason used as a metrics label (e.g.
            ``"REJECTED"``); default ``"BACKEND"`` for ``INTERNAL``, else ``"REJECTED"``.

    Raises:
        TypeError: ``code`` is not an :class:`ErrorCode` (e.g. an HTTP status number).
    """

    def __init__(
        self, message: str, code: ErrorCode = ErrorCode.INVALID_ARG, reason: str | None = None
    ) -> None:
        if not isinstance(code, ErrorCode):
            raise TypeError(f"InferError code must be an ErrorCode, got {code!r}")
        super().__init__(message)
        self.message = message
        self.code = code
        #: short machine-readable reason used as a metrics label (e.g. "REJECTED").
        self.reason = reason or ("BACKEND" if code is ErrorCode.INTERNAL else "REJECTED")

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"InferError({self.message!r}, code={self.code})"

    def fresh(self) -> InferError:
        """A copy with no traceback, cause or context: give each request its own.

        One error object raised in many requests' frames would collect all their
        tracebacks (``raise`` prepends the raising frame to ``__traceback__``), and a
        traceback kept where it references its own frame is a reference cycle that
        holds the request's tensors until the cyclic garbage collector runs.
        """
        err = InferError(self.message, self.code, self.reason)
        err.__dict__.update(self.__dict__)
        return err


def invalid_arg(message: str) -> InferError:
    """A bad request (input, parameter, config): ``INVALID_ARG`` (HTTP 400, gRPC
    INVALID_ARGUMENT)."""
    return InferError(message, ErrorCode.INVALID_ARG)


def not_found(message: str) -> InferError:
    """An unknown model / version / tensor: ``NOT_FOUND`` (HTTP 404, gRPC NOT_FOUND)."""
    return InferError(message, ErrorCode.NOT_FOUND)


def unavailable(message: str, reason: str | None = None) -> InferError:
    """Not ready, queue full, timed out in the queue, shutting down: ``UNAVAILABLE``
    (HTTP 503, gRPC UNAVAILABLE)."""
    return InferError(message, ErrorCode.UNAVAILABLE, reason)


def internal(message: str) -> InferError:
    """A model or server fault: ``INTERNAL`` (HTTP 500, gRPC INTERNAL), metrics reason
    ``"BACKEND"``."""
    return InferError(message, ErrorCode.INTERNAL, reason="BACKEND")


def unsupported(message: str) -> InferError:
    """A feature pdserve does not implement: ``UNSUPPORTED`` (HTTP 501, gRPC
    UNIMPLEMENTED)."""
    return InferError(message, ErrorCode.UNSUPPORTED)


def client_gone(message: str = "request was cancelled: the client went away") -> InferError:
    """The client went away before the answer: ``CLIENT_GONE`` (HTTP 499, gRPC
    CANCELLED), metrics reason ``"CANCELED"``."""
    return InferError(message, ErrorCode.CLIENT_GONE, reason="CANCELED")
