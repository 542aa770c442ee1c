"""A lean gRPC client for ``pdserve perf``: unary ``ModelInfer`` calls over raw
HTTP/2 (RFC 9113) on an asyncio protocol, for load generation only.

Why not ``grpcio``: its Python layer costs enough CPU and latency per call that the
client, not the server, becomes what is measured on a fast model. Here a request is
a few pre-encoded bytes (the HEADERS block is built once; per call only the stream
id and the serialized ``ModelInferRequest`` go out) and an answer is three frames.

Implemented: the preface, SETTINGS (no push, a header table of 0, the largest
window), SETTINGS/PING acks, WINDOW_UPDATE both ways, MAX_FRAME_SIZE splitting,
GOAWAY, RST_STREAM, CONTINUATION, padding. Success is ``grpc-status: 0`` in the
trailers; another status is an error named by its code, with ``grpc-message`` as
the example. Header blocks are decoded with ``hpack`` once per distinct block (with
no dynamic table the same bytes always mean the same headers).
"""

from __future__ import annotations

import asyncio
import struct
import urllib.parse
from collections.abc import Callable

#: Frame types (RFC 9113 section 6).
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    0x0,
    0x1,
    0x3,
    0x4,
    0x6,
    0x7,
    0x8,
    0x9,
)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_WINDOW = 2**31 - 1
#: Receive-window credit returned to the server once this much data has arrived.
WINDOW_REFILL = 2**30
METHOD = "/inference.GRPCInferenceService/ModelInfer"

#: gRPC status codes by number.
GRPC_CODES = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
]

_FRAME = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id: 9 bytes


