"""The native HTTP/1.1 transport (pdserve.frontends.http.native), in process on uvloop,
with raw sockets: keep-alive, HTTP/1.0, pipelining, chunked and compressed bodies,
``Expect: 100-continue``, the limits and timeouts, backpressure, cancellation on
disconnect and graceful shutdown. The core is test_http_codec's fake "echo" server."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import uvloop

from pdserve.core import timing as timing_mod
from pdserve.core.types import InferRequest, InferResponse
from pdserve.frontends.http.app import create_http_app
from pdserve.frontends.http.compression import GZIP_MIN_BYTES
from pdserve.frontends.http.native import HttpConnection, NativeHttpServer
from pdserve.frontends.http.server import HttpLimits
from tests.unit.frontends.http.test_codec import FakeServer, client_request, parse

LIMITS = HttpLimits(
    max_header_bytes=2048,
    max_header_count=10,
    header_timeout=0.4,
    idle_timeout=0.6,
    max_connections=8,
)


class SlowServer(FakeServer):
    """The echo model, each request held until :attr:`gate` is set; remembers tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.started = asyncio.Event()

    async def infer(self, request: InferRequest) -> InferResponse:
        self.seen.append(request)
        self.started.set()
        cancelled = asyncio.ensure_future(asyncio.sleep(3600))
        token = request.cancelled
        assert token is not None
        token.add_callback(lambda _t: cancelled.cancel())
        waiter = asyncio.ensure_future(self.gate.wait())
        await asyncio.wait({cancelled, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if cancelled.cancelled():
            raise token.error  # type: ignore[misc]  # set when cancelled
        cancelled.cancel()
        return InferResponse("echo", "1", dict(request.inputs), id=request.id)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    uvloop.run(asyncio.wait_for(scenario(), 30))


@asynccontextmanager
async def serving(
    core: Any = None, limits: HttpLimits = LIMITS, **app_options: Any
) -> AsyncIterator[NativeHttpServer]:
    app = create_http_app(core if core is not None else FakeServer(), **app_options)
    server = NativeHttpServer(app, "127.0.0.1", 0, limits=limits)
    await server.start()
    try:
        yield server
    finally:
        await server.shutdown(0.5)


def infer_body(value: float = 1.0, n: int = 4, request_id: str = "") -> bytes:
    doc: dict[str, Any] = {
        "inputs": [{"name": "IN", "datatype": "FP32", "shape": [n], "data": [value] * n}]
    }
    if request_id:
        doc["id"] = request_id
    return json.dumps(doc).encode()


def post(body: bytes, path: str = "/v2/models/echo/infer", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


async def read_response(reader: asyncio.StreamReader, head: bool = False) -> Response:
    """One response (Content-Length, chunked, or until close)."""
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            assert name.lower() not in headers, f"repeated header {name}"
            headers[name.lower()] = value.strip()
    if status == 100 or head:
        return Response(status, headers, b"")
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await reader.read()
    return Response(status, headers, body)


async def closed(reader: asyncio.StreamReader, timeout: float = 5.0) -> bool:
    """The server closed the connection (EOF or reset) within ``timeout`` seconds."""
    try:
        return await asyncio.wait_for(reader.read(), timeout) == b""
    except ConnectionResetError:
        return True


def out_values(response: Response) -> list[float]:
    return response.json()["outputs"][0]["data"]  # type: ignore[no-any-return]


def test_keep_alive_and_connection_close() -> None:
    async def scenario() -> None:
        async with serving() as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            for value in (1.0, 2.0, 3.0):
                writer.write(post(infer_body(value)))
                reply = await read_response(reader)
                assert reply.status == 200
                assert out_values(reply) == [value] * 4
                assert "connection" not in reply.headers
            writer.write(post(infer_body(4.0), extra="connection: close\r\n"))
            reply = await read_response(reader)
            assert reply.status == 200 and reply.headers["connection"] == "close"
            assert await closed(reader)
            writer.close()

    run(scenario)


def test_http10_closes_unless_keep_alive() -> None:
    async def scenario() -> None:
        async with serving() as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /v2/health/live HTTP/1.0\r\n\r\n")
            reply = await read_response(reader)
            assert reply.status == 200 and reply.headers["connection"] == "close"
            assert await closed(reader)
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            for _ in range(2):
                writer.write(b"GET /v2/models/echo HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
                reply = await read_response(reader)
                assert reply.status == 200 and reply.headers["connection"] == "keep-alive"
                assert reply.json()["name"] == "echo"
            writer.close()

    run(scenario)


def test_pipelined_requests_are_answered_in_order_and_a_bad_one_last() -> None:
    async def scenario() -> None:
        async with serving() as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                post(infer_body(1.0, request_id="a"))
                + b"GET /v2/models/echo/ready HTTP/1.1\r\n\r\n"
                + post(infer_body(2.0, request_id="b"))
                + b"GET /v2/nope HTTP/1.1\r\n\r\n"
                + post(infer_body(3.0, request_id="c"))
                + b"BOGUS\x01 / HTTP/1.1\r\n\r\n"
                + post(infer_body(4.0, request_id="d"))
            )
            first = await read_response(reader)
            assert first.json()["id"] == "a" and out_values(first) == [1.0] * 4
            assert (await read_response(reader)).status == 200
            assert (await read_response(reader)).json()["id"] == "b"
            assert (await read_response(reader)).status == 404
            assert (await read_response(reader)).json()["id"] == "c"
            bad = await read_response(reader)
            assert bad.status == 400 and bad.headers["connection"] == "close"
            assert "Invalid HTTP request" in bad.json()["error"]
            assert await closed(reader)  # "d" came after the bad request: never answered
            writer.close()

    run(scenario)


def test_chunked_and_compressed_bodies() -> None:
    async def scenario() -> None:
        async with serving() as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            body = infer_body(5.0)
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:7], body[7:]))
            writer.write(
                b"POST /v2/models/echo/infer HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"
                + chunks
                + b"0\r\n\r\n"
            )
            assert out_values(await read_response(reader)) == [5.0] * 4
            for coding, packed in (
                ("gzip", gzip.compress(infer_body(6.0))),
                ("deflate", zlib.compress(infer_body(6.0))),
            ):
                writer.write(post(packed, extra=f"content-encoding: {coding}\r\n"))
                assert out_values(await read_response(reader)) == [6.0] * 4
            writer.write(post(b"garbage", extra="content-encoding: gzip\r\n"))
            reply = await read_response(reader)
            assert reply.status == 400 and "error" in reply.json()
            writer.write(post(b"x", extra="content-encoding: br\r\n"))
            assert (await read_response(reader)).status == 415
            writer.close()

    run(scenario)


