"""pdserve.frontends.http.wire (response bytes, the header size limit) and the native
transport's chunked stream writer (pdserve.frontends.http.native_reply)."""

from __future__ import annotations

import asyncio

from pdserve.frontends.http.answer import Answer
from pdserve.frontends.http.native_reply import ParsedRequest, _StreamWriter
from pdserve.frontends.http.wire import (
    END_KEEP,
    Rejected,
    error_bytes,
    feed_to_header_limit,
    origin_form,
    status_line,
    too_many_headers,
    unread_bytes,
)


def test_response_bytes() -> None:
    assert status_line(404) == b"HTTP/1.1 404 Not Found\r\n"
    assert status_line(499) == b"HTTP/1.1 499 Client Closed Request\r\n"
    assert status_line(599) == b"HTTP/1.1 599 Unknown\r\n"
    whole = error_bytes(503, "busy")
    assert whole.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert whole.endswith(b'connection: close\r\n\r\n{"error":"busy"}')
    assert origin_form(b"http://host:8000/v2/models?x=1") == b"/v2/models?x=1"
    assert origin_form(b"*") == b"*"
    assert unread_bytes(None) == 0


class _Conn:
    def __init__(self, head_ends_at: int) -> None:
        self._awaiting_headers = True
        self._header_bytes = 0
        self.fed: list[bytes] = []
        self.rejected: list[int] = []
        self.head_ends_at = head_ends_at

    def _feed(self, data: bytes) -> bool:
        self.fed.append(data)
        if sum(map(len, self.fed)) >= self.head_ends_at:
            self._awaiting_headers = False
        return True

    def _reject(self, status: int, message: str) -> None:
        self.rejected.append(status)


def test_headers_past_the_limit_are_refused_unbuffered() -> None:
    conn = _Conn(head_ends_at=100)
    assert feed_to_header_limit(conn, b"x" * 50, 10, 10) is None
    assert conn.fed == [b"x" * 10] and conn.rejected == [431]
    ended = _Conn(head_ends_at=5)
    assert feed_to_header_limit(ended, b"h" * 5 + b"body", 5, 5) == b"body"
    assert ended.rejected == []


class _Transport:
    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, data: bytes) -> None:
        self.out += data

    def writelines(self, parts: list[bytes]) -> None:
        for part in parts:
            self.out += part

    def is_closing(self) -> bool:
        return False


class _Replies:
    def __init__(self) -> None:
        self._gone = False
        self._head_only = False
        self.transport = _Transport()

    def _end(self, request: ParsedRequest) -> bytes:
        return END_KEEP

    async def drain(self) -> None:
        return None


def _stream(http10: bool) -> tuple[bytes, ParsedRequest]:
    conn = _Replies()
    request = ParsedRequest(b"POST", b"/", [], b"", True, http10, b"")
    answer = Answer(200, [(b"content-type", b"text/event-stream")])
    writer = _StreamWriter(conn, request, answer)  # type: ignore[arg-type]  # a stand-in connection

    async def run() -> None:
        await writer.start()
        await writer.write(b"data: 1\n\n")
        await writer.end()

    asyncio.run(run())
    assert writer.complete
    return bytes(conn.transport.out), request


def test_a_stream_is_chunked_for_http11_and_closes_for_http10() -> None:
    out, request = _stream(http10=False)
    assert b"transfer-encoding: chunked\r\n" in out
    assert out.endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n0\r\n\r\n") and request.keep_alive
    out, request = _stream(http10=True)
    assert b"transfer-encoding" not in out and out.endswith(b"\r\n\r\ndata: 1\n\n")
    assert not request.keep_alive


def test_too_many_headers_is_a_431() -> None:
    class Conn:
        _rejection: tuple[int, str] | None = None

    conn = Conn()
    assert isinstance(too_many_headers(conn, 100), Rejected)
    assert conn._rejection == (431, "the request has more than 100 header fields")
