"""pdserve.frontends.http.server: gzip_responses, the ASGI path's response coding, the
same as the native transport's (threshold, Vary, streams and HEAD untouched); and
HTTPS (``ssl=``) on uvicorn and on the native transport."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trustme
import uvloop

from pdserve.frontends.http.app import create_http_app
from pdserve.frontends.http.native import NativeHttpServer
from pdserve.frontends.http.server import gzip_responses, serve_http
from pdserve.frontends.tls import ALPN_HTTP, ServerTls, TlsFiles
from tests.tls_certs import client_context, issue, served_cert
from tests.unit.frontends.http.test_codec import FakeServer


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


# -- HTTPS on both transports -------------------------------------------------------------


def _https(port: int, ctx: ssl.SSLContext, path: str, body: bytes | None = None) -> Any:
    url = f"https://127.0.0.1:{port}{path}"
    req = urllib.request.Request(url, data=body, method="POST" if body else "GET")
    with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
        return r.status, json.loads(r.read() or b"null")


@pytest.mark.parametrize("transport", ["native", "asgi"])
def test_mutual_https_on_each_transport(tmp_path: Path, transport: str) -> None:
    """Each HTTP transport serves HTTPS with ALPN http/1.1; under mutual TLS a client
    without a certificate, or speaking plain HTTP, is refused and the next one served."""
    files = issue(trustme.CA(), tmp_path / "certs")
    tls = ServerTls(TlsFiles(files.cert, files.key, files.ca, True, "--http"), ALPN_HTTP, "HTTP")
    app = create_http_app(FakeServer())
    good = client_context(files.ca, files.client_cert, files.client_key)
    body = json.dumps(
        {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2], "data": [1.5, -2.0]}]}
    ).encode()

    def clients(port: int) -> None:
        assert _https(port, good, "/v2/health/live") == (200, None)
        status, doc = _https(port, good, "/v2/models/echo/infer", body)
        assert status == 200 and doc["outputs"][0]["data"] == [1.5, -2.0]
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            _https(port, client_context(files.ca), "/v2/health/live")
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=5)
        assert (
            served_cert(
                port, client_context(files.ca, files.client_cert, files.client_key, "http/1.1")
            )[1]
            == "http/1.1"
        )
        assert _https(port, good, "/v2/health/ready") == (200, None)

    async def main() -> None:
        if transport == "native":
            native = NativeHttpServer(app, "127.0.0.1", 0, ssl=tls.context)
            await native.start()
            try:
                await asyncio.to_thread(clients, native.port)
            finally:
                await native.shutdown(0.5)
            return
        server = serve_http(app, "127.0.0.1", 0, ssl=tls.context)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            await asyncio.to_thread(clients, port)
        finally:
            server.should_exit = True
            await task

    uvloop.run(asyncio.wait_for(main(), 60))
