"""The HTTP load of a ``pdserve perf`` worker: raw HTTP/1.1 keep-alive connections,
requests as prepared bytes (:meth:`~pdserve.app.perf.inputs.HttpRequest.wire`),
responses parsed by ``httptools``. Each completion sends the next request from the
protocol callback itself (no task, no future per request)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import httptools

from pdserve.app.perf.load import EXAMPLE_BYTES, MAX_PENDING, Load, WorkerSpec, monotonic_ns


class HttpConn(asyncio.Protocol):
    """One keep-alive connection; the load's callbacks drive it."""

    __slots__ = (
        "load",
        "tr",
        "parser",
        "t0",
        "t_first",
        "send_ns",
        "busy",
        "err_body",
        "status",
        "failed",
    )

    def __init__(self, load: HttpLoad) -> None:
        self.load = load
        self.tr: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.t0 = 0
        self.t_first = 0
        self.send_ns = 0
        self.busy = False
        self.err_body: list[bytes] | None = None
        self.status = 0
        self.failed = False  # ended by an error, not after a complete answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tr = transport  # type: ignore[assignment]  # uvloop's TCPTransport is not a subclass

    def send(self, data: bytes) -> None:
        assert self.tr is not None
        self.busy = True
        self.t_first = 0
        self.err_body = None
        t = monotonic_ns()
        self.t0 = t
        self.tr.write(data)
        self.send_ns = monotonic_ns() - t
        self.load.rec.sent += 1

    def data_received(self, data: bytes) -> None:
        if not self.t_first:
            self.t_first = monotonic_ns()
        try:
            self.parser.feed_data(data)
        except Exception as e:  # noqa: BLE001 - any parser failure is a bad response
            if self.busy:
                self.busy = False
                self.load.rec.error("bad response", str(e))
            self.failed = True
            self.close()

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status != 200:
            self.err_body = []

    def on_body(self, body: bytes) -> None:
        if self.err_body is not None and sum(map(len, self.err_body)) < EXAMPLE_BYTES:
            self.err_body.append(body)

    def on_message_complete(self) -> None:
        t1 = monotonic_ns()
        if not self.busy:  # an answer nobody asked for (after a timeout)
            self.close()
            return
        self.busy = False
        rec = self.load.rec
        if self.status == 200:
            rec.ends.append(t1)
            rec.lats.append(t1 - self.t0)
            rec.sends.append(self.send_ns)
            rec.recvs.append(t1 - self.t_first)
        else:
            key = f"HTTP {self.status}"
            body = b"".join(self.err_body or [])
            rec.error(key, body.decode(errors="replace").strip())
        if self.parser.should_keep_alive():
            self.load.ready(self)
        else:
            self.close()

    def close(self) -> None:
        if self.tr is not None and not self.tr.is_closing():
            self.tr.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy:
            self.busy = False
            self.failed = True
            self.load.rec.error("connection lost", str(exc or "the server closed the connection"))
        self.load.lost(self)


class HttpLoad(Load):
    """The HTTP load of one worker: a connection per request in flight."""

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(spec, loop, spec.requests)
        self.conns: set[HttpConn] = set()
        self.idle: deque[HttpConn] = deque()
        self.connecting = 0
        self.start_timeout_checks()

    def ready(self, conn: HttpConn) -> None:
        """``conn`` finished a request (or just connected): give it work or park it."""
        if self.mode == "concurrency":
            if len(self.conns) + self.connecting > self.target:
                self.conns.discard(conn)
                conn.close()
                return
            conn.send(self.next_request())
        elif self.mode == "rate" and self.pending > 0:
            self.pending -= 1
            conn.send(self.next_request())
        else:
            self.idle.append(conn)

    def lost(self, conn: HttpConn) -> None:
        """``conn`` closed: replace it if the load still wants it."""
        self.conns.discard(conn)
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)
        if self.closing or not self._wants_connection():
            return
        if conn.failed:
            # A short pause, so a server that drops every connection is not hammered.
            self.loop.call_later(0.005, self._maybe_open)
        else:  # closed after a complete answer (no keep-alive): replace it at once
            self._maybe_open()

    def _wants_connection(self, attempts: int = 0) -> bool:
        """Whether one more connection is wanted, not counting ``attempts`` of those
        under way."""
        have = len(self.conns) + self.connecting - attempts
        if self.mode == "concurrency":
            return have < self.target
        if self.mode == "rate":
            return self.pending > 0 and have < self.max_conns
        return False

    def _maybe_open(self) -> None:
        if not self.closing and self._wants_connection():
            self._open()

    def _open(self) -> None:
        self.connecting += 1
        asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        conn: HttpConn | None = None
        try:
            # This attempt counts in self.connecting: want one more than the others.
            conn = await self.open_connection(
                lambda: HttpConn(self), lambda: self._wants_connection(1)
            )
            if conn is not None:
                self.conns.add(conn)
        finally:
            self.connecting -= 1
        if conn is not None:
            self.ready(conn)

    def expire(self, now: int) -> None:
        for conn in list(self.conns):
            if conn.busy and now - conn.t0 > self.timeout_ns:
                conn.busy = False
                conn.failed = True
                self.timed_out()
                conn.close()

    def set_concurrency(self, n: int) -> None:
        self._stop_timer()
        self.mode = "concurrency"
        self.target = n
        self.pending = 0
        while self.idle and len(self.conns) + self.connecting > n:
            conn = self.idle.popleft()
            self.conns.discard(conn)
            conn.close()
        idle = list(self.idle)
        self.idle.clear()
        for conn in idle:
            self.ready(conn)
        for _ in range(max(0, n - len(self.conns) - self.connecting)):
            self._open()

    def arrival(self) -> None:
        if self.idle:
            self.idle.popleft().send(self.next_request())
            return
        if self.pending >= MAX_PENDING:
            self.drop()
            return
        self.pending += 1
        if len(self.conns) + self.connecting < self.max_conns:
            self._open()
        else:
            self.rec.delayed += 1

    def outstanding(self) -> int:
        return sum(1 for c in self.conns if c.busy)

    def close_connections(self) -> None:
        for conn in list(self.conns):
            conn.close()
