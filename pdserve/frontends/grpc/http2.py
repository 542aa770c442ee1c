"""HTTP/2 as the native gRPC transport speaks it (RFC 9113, server side): frame
encoding, the server's preface and settings, request header blocks, and the gRPC
wire details carried in them (``grpc-timeout``, ``grpc-status`` trailers, the
5-byte message prefix, compressed messages).

Every header block sent is encoded without the HPACK dynamic table, so the constant
response headers and the OK trailers are precomputed bytes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import grpc
import hpack

from pdserve.frontends.admission import header_text

if TYPE_CHECKING:
    from pdserve.frontends.grpc.service import UnaryBehavior

#: One header field as sent or received: ``(name, value)`` bytes.
Header = tuple[bytes, bytes]
#: gRPC metadata as handlers see it: ``(key, value)``, ``str`` values (``-bin`` keys: bytes).
Metadata = tuple[tuple[str, str | bytes], ...]
#: Trailing metadata a handler sets: ``(key, value)`` pairs, values converted to text.
TrailingMetadata = Sequence[tuple[str | bytes, object]]

#: Most streams a client may have open on one connection (SETTINGS_MAX_CONCURRENT_STREAMS).
MAX_CONCURRENT_STREAMS = 1024
#: The receive window of the connection and of each stream, in bytes: a request is
#: read without waiting for WINDOW_UPDATEs (memory per call is bounded by the
#: message limit, which is checked from each message's length prefix).
RECEIVE_WINDOW = 16 * 1024 * 1024
#: Largest header block accepted (SETTINGS_MAX_HEADER_LIST_SIZE), bytes (grpc's default).
MAX_HEADER_LIST_SIZE = 16 * 1024
#: Our SETTINGS_MAX_FRAME_SIZE (HTTP/2's default): a larger frame is a connection error.
MAX_FRAME_SIZE = 16384
#: The request encodings understood (``grpc-encoding``), for ``grpc-accept-encoding``.
ACCEPT_ENCODING = b"identity,deflate,gzip"

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP1_METHODS = (b"GET ", b"POST", b"PUT ", b"HEAD", b"DELE", b"OPTI", b"PATC", b"CONN")
#: a gRPC message's prefix: compressed flag, length
MESSAGE_PREFIX = struct.Struct(">BI")
_OK = b"0"
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
#: frame header: length << 8 | type, flags, stream id (a DATA frame's type is 0)
FRAME_HEADER = struct.Struct(">IBI")
U32 = struct.Struct(">I")
SETTING = struct.Struct(">HI")
GOAWAY_BODY = struct.Struct(">II")


def frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    """One HTTP/2 frame."""
    return FRAME_HEADER.pack(len(payload) << 8 | kind, flags, sid) + payload


def encode_block(headers: list[Header]) -> bytes:
    """A header block encoded without the dynamic table (never-indexed literals or
    static-table indexes), so blocks can be precomputed and sent in any order."""
    return hpack.Encoder().encode([(k, v, True) for k, v in headers])


SERVER_PREFACE = frame(
    4,
    0,
    0,
    SETTING.pack(3, MAX_CONCURRENT_STREAMS)
    + SETTING.pack(4, RECEIVE_WINDOW)
    + SETTING.pack(6, MAX_HEADER_LIST_SIZE),
) + frame(8, 0, 0, U32.pack(RECEIVE_WINDOW - 65535))
SETTINGS_ACK = frame(4, 0x1, 0, b"")
RESPONSE_HEADERS_BLOCK = encode_block(_RESPONSE_HEADERS)
OK_TRAILERS_BLOCK = encode_block(_OK_TRAILERS)


class H2ConnectionError(Exception):
    """An HTTP/2 connection error: GOAWAY with ``code`` (and ``debug`` as its debug
    data), then close."""

    def __init__(self, code: int, message: str, debug: bytes = b"") -> None:
        super().__init__(message)
        self.code = code
        self.debug = debug


class RequestHead:
    """What the transport reads from a request's header block."""

    __slots__ = ("content_type", "encoding", "metadata", "method", "path", "route", "timeout")

    def __init__(self, headers: Iterable[Header]) -> None:
        #: (handler, direct unary method) of the path, once looked up (a head is cached
        #: with its header block, so a repeated block skips the lookup)
        self.route: tuple[grpc.RpcMethodHandler | None, UnaryBehavior | None] | None = None
        self.path = self.method = self.content_type = b""
        self.encoding = b"identity"
        self.timeout: bytes | None = None
        metadata: list[tuple[str, str | bytes]] = []
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


def http1_refusal() -> bytes:
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


def status_trailers(
    code: grpc.StatusCode, details: str, extra: TrailingMetadata = ()
) -> list[Header]:
    """Trailers (or the tail of a Trailers-Only response) for a status."""
    out: list[Header] = [(b"grpc-status", str(code.value[0]).encode())]
    if details:
        out.append((b"grpc-message", percent_encode(details)))
    for key, value in extra or ():
        k = key.encode("latin-1") if isinstance(key, str) else key
        v = value if isinstance(value, bytes) else str(value).encode("latin-1")
        out.append((k, v))
    return out


class Decompressor:
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
