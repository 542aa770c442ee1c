"""The HTTP/1.1 transports (``--http-server native``: frontends/http/native.py, and
``--http-server asgi``: frontends/http/server.py on uvicorn) as a client sees them,
over raw sockets against a real pdserve: every safety behaviour of issue 11 point 1,
each test run on both transports.

The module's server runs with short timeouts (1 s for headers and bodies, 2 s idle),
small header limits, a 1 MiB body limit and a cap of 12 connections, so that each
limit is reached in seconds.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import shutil
import signal
import socket
import subprocess
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import ROOT, ServerProcess, copy_models
from tests.goldens import tiny_reference
from tests.http_wire import (
    KINDS,
    Conn,
    chunked,
    health,
    request,
    rss_bytes,
    start_kind,
    tiny_body,
    tiny_output,
)

HEADER_BYTES = 8192
HEADER_COUNT = 20
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
IDLE_TIMEOUT = 2.0
MAX_CONNECTIONS = 12
MAX_BODY = 1 << 20
#: Slack on a loaded 2-core machine for "within the configured timeout".
MARGIN = 4.0

INFER = "/v2/models/tiny/infer"
STALL = "/v2/models/stalling/infer"
JSON_HEADERS = [("Content-Type", "application/json")]


def _x(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)


def _stall_body(seconds: float) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [seconds]}]}
    ).encode()


def _repo(root: Path) -> Path:
    repo = copy_models(root / "repo", "tiny")
    for name in ("stalling", "decoupled_repeat"):
        shutil.copytree(ROOT / "tests" / "data" / "python_models" / name, repo / name)
    return repo


@pytest.fixture(scope="module", params=KINDS)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A pdserve on transport ``request.param`` with the module's limits."""
    root = tmp_path_factory.mktemp(f"transport_{request.param}")
    proc = start_kind(
        request.param,
        _repo(root),
        root / "pdserve.log",
        "--http-max-header-bytes",
        str(HEADER_BYTES),
        "--http-max-header-count",
        str(HEADER_COUNT),
        "--http-header-timeout-secs",
        str(HEADER_TIMEOUT),
        "--http-body-timeout-secs",
        str(BODY_TIMEOUT),
        "--http-idle-timeout-secs",
        str(IDLE_TIMEOUT),
        "--http-max-connections",
        str(MAX_CONNECTIONS),
        "--max-request-bytes",
        str(MAX_BODY),
    )
    yield proc
    proc.stop()


@pytest.fixture
def kind(server: ServerProcess, request: pytest.FixtureRequest) -> str:
    """The transport the test's ``server`` runs."""
    return str(request.node.callspec.params["server"])


def _conn(server: ServerProcess, timeout: float = 15.0) -> Conn:
    return Conn(server.http_port, timeout)


def _assert_error(r: object, status: int, *words: str) -> None:
    from tests.http_wire import Response

    assert isinstance(r, Response), r
    assert r.status == status, (r.status, r.body[:300])
    assert r.header("content-type") == "application/json"
    message = r.json()["error"]
    for w in words:
        assert w in message, message


# -- keep-alive, Connection: close, HTTP/1.0 ----------------------------------------------


def test_keep_alive_serves_several_requests_then_connection_close(
    server: ServerProcess,
) -> None:
    with _conn(server) as c:
        for seed in range(4):
            x = _x(seed + 1, seed)
            c.send(request("POST", INFER, tiny_body(x), JSON_HEADERS))
            r = c.expect_response()
            assert r.version == "1.1" and not r.closes
            np.testing.assert_allclose(tiny_output(r), tiny_reference(x), rtol=1e-5, atol=1e-5)
        c.send(request("GET", "/v2/health/ready", headers=[("Connection", "close")]))
        r = c.expect_response()
        assert (r.status, r.body) == (200, b"")
        assert r.closes
        assert c.closed_within(MARGIN)


def test_http10_closes_after_the_response_unless_keep_alive(
    server: ServerProcess, kind: str
) -> None:
    x = _x(2, 7)
    with _conn(server) as c:
        c.send(request("POST", INFER, tiny_body(x), JSON_HEADERS, version="1.0"))
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )
        assert c.closed_within(MARGIN)
    with _conn(server) as c:
        for _ in range(3):
            c.send(request("GET", "/v2", headers=[("Connection", "keep-alive")], version="1.0"))
            r = c.expect_response()
            assert r.status == 200 and r.json()["name"] == "pdserve"
            assert not r.chunked  # an HTTP/1.0 client cannot read chunked
            if kind == "asgi":
                # uvicorn never keeps an HTTP/1.0 connection alive; it says so, as
                # RFC 9112 9.3 allows.
                assert r.closes and c.closed_within(MARGIN)
                return
        assert not c.closed_within(0.3)


