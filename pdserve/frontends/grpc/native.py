"""The native gRPC transport (``--grpc-server native``): HTTP/2 on the running (uvloop)
event loop, calling the V2 servicer's handlers directly.

grpcio's Python servers cost 130-207 µs of server CPU per call before pdserve does
anything (benchmarks/RESULTS.md, "Issue 11 point 3: gRPC"); this transport is an
``asyncio.Protocol`` that speaks HTTP/2 itself, as the native HTTP/1.1 transport does
for REST, and runs the same handlers the grpcio servers run
(:func:`~pdserve.frontends.grpc.service.method_handlers`: the servicer's methods with
its request deserializers and the auth/rate-limit gate), each with a
:class:`NativeContext` offering the subset of ``grpc.aio.ServicerContext`` they use.

Why not the ``h2`` library: a first version drove ``h2.connection.H2Connection``
(state machine, flow control, HPACK); measured in-process (a unary call, trivial
handler) its receive/send work cost 130-210 µs per call on this machine, as much as
grpcio. The server side of HTTP/2 that gRPC needs is small, so :class:`GrpcConnection`
does it: frames parsed with ``struct``, header blocks decoded by ``hpack`` (the
library ``h2`` uses; a block that did not change the dynamic table is cached, and a
gRPC client repeats the same fully indexed block on every call), every block sent
encoded without the dynamic table so the response headers and OK trailers are
precomputed bytes, and a unary answer (headers, message, trailers) is one write:
11-16 µs of transport per call. ``h2`` stays a dependency for its error codes and as
the client of the tests.

gRPC over HTTP/2, as served here:

- requests: ``POST /inference.GRPCInferenceService/<Method>`` with a ``content-type``
  starting with ``application/grpc`` (else HTTP 415, as the protocol document says);
  unknown service or method: ``UNIMPLEMENTED``. Messages are 5-byte length-prefixed;
  a compressed one is decoded with the request's ``grpc-encoding`` (``gzip``,
  ``deflate``, ``identity``); another encoding: ``UNIMPLEMENTED`` with
  ``grpc-accept-encoding``. Responses are sent uncompressed (allowed by the protocol).
- a message larger than ``max_message_bytes`` received or to be sent:
  ``RESOURCE_EXHAUSTED`` with grpcio's wording.
- ``grpc-timeout``: the call ends with ``DEADLINE_EXCEEDED`` when it passes; the
  handler is cancelled and the request's :class:`~pdserve.core.cancel.CancelToken`
  fires (``add_done_callback``), as on RST_STREAM from the client (a cancel).
- status in trailers (``grpc-status``, percent-encoded ``grpc-message``); an error
  before any message is a Trailers-Only response.
- flow control: the peer's connection and stream windows and its
  SETTINGS_MAX_FRAME_SIZE are respected (large messages go out in window-sized DATA
  frames as WINDOW_UPDATEs arrive); the receive windows are opened wide
  (:data:`RECEIVE_WINDOW`) and received data is acknowledged as it is read.
- SETTINGS are acknowledged, PINGs answered, CONTINUATION frames joined, padding
  and PRIORITY read and ignored; a frame over 16 KiB, a malformed frame or header
  block (HPACK error) is a connection error: GOAWAY with the HTTP/2 error code, then
  close. A client's GOAWAY lets its open streams finish.
- keepalive (:class:`~pdserve.frontends.grpc.engine.GrpcKeepalive`, Triton's
  ``--grpc-keepalive-*`` / ``--grpc-http2-*`` flags, grpc core's meaning): a PING
  after ``time_ms`` with nothing read (on a connection with a call open, or any if
  ``permit_without_calls``), GOAWAY and close when it is not acknowledged within
  ``timeout_ms``; a client PING sooner than ``min_recv_ping_interval_ms`` after its
  previous one, with no HEADERS or DATA sent or received between, is a strike, and strike
  ``max_ping_strikes + 1`` gets GOAWAY ENHANCE_YOUR_CALM ``too_many_pings``.
- rapid reset (CVE-2023-44487): streams the client resets while they are served, and
  streams refused for the concurrent-stream limit, are counted in a token bucket
  (:data:`RESET_BURST`, :data:`RESETS_PER_SEC`); past it: GOAWAY ENHANCE_YOUR_CALM
  ``too_many_resets`` and close.
- bidirectional streams (``ModelStreamInfer``): the handler is given no more
  requests while :data:`STREAM_MAX_UNANSWERED` it was given are unanswered, and its
  responses go out one at a time within the peer's windows, so a client that does not
  read its responses stops the reading of its requests; the stream's receive window
  is not reopened while :data:`STREAM_MAX_QUEUED` requests wait, so what waits is
  bounded by the window too.
- SETTINGS_MAX_CONCURRENT_STREAMS :data:`MAX_CONCURRENT_STREAMS` (a stream past it:
  RST_STREAM REFUSED_STREAM); at most
  ``max_connections`` connections (more are closed at once); a connection with no
  stream for ``idle_timeout`` seconds gets GOAWAY and is closed.
- graceful stop: GOAWAY (last stream id = the highest one seen), streams in flight
  finish for up to the grace period, newer streams are refused (REFUSED_STREAM, which
  grpc clients retry elsewhere); then what is left is cancelled and closed.
- a client that does not speak HTTP/2 (an HTTP/1.1 request, garbage) gets, for an
  HTTP/1.x request line, a ``400`` naming the port's protocol, and the connection is
  closed; an HTTP/2 protocol error closes the connection with GOAWAY.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
import struct
import time
import zlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, cast

import grpc
import hpack
from h2.errors import ErrorCodes

from pdserve.frontends.admission import header_text
from pdserve.frontends.grpc.engine import GrpcKeepalive
from pdserve.frontends.grpc.service import MalformedMessage, direct_unary
from pdserve.frontends.grpc.sync_bridge import BridgedAbort

log = logging.getLogger("pdserve.grpc")

#: Most streams a client may have open on one connection (SETTINGS_MAX_CONCURRENT_STREAMS).
MAX_CONCURRENT_STREAMS = 1024
#: The receive window of the connection and of each stream, in bytes: a request is
#: read without waiting for WINDOW_UPDATEs (memory per call is bounded by the
#: message limit, which is checked from each message's length prefix).
RECEIVE_WINDOW = 16 * 1024 * 1024
#: Largest header block accepted (SETTINGS_MAX_HEADER_LIST_SIZE), bytes (grpc's default).
MAX_HEADER_LIST_SIZE = 16 * 1024
#: A connection with no stream open this long (seconds) gets GOAWAY and is closed.
IDLE_TIMEOUT_SECS = 300.0
#: Rapid reset (CVE-2023-44487): a connection may have this many streams reset by the
#: client while the server was serving them, or refused for going past
#: :data:`MAX_CONCURRENT_STREAMS`, in a burst ...
RESET_BURST = 1000
#: ... and this many more per second; past that it gets GOAWAY ENHANCE_YOUR_CALM and
#: is closed (a token bucket, as Go's and nginx's answers to the attack bound the work a
#: client can cause by opening and cancelling streams).
RESETS_PER_SEC = 200.0
#: ModelStreamInfer (any bidirectional stream) backpressure: the handler is given no
#: more requests while this many it was given are unanswered (responses are yielded
#: one at a time, each once the previous one is out: a client that does not read
#: them, its flow-control window closed, stops the reading of its requests)...
STREAM_MAX_UNANSWERED = 128
#: ... and the stream's receive window is not reopened (no WINDOW_UPDATE) while this
#: many requests wait to be given: the client can send no more than the window.
STREAM_MAX_QUEUED = 64
#: The opaque data of the server's keepalive PINGs.
KEEPALIVE_OPAQUE = b"pdsv-kap"
#: A client may PING a connection with no call open at most this often (seconds)
#: unless ``permit_without_calls`` (grpc core: 2 hours).
IDLE_PING_INTERVAL_SECS = 7200.0
#: The request encodings understood (``grpc-encoding``), for ``grpc-accept-encoding``.
ACCEPT_ENCODING = b"identity,deflate,gzip"
#: The name of every call's task (see :meth:`GrpcConnection._start`).
_CALL_TASK_NAME = "pdserve-grpc-call"

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HTTP1_METHODS = (b"GET ", b"POST", b"PUT ", b"HEAD", b"DELE", b"OPTI", b"PATC", b"CONN")
_PREFIX = struct.Struct(">BI")
_OK = b"0"
_END = object()

_RESPONSE_HEADERS = [
    (b":status", b"200"),
    (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", ACCEPT_ENCODING),
]
_OK_TRAILERS = [(b"grpc-status", _OK)]
#: seconds per ``grpc-timeout`` unit
_TIMEOUT_UNITS = {
    ord("H"): 3600.0,
    ord("M"): 60.0,
    ord("S"): 1.0,
    ord("m"): 1e-3,
    ord("u"): 1e-6,
    ord("n"): 1e-9,
}


#: Our SETTINGS_MAX_FRAME_SIZE (HTTP/2's default): a larger frame is a connection error.
MAX_FRAME_SIZE = 16384
#: frame header: length << 8 | type, flags, stream id
_FRAME_HEADER = struct.Struct(">IBI")
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")
_GOAWAY = struct.Struct(">II")


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    """One HTTP/2 frame."""
    return _FRAME_HEADER.pack(len(payload) << 8 | kind, flags, sid) + payload


def _data_frame_header(length: int, flags: int, sid: int) -> bytes:
    """The 9-byte header of a DATA frame of ``length`` bytes."""
    return _FRAME_HEADER.pack(length << 8, flags, sid)


def _encode(headers: list[Any]) -> bytes:
    """A header block encoded without the dynamic table (never-indexed literals or
    static-table indexes), so blocks can be precomputed and sent in any order."""
    return hpack.Encoder().encode([(k, v, True) for k, v in headers])


_SERVER_PREFACE = _frame(
    4,
    0,
    0,
    _SETTING.pack(3, MAX_CONCURRENT_STREAMS)
    + _SETTING.pack(4, RECEIVE_WINDOW)
    + _SETTING.pack(6, MAX_HEADER_LIST_SIZE),
) + _frame(8, 0, 0, _U32.pack(RECEIVE_WINDOW - 65535))
_SETTINGS_ACK = _frame(4, 0x1, 0, b"")
_RESPONSE_HEADERS_BLOCK = _encode(_RESPONSE_HEADERS)
_OK_TRAILERS_BLOCK = _encode(_OK_TRAILERS)


class _ConnectionError(Exception):
    """An HTTP/2 connection error: GOAWAY with ``code`` (and ``debug`` as its debug
    data), then close."""

    def __init__(self, code: int, message: str, debug: bytes = b"") -> None:
        super().__init__(message)
        self.code = code
        self.debug = debug


class _Head:
    """What the transport reads from a request's header block."""

    __slots__ = ("content_type", "encoding", "metadata", "method", "path", "route", "timeout")

    def __init__(self, headers: Any) -> None:
        #: (handler, direct unary method) of the path, once looked up (a head is cached
        #: with its header block, so a repeated block skips the lookup)
        self.route: tuple[Any, Any] | None = None
        self.path = self.method = self.content_type = b""
        self.encoding = b"identity"
        self.timeout: bytes | None = None
        metadata: list[tuple[str, Any]] = []
        for name, value in headers:
            if name[:1] == b":":
                if name == b":path":
                    self.path = value
                elif name == b":method":
                    self.method = value
            elif name == b"content-type":
                self.content_type = value
            elif name == b"grpc-timeout":
                self.timeout = value
            elif name == b"grpc-encoding":
                self.encoding = value
            elif name == b"te" or name == b"grpc-accept-encoding":
                pass
            elif name.endswith(b"-bin"):
                metadata.append((name.decode("latin-1"), value))
            else:  # read as grpcio reads metadata, so both servers see the same text
                metadata.append((name.decode("latin-1"), header_text(value)))
        self.metadata = tuple(metadata)