def test_expect_100_continue() -> None:
    async def scenario() -> None:
        async with serving(max_request_bytes=10_000) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            body = infer_body(7.0)
            writer.write(
                f"POST /v2/models/echo/infer HTTP/1.1\r\ncontent-length: {len(body)}\r\n"
                "expect: 100-continue\r\n\r\n".encode()
            )
            interim = await read_response(reader)
            assert interim.status == 100
            writer.write(body)
            assert out_values(await read_response(reader)) == [7.0] * 4
            # Too large: refused before the body is sent, no 100.
            writer.write(
                b"POST /v2/models/echo/infer HTTP/1.1\r\ncontent-length: 20000\r\n"
                b"expect: 100-continue\r\n\r\n"
            )
            reply = await read_response(reader)
            assert reply.status == 413 and reply.headers["connection"] == "close"
            assert await closed(reader)
            writer.close()

    run(scenario)


def test_header_limits_are_431() -> None:
    async def scenario() -> None:
        async with serving() as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nx-long: " + b"a" * 4000)
            reply = await read_response(reader)
            assert reply.status == 431 and "2048 bytes" in reply.json()["error"]
            assert await closed(reader)
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            many = "".join(f"x-h{i}: v\r\n" for i in range(11))
            writer.write(f"GET /v2/health/live HTTP/1.1\r\n{many}\r\n".encode())
            reply = await read_response(reader)
            assert reply.status == 431 and "10 header fields" in reply.json()["error"]
            assert await closed(reader)
            writer.close()

    run(scenario)