def test_streamed_response_framing_follows_the_client_version(
    server: ServerProcess, kind: str
) -> None:
    """A response of unknown length (``generate_stream``'s server-sent events) is
    chunked for an HTTP/1.1 client, which keeps its connection, and delimited by the
    close for an HTTP/1.0 one (RFC 9112 6.1: no Transfer-Encoding to HTTP/1.0)."""
    body = json.dumps({"IN": [5, 6, 7]}).encode()
    path = "/v2/models/decoupled_repeat/generate_stream"
    for version in ("1.1", "1.0"):
        with _conn(server) as c:
            c.send(request("POST", path, body, JSON_HEADERS, version=version))
            r = c.expect_response()
            assert r.status == 200 and (r.header("content-type") or "").startswith(
                "text/event-stream"
            )
            events = [json.loads(e.removeprefix(b"data: ")) for e in r.body.split(b"\n\n") if e]
            assert [(e["OUT"], e["IDX"]) for e in events] == [(5, 0), (6, 1), (7, 2)]
            if version == "1.1":
                assert r.chunked and not r.closes
                c.send(request("GET", "/v2/health/live"))
                assert c.expect_response().status == 200
            else:
                if kind == "asgi" and r.chunked:
                    pytest.xfail("uvicorn chunks a response of unknown length to HTTP/1.0")
                assert not r.chunked and r.header("transfer-encoding") is None
                assert r.header("content-length") is None and c.eof


# -- pipelining ----------------------------------------------------------------------------


def test_pipelined_requests_are_answered_in_order(server: ServerProcess) -> None:
    xs = [_x(i + 1, 100 + i) for i in range(6)]
    wire = [request("POST", STALL, _stall_body(0.3), JSON_HEADERS)]  # slow first
    wire += [request("POST", INFER, tiny_body(x), JSON_HEADERS) for x in xs[:3]]
    wire.append(request("GET", "/v2/models/tiny"))
    wire += [request("POST", INFER, tiny_body(x), JSON_HEADERS) for x in xs[3:]]
    with _conn(server) as c:
        c.send(b"".join(wire))
        r = c.expect_response()
        assert r.status == 200 and r.json()["outputs"][0]["data"] == [pytest.approx(0.3)]
        for x in xs[:3]:
            np.testing.assert_allclose(
                tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
            )
        meta = c.expect_response()
        assert meta.status == 200 and meta.json()["name"] == "tiny"
        for x in xs[3:]:
            np.testing.assert_allclose(
                tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
            )
        # Byte by byte, the same pipeline is answered the same way.
        c.send(request("GET", "/v2/health/live") + request("GET", "/v2/models/tiny/ready"))
        assert c.expect_response().status == 200
        assert c.expect_response().status == 200


def test_pipelined_requests_wait_behind_a_slow_one_without_timing_out(
    server: ServerProcess,
) -> None:
    """Requests pipelined behind one that takes 2.5 s (longer than the header, body
    and idle timeouts) are complete: they wait their turn and are answered, not 408."""
    x = _x(2, 21)
    with _conn(server) as c:
        c.send(
            request("POST", STALL, _stall_body(2.5), JSON_HEADERS)
            + request("GET", "/v2/health/live")
            + request("POST", INFER, tiny_body(x), JSON_HEADERS)
        )
        r = c.expect_response()
        assert r.status == 200 and r.json()["outputs"][0]["data"] == [2.5]
        assert c.expect_response().status == 200
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )
    # Expect: 100-continue behind the slow one: the 100, then the answer, in turn.
    with _conn(server) as c:
        body = tiny_body(x)
        c.send(
            request("POST", STALL, _stall_body(1.5), JSON_HEADERS)
            + request("POST", INFER, body, [("Expect", "100-continue")])[: -len(body)]
        )
        first = c.expect_response()
        assert first.status == 200 and first.json()["model_name"] == "stalling"
        c.settimeout(5)
        head = c.read_head()
        assert head is not None and head.status == 100, head
        c.send(body)
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )


def test_a_client_leaving_behind_a_pipeline_logs_no_traceback(server: ServerProcess) -> None:
    """The client sends a slow request with another pipelined behind it and closes the
    connection before either is answered: the server logs no traceback (under uvicorn
    the answer's own write then failed, and the app tried a second response start) and
    goes on serving."""
    before = len(server.log())
    with _conn(server) as c:
        c.send(
            request("POST", STALL, _stall_body(0.5), JSON_HEADERS)
            + request("POST", INFER, tiny_body(_x(1, 5)), JSON_HEADERS)
        )
        time.sleep(0.1)
    time.sleep(1.5)  # the slow request ends and its answer meets the closed connection
    x = _x(1, 6)
    with _conn(server) as c:
        c.send(request("POST", INFER, tiny_body(x), JSON_HEADERS))
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )
    logged = server.log()[before:]
    assert "Traceback" not in logged, logged[-3000:]
    # nor an error line: uvicorn's "ASGI callable returned without completing response"
    # when the app, whose answer's write failed, returned without ending the response
    assert "ASGI callable" not in logged and " E " not in logged, logged[-3000:]


