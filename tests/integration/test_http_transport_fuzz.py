"""Fuzzing the HTTP/1.1 transports' parser path with hypothesis: generated request
byte streams (valid and malformed request lines, headers, Content-Length and chunked
framings, pipelines of several requests, trailing garbage), cut into random TCP
segments, against a running pdserve of each ``--http-server`` kind.

Properties, for every stream:

* everything the server sends is well-formed HTTP/1.1 responses (a status line,
  headers, a body framed by its Content-Length or chunked coding), and then it either
  goes on serving or closes the connection;
* it never hangs: the connection is closed within the server's timeouts (0.5 s here)
  plus a margin after the last byte sent;
* malformed framing is the client's error: no status is 5xx (500 never; no 503 either,
  as the server is neither draining nor at its connection cap);
* the server stays up: a health check on a new connection after each example.

Examples are derandomized (the same ones every run) and bounded: ~20 s per transport.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ServerProcess, copy_models
from tests.http_wire import KINDS, Conn, WireError, health, start_kind

TIMEOUT = 0.5
#: After the last byte, the connection must be closed within this many seconds.
BOUND = TIMEOUT + 6.0
EXAMPLES = 300

_TINY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}
).encode()


@pytest.fixture(scope="module", params=KINDS)
def fuzz_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A pdserve with short timeouts and small limits, on transport ``request.param``."""
    root = tmp_path_factory.mktemp(f"fuzz_{request.param}")
    proc = start_kind(
        request.param,
        copy_models(root / "repo", "tiny"),
        root / "pdserve.log",
        "--http-header-timeout-secs",
        str(TIMEOUT),
        "--http-body-timeout-secs",
        str(TIMEOUT),
        "--http-idle-timeout-secs",
        str(TIMEOUT),
        "--http-max-header-bytes",
        "4096",
        "--http-max-header-count",
        "16",
        "--max-request-bytes",
        "65536",
    )
    yield proc
    proc.stop()


# -- request byte streams --------------------------------------------------------------------

_junk = st.binary(max_size=12)
_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=255), max_size=16).map(
    lambda s: s.encode("latin-1")
)

GOOD_METHODS = [b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS"]
BAD_METHODS = [b"get", b"", b"P OST", b"\x00GET", b"GET\t", b"CONNECT", b"PRI"]
GOOD_PATHS = [
    b"/v2/health/live",
    b"/v2/health/ready",
    b"/v2",
    b"/v2/models/tiny",
    b"/v2/models/tiny/config",
    b"/v2/models/tiny/ready",
    b"/v2/models/tiny/infer",
    b"/v2/models/tiny/versions/1/infer",
    b"/v2/models/nope/infer",
    b"/v2/models/stats",
    b"/nowhere",
]
ROUTES = [
    (b"POST", b"/v2/models/tiny/infer"),
    (b"POST", b"/v2/models/tiny/infer"),
    (b"POST", b"/v2/models/tiny/versions/1/infer"),
    (b"POST", b"/v2/models/nope/infer"),
    (b"GET", b"/v2/health/live"),
    (b"GET", b"/v2/models/tiny"),
    (b"GET", b"/v2/models/stats"),
    (b"POST", b"/v2/repository/index"),
]
BAD_PATHS = [b"*", b"", b"/%zz", b"/v2/models/tiny/infer?x=1#f", b"http://h/v2", b"//", b"/a b"]
GOOD_VERSIONS = [b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]
BAD_VERSIONS = [b"HTTP/1.2", b"HTTP/2.0", b"HTTP/1", b"http/1.1", b"HTTP/1.1 ", b"", b"HTTP/x"]
GOOD_HEADERS = [
    b"Accept: */*",
    b"Content-Type: application/json",
    b"X-A: x",
    b"Connection: keep-alive",
    b"Accept-Encoding: gzip",
    b"Expect: 100-continue",
    b"User-Agent: fuzz",
]
BAD_HEADER_NAMES = [b"Bad Name", b"", b"X\x00", b"X:Y", b" Host", b"Content-Length ", b"\xff"]
BAD_HEADER_VALUES = [b"a\x00b", b"a\rb", b"\x7f", b"\xff\xfe"]
CODINGS = [b"Content-Encoding: gzip", b"Content-Encoding: deflate", b"Content-Encoding: br"]


def _chunked(draw: st.DrawFn, content: bytes) -> bytes:
    pieces = []
    pos = 0
    while pos < len(content):
        n = draw(st.integers(1, max(1, len(content) - pos)))
        pieces.append(content[pos : pos + n])
        pos += n
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


@st.composite
def framing(draw: st.DrawFn, broken: bool) -> tuple[list[bytes], bytes]:
    """Framing headers and body bytes. Well-formed: none, Content-Length or chunked.
    Broken: a wrong or malformed Content-Length, malformed chunks, both framings, or
    a Transfer-Encoding other than chunked."""
    content = draw(
        st.sampled_from([_TINY, _TINY, b"", b"{", b"{}", b'{"inputs": 3}'])
        if not broken
        else st.one_of(st.sampled_from([_TINY, b"{}"]), _junk)
    )
    if not broken:
        kind = draw(st.sampled_from(["none", "cl", "cl", "chunked"]))
        if kind == "none":
            return [], b""
        if kind == "cl":
            return [b"Content-Length: %d" % len(content)], content
        return [b"Transfer-Encoding: chunked"], _chunked(draw, content)
    kind = draw(st.sampled_from(["cl_short", "cl_bad", "chunked_bad", "both", "te_other"]))
    if kind == "cl_short":  # fewer bytes than declared: the body timeout answers
        return [b"Content-Length: %d" % (len(content) + draw(st.integers(1, 5)))], content
    if kind == "cl_bad":
        value = draw(
            st.sampled_from(
                [b"-1", b"abc", b"99999999999999999999999", b"1, 1", b"", b"+5", b"0x10", b"1 2"]
            )
        )
        return [b"Content-Length: " + value], content
    chunks = _chunked(draw, content)
    if kind == "both":
        return [b"Transfer-Encoding: chunked", b"Content-Length: %d" % len(chunks)], chunks
    if kind == "te_other":
        te = draw(st.sampled_from([b"gzip", b"gzip, chunked", b"chunked, gzip", b"identity"]))
        return [b"Transfer-Encoding: " + te], chunks
    bad = draw(
        st.sampled_from(
            [
                b"zz\r\nabc\r\n0\r\n\r\n",
                b"3\r\nabcdef\r\n0\r\n\r\n",
                b"3\r\nabc0\r\n\r\n",
                b"ffffffffffffffffffff\r\nab\r\n",
                b"-1\r\n\r\n",
                b"3 ;\r\nabc\r\n0\r\n\r\n",
                b"0\r\nTrailer\r\n\r\n",
                b"3\nabc\n0\n\n",
                chunks[: max(0, len(chunks) - 3)],
            ]
        )
    )
    return [b"Transfer-Encoding: chunked"], bad


@st.composite
def requests(draw: st.DrawFn, last: bool = False) -> tuple[bytes, bool, bool]:
    """One request: well-formed most of the time, else with one part broken. Returns
    its bytes, whether it is well-formed, and whether it ends the connection (HTTP/1.0
    or ``Connection: close``)."""
    broken = draw(
        st.sampled_from(
            [None] * 5 + ["method", "path", "version", "eol", "header", "framing", "random"]
        )
    )
    if broken == "random":
        return draw(st.binary(min_size=1, max_size=60)), False, False
    method, path = draw(st.sampled_from(ROUTES))
    if draw(st.integers(0, 5)) == 0:  # any method on any path
        method, path = draw(st.sampled_from(GOOD_METHODS)), draw(st.sampled_from(GOOD_PATHS))
    if broken == "method":
        method = draw(st.one_of(st.sampled_from(BAD_METHODS), _text))
    if broken == "path":
        path = draw(st.sampled_from(BAD_PATHS))
    if broken == "path" and draw(st.booleans()):
        path = b"/" + draw(_text)
    version = draw(st.sampled_from(BAD_VERSIONS if broken == "version" else GOOD_VERSIONS))
    eol = draw(st.sampled_from([b"\n", b"\r", b"\r\r\n"])) if broken == "eol" else b"\r\n"
    headers = [b"Host: x"] if draw(st.integers(0, 4)) else []
    headers += draw(st.lists(st.sampled_from(GOOD_HEADERS), max_size=3))
    if draw(st.integers(0, 7)) == 0:
        headers.append(draw(st.sampled_from(CODINGS)))
    if broken == "header":
        name = draw(st.one_of(st.sampled_from(BAD_HEADER_NAMES), _text))
        value = draw(st.one_of(st.sampled_from(BAD_HEADER_VALUES), _text))
        headers.append(name + b": " + value)
    framed, body = draw(framing(broken == "framing"))
    headers += framed
    closes = version == b"HTTP/1.0"
    if last and draw(st.booleans()):
        headers.append(b"Connection: close")
        closes = True
    headers = draw(st.permutations(headers))
    line = method + b" " + path + b" " + version + eol
    return line + b"".join(h + eol for h in headers) + eol + body, broken is None, closes


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[bytes], int]:
    """A pipeline of 1-3 requests and maybe trailing garbage, cut into TCP segments;
    and how many well-formed requests lead it (each is owed a response)."""
    n = draw(st.integers(1, 3))
    reqs = [draw(requests(last=i == n - 1)) for i in range(n)]
    data = b"".join(r[0] for r in reqs)
    owed = 0
    for _, ok, closes in reqs:
        if not ok:
            break
        owed += 1
        if closes:
            break
    if draw(st.integers(0, 5)) == 0:
        data += draw(st.binary(min_size=1, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=4, unique=True)))
    segments = []
    prev = 0
    for c in cuts:
        if prev < c < len(data):
            segments.append(data[prev:c])
            prev = c
    segments.append(data[prev:])
    return segments, owed


# -- the property ------------------------------------------------------------------------------


def _check_stream(server: ServerProcess, segments: list[bytes], owed: int) -> None:
    with Conn(server.http_port, BOUND) as c:
        try:
            for seg in segments:
                c.send(seg)
                time.sleep(0.002)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused and closed early: what it sent is still checked
        statuses = []
        start = time.monotonic()
        while True:
            try:
                r = c.read_response()
            except TimeoutError:
                raise AssertionError(
                    f"no answer and no close within {BOUND} s; statuses so far {statuses}"
                ) from None
            except WireError as e:
                raise AssertionError(f"{e}; statuses so far {statuses}") from None
            if r is None:
                break
            assert r.version == "1.1", r.raw_head
            statuses.append(r.status)
            assert r.status < 500, (r.status, r.body[:300], statuses)
            assert time.monotonic() - start < 3 * BOUND, "the connection is never closed"
    # The well-formed requests before a bad one are all answered (before it is).
    assert len(statuses) >= owed, (owed, statuses)
    assert server.proc.poll() is None, server.log()[-3000:]
    assert health(server.http_port) == 200


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(stream=streams())
def test_fuzzed_request_streams(
    fuzz_server: ServerProcess, stream: tuple[list[bytes], int]
) -> None:
    _check_stream(fuzz_server, *stream)


def test_fuzz_server_still_serves_inference(fuzz_server: ServerProcess) -> None:
    """After the fuzzing, a real inference on a new connection still works."""
    with Conn(fuzz_server.http_port) as c:
        c.send(
            b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (len(_TINY), _TINY)
        )
        r = c.expect_response()
        assert r.status == 200
        assert r.json()["outputs"][0]["shape"] == [1, 64]
    with socket.create_connection(("127.0.0.1", fuzz_server.http_port), timeout=5):
        pass
