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

``--connections K`` models Triton's perf_analyzer instead (``-i grpc``, concurrency
``-c``): its client library shares one gRPC channel among at most 6 clients, so its
32 contexts use 6 HTTP/2 connections, each with 5-6 calls in flight, and each call
is re-sent as soon as its answer is read (closed loop): calls arrive a few per read
on each connection, staggered, and the dynamic batcher forms smaller batches than
from one wave of 32. With ``--triton-client`` each request carries perf_analyzer's
``triton_enable_empty_final_response`` parameter and its HEADERS are followed by a
WINDOW_UPDATE of the new stream, as grpc C++ sends (the connection's WINDOW_UPDATE per
answer read is sent in both modes).

Run from the checkout to measure (``PYTHONPATH=.``), on one core::

    PYTHONPATH=. taskset -c 0 .venv/bin/python benchmarks/bench_grpc_native_inproc.py \\
        -c 32 -n 20000 --rounds 5 [--fake-core] [--connections 6 --triton-client]
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
from pdserve.frontends.grpc.http2 import OK_TRAILERS_BLOCK
from pdserve.frontends.grpc.native import GrpcConnection, NativeGrpcServer
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
        st["ok"] += bytes(data).count(OK_TRAILERS_BLOCK)  # grpc-status 0 trailers
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


class _ClientTransport(_Transport):
    """One connection of the closed-loop client (``--connections``): every answer
    written is read by the client, which sends a new call in its place (in the next
    loop iteration, after a connection WINDOW_UPDATE per answer)."""

    def __init__(self, state: dict[str, Any], client: _ClosedLoop) -> None:
        super().__init__(state)
        self.client = client

    def write(self, data: Any) -> None:
        n = bytes(data).count(OK_TRAILERS_BLOCK)
        st = self.state
        st["writes"] += 1
        st["ok"] += n
        if n:
            self.client.answered(self, n)


class _ClosedLoop:
    """perf_analyzer's pattern (``--connections``): ``concurrency`` calls spread over
    the connections, each re-sent when its answer is read, until ``stop`` is set."""

    def __init__(self, loop: asyncio.AbstractEventLoop, message: bytes, triton: bool) -> None:
        self.loop = loop
        self.message = message
        self.triton = triton
        self.encoders: dict[int, hpack.Encoder] = {}
        self.blocks: dict[int, bytes] = {}  # the repeated block (as the client's is)
        self.sids: dict[int, int] = {}
        self.outstanding = 0
        self.stop = False
        self.idle: asyncio.Future[None] | None = None

    def send(self, transport: _ClientTransport, n: int, answered: int = 0) -> None:
        conn = transport.conn
        assert conn is not None
        key = id(transport)
        encoder = self.encoders.setdefault(key, hpack.Encoder())
        sid = self.sids.get(key, 1)
        chunks = []
        consumed = struct.pack(">I", len(self.message))  # (about an answer's size)
        for _ in range(answered):  # the client read an answer: the connection's window
            chunks.append(_frame(8, 0, 0, consumed))
        update = struct.pack(">I", 4_194_304)
        for _ in range(n):
            block = self.blocks.get(key) or encoder.encode(_HEADERS)
            if key in self.encoders and key not in self.blocks and sid > 1:
                self.blocks[key] = block  # fully indexed from the second call on
            chunks.append(_frame(1, 0x4, sid, block))
            if self.triton:  # grpc C++ opens the new stream's receive window at once
                chunks.append(_frame(8, 0, sid, update))
            chunks.append(_frame(0, 0x1, sid, self.message))
            sid += 2
        self.sids[key] = sid
        self.outstanding += n
        conn.data_received(b"".join(chunks))

    def answered(self, transport: _ClientTransport, n: int) -> None:
        self.outstanding -= n
        if not self.stop:
            self.loop.call_soon(self.send, transport, n, n)
        elif not self.outstanding and self.idle is not None and not self.idle.done():
            self.idle.set_result(None)


async def run_closed_loop(
    args: argparse.Namespace, grpc: NativeGrpcServer, message: bytes
) -> list[float]:
    """``--connections``: rounds of the closed-loop client; CPU-µs per call per round."""
    loop = asyncio.get_running_loop()
    st: dict[str, Any] = {"writes": 0, "ok": 0, "waiter": None}
    client = _ClosedLoop(loop, message, args.triton_client)
    transports = []
    for _ in range(args.connections):
        transport = _ClientTransport(st, client)
        conn = grpc.protocol()
        conn.connection_made(transport)
        transport.conn = conn
        conn.data_received(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b""))
        transports.append(transport)
    figures = []
    try:
        for rnd in range(args.rounds):
            client.stop = False
            client.idle = loop.create_future()
            ok0, writes0 = st["ok"], st["writes"]
            t0 = time.process_time()
            for i in range(args.concurrency):
                client.send(transports[i % len(transports)], 1)
            while st["ok"] - ok0 < args.requests:
                await asyncio.sleep(0.005)
                if any(t.conn is not None and t.conn.closed for t in transports):
                    raise RuntimeError("the server closed a connection (see the log)")
            client.stop = True
            await client.idle
            answered = st["ok"] - ok0
            us = 1e6 * (time.process_time() - t0) / answered
            figures.append(us)
            print(
                f"round {rnd}: {answered} calls, {us:.2f} CPU-us/call, "
                f"{answered / (st['writes'] - writes0):.1f} calls per write",
                flush=True,
            )
    finally:
        for transport in transports:
            assert transport.conn is not None
            transport.conn.connection_lost(None)
    return figures


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
    if args.triton_client:  # perf_analyzer sets it on every gRPC request
        msg.parameters["triton_enable_empty_final_response"].bool_param = True
    body = msg.SerializeToString()
    message = struct.pack(">BI", 0, len(body)) + body
    encoder = hpack.Encoder()
    st: dict[str, Any] = {"writes": 0, "ok": 0, "waiter": None}
    grpc = NativeGrpcServer(method_handlers(GrpcService(core)), SERVICE_NAME, 64 << 20)
    if args.connections:
        try:
            return await run_closed_loop(args, grpc, message)
        finally:
            if server is not None:
                await server.stop()
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
    p.add_argument(
        "--connections",
        type=int,
        default=0,
        help="closed loop over this many connections (perf_analyzer -i grpc: 6)",
    )
    p.add_argument(
        "--triton-client",
        action="store_true",
        help="perf_analyzer's request parameter and per-call stream WINDOW_UPDATE",
    )
    args = p.parse_args(argv)
    figures = uvloop.run(run(args))
    print(f"min {min(figures):.2f} CPU-us/call over {len(figures)} round(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
