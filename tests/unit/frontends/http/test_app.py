"""The ASGI app's JSON limit and where it parses large JSON (pdserve.frontends.http.app);
the harness and fake servers are test_http_codec's."""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Iterator

import numpy as np
import pytest

from pdserve.core.types import InferRequest, InferResponse
from pdserve.frontends import offload
from pdserve.frontends.http.app import create_http_app
from pdserve.frontends.http.body import PROCESS_JSON_BYTES
from tests.unit.frontends.http.test_codec import (
    FakeServer,
    StatsServer,
    call,
    client_request,
    parse,
)

LIMIT = 100_000


@pytest.fixture(autouse=True)
def fresh_pools() -> Iterator[None]:
    offload.shutdown()
    yield
    offload.shutdown()


def json_body(n: int) -> bytes:
    doc = {"inputs": [{"name": "IN", "datatype": "FP64", "shape": [n], "data": [0.123456789] * n}]}
    return json.dumps(doc).encode()


def test_json_over_the_json_limit_is_413_without_reading_it() -> None:
    app = create_http_app(FakeServer(), max_json_bytes=LIMIT)
    body = json_body(20_000)
    reply = call(app, "POST", "/v2/models/echo/infer", body)
    assert reply.status == 413 and reply.receives == 0  # type: ignore[attr-defined]
    assert reply.headers["connection"] == "close"
    error = reply.json()["error"]
    assert error.startswith(f"request JSON of {len(body)} bytes exceeds the limit of {LIMIT} bytes")
    assert "binary tensor data extension" in error
    # No content-length: stops at the first piece over the limit.
    reply = call(app, "POST", "/v2/models/echo/infer", body, {"content-length": ""}, chunk=30_000)
    assert reply.status == 413 and reply.receives == 4  # type: ignore[attr-defined]
    assert "request JSON of at least 120000 bytes" in reply.json()["error"]
    # Compressed under the limit, over it once decompressed.
    packed = gzip.compress(body)
    assert len(packed) < LIMIT
    reply = call(app, "POST", "/v2/models/echo/infer", packed, {"content-encoding": "gzip"})
    assert reply.status == 413 and f"limit of {LIMIT} bytes" in reply.json()["error"]


def test_json_limit_applies_to_the_json_part_only() -> None:
    app = create_http_app(FakeServer(), max_json_bytes=LIMIT)
    big = np.arange(200_000, dtype=np.float32)  # 800 KB of binary data: fine
    body, json_size = client_request({"IN": big}, True)
    headers = {"Inference-Header-Content-Length": str(json_size)}
    reply = call(app, "POST", "/v2/models/echo/infer", body, headers)
    assert reply.status == 200, reply.body
    # A binary request whose announced JSON part is over the limit: refused unread.
    headers = {"Inference-Header-Content-Length": str(LIMIT + 1)}
    reply = call(app, "POST", "/v2/models/echo/infer", b"{" * (LIMIT + 10), headers)
    assert reply.status == 413 and reply.receives == 0  # type: ignore[attr-defined]
    assert f"request JSON of {LIMIT + 1} bytes" in reply.json()["error"]
    # The request limit stays the tighter one when it is.
    app = create_http_app(FakeServer(), max_request_bytes=1000, max_json_bytes=LIMIT)
    reply = call(app, "POST", "/v2/models/echo/infer", json_body(100))
    assert reply.json()["error"].startswith("request body of ")


def test_a_header_length_past_the_body_is_a_bad_request() -> None:
    # Triton (GetInferenceHeaderLength): 400 "inference header size should be in
    # range (0, <content length>), got: <value>", before any JSON limit (not a 413)
    app = create_http_app(FakeServer(), max_json_bytes=LIMIT)
    body, json_size = client_request({"IN": np.arange(4, dtype=np.float32)}, True)
    for announced in (len(body) + 1, LIMIT * 100):
        headers = {"Inference-Header-Content-Length": str(announced)}
        reply = call(app, "POST", "/v2/models/echo/infer", body, headers)
        assert reply.status == 400, reply.body
        assert reply.json() == {
            "error": f"inference header size should be in range (0, {len(body)}), got: {announced}"
        }
    # a compressed body is compared after decompression (the header counts those bytes)
    headers = {"Inference-Header-Content-Length": str(len(body) + 1), "content-encoding": "gzip"}
    reply = call(app, "POST", "/v2/models/echo/infer", gzip.compress(body), headers)
    assert reply.status == 400 and "inference header size should be in range" in reply.body.decode()
    headers = {"Inference-Header-Content-Length": str(json_size)}
    assert call(app, "POST", "/v2/models/echo/infer", body, headers).status == 200


