"""What the V2 handlers give a transport: :class:`Answer` (status, headers, body or
stream), what a transport gives the handlers for one request (:class:`Exchange`), and
the answer to an exception (:func:`error_answer`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, NamedTuple, Protocol

import orjson

from pdserve.core.cancel import CancelToken
from pdserve.core.errors import InferError
from pdserve.frontends.http.encode import encode_error
from pdserve.frontends.http.status import HTTP_STATUS, HttpError, MethodNotAllowedError

logger = logging.getLogger("pdserve.http")

Headers = list[tuple[bytes, bytes]]

JSON = (b"content-type", b"application/json")
OCTETS = (b"content-type", b"application/octet-stream")
CLOSE = (b"connection", b"close")


class Answer(NamedTuple):
    """A response: ``status``, ``headers`` (lower-case names; ``content-length`` set
    for a whole body) and ``body``: one bytes object, or the parts of a binary
    inference response (``parts`` set, ``body`` their first). ``stream``: the body of a
    streaming answer (Server-Sent Events), written as it comes, ``body`` unused."""

    status: int
    headers: Headers
    body: bytes = b""
    parts: list[Any] | None = None
    stream: AsyncGenerator[bytes, None] | None = None


class Exchange(Protocol):
    """What a transport offers the handlers for one request."""

    def read_body(self, content_length: int, encoding: bytes, json: bool) -> Awaitable[bytes]:
        """The whole request body, within the app's limits, ``Content-Encoding`` undone
        (``json``: all of it is JSON, so the JSON limit applies)."""
        ...

    def cancel_token(self) -> CancelToken:
        """The request's token, cancelled with ``CLIENT_GONE`` when the client leaves."""
        ...

    def disconnected(self) -> Awaitable[None]:
        """Done when the client has gone."""
        ...


def json_answer(body: bytes, status: int = 200) -> Answer:
    """A whole ``application/json`` answer."""
    return Answer(status, [JSON, (b"content-length", b"%d" % len(body))], body)


EMPTY_ANSWER = Answer(200, [(b"content-length", b"0")])
EMPTY_JSON_ANSWER = Answer(200, [JSON, (b"content-length", b"0")])
NOT_READY_ANSWER = Answer(400, [(b"content-length", b"0")])


def dumps(value: Any) -> bytes:
    """JSON bytes of a handler's result (numpy values included)."""
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


class WrongMethodError(MethodNotAllowedError):
    """405 with the method the path takes, for the ``Allow`` header RFC 9110 requires."""

    def __init__(self, allow: str) -> None:
        super().__init__("Method Not Allowed")
        self.allow = allow


def check_method(method: str, allowed: str) -> None:
    if method != allowed:
        raise WrongMethodError(allowed)


def error_answer(exc: BaseException, method: str = "", path: str = "") -> Answer:
    """The answer to an exception raised while serving ``method path``: ``{"error":
    message}`` with ``content-type`` and ``content-length``. InferError: the status of
    its code (:data:`~pdserve.frontends.http.status.HTTP_STATUS`), its ``http_headers``
    and ``Retry-After``; HttpError: its own status (405 with ``Allow``; ``connection:
    close`` when it closes); anything else: 500, logged with its traceback."""
    extra: Headers | None = None
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
    headers = [JSON, (b"content-length", b"%d" % len(body))]
    if close:
        headers.append(CLOSE)
    if extra:
        headers.extend(extra)
    return Answer(status, headers, body)


async def pump_stream(
    stream: AsyncGenerator[bytes, None],
    start: Callable[[], Awaitable[None]],
    write: Callable[[bytes], Awaitable[None]],
    end: Callable[[], Awaitable[None]],
    disconnected: Awaitable[None],
) -> None:
    """Write a streaming answer: ``start`` (its head) before its first piece (an error
    raised before it propagates, to be answered as such), ``write`` each piece, ``end``;
    stop (closing ``stream``, which cancels the request in the model) when the client
    leaves."""

    async def pump() -> None:
        started = False
        async for piece in stream:
            if not started:
                await start()
                started = True
            await write(piece)
        if not started:  # no piece at all: an empty stream
            await start()
        await end()

    pumping = asyncio.ensure_future(pump())
    watching = asyncio.ensure_future(disconnected)
    try:
        await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not pumping.done():
            pumping.cancel()
            with contextlib.suppress(BaseException):
                await pumping
        await stream.aclose()
    if pumping.done() and not pumping.cancelled():
        error = pumping.exception()
        if error is not None:
            raise error
