"""The native HTTP/1.1 transport for the V2 REST API: an ``asyncio.Protocol`` on the
running (uvloop) event loop with ``httptools`` as the parser, calling the
:class:`~pdserve.frontends.http.app.HttpApp` handlers without ASGI (the answering half
of a connection is :mod:`~pdserve.frontends.http.native_reply`).

What a connection may cost (:class:`~pdserve.frontends.http.server.HttpLimits`, shared
with the uvicorn server, and the app's body limits): request line and headers (431),
header and body timeouts and a least body rate (408), idle and write timeouts, open
connections (503), chunk sizes and chunked framing (413 / 431). A refusal is answered
after the responses due before it, then the connection closes lingering. Keep-alive,
HTTP/1.0, pipelining (in order, at most :data:`MAX_PIPELINE` waiting), ``Expect:
100-continue``, compressed bodies, gzip responses, write backpressure, cancellation on
disconnect and a graceful shutdown are handled here; one timer per server
(:meth:`NativeHttpServer._sweep`) checks every connection's deadline.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import struct
from collections.abc import Callable
from ssl import SSLContext
from typing import Any, cast

import httptools

from pdserve.core.cancel import CancelToken
from pdserve.core.errors import client_gone
from pdserve.core.procmem import settle_gc
from pdserve.frontends.http.app import HttpApp
from pdserve.frontends.http.chunks import ChunkWatch
from pdserve.frontends.http.native_reply import (
    BODY,
    HEAD,
    IDLE,
    LINGER,
    NONE,
    PIPE,
    WRITE,
    ParsedRequest,
    Replies,
)
from pdserve.frontends.http.server import HttpLimits, _warn
from pdserve.frontends.http.upgrade import InvalidFramingError, body_framing, continue_after_upgrade
from pdserve.frontends.http.wire import (
    CONTINUE,
    Rejected,
    error_bytes,
    feed_to_header_limit,
    origin_form,
    too_many_headers,
    unread_bytes,
)

#: Complete requests a connection may hold, waiting their turn, before it stops
#: reading (pipelining depth; memory bound).
MAX_PIPELINE = 16
#: Write buffer high-water mark per connection, in bytes (reading pauses above it).
WRITE_HIGH_WATER = 256 * 1024


def _tick(limits: HttpLimits, body_timeout: float | None) -> float:
    """Seconds between two deadline sweeps: a quarter of the shortest timeout, within
    [0.05, 1]."""
    timeouts = [t for t in (limits.header_timeout, limits.idle_timeout, body_timeout or 0) if t]
    if not timeouts:
        return 1.0
    return min(1.0, max(0.05, min(timeouts) / 4))


class NativeHttpServer:
    """The native HTTP/1.1 server for one :class:`~pdserve.frontends.http.app.HttpApp`.

    Args:
        app: the V2 application (its handlers, body limits and body timeout are used).
        host / port: where to listen (port 0: a free one; see :attr:`port`).
        limits: header size/count/timeout, idle timeout and connection cap
            (:class:`~pdserve.frontends.http.server.HttpLimits`; the same flags as the
            uvicorn server).
        draining: true from the shutdown signal on: every response then says
            ``Connection: close``.
        backlog: the listen queue length.
        reuse_port: set ``SO_REUSEPORT`` (several processes on one port).
        sock: a bound, listening socket to serve instead of binding ``host:port``.
        ssl: serve HTTPS with this server context
            (:attr:`pdserve.frontends.tls.ServerTls.context`); None: plain HTTP.

    Use: ``await server.start()``; ... ``await server.shutdown(grace)``.
    """

    def __init__(
        self,
        app: HttpApp,
        host: str = "0.0.0.0",
        port: int = 8000,
        *,
        limits: HttpLimits | None = None,
        draining: Callable[[], bool] | None = None,
        backlog: int = 2048,
        reuse_port: bool = False,
        sock: socket.socket | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        self.app = app
        self.ssl = ssl
        self.host = host
        self.port = port
        self.limits = limits or HttpLimits()
        self.connection_limit = self.limits.connection_limit()
        self.draining = draining or (lambda: False)
        self.backlog = backlog
        self.reuse_port = reuse_port
        self.sock = sock
        #: open connections.
        self.connections: set[HttpConnection] = set()
        #: the asyncio servers (their ``sockets`` are the listeners).
        self.servers: list[asyncio.Server] = []
        self.started = False
        #: set by :meth:`shutdown`: new requests are answered 503 and close.
        self.closing = False
        self._sweeper: asyncio.TimerHandle | None = None
        self._tick = _tick(self.limits, app.body.timeout)
        self._stopped: asyncio.Future[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        #: inference paths seen (query cut off) -> (model, version) decoded from them,
        #: so a request to a known path is routed without splitting and decoding it;
        #: cleared when it holds :data:`MAX_INFER_ROUTES`.
        self.infer_routes: dict[bytes, tuple[str, str]] = {}

    async def start(self) -> None:
        """Listen (raises ``OSError`` when the address cannot be bound)."""
        loop = self.loop = asyncio.get_running_loop()
        if self.sock is not None:
            srv = await loop.create_server(
                self._connection, sock=self.sock, backlog=self.backlog, ssl=self.ssl
            )
        else:
            srv = await loop.create_server(
                self._connection,
                self.host,
                self.port,
                backlog=self.backlog,
                reuse_port=self.reuse_port or None,
                ssl=self.ssl,
            )
        self.servers = [srv]
        if self.port == 0 and srv.sockets:
            self.port = srv.sockets[0].getsockname()[1]
        self._stopped = loop.create_future()
        self._sweeper = loop.call_later(self._tick, self._sweep)
        settle_gc()
        self.started = True

    def _connection(self) -> HttpConnection:
        return HttpConnection(self)

    @property
    def sockets(self) -> list[Any]:
        """The listening sockets."""
        return [s for srv in self.servers for s in srv.sockets]

    async def wait_stopped(self) -> None:
        """Return once :meth:`shutdown` has finished."""
        assert self._stopped is not None
        await asyncio.shield(self._stopped)

    def _sweep(self) -> None:
        """Close the connections past their deadline (idle, headers or body)."""
        assert self.loop is not None
        now = self.loop.time()
        for conn in list(self.connections):
            if conn.deadline and now >= conn.deadline:
                conn.deadline_passed(now)
            if conn.write_deadline:
                conn.check_write_stall(now)
        self._sweeper = self.loop.call_later(self._tick, self._sweep)

    def close_listeners(self) -> None:
        """Stop accepting connections."""
        for srv in self.servers:
            srv.close()

    async def shutdown(self, grace: float = 5.0) -> None:
        """Graceful stop: close the listeners; from now on a new request on an open
        connection gets 503 with ``Connection: close``; idle keep-alive connections
        close now, busy ones after their response; after ``grace`` seconds what is
        still open is aborted."""
        self.close_listeners()
        self.closing = True
        for conn in list(self.connections):
            conn.close_if_idle()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for srv in self.servers:
            try:
                await asyncio.wait_for(srv.wait_closed(), 1.0)
            except TimeoutError:
                pass
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    def settled(self) -> bool:
        """Every connection has answered what it received (nothing in progress or unread)."""
        return all(c.settled() for c in self.connections)


#: What a closed connection's ``parser`` becomes (bytes never reach it: asyncio calls
#: no ``data_received`` after ``connection_lost``).
_DETACHED_PARSER = httptools.HttpRequestParser(object())


class HttpConnection(Replies, asyncio.Protocol):
    """One client connection of a :class:`NativeHttpServer` (see the module docstring)."""

    def __init__(self, server: NativeHttpServer) -> None:
        self.server: NativeHttpServer = server
        self.app = server.app
        self.limits = server.limits
        self.loop = server.loop or asyncio.get_event_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set on connect
        self.deadline = 0.0
        self.deadline_kind = NONE
        #: while paused for writing: when it is aborted unless the client reads (0: not
        #: paused, or no idle timeout); the write buffer's size at the last sweep
        self.write_deadline = 0.0
        self._write_left = 0
        self._refused = False
        self._gone = False
        self._broken = False  # the parser failed or the request was refused: read no more
        # the request being parsed
        self._awaiting_headers = True
        self._message_begun = False
        self._header_bytes = 0
        self._header_count = 0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: bytes | bytearray = b""
        self._body_size = 0
        self._body_limit = 0
        self._body_json = False
        self._chunked = False  # the body is chunked (its size lines are watched)
        self._chunks = ChunkWatch()
        self._body_start = 0.0  # when its body began (headers or "100 Continue" sent)
        self._min_rate = self.limits.body_min_rate if server.app.body.timeout else 0.0
        self._accept = b""
        self._continue = False  # the request waits for "100 Continue"
        self._rejection: tuple[int, str] | None = None
        # a request asking for an upgrade (served as HTTP/1.1, see upgrade.py): its
        # method, keep-alive and HTTP/1.0-ness, and the framing of the body to read
        self._upgrade: tuple[bytes, bool, bool] | None = None
        self._upgrade_framing = b""
        self._framing = 0  # bytes past the headers that are not body (see _feed_body)
        self._linger_left = 0  # bytes still to drop while lingering (see _linger_close)
        self._serial = 0  # requests completed on this connection
        # requests being answered / waiting
        self._busy = False
        self._queue: collections.deque[ParsedRequest] = collections.deque()
        self._pending_error: bytes | None = None
        self._token: CancelToken | None = None
        self._paused = 0
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._disconnected: asyncio.Future[None] | None = None
        self._head_only = False  # the response being written answers HEAD

    # -- connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = self.transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport
        server = self.server
        if len(server.connections) >= server.connection_limit:
            self._refused = True
            _warn(
                "connections",
                "HTTP connection refused: %d connections are open (the limit)",
                len(server.connections),
            )
            transport.write(
                error_bytes(
                    503, f"too many open connections (the limit is {server.connection_limit})"
                )
            )
            transport.close()
            return
        server.connections.add(self)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass
        if self.limits.idle_timeout > 0:
            self.deadline = self.loop.time() + self.limits.idle_timeout
            self.deadline_kind = IDLE

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone = True
        # the parser holds this protocol (its callbacks): drop it, so the connection is
        # freed by reference counting, not left in a cycle for the collector
        self.parser = _DETACHED_PARSER
        self.server.connections.discard(self)
        self._queue.clear()
        self.deadline = 0.0
        token = self._token
        if token is not None and not token.finished:
            token.cancel(client_gone())
        if self._disconnected is not None and not self._disconnected.done():
            self._disconnected.set_result(None)
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True
        if self.limits.write_timeout > 0:
            self.write_deadline = self.loop.time() + self.limits.write_timeout
            self._write_left = self.transport.get_write_buffer_size()
        self._pause(WRITE)

    def resume_writing(self) -> None:
        self._write_paused = False
        self.write_deadline = 0.0
        self._resume(WRITE)
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pause(self, reason: int) -> None:
        if not self._paused and not self._gone and not self.transport.is_closing():
            self.transport.pause_reading()
        self._paused |= reason

    def _resume(self, reason: int) -> None:
        if not self._paused & reason:
            return
        self._paused &= ~reason
        if not self._paused and not self._gone and not self.transport.is_closing():
            self.transport.resume_reading()

    def abort(self) -> None:
        """Close at once (end of a shutdown's grace)."""
        if not self._gone:
            self.transport.abort()

    def _idle(self) -> bool:
        return not self._busy and not self._queue and not self._message_begun

    def close_if_idle(self) -> None:
        """Shutdown: close now if no request is in progress and nothing is unread."""
        if self._idle() and not unread_bytes(self.transport):
            self.transport.close()

    def settled(self) -> bool:
        """No request in progress or waiting, nothing unread."""
        if self._gone or self.transport.is_closing():
            return True
        return self._idle() and not unread_bytes(self.transport)

    # -- deadlines ----------------------------------------------------------------------

    def deadline_passed(self, now: float) -> None:
        """Called by the server's sweep once :attr:`deadline` has passed."""
        kind = self.deadline_kind
        self.deadline = 0.0
        self.deadline_kind = NONE
        if self._gone or self.transport.is_closing():
            return
        if kind == LINGER:
            self.transport.close()
            return
        if kind == IDLE:
            if self._idle():
                self.transport.close()
            return
        if self._busy or self._queue or self._paused:
            # A request is being answered: the pipelined one being read waits its turn;
            # or reading is paused (the client does not read what it was sent): what
            # does not arrive meanwhile is not the client's delay.
            self.deadline = now + self._tick_grace()
            self.deadline_kind = kind
            if kind == BODY and self._min_rate:
                # its rate clock restarts: a whole body timeout from now
                self._body_start = now - self._body_size / self._min_rate
            return
        if kind == HEAD and self._awaiting_headers:
            self._reject(
                408,
                f"the request headers did not arrive within {self.limits.header_timeout:g} seconds",
            )
        elif kind == BODY and not self._awaiting_headers:
            timeout = self.app.body.timeout or 0
            rate = self._min_rate
            if rate and self._body_size < (now - self._body_start - timeout) * rate:
                self._reject(
                    408,
                    f"the request body arrived too slowly: {self._body_size} bytes in "
                    f"{now - self._body_start:.1f} seconds (at least {rate:g} bytes per "
                    f"second after the first {timeout:g} seconds)",
                )
                return
            self._reject(
                408,
                f"the request body did not arrive: nothing received for {timeout:g} seconds",
            )

    def check_write_stall(self, now: float) -> None:
        """Called by the server's sweep while paused for writing: abort the connection
        once its write buffer has not shrunk (the client read nothing) for the write
        timeout; it cannot be closed gracefully, its buffer would never drain."""
        if self._gone or not self._write_paused:
            self.write_deadline = 0.0
            return
        left = self.transport.get_write_buffer_size()
        if left < self._write_left:  # the client took some: a whole timeout from now
            self.write_deadline = now + self.limits.write_timeout
        self._write_left = left
        if now < self.write_deadline:
            return
        self.write_deadline = 0.0
        _warn(
            "write-timeout",
            "HTTP connection aborted: the client read none of its %d buffered response "
            "bytes for %g seconds",
            left,
            self.limits.write_timeout,
        )
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset: the kernel drops the buffer instead of keeping it
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except (OSError, AttributeError):
                pass
        self.transport.abort()

    def _tick_grace(self) -> float:
        return self.limits.header_timeout or self.app.body.timeout or 1.0

    # -- bytes in -----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused or self._broken:
            if self.deadline_kind == LINGER:
                self._linger_left -= len(data)
                if self._linger_left < 0:
                    self.transport.close()  # dropped enough: the rest gets a reset
            return
        if self._awaiting_headers:
            room = self.limits.max_header_bytes - self._header_bytes
            if len(data) <= room:
                self._header_bytes += len(data)
                if data:
                    self._feed(data)
                return
            # the headers end within the room (the rest is body) or the request is refused
            rest = feed_to_header_limit(self, data, room, self.limits.max_header_bytes)
            if rest is None:
                return
            data = rest
        if data:
            self._feed_body(data)

    def _feed_body(self, data: bytes) -> None:
        """Feed bytes of a request past its headers; the framing among them (chunk
        headers and extensions, trailers: what is not body) may not exceed the header
        size limit plus the body's own size, which the parser would otherwise buffer
        (a trailer field) or spin on (extensions) without bound."""
        before = self._body_size
        serial = self._serial
        if not self._feed(data) or self._serial != serial or self._awaiting_headers:
            return  # refused, or this request is complete (its successor is counted anew)
        self._framing += len(data) - (self._body_size - before)
        limit = self.limits.max_header_bytes
        if self._framing > limit + self._body_size:
            self._reject(
                431,
                f"the chunked body's framing (chunk sizes, extensions, trailer fields) "
                f"exceeds {limit} bytes beyond its body",
            )

    def _feed(self, data: bytes) -> bool:
        """Feed the parser; False when no more should be read."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # The request asked for a protocol upgrade, which pdserve does not do: it is
            # served as HTTP/1.1, its body (if any) and what follows read by a fresh
            # parser (see upgrade.py).
            rest = continue_after_upgrade(self, data, exc)
            if rest and not self._broken:
                return self._feed(rest)
            return not self._broken
        except httptools.HttpParserError as exc:
            if self._rejection is None and self._broken:
                return False  # stopped after a request that closes the connection
            if self._rejection is not None:
                self._reject(*self._rejection)
            else:
                self._reject(400, f"Invalid HTTP request received: {exc}")
            return False
        if self._chunked and not self._awaiting_headers and not self._broken:
            size = self._chunks.declared(data, self._body_size)
            if size > self._body_limit:
                self._reject(
                    413, str(self.app.body.too_large(size, self._body_json, "of at least"))
                )
                return False
        return not self._broken

    # -- parser callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._broken:
            raise Rejected()  # nothing after a request that closes the connection
        self._message_begun = True
        self._header_count = 0
        self._url = b""
        self._headers = []
        self._body = b""
        self._body_size = 0
        self._accept = b""
        self._continue = False
        if self.limits.header_timeout > 0:
            self.deadline = self.loop.time() + self.limits.header_timeout
            self.deadline_kind = HEAD
        else:
            self.deadline = 0.0
            self.deadline_kind = NONE

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self._headers
        if self._awaiting_headers:
            headers.append((name.lower(), value))
            if len(headers) > self.limits.max_header_count:
                raise too_many_headers(self, self.limits.max_header_count)
            return
        # a trailer field of a chunked body: not a request header (dropped), but counted
        self._header_count += 1
        if len(headers) + self._header_count > self.limits.max_header_count:
            raise too_many_headers(self, self.limits.max_header_count)

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._framing = 0
        parser = self.parser
        content_length = -1
        expect = False
        chunked = False
        json = True
        infer = False
        url = self._url
        if parser.get_method() == b"POST" and url.startswith(b"/v2/models/"):
            infer = url.endswith(b"/infer") or b"/infer?" in url
        for key, value in self._headers:
            if key == b"content-length":
                try:
                    content_length = int(value)
                except ValueError:
                    content_length = -1
            elif key == b"accept-encoding":
                self._accept = value  # read when a response is large enough to gzip
            elif key == b"expect":
                if value.strip().lower() == b"100-continue":
                    expect = True
            elif key == b"inference-header-content-length":
                json = False
            elif key == b"transfer-encoding":
                chunked = True
                for coding in value.split(b","):
                    coding = coding.strip().lower()
                    if coding != b"chunked":
                        # RFC 9112 6.1 suggests 501; 400 keeps "a malformed request is
                        # never a 5xx" (the fuzz tests' rule; h11 also hints 501)
                        self._rejection = (
                            400,
                            f"Transfer-Encoding: transfer coding {coding.decode('latin-1')[:40]!r} "
                            "is not implemented (only chunked; use Content-Encoding to "
                            "compress)",
                        )
                        raise Rejected()
        json = json and infer
        self._chunked = chunked
        if chunked:
            self._chunks.start()
        app = self.app
        limit = app.body.json_limit if json else app.body.max_request_bytes
        self._body_limit = limit
        self._body_json = json
        if content_length > limit:
            self._rejection = (413, str(app.body.too_large(content_length, json)))
            raise Rejected()
        if content_length != 0 and (content_length > 0 or parser.get_http_version() == "1.1"):
            if app.body.timeout:
                now = self._body_start = self.loop.time()
                self.deadline = now + app.body.timeout
                self.deadline_kind = BODY
            else:
                self.deadline = 0.0
                self.deadline_kind = NONE
            if expect and parser.get_http_version() == "1.1":
                if self._busy or self._queue:
                    self._continue = True  # sent when this request is next in line
                else:
                    self.transport.write(CONTINUE)
        else:
            self.deadline = 0.0
            self.deadline_kind = NONE
        if parser.should_upgrade():
            try:
                self._upgrade_framing = body_framing(self._headers)
            except InvalidFramingError as exc:
                self._rejection = (400, f"Invalid HTTP request received: {exc}")
                raise Rejected() from None
            self._upgrade = (
                parser.get_method(),
                parser.should_keep_alive(),
                parser.get_http_version() == "1.0",
            )

    def on_body(self, chunk: bytes) -> None:
        size = self._body_size + len(chunk)
        self._body_size = size
        if size > self._body_limit:
            self._rejection = (
                413,
                str(self.app.body.too_large(size, self._body_json, "of at least")),
            )
            raise Rejected()
        body = self._body
        if not body:
            self._body = chunk
        elif type(body) is bytearray:
            body += chunk
        else:
            # Grown in place from the second piece on (see HttpApp._read_body).
            grown = bytearray(body)
            grown += chunk
            self._body = grown
        if self.deadline_kind == BODY:
            timeout = self.app.body.timeout or 0
            deadline = self.loop.time() + timeout
            if self._min_rate:
                # at least body_min_rate bytes/s on average after the first timeout
                by_rate = self._body_start + timeout + size / self._min_rate
                if by_rate < deadline:
                    deadline = by_rate
            self.deadline = deadline

    def on_chunk_header(self) -> None:
        self._chunks.chunk_header(self._body_size)

    def on_chunk_complete(self) -> None:
        self._chunks.chunk_complete()

    def on_message_complete(self) -> None:
        upgrade = self._upgrade
        if upgrade is None:
            parser = self.parser
            method = parser.get_method()
            keep_alive = parser.should_keep_alive()
            http10 = parser.get_http_version() == "1.0"
        elif self._upgrade_framing:
            return  # llhttp skipped the body: the next parser reads it (see _feed)
        else:
            method, keep_alive, http10 = upgrade
            self._upgrade = None
        url = self._url
        if url[:1] != b"/" or b"#" in url:  # a fragment too: uvicorn drops it
            url = origin_form(url)
        request = ParsedRequest(
            method,
            url,
            self._headers,
            self._body,  # type: ignore[arg-type]  # bytes or bytearray: both read alike
            keep_alive,
            http10,
            self._accept,
        )
        self._awaiting_headers = True
        self._message_begun = False
        self._serial += 1
        self._header_bytes = 0
        self._body = b""
        self.deadline = 0.0
        self.deadline_kind = NONE
        if not request.keep_alive:
            # Nothing after a request that closes the connection is parsed (what comes
            # is read and dropped: reading on is how a disconnect is seen).
            self._broken = True
        if self._busy or self._queue:
            self._queue.append(request)
            if len(self._queue) >= MAX_PIPELINE:
                self._pause(PIPE)
        else:
            self._dispatch(request)
