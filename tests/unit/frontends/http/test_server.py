"""pdserve.frontends.http.server.gzip_responses: the ASGI path's response coding, the
same as the native transport's (threshold, Vary, streams and HEAD untouched)."""

from __future__ import annotations

import asyncio
import gzip
from typing import Any

from pdserve.frontends.http.server import gzip_responses


def _serve(
    messages: list[dict[str, Any]], accept: bytes | None, method: str = "POST"
) -> list[dict[str, Any]]:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        for m in messages:
            await send(m)

    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    headers = [] if accept is None else [(b"accept-encoding", accept)]
    scope = {"type": "http", "method": method, "headers": headers}
    asyncio.run(gzip_responses(app)(scope, None, send))
    return sent


def _start(length: int | None) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", b"%d" % length))
    return {"type": "http.response.start", "status": 200, "headers": headers}


def _headers(message: dict[str, Any]) -> dict[bytes, bytes]:
    return dict(message["headers"])


def test_large_whole_body_is_gzipped_for_a_client_that_accepts_it() -> None:
    body = b'{"x": "' + b"a" * 3000 + b'"}'
    for start in (_start(len(body)), _start(None)):
        sent = _serve([start, {"type": "http.response.body", "body": body}], b"br, gzip")
        head = _headers(sent[0])
        assert head[b"content-encoding"] == b"gzip" and head[b"vary"] == b"accept-encoding"
        assert int(head[b"content-length"]) == len(sent[1]["body"])
        assert gzip.decompress(sent[1]["body"]) == body
    # in pieces with a known length: joined, then compressed
    pieces = [
        _start(len(body)),
        {"type": "http.response.body", "body": body[:100], "more_body": True},
        {"type": "http.response.body", "body": body[100:]},
    ]
    sent = _serve(pieces, b"gzip")
    assert len(sent) == 2 and gzip.decompress(sent[1]["body"]) == body


def test_what_is_not_gzipped() -> None:
    body = b"b" * 3000
    whole = [_start(len(body)), {"type": "http.response.body", "body": body}]
    for accept, method in ((None, "POST"), (b"gzip;q=0", "POST"), (b"gzip", "HEAD")):
        sent = _serve(whole, accept, method)
        head = _headers(sent[0])
        assert b"content-encoding" not in head and head[b"vary"] == b"accept-encoding"
        assert sent[1]["body"] == body
    small = [_start(10), {"type": "http.response.body", "body": b"s" * 10}]
    assert _serve(small, b"gzip") == small
    # a stream (unknown length, in pieces) passes as it is
    stream = [
        _start(None),
        {"type": "http.response.body", "body": body, "more_body": True},
        {"type": "http.response.body", "body": body},
    ]
    assert _serve(stream, b"gzip") == stream
