"""HTTP/1.1 wire helpers: response bytes of the native transport (status lines, header
block endings, a whole error response), what a socket holds unread, and the header limits
(size, field count) both transports' connections enforce while feeding their parser."""

from __future__ import annotations

import asyncio
import fcntl
import http
import struct
import termios
from typing import Protocol

import httptools

from pdserve.frontends.http.encode import encode_error

_STATUS_LINES: dict[int, bytes] = {
    s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode("latin-1")) for s in http.HTTPStatus
}
_STATUS_LINES[499] = b"HTTP/1.1 499 Client Closed Request\r\n"
OK_JSON = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
OK_OCTETS = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
    b"inference-header-content-length: "
)
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Header block endings by connection disposition.
END_KEEP = b"\r\n\r\n"  # HTTP/1.1 keep-alive: nothing to say
END_CLOSE = b"\r\nconnection: close\r\n\r\n"
END_KEEP10 = b"\r\nconnection: keep-alive\r\n\r\n"  # HTTP/1.0 keep-alive
GZIP_HEADERS = b"\r\ncontent-encoding: gzip\r\nvary: accept-encoding"
VARY = b"\r\nvary: accept-encoding"


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d Unknown\r\n" % status
    return line


def error_bytes(status: int, message: str, close: bool = True, body: bytes = b"") -> bytes:
    """A whole JSON error response (with ``connection: close``): ``body``, or when
    empty V2's ``{"error": message}``."""
    body = body or encode_error(message)
    return b"%scontent-type: application/json\r\ncontent-length: %d%s%s" % (
        status_line(status),
        len(body),
        END_CLOSE if close else END_KEEP,
        body,
    )


def unread_bytes(transport: asyncio.BaseTransport | None) -> int:
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


def origin_form(url: bytes) -> bytes:
    """The path and query of an absolute-form request target (``http://host/p?q``,
    RFC 9112 3.2.2), as uvicorn reads it; other targets (``*``) unchanged."""
    try:
        parsed = httptools.parse_url(url)
    except httptools.HttpParserInvalidURLError:
        return url
    path = parsed.path or b"/"
    return path + b"?" + parsed.query if parsed.query else path


class _HeadFeeder(Protocol):
    _awaiting_headers: bool
    _header_bytes: int

    def _feed(self, data: bytes) -> bool: ...

    def _reject(self, status: int, message: str) -> None: ...


def feed_to_header_limit(conn: _HeadFeeder, data: bytes, room: int, limit: int) -> bytes | None:
    """Feed ``conn`` only the ``room`` bytes of ``data`` its request line and headers
    may still take (``limit`` in all): the rest of ``data`` when the headers ended within
    them; None when the connection stopped (the headers go on: 431, nothing more is
    buffered)."""
    head = data[: max(room, 0)]
    conn._header_bytes += len(head)
    if head and not conn._feed(head):
        return None
    if conn._awaiting_headers:
        conn._reject(431, f"the request line and headers exceed the limit of {limit} bytes")
        return None
    return data[len(head) :]


class Rejected(Exception):
    """Raised from a parser callback to stop parsing a request the connection refuses
    (its ``_rejection`` says how it is answered)."""


class _Refusing(Protocol):
    _rejection: tuple[int, str] | None


def too_many_headers(conn: _Refusing, limit: int) -> Rejected:
    """Refuse a request with more than ``limit`` header fields (431): sets
    ``conn._rejection``; raise what it returns from the parser callback."""
    conn._rejection = (431, f"the request has more than {limit} header fields")
    return Rejected()
