"""Issue 11: the native gRPC transport's per-call CPU (ModelInfer) inside one process,
without sockets (the steady figure to compare two checkouts on a loaded machine).

The gRPC twin of ``bench_native_inproc.py``: one
:class:`~pdserve.frontends.grpc.native.GrpcConnection` of a
:class:`~pdserve.frontends.grpc.native.NativeGrpcServer` serving the real
:class:`~pdserve.frontends.grpc.service.GrpcService` on a started
:class:`~pdserve.server.InferenceServer` (``bench_frontend.py``'s ``tiny`` model, dynamic
batcher, ONNX Runtime), on a fake transport. A wave of ``-c`` calls arrives in one read
(HEADERS with the same fully indexed HPACK block a grpc client repeats, DATA with
perf_analyzer's message: one row of 64 FP32 as ``raw_input_contents``, output
``OUTPUT0`` asked for, and a connection WINDOW_UPDATE per call, as a client sends for each
response it reads); the next wave arrives once every call of the last one is answered.
Everything the server runs per call is measured except the ``recv``/``send`` system
calls and the loop's polling. Reported: process CPU-µs per call per round; take the
minimum (a round that shared its core with another process is only slower).
``--fake-core`` answers from a stub instead of the server: the front end's own cost.

Run from the checkout to measure (``PYTHONPATH=.``), on one core::

    PYTHONPATH=. taskset -c 0 .venv/bin/python benchmarks/bench_grpc_native_inproc.py \\
        -c 32 -n 20000 --rounds 5 [--fake-core]
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import sys
import time
from typing import Any

import hpack
import numpy as np
import uvloop
from bench_frontend import build_repo
from common import cli_parser
from tritonclient.grpc import service_pb2

from pdserve.core.types import InferResponse
from pdserve.frontends.grpc.native import _OK_TRAILERS_BLOCK, GrpcConnection, NativeGrpcServer
from pdserve.frontends.grpc.service import SERVICE_NAME, GrpcService, method_handlers
from pdserve.server import InferenceServer

_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/inference.GRPCInferenceService/ModelInfer"),
    (":authority", "127.0.0.1:8001"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
    ("user-agent", "grpc-c++/1.67.1 grpc-c/44.0.0 (linux; chttp2)"),
    ("grpc-accept-encoding", "identity,deflate,gzip"),
]


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return struct.pack(">IBI", len(payload) << 8 | kind, flags, sid) + payload


class _FakeCore:
    """Answers every request with the tiny model's output shape (``--fake-core``)."""

    output = np.zeros((1, 16), np.float32)

    async def infer(self, request: Any) -> InferResponse:
        token = request.cancelled
        if token is not None:  # the dynamic batcher polls the token three times
            token()
            token()
            token()
        return InferResponse(
            model_name=request.model_name,
            model_version="1",
            outputs={"OUTPUT0": self.output},
            id=request.id,
        )


class _Transport(asyncio.Transport):
    """Counts writes; wakes the driver when the connection has no call open."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__()
        self.state = state
        self.conn: GrpcConnection | None = None

    def write(self, data: Any) -> None:
        st = self.state
        st["writes"] += 1
        st["ok"] += bytes(data).count(_OK_TRAILERS_BLOCK)  # grpc-status 0 trailers
        waiter = st["waiter"]
        if self.conn is not None and not self.conn.calls and waiter is not None:
            st["waiter"] = None
            waiter.set_result(None)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 5000) if name == "peername" else default


async def run(args: argparse.Namespace) -> list[float]:
    loop = asyncio.get_running_loop()
    server: InferenceServer | None = None
    core: Any = _FakeCore()
    if not args.fake_core:
        server = InferenceServer(str(build_repo()))
        await server.start()
        core = server
    msg = service_pb2.ModelInferRequest(model_name="tiny")
    tensor = msg.inputs.add(name="INPUT0", datatype="FP32")
    tensor.shape.extend([1, 64])
    msg.outputs.add(name="OUTPUT0")
    row = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    msg.raw_input_contents.append(row.tobytes())
    body = msg.SerializeToString()
    message = struct.pack(">BI", 0, len(body)) + body
    encoder = hpack.Encoder()
    st: dict[str, Any] = {"writes": 0, "ok": 0, "waiter": None}
    grpc = NativeGrpcServer(method_handlers(GrpcService(core)), SERVICE_NAME, 64 << 20)
    transport = _Transport(st)
    conn = grpc.protocol()
    conn.connection_made(transport)
    transport.conn = conn
    figures = []
    try:
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"")
        first = _frame(1, 0x4, 1, encoder.encode(_HEADERS)) + _frame(0, 0x1, 1, message)
        st["waiter"] = loop.create_future()
        conn.data_received(preface + first)
        await st["waiter"]
        block = encoder.encode(_HEADERS)  # now fully indexed: the same bytes every call
        update = _frame(8, 0, 0, struct.pack(">I", len(message)))
        sid = 3
        for rnd in range(args.rounds):
            answered = 0
            t0 = time.process_time()
            while answered < args.requests:
                wave = []
                for _ in range(args.concurrency):
                    wave.append(_frame(1, 0x4, sid, block) + _frame(0, 0x1, sid, message) + update)
                    sid += 2
                st["waiter"] = loop.create_future()
                conn.data_received(b"".join(wave))
                await st["waiter"]
                answered += args.concurrency
            us = 1e6 * (time.process_time() - t0) / answered
            figures.append(us)
            print(f"round {rnd}: {answered} calls, {us:.2f} CPU-us/call", flush=True)
        if st["ok"] != sid // 2:
            print(f"only {st['ok']} of {sid // 2} calls answered OK", file=sys.stderr)
    finally:
        conn.connection_lost(None)
        if server is not None:
            await server.stop()
    return figures


def main(argv: list[str] | None = None) -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument("-c", "--concurrency", type=int, default=32)
    p.add_argument("-n", "--requests", type=int, default=20000, help="per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fake-core", action="store_true", help="a stub instead of the server")
    args = p.parse_args(argv)
    figures = uvloop.run(run(args))
    print(f"min {min(figures):.2f} CPU-us/call over {len(figures)} round(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
