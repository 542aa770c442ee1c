"""The ASGI transport of the V2 handlers (what runs under uvicorn): an ASGI request
becomes one :meth:`~pdserve.frontends.http.app.HttpApp.handle` call, its
:class:`~pdserve.frontends.http.answer.Answer` becomes ASGI messages. The body is read
from ``receive`` within the app's limits; under uvicorn a client's disconnect cancels
the request at once (:func:`disconnect_token`)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol, cast

from pdserve.core.cancel import CancelToken
from pdserve.core.errors import client_gone
from pdserve.frontends.http.answer import Answer, Exchange, Headers, error_answer, pump_stream
from pdserve.frontends.http.body import BodyLimits
from pdserve.frontends.http.status import BodyTimeoutError

logger = logging.getLogger("pdserve.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientGoneError(Exception):
    """The client disconnected before the whole body arrived: nothing to answer."""


class Handlers(Protocol):
    """The V2 handlers as this transport calls them (:class:`~pdserve.frontends.http.app.HttpApp`)."""

    body: BodyLimits

    def handle(
        self, method: str, path: str, headers: Headers, exchange: Exchange
    ) -> Awaitable[Answer]: ...


async def serve_asgi(app: Handlers, scope: Scope, receive: Receive, send: Send) -> None:
    """ASGI 3: ``http`` scopes are answered by ``app.handle``, ``lifespan`` acknowledged."""
    kind = scope["type"]
    if kind != "http":
        if kind == "lifespan":
            await _lifespan(receive, send)
        return
    path: str = scope["path"]
    method: str = scope["method"]
    exchange = AsgiExchange(app.body, receive)
    try:
        answer = await app.handle(method, path, scope["headers"], exchange)
        if answer.stream is not None:
            await _send_stream(answer, receive, send)
        else:
            await send_answer(send, answer)
    except ClientGoneError:
        return
    except Exception as exc:  # noqa: BLE001 - one request must not take the server down
        if connection_closed(receive):
            # nobody to answer (e.g. the answer's own write failed: the client left
            # while a pipelined request waited, which uvicorn does not flag); flag it,
            # or uvicorn logs "ASGI callable returned without completing response" at
            # ERROR for a response begun and not ended
            mark_disconnected(receive)
            logger.debug("%s %s: the connection closed before the answer: %r", method, path, exc)
            return
        try:
            await send_answer(send, error_answer(exc, method, path))
        except RuntimeError as e:  # the response had started: the error cannot be sent
            logger.warning("%s %s failed after its answer began (%s): %r", method, path, e, exc)
    finally:
        release_disconnect_hook(receive)


async def send_answer(send: Send, answer: Answer) -> None:
    """An answer's ASGI messages (the parts of a large binary one sent one by one)."""
    await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
    parts = answer.parts
    if parts is None:
        await send({"type": "http.response.body", "body": answer.body})
        return
    last = len(parts) - 1
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": i != last})


async def _send_stream(answer: Answer, receive: Receive, send: Send) -> None:
    assert answer.stream is not None

    async def start() -> None:
        await send(
            {"type": "http.response.start", "status": answer.status, "headers": answer.headers}
        )

    async def write(piece: bytes) -> None:
        await send({"type": "http.response.body", "body": piece, "more_body": True})

    async def end() -> None:
        await send({"type": "http.response.body", "body": b""})

    await pump_stream(answer.stream, start, write, end, _wait_disconnect(receive))


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


class AsgiExchange:
    """One ASGI request as the handlers see it (:class:`~pdserve.frontends.http.answer.Exchange`)."""

    __slots__ = ("limits", "receive")

    def __init__(self, limits: BodyLimits, receive: Receive) -> None:
        self.limits = limits
        self.receive = receive

    def read_body(self, content_length: int, encoding: bytes, json: bool) -> Awaitable[bytes]:
        return read_body(self.limits, self.receive, content_length, encoding, json)

    def cancel_token(self) -> CancelToken:
        return disconnect_token(self.receive)

    def disconnected(self) -> Awaitable[None]:
        return _wait_disconnect(self.receive)


async def read_body(
    limits: BodyLimits, receive: Receive, content_length: int, encoding: bytes, json: bool = False
) -> bytes:
    """Read the request body, within ``limits`` (``json``: all of it is JSON), and
    decompress it.

    Raises:
        BodyTooLargeError: the declared, received or decompressed size is over the limit
            (reading stops there; the rest is never held in memory).
        BodyTimeoutError: no part of the body came for the body timeout.
        ClientGoneError: ``http.disconnect`` came before the end of the body.
        InferError(INVALID_ARG): a corrupt or truncated compressed body.
        UnsupportedMediaTypeError: an unsupported ``Content-Encoding``.
    """
    limit = limits.limit(json)
    if content_length > limit:
        raise limits.too_large(content_length, json)
    # uvicorn's cycle sets ``message_event`` once body bytes are buffered: then
    # ``receive()`` returns at once and needs no timer (the small-request path).
    event = getattr(getattr(receive, "__self__", None), "message_event", None)
    timeout = limits.timeout
    if timeout is None or (event is not None and event.is_set()):
        message = await receive()
    else:
        message = await _receive_within(receive, timeout)
    if message["type"] != "http.request":
        raise ClientGoneError()
    body: bytes = message.get("body", b"")
    if message.get("more_body", False):
        # Grown piece by piece: joining a list of pieces at the end would copy the whole
        # body into fresh memory in one step, during which the loop answers nothing.
        # Everything that reads the body (the codec, decompress, orjson) takes any
        # buffer, so the bytearray stands for bytes.
        buf = bytearray(body)
        while True:
            if len(buf) > limit:
                raise limits.too_large(len(buf), json, "of at least")
            message = await (receive() if timeout is None else _receive_within(receive, timeout))
            if message["type"] != "http.request":
                raise ClientGoneError()
            buf += message.get("body", b"")
            if not message.get("more_body", False):
                break
        body = cast(bytes, buf)
    return await limits.finish(body, encoding, json)