def test_a_client_leaving_a_stream_logs_no_error(server: ServerProcess) -> None:
    """The client of a ``generate_stream`` (served through the ASGI app on both
    transports) closes its connection before the model's first response: the app
    answers nothing, and the server logs no error for it (the native transport logged
    "error serving POST" with "the application sent no response" per such client)."""
    before = len(server.log())
    body = json.dumps({"IN": [1, 2, 3], "parameters": {"delay_ms": 300}}).encode()
    path = "/v2/models/decoupled_repeat/generate_stream"
    for _ in range(2):
        with _conn(server) as c:
            c.send(request("POST", path, body, JSON_HEADERS))
            time.sleep(0.1)
    time.sleep(1.5)  # the model's responses meet the closed connections
    x = _x(1, 7)
    with _conn(server) as c:
        c.send(request("POST", INFER, tiny_body(x), JSON_HEADERS))
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )
    logged = server.log()[before:]
    assert "no response" not in logged and " E " not in logged, logged[-3000:]
    assert "ASGI callable" not in logged and "Traceback" not in logged, logged[-3000:]


def test_bad_request_in_a_pipeline_is_answered_after_the_good_ones(
    server: ServerProcess,
) -> None:
    x = _x(1, 5)
    wire = (
        request("POST", STALL, _stall_body(0.3), JSON_HEADERS)
        + request("POST", INFER, tiny_body(x), JSON_HEADERS)
        + b"NOT HTTP AT ALL\r\n\r\n"
        + request("GET", "/v2/health/live")
    )
    with _conn(server) as c:
        c.send(wire)
        first = c.expect_response()
        assert first.status == 200 and first.json()["model_name"] == "stalling"
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )
        bad = c.expect_response()
        assert bad.status == 400, (bad.status, bad.body)
        assert bad.closes
        assert c.read_response() is None  # nothing after it: the request behind is not read


# -- request bodies --------------------------------------------------------------------------


def test_chunked_request_bodies(server: ServerProcess) -> None:
    x = _x(3, 11)
    body = tiny_body(x)
    with _conn(server) as c:
        for sizes in ([len(body)], [1, 7, 300], [4096]):
            c.send(
                request(
                    "POST",
                    INFER,
                    chunked(body, sizes),
                    [*JSON_HEADERS, ("Transfer-Encoding", "chunked")],
                    content_length=False,
                )
            )
            np.testing.assert_allclose(
                tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
            )
        # Chunk extensions and a trailer are allowed (RFC 9112 7.1).
        wire = b"%x;ext=1\r\n%s\r\n0\r\nX-Trailer: t\r\n\r\n" % (len(body), body)
        c.send(
            request("POST", INFER, wire, [("Transfer-Encoding", "chunked")], content_length=False)
        )
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )


def test_content_length_body_sent_in_pieces(server: ServerProcess) -> None:
    x = _x(4, 12)
    body = tiny_body(x)
    with _conn(server) as c:
        c.send(request("POST", INFER, body, JSON_HEADERS)[: -len(body)])
        for i in range(0, len(body), 1000):
            c.send(body[i : i + 1000])
            time.sleep(0.01)
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )


def test_body_over_the_limit_is_413(server: ServerProcess) -> None:
    # Declared: refused before the body is read.
    with _conn(server) as c:
        c.send(request("POST", INFER, None, [("Content-Length", str(MAX_BODY + 1))]))
        r = c.expect_response()
        _assert_error(r, 413, "exceeds the limit")
        assert r.closes and c.closed_within(MARGIN)
    # Chunked: refused once more than the limit has arrived.
    with _conn(server) as c:
        c.send(request("POST", INFER, None, [("Transfer-Encoding", "chunked")]))
        piece = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
        try:
            for _ in range(MAX_BODY // 65536 + 4):
                c.send(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        r = c.expect_response()
        _assert_error(r, 413, "exceeds the limit")
        assert r.closes and c.closed_within(MARGIN)
    assert health(server.http_port) == 200


def test_absurd_chunk_size_is_refused_at_once(server: ServerProcess) -> None:
    """A chunk whose size line declares more than the body limit is answered 413 as
    soon as the line (or enough of its digits) arrives, not after the body timeout
    (which would answer 408); a size that overflows 64 bits, or is not hex, is 400.
    Each refusal closes the connection; the server carries on."""
    head = request("POST", INFER, None, [*JSON_HEADERS, ("Transfer-Encoding", "chunked")])
    first = b"%x\r\n%s\r\n" % (100, b" " * 100)
    cases: list[tuple[list[bytes], int, str]] = [
        ([head + b"7FFFFFFFFFFFFFFF\r\n"], 413, "exceeds the limit"),
        ([head + b"FFFFFFFFFFFFFFFF;ext=1\r\n"], 413, "exceeds the limit"),
        ([head + b"%x\r\n" % (MAX_BODY + 1)], 413, "exceeds the limit"),
        ([head, b"%x\r\n" % (MAX_BODY + 1)], 413, "exceeds the limit"),
        # a later chunk, alone in its packet, that would take the body past the limit
        ([head + first, b"%x\r\n" % (MAX_BODY - 50)], 413, "exceeds the limit"),
        # the line in pieces; its digits alone already say too much
        ([head, b"7FFF", b"FFFFFFFF"], 413, "exceeds the limit"),
        ([head + first + b"00", b"7FFFFFFFFFFFFFFF"], 413, "exceeds the limit"),
        ([head + b"1FFFFFFFFFFFFFFFFF\r\n"], 400, "hunk size"),
        ([head + b"zz\r\n"], 400, ""),
    ]
    for pieces, status, words in cases:
        with _conn(server) as c:
            start = time.monotonic()
            try:
                for piece in pieces:
                    c.send(piece)
                    time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                pass
            r = c.expect_response()
            _assert_error(r, status, words)
            assert time.monotonic() - start < BODY_TIMEOUT + MARGIN
            assert r.closes and c.closed_within(MARGIN), pieces
    # Sizes within the limit, sent a byte at a time, with leading zeros, an extension
    # and a trailer field whose name is all hex digits, are served.
    x = _x(2, 14)
    body = tiny_body(x)
    wire = b"000%x;n=FFFFFFFFFFFFFFFF\r\n%s\r\n0\r\nABCDEF0123456789ABCDEF: 1\r\n\r\n" % (
        len(body),
        body,
    )
    with _conn(server) as c:
        c.send(head)
        for i in range(0, 40):
            c.send(wire[i : i + 1])
            time.sleep(0.002)
        rest = wire[40:]
        c.send(rest[: -len(b"ABCDEF0123456789ABCDEF: 1\r\n\r\n")])
        for part in (b"ABCDEF0123456789ABCDEF", b": 1\r\n", b"\r\n"):
            time.sleep(0.05)
            c.send(part)
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )
    assert health(server.http_port) == 200


def test_expect_100_continue(server: ServerProcess) -> None:
    x = _x(2, 13)
    body = tiny_body(x)
    with _conn(server) as c:
        c.send(
            request("POST", INFER, body, [*JSON_HEADERS, ("Expect", "100-continue")])[: -len(body)]
        )
        c.settimeout(5)
        interim = c.read_head()
        assert interim is not None and interim.status == 100, interim
        assert c.buf == b""  # nothing but the interim response before the body is sent
        c.settimeout(15)
        c.send(body)
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )
    # Over the limit: the final 413 comes instead of the 100.
    with _conn(server) as c:
        c.send(
            request(
                "POST",
                INFER,
                None,
                [("Expect", "100-continue"), ("Content-Length", str(MAX_BODY * 2))],
            )
        )
        head = c.read_head()
        assert head is not None and head.status == 413, head
        assert head.closes


def test_gzip_and_deflate_request_bodies(server: ServerProcess) -> None:
    x = _x(5, 14)
    body = tiny_body(x)
    codings = {"gzip": gzip.compress(body), "deflate": zlib.compress(body)}
    with _conn(server) as c:
        for name, data in codings.items():
            c.send(request("POST", INFER, data, [*JSON_HEADERS, ("Content-Encoding", name)]))
            np.testing.assert_allclose(
                tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
            )
        # Corrupt data is the client's error, and the connection carries on.
        c.send(request("POST", INFER, b"\x1f\x8bnot gzip", [("Content-Encoding", "gzip")]))
        _assert_error(c.expect_response(), 400)
        c.send(request("POST", INFER, body, [("Content-Encoding", "br")]))
        _assert_error(c.expect_response(), 415, "br")
        c.send(request("GET", "/v2/health/live"))
        assert c.expect_response().status == 200


