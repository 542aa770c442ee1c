"""The native gRPC transport (``--grpc-server native``): HTTP/2 on the running (uvloop)
event loop, serving the V2 servicer's handlers
(:func:`~pdserve.frontends.grpc.service.method_handlers`, gate included) directly.

:class:`GrpcConnection` is one connection: it reads frames (:mod:`.http2`), hands
streams to its call side (:mod:`.native_dispatch`), and enforces the connection's
limits: SETTINGS_MAX_CONCURRENT_STREAMS (past it: RST_STREAM REFUSED_STREAM), rapid
reset (streams reset or refused past a token bucket: GOAWAY ENHANCE_YOUR_CALM),
keepalive PINGs and ping policing with grpc core's meaning of Triton's
``--grpc-keepalive-*`` / ``--grpc-http2-*`` flags, an idle timeout, and a graceful
stop (GOAWAY, calls in flight finish within the grace period). An HTTP/1.x client
gets a ``400`` naming the port's protocol; an HTTP/2 protocol error closes the
connection with GOAWAY. :class:`NativeGrpcServer` is the listener and its connections.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from ssl import SSLContext
from typing import TYPE_CHECKING, cast

import hpack
from h2.errors import ErrorCodes

if TYPE_CHECKING:
    import grpc

from pdserve.frontends.grpc.engine import GrpcKeepalive
from pdserve.frontends.grpc.http2 import (
    FRAME_HEADER,
    GOAWAY_BODY,
    HTTP1_METHODS,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
    PREFACE,
    RECEIVE_WINDOW,
    SERVER_PREFACE,
    SETTING,
    SETTINGS_ACK,
    U32,
    H2ConnectionError,
    RequestHead,
    frame,
    http1_refusal,
)
from pdserve.frontends.grpc.native_call import STREAM_MAX_QUEUED, NativeCall
from pdserve.frontends.grpc.native_dispatch import CallDispatch
from pdserve.frontends.grpc.service import direct_unary

log = logging.getLogger("pdserve.grpc")

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
#: The opaque data of the server's keepalive PINGs.
KEEPALIVE_OPAQUE = b"pdsv-kap"
#: A client may PING a connection with no call open at most this often (seconds)
#: unless ``permit_without_calls`` (grpc core: 2 hours).
IDLE_PING_INTERVAL_SECS = 7200.0


class GrpcConnection(CallDispatch, asyncio.Protocol):
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
        self.calls: dict[int, NativeCall] = {}
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
        self.hcache: dict[bytes, RequestHead] = {}
        self.hstate: tuple[int, object] = (0, None)
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
        self.transport = cast(asyncio.Transport, transport)  # a TCP transport
        server = self.server
        if len(server.connections) >= server.max_connections:
            self.transport.abort()
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
        frames: bytes | bytearray = data
        if not self.preface or buf:
            # else the common case: frames parsed from ``data`` itself (a payload is one
            # copy of it, not a copy into the buffer and two out); what is left is buffered
            buf += data
            frames = buf
            if not self.preface:
                if len(buf) < len(PREFACE):
                    if PREFACE.startswith(bytes(buf)):
                        return
                elif buf.startswith(PREFACE):
                    del buf[: len(PREFACE)]
                    self.preface = True
                    self.out.append(SERVER_PREFACE)
                if not self.preface:
                    if bytes(buf[:4]) in HTTP1_METHODS:
                        assert self.transport is not None
                        self.transport.write(http1_refusal())
                    self._close()
                    return
        try:
            self._frames(frames)
        except H2ConnectionError as e:
            self._connection_error(e)
            return
        self._flush()

    def _connection_error(self, e: H2ConnectionError) -> None:
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
        unpack = FRAME_HEADER.unpack_from
        try:
            while end - pos >= 9:
                head, kind_flags, sid = unpack(buf, pos)
                length = head >> 8
                kind = head & 0xFF
                sid &= 0x7FFFFFFF
                if length > MAX_FRAME_SIZE:
                    raise H2ConnectionError(ErrorCodes.FRAME_SIZE_ERROR, f"frame of {length} bytes")
                if end - pos < 9 + length:
                    break
                chunk = buf[pos + 9 : pos + 9 + length]
                payload = bytes(chunk) if copy else cast(bytes, chunk)
                pos += 9 + length
                if self.continuation is not None and kind != 9:
                    raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "expected CONTINUATION")
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
                        raise H2ConnectionError(ErrorCodes.FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
                    inc = U32.unpack(payload)[0] & 0x7FFFFFFF
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
                            raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
                        self.send_window += inc
                        if self.send_window > 0x7FFFFFFF:
                            raise H2ConnectionError(
                                ErrorCodes.FLOW_CONTROL_ERROR, "window overflow"
                            )
                        if self.stalled:
                            self._window(0)
                elif kind == 4:
                    self._on_settings(sid, kind_flags, payload)
                elif kind == 6:
                    self._on_ping(sid, kind_flags, payload)
                elif kind == 3:
                    if not sid or length != 4:
                        raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad RST_STREAM")
                    call = self.calls.pop(sid, None)
                    if call is not None:
                        self._cancel(call)
                        self._maybe_idle()
                        if not call.finished:
                            self._count_reset()
                elif kind == 7:
                    pass  # the client sends no new streams; the ones open go on
                elif kind == 5:
                    raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
                elif kind == 2 and (not sid or length != 5):
                    raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad PRIORITY")
                # other types (PRIORITY, extensions) are ignored
        finally:
            if buf is self.buf:
                del buf[:pos]
            elif pos < end:
                self.buf += buf[pos:]
        if len(self.buf) > MAX_FRAME_SIZE + 9:  # pragma: no cover - cannot: checked above
            raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "receive buffer overflow")

    def _on_ping(self, sid: int, flags: int, payload: bytes) -> None:
        """A PING: an ACK of ours ends the keepalive wait; the client's is answered, and
        one sooner than the allowed interval after the previous one, with no data or
        headers sent or received between them, is a strike; past ``max_ping_strikes``
        strikes: GOAWAY ENHANCE_YOUR_CALM ``too_many_pings`` (grpc core's ping abuse
        policy, which Triton's flags set)."""
        if sid or len(payload) != 8:
            raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad PING")
        if flags & 0x1:
            if payload == KEEPALIVE_OPAQUE:
                self.ping_sent_at = 0.0
            return
        self._police_ping()
        self.out.append(frame(6, 0x1, 0, payload))

    def _police_ping(self) -> None:
        """Count a client's PING against the ping abuse policy (raises past it)."""
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
            raise H2ConnectionError(
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
            raise H2ConnectionError(
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
        self.out.append(frame(6, 0, 0, KEEPALIVE_OPAQUE))
        self._flush()
        self.writes_at_ping = self.writes

    def _strip_padding(self, flags: int, payload: bytes) -> bytes:
        if flags & 0x8:
            if not payload or payload[0] >= len(payload):
                raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad padding")
            return payload[1 : len(payload) - payload[0]]
        return payload

    def _on_settings(self, sid: int, flags: int, payload: bytes) -> None:
        if sid or len(payload) % 6:
            raise H2ConnectionError(ErrorCodes.FRAME_SIZE_ERROR, "bad SETTINGS")
        if flags & 0x1:
            return
        for i in range(0, len(payload), 6):
            key, value = SETTING.unpack_from(payload, i)
            if key == 4:  # INITIAL_WINDOW_SIZE
                if value > 0x7FFFFFFF:
                    raise H2ConnectionError(ErrorCodes.FLOW_CONTROL_ERROR, "window too large")
                delta = value - self.stream_window
                self.stream_window = value
                for call in self.calls.values():
                    call.send_window += delta
            elif key == 5:  # MAX_FRAME_SIZE
                if not 16384 <= value <= 16777215:
                    raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
                self.max_frame = value
            elif key == 2 and value > 1:  # ENABLE_PUSH
                raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "bad ENABLE_PUSH")
        self.out.append(SETTINGS_ACK)
        self._window(0)

    def _on_headers(self, sid: int, flags: int, payload: bytes) -> None:
        if not sid:
            raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "HEADERS on stream 0")
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
            raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "unexpected CONTINUATION")
        pending[2].extend(payload)
        if len(pending[2]) > MAX_HEADER_LIST_SIZE * 2:
            raise H2ConnectionError(ErrorCodes.ENHANCE_YOUR_CALM, "header block too large")
        if flags & 0x4:
            self.continuation = None
            self._header_block(sid, pending[1], bytes(pending[2]))

    def _decode(self, block: bytes) -> RequestHead:
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
            raise H2ConnectionError(ErrorCodes.COMPRESSION_ERROR, str(e)) from None
        head = RequestHead(headers)
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
            raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, f"bad stream id {sid}")
        self.last_sid = sid
        if self.draining or len(self.calls) >= MAX_CONCURRENT_STREAMS:
            self.out.append(frame(3, 0, sid, U32.pack(ErrorCodes.REFUSED_STREAM)))
            if not self.draining:
                self._count_reset()
            return
        self._request(sid, head, end_stream)

    def _on_data(self, sid: int, flags: int, payload: bytes, length: int) -> None:
        if not sid:
            raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "DATA on stream 0")
        if self.last_ping_recv:  # data received: the ping clock starts anew
            self.last_ping_recv = 0.0
            self.ping_strikes = 0
        self.received += length
        if self.received >= RECEIVE_WINDOW // 2:
            self.out.append(frame(8, 0, 0, U32.pack(self.received)))
            self.received = 0
        call = self.calls.get(sid)
        if call is None:
            if sid > self.last_sid:
                raise H2ConnectionError(ErrorCodes.PROTOCOL_ERROR, "DATA on an idle stream")
            return
        if call.remote_ended:
            self._reset(call, ErrorCodes.STREAM_CLOSED)
            return
        call.received += length
        if call.received >= RECEIVE_WINDOW // 2:
            if call.queue is not None and call.queue.qsize() >= STREAM_MAX_QUEUED:
                call.held = True  # reopened as the handler takes requests (_requests)
            else:
                self.out.append(frame(8, 0, sid, U32.pack(call.received)))
                call.received = 0
        data = self._strip_padding(flags, payload)
        if not call.finished:
            self._messages(call, data)
        if flags & 0x1:
            self._remote_end(call)

    # -- writing and closing -------------------------------------------------------------

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
        self.out.append(frame(7, 0, 0, GOAWAY_BODY.pack(self.last_sid, code) + debug))

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
        handlers: dict[str, grpc.RpcMethodHandler],
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
    handlers: dict[str, grpc.RpcMethodHandler],
    service: str,
    host: str,
    port: int,
    max_message_bytes: int,
    max_connections: int = 0,
    idle_timeout: float = IDLE_TIMEOUT_SECS,
    keepalive: GrpcKeepalive | None = None,
    ssl: SSLContext | None = None,
) -> NativeGrpcServer:
    """Listen on ``host:port`` and serve ``handlers`` with the native transport; over
    TLS with ``ssl`` (a server context offering ALPN ``h2``:
    :attr:`pdserve.frontends.tls.ServerTls.context`).

    Raises:
        RuntimeError: the address could not be bound.
    """
    srv = NativeGrpcServer(
        handlers, service, max_message_bytes, max_connections, idle_timeout, keepalive
    )
    try:
        srv.listener = await srv.loop.create_server(
            srv.protocol, host, port, reuse_address=True, backlog=2048, ssl=ssl
        )
    except OSError as e:
        raise RuntimeError(f"could not listen for gRPC on {host}:{port}: {e}") from None
    srv.start_sweeping()
    return srv
