"""The ``/metrics`` scrape listener, on a real socket."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from pdserve.frontends import metrics_http
from pdserve.frontends.metrics_http import serve_metrics

CTYPE = "text/plain; version=0.0.4; charset=utf-8"


async def _ask(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    answer = await reader.read()  # the listener closes the connection after one answer
    writer.close()
    return answer


def _scrape(render: Callable[[], bytes], *requests: bytes) -> list[bytes]:
    async def run() -> list[bytes]:
        server = await serve_metrics(render, "127.0.0.1", 0, content_type=CTYPE)
        port = server.sockets[0].getsockname()[1]
        try:
            return [await _ask(port, raw) for raw in requests]
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(run())


def test_get_and_head_metrics_render_at_each_scrape() -> None:
    calls: list[int] = []

    def render() -> bytes:
        calls.append(1)
        return f"requests_total {len(calls)}\n".encode()

    get1, head, get2 = _scrape(
        render,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        b"HEAD /metrics HTTP/1.1\r\n\r\n",
        b"GET /metrics?name[]=x HTTP/1.1\r\n\r\n",
    )
    assert get1 == (
        b"HTTP/1.1 200 OK\r\nContent-Type: " + CTYPE.encode() + b"\r\nContent-Length: 17\r\n"
        b"Connection: close\r\n\r\nrequests_total 1\n"
    )
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Length: 17\r\n" in head
    assert head.endswith(b"\r\n\r\n")
    assert get2.endswith(b"\r\n\r\nrequests_total 3\n")
    assert len(calls) == 3


def test_other_paths_and_methods_are_404_naming_metrics() -> None:
    body = b"not found: metrics are served at /metrics\n"
    other_path, post = _scrape(
        lambda: b"never",
        b"GET /v2/health/ready HTTP/1.1\r\n\r\n",
        b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    )
    for answer in (other_path, post):
        assert answer.startswith(b"HTTP/1.1 404 Not Found\r\n")
        assert b"Content-Type: text/plain; charset=utf-8\r\n" in answer
        assert answer.endswith(b"\r\n\r\n" + body)


def test_a_failing_render_closes_the_connection_and_the_listener_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers = iter([RuntimeError("boom"), b"ok\n"])

    def render() -> bytes:
        item = next(answers)
        if isinstance(item, Exception):
            raise item
        return item

    failed, served = _scrape(
        render, b"GET /metrics HTTP/1.1\r\n\r\n", b"GET /metrics HTTP/1.1\r\n\r\n"
    )
    assert failed == b""
    assert served.endswith(b"\r\n\r\nok\n")
    assert "metrics request failed" in caplog.text


def test_a_client_that_sends_no_head_is_disconnected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_http, "HEAD_TIMEOUT_SECS", 0.2)
    (answer,) = _scrape(lambda: b"x", b"GET /metrics HTTP/1.1\r\n")  # no blank line ending the head
    assert answer == b""