def test_body_limits_are_413() -> None:
    async def scenario() -> None:
        async with serving(max_request_bytes=5000, max_json_bytes=1000) as server:
            # Content-Length over the JSON limit of an inference request.
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(post(b"{" * 1500))
            reply = await read_response(reader)
            assert reply.status == 413 and "request JSON of 1500 bytes" in reply.json()["error"]
            assert await closed(reader)
            writer.close()
            # Chunked: refused once the bytes received pass the limit.
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                b"POST /v2/repository/index HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for _ in range(6):
                writer.write(b"3e8\r\n" + b" " * 1000 + b"\r\n")
            reply = await read_response(reader)
            assert reply.status == 413 and "at least 6000 bytes" in reply.json()["error"]
            assert await closed(reader)
            writer.close()

    run(scenario)


def test_header_body_and_idle_timeouts() -> None:
    async def scenario() -> None:
        async with serving(body_timeout=0.4) as server:
            loop = asyncio.get_running_loop()
            # slowloris on the headers: a byte now and then never completes them
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            began = loop.time()
            writer.write(b"GET /v2/health/live HTTP/1.1\r\n")
            for _ in range(2):  # each byte within the timeout; all of them not
                await asyncio.sleep(0.15)
                writer.write(b"x")
            reply = await read_response(reader)
            assert reply.status == 408 and "headers" in reply.json()["error"]
            assert loop.time() - began < 2.0
            writer.close()
            # slowloris on the body: pieces further apart than the body timeout
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /v2/models/echo/infer HTTP/1.1\r\ncontent-length: 100\r\n\r\n{")
            reply = await read_response(reader)
            assert reply.status == 408 and "body" in reply.json()["error"]
            assert await closed(reader)
            writer.close()
            # idle: closed silently, also after a response
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\n\r\n")
            assert (await read_response(reader)).status == 200
            began = loop.time()
            assert await reader.read() == b""
            assert 0.4 < loop.time() - began < 2.5
            writer.close()

    run(scenario)


def test_connections_over_the_cap_get_503() -> None:
    async def scenario() -> None:
        async with serving() as server:
            held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(8)]
            await asyncio.sleep(0.05)
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            reply = await read_response(reader)
            assert reply.status == 503 and "too many open connections" in reply.json()["error"]
            writer.close()
            for _, w in held:
                w.close()
            await asyncio.sleep(0.1)
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\n\r\n")
            assert (await read_response(reader)).status == 200
            writer.close()

    run(scenario)


def test_gzip_responses_for_clients_that_accept_them() -> None:
    async def scenario() -> None:
        async with serving() as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            big = infer_body(0.25, n=2000)
            writer.write(post(big, extra="accept-encoding: gzip, deflate\r\n"))
            reply = await read_response(reader)
            assert reply.headers["content-encoding"] == "gzip"
            assert reply.headers["vary"] == "accept-encoding"
            doc = json.loads(gzip.decompress(reply.body))
            assert doc["outputs"][0]["data"] == [0.25] * 2000
            # not accepted (q=0), or too small: plain
            writer.write(post(big, extra="accept-encoding: gzip;q=0\r\n"))
            reply = await read_response(reader)
            assert "content-encoding" not in reply.headers and reply.headers["vary"]
            assert len(reply.body) >= GZIP_MIN_BYTES
            writer.write(post(infer_body(1.0), extra="accept-encoding: gzip\r\n"))
            reply = await read_response(reader)
            assert "content-encoding" not in reply.headers and out_values(reply) == [1.0] * 4
            # binary outputs and the other routes too
            arr = np.arange(1000, dtype=np.float32)
            body, json_size = client_request({"IN": arr}, True)
            writer.write(
                post(
                    body,
                    extra=f"inference-header-content-length: {json_size}\r\n"
                    "accept-encoding: gzip\r\n",
                )
            )
            reply = await read_response(reader)
            assert reply.headers["content-encoding"] == "gzip"
            length = int(reply.headers["inference-header-content-length"])
            out = parse(gzip.decompress(reply.body), length).as_numpy("IN")
            assert np.array_equal(out, arr)
            writer.close()

    run(scenario)


def test_head_gets_no_body() -> None:
    async def scenario() -> None:
        async with serving() as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"HEAD /v2/health/live HTTP/1.1\r\n\r\n")
            reply = await read_response(reader, head=True)
            assert reply.status == 405
            writer.write(b"GET /v2/health/live HTTP/1.1\r\n\r\n")
            assert (await read_response(reader)).status == 200  # nothing was left over
            writer.close()

    run(scenario)


