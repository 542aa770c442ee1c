"""Requests that ask for a protocol upgrade, served as plain HTTP/1.1 (both transports).

pdserve speaks only HTTP/1.1 on its HTTP port (no WebSocket, no h2c), as Triton's HTTP
server: a request with ``Connection: Upgrade`` (``curl --http2`` sends ``Upgrade: h2c``)
is answered as an ordinary request (RFC 9110 7.8 lets a server ignore ``Upgrade``).

httptools (llhttp) cannot be told so: it skips the body, reports the message complete
after the headers and raises ``HttpParserUpgrade`` (with the offset past the headers).
The transports then go on with a fresh parser (:func:`continue_after_upgrade`), first fed
a synthetic head carrying only the original body framing (``Content-Length`` or
chunked), its callbacks swallowed, so the body is parsed, limited and timed as the
original request's, and what follows as the next request.
"""

from __future__ import annotations

from typing import Any

import httptools


class InvalidFramingError(ValueError):
    """The upgrade request's body framing is invalid (``Transfer-Encoding`` without a
    final ``chunked``): answered 400, as llhttp answers it on any other request."""


def body_framing(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The header line that frames an upgrade request's body, or ``b""`` if it has none.

    Args:
        headers: the request's header fields, names lower-cased (as both transports
            keep them). llhttp has already refused a request with both
            ``Content-Length`` and ``Transfer-Encoding``, or with a malformed or
            repeated ``Content-Length``.

    Returns:
        ``b"transfer-encoding: chunked"``, ``b"content-length: N"`` (N > 0) or ``b""``.

    Raises:
        InvalidFramingError: ``Transfer-Encoding`` whose last coding is not ``chunked``
            (RFC 9112 6.3: the length of such a request cannot be determined).
    """
    length = b""
    coding: bytes | None = None
    for name, value in headers:
        if name == b"transfer-encoding":
            coding = value
        elif name == b"content-length":
            length = value.strip()
    if coding is not None:
        if coding.rsplit(b",", 1)[-1].strip().lower() != b"chunked":
            raise InvalidFramingError("Request has invalid `Transfer-Encoding`")
        return b"transfer-encoding: chunked"
    if length and length.lstrip(b"0"):
        return b"content-length: " + length
    return b""


class _SkipHead:
    """The callbacks of the parser that follows an upgrade request: those of the
    synthetic head are swallowed, every other one goes to ``protocol``."""

    __slots__ = ("protocol", "in_head")

    def __init__(self, protocol: Any, in_head: bool) -> None:
        self.protocol = protocol
        self.in_head = in_head

    def on_message_begin(self) -> None:
        if not self.in_head:
            self.protocol.on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self.in_head:
            self.protocol.on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_head:
            self.protocol.on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.in_head:
            self.in_head = False
            return
        self.protocol.on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self.protocol.on_body(body)

    def on_chunk_header(self) -> None:
        callback = getattr(self.protocol, "on_chunk_header", None)  # (optional, as in httptools)
        if callback is not None:
            callback()

    def on_chunk_complete(self) -> None:
        callback = getattr(self.protocol, "on_chunk_complete", None)
        if callback is not None:
            callback()

    def on_message_complete(self) -> None:
        self.protocol.on_message_complete()


def parser_after_upgrade(protocol: Any, framing: bytes) -> httptools.HttpRequestParser:
    """A fresh request parser for ``protocol`` (an object with httptools' callbacks),
    to feed what follows an upgrade request's headers.

    Args:
        protocol: the connection (its ``on_*`` callbacks receive the body, if any, and
            every later request).
        framing: :func:`body_framing`'s line; when not empty, the parser is first fed a
            synthetic head with only that field, so that the bytes fed next are parsed
            as a body of that framing (``on_body``, ``on_message_complete``).
    """
    parser = httptools.HttpRequestParser(_SkipHead(protocol, bool(framing)))
    if framing:
        parser.feed_data(b"POST / HTTP/1.1\r\n%s\r\n\r\n" % framing)
    return parser


def continue_after_upgrade(
    protocol: Any, data: bytes, upgrade: httptools.HttpParserUpgrade
) -> bytes:
    """Give ``protocol`` (its ``parser`` and the :func:`body_framing` line it kept in
    ``_upgrade_framing``, cleared here) a fresh parser after an upgrade request's head,
    which ``upgrade`` (the parser's exception) ended within ``data``.

    Returns:
        the bytes of ``data`` after that head (the body, if any, and what follows), for
        the new parser.
    """
    framing = protocol._upgrade_framing
    protocol._upgrade_framing = b""
    protocol.parser = parser_after_upgrade(protocol, framing)
    return data[upgrade.args[0] :]