def test_accept_encoding_gzip_responses(server: ServerProcess) -> None:
    x = _x(32, 15)
    with _conn(server) as c:
        c.send(request("POST", INFER, tiny_body(x), [("Accept-Encoding", "gzip")]))
        r = c.expect_response()
        assert r.status == 200
        assert r.header("content-encoding") == "gzip", r.headers
        assert r.header("vary") == "accept-encoding", r.headers
        assert int(r.header("content-length") or -1) == len(r.body)
        r.body = gzip.decompress(r.body)
        np.testing.assert_allclose(tiny_output(r), tiny_reference(x), rtol=1e-5, atol=1e-5)
        # Without Accept-Encoding the same response is identity-coded, and says Vary.
        c.send(request("POST", INFER, tiny_body(x)))
        plain = c.expect_response()
        assert plain.header("content-encoding") is None
        assert plain.header("vary") == "accept-encoding", plain.headers
        assert plain.body == r.body
        # Under 1 KiB: never compressed (q=0 refuses gzip too).
        c.send(request("POST", INFER, tiny_body(x[:1]), [("Accept-Encoding", "gzip, br")]))
        small = c.expect_response()
        assert small.header("content-encoding") is None and small.header("vary") is None
        assert len(small.body) < 1024
        c.send(request("POST", INFER, tiny_body(x), [("Accept-Encoding", "gzip;q=0")]))
        assert c.expect_response().header("content-encoding") is None


# -- header limits and timeouts -----------------------------------------------------------


def test_request_line_and_headers_over_the_limits_get_431(server: ServerProcess) -> None:
    cases = {
        "long request line": request("GET", "/v2/health/live?" + "q" * HEADER_BYTES),
        "long header": request("GET", "/v2/health/live", headers=[("X-Big", "b" * HEADER_BYTES)]),
        "many headers": request(
            "GET", "/v2/health/live", headers=[(f"X-H{i}", "v") for i in range(HEADER_COUNT + 1)]
        ),
    }
    for name, wire in cases.items():
        with _conn(server) as c:
            c.send(wire)
            r = c.expect_response()
            assert r.status == 431, (name, r.status, r.body)
            assert r.closes, name
            assert c.closed_within(MARGIN), name
    # At the limits: served.
    with _conn(server) as c:
        c.send(
            request(
                "GET",
                "/v2/health/live",
                headers=[(f"X-H{i}", "v") for i in range(HEADER_COUNT - 1)],
            )
        )
        assert c.expect_response().status == 200


def _drip_until_answered(c: Conn, drip: bytes, every: float, limit: float) -> tuple[bytes, float]:
    """Send ``drip`` every ``every`` s until the server answers or closes; the bytes
    it sent and the seconds that took."""
    start = time.monotonic()
    c.settimeout(every)
    got = b""
    while time.monotonic() - start < limit:
        try:
            c.send(drip)
        except (BrokenPipeError, ConnectionResetError):
            break
        try:
            chunk = c.sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        got += chunk
        if b"\r\n\r\n" in got:
            break
    return got, time.monotonic() - start


def test_slow_headers_get_408_within_the_header_timeout(server: ServerProcess) -> None:
    with _conn(server) as c:
        c.send(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\n")
        got, elapsed = _drip_until_answered(c, b"X", 0.2, HEADER_TIMEOUT + MARGIN)
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert 0.8 * HEADER_TIMEOUT < elapsed < HEADER_TIMEOUT + MARGIN, elapsed
        c.buf = got
        r = c.read_response()
        assert r is not None and r.closes
        assert c.closed_within(MARGIN)


def test_stalled_body_gets_408_within_the_body_timeout(server: ServerProcess) -> None:
    body = tiny_body(_x(2, 16))
    for framing in ("content-length", "chunked"):
        with _conn(server) as c:
            if framing == "chunked":
                head = request("POST", INFER, None, [("Transfer-Encoding", "chunked")])
                c.send(head + b"%x\r\n%s\r\n" % (100, body[:100]))
            else:
                c.send(request("POST", INFER, body)[: -len(body) + 100])
            start = time.monotonic()
            c.settimeout(BODY_TIMEOUT + MARGIN)
            r = c.expect_response()
            elapsed = time.monotonic() - start
            _assert_error(r, 408)
            assert r.closes and c.closed_within(MARGIN)
            assert 0.8 * BODY_TIMEOUT < elapsed < BODY_TIMEOUT + MARGIN, (framing, elapsed)


def test_body_timeout_is_between_pieces(server: ServerProcess) -> None:
    """``--http-body-timeout-secs`` bounds each wait for the next piece of a body (as
    nginx's ``client_body_timeout``), not the whole body: a body sent in pieces 0.4 s
    apart, 3.2 s in all (over the 1 s timeout), at ~800 bytes/s (over the 500 bytes/s
    of ``--http-body-min-bytes-per-sec``), is read to its end and answered."""
    x = _x(2, 17)
    body = tiny_body(x)
    with _conn(server) as c:
        c.send(request("POST", INFER, body, JSON_HEADERS)[: -len(body)])
        step = -(-len(body) // 8)
        for i in range(0, len(body), step):
            time.sleep(0.4)
            c.send(body[i : i + step])
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )


def test_body_dripped_within_the_timeout_gets_408_at_the_minimum_rate(
    server: ServerProcess,
) -> None:
    """A body that declares 100 KB and drips one byte every 0.5 s (each piece within
    the 1 s body timeout) is refused 408 soon after the first body timeout, once it is
    below ``--http-body-min-bytes-per-sec`` (500 bytes/s by default, as Apache's
    mod_reqtimeout ``MinRate``): it cannot hold the connection until the size limit."""
    for framing in ("content-length", "chunked"):
        with _conn(server) as c:
            if framing == "chunked":
                c.send(request("POST", INFER, None, [("Transfer-Encoding", "chunked")]))
                drip = b"1\r\n \r\n"
            else:
                c.send(request("POST", INFER, None, [("Content-Length", "100000")]))
                drip = b" "
            got, elapsed = _drip_until_answered(c, drip, 0.5, BODY_TIMEOUT + 2 * MARGIN)
            assert got.startswith(b"HTTP/1.1 408 "), (framing, got[:300])
            assert b"too slowly" in got, got
            assert 0.8 * BODY_TIMEOUT < elapsed < BODY_TIMEOUT + MARGIN, (framing, elapsed)
            c.buf = got
            r = c.read_response()
            assert r is not None and r.closes
            assert c.closed_within(MARGIN)


def test_upgrade_header_is_ignored(server: ServerProcess) -> None:
    """pdserve speaks only HTTP/1.1 here: a request asking to upgrade (WebSocket, or
    h2c as ``curl --http2`` asks on every cleartext request) is served as HTTP/1.1
    (RFC 9110 7.8 lets a server ignore Upgrade), its body included, whether framed by
    Content-Length or chunked, sent at once or in pieces; the connection carries on
    with the requests after it."""
    x = _x(1, 19)
    body = tiny_body(x)
    upgrades = {
        "websocket": [
            ("Connection", "Upgrade"),
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ("Sec-WebSocket-Version", "13"),
        ],
        "h2c": [
            ("Connection", "Upgrade, HTTP2-Settings"),
            ("Upgrade", "h2c"),
            ("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA"),
        ],
    }
    for name, headers in upgrades.items():
        with _conn(server) as c:
            c.send(request("GET", "/v2/health/live", headers=headers))
            r = c.expect_response()
            assert (r.status, r.body, r.closes) == (200, b"", False), (name, r.status, r.body)
            c.send(request("POST", INFER, body, headers))
            r = c.expect_response()
            assert r.status == 200, (name, r.status, r.body)
            np.testing.assert_allclose(tiny_output(r), tiny_reference(x), rtol=1e-5, atol=1e-5)
            # Chunked, pipelined with the request after it, in one piece.
            wire = request(
                "POST",
                INFER,
                chunked(body, [100, len(body) - 100]),
                [*headers, ("Transfer-Encoding", "chunked")],
                content_length=False,
            )
            c.send(wire + request("GET", "/v2/models/tiny"))
            np.testing.assert_allclose(
                tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
            )
            meta = c.expect_response()
            assert meta.status == 200 and meta.json()["name"] == "tiny", (name, meta.body)
            # The head alone first, then the body in pieces.
            wire = request("POST", INFER, body, headers)
            c.send(wire[: -len(body)])
            time.sleep(0.1)
            for i in range(0, len(body), 500):
                c.send(body[i : i + 500])
                time.sleep(0.02)
            r = c.expect_response()
            np.testing.assert_allclose(tiny_output(r), tiny_reference(x), rtol=1e-5, atol=1e-5)
            assert not r.closes and not c.closed_within(0.2)
    # Its body is limited as any other's, and a Transfer-Encoding that is not chunked
    # is refused as on any other request.
    up = upgrades["h2c"]
    with _conn(server) as c:
        c.send(request("POST", INFER, None, [*up, ("Content-Length", str(MAX_BODY + 1))]))
        r = c.expect_response()
        _assert_error(r, 413, "exceeds the limit")
        assert r.closes and c.closed_within(MARGIN)
    with _conn(server) as c:
        c.send(
            request("POST", INFER, body, [*up, ("Transfer-Encoding", "gzip")], content_length=False)
        )
        r = c.expect_response()
        _assert_error(r, 400, "Transfer-Encoding")
        assert r.closes and c.closed_within(MARGIN)


def test_curl_http2_request_is_served_as_http11(server: ServerProcess) -> None:
    """``curl --http2`` on a cleartext URL asks to upgrade to h2c (``Upgrade: h2c``,
    ``HTTP2-Settings``) with its POST body: it gets the HTTP/1.1 answer."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    x = _x(2, 22)
    out = subprocess.run(
        [
            curl,
            "-sS",
            "--http2",
            "-v",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            "@-",
            f"http://127.0.0.1:{server.http_port}{INFER}",
        ],
        input=tiny_body(x),
        capture_output=True,
        timeout=60,
        check=False,
    )
    if b"HTTP2 feature" in out.stderr or b"not support" in out.stderr:
        pytest.skip(f"this curl has no HTTP/2: {out.stderr[-200:]!r}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert b"Upgrade: h2c" in out.stderr, out.stderr[-2000:]  # curl did ask
    assert b"< HTTP/1.1 200" in out.stderr, out.stderr[-2000:]
    got = json.loads(out.stdout)["outputs"][0]
    np.testing.assert_allclose(
        np.asarray(got["data"], np.float32).reshape(got["shape"]),
        tiny_reference(x),
        rtol=1e-5,
        atol=1e-5,
    )


def test_absolute_form_target(server: ServerProcess) -> None:
    """RFC 9112 3.2.2: a server MUST accept a target in absolute form; a fragment is
    not part of the path."""
    x = _x(1, 20)
    with _conn(server) as c:
        c.send(request("GET", "http://127.0.0.1/v2/models/tiny?x=1"))
        r = c.expect_response()
        assert r.status == 200 and r.json()["name"] == "tiny", (r.status, r.body)
        c.send(request("POST", "http://127.0.0.1:1/v2/models/tiny/infer", tiny_body(x)))
        np.testing.assert_allclose(
            tiny_output(c.expect_response()), tiny_reference(x), rtol=1e-5, atol=1e-5
        )
        c.send(request("GET", "/v2/health/live#here"))
        assert c.expect_response().status == 200


def test_idle_keep_alive_is_closed_after_the_idle_timeout(server: ServerProcess) -> None:
    with _conn(server) as c:  # never sends a byte
        start = time.monotonic()
        assert c.closed_within(IDLE_TIMEOUT + MARGIN)
        assert 0.8 * IDLE_TIMEOUT < time.monotonic() - start
    with _conn(server) as c:
        for _ in range(3):  # each request restarts the clock
            c.send(request("GET", "/v2/health/live"))
            assert c.expect_response().status == 200
            time.sleep(IDLE_TIMEOUT / 2)
        start = time.monotonic()
        assert c.closed_within(IDLE_TIMEOUT + MARGIN)
        assert time.monotonic() - start > 0.8 * IDLE_TIMEOUT / 2


# -- connections -----------------------------------------------------------------------------


def test_connections_over_the_cap_get_503_and_close(server: ServerProcess) -> None:
    held: list[Conn] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            c = _conn(server)
            c.send(request("GET", "/v2/health/live"))
            assert c.expect_response().status == 200  # accepted and counted
            held.append(c)
        with _conn(server) as extra:
            try:
                extra.send(request("GET", "/v2/health/live"))
            except (BrokenPipeError, ConnectionResetError):
                pass
            r = extra.read_response()
            assert r is not None, "closed without the 503"
            _assert_error(r, 503, str(MAX_CONNECTIONS))
            assert r.closes and extra.closed_within(MARGIN)
        # The held ones are still served.
        held[0].send(request("GET", "/v2/health/ready"))
        assert held[0].expect_response().status == 200
    finally:
        for c in held:
            c.close()
    deadline = time.monotonic() + MARGIN
    while True:  # the closes reach the server: it serves new connections again
        try:
            if health(server.http_port) == 200:
                break
        except (AssertionError, OSError):
            pass
        assert time.monotonic() < deadline, "not served after the held connections closed"
        time.sleep(0.1)


def test_client_that_does_not_read_costs_bounded_memory(server: ServerProcess) -> None:
    """Pipelined requests for large responses (128 x 64 floats as JSON, ~150 KB each)
    from a client that never reads: the server stops reading from it instead of
    buffering responses (RSS stays within 64 MB of where it was, while 2000 such
    responses would be ~300 MB), and another client is served meanwhile."""
    x = _x(128, 18)
    one = request("POST", INFER, tiny_body(x), JSON_HEADERS)
    base = rss_bytes(server.proc.pid)
    sent = [0]
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)

    def push() -> None:
        try:
            for _ in range(2000):
                sock.sendall(one)
                sent[0] += len(one)
        except OSError:
            pass

    pusher = threading.Thread(target=push, daemon=True)
    pusher.start()
    try:
        time.sleep(3)
        peak = rss_bytes(server.proc.pid)
        with _conn(server) as other:
            start = time.monotonic()
            other.send(request("POST", INFER, tiny_body(x[:2]), JSON_HEADERS))
            np.testing.assert_allclose(
                tiny_output(other.expect_response()), tiny_reference(x[:2]), rtol=1e-5, atol=1e-5
            )
            assert time.monotonic() - start < MARGIN
        time.sleep(1)
        peak = max(peak, rss_bytes(server.proc.pid))
        assert pusher.is_alive(), "the server read all 2000 requests"
        assert sent[0] < 1000 * len(one), sent[0]
        assert peak - base < 64 << 20, (base, peak)
    finally:
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        pusher.join(10)
    assert health(server.http_port) == 200


# -- graceful shutdown -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_graceful_shutdown(kind: str, tmp_path: Path) -> None:
    """SIGTERM while a request is in flight: it completes; a request on an open
    keep-alive connection gets 503 and ``Connection: close``; idle keep-alives are
    closed; then new connections are refused."""
    srv = start_kind(kind, _repo(tmp_path), tmp_path / "pdserve.log", "--exit-timeout-secs", "20")
    try:
        port = srv.http_port
        busy, keep, idle = Conn(port, 30), Conn(port, 30), Conn(port, 30)
        for c in (keep, idle):
            c.send(request("GET", "/v2/health/live"))
            assert c.expect_response().status == 200
        busy.send(request("POST", STALL, _stall_body(3.0), JSON_HEADERS))
        time.sleep(0.5)  # it reaches the model
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        keep.send(request("POST", INFER, tiny_body(_x(1, 1)), JSON_HEADERS))
        r = keep.expect_response()
        assert r.status == 503, (r.status, r.body)
        assert r.closes and keep.closed_within(MARGIN)
        # A new connection during the drain: refused, or answered 503 and closed.
        try:
            with Conn(port, 10) as late:
                late.send(request("POST", INFER, tiny_body(_x(1, 1)), JSON_HEADERS))
                r = late.read_response()
                assert r is None or (r.status == 503 and r.closes), r
        except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError):
            pass
        done = busy.expect_response()
        assert done.status == 200 and done.json()["outputs"][0]["data"] == [3.0]
        assert done.closes
        assert idle.closed_within(20), "idle keep-alive left open"
        assert srv.proc.wait(30) == 0, srv.log()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        for c in (busy, keep, idle):
            c.close()
    finally:
        srv.stop(signal.SIGKILL)


def test_body_timeout_does_not_run_while_the_server_stopped_reading(
    server: ServerProcess, kind: str
) -> None:
    """128 pipelined requests for large responses (~100 KB each, ~13 MB, more than
    the socket buffers hold) from a client that reads
    nothing for a while, then the head of one more request: the server stops reading
    (its write buffer is full), so the rest of that request cannot arrive; that is no
    slow client, and once the client reads, every request is answered. Before the fix
    the native transport answered the last one 408 after the body timeout (1 s)."""
    if kind != "native":
        pytest.skip("the native transport's write backpressure")
    x = _x(128, 21)
    one = request("POST", INFER, tiny_body(x), JSON_HEADERS)
    last = request("POST", INFER, tiny_body(x[:1]), JSON_HEADERS)
    cut = last.index(b"\r\n\r\n") + 10
    with _conn(server, timeout=30) as conn:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
        conn.send(one * 128 + last[:cut])
        time.sleep(BODY_TIMEOUT + 2)
        conn.send(last[cut:])
        for _ in range(128):
            r = conn.read_response()
            assert r is not None and r.status == 200, r
        r = conn.read_response()
        assert r is not None and r.status == 200, (r.status, r.body[:200]) if r else r
        np.testing.assert_allclose(tiny_output(r), tiny_reference(x[:1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transport", ["native", "asgi"])
def test_answered_requests_leave_no_cyclic_garbage(transport: str, tmp_path: Path) -> None:
    """A real server in this process answers 64 V2 JSON inferences (8 client threads,
    one connection per request, through the dynamic batcher): none of its objects is
    left in a reference cycle, so serving with the collector's thresholds raised
    (``settle_gc``) frees every finished request at once. (Both transports once left
    ~12-15 objects per request in cycles: ~20-30 µs of collector time per request.)"""
    import urllib.request

    from pdserve.frontends.http.app import create_http_app
    from pdserve.frontends.http.native import NativeHttpServer
    from pdserve.frontends.http.server import serve_http
    from tests.conftest import free_port
    from tests.cyclic import cyclic_garbage, tiny_batched

    row = np.arange(64, dtype=np.float32).reshape(1, 64)
    body = tiny_body(row)
    want = tiny_reference(row)

    async def start(server: Any) -> tuple[int, Any]:
        app = create_http_app(server)
        if transport == "native":
            http = NativeHttpServer(app, "127.0.0.1", 0)
            await http.start()

            async def stop_native() -> None:
                await http.shutdown(1.0)

            return http.port, stop_native
        port = free_port()
        uv = serve_http(app, "127.0.0.1", port)
        task = asyncio.ensure_future(uv.serve())
        while not uv.started:
            await asyncio.sleep(0.01)

        async def stop_asgi() -> None:
            uv.should_exit = True
            await task

        return port, stop_asgi

    def call(port: int, i: int) -> None:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v2/models/tiny/infer",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            out = json.load(r)["outputs"][0]
        got = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    assert cyclic_garbage(tiny_batched(tmp_path / "repo"), start, call) == {}
