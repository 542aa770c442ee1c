"""HTTP status at the REST frontend's edge: the one ErrorCode -> status table, and the
errors that exist only in HTTP."""

from __future__ import annotations

from pdserve.core.errors import ErrorCode

#: ErrorCode -> HTTP status: the one table of the HTTP frontend. Triton's codes as
#: Triton's HTTP frontend maps them (triton-inference-server/server
#: ``src/http_server.cc``, ``HttpCodeFromError``: 500 internal, 404 not found, 503
#: unavailable, 501 unsupported, 400 for the rest); pdserve's extensions as
#: documented on :class:`~pdserve.core.errors.ErrorCode`.
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.UNKNOWN: 400,
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.CANCELLED: 400,
    ErrorCode.CLIENT_GONE: 499,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
}


def http_status(code: ErrorCode) -> int:
    """The HTTP status for ``code``, from :data:`HTTP_STATUS`."""
    return HTTP_STATUS[code]


class HttpError(Exception):
    """An error that exists only in HTTP (no :class:`~pdserve.core.errors.ErrorCode`):
    answered ``{"error": message}`` with :attr:`status`, and the connection closed
    after it when :attr:`close` is true.

    Args:
        message: what went wrong, as the client sees it.
        status: the HTTP status; default the class's :attr:`status`.
    """

    #: the HTTP status of the answer.
    status: int = 400
    #: close the connection after the answer (the rest of the body was not read).
    close: bool = False

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class MethodNotAllowedError(HttpError):
    """A known path with the wrong method: 405."""

    status = 405


class UnsupportedMediaTypeError(HttpError):
    """A ``Content-Encoding`` the server cannot undo: 415."""

    status = 415


class BodyTooLargeError(HttpError):
    """The request body is over the limit: 413, and the connection closed."""

    status = 413
    close = True


class BodyTimeoutError(HttpError):
    """The client stopped sending the body: 408, and the connection closed."""

    status = 408
    close = True