def test_large_json_is_decoded_in_a_decode_process() -> None:
    server = FakeServer()
    app = create_http_app(server)
    body = json_body(40_000)
    assert len(body) > PROCESS_JSON_BYTES
    reply = call(app, "POST", "/v2/models/echo/infer", body, chunk=65536)
    assert reply.status == 200, reply.body[:200]
    assert offload.decode_processes(), "the body was not decoded in a decode process"
    out = parse(reply.body, None).as_numpy("IN")
    np.testing.assert_array_equal(out, np.full(40_000, 0.123456789))
    # Errors from the decode process keep their status.
    bad = body.replace(b'"FP64"', b'"FP65"')
    reply = call(app, "POST", "/v2/models/echo/infer", bad, chunk=65536)
    assert reply.status == 400 and "unsupported datatype 'FP65'" in reply.json()["error"]


def test_large_repository_bodies_are_parsed_in_a_decode_process() -> None:
    server = StatsServer()
    app = create_http_app(server)
    blob = bytes(range(256)) * 2000
    doc = {"parameters": {"config": "{}", "file:1/model.onnx": base64.b64encode(blob).decode()}}
    body = json.dumps(doc).encode()
    assert len(body) > PROCESS_JSON_BYTES
    reply = call(app, "POST", "/v2/repository/models/m/load", body, chunk=65536)
    assert reply.status == 200, reply.body
    assert server.loaded == [("load", "m", "{}", {"1/model.onnx": blob})]
    assert offload.decode_processes()
    reply = call(app, "POST", "/v2/repository/models/m/load", b"[" + b"1," * 200_000 + b"1]")
    assert reply.status == 400 and reply.json()["error"] == "the request body must be a JSON object"


def test_repository_parameters_must_be_an_object_when_given() -> None:
    server = StatsServer()
    app = create_http_app(server)
    for path, what in (("load", "load"), ("unload", "unload")):
        for params in (b"null", b"[]", b"3"):
            body = b'{"parameters": ' + params + b"}"
            reply = call(app, "POST", f"/v2/repository/models/m/{path}", body)
            assert reply.status == 400, (path, params)
            assert reply.json()["error"] == f"{what} request 'parameters' must be a JSON object"
    assert server.loaded == []
    assert call(app, "POST", "/v2/repository/models/m/unload", b"{}").status == 200


def test_wrong_method_is_405_with_allow() -> None:
    app = create_http_app(StatsServer())
    for method, path, allow in (
        ("TRACE", "/v2/health/live", "GET"),
        ("POST", "/v2/models/echo", "GET"),
        ("GET", "/v2/models/echo/infer", "POST"),
        ("PUT", "/v2/repository/index", "POST"),
        ("DELETE", "/v2/openapi.json", "GET"),
    ):
        reply = call(app, method, path)
        assert reply.status == 405 and reply.headers["allow"] == allow, (method, path)
        assert reply.json() == {"error": "Method Not Allowed"}


def test_openapi_document_is_served() -> None:
    reply = call(create_http_app(FakeServer()), "GET", "/v2/openapi.json")
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    doc = reply.json()
    assert doc["openapi"] == "3.0.3" and "/v2/models/{model_name}/infer" in doc["paths"]


# --------------------------------------------------------------------------- large JSON responses


def test_output_data_json_gives_the_bytes_the_encoder_writes() -> None:
    """Outputs encoded beforehand (``encoded``) give a body byte-identical to the one
    encoded in one go: floats with NaN/inf tokens, FP16, non-contiguous and big-endian
    arrays, BYTES, booleans, scalars; binary outputs are left alone."""
    from pdserve.core.types import RequestedOutput
    from pdserve.frontends.http.encode import (
        encode_infer_response,
        json_output_names,
        output_data_json,
    )

    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    nonfinite = np.array([1.5, np.nan, np.inf, -np.inf, 0.1], dtype=np.float32)
    outputs = {
        "F": nonfinite,
        "H": nonfinite.astype(np.float16),
        "T": base.T,
        "BE": base.astype(">f4"),
        "I": np.arange(5, dtype=np.int64),
        "B": np.array([True, False]),
        "S": np.array([b"x", "ä".encode()], dtype=object),
        "Z": np.float64(1.5) * np.ones(()),
        "BIN": base,
    }
    request = InferRequest(
        "m", id="r", outputs=[RequestedOutput(n, binary_data=n == "BIN") for n in outputs]
    )
    response = InferResponse("m", "1", outputs)
    names = json_output_names(response, request)
    assert names == [n for n in outputs if n != "BIN"]
    encoded = {n: output_data_json(outputs[n], n) for n in names}
    assert encode_infer_response_with(response, request, encoded) == encode_infer_response(
        response, request
    )


def encode_infer_response_with(
    response: InferResponse, request: InferRequest, encoded: dict[str, bytes]
) -> tuple[bytes, int | None]:
    from pdserve.frontends.http.encode import encode_infer_response_parts

    parts, json_length, _ = encode_infer_response_parts(response, request, encoded)
    return b"".join(bytes(p) for p in parts), json_length