def test_write_backpressure_pauses_reading() -> None:
    async def scenario() -> None:
        async with serving(limits=HttpLimits(idle_timeout=0, header_timeout=0)) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            arr = np.zeros(1 << 20, dtype=np.float32)  # 4 MiB out per request, never read
            body, json_size = client_request({"IN": arr}, True)
            raw = post(body, extra=f"inference-header-content-length: {json_size}\r\n")
            conn: HttpConnection | None = None
            sent = 0
            for _ in range(8):
                writer.write(raw)
                sent += 1
                await asyncio.sleep(0.1)
                conn = next(iter(server.connections))
                if conn._write_paused:
                    break
            assert conn is not None and conn._write_paused and conn._paused
            # reading the responses drains the buffer and the connection carries on
            for _ in range(sent):
                reply = await read_response(reader)
                assert reply.status == 200 and len(reply.body) > 4 << 20
            assert not conn._write_paused and not conn._paused
            writer.write(b"GET /v2/health/live HTTP/1.1\r\n\r\n")
            assert (await read_response(reader)).status == 200
            writer.close()

    run(scenario)


def test_client_disconnect_cancels_the_request() -> None:
    async def scenario() -> None:
        core = SlowServer()
        async with serving(core) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(post(infer_body(1.0)))
            await asyncio.wait_for(core.started.wait(), 5)
            writer.close()
            token = core.seen[0].cancelled
            assert token is not None
            for _ in range(100):
                if token.error is not None:
                    break
                await asyncio.sleep(0.01)
            assert token.error is not None and "client" in token.error.message.lower()
            # also for a request that closes the connection (HTTP/1.0, Connection: close)
            core.started.clear()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(post(infer_body(2.0), extra="connection: close\r\n"))
            await asyncio.wait_for(core.started.wait(), 5)
            writer.close()
            token = core.seen[1].cancelled
            assert token is not None
            for _ in range(100):
                if token.error is not None:
                    break
                await asyncio.sleep(0.01)
            assert token.error is not None

    run(scenario)


def test_graceful_shutdown() -> None:
    async def scenario() -> None:
        core = SlowServer()
        app = create_http_app(core)
        server = NativeHttpServer(app, "127.0.0.1", 0, limits=LIMITS)
        await server.start()
        busy_r, busy_w = await asyncio.open_connection("127.0.0.1", server.port)
        busy_w.write(post(infer_body(9.0)))
        await asyncio.wait_for(core.started.wait(), 5)
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", server.port)
        idle_w.write(b"GET /v2/health/live HTTP/1.1\r\n\r\n")
        assert (await read_response(idle_r)).status == 200
        late_r, late_w = await asyncio.open_connection("127.0.0.1", server.port)
        late_w.write(b"GET /v2/health/live HTTP/1.1\r\n")  # a request on its way
        await asyncio.sleep(0.05)
        stopping = asyncio.ensure_future(server.shutdown(5.0))
        await asyncio.sleep(0.1)
        assert await closed(idle_r, 1.0)  # the idle keep-alive connection is closed
        late_w.write(b"\r\n")  # its end arrives after the shutdown began
        reply = await read_response(late_r)
        assert reply.status == 503 and reply.headers["connection"] == "close"
        try:
            await asyncio.open_connection("127.0.0.1", server.port)
            raise AssertionError("the listener still accepts")
        except OSError:
            pass
        core.gate.set()  # the request in flight finishes
        reply = await read_response(busy_r)
        assert reply.status == 200 and reply.headers["connection"] == "close"
        assert out_values(reply) == [9.0] * 4
        await asyncio.wait_for(stopping, 5)
        assert not server.connections
        for w in (busy_w, idle_w, late_w):
            w.close()

    run(scenario)


def test_draining_responses_say_connection_close() -> None:
    async def scenario() -> None:
        draining = False
        app = create_http_app(FakeServer())
        server = NativeHttpServer(app, "127.0.0.1", 0, limits=LIMITS, draining=lambda: draining)
        await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(post(infer_body(1.0)))
        assert "connection" not in (await read_response(reader)).headers
        draining = True
        writer.write(post(infer_body(1.0)))
        assert (await read_response(reader)).headers["connection"] == "close"
        assert await closed(reader)
        writer.close()
        await server.shutdown(0.5)

    run(scenario)


