"""The gRPC loads of a ``pdserve perf`` worker: :class:`H2Load` over raw HTTP/2
(:mod:`~pdserve.app.perf.h2grpc`, the default) and :class:`GrpcioLoad` over
``grpc.aio``. The request is serialized once (no protobuf work per request);
answers are not decoded."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING

from pdserve.app.perf.h2grpc import H2Connection, Stream, grpc_message
from pdserve.app.perf.load import MAX_BACKOFF_S, MAX_PENDING, Load, WorkerSpec, monotonic_ns

if TYPE_CHECKING:
    import grpc


class GrpcioLoad(Load):
    """The gRPC load of one worker (``grpc.aio``, one channel)."""

    METHOD = "/inference.GRPCInferenceService/ModelInfer"

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> None:
        import grpc

        super().__init__(spec, loop, spec.requests)
        self.grpc = grpc
        self.active = 0
        self.inflight = 0
        self.channel = grpc.aio.insecure_channel(
            f"{spec.host}:{spec.port}",
            options=[
                ("grpc.max_send_message_length", -1),
                ("grpc.max_receive_message_length", -1),
            ],
        )
        self.call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(
            self.METHOD, request_serializer=None, response_deserializer=None
        )
        self.tasks: set[asyncio.Task[None]] = set()

    async def _one(self) -> None:
        rec = self.rec
        req = self.next_request()
        rec.sent += 1
        t0 = monotonic_ns()
        try:
            await self.call(req, timeout=self.spec.request_timeout_s)
        except self.grpc.aio.AioRpcError as e:
            code = e.code()
            rec.error(code.name, e.details() or "")
            if code in (self.grpc.StatusCode.UNAVAILABLE, self.grpc.StatusCode.DEADLINE_EXCEEDED):
                await asyncio.sleep(0.05)
            return
        t1 = monotonic_ns()
        rec.ok(t1, t1 - t0)

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _slot(self) -> None:
        self.active += 1
        try:
            while not self.closing and self.mode == "concurrency" and self.active <= self.target:
                await self._one()
        finally:
            self.active -= 1

    async def _rate_task(self) -> None:
        self.inflight += 1
        try:
            while not self.closing:
                await self._one()
                if self.mode == "rate" and self.pending > 0:
                    self.pending -= 1
                    continue
                break
        finally:
            self.inflight -= 1

    def set_concurrency(self, n: int) -> None:
        self._stop_timer()
        self.mode = "concurrency"
        self.target = n
        self.pending = 0
        for _ in range(max(0, n - self.active)):
            self._spawn(self._slot())

    def arrival(self) -> None:
        if self.inflight < self.max_conns:
            self._spawn(self._rate_task())
        elif self.pending >= MAX_PENDING:
            self.drop()
        else:
            self.pending += 1
            self.rec.delayed += 1

    def outstanding(self) -> int:
        return self.active if self.mode == "concurrency" else self.inflight

    async def aclose(self) -> None:
        self.closing = True
        self._stop_timer()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.channel.close(grace=None)


class H2Load(Load):
    """The gRPC load of one worker over :class:`~pdserve.app.perf.h2grpc.H2Connection`
    (one HTTP/2 connection carrying every call in flight; a new one replaces it when
    it closes or the server sends GOAWAY)."""

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(spec, loop, [grpc_message(r) for r in spec.requests])
        self.inflight = 0
        self.conn: H2Connection | None = None
        self.conns: set[H2Connection] = set()
        self.connecting = False
        self.streak = 0
        host, port = spec.host, spec.port
        self.authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.start_timeout_checks()

    def _wanted(self) -> int:
        """Calls to start now, connection permitting."""
        if self.mode == "concurrency":
            return self.target - self.inflight
        if self.mode == "rate":
            return min(self.pending, self.max_conns - self.inflight)
        return 0

    def _fill(self) -> None:
        want = self._wanted()
        if want <= 0 or self.closing:
            return
        conn = self.conn
        if conn is None or not conn.usable:
            self.conn = None
            self._ensure_connection()
            return
        n = min(want, conn.free_streams)
        for _ in range(n):
            if self.mode == "rate":
                self.pending -= 1
            conn.call(self.next_request())
            self.inflight += 1
            self.rec.sent += 1

    def _finished(self, st: Stream, error: str | None, message: str) -> None:
        t1 = monotonic_ns()
        self.inflight -= 1
        if error is None:
            self.streak = 0
            self.rec.ok(t1, t1 - st.t0)
        else:
            self.rec.error(error, message)
        self._fill()

    def _lost(self, conn: H2Connection) -> None:
        self.conns.discard(conn)
        if conn is self.conn:
            self.conn = None
            self.streak += 1
            if not self.closing and self._wanted() > 0:
                delay = min(0.005 * 2 ** min(self.streak, 10), MAX_BACKOFF_S)
                self.loop.call_later(delay, self._fill)

    def _ensure_connection(self) -> None:
        if not self.connecting and not self.closing:
            self.connecting = True
            asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        try:
            conn = await self.open_connection(
                lambda: H2Connection(self.authority, self._finished, self._lost, monotonic_ns),
                lambda: self._wanted() > 0,
            )
            if conn is not None:
                self.conn = conn
                self.conns.add(conn)
        finally:
            self.connecting = False
        self._fill()

    def expire(self, now: int) -> None:
        expired = [
            (c, st)
            for c in self.conns
            for st in list(c.streams.values())
            if now - st.t0 > self.timeout_ns
        ]
        for conn, st in expired:
            conn.cancel(st)
            self.inflight -= 1
            self.timed_out()
        if expired:
            self._fill()

    def set_concurrency(self, n: int) -> None:
        self._stop_timer()
        self.mode = "concurrency"
        self.target = n
        self.pending = 0
        self._fill()

    def arrival(self) -> None:
        if self.pending >= MAX_PENDING:
            self.drop()
            return
        if self.inflight + self.pending >= self.max_conns:
            self.rec.delayed += 1
        self.pending += 1

    def arrivals_done(self) -> None:
        self._fill()

    def outstanding(self) -> int:
        return self.inflight

    def close_connections(self) -> None:
        for conn in list(self.conns):
            conn.close()
