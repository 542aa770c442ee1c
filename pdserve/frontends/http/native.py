"""The native HTTP/1.1 transport for the V2 REST API: an ``asyncio.Protocol`` on the
running (uvloop) event loop, ``httptools`` as the parser, calling the
:class:`~pdserve.frontends.http.app.HttpApp`'s handlers directly.

The inference route (``POST /v2/models/{m}[/versions/{v}]/infer``) runs
:meth:`HttpApp.infer_body <pdserve.frontends.http.app.HttpApp.infer_body>` (the same
decode, checks, inference, statistics and encode as the ASGI app) with no ASGI scope,
``receive`` or ``send``: the response is written with one ``transport.write``
(``writelines`` for binary outputs) from precomputed header bytes. Every other route
(health, metadata, repository, shared memory, logging, trace, traffic, generate and
the ``generate_stream`` SSE stream) is served by the same :class:`HttpApp` through a
minimal in-process ASGI adapter (:class:`_AsgiExchange`): those routes are not on the
hot path, and one implementation of them is kept for both servers.

What the transport enforces (:class:`~pdserve.frontends.http.server.HttpLimits`, the
flags shared with the uvicorn server, plus the app's body limits):

==========================  =================================================================
request line + headers      over ``max_header_bytes`` bytes or ``max_header_count`` fields:
                            431 and close (nothing past the limit is buffered)
header timeout              ``header_timeout`` s from a request's first byte to the end of its
                            headers: 408 and close (slowloris on headers)
body                        over ``max_request_bytes`` (``max_json_bytes`` for a JSON-only
                            inference body): 413 and close, as soon as ``Content-Length``
                            says so or the bytes received pass it; ``body_timeout`` s with
                            no piece of it: 408 and close (slowloris on bodies); slower
                            than ``body_min_rate`` bytes/s on average after the first
                            ``body_timeout`` s: 408 and close (a body dripped just within
                            the timeout)
idle timeout                ``idle_timeout`` s with no request in progress: closed silently
write timeout               ``write_timeout`` s paused for writing (the write buffer above
                            :data:`WRITE_HIGH_WATER`) with no byte of it taken by the client:
                            aborted (a client that never reads its responses)
connections                 over ``max_connections``: 503 and closed at once
chunk sizes                 a chunk whose declared size takes the body past its limit: 413
                            and close as soon as its size line (or its first digits)
                            arrives (:mod:`~pdserve.frontends.http.chunks`); a size that
                            overflows 64 bits or is malformed: 400 (llhttp)
chunked framing             chunk sizes, extensions and trailer fields beyond
                            ``max_header_bytes`` plus the body's size: 431 and close; trailer
                            fields are not request headers (dropped); a transfer coding
                            other than ``chunked``: 400
==========================  =================================================================

An error that closes the connection is followed by a lingering close (the sending side
is shut, what the client still sends is dropped for :data:`LINGER_SECONDS`), so a client
still sending its body reads the 413 instead of a reset. Header and body deadlines do
not run while reading is paused by write backpressure.

HTTP/1.1 keep-alive (``Connection: close`` honoured), HTTP/1.0 (closed after the
response unless ``Connection: keep-alive``), pipelining (requests answered one after
the other, in order; a malformed request in a pipeline is answered after the good
ones before it, then the connection closes), ``Content-Length`` and chunked request
bodies, ``Expect: 100-continue`` (the interim response is sent when the request is
next in line and its declared size fits; otherwise 413 and close), gzip/deflate request
bodies (:mod:`~pdserve.frontends.http.compression`), gzip responses for clients that
send ``Accept-Encoding: gzip`` when the body is at least :data:`GZIP_MIN_BYTES`
(``Content-Encoding: gzip``, ``Vary: Accept-Encoding``; Triton's HTTP server also
compresses responses on ``Accept-Encoding``), write backpressure (reading stops while
the transport's write buffer is above its high-water mark), and request cancellation
when the client disconnects (the request's
:class:`~pdserve.core.cancel.CancelToken` is cancelled with ``CLIENT_GONE`` in
``connection_lost``).

Timeouts are checked by one timer per server (:meth:`NativeHttpServer._sweep`, every
:func:`_tick` seconds) against a deadline each connection keeps, so a request arms and
cancels no timer.

Graceful shutdown (:meth:`NativeHttpServer.shutdown`): the listeners are closed, idle
keep-alive connections are closed, a request that arrives on an open connection is
answered 503 with ``Connection: close``, requests in flight finish; what is still open
after the grace period is aborted. While ``draining()`` (from the shutdown signal on)
every response says ``Connection: close``, as the ASGI path does.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import http
import logging
import socket
import struct
import termios
import time
from collections.abc import Callable, Coroutine, MutableMapping
from typing import Any, cast
from urllib.parse import unquote

import httptools

from pdserve.core.cancel import CancelToken
from pdserve.core.errors import InferError, client_gone
from pdserve.core.procmem import settle_gc
from pdserve.frontends.http.app import (
    OFFLOAD_BYTES,
    HttpApp,
    _ClientGoneError,
    error_answer,
    parse_infer_headers,
)
from pdserve.frontends.http.chunks import ChunkWatch
from pdserve.frontends.http.codec import encode_error
from pdserve.frontends.http.compression import GZIP_MIN_BYTES
from pdserve.frontends.http.compression import accepts_gzip as _accepts_gzip
from pdserve.frontends.http.compression import gzip_bytes as _gzip
from pdserve.frontends.http.server import HttpLimits, _warn
from pdserve.frontends.http.status import BodyTooLargeError
from pdserve.frontends.http.upgrade import InvalidFramingError, body_framing, parser_after_upgrade
from pdserve.frontends.offload import off_loop

logger = logging.getLogger("pdserve.http")

#: Complete requests a connection may hold, waiting their turn, before it stops
#: reading (pipelining depth; memory bound).
MAX_PIPELINE = 16
#: Inference paths whose decoded (model, version) a server keeps (see
#: ``NativeHttpServer.infer_routes``).
MAX_INFER_ROUTES = 256
#: The name of every inference request's task (see ``HttpConnection._start``).
_INFER_TASK_NAME = "pdserve-http-infer"
#: Write buffer high-water mark per connection, in bytes (reading pauses above it).
WRITE_HIGH_WATER = 256 * 1024

_STATUS_LINES: dict[int, bytes] = {
    s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode("latin-1")) for s in http.HTTPStatus
}
_STATUS_LINES[499] = b"HTTP/1.1 499 Client Closed Request\r\n"
_OK_JSON = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
_OK_OCTETS = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
    b"inference-header-content-length: "
)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Header block endings by connection disposition.
_END_KEEP = b"\r\n\r\n"  # HTTP/1.1 keep-alive: nothing to say
_END_CLOSE = b"\r\nconnection: close\r\n\r\n"
_END_KEEP10 = b"\r\nconnection: keep-alive\r\n\r\n"  # HTTP/1.0 keep-alive
_GZIP_HEADERS = b"\r\ncontent-encoding: gzip\r\nvary: accept-encoding"
_VARY = b"\r\nvary: accept-encoding"

#: Seconds a connection closed after an error answer keeps reading (and dropping) what
#: the client still sends, so that the answer is not lost to a reset (a lingering close,
#: as nginx's ``lingering_close``).
LINGER_SECONDS = 2.0
#: At most this many bytes are read and dropped after a refusal in a request's line or
#: headers (431, 400): enough for a legitimate client's oversized headers to finish
#: arriving, not a sink for an endless header.
LINGER_HEADER_BYTES = 2 * 1024 * 1024

# Deadline kinds of a connection.
_NONE, _IDLE, _HEAD, _BODY, _LINGER = 0, 1, 2, 3, 4
# Reasons reading is paused (a bit mask).
_PIPE, _WRITE = 1, 2


class _Rejected(Exception):
    """Raised from a parser callback to stop parsing a request we refuse."""


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d Unknown\r\n" % status
    return line


def _error_bytes(status: int, message: str, close: bool = True) -> bytes:
    """A whole response ``{"error": message}`` (with ``connection: close``)."""
    body = encode_error(message)
    return b"%scontent-type: application/json\r\ncontent-length: %d%s%s" % (
        _status_line(status),
        len(body),
        _END_CLOSE if close else _END_KEEP,
        body,
    )


def _tick(limits: HttpLimits, body_timeout: float | None) -> float:
    """Seconds between two deadline sweeps: a quarter of the shortest timeout, within
    [0.05, 1]."""
    timeouts = [t for t in (limits.header_timeout, limits.idle_timeout, body_timeout or 0) if t]
    if not timeouts:
        return 1.0
    return min(1.0, max(0.05, min(timeouts) / 4))


def _unread_bytes(transport: Any) -> int:
    """Bytes received on a connection and not read yet (``FIONREAD``); 0 if unknown."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return 0
    buf = bytearray(4)
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", bytes(buf))[0])


