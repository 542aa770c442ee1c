"""A real pdserve against hostile or slow HTTP / gRPC clients: no request may stall
the event loop, stall a connection forever, or turn a bad request into a 500."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.conftest import ServerProcess, copy_models, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root: Path = tmp_path_factory.mktemp("robustness")
    repo = copy_models(root / "repo", "tiny")
    proc = start_server(repo, root / "pdserve.log", "--http-body-timeout-secs", "1")
    yield proc
    proc.stop()


def _request(
    server: ServerProcess, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request("POST", "/v2/models/tiny/infer", body=body, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def _tiny_body() -> bytes:
    doc = {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}
    return json.dumps(doc).encode()


class LiveProbe:
    """Polls /v2/health/live in a thread; ``worst`` is the slowest answer in seconds."""

    def __init__(self, server: ServerProcess) -> None:
        self.port = server.http_port
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            conn.request("GET", "/v2/health/live")
            assert conn.getresponse().status == 200
            conn.close()
            self.worst = max(self.worst, time.perf_counter() - start)
            time.sleep(0.02)

    def __enter__(self) -> LiveProbe:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.1)
        self._stop.set()
        self._thread.join()


def test_many_gzip_members_are_rejected_fast(server: ServerProcess) -> None:
    with LiveProbe(server) as probe:
        status, body = _request(server, gzip.compress(b"") * 120_000, {"Content-Encoding": "gzip"})
    assert status == 400 and b"more than 4096 gzip members" in body
    assert probe.worst < 0.5


def test_content_encoding_list_is_accepted(server: ServerProcess) -> None:
    packed = gzip.compress(_tiny_body())
    status, body = _request(server, packed, {"Content-Encoding": "gzip, identity"})
    assert status == 200, body
    status, body = _request(server, packed[:-4], {"Content-Encoding": "gzip"})
    assert status == 400 and b"truncated" in body


def test_millions_of_empty_bytes_elements_do_not_stall_the_loop(server: ServerProcess) -> None:
    n = 4_000_000
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "shape": [1, 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": 4 * n},
                }
            ]
        }
    ).encode()
    with LiveProbe(server) as probe:
        start = time.perf_counter()
        status, body = _request(
            server, header + b"\0" * (4 * n), {"Inference-Header-Content-Length": str(len(header))}
        )
        elapsed = time.perf_counter() - start
    assert status == 400 and b"more than 1 elements" in body
    assert elapsed < 2 and probe.worst < 0.5


def test_large_valid_bytes_input_decodes_off_the_loop(server: ServerProcess) -> None:
    """A 2M-element BYTES input takes a while to parse, on a worker thread."""
    n = 2_000_000
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "shape": [n],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": 4 * n},
                }
            ]
        }
    ).encode()
    with LiveProbe(server) as probe:
        status, body = _request(
            server, header + b"\0" * (4 * n), {"Inference-Header-Content-Length": str(len(header))}
        )
    assert status == 400 and b"unexpected inference input 'text'" in body  # decoded, then checked
    assert probe.worst < 0.5


def test_shapes_numpy_cannot_hold_are_400(server: ServerProcess) -> None:
    for shape in ([1] * 70, [0, 2**63 - 1]):
        doc = {"inputs": [{"name": "INPUT0", "shape": shape, "datatype": "FP32", "data": []}]}
        status, body = _request(server, json.dumps(doc).encode())
        assert status == 400, body


def test_grpc_bad_shapes_and_out_of_range_contents_are_invalid_argument(
    server: ServerProcess,
) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        msg = service_pb2.ModelInferRequest(model_name="tiny", raw_input_contents=[b""])
        msg.inputs.add(name="INPUT0", datatype="FP32", shape=[1] * 70)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(msg, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 64" in info.value.details()
        msg = service_pb2.ModelInferRequest(model_name="tiny")
        msg.inputs.add(name="INPUT0", datatype="INT8", shape=[1]).contents.int_contents.append(1000)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(msg, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "out of range for INT8" in info.value.details()


def test_stalled_body_is_408_and_the_connection_closed(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(
            b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
            + b"{" * 100
        )
        start = time.perf_counter()
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
        elapsed = time.perf_counter() - start
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in reply.lower()
    assert 0.8 < elapsed < 10
    # The server still answers.
    assert _request(server, _tiny_body())[0] == 200