class BigOutputServer(FakeServer):
    """``big``: one FP32 output of the element count the request's id says."""

    async def infer(self, request: InferRequest) -> InferResponse:
        if request.model_name != "big":
            return await super().infer(request)
        n = int(request.id)
        return InferResponse("big", "1", {"OUT": big_output(n)}, id=request.id)


def big_output(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.float32) * np.float32(0.37)).astype(np.float32)


def infer_body(rid: str) -> bytes:
    doc = {"id": rid, "inputs": [{"name": "IN", "datatype": "FP32", "shape": [1], "data": [0]}]}
    return json.dumps(doc).encode()


def test_a_large_json_response_is_encoded_in_a_decode_process_byte_identical() -> None:
    from pdserve.frontends.http.app import PROCESS_JSON_OUTPUT_BYTES
    from pdserve.frontends.http.encode import encode_infer_response

    n = PROCESS_JSON_OUTPUT_BYTES // 4 + 1000
    app = create_http_app(BigOutputServer())
    reply = call(app, "POST", "/v2/models/big/infer", infer_body(str(n)))
    assert reply.status == 200, reply.body[:200]
    assert offload.decode_processes(), "the response was not encoded in a decode process"
    want, _ = encode_infer_response(
        InferResponse("big", "1", {"OUT": big_output(n)}, id=str(n)), InferRequest("big")
    )
    assert reply.body == want
    # a small response stays in this process
    offload.shutdown()
    reply = call(app, "POST", "/v2/models/big/infer", infer_body("1000"))
    assert reply.status == 200 and not offload.decode_processes()


def test_small_requests_are_served_while_a_large_response_is_encoded() -> None:
    """A 32 MiB FP32 output as JSON (orjson holds the GIL about 1 s for it): health
    checks sent meanwhile are answered at once, not after the encode."""
    import asyncio
    import time

    app = create_http_app(BigOutputServer())
    n = 8 * 1024 * 1024

    async def request(path: str, body: bytes = b"") -> tuple[int, float]:
        method = "POST" if body else "GET"
        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
        events = [{"type": "http.request", "body": body, "more_body": False}]
        status: list[int] = []

        async def receive() -> dict:
            return events.pop(0) if events else {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        start = time.monotonic()
        await app(scope, receive, send)
        return status[0], time.monotonic() - start

    async def main() -> tuple[float, list[float]]:
        await request("/v2/models/big/infer", infer_body("300000"))  # start the processes
        begin = time.monotonic()
        big = asyncio.ensure_future(request("/v2/models/big/infer", infer_body(str(n))))
        answered = [begin]  # when each health check was answered
        while not big.done():
            status, _ = await request("/v2/health/live")
            assert status == 200
            answered.append(time.monotonic())
            await asyncio.sleep(0.01)
        status, took = await big
        assert status == 200
        return took, [b - a for a, b in zip(answered, answered[1:], strict=False)]

    big_took, gaps = asyncio.run(main())
    # before: the event loop stood still for the whole encode: 2-3 checks answered, one
    # gap ~ big_took. After (loaded 2-core machine): 100+ checks, the largest gap about
    # big_took / 8 (the scheduler's, not the encoder's)
    assert len(gaps) >= 20, (big_took, gaps)
    assert max(gaps) < big_took / 2, (big_took, max(gaps), len(gaps))


def test_the_disconnect_hook_leaves_no_cycle_once_released() -> None:
    """Under uvicorn the request's token hooks the cycle's ``message_event``: once the
    request is answered the hook lets go, so the cycle, the hook and the token are freed
    by reference counting, not left for the garbage collector; a disconnect before that
    cancels the token, one after it is ignored."""
    import asyncio

    from pdserve.core.errors import ErrorCode
    from pdserve.frontends.http.asgi import (
        _DisconnectEvent,
        disconnect_token,
        release_disconnect_hook,
    )
    from tests.cyclic import collector_off

    class Cycle:  # the attributes of uvicorn's httptools RequestResponseCycle we use
        def __init__(self) -> None:
            self.disconnected = False
            self.message_event = asyncio.Event()
            self.flow = None

        async def receive(self) -> dict:
            return {"type": "http.disconnect"}

    async def run() -> tuple[bool, bool]:
        gone = Cycle()
        token = disconnect_token(gone.receive)
        gone.disconnected = True
        gone.message_event.set()  # uvicorn's connection_lost
        cancelled_before = token.error is not None and token.error.code is ErrorCode.CLIENT_GONE
        release_disconnect_hook(gone.receive)  # the app's handler returns (a 499 or nothing)
        answered = Cycle()
        late = disconnect_token(answered.receive)
        assert type(answered.message_event) is _DisconnectEvent
        release_disconnect_hook(answered.receive)
        answered.disconnected = True
        answered.message_event.set()
        return cancelled_before, late.error is not None

    with collector_off() as collect:
        assert asyncio.run(run()) == (True, False)
        kinds = {type(o).__name__ for o in collect()}
    assert "Cycle" not in kinds and "_DisconnectEvent" not in kinds, kinds