def _origin_form(url: bytes) -> bytes:
    """The path and query of an absolute-form request target (``http://host/p?q``,
    RFC 9112 3.2.2), as uvicorn reads it; other targets (``*``) unchanged."""
    try:
        parsed = httptools.parse_url(url)
    except httptools.HttpParserInvalidURLError:
        return url
    path = parsed.path or b"/"
    return path + b"?" + parsed.query if parsed.query else path


class _Request:
    """One parsed request waiting to be (or being) answered."""

    __slots__ = ("method", "url", "headers", "body", "keep_alive", "http10", "gzip")

    def __init__(
        self,
        method: bytes,
        url: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        http10: bool,
        gzip: bool,
    ) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http10 = http10
        self.gzip = gzip


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
    ) -> None:
        self.app = app
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
        self._tick = _tick(self.limits, app.body_timeout)
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
            srv = await loop.create_server(self._connection, sock=self.sock, backlog=self.backlog)
        else:
            srv = await loop.create_server(
                self._connection,
                self.host,
                self.port,
                backlog=self.backlog,
                reuse_port=self.reuse_port or None,
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


class HttpConnection(asyncio.Protocol):
    """One client connection of a :class:`NativeHttpServer` (see the module docstring)."""

    def __init__(self, server: NativeHttpServer) -> None:
        self.server = server
        self.app = server.app
        self.limits = server.limits
        self.loop = server.loop or asyncio.get_event_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set on connect
        self.deadline = 0.0
        self.deadline_kind = _NONE
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
        self._min_rate = self.limits.body_min_rate if server.app.body_timeout else 0.0
        self._gzip = False
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
        self._queue: collections.deque[_Request] = collections.deque()
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
                _error_bytes(
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
            self.deadline_kind = _IDLE

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
        self._pause(_WRITE)

    def resume_writing(self) -> None:
        self._write_paused = False
        self.write_deadline = 0.0
        self._resume(_WRITE)
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
        if self._idle() and not _unread_bytes(self.transport):
            self.transport.close()

    def settled(self) -> bool:
        """No request in progress or waiting, nothing unread."""
        if self._gone or self.transport.is_closing():
            return True
        return self._idle() and not _unread_bytes(self.transport)

    # -- deadlines ----------------------------------------------------------------------

    def deadline_passed(self, now: float) -> None:
        """Called by the server's sweep once :attr:`deadline` has passed."""
        kind = self.deadline_kind
        self.deadline = 0.0
        self.deadline_kind = _NONE
        if self._gone or self.transport.is_closing():
            return
        if kind == _LINGER:
            self.transport.close()
            return
        if kind == _IDLE:
            if self._idle():
                self.transport.close()
            return
        if self._busy or self._queue or self._paused:
            # A request is being answered: the pipelined one being read waits its turn;
            # or reading is paused (the client does not read what it was sent): what
            # does not arrive meanwhile is not the client's delay.
            self.deadline = now + self._tick_grace()
            self.deadline_kind = kind
            if kind == _BODY and self._min_rate:
                # its rate clock restarts: a whole body timeout from now
                self._body_start = now - self._body_size / self._min_rate
            return
        if kind == _HEAD and self._awaiting_headers:
            self._reject(
                408,
                f"the request headers did not arrive within {self.limits.header_timeout:g} seconds",
            )
        elif kind == _BODY and not self._awaiting_headers:
            timeout = self.app.body_timeout or 0
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
        return self.limits.header_timeout or self.app.body_timeout or 1.0

    # -- bytes in -----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused or self._broken:
            if self.deadline_kind == _LINGER:
                self._linger_left -= len(data)
                if self._linger_left < 0:
                    self.transport.close()  # dropped enough: the rest gets a reset
            return
        limit = self.limits.max_header_bytes
        while True:
            if self._awaiting_headers:
                room = limit - self._header_bytes
                if len(data) > room:
                    head = data[: max(room, 0)]
                    data = data[len(head) :]
                    self._header_bytes += len(head)
                    if head and not self._feed(head):
                        return
                    if self._awaiting_headers:
                        self._reject(
                            431,
                            f"the request line and headers exceed the limit of {limit} bytes",
                        )
                        return
                    continue
                self._header_bytes += len(data)
                if data:
                    self._feed(data)
                return
            if data:
                self._feed_body(data)
            return

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
            framing = self._upgrade_framing
            self._upgrade_framing = b""
            self.parser = parser_after_upgrade(self, framing)
            rest = data[exc.args[0] :]
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
                    413, str(self.app.body_too_large(size, self._body_json, "of at least"))
                )
                return False
        return not self._broken

    # -- parser callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._broken:
            raise _Rejected()  # nothing after a request that closes the connection
        self._message_begun = True
        self._header_count = 0
        self._url = b""
        self._headers = []
        self._body = b""
        self._body_size = 0
        self._gzip = False
        self._continue = False
        if self.limits.header_timeout > 0:
            self.deadline = self.loop.time() + self.limits.header_timeout
            self.deadline_kind = _HEAD
        else:
            self.deadline = 0.0
            self.deadline_kind = _NONE

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_header_count:
            self._rejection = (
                431,
                f"the request has more than {self.limits.max_header_count} header fields",
            )
            raise _Rejected()
        if self._awaiting_headers:
            self._headers.append((name.lower(), value))
        # else: a trailer field of a chunked body: not a request header (dropped)

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
                self._gzip = _accepts_gzip(value)
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
                        raise _Rejected()
        json = json and infer
        self._chunked = chunked
        if chunked:
            self._chunks.start()
        app = self.app
        limit = app.body_limit(json)
        self._body_limit = limit
        self._body_json = json
        if content_length > limit:
            self._rejection = (413, str(app.body_too_large(content_length, json)))
            raise _Rejected()
        if content_length != 0 and (content_length > 0 or parser.get_http_version() == "1.1"):
            if app.body_timeout:
                now = self._body_start = self.loop.time()
                self.deadline = now + app.body_timeout
                self.deadline_kind = _BODY
            else:
                self.deadline = 0.0
                self.deadline_kind = _NONE
            if expect and parser.get_http_version() == "1.1":
                if self._busy or self._queue:
                    self._continue = True  # sent when this request is next in line
                else:
                    self.transport.write(_CONTINUE)
        else:
            self.deadline = 0.0
            self.deadline_kind = _NONE
        if parser.should_upgrade():
            try:
                self._upgrade_framing = body_framing(self._headers)
            except InvalidFramingError as exc:
                self._rejection = (400, f"Invalid HTTP request received: {exc}")
                raise _Rejected() from None
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
                str(self.app.body_too_large(size, self._body_json, "of at least")),
            )
            raise _Rejected()
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
        if self.deadline_kind == _BODY:
            timeout = self.app.body_timeout or 0
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
            url = _origin_form(url)
        request = _Request(
            method,
            url,
            self._headers,
            self._body,  # type: ignore[arg-type]  # bytes or bytearray: both read alike
            keep_alive,
            http10,
            self._gzip,
        )
        self._awaiting_headers = True
        self._message_begun = False
        self._serial += 1
        self._header_bytes = 0
        self._body = b""
        self.deadline = 0.0
        self.deadline_kind = _NONE
        if not request.keep_alive:
            # Nothing after a request that closes the connection is parsed (what comes
            # is read and dropped: reading on is how a disconnect is seen).
            self._broken = True
        if self._busy or self._queue:
            self._queue.append(request)
            if len(self._queue) >= MAX_PIPELINE:
                self._pause(_PIPE)
        else:
            self._dispatch(request)

    # -- requests -----------------------------------------------------------------------

    def _dispatch(self, request: _Request) -> None:
        self._busy = True
        self._head_only = request.method == b"HEAD"
        if self.server.closing:
            request.keep_alive = False
            self._finish(
                request,
                _error_bytes(503, "the server is shutting down"),
            )
            return
        url = request.url
        if request.method == b"POST" and url.startswith(b"/v2/models/"):
            path = url.split(b"?", 1)[0] if b"?" in url else url
            routes = self.server.infer_routes
            route = routes.get(path)
            if route is not None:
                self._start(self._infer(request, route[0], route[1]))
                return
            if path.endswith(b"/infer"):
                parts = path.split(b"/")
                n = len(parts)
                if n == 5 or (n == 7 and parts[4] == b"versions" and parts[5]):
                    try:
                        model = self._segment(parts[3])
                        version = self._segment(parts[5]) if n == 7 else ""
                    except UnicodeDecodeError:
                        pass  # the ASGI route answers it
                    else:
                        if len(routes) >= MAX_INFER_ROUTES:
                            routes.clear()
                        routes[path] = (model, version)
                        self._start(self._infer(request, model, version))
                        return
        self.loop.create_task(self._asgi(request))

    def _start(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run an inference request's coroutine in its own task.

        ``asyncio.Task`` with a fixed name rather than ``loop.create_task``: a task
        without a name gets "Task-N", formatted by ``PyUnicode_FromFormat`` at creation
        on 3.11, and uvloop's ``create_task`` wraps the same constructor (together about
        0.2 CPU-µs per request, measured). No task factory is set on pdserve's loops.
        """
        asyncio.Task(coro, loop=self.loop, name=_INFER_TASK_NAME)

    @staticmethod
    def _segment(raw: bytes) -> str:
        text = raw.decode("ascii")
        return unquote(text) if "%" in text else text

    def _new_token(self) -> CancelToken:
        # No probe to poll: connection_lost cancels self._token, the only token of
        # this connection not yet answered (one request is served at a time), so a
        # poll of self._gone would only repeat it (3 Python calls per request saved).
        token = self._token = CancelToken(None, self.loop)
        if self._gone:
            token.cancel(client_gone())
        return token

    async def _infer(self, request: _Request, model: str, version: str) -> None:
        """The hot path: ``POST .../infer`` without ASGI."""
        app = self.app
        arrival_ns = time.monotonic_ns()
        try:
            if not model:
                raise InferError("missing model name in the inference request path")
            headers = request.headers
            if app.gate is not None:
                path = request.url.split(b"?", 1)[0].decode("latin-1")
                await app.check_gate(unquote(path), headers)
            head = parse_infer_headers(headers)
            header_length = head[2]
            if header_length is not None and header_length > app.max_json_bytes:
                raise BodyTooLargeError(app._json_limit_message(header_length, "of"))
            body = request.body
            if head[1]:
                body = await app.finish_body(body, head[1], header_length is None)
            # app.infer_body's steps, run here for the common small request: the server's
            # coroutine is awaited by this task directly (one coroutine level fewer)
            decoded = app.decode_inline(body, head, model, version, arrival_ns, self._new_token)
            if decoded is None:
                parts, json_length, total = await app.infer_body(
                    body, head, model, version, arrival_ns, self._new_token
                )
            else:
                response = await app.run_decoded(decoded)
                encoded = app.encode_inline(response, decoded)
                if encoded is None:
                    encoded = await app.encode_large(response, decoded)
                parts, json_length, total = encoded
        except _ClientGoneError:
            self._finish(request, None)
            return
        except Exception as exc:  # noqa: BLE001 - answered; the connection carries on
            self._answer_error(request, exc, "POST", model)
            return
        except BaseException:  # cancelled: no answer can be trusted; close
            request.keep_alive = False
            self._finish(request, None)
            raise
        if self._gone:
            self._finish(request, None)
            return
        gzip_ok = request.gzip and total >= GZIP_MIN_BYTES
        if json_length is None:
            if gzip_ok:
                self._write_whole(request, 200, [(b"content-type", b"application/json")], parts)
                return
            end = self._end(request)
            if total >= GZIP_MIN_BYTES:
                end = _VARY + end
            self._finish(request, b"%s%d%s%s" % (_OK_JSON, total, end, parts[0]))
            return
        if gzip_ok:
            self._write_whole(
                request,
                200,
                [
                    (b"content-type", b"application/octet-stream"),
                    (b"inference-header-content-length", b"%d" % json_length),
                ],
                parts,
            )
            return
        end = self._end(request)
        if total >= GZIP_MIN_BYTES:
            end = _VARY + end
        head_bytes = b"%s%d\r\ncontent-length: %d%s" % (_OK_OCTETS, json_length, total, end)
        if self._gone:
            self._finish(request, None)
            return
        if total <= 64 * 1024:
            self._finish(request, head_bytes + b"".join(parts))
            return
        if not self._head_only:
            self.transport.writelines([head_bytes, *parts])
        else:
            self.transport.write(head_bytes)
        self._finish(request, None)

    def _end(self, request: _Request) -> bytes:
        """The end of the header block: the connection header, if one is needed."""
        if not request.keep_alive or self.server.draining() or self.server.closing:
            request.keep_alive = False
            return _END_CLOSE
        if request.http10:
            return _END_KEEP10
        return _END_KEEP

    def _write_whole(
        self,
        request: _Request,
        status: int,
        headers: list[tuple[bytes, bytes]],
        parts: list[Any],
    ) -> None:
        """Write a whole response (gzip-compressed when the client accepts it and it is
        large enough); schedules the compression off the loop when it is large."""
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        if request.gzip and len(body) >= GZIP_MIN_BYTES:
            if len(body) > OFFLOAD_BYTES:
                self.loop.create_task(self._write_gzip_later(request, status, headers, body))
                return
            self._finish(request, self._compose(request, status, headers, _gzip(body), True))
            return
        self._finish(request, self._compose(request, status, headers, body, False))

    async def _write_gzip_later(
        self, request: _Request, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        try:
            compressed = await off_loop(_gzip, body)
        except Exception:  # noqa: BLE001 - send it uncompressed
            self._finish(request, self._compose(request, status, headers, body, False))
            return
        self._finish(request, self._compose(request, status, headers, compressed, True))

    def _compose(
        self,
        request: _Request,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        gzipped: bool,
    ) -> bytes:
        """A whole response: status line, ``headers`` (content-length and connection
        are set here), body."""
        out = [_status_line(status)]
        for name, value in headers:
            if name in (b"content-length", b"connection", b"transfer-encoding"):
                continue
            if name == b"vary" and len(body) >= GZIP_MIN_BYTES:
                continue
            out.append(b"%s: %s\r\n" % (name, value))
        out.append(b"content-length: %d" % len(body))
        if gzipped:
            out.append(_GZIP_HEADERS)
        elif len(body) >= GZIP_MIN_BYTES:
            out.append(_VARY)
        out.append(self._end(request))
        if not self._head_only:
            out.append(body)
        return b"".join(out)

    def _answer_error(self, request: _Request, exc: BaseException, method: str, what: str) -> None:
        status, body, headers = error_answer(exc, method, what)
        close = any(name == b"connection" and value == b"close" for name, value in headers)
        if close:
            request.keep_alive = False
            self._broken = True
        if self._gone:
            self._finish(request, None)
            return
        self._finish(request, self._compose(request, status, headers, body, False))

    def _finish(self, request: _Request, data: bytes | None) -> None:
        """Write ``data`` (the whole response; None: already written) and go on with
        the next request, or close."""
        transport = self.transport
        if data is not None and not self._gone and not transport.is_closing():
            if self._head_only:
                end = data.find(b"\r\n\r\n")
                if end >= 0:
                    data = data[: end + 4]
            transport.write(data)
        self._busy = False
        self._token = None
        if self._gone:
            return
        if not request.keep_alive or self.server.closing:
            self._linger_close()
            return
        if self._queue:
            self._resume(_PIPE)
            self._dispatch(self._queue.popleft())
            return
        if self._pending_error is not None:
            transport.write(self._pending_error)
            self._pending_error = None
            self._linger_close()
            return
        if self._broken:
            # nothing after a refused request (or one that closes) was parsed: close
            transport.close()
            return
        if self._message_begun:
            if self._continue and not self._awaiting_headers:
                self._continue = False
                transport.write(_CONTINUE)
                if self.deadline_kind == _BODY:  # the client sends its body from now on
                    now = self._body_start = self.loop.time()
                    self.deadline = now + (self.app.body_timeout or 0)
            return  # its header/body deadline stands
        if self.limits.idle_timeout > 0:
            self.deadline = self.loop.time() + self.limits.idle_timeout
            self.deadline_kind = _IDLE

    def _reject(self, status: int, message: str) -> None:
        """Answer ``status`` and close; after the responses due before it."""
        _warn(str(status), "HTTP request refused with %d: %s", status, message)
        self._broken = True
        self._rejection = None
        self.deadline = 0.0
        self.deadline_kind = _NONE
        data = _error_bytes(status, message)
        if self._busy or self._queue:
            self._pending_error = data
            return
        if not self.transport.is_closing():
            self.transport.write(data)
            self._linger_close()

    def _linger_close(self) -> None:
        """Close after the last answer. While the client may still be sending (a request
        is half read, or bytes are unread), only the sending side is shut and what comes
        is read and dropped for up to :data:`LINGER_SECONDS` (and :data:`LINGER_HEADER_BYTES`
        after a refused line or header block, the request limit after a refused body):
        closing a socket with
        unread bytes makes the kernel send a reset, and the client would lose the
        answer (a 413 for a body it is still sending)."""
        transport = self.transport
        if self._gone or transport.is_closing():
            return
        if not self._message_begun and not _unread_bytes(transport):
            transport.close()
            return
        try:
            transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            transport.close()
            return
        self._broken = True  # what comes is dropped (data_received)
        # a body being refused may still be on its way (up to the request limit); a
        # refused line or header block gets a small allowance
        self._linger_left = (
            LINGER_HEADER_BYTES if self._awaiting_headers else self.app.max_request_bytes
        )
        self.deadline = self.loop.time() + LINGER_SECONDS
        self.deadline_kind = _LINGER
        # (reading stays paused while the client does not read what it was sent)
        self._resume(_PIPE)

    # -- every other route: the HttpApp through a minimal ASGI exchange ----------------

    async def _asgi(self, request: _Request) -> None:
        exchange = _AsgiExchange(self, request)
        try:
            await self.app(exchange.scope(), exchange.receive, exchange.send)
        except Exception as exc:  # noqa: BLE001 - the app answers its own errors
            if not exchange.started:
                self._answer_error(request, exc, request.method.decode("latin-1"), "")
                return
            logger.exception("error serving %s", request.url[:200])
            request.keep_alive = False
        except BaseException:  # cancelled: close
            request.keep_alive = False
            self._finish(request, None)
            raise
        if not exchange.started:
            if self._gone or self.transport.is_closing():
                # the app saw the client leave (a generate_stream whose client closed)
                # and answered nothing: nobody to answer, nothing to log
                self._finish(request, None)
                return
            self._answer_error(
                request,
                RuntimeError("the application sent no response"),
                request.method.decode("latin-1"),
                "",
            )
            return
        if not exchange.complete:
            # ended mid-stream: closing without the last chunk tells the client that the
            # body is incomplete
            request.keep_alive = False
        self._finish(request, None)

    def disconnected_future(self) -> asyncio.Future[None]:
        """Done when the client has gone."""
        if self._disconnected is None:
            self._disconnected = self.loop.create_future()
            if self._gone:
                self._disconnected.set_result(None)
        return self._disconnected

    async def drain(self) -> None:
        """Wait while the write buffer is above its high-water mark."""
        if self._write_paused and not self._gone:
            self._drain_waiter = self.loop.create_future()
            await self._drain_waiter


class _AsgiExchange:
    """One request served through the ASGI interface of the :class:`HttpApp` (every
    route but inference): ``receive`` hands over the body read already, then waits for
    the disconnect; ``send`` writes the response, with ``Content-Length`` when the app
    sends one body (or says it), chunked otherwise (HTTP/1.0: until close)."""

    __slots__ = ("conn", "request", "status", "headers", "started", "complete", "chunked", "_sent")

    def __init__(self, conn: HttpConnection, request: _Request) -> None:
        self.conn = conn
        self.request = request
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] = []
        self.started = False  # a response head was written
        self.complete = False
        self.chunked = False
        self._sent = False  # the body was handed to receive()

    def scope(self) -> dict[str, Any]:
        request = self.request
        raw_path, _, query = request.url.partition(b"?")
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        transport = self.conn.transport
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.0" if request.http10 else "1.1",
            "scheme": "http",
            "method": request.method.decode("latin-1"),
            "path": path,
            "raw_path": raw_path,
            "root_path": "",
            "query_string": query,
            "headers": request.headers,
            "client": transport.get_extra_info("peername"),
            "server": transport.get_extra_info("sockname"),
        }

    async def receive(self) -> dict[str, Any]:
        if not self._sent:
            self._sent = True
            return {"type": "http.request", "body": self.request.body, "more_body": False}
        # shielded: a cancelled receive() (the SSE watcher's) must not cancel the
        # connection's future, which the next request's receive() awaits too
        await asyncio.shield(self.conn.disconnected_future())
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        conn = self.conn
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            return
        if kind != "http.response.body" or self.complete:
            return
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        request = self.request
        if conn._gone or conn.transport.is_closing():
            self.started = True
            self.complete = not more
            return
        if not self.started:
            self.started = True
            if not more:
                self.complete = True
                headers = [(n.lower(), v) for n, v in self.headers]
                encoded = False
                for name, value in headers:
                    if name == b"connection" and value.lower() == b"close":
                        request.keep_alive = False
                        conn._broken = True
                    elif name == b"content-encoding":
                        encoded = True
                gzipped = (
                    request.gzip
                    and not encoded
                    and GZIP_MIN_BYTES <= len(body) <= OFFLOAD_BYTES
                    and not conn._head_only
                )
                if gzipped:
                    body = _gzip(body)
                conn.transport.write(conn._compose(request, self.status, headers, body, gzipped))
                return
            out = [_status_line(self.status)]
            has_length = False
            for name, value in self.headers:
                name = name.lower()
                if name == b"connection":
                    continue
                if name == b"content-length":
                    has_length = True
                out.append(b"%s: %s\r\n" % (name, value))
            if not has_length:
                if request.http10:
                    request.keep_alive = False
                else:
                    self.chunked = True
                    out.append(b"transfer-encoding: chunked\r\n")
            end = conn._end(request)
            out.append(end[2:])  # the connection header (if any) and the blank line
            conn.transport.write(b"".join(out))
        if body and not conn._head_only:
            if self.chunked:
                conn.transport.writelines([b"%x\r\n" % len(body), body, b"\r\n"])
            else:
                conn.transport.write(body)
        if not more:
            self.complete = True
            if self.chunked and not conn._head_only:
                conn.transport.write(b"0\r\n\r\n")
            return
        await conn.drain()