def _http1_refusal() -> bytes:
    body = b"this port serves gRPC: HTTP/2 with prior knowledge\n"
    return (
        b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\nconnection: close\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def percent_encode(message: str) -> bytes:
    """``grpc-message``'s encoding: UTF-8, then every byte outside 0x20-0x7E and ``%``
    as ``%XX`` (grpc's PROTOCOL-HTTP2.md)."""
    raw = message.encode("utf-8", "replace")
    if all(0x20 <= c <= 0x7E and c != 0x25 for c in raw):
        return raw
    return "".join(chr(c) if 0x20 <= c <= 0x7E and c != 0x25 else f"%{c:02X}" for c in raw).encode(
        "ascii"
    )


def parse_timeout(value: bytes) -> float | None:
    """Seconds of a ``grpc-timeout`` value (1-8 ASCII digits and a unit of ``HMSmun``);
    None when it is not one."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
        return None
    unit = _TIMEOUT_UNITS.get(value[-1])
    return None if unit is None else int(value[:-1]) * unit


def status_trailers(code: grpc.StatusCode, details: str, extra: Any = ()) -> list[Any]:
    """Trailers (or the tail of a Trailers-Only response) for a status."""
    out: list[Any] = [(b"grpc-status", str(code.value[0]).encode())]
    if details:
        out.append((b"grpc-message", percent_encode(details)))
    for key, value in extra or ():
        k = key.encode("latin-1") if isinstance(key, str) else key
        v = value if isinstance(value, bytes) else str(value).encode("latin-1")
        out.append((k, v))
    return out


class NativeContext:
    """The ``grpc.aio.ServicerContext`` subset the servicer uses, for one call.

    Args:
        call: the call (its cancellation state and status live there).
        metadata: the request's custom metadata, ``(key, value)`` pairs (``str``
            values; ``-bin`` keys keep their raw header bytes).
        peer: ``ipv4:host:port``-style peer name.
        deadline: ``time.monotonic()`` when the call's ``grpc-timeout`` passes; None: none.
        loop: the connection's event loop (:attr:`native_loop`).

    Attributes:
        native_loop: the event loop the call runs on. Its presence tells
            :func:`~pdserve.frontends.grpc.service.grpc_cancel_token` that every early
            end of the call (RST_STREAM, deadline, connection lost) runs the done
            callbacks (:meth:`GrpcConnection._cancel`), so the request's token needs no
            probe polled (the dynamic batcher polls a token up to 3 times a request).
    """

    __slots__ = (
        "_call",
        "_callbacks",
        "_metadata",
        "_peer",
        "code",
        "deadline",
        "details",
        "native_loop",
        "trailers",
    )

    def __init__(
        self,
        call: _Call,
        metadata: tuple[tuple[str, Any], ...],
        peer: str,
        deadline: float | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.native_loop = loop
        self._call = call
        self._metadata = metadata
        self._peer = peer
        self._callbacks: list[Callable[[Any], None]] | None = None
        self.deadline = deadline
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailers: Any = ()

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        """The call's metadata ``(key, value)`` pairs."""
        return self._metadata

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        """End the call with ``code`` / ``details`` (raises
        :class:`~pdserve.frontends.grpc.sync_bridge.BridgedAbort`, a ``grpc.aio.AbortError``)."""
        if trailing_metadata:
            self.trailers = trailing_metadata
        raise BridgedAbort(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        """The status to end the call with when the handler returns."""
        self.code = code

    def set_details(self, details: str) -> None:
        """The status message to end the call with."""
        self.details = details

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        """Trailing metadata sent with the status."""
        self.trailers = trailing_metadata

    def cancelled(self) -> bool:
        """Whether the call ended before its answer (RST_STREAM, deadline, connection lost)."""
        return self._call.cancelled

    def done(self) -> bool:
        """Whether the call has ended."""
        return self._call.finished or self._call.cancelled

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(self)`` when the call is cancelled before its answer (as the
        ``threads`` server's bridge: the callback exists to stop work in progress)."""
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)

    def run_callbacks(self) -> None:
        """Run the done callbacks (once; on cancellation)."""
        callbacks, self._callbacks = self._callbacks, None
        for cb in callbacks or ():
            try:
                cb(self)
            except Exception:  # noqa: BLE001 - a callback must not break the connection
                log.exception("gRPC done callback failed")

    def peer(self) -> str:
        """The client's address, grpc style (``ipv4:127.0.0.1:5000``)."""
        return self._peer

    def time_remaining(self) -> float | None:
        """Seconds until the deadline; None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class _Call:
    """One stream (RPC) on a connection."""

    __slots__ = (
        "buf",
        "cancelled",
        "ctx",
        "delivered",
        "direct",
        "held",
        "decompress",
        "finished",
        "handler",
        "out",
        "queue",
        "received",
        "remote_ended",
        "request",
        "resume",
        "sid",
        "task",
        "send_window",
        "timer",
        "trailers",
        "trailers_block",
        "writable",
        "yielded",
    )

    def __init__(self, sid: int, handler: Any, direct: Any = None) -> None:
        self.sid = sid
        self.handler = handler
        self.direct = direct  # the unary servicer method without its wrapper (direct_unary)
        self.buf = bytearray()
        self.ctx: NativeContext | None = None
        self.decompress: Callable[[bytes], bytes] | None = None
        self.request: Any = _END
        self.queue: asyncio.Queue[Any] | None = None
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.out: collections.deque[bytes] = collections.deque()
        self.trailers: list[Any] | None = None  # not None: the trailers wait to go out
        self.trailers_block = b""
        self.send_window = 65535
        self.received = 0
        self.writable: asyncio.Event | None = None
        # streams: requests given to the handler, responses it yielded, its request
        # reader waiting for them to go out, the receive window withheld
        self.delivered = 0
        self.yielded = 0
        self.resume: asyncio.Event | None = None
        self.held = False
        self.cancelled = False
        self.finished = False  # our side has ended (trailers queued or sent)
        self.remote_ended = False


class _Decompressor:
    """``gzip`` / ``deflate`` message decoding bounded by the message limit."""

    __slots__ = ("limit", "wbits")

    def __init__(self, wbits: int, limit: int) -> None:
        self.wbits, self.limit = wbits, limit

    def __call__(self, data: bytes) -> bytes:
        d = zlib.decompressobj(self.wbits)
        out = d.decompress(data, self.limit + 1)
        if len(out) > self.limit:
            raise OverflowError(len(out))
        return out


class _Refused(Exception):
    """A call ended before its handler runs: its status."""

    def __init__(self, code: grpc.StatusCode, details: str, extra: Any = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.extra = code, details, extra


class GrpcConnection(asyncio.Protocol):
    """One HTTP/2 connection serving gRPC calls (see the module docstring).

    The HTTP/2 framing is done here (RFC 9113, server side, what gRPC uses): frames
    are parsed from the receive buffer with ``struct``, header blocks decoded by
    ``hpack``'s decoder (decoded blocks cached while the dynamic table is unchanged:
    a gRPC client repeats the same fully indexed block on every call), and every
    header block sent is encoded without the dynamic table (never-indexed literals),
    so the constant response headers and the OK trailers are precomputed bytes.
    """

    def __init__(self, server: NativeGrpcServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.calls: dict[int, _Call] = {}
        self.peer = ""
        self.buf = bytearray()
        self.out: list[bytes] = []
        self.preface = False
        self.flush_pending = False
        self.draining = False
        self.closed = False
        self.idle_since = time.monotonic()
        self.write_ready: asyncio.Event | None = None
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = MAX_HEADER_LIST_SIZE
        self.hcache: dict[bytes, _Head] = {}
        self.hstate: tuple[int, Any] = (0, None)
        self.last_sid = 0
        self.send_window = 65535  # the connection's, for what we send
        # some call's data waits for flow-control window (set by _pump): a connection
        # WINDOW_UPDATE scans the calls only then (a client sends one per response read)
        self.stalled = False
        self.stream_window = 65535  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.max_frame = 16384  # the peer's SETTINGS_MAX_FRAME_SIZE
        self.received = 0  # bytes received since the last connection WINDOW_UPDATE
        self.continuation: tuple[int, int, bytearray] | None = None  # sid, flags, block
        # keepalive (see NativeGrpcServer.keepalive): reads so far, and at the last sweep;
        # when something was last read (as the sweeps see it); our PING in flight (when
        # sent; 0: none), PINGs sent with nothing else sent since, writes at that PING
        self.reads = 0
        self.reads_seen = 0
        self.active_at = self.idle_since
        self.ping_sent_at = 0.0
        self.pings_without_data = 0
        self.writes = 0
        self.writes_at_ping = -1
        # ping policing: the client's last PING (0: none since data or headers), strikes
        self.last_ping_recv = 0.0
        self.ping_strikes = 0
        # rapid reset: tokens left, when last counted
        self.reset_tokens = float(RESET_BURST)
        self.reset_at = 0.0

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # noqa: D102
        self.transport = transport  # type: ignore[assignment]  # a TCP transport
        server = self.server
        if len(server.connections) >= server.max_connections:
            self.transport.abort()  # type: ignore[union-attr]
            self.closed = True
            return
        server.connections.add(self)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"{'ipv6' if ':' in str(peer[0]) else 'ipv4'}:{peer[0]}:{peer[1]}"
        # the server preface goes out with the answer to the client's first bytes, so
        # that an HTTP/1.x client can be answered in HTTP/1.1 instead

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self.closed = True
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            self._cancel(call)
        self.calls.clear()
        if self.write_ready is not None:
            self.write_ready.set()
        self.server.check_drained()

    def pause_writing(self) -> None:  # noqa: D102
        self.write_ready = asyncio.Event()

    def resume_writing(self) -> None:  # noqa: D102
        if self.write_ready is not None:
            self.write_ready.set()
            self.write_ready = None

    def data_received(self, data: bytes) -> None:  # noqa: D102
        if self.closed:
            return
        self.reads += 1
        buf = self.buf
        if self.preface and not buf:
            # the common case: frames parsed from ``data`` itself (a payload is one copy
            # of it, not a copy into the buffer and two out); what is left is buffered
            try:
                self._frames(data)
            except _ConnectionError as e:
                self._connection_error(e)
                return
            self._flush()
            return
        buf += data
        if not self.preface:
            if len(buf) < len(_PREFACE):
                if _PREFACE.startswith(bytes(buf)):
                    return
            elif buf.startswith(_PREFACE):
                del buf[: len(_PREFACE)]
                self.preface = True
                self.out.append(_SERVER_PREFACE)
            if not self.preface:
                if bytes(buf[:4]) in _HTTP1_METHODS:
                    assert self.transport is not None
                    self.transport.write(_http1_refusal())
                self._close()
                return
        try:
            self._frames(buf)
        except _ConnectionError as e:
            self._connection_error(e)
            return
        self._flush()

    def _connection_error(self, e: _ConnectionError) -> None:
        log.debug("gRPC connection %s: HTTP/2 error: %s", self.peer, e)
        self._goaway(e.code, e.debug)
        self._flush()
        self._close()

    # -- frames --------------------------------------------------------------------------

    def _frames(self, buf: bytes | bytearray) -> None:
        """Handle the complete frames of ``buf`` (:attr:`buf` itself, or bytes just
        received with nothing buffered); an incomplete frame is kept in :attr:`buf`."""
        copy = isinstance(buf, bytearray)
        pos = 0
        end = len(buf)
        unpack = _FRAME_HEADER.unpack_from
        try:
            while end - pos >= 9:
                head, kind_flags, sid = unpack(buf, pos)
                length = head >> 8
                kind = head & 0xFF
                sid &= 0x7FFFFFFF
                if length > MAX_FRAME_SIZE:
                    raise _ConnectionError(ErrorCodes.FRAME_SIZE_ERROR, f"frame of {length} bytes")
                if end - pos < 9 + length:
                    break
                chunk = buf[pos + 9 : pos + 9 + length]
                payload = bytes(chunk) if copy else cast(bytes, chunk)
                pos += 9 + length
                if self.continuation is not None and kind != 9:
                    raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "expected CONTINUATION")
                if kind == 0:
                    self._on_data(sid, kind_flags, payload, length)
                elif kind == 1:
                    self._on_headers(sid, kind_flags, payload)
                elif kind == 9:
                    self._on_continuation(sid, kind_flags, payload)
                elif kind == 8:
                    # inline: a grpc C++ client sends two per call (its stream's window
                    # after the HEADERS, the connection's per answer read)
                    if length != 4:
                        raise _ConnectionError(ErrorCodes.FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
                    inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
                    if sid:
                        call = self.calls.get(sid)
                        if call is None:
                            continue  # a closed stream's (or an idle one's): nothing to do
                        call.send_window += inc
                        if not inc or call.send_window > 0x7FFFFFFF:
                            self._reset(
                                call,
                                ErrorCodes.FLOW_CONTROL_ERROR if inc else ErrorCodes.PROTOCOL_ERROR,
                            )
                        elif call.out or call.trailers is not None:
                            self._pump(call)
                    else:
                        if not inc:
                            raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
                        self.send_window += inc
                        if self.send_window > 0x7FFFFFFF:
                            raise _ConnectionError(ErrorCodes.FLOW_CONTROL_ERROR, "window overflow")
                        if self.stalled:
                            self._window(0)
                elif kind == 4:
                    self._on_settings(sid, kind_flags, payload)
                elif kind == 6:
                    if sid or length != 8:
                        raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad PING")
                    if not kind_flags & 0x1:
                        self._on_ping()
                        self.out.append(_frame(6, 0x1, 0, payload))
                    elif payload == KEEPALIVE_OPAQUE:
                        self.ping_sent_at = 0.0
                elif kind == 3:
                    if not sid or length != 4:
                        raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad RST_STREAM")
                    call = self.calls.pop(sid, None)
                    if call is not None:
                        self._cancel(call)
                        self._maybe_idle()
                        if not call.finished:
                            self._count_reset()
                elif kind == 7:
                    pass  # the client sends no new streams; the ones open go on
                elif kind == 5:
                    raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
                elif kind == 2 and (not sid or length != 5):
                    raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad PRIORITY")
                # other types (PRIORITY, extensions) are ignored
        finally:
            if buf is self.buf:
                del buf[:pos]
            elif pos < end:
                self.buf += buf[pos:]
        if len(self.buf) > MAX_FRAME_SIZE + 9:  # pragma: no cover - cannot: checked above
            raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "receive buffer overflow")

    def _on_ping(self) -> None:
        """A client's PING (not an ACK): one sooner than the allowed interval after the
        previous one, with no data or headers sent or received between them, is a strike; past
        ``max_ping_strikes`` strikes: GOAWAY ENHANCE_YOUR_CALM ``too_many_pings``
        (grpc core's ping abuse policy, which Triton's flags set)."""
        ka = self.server.keepalive
        now = self.loop.time()
        last = self.last_ping_recv
        self.last_ping_recv = now
        if not last:
            return
        if not self.calls and not ka.permit_without_calls:
            interval = IDLE_PING_INTERVAL_SECS
        else:
            interval = ka.min_recv_ping_interval_ms / 1000.0
        if now - last >= interval:
            return
        self.ping_strikes += 1
        if ka.max_ping_strikes and self.ping_strikes > ka.max_ping_strikes:
            raise _ConnectionError(
                ErrorCodes.ENHANCE_YOUR_CALM,
                f"too many pings: {self.ping_strikes} sooner than {interval:g} s apart",
                b"too_many_pings",
            )

    def _count_reset(self) -> None:
        """A stream the client reset while it was served, or one refused for passing
        the concurrent-stream limit: past :data:`RESET_BURST` plus
        :data:`RESETS_PER_SEC` a second, GOAWAY ENHANCE_YOUR_CALM (rapid reset)."""
        now = self.loop.time()
        tokens = min(float(RESET_BURST), self.reset_tokens + (now - self.reset_at) * RESETS_PER_SEC)
        self.reset_at = now
        if tokens < 1.0:
            raise _ConnectionError(
                ErrorCodes.ENHANCE_YOUR_CALM,
                "too many streams reset or refused (rapid reset)",
                b"too_many_resets",
            )
        self.reset_tokens = tokens - 1.0

    def keepalive(self, now: float) -> None:
        """The sweep's keepalive check (``now``: ``time.monotonic()``): after
        ``time_ms`` with nothing read, PING (on a connection with a call open, or any if
        ``permit_without_calls``; at most ``max_pings_without_data`` PINGs while
        nothing else is sent); a PING unanswered for ``timeout_ms``: GOAWAY and close."""
        if self.closed or not self.preface:
            return
        ka = self.server.keepalive
        if self.reads != self.reads_seen:
            self.reads_seen = self.reads
            self.active_at = now
        if self.ping_sent_at:
            if now - self.ping_sent_at >= ka.timeout_ms / 1000.0:
                log.debug("gRPC connection %s: keepalive PING not acknowledged", self.peer)
                self._goaway(ErrorCodes.NO_ERROR, b"keepalive watchdog timeout")
                self._flush()
                self._close()  # (its calls are cancelled when the connection is lost)
            return
        if now - self.active_at < ka.time_ms / 1000.0:
            return
        if not self.calls and not ka.permit_without_calls:
            return
        if self.writes != self.writes_at_ping:
            self.pings_without_data = 0
        if ka.max_pings_without_data and self.pings_without_data >= ka.max_pings_without_data:
            return
        self.pings_without_data += 1
        self.ping_sent_at = now
        self.out.append(_frame(6, 0, 0, KEEPALIVE_OPAQUE))
        self._flush()
        self.writes_at_ping = self.writes

    def _strip_padding(self, flags: int, payload: bytes) -> bytes:
        if flags & 0x8:
            if not payload or payload[0] >= len(payload):
                raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad padding")
            return payload[1 : len(payload) - payload[0]]
        return payload

    def _on_settings(self, sid: int, flags: int, payload: bytes) -> None:
        if sid or len(payload) % 6:
            raise _ConnectionError(ErrorCodes.FRAME_SIZE_ERROR, "bad SETTINGS")
        if flags & 0x1:
            return
        for i in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == 4:  # INITIAL_WINDOW_SIZE
                if value > 0x7FFFFFFF:
                    raise _ConnectionError(ErrorCodes.FLOW_CONTROL_ERROR, "window too large")
                delta = value - self.stream_window
                self.stream_window = value
                for call in self.calls.values():
                    call.send_window += delta
            elif key == 5:  # MAX_FRAME_SIZE
                if not 16384 <= value <= 16777215:
                    raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
                self.max_frame = value
            elif key == 2 and value > 1:  # ENABLE_PUSH
                raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad ENABLE_PUSH")
        self.out.append(_SETTINGS_ACK)
        self._window(0)

    def _on_headers(self, sid: int, flags: int, payload: bytes) -> None:
        if not sid:
            raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "HEADERS on stream 0")
        if self.last_ping_recv:  # headers received: the ping clock starts anew
            self.last_ping_recv = 0.0
            self.ping_strikes = 0
        block = self._strip_padding(flags, payload)
        if flags & 0x20:  # PRIORITY
            block = block[5:]
        if not flags & 0x4:  # no END_HEADERS: CONTINUATION frames follow
            self.continuation = (sid, flags, bytearray(block))
            return
        self._header_block(sid, flags, block)

    def _on_continuation(self, sid: int, flags: int, payload: bytes) -> None:
        pending = self.continuation
        if pending is None or pending[0] != sid:
            raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "unexpected CONTINUATION")
        pending[2].extend(payload)
        if len(pending[2]) > MAX_HEADER_LIST_SIZE * 2:
            raise _ConnectionError(ErrorCodes.ENHANCE_YOUR_CALM, "header block too large")
        if flags & 0x4:
            self.continuation = None
            self._header_block(sid, pending[1], bytes(pending[2]))

    def _decode(self, block: bytes) -> _Head:
        """The request head of a header block (cached while the HPACK table stays)."""
        table = self.decoder.header_table.dynamic_entries
        state = (len(table), table[0] if table else None)
        if state[0] != self.hstate[0] or state[1] is not self.hstate[1]:
            self.hcache.clear()
            self.hstate = state
        head = self.hcache.get(block)
        if head is not None:
            return head
        try:
            headers = self.decoder.decode(block, raw=True)
        except hpack.HPACKError as e:
            raise _ConnectionError(ErrorCodes.COMPRESSION_ERROR, str(e)) from None
        head = _Head(headers)
        after = (len(table), table[0] if table else None)
        if after[0] == state[0] and after[1] is state[1]:
            if len(self.hcache) < 256:
                self.hcache[block] = head
        else:
            self.hcache.clear()
            self.hstate = after
        return head

    def _header_block(self, sid: int, flags: int, block: bytes) -> None:
        head = self._decode(block)  # always decoded: it may change the HPACK table
        end_stream = bool(flags & 0x1)
        call = self.calls.get(sid)
        if call is not None:  # trailers from the client
            if not end_stream:
                self._reset(call, ErrorCodes.PROTOCOL_ERROR)
            else:
                self._remote_end(call)
            return
        if sid <= self.last_sid or not sid & 1:
            if sid & 1:
                return  # a closed stream's trailers: nothing to do
            raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, f"bad stream id {sid}")
        self.last_sid = sid
        if self.draining or len(self.calls) >= MAX_CONCURRENT_STREAMS:
            self.out.append(_frame(3, 0, sid, _U32.pack(ErrorCodes.REFUSED_STREAM)))
            if not self.draining:
                self._count_reset()
            return
        self._request(sid, head, end_stream)

    def _on_data(self, sid: int, flags: int, payload: bytes, length: int) -> None:
        if not sid:
            raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "DATA on stream 0")
        if self.last_ping_recv:  # data received: the ping clock starts anew
            self.last_ping_recv = 0.0
            self.ping_strikes = 0
        self.received += length
        if self.received >= RECEIVE_WINDOW // 2:
            self.out.append(_frame(8, 0, 0, _U32.pack(self.received)))
            self.received = 0
        call = self.calls.get(sid)
        if call is None:
            if sid > self.last_sid:
                raise _ConnectionError(ErrorCodes.PROTOCOL_ERROR, "DATA on an idle stream")
            return
        if call.remote_ended:
            self._reset(call, ErrorCodes.STREAM_CLOSED)
            return
        call.received += length
        if call.received >= RECEIVE_WINDOW // 2:
            if call.queue is not None and call.queue.qsize() >= STREAM_MAX_QUEUED:
                call.held = True  # reopened as the handler takes requests (_requests)
            else:
                self.out.append(_frame(8, 0, sid, _U32.pack(call.received)))
                call.received = 0
        data = self._strip_padding(flags, payload)
        if not call.finished:
            self._messages(call, data)
        if flags & 0x1:
            self._remote_end(call)

    # -- requests ------------------------------------------------------------------------

    def _request(self, sid: int, head: _Head, end_stream: bool) -> None:
        if head.method != b"POST" or not head.content_type.startswith(b"application/grpc"):
            status = b"405" if head.method != b"POST" else b"415"
            block = _encode([(b":status", status)])
            self.out.append(_frame(1, 0x5, sid, block))
            if not end_stream:
                self.out.append(_frame(3, 0, sid, _U32.pack(ErrorCodes.NO_ERROR)))
            return
        route = head.route
        if route is None:
            service, _, name = head.path.rpartition(b"/")
            handler = direct = None
            if service == self.server.service_path:
                key = name.decode("latin-1")
                handler = self.server.handlers.get(key)
                direct = self.server.direct.get(key)
            route = head.route = (handler, direct)
        handler, direct = route
        call = _Call(sid, handler, direct)
        call.send_window = self.stream_window
        self.calls[sid] = call
        try:
            if handler is None:
                raise _Refused(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"Method not found: {head.path.decode('latin-1', 'replace')}",
                )
            encoding = head.encoding
            if encoding != b"identity":
                limit = self.server.max_message_bytes
                if encoding == b"gzip":
                    call.decompress = _Decompressor(16 + zlib.MAX_WBITS, limit)
                elif encoding == b"deflate":
                    call.decompress = _Decompressor(zlib.MAX_WBITS, limit)
                else:
                    raise _Refused(
                        grpc.StatusCode.UNIMPLEMENTED,
                        f"Compression algorithm '{encoding.decode('latin-1', 'replace')}' "
                        "is not supported",
                        ((b"grpc-accept-encoding", ACCEPT_ENCODING),),
                    )
            deadline = None
            if head.timeout is not None:
                seconds = parse_timeout(head.timeout)
                if seconds is None:
                    raise _Refused(grpc.StatusCode.INTERNAL, "malformed grpc-timeout")
                deadline = time.monotonic() + seconds
                call.timer = self.loop.call_later(seconds, self._expire, call)
            call.ctx = NativeContext(call, head.metadata, self.peer, deadline, self.loop)
        except _Refused as e:
            self._finish(call, e.code, e.details, e.extra)
            return
        if handler.stream_stream is not None:
            call.queue = asyncio.Queue()
            call.task = self._start(self._run_stream(call))
        if end_stream:
            self._remote_end(call)

    def _messages(self, call: _Call, data: bytes) -> None:
        """Read the complete length-prefixed messages of the call's data."""
        buf = call.buf
        if buf:
            buf += data
        elif len(data) >= 5:  # the common case: one whole message in one frame
            flag, length = _PREFIX.unpack_from(data)
            if flag == 0 and len(data) == 5 + length and length <= self.server.max_message_bytes:
                self._message(call, data[5:])
                return
            buf += data
        else:
            buf += data
        limit = self.server.max_message_bytes
        while len(buf) >= 5:
            flag, length = _PREFIX.unpack_from(buf)
            if length > limit:
                self._finish(
                    call,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({length} vs. {limit})",
                )
                return
            if len(buf) < 5 + length:
                return
            payload = bytes(buf[5 : 5 + length])
            del buf[: 5 + length]
            if flag:
                if flag != 1 or call.decompress is None:
                    self._finish(
                        call,
                        grpc.StatusCode.INTERNAL,
                        "compressed message without a grpc-encoding"
                        if flag == 1
                        else f"bad message flag {flag}",
                    )
                    return
                try:
                    payload = call.decompress(payload)
                except OverflowError:
                    self._finish(
                        call,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Received message larger than max (more than {limit} bytes decompressed)",
                    )
                    return
                except zlib.error as e:
                    self._finish(
                        call, grpc.StatusCode.INTERNAL, f"could not decompress the message: {e}"
                    )
                    return
            if not self._message(call, payload):
                return

    def _message(self, call: _Call, payload: bytes) -> bool:
        request = call.handler.request_deserializer(payload)
        if call.queue is not None:
            call.queue.put_nowait(request)
        elif call.request is _END:
            call.request = request
        else:
            self._finish(
                call,
                grpc.StatusCode.UNIMPLEMENTED,
                "more than one request message on a unary call",
            )
            return False
        return True

    def _remote_end(self, call: _Call) -> None:
        call.remote_ended = True
        if call.finished:
            if call.sid in self.calls and call.trailers is None and not call.out:
                self._forget(call)
            return
        if call.buf:
            self._finish(call, grpc.StatusCode.INTERNAL, "the request ended inside a message")
            return
        if call.queue is not None:
            call.queue.put_nowait(_END)
            return
        if call.request is _END:
            self._finish(call, grpc.StatusCode.UNIMPLEMENTED, "no request message on a unary call")
            return
        call.task = self._start(self._run_unary(call))

    def _start(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a call's coroutine in its own task: ``asyncio.Task`` with a fixed name
        rather than ``loop.create_task`` (no "Task-N" formatting, no uvloop wrapper;
        pdserve's loops set no task factory), as the native HTTP transport does."""
        return asyncio.Task(coro, loop=self.loop, name=_CALL_TASK_NAME)

    def _window(self, sid: int) -> None:
        if sid:
            call = self.calls.get(sid)
            if call is not None and (call.out or call.trailers is not None):
                self._pump(call)
            return
        if not self.stalled:  # no call waits for window: nothing to scan
            return
        self.stalled = False
        for call in list(self.calls.values()):
            if self.send_window <= 0:
                self.stalled = True
                return
            if call.out or call.trailers is not None:
                self._pump(call)  # (marks the connection stalled again if still blocked)

    # -- calls ---------------------------------------------------------------------------

    async def _run_unary(self, call: _Call) -> None:
        ctx = call.ctx
        assert ctx is not None
        try:
            handler = call.handler
            request = call.request
            direct = call.direct
            try:
                if direct is not None and not isinstance(request, MalformedMessage):
                    response = await direct(request, ctx)  # the servicer's method itself
                else:
                    response = await handler.unary_unary(request, ctx)
            except BridgedAbort as e:
                self._finish(call, e.code, e.details, ctx.trailers)
                return
            except asyncio.CancelledError:
                return
            except Exception as e:  # noqa: BLE001 - one call must not take the connection down
                log.exception("gRPC call failed")
                self._finish(
                    call,
                    grpc.StatusCode.UNKNOWN,
                    f"Unexpected error in handler: {type(e).__name__}: {e}",
                )
                return
            if call.finished or call.cancelled:
                return
            if ctx.code is not None and ctx.code is not grpc.StatusCode.OK:
                self._finish(call, ctx.code, ctx.details, ctx.trailers)
                return
            data = handler.response_serializer(response)
            n = len(data)
            if n > self.server.max_message_bytes:
                self._finish(
                    call,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Sent message larger than max ({n} vs. {self.server.max_message_bytes})",
                )
                return
            call.finished = True
            trailers = (
                _encode(status_trailers(grpc.StatusCode.OK, ctx.details, ctx.trailers))
                if ctx.trailers or ctx.details
                else _OK_TRAILERS_BLOCK
            )
            if n + 5 <= min(call.send_window, self.send_window, self.max_frame):
                # the common case: headers, the message and trailers in one write
                call.send_window -= n + 5
                self.send_window -= n + 5
                self.out.append(
                    _frame(1, 0x4, call.sid, _RESPONSE_HEADERS_BLOCK)
                    + _data_frame_header(n + 5, 0, call.sid)
                    + _PREFIX.pack(0, n)
                    + data
                    + _frame(1, 0x5, call.sid, trailers)
                )
                self._done_sending(call)
            else:
                self.out.append(_frame(1, 0x4, call.sid, _RESPONSE_HEADERS_BLOCK))
                call.out.append(_PREFIX.pack(0, n) + data)
                call.trailers_block = trailers
                call.trailers = []
                self._pump(call)
            self._flush_soon()
        finally:
            call.ctx = None  # ctx refers to the call: no cycle left for the collector

    async def _requests(self, call: _Call) -> AsyncIterator[Any]:
        """The stream's requests for its handler; none more while
        :data:`STREAM_MAX_UNANSWERED` given ones are unanswered (backpressure)."""
        queue = call.queue
        assert queue is not None
        while True:
            while (
                call.delivered - call.yielded >= STREAM_MAX_UNANSWERED
                and not call.cancelled
                and not self.closed
            ):
                call.resume = asyncio.Event()
                await call.resume.wait()
            request = await queue.get()
            if request is _END:
                return
            call.delivered += 1
            if call.held and queue.qsize() < STREAM_MAX_QUEUED and not call.cancelled:
                call.held = False
                self.out.append(_frame(8, 0, call.sid, _U32.pack(call.received)))
                call.received = 0
                self._flush_soon()
            yield request

    async def _run_stream(self, call: _Call) -> None:
        ctx = call.ctx
        assert ctx is not None
        try:
            handler = call.handler
            limit = self.server.max_message_bytes
            headers_sent = False
            code, details, extra = grpc.StatusCode.OK, "", ()
            try:
                async for response in handler.stream_stream(self._requests(call), ctx):
                    if call.finished or call.cancelled:
                        return
                    data = handler.response_serializer(response)
                    if len(data) > limit:
                        code = grpc.StatusCode.RESOURCE_EXHAUSTED
                        details = f"Sent message larger than max ({len(data)} vs. {limit})"
                        break
                    if not headers_sent:
                        self.out.append(_frame(1, 0x4, call.sid, _RESPONSE_HEADERS_BLOCK))
                        headers_sent = True
                    call.out.append(_PREFIX.pack(0, len(data)) + data)
                    call.yielded += 1
                    if call.resume is not None:  # one fewer unanswered: read on
                        call.resume.set()
                        call.resume = None
                    self._pump(call)
                    self._flush_soon()
                    await self._writable(call)
                else:
                    if ctx.code is not None:
                        code, details = ctx.code, ctx.details
                    extra = ctx.trailers
            except BridgedAbort as e:
                code, details, extra = e.code, e.details, ctx.trailers
            except asyncio.CancelledError:
                return
            except Exception as e:  # noqa: BLE001
                log.exception("gRPC stream failed")
                code = grpc.StatusCode.UNKNOWN
                details = f"Unexpected error in handler: {type(e).__name__}: {e}"
            if call.finished or call.cancelled:
                return
            if headers_sent:
                call.finished = True
                call.trailers_block = _encode(status_trailers(code, details, extra))
                call.trailers = []
                self._pump(call)
                self._flush_soon()
            else:
                self._finish(call, code, details, extra)
        finally:
            call.ctx = None  # ctx refers to the call: no cycle left for the collector

    async def _writable(self, call: _Call) -> None:
        """Wait while the call's data waits for flow-control window or the transport's
        buffer is full."""
        while call.out and not call.cancelled and not self.closed:
            call.writable = asyncio.Event()
            await call.writable.wait()
        while self.write_ready is not None and not self.closed:
            await self.write_ready.wait()

    def _pump(self, call: _Call) -> None:
        """Send what flow control allows of the call's queued data, then its trailers."""
        if call.cancelled:
            call.out.clear()
            return
        out = call.out
        sid = call.sid
        while out:
            size = min(call.send_window, self.send_window, self.max_frame)
            if size <= 0:
                self.stalled = True  # a WINDOW_UPDATE of the connection pumps it again
                return
            data = out[0]
            if len(data) <= size:
                out.popleft()
            else:
                out[0] = data[size:]
                data = data[:size]
            n = len(data)
            call.send_window -= n
            self.send_window -= n
            self.out.append(_data_frame_header(n, 0, sid) + data)
        if call.writable is not None:
            call.writable.set()
            call.writable = None
        if call.trailers is not None:
            call.trailers = None
            self.out.append(_frame(1, 0x5, sid, call.trailers_block))
            self._done_sending(call)
        self._flush_soon()

    def _done_sending(self, call: _Call) -> None:
        """The call's trailers are out: close the stream."""
        if not call.remote_ended:  # the client is still sending: stop it
            self.out.append(_frame(3, 0, call.sid, _U32.pack(ErrorCodes.NO_ERROR)))
        self._forget(call)

    def _reset(self, call: _Call, code: int) -> None:
        """RST_STREAM ``code`` and cancel the call."""
        self.out.append(_frame(3, 0, call.sid, _U32.pack(code)))
        self.calls.pop(call.sid, None)
        self._cancel(call)
        self._maybe_idle()

    def _finish(self, call: _Call, code: grpc.StatusCode, details: str, extra: Any = ()) -> None:
        """End a call that has sent nothing with a Trailers-Only response."""
        if call.finished or call.cancelled:
            return
        call.finished = True
        block = _encode(
            [(b":status", b"200"), (b"content-type", b"application/grpc")]
            + status_trailers(code, details, extra)
        )
        self.out.append(_frame(1, 0x5, call.sid, block))
        self._done_sending(call)
        self._flush_soon()

    def _forget(self, call: _Call) -> None:
        call.finished = True
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        if self.calls.pop(call.sid, None) is not None:
            self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self.calls:
            self.idle_since = time.monotonic()
            if self.draining:
                self._flush()
                self._close()
                self.server.check_drained()

    def _cancel(self, call: _Call) -> None:
        """The client reset the stream, the deadline passed or the connection went:
        stop the call's work (its CancelToken via the done callbacks, then the task)."""
        if call.cancelled:
            return
        call.cancelled = True
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        if call.writable is not None:
            call.writable.set()
        if call.resume is not None:
            call.resume.set()
        if call.task is not None and not call.task.done():
            if call.ctx is not None:
                call.ctx.run_callbacks()
            call.task.cancel()

    def _expire(self, call: _Call) -> None:
        """``grpc-timeout`` passed: DEADLINE_EXCEEDED, and the work is stopped."""
        call.timer = None
        if call.finished or call.cancelled:
            return
        self._finish(call, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        self._cancel(call)
        self._flush()

    # -- writing and closing -------------------------------------------------------------

    def _flush_soon(self) -> None:
        if not self.flush_pending:
            self.flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_pending = False
        out = self.out
        if self.last_ping_recv:  # sending HEADERS or DATA forgives the client's PINGs
            for frame in out:  # (grpc core's ResetPingClock, grpc-go's resetPingStrikes)
                if frame[3] <= 1:  # the frame header's type byte: 0 DATA, 1 HEADERS
                    self.last_ping_recv = 0.0
                    self.ping_strikes = 0
                    break
        if out and not self.closed and self.transport is not None:
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])
            self.writes += 1
        out.clear()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.closed = True

    def _goaway(self, code: int, debug: bytes = b"") -> None:
        self.out.append(_frame(7, 0, 0, _GOAWAY.pack(self.last_sid, code) + debug))

    def goaway(self) -> None:
        """Start a graceful close: GOAWAY naming the last stream that will be served;
        the connection closes once its calls have finished."""
        if self.closed or self.draining:
            return
        self.draining = True
        if self.preface:
            self._goaway(ErrorCodes.NO_ERROR)
        self._flush()
        if not self.calls:
            self._close()

    def abort(self) -> None:
        """Cancel every call and drop the connection."""
        for call in list(self.calls.values()):
            self._cancel(call)
        self.calls.clear()
        if self.transport is not None:
            self.transport.abort()
        self.closed = True


class NativeGrpcServer:
    """The listening side of the native transport: the handlers, the limits and the
    open connections (:func:`serve_native`).

    Args:
        handlers: method name -> ``grpc.RpcMethodHandler``
            (:func:`~pdserve.frontends.grpc.service.method_handlers`).
        service: the fully qualified service name (``inference.GRPCInferenceService``).
        max_message_bytes: the largest message received or sent.
        max_connections: most connections open at once (0: half the open-file limit).
        idle_timeout: seconds with no stream before a connection is closed (0: never).
        keepalive: keepalive PINGs and ping policing (Triton's ``--grpc-keepalive-*``
            and ``--grpc-http2-*`` flags); None: grpc core's defaults.
    """

    def __init__(
        self,
        handlers: dict[str, Any],
        service: str,
        max_message_bytes: int,
        max_connections: int = 0,
        idle_timeout: float = IDLE_TIMEOUT_SECS,
        keepalive: GrpcKeepalive | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.keepalive = keepalive or GrpcKeepalive()
        self.handlers = handlers
        #: method name -> the servicer method a unary handler wraps (:func:`direct_unary`)
        self.direct = {
            name: d for name, h in handlers.items() if (d := direct_unary(h)) is not None
        }
        self.service_path = b"/" + service.encode()
        self.max_message_bytes = max_message_bytes
        if max_connections <= 0:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            max_connections = max(16, soft // 2) if soft > 0 else 4096
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.connections: set[GrpcConnection] = set()
        self.listener: asyncio.base_events.Server | None = None
        self._drained: asyncio.Event | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    def protocol(self) -> GrpcConnection:
        """A new connection's protocol."""
        return GrpcConnection(self)

    def start_sweeping(self) -> None:
        """Check idle connections and keepalive every quarter of the shortest of the idle
        timeout, the keepalive time and the keepalive timeout (at most every 50 ms)."""
        ka = self.keepalive
        periods = [ka.time_ms / 1000.0, ka.timeout_ms / 1000.0]
        if self.idle_timeout > 0:
            periods.append(self.idle_timeout)
        self._sweeper = self.loop.call_later(max(0.05, min(periods) / 4), self._sweep)

    def _sweep(self) -> None:
        now = time.monotonic()
        for c in list(self.connections):
            if self.idle_timeout > 0 and not c.calls and now - c.idle_since >= self.idle_timeout:
                c.goaway()
            else:
                c.keepalive(now)
        self.start_sweeping()

    def check_drained(self) -> None:
        """Wake :meth:`stop` when the last connection is gone."""
        if self._drained is not None and not self.connections:
            self._drained.set()

    async def stop(self, grace: float | None) -> None:
        """Graceful stop: close the listener, GOAWAY every connection, let calls in
        flight finish for up to ``grace`` seconds, then cancel and close the rest."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.listener is not None:
            self.listener.close()
        self._drained = asyncio.Event()
        for c in list(self.connections):
            c.goaway()
        self.check_drained()
        if self.connections and grace:
            try:
                await asyncio.wait_for(self._drained.wait(), grace)
            except TimeoutError:
                pass
        for c in list(self.connections):
            c.abort()
        self.connections.clear()


async def serve_native(
    handlers: dict[str, Any],
    service: str,
    host: str,
    port: int,
    max_message_bytes: int,
    max_connections: int = 0,
    idle_timeout: float = IDLE_TIMEOUT_SECS,
    keepalive: GrpcKeepalive | None = None,
) -> NativeGrpcServer:
    """Listen on ``host:port`` and serve ``handlers`` with the native transport.

    Raises:
        RuntimeError: the address could not be bound.
    """
    srv = NativeGrpcServer(
        handlers, service, max_message_bytes, max_connections, idle_timeout, keepalive
    )
    try:
        srv.listener = await srv.loop.create_server(
            srv.protocol, host, port, reuse_address=True, backlog=2048
        )
    except OSError as e:
        raise RuntimeError(f"could not listen for gRPC on {host}:{port}: {e}") from None
    srv.start_sweeping()
    return srv