def test_errors_map_as_in_the_asgi_app() -> None:
    async def scenario() -> None:
        async with serving() as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            cases = [
                (post(infer_body(), "/v2/models/other/infer"), 503, "not ready"),
                (post(infer_body(), "/v2/models/boom/infer"), 500, "kaboom"),
                (post(b"{nope"), 400, "parse"),
                (b"GET /v2/models/echo/infer HTTP/1.1\r\n\r\n", 405, "Method Not Allowed"),
                (
                    post(infer_body(), extra="inference-header-content-length: x\r\n"),
                    400,
                    "Inference-Header-Content-Length",
                ),
            ]
            for raw, status, words in cases:
                writer.write(raw)
                reply = await read_response(reader)
                assert reply.status == status, (raw[:40], reply.body)
                assert words.lower() in reply.json()["error"].lower()
            writer.close()

    run(scenario)


def test_absolute_form_targets_and_percent_encoded_names() -> None:
    async def scenario() -> None:
        async with serving() as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(post(infer_body(2.0), "http://example.com/v2/models/echo/infer"))
            assert out_values(await read_response(reader)) == [2.0] * 4
            writer.write(post(infer_body(3.0), "/v2/models/%65cho/versions/1/infer?x=1"))
            assert out_values(await read_response(reader)) == [3.0] * 4
            writer.write(b"GET http://example.com/v2/models/echo/ready HTTP/1.1\r\n\r\n")
            assert (await read_response(reader)).status == 200
            writer.close()

    run(scenario)


class TimedServer(FakeServer):
    """The echo model, appending a timing entry to a request that asked, as the core does."""

    async def infer(self, request: InferRequest) -> InferResponse:
        if request.timing is not None:
            request.timing.append(("echo", 120_000, 0, 1_500_000, 0, 2_000_000))
        return await super().infer(request)


def test_server_timing_header_on_small_large_json_and_binary_responses() -> None:
    expected = "queue;dur=0.120, compute_input;dur=0.000, compute_infer;dur=1.500, "
    expected += "compute_output;dur=0.000, total;dur=2.000"
    ask = "x-pdserve-server-timing: 1\r\n"

    async def scenario() -> None:
        async with serving(TimedServer()) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(post(infer_body(1.0), extra=ask))  # small JSON: one format
            reply = await read_response(reader)
            assert reply.headers["server-timing"] == expected
            assert reply.headers["content-type"] == "application/json"
            assert out_values(reply) == [1.0] * 4 and "connection" not in reply.headers
            writer.write(post(infer_body(1.0)))  # not asked: no header
            reply = await read_response(reader)
            assert "server-timing" not in reply.headers and out_values(reply) == [1.0] * 4
            arr = np.arange(8, dtype=np.float32)  # small binary
            body, json_size = client_request({"IN": arr}, True)
            writer.write(post(body, extra=f"inference-header-content-length: {json_size}\r\n{ask}"))
            reply = await read_response(reader)
            assert reply.headers["server-timing"] == expected
            length = int(reply.headers["inference-header-content-length"])
            assert np.array_equal(parse(reply.body, length).as_numpy("IN"), arr)
            big = infer_body(0.25, n=2000)  # large: gzip when accepted, still timed
            writer.write(post(big, extra=f"accept-encoding: gzip\r\n{ask}"))
            reply = await read_response(reader)
            assert reply.headers["server-timing"] == expected
            assert reply.headers["content-encoding"] == "gzip"
            assert json.loads(gzip.decompress(reply.body))["outputs"][0]["data"] == [0.25] * 2000
            writer.write(post(infer_body(2.0), extra=f"connection: close\r\n{ask}"))
            reply = await read_response(reader)
            assert reply.headers["server-timing"] == expected
            assert reply.headers["connection"] == "close" and out_values(reply) == [2.0] * 4
            assert await closed(reader)
            writer.close()

    timing_mod.state.enabled = True
    try:
        run(scenario)
    finally:
        timing_mod.state.enabled = False
