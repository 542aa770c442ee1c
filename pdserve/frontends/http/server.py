"""Run the V2 REST ASGI application on uvicorn (uvloop + httptools), with limits on
what a connection may cost.

uvicorn's httptools protocol has no limit on the size or number of request headers, no
deadline for them, arms its keep-alive timer only after a response and limits
concurrency only by answering 503 once a connection is open. :class:`LimitedHttpProtocol`
(a subclass of uvicorn's ``HttpToolsProtocol``) enforces :class:`HttpLimits` instead:
header bytes and count (431), header timeout and least body rate (408), idle timeout,
open connections (503 at once). Refusals are ``{"error": message}`` with ``connection:
close``, logged at most once per 10 seconds per kind. :func:`gzip_responses` codes
responses as the native transport does; an upgrade request is served as HTTP/1.1
(:mod:`.upgrade`). Body limits are the app's (:mod:`.body`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from ssl import SSLContext
from typing import Any, ClassVar

import httptools
import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pdserve.core.procmem import settle_gc
from pdserve.frontends.http.asgi import Message, Receive, Scope, Send
from pdserve.frontends.http.chunks import ChunkWatch
from pdserve.frontends.http.compression import GZIP_MIN_BYTES, accepts_gzip, gzip_bytes
from pdserve.frontends.http.upgrade import InvalidFramingError, body_framing, continue_after_upgrade
from pdserve.frontends.http.wire import Rejected, feed_to_header_limit, too_many_headers
from pdserve.frontends.offload import off_loop

logger = logging.getLogger("pdserve.http")

#: Default limit on the request line and headers of one request, in bytes: 64 KiB.
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
#: Default limit on the number of header fields of one request (Apache's LimitRequestFields).
DEFAULT_MAX_HEADER_COUNT = 100
#: Default seconds from a request's first byte to the end of its headers.
DEFAULT_HEADER_TIMEOUT_SECS = 30.0
#: Default seconds a connection may stay open with no request in progress (nginx's
#: keepalive_timeout: longer than the 60 s idle timeout of common load balancers, so
#: that the balancer, not pdserve, closes an idle pooled connection).
DEFAULT_IDLE_TIMEOUT_SECS = 75.0
#: Default least average rate of a request body, in bytes per second, after the first
#: body timeout (Apache's ``RequestReadTimeout body=20,MinRate=500`` default).
DEFAULT_BODY_MIN_RATE = 500.0
#: Default seconds a native-transport connection may stay paused for writing while its
#: client reads nothing (nginx's send_timeout default).
DEFAULT_WRITE_TIMEOUT_SECS = 60.0
#: ``max_connections`` 0 means: half the process's open-file limit (``ulimit -n``),
#: leaving the other half to models, gRPC and logs.
AUTO = 0


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP connection may cost (see the module docstring's table).

    Attributes:
        max_header_bytes: request line + headers of one request, in bytes (> 0).
        max_header_count: header fields of one request (> 0).
        header_timeout: seconds from a request's first byte to the end of its headers;
            0: no limit.
        idle_timeout: seconds a connection may stay open with no request in progress;
            0: no limit.
        max_connections: open connections at once; :data:`AUTO` (0) for half the
            open-file limit (see :meth:`connection_limit`).
        body_min_rate: least average rate of a request body, in bytes per second: a
            body must have arrived within the body timeout (``--http-body-timeout-secs``)
            plus one second per ``body_min_rate`` bytes received since its headers, or
            it gets 408 and the connection closes (Apache's mod_reqtimeout ``MinRate``).
            0, or no body timeout: no minimum.
        write_timeout: native transport: seconds a connection may stay paused for writing
            (its write buffer over the high-water mark) while the client reads none of it;
            then it is aborted (nginx's ``send_timeout``, default 60 s). 0: no limit.
    """

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_header_count: int = DEFAULT_MAX_HEADER_COUNT
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_SECS
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_SECS
    max_connections: int = AUTO
    body_min_rate: float = DEFAULT_BODY_MIN_RATE
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_SECS

    def connection_limit(self) -> int:
        """``max_connections``, with :data:`AUTO` resolved: half the soft
        ``RLIMIT_NOFILE`` of this process now (at least 1)."""
        if self.max_connections != AUTO:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return 1 << 20
        return max(1, soft // 2)


def serve_http(
    app: Callable[..., Awaitable[None]],
    host: str = "0.0.0.0",
    port: int = 8000,
    *,
    limits: HttpLimits | None = None,
    install_signal_handlers: bool = False,
    log_level: str = "warning",
    body_timeout: float | None = None,
    max_body: int = 0,
    ssl: SSLContext | None = None,
    **uvicorn_options: Any,
) -> uvicorn.Server:
    """Build (not start) a uvicorn server for ``app`` on uvloop + httptools.

    Run it inside the caller's asyncio loop with ``await server.serve()``; set
    ``server.should_exit = True`` for a graceful shutdown (stop accepting, finish
    in-flight requests), ``server.force_exit = True`` to stop at once.

    Args:
        app: the ASGI application (from :func:`create_http_app`).
        host / port: where to listen (port 0 picks a free port; read it back from
            ``server.servers[0].sockets`` once ``server.started`` is true).
        limits: header size, count and timeout, idle timeout and connection limit,
            enforced by :class:`LimitedHttpProtocol`; default :class:`HttpLimits`'s
            defaults.
        install_signal_handlers: uvicorn's ``serve()`` takes over SIGINT/SIGTERM and
            re-raises them when it returns. The default ``False`` leaves signals to the
            caller (the CLI shuts down HTTP, gRPC and workers together).
        log_level: uvicorn's own log level.
        body_timeout: the app's body timeout (``--http-body-timeout-secs``; the app
            enforces it between pieces): the grace before ``limits.body_min_rate``
            applies. None or 0: no minimum body rate.
        max_body: the app's largest request body (``--max-request-bytes``): a chunked
            body's chunk that declares a size past it is answered 413 at once, not
            awaited (see :mod:`~pdserve.frontends.http.chunks`). 0: not checked.
        ssl: serve HTTPS with this server context
            (:attr:`pdserve.frontends.tls.ServerTls.context`, handed to uvicorn as its
            ``ssl_context_factory``); None: plain HTTP.
        **uvicorn_options: passed to ``uvicorn.Config`` (``backlog``,
            ``ssl_certfile``...).

    Returns:
        The ``uvicorn.Server``.
    """
    limits = limits or HttpLimits()
    protocol = type(
        "LimitedHttpProtocol",
        (LimitedHttpProtocol,),
        {
            "limits": limits,
            "connection_limit": limits.connection_limit(),
            "body_timeout": body_timeout or 0.0,
            "max_body": max_body,
        },
    )
    options: dict[str, Any] = {
        "loop": "uvloop",
        "http": protocol,
        "lifespan": "off",
        "access_log": False,
        "log_level": log_level,
        "server_header": False,
        "date_header": False,
        # pdserve serves no WebSocket: an Upgrade request is plain HTTP (uvicorn would
        # hand it to its WebSocket protocol, which answered 500).
        "ws": "none",
        # uvicorn arms this after each response; ours also covers new connections.
        "timeout_keep_alive": limits.idle_timeout or 1e9,
    }
    if ssl is not None:
        options["ssl_context_factory"] = lambda _config, _default: ssl
    options.update(uvicorn_options)
    app = gzip_responses(app)
    settle_gc()
    config = uvicorn.Config(app, host=host, port=port, **options)
    if install_signal_handlers:
        return uvicorn.Server(config)
    return QuietServer(config)


#: Responses larger than this are compressed on a worker thread (the event loop carries
#: on); the same size as the app's ``OFFLOAD_BYTES``.
_GZIP_OFFLOAD_BYTES = 1 << 20


def gzip_responses(app: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Wrap an ASGI app so that its responses are coded as the native transport codes
    them: for a client whose ``Accept-Encoding`` allows gzip, a response body of at
    least :data:`~pdserve.frontends.http.compression.GZIP_MIN_BYTES` bytes with a
    known length and no ``Content-Encoding`` of its own is gzip-compressed
    (``Content-Encoding: gzip``, ``Content-Length`` of the compressed body); every
    response of that size says ``Vary: Accept-Encoding``. A response of unknown length
    (the ``generate_stream`` events) and the answer to ``HEAD`` are sent as they are.
    Triton's HTTP server also compresses responses on ``Accept-Encoding``.
    """

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await app(scope, receive, send)
            return
        gzip_ok = scope.get("method") != "HEAD" and any(
            name == b"accept-encoding" and accepts_gzip(value)
            for name, value in scope.get("headers", ())
        )
        start: Message | None = None  # held until the body is whole
        length = -1  # its declared Content-Length, -1 unknown
        encoded = False  # it has a Content-Encoding of its own
        held: list[bytes] = []

        async def send_coded(message: Message) -> None:
            nonlocal start, length, encoded
            kind = message.get("type")
            if kind == "http.response.start":
                length = -1
                encoded = False
                for name, value in message.get("headers", ()):
                    name = name.lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"content-encoding":
                        encoded = True
                if 0 <= length < GZIP_MIN_BYTES:
                    await send(message)  # small: as it is
                elif length >= 0 and (encoded or not gzip_ok):
                    await send(_with_vary(message, None))
                else:
                    start = message
                return
            if kind != "http.response.body" or start is None:
                await send(message)
                return
            more = message.get("more_body", False)
            if length < 0 and more and not held:
                # of unknown length and in pieces (a stream): as it is
                await send(start)
                start = None
                await send(message)
                return
            held.append(message.get("body", b""))
            if more:
                return
            body = held[0] if len(held) == 1 else b"".join(held)
            held.clear()
            head, start = start, None
            if len(body) < GZIP_MIN_BYTES:
                await send(head)
            elif encoded or not gzip_ok:
                await send(_with_vary(head, None))
            else:
                if len(body) > _GZIP_OFFLOAD_BYTES:
                    body = await off_loop(gzip_bytes, body)
                else:
                    body = gzip_bytes(body)
                await send(_with_vary(head, len(body)))
            await send({"type": "http.response.body", "body": body})

        await app(scope, receive, send_coded)

    return wrapped


def _with_vary(start: Message, gzip_length: int | None) -> Message:
    """``start`` (an ``http.response.start``) with ``Vary: Accept-Encoding``; with
    ``gzip_length``: also ``Content-Encoding: gzip`` and that ``Content-Length``."""
    headers = [
        (name, value)
        for name, value in start.get("headers", ())
        if name.lower() != b"vary" and (gzip_length is None or name.lower() != b"content-length")
    ]
    if gzip_length is not None:
        headers.append((b"content-length", b"%d" % gzip_length))
        headers.append((b"content-encoding", b"gzip"))
    headers.append((b"vary", b"accept-encoding"))
    return {**start, "headers": headers}


class QuietServer(uvicorn.Server):
    """A ``uvicorn.Server`` that leaves SIGINT/SIGTERM to its owner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


_last_warning: dict[str, float] = {}
_suppressed: dict[str, int] = {}


def _warn(kind: str, message: str, *args: Any) -> None:
    """Log a rejection, at most once per 10 s per ``kind`` (with how many were not logged)."""
    now = time.monotonic()
    if now - _last_warning.get(kind, -1e9) < 10.0:
        _suppressed[kind] = _suppressed.get(kind, 0) + 1
        return
    _last_warning[kind] = now
    skipped = _suppressed.pop(kind, 0)
    suffix = f" ({skipped} more since the last such message)" if skipped else ""
    logger.warning(message + suffix, *args)


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`HttpLimits` enforced.

    :func:`serve_http` makes a subclass per server that sets :attr:`limits` and
    :attr:`connection_limit`.

    Per connection: the bytes of the current request's line and headers are counted
    as they arrive, before httptools buffers them, and parsing stops at the limit
    (the bytes past it are never fed to the parser); a timer runs from a request's
    first byte until its headers are complete; uvicorn's keep-alive timer is armed
    whenever no request is in progress, new connections included.
    """

    limits: ClassVar[HttpLimits] = HttpLimits()
    connection_limit: ClassVar[int] = 1 << 20
    #: the grace, in seconds, before ``limits.body_min_rate`` applies to a body (0: never)
    body_timeout: ClassVar[float] = 0.0
    #: the largest request body (``--max-request-bytes``): a chunk declaring a size past
    #: it is refused at once (0: not checked; the app's limit applies as bytes arrive)
    max_body: ClassVar[int] = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_headers = True  # no request, or one whose headers are incomplete
        self._message_begun = False  # a request's first byte has been parsed
        self._header_bytes = 0
        self._header_count = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._rejection: tuple[int, str] | None = None
        self._deferred: tuple[int, str] | None = None  # answered once in-flight ones are
        self._refused = False
        # the body framing of a request asking for an upgrade (served as HTTP/1.1)
        self._upgrade_framing = b""
        # the minimum body rate: when the body began, its bytes so far, the check's timer
        self._body_start = 0.0
        self._body_got = 0
        self._rate_timer: asyncio.TimerHandle | None = None
        # a chunked body's size lines (see chunks.py), watched when max_body is set
        self._chunked = False
        self._chunks = ChunkWatch()

    # -- connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's base takes a BaseTransport; ours are Transports
        if len(self.connections) >= self.connection_limit:
            # Refused before it is counted: answer 503 and give the descriptor back now.
            self._refused = True
            self.transport = transport
            _warn(
                "connections",
                "HTTP connection refused: %d connections are open (the limit)",
                len(self.connections),
            )
            transport.write(
                _error_response(
                    503, f"too many open connections (the limit is {self.connection_limit})"
                )
            )
            transport.close()
            return
        super().connection_made(transport)
        self._arm_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_header_timer()
        self._cancel_rate_timer()
        super().connection_lost(exc)

    def _in_flight(self) -> bool:
        """A request's response is being produced (or its pipelined successor waits)."""
        return (self.cycle is not None and not self.cycle.response_complete) or bool(self.pipeline)

    # -- bytes in -----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused or self.parser is None or self._deferred is not None:
            return
        if self._awaiting_headers:
            room = self.limits.max_header_bytes - self._header_bytes
            if len(data) > room:
                # the headers end within the room (the rest is body), or it is refused
                rest = feed_to_header_limit(self, data, room, self.limits.max_header_bytes)
                if rest is None:
                    return
                data = rest
            else:
                self._header_bytes += len(data)
        if data and not self._feed(data):
            return
        if (
            not self._awaiting_headers
            and self._rate_timer is None
            and self.body_timeout > 0
            and self.limits.body_min_rate > 0
        ):
            # A body is being read (one that came whole with its headers never gets
            # here): check its rate once its first body timeout is over.
            delay = max(0.0, self._body_start + self.body_timeout - self.loop.time())
            self._rate_timer = self.loop.call_later(delay, self._check_body_rate)
        if not self._in_flight():
            if not self._message_begun:
                self._arm_idle_timer()  # nothing of a next request yet: restart the clock
            elif not self._awaiting_headers and self.timeout_keep_alive_task is None:
                # The body of a request already answered is being read and dropped:
                # the idle timeout is its deadline (not restarted by each piece).
                self._arm_idle_timer()

    def _feed(self, data: bytes) -> bool:
        """Feed httptools; ``False`` when the connection was answered and closed."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # pdserve upgrades to nothing (uvicorn runs with ws="none"): the request is
            # served as HTTP/1.1, its body (if any) and what follows read by a fresh
            # parser (see upgrade.py).
            rest = continue_after_upgrade(self, data, exc)
            if rest and not self.transport.is_closing():
                return self._feed(rest)
            return not self.transport.is_closing()
        except httptools.HttpParserError as exc:
            if self._rejection is not None:
                self._reject(*self._rejection)
            else:
                # Through _reject, not uvicorn's send_400_response: that one writes at
                # once, in the middle of (or instead of) the answers still owed to the
                # good requests pipelined before this one.
                self._reject(400, f"invalid HTTP request: {exc}")
            return False
        if self._chunked and not self._awaiting_headers and not self.transport.is_closing():
            size = self._chunks.declared(data, self._body_got)
            if size > self.max_body:
                cycle = self.cycle
                if cycle is not None and cycle.response_started:
                    self.transport.close()  # answered already; the body is not awaited
                else:
                    self._reject(
                        413,
                        f"request body of at least {size} bytes exceeds the limit of "
                        f"{self.max_body} bytes",
                    )
                return False
        return self.parser is not None and not self.transport.is_closing()

    # -- parser callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._message_begun = True
        self._header_count = 0
        self._unset_keepalive_if_required()
        if self.limits.header_timeout > 0 and self._header_timer is None:
            self._header_timer = self.loop.call_later(
                self.limits.header_timeout, self._header_timeout
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_header_count:
            raise too_many_headers(self, self.limits.max_header_count)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._cancel_header_timer()
        if self.parser.should_upgrade():
            try:
                self._upgrade_framing = body_framing(self.headers)
            except InvalidFramingError as exc:
                self._rejection = (400, f"invalid HTTP request: {exc}")
                raise Rejected() from None
        super().on_headers_complete()
        self._body_start = self.loop.time()
        self._body_got = 0
        self._chunked = bool(self.max_body) and any(
            name == b"transfer-encoding" for name, _ in self.headers
        )
        if self._chunked:
            self._chunks.start()

    def on_chunk_header(self) -> None:
        self._chunks.chunk_header(self._body_got)

    def on_chunk_complete(self) -> None:
        self._chunks.chunk_complete()

    def on_body(self, body: bytes) -> None:
        self._body_got += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._upgrade_framing:
            return  # llhttp skipped the upgrade request's body: the next parser reads it
        self._cancel_rate_timer()
        super().on_message_complete()
        self._awaiting_headers = True
        self._message_begun = False
        self._header_bytes = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer when idle
        if self._deferred is not None and not self._in_flight():
            # The requests pipelined before the refused one are all answered: now its turn.
            status, message = self._deferred
            self._unset_keepalive_if_required()
            if not self.transport.is_closing():
                self.transport.write(_error_response(status, message))
                self.transport.close()
            return
        if self._message_begun and self._awaiting_headers:
            # The next request has begun (pipelined): its header timer applies instead.
            self._unset_keepalive_if_required()

    # -- timers and refusals ------------------------------------------------------------

    def _arm_idle_timer(self) -> None:
        self._unset_keepalive_if_required()
        if self.limits.idle_timeout > 0:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.limits.idle_timeout, self.timeout_keep_alive_handler
            )

    def _cancel_rate_timer(self) -> None:
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None

    def _check_body_rate(self) -> None:
        """The body being read must have come at ``limits.body_min_rate`` bytes/s on
        average after its first ``body_timeout`` seconds: otherwise 408 and close."""
        self._rate_timer = None
        if self.transport.is_closing() or self._awaiting_headers:
            return
        rate = self.limits.body_min_rate
        now = self.loop.time()
        if self.flow.read_paused or self.pipeline:
            # Not read (a pipelined request waits its turn, or the app has not taken the
            # body so far): not the client's delay; its clock restarts.
            self._body_start = now - self._body_got / rate
        deadline = self._body_start + self.body_timeout + self._body_got / rate
        if now < deadline:
            self._rate_timer = self.loop.call_later(deadline - now, self._check_body_rate)
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self.transport.close()  # answered already; the rest of its body is not awaited
            return
        self._reject(
            408,
            f"the request body arrived too slowly: {self._body_got} bytes in "
            f"{now - self._body_start:.1f} seconds (at least {rate:g} bytes per second "
            f"after the first {self.body_timeout:g} seconds)",
        )

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self._awaiting_headers or self.transport.is_closing():
            return
        if self._in_flight():  # a pipelined request waits behind a response being sent
            self._header_timer = self.loop.call_later(
                self.limits.header_timeout, self._header_timeout
            )
            return
        self._reject(
            408,
            f"the request headers did not arrive within {self.limits.header_timeout:g} seconds",
        )

    def _reject(self, status: int, message: str) -> None:
        """Answer ``status`` and close; after the response in progress, if there is one."""
        _warn(str(status), "HTTP request refused with %d: %s", status, message)
        self._cancel_header_timer()
        self._unset_keepalive_if_required()
        if self._in_flight() and self._awaiting_headers:
            # A request after those in flight is refused: never interleave with a
            # response being written. Stop reading, answer the requests pipelined
            # before this one, then this refusal, then close (on_response_complete).
            # (An error in a body is the newest request's own: answered at once.)
            self._deferred = (status, message)
            self.flow.pause_reading()
            return
        if not self.transport.is_closing():
            self.transport.write(_error_response(status, message))
            self.transport.close()


def _error_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response: ``{"error": message}`` and ``connection: close``."""
    body = orjson.dumps({"error": message})
    return b"".join(
        [
            STATUS_LINE[status],
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )
