"""Differential test of the HTTP transports: the same corpus of requests (inference
in JSON and binary, gzip/deflate bodies, client errors of every kind, unknown routes,
wrong methods, the metadata, statistics and repository routes) sent in the same order
to a ``--http-server native`` and an ``--http-server asgi`` pdserve on the same
repository must get the same status, the same body (JSON compared parsed, with
durations and timestamps zeroed; binary tensor data byte for byte) and the same
relevant headers.

Known, intended differences are not compared: ``Content-Encoding`` of responses (the
bodies are compared decoded), header order and case, and ``Content-Length`` where the
JSON is written differently (the parsed JSON must be equal).
"""

from __future__ import annotations

import gzip
import json
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.conftest import ServerProcess, copy_models
from tests.http_wire import Conn, Response, native_available, request, start_kind, tiny_body

MAX_BODY = 65536

#: Headers whose values must be the same on both transports (names lower-case).
COMPARED_HEADERS = (
    "content-type",
    "allow",
    "retry-after",
    "www-authenticate",
    "inference-header-content-length",
)


def _binary_infer(x: np.ndarray, binary_output: bool) -> tuple[bytes, list[tuple[str, str]]]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": binary_output}}],
        }
    ).encode()
    return header + x.tobytes(), [
        ("Inference-Header-Content-Length", str(len(header))),
        ("Content-Type", "application/octet-stream"),
    ]


def _corpus() -> list[tuple[str, bytes, bool]]:
    """(name, request bytes, is HEAD) in the order they are sent."""
    x1 = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    x3 = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    good = tiny_body(x3)
    infer = "/v2/models/tiny/infer"
    jh = [("Content-Type", "application/json")]
    bin_body, bin_headers = _binary_infer(x3, True)
    bin_body_json_out, bin_headers_json_out = _binary_infer(x1, False)

    def inp(**kw: Any) -> bytes:
        d = {"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}
        d.update(kw)
        return json.dumps({"inputs": [d]}).encode()

    c: list[tuple[str, bytes, bool]] = [
        ("server metadata", request("GET", "/v2"), False),
        ("live", request("GET", "/v2/health/live"), False),
        ("ready", request("GET", "/v2/health/ready"), False),
        ("live with query", request("GET", "/v2/health/live?x=1&y"), False),
        ("HEAD live", request("HEAD", "/v2/health/live"), True),
        ("model metadata", request("GET", "/v2/models/tiny"), False),
        ("version metadata", request("GET", "/v2/models/tiny/versions/2"), False),
        ("percent-encoded path", request("GET", "/v2/models/ti%6Ey"), False),
        ("model config", request("GET", "/v2/models/tiny/config"), False),
        ("model ready", request("GET", "/v2/models/tiny/ready"), False),
        ("unknown model metadata", request("GET", "/v2/models/nope"), False),
        ("unknown model ready", request("GET", "/v2/models/nope/ready"), False),
        ("unknown version", request("GET", "/v2/models/tiny/versions/9"), False),
        ("absolute-form target", request("GET", "http://127.0.0.1/v2/models/tiny?x=1"), False),
        ("fragment", request("GET", "/v2/health/live#f"), False),
        ("unknown route", request("GET", "/nope"), False),
        ("unknown v2 route", request("GET", "/v2/nope/deeper"), False),
        ("infer by GET", request("GET", infer), False),
        ("DELETE live", request("DELETE", "/v2/health/live"), False),
        ("PUT server metadata", request("PUT", "/v2", b"{}"), False),
        ("infer json", request("POST", infer, tiny_body(x1), jh), False),
        ("infer json 3 rows", request("POST", infer, good), False),
        (
            "infer with id and parameters",
            request(
                "POST",
                infer,
                json.dumps(
                    {
                        "id": "req-7",
                        "parameters": {"custom": 3},
                        "inputs": json.loads(good)["inputs"],
                        "outputs": [{"name": "OUTPUT0"}],
                    }
                ).encode(),
            ),
            False,
        ),
        ("infer version 1", request("POST", "/v2/models/tiny/versions/1/infer", good), False),
        ("infer binary in and out", request("POST", infer, bin_body, bin_headers), False),
        (
            "infer binary in, json out",
            request("POST", infer, bin_body_json_out, bin_headers_json_out),
            False,
        ),
        (
            "infer gzip body",
            request("POST", infer, gzip.compress(good), [("Content-Encoding", "gzip")]),
            False,
        ),
        (
            "infer deflate body",
            request("POST", infer, zlib.compress(good), [("Content-Encoding", "deflate")]),
            False,
        ),
        (
            "infer accept gzip",
            request("POST", infer, good, [("Accept-Encoding", "gzip")]),
            False,
        ),
        (
            "infer chunked",
            request(
                "POST",
                infer,
                b"%x\r\n%s\r\n0\r\n\r\n" % (len(good), good),
                [("Transfer-Encoding", "chunked")],
                content_length=False,
            ),
            False,
        ),
        (
            "corrupt gzip",
            request("POST", infer, b"\x1f\x8b\x08junk", [("Content-Encoding", "gzip")]),
            False,
        ),
        ("unsupported encoding", request("POST", infer, good, [("Content-Encoding", "br")]), False),
        ("bad json", request("POST", infer, b'{"inputs": [', jh), False),
        ("empty body", request("POST", infer, b""), False),
        ("no inputs", request("POST", infer, b'{"inputs": []}'), False),
        ("inputs not a list", request("POST", infer, b'{"inputs": 3}'), False),
        ("wrong shape", request("POST", infer, inp(shape=[1, 63])), False),
        ("data count mismatch", request("POST", infer, inp(shape=[2, 64])), False),
        ("wrong datatype", request("POST", infer, inp(datatype="INT32")), False),
        ("unknown datatype", request("POST", infer, inp(datatype="FP99")), False),
        ("unknown input", request("POST", infer, inp(name="NOPE")), False),
        ("data of wrong type", request("POST", infer, inp(data=["a"] * 64)), False),
        (
            "unknown output",
            request(
                "POST",
                infer,
                json.dumps(
                    {"inputs": json.loads(inp())["inputs"], "outputs": [{"name": "NOPE"}]}
                ).encode(),
            ),
            False,
        ),
        ("unknown model infer", request("POST", "/v2/models/nope/infer", good), False),
        ("unknown version infer", request("POST", "/v2/models/tiny/versions/9/infer", good), False),
        (
            "bad inference header length",
            request("POST", infer, good, [("Inference-Header-Content-Length", "x")]),
            False,
        ),
        (
            "inference header length past body",
            request("POST", infer, good, [("Inference-Header-Content-Length", "999999")]),
            False,
        ),
        ("body over the limit", request("POST", infer, b" " * (MAX_BODY + 1)), False),
        ("connection close", request("GET", "/v2", headers=[("Connection", "close")]), False),
        ("model stats", request("GET", "/v2/models/tiny/stats"), False),
        ("all stats", request("GET", "/v2/models/stats"), False),
        ("repository index", request("POST", "/v2/repository/index", b"{}"), False),
        (
            "repository index ready",
            request("POST", "/v2/repository/index", b'{"ready": true}'),
            False,
        ),
        ("repository index bad json", request("POST", "/v2/repository/index", b"{"), False),
        ("logging", request("GET", "/v2/logging"), False),
        ("trace settings", request("GET", "/v2/trace/setting"), False),
        ("model trace settings", request("GET", "/v2/models/tiny/trace/setting"), False),
        ("shm status", request("GET", "/v2/systemsharedmemory/status"), False),
        ("cuda shm status", request("GET", "/v2/cudasharedmemory/status"), False),
    ]
    return c


#: Fields that measure the process, not the request: durations, timestamps, memory.
MEASURED = {"ns", "last_inference", "timestamp", "byte_size", "memory_bytes", "qps", "latency_us"}


def _zero_timings(value: Any) -> Any:
    """``value`` with every measured field (:data:`MEASURED`, ``*_ns``) zeroed."""
    if isinstance(value, dict):
        return {
            k: 0 if (k in MEASURED or k.endswith("_ns")) else _zero_timings(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_zero_timings(v) for v in value]
    return value


def _normalized(r: Response) -> dict[str, Any]:
    body = r.body
    if r.header("content-encoding") == "gzip":
        body = gzip.decompress(body)
    elif r.header("content-encoding") == "deflate":
        body = zlib.decompress(body)
    parsed: Any = body
    split = r.header("inference-header-content-length")
    if split is not None:
        n = int(split)
        parsed = {"json": _zero_timings(json.loads(body[:n])), "binary": body[n:]}
    elif body and (r.header("content-type") or "").startswith("application/json"):
        parsed = _zero_timings(json.loads(body))
    return {
        "status": r.status,
        "body": parsed,
        "headers": {h: r.header(h) for h in COMPARED_HEADERS},
        "closes": r.closes,
    }


def _send(server: ServerProcess, wire: bytes, head: bool) -> dict[str, Any]:
    with Conn(server.http_port, 30) as c:
        try:
            c.send(wire)
        except (BrokenPipeError, ConnectionResetError):
            pass
        r = c.read_response(head_request=head)
        assert r is not None, "closed without an answer"
        return _normalized(r)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A native and an ASGI pdserve on copies of the same repository."""
    if not native_available():
        pytest.skip("--http-server does not exist yet (no native transport)")
    root = tmp_path_factory.mktemp("diff")
    flags = ("--max-request-bytes", str(MAX_BODY))
    servers: list[ServerProcess] = []
    try:
        for kind in ("native", "asgi"):
            repo = copy_models(root / kind / "repo", "tiny")
            servers.append(start_kind(kind, repo, root / kind / "pdserve.log", *flags))
        yield servers[0], servers[1]
    finally:
        for s in servers:
            s.stop()


def test_same_answers_on_both_transports(pair: tuple[ServerProcess, ServerProcess]) -> None:
    native, asgi = pair
    differences = []
    for name, wire, head in _corpus():
        a, b = _send(native, wire, head), _send(asgi, wire, head)
        if a != b:
            differences.append(f"{name}:\n  native {a}\n  asgi   {b}")
    assert not differences, "\n".join(differences)


def test_binary_output_is_the_model_output(pair: tuple[ServerProcess, ServerProcess]) -> None:
    """The binary corpus entry's tensor bytes are the model's output (not just equal)."""
    from tests.goldens import tiny_reference

    x3 = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    body, headers = _binary_infer(x3, True)
    for server in pair:
        got = _send(server, request("POST", "/v2/models/tiny/infer", body, headers), False)
        assert got["status"] == 200
        out = np.frombuffer(got["body"]["binary"], dtype=np.float32).reshape(3, 64)
        np.testing.assert_allclose(out, tiny_reference(x3), rtol=1e-5, atol=1e-5)
        size = got["body"]["json"]["outputs"][0]["parameters"]["binary_data_size"]
        assert size == struct.calcsize("f") * 3 * 64