async def _receive_within(receive: Receive, timeout: float) -> Message:
    """``await receive()``, giving up after ``timeout`` seconds with 408."""
    try:
        async with asyncio.timeout(timeout):
            return await receive()
    except TimeoutError:
        raise BodyTimeoutError(
            f"the request body did not arrive: nothing received for {timeout:g} seconds"
        ) from None


async def _lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge ASGI lifespan events (the server's lifecycle is the CLI's job)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


# -- uvicorn's request cycle: seeing a disconnect without a task per request ----------


def _disconnect_probe(receive: Receive) -> Callable[[], bool] | None:
    """A zero-cost "has the client gone?" callable, or ``None``.

    uvicorn hands the app ``RequestResponseCycle.receive``; the cycle's ``disconnected``
    flag turns true when the connection is lost before the response completes. Other
    ASGI servers: ``None`` (a background ``receive()`` task per request would cost
    more than the check is worth on small models).
    """
    cycle = getattr(receive, "__self__", None)
    if cycle is not None and hasattr(cycle, "disconnected"):
        return functools.partial(getattr, cycle, "disconnected")
    return None


class _DisconnectEvent(asyncio.Event):
    """uvicorn's per-request ``message_event``, which also cancels the request's token
    the moment uvicorn marks the connection lost (``connection_lost`` sets
    ``cycle.disconnected`` then this event): a push, no task or poll per request."""

    def __init__(self, cycle: Any, token: CancelToken) -> None:
        super().__init__()
        self._cycle: Any = cycle  # uvicorn's RequestResponseCycle (not a public type)
        self._token: CancelToken | None = token

    def set(self) -> None:
        super().set()
        cycle, token = self._cycle, self._token
        if cycle is not None and token is not None and cycle.disconnected and not token.finished:
            token.cancel(client_gone())

    def release(self) -> None:
        """The request is answered: drop the cycle and the token. The cycle holds this
        event and the token's probe holds the cycle, so keeping them would leave a
        reference cycle per request for the garbage collector."""
        self._cycle = self._token = None


def connection_closed(receive: Receive) -> bool:
    """Whether the request's connection is gone, under uvicorn (``receive`` is
    ``RequestResponseCycle.receive``: its ``disconnected`` flag, or its transport closing);
    False under other ASGI servers."""
    cycle = getattr(receive, "__self__", None)
    if getattr(cycle, "disconnected", False):
        return True
    transport = getattr(cycle, "transport", None)
    return transport is not None and bool(transport.is_closing())


def mark_disconnected(receive: Receive) -> None:
    """Under uvicorn, set the request cycle's ``disconnected`` flag (the client is gone:
    a response begun and not ended is then not logged as the app's error)."""
    cycle = getattr(receive, "__self__", None)
    if cycle is not None and hasattr(cycle, "disconnected"):
        cycle.disconnected = True


def release_disconnect_hook(receive: Receive) -> None:
    """Release the request's :class:`_DisconnectEvent`, if :func:`disconnect_token`
    installed one on uvicorn's cycle (called once the request is answered)."""
    hook = getattr(getattr(receive, "__self__", None), "message_event", None)
    if type(hook) is _DisconnectEvent:
        hook.release()


def disconnect_token(receive: Receive) -> CancelToken:
    """The request's :class:`~pdserve.core.cancel.CancelToken`, cancelled with
    ``CLIENT_GONE`` as soon as the client disconnects.

    Under uvicorn (``receive`` is ``RequestResponseCycle.receive``) the cycle's
    ``message_event`` is swapped for :class:`_DisconnectEvent` once the body has been
    read, and reading resumes, so the disconnect is pushed; the ``disconnected`` flag
    stays the token's probe. Other ASGI servers: a token without a probe (timeouts only).
    """
    probe = _disconnect_probe(receive)
    token = CancelToken(probe)
    cycle: Any = getattr(receive, "__self__", None)  # uvicorn's RequestResponseCycle
    event = getattr(cycle, "message_event", None)
    if probe is not None and isinstance(event, asyncio.Event):
        hook = _DisconnectEvent(cycle, token)
        if event.is_set():
            asyncio.Event.set(hook)
        cycle.message_event = hook
        # uvicorn pauses reading while a large body waits in its buffer; the body is
        # read now: read on, or a client's close would go unseen (as uvicorn does when
        # an app awaits ``http.disconnect``; a pipelined request pauses it again)
        flow = getattr(cycle, "flow", None)
        if flow is not None and not getattr(cycle, "disconnected", False):
            flow.resume_reading()
    return token