def frame(ftype: int, flags: int, stream: int, payload: bytes) -> bytes:
    """One HTTP/2 frame."""
    return _FRAME.pack((len(payload) << 8) | ftype, flags, stream) + payload


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """RFC 7541 5.1 integer with a ``prefix_bits`` prefix; ``first`` holds the
    pattern bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name_index: int | None, name: str, value: str) -> bytes:
    """A literal header field without indexing (RFC 7541 6.2.2), raw strings."""
    v = value.encode()
    if name_index is not None:
        head = _hpack_int(name_index, 4, 0x00)
    else:
        n = name.encode()
        head = b"\x00" + _hpack_int(len(n), 7, 0x00) + n
    return head + _hpack_int(len(v), 7, 0x00) + v


def request_headers(authority: str, path: str = METHOD) -> bytes:
    """The HPACK block of every request (static-table indices from RFC 7541 A)."""
    return (
        b"\x83"  # :method POST (index 3)
        + b"\x86"  # :scheme http (index 6)
        + _literal(4, ":path", path)
        + _literal(1, ":authority", authority)
        + _literal(31, "content-type", "application/grpc")
        + _literal(None, "te", "trailers")
    )


def grpc_message(message: bytes) -> bytes:
    """The gRPC length-prefixed message (uncompressed)."""
    return b"\x00" + struct.pack(">I", len(message)) + message


class Stream:
    """One call in flight on an :class:`H2Connection` (``t0``: when it was sent)."""

    __slots__ = ("sid", "t0", "status", "pending", "window", "done")

    def __init__(self, sid: int, t0: int, window: int) -> None:
        self.sid = sid
        self.t0 = t0
        self.status = 0  # HTTP :status, 0 until the response headers
        self.pending = memoryview(b"")  # DATA payload still to send (flow control)
        self.window = window
        self.done = False


#: What a finished call reports: (stream, error key or None on success, message).
Finished = Callable[[Stream, str | None, str], None]


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection carrying many concurrent unary gRPC calls.

    ``finished(stream, error, message)`` is called once per call, from the event
    loop: ``error`` None for ``grpc-status 0``; otherwise the gRPC code name,
    ``HTTP <status>``, ``stream reset`` or ``connection lost``.
    ``on_lost(conn)`` is called when the connection closes.
    """

    def __init__(
        self,
        authority: str,
        finished: Finished,
        on_lost: Callable[[H2Connection], None],
        clock: Callable[[], int],
    ) -> None:
        import hpack

        self.headers_block = request_headers(authority)
        self.finished = finished
        self.on_lost = on_lost
        self.clock = clock
        self.tr: asyncio.Transport | None = None
        self.decoder = hpack.Decoder()
        self.decoder.max_allowed_table_size = 0
        self.decoder.header_table_size = 0
        self.trailer_cache: dict[bytes, tuple[str | None, str]] = {}
        self.status_cache: dict[bytes, int] = {}
        self.buf = b""
        self.next_sid = 1
        self.streams: dict[int, Stream] = {}
        self.peer_max_streams = 2**31
        self.peer_window = 65535  # initial stream window the server grants
        self.conn_window = 65535  # connection send window
        self.max_frame = 16384
        self.received = 0
        self.closed = False
        self.goaway = False
        self.blocked: list[Stream] = []
        self._cont: tuple[int, int, bytearray] | None = None  # (stream, flags, block)

    # -- connection
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr: asyncio.Transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.tr = tr
        settings = struct.pack(">HIHIHI", 0x1, 0, 0x2, 0, 0x4, MAX_WINDOW)
        tr.write(
            PREFACE
            + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - 65535))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        why = str(exc) if exc else "the server closed the connection"
        for st in list(self.streams.values()):
            self._finish(st, "connection lost", why)
        self.on_lost(self)

    def close(self) -> None:
        """Abort the connection (its calls fail as ``connection lost``)."""
        if self.tr is not None and not self.tr.is_closing():
            self.tr.abort()

    @property
    def usable(self) -> bool:
        """Open, not going away, and with a stream id left."""
        return not self.closed and not self.goaway and self.next_sid < 2**31 - 2

    @property
    def free_streams(self) -> int:
        """How many more calls the server's MAX_CONCURRENT_STREAMS allows now."""
        return self.peer_max_streams - len(self.streams)

    # -- calls
    def call(self, payload: bytes) -> Stream:
        """Start a call; ``payload`` is the request as :func:`grpc_message` frames it
        (built once per distinct request). Returns the call's stream."""
        assert self.tr is not None
        sid = self.next_sid
        self.next_sid += 2
        st = Stream(sid, self.clock(), self.peer_window)
        self.streams[sid] = st
        out = frame(HEADERS, END_HEADERS, sid, self.headers_block)
        n = len(payload)
        if n <= self.max_frame and n <= st.window and n <= self.conn_window:
            st.window -= n
            self.conn_window -= n
            # One vectored write; the (possibly large) payload is not copied here.
            self.tr.writelines((out, _FRAME.pack((n << 8) | DATA, END_STREAM, sid), payload))
        else:
            self.tr.write(out)
            st.pending = memoryview(payload)
            self._send_pending(st)
        return st

    def _send_pending(self, st: Stream) -> None:
        assert self.tr is not None
        chunks = []
        while st.pending:
            n = min(len(st.pending), self.max_frame, st.window, self.conn_window)
            if n <= 0:
                if st not in self.blocked:
                    self.blocked.append(st)
                break
            part, st.pending = bytes(st.pending[:n]), st.pending[n:]
            st.window -= n
            self.conn_window -= n
            chunks.append(frame(DATA, 0 if st.pending else END_STREAM, st.sid, part))
        if chunks:
            self.tr.write(b"".join(chunks))

    def cancel(self, st: Stream) -> None:
        """Give up on a call (RST_STREAM CANCEL); it reports nothing more."""
        if self.streams.pop(st.sid, None) is not None and self.tr is not None:
            st.done = True
            if not self.tr.is_closing():
                self.tr.write(frame(RST_STREAM, 0, st.sid, struct.pack(">I", 0x8)))

    def _finish(self, st: Stream, error: str | None, message: str) -> None:
        if st.done:
            return
        st.done = True
        self.streams.pop(st.sid, None)
        self.finished(st, error, message)

    # -- frames in
    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos = 0
        end = len(buf)
        unpack = _FRAME.unpack_from
        try:
            while end - pos >= 9:
                lt, flags, sid = unpack(buf, pos)
                length = lt >> 8
                if end - pos - 9 < length:
                    break
                payload = buf[pos + 9 : pos + 9 + length]
                pos += 9 + length
                self._frame(lt & 0xFF, flags, sid & 0x7FFFFFFF, payload)
        except Exception as e:  # noqa: BLE001 - a protocol error ends the connection
            for st in list(self.streams.values()):
                self._finish(st, "protocol error", str(e))
            self.close()
            return
        self.buf = buf[pos:]

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self._cont is not None and ftype != CONTINUATION:
            raise ValueError("expected a CONTINUATION frame")
        if ftype == DATA:
            self.received += len(payload)
            if self.received >= WINDOW_REFILL and self.tr is not None:
                self.tr.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.received)))
                self.received = 0
            if flags & END_STREAM:
                st = self.streams.get(sid)
                if st is not None:
                    self._finish(st, "no grpc-status", "the stream ended without trailers")
        elif ftype == HEADERS:
            if flags & PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            if flags & PRIORITY:
                payload = payload[5:]
            if flags & END_HEADERS:
                self._headers(sid, flags, payload)
            else:
                self._cont = (sid, flags, bytearray(payload))
        elif ftype == CONTINUATION:
            if self._cont is None:
                raise ValueError("CONTINUATION without HEADERS")
            self._cont[2].extend(payload)
            if flags & END_HEADERS:
                csid, cflags, block = self._cont
                self._cont = None
                self._headers(csid, cflags, bytes(block))
        elif ftype == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif ftype == WINDOW_UPDATE:
            (inc,) = struct.unpack(">I", payload[:4])
            inc &= 0x7FFFFFFF
            if sid == 0:
                self.conn_window += inc
            elif (st := self.streams.get(sid)) is not None:
                st.window += inc
            self._unblock()
        elif ftype == PING:
            if not flags & ACK and self.tr is not None:
                self.tr.write(frame(PING, ACK, 0, payload))
        elif ftype == RST_STREAM:
            st = self.streams.get(sid)
            if st is not None:
                (code,) = struct.unpack(">I", payload[:4])
                self._finish(st, "stream reset", f"RST_STREAM error code {code}")
        elif ftype == GOAWAY:
            self.goaway = True
            last = struct.unpack(">I", payload[:4])[0] & 0x7FFFFFFF
            for st in [s for s in self.streams.values() if s.sid > last]:
                self._finish(st, "connection lost", "GOAWAY: the server is closing")
            if not self.streams:
                self.close()

    def _settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == 0x3:
                self.peer_max_streams = value
            elif key == 0x4:
                delta = value - self.peer_window
                self.peer_window = value
                for st in self.streams.values():
                    st.window += delta
            elif key == 0x5:
                self.max_frame = value
        if self.tr is not None:
            self.tr.write(frame(SETTINGS, ACK, 0, b""))
        self._unblock()

    def _unblock(self) -> None:
        blocked, self.blocked = self.blocked, []
        for st in blocked:
            if not st.done:
                self._send_pending(st)

    def _headers(self, sid: int, flags: int, block: bytes) -> None:
        st = self.streams.get(sid)
        if st is None:
            return
        if not flags & END_STREAM:  # the response headers; the trailers follow
            status = self.status_cache.get(block)
            if status is None:
                status = self._status(block)
                if len(self.status_cache) < 1024:
                    self.status_cache[block] = status
            st.status = status
            return
        cached = self.trailer_cache.get(block)
        if cached is None:
            cached = self._trailers(block)
            if len(self.trailer_cache) < 1024:
                self.trailer_cache[block] = cached
        error, message = cached
        if error is None and st.status not in (0, 200):
            error, message = f"HTTP {st.status}", ""
        self._finish(st, error, message)

    def _decode(self, block: bytes) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, value in self.decoder.decode(block, raw=True):
            out[name.decode(errors="replace")] = value.decode(errors="replace")
        return out

    def _status(self, block: bytes) -> int:
        status = self._decode(block).get(":status", "200")
        return int(status) if status.isdigit() else 0

    def _trailers(self, block: bytes) -> tuple[str | None, str]:
        h = self._decode(block)
        status = h.get(":status")
        code = h.get("grpc-status")
        if code is None:
            return (f"HTTP {status}" if status and status != "200" else "no grpc-status"), ""
        if code == "0":
            return None, ""
        name = GRPC_CODES[int(code)] if code.isdigit() and int(code) < len(GRPC_CODES) else code
        return name, urllib.parse.unquote(h.get("grpc-message", ""))
