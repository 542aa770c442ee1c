"""A load-generating process of ``pdserve perf``.

Each worker is a separate process (``python -m pdserve.app.perf.worker FD``) with
one event loop, so the load is not capped by one interpreter, and each imports
little (no numpy): it starts in about 0.1 s. The coordinator
(:mod:`pdserve.app.perf.runner`) drives it over a pipe:

``("load", "concurrency", n)``
    closed loop: ``n`` connections, each sending its next request as soon as the
    previous answer ends;
``("load", "rate", rate, phase_s, max_conns, distribution)``
    open loop: requests at ``rate`` per second (``constant`` spacing, first one
    ``phase_s`` in, or ``poisson`` arrivals) on up to ``max_conns`` connections;
    a request finding none free waits and counts as delayed;
``("idle",)``
    send nothing new (connections stay open);
``("collect", t0_ns, t1_ns)``
    answer ``("window", dict)`` with what completed in ``[t0, t1)`` (and the
    process's CPU time since the last collect) and drop everything before ``t1``;
``("exit",)``
    close everything and end.

HTTP: raw HTTP/1.1 keep-alive connections on uvloop, requests as prepared bytes
(:meth:`~pdserve.app.perf.inputs.HttpRequest.wire`), responses parsed by
``httptools``; each completion sends the next request from the protocol callback
itself (no task, no future per request). gRPC: by default raw HTTP/2 on uvloop
(:mod:`~pdserve.app.perf.h2grpc`), or ``grpc.aio`` (``grpc_client="grpcio"``); the
request is serialized once (no protobuf work per request; answers are not
decoded).

Latency is from just before the request is written to the end of its response. A
request unanswered after ``request_timeout_s`` fails (``timeout``) and its
connection is closed; connecting is retried with backoff (each failure counted),
so a server that is down gives a bounded stream of errors, not a busy loop.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import pickle
import random
import signal
import sys
import time
import traceback
from array import array
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

monotonic_ns = time.monotonic_ns

#: Most open-loop requests waiting for a connection; more are dropped (counted).
MAX_PENDING = 100_000
#: Longest wait between two connection attempts (seconds).
MAX_BACKOFF_S = 0.25
#: How often outstanding requests are checked against the timeout (seconds).
TIMEOUT_CHECK_S = 0.1
#: Bytes of an error response kept as its example.
EXAMPLE_BYTES = 300


@dataclass
class WorkerSpec:
    """What a worker needs: where to send, what, and its limits.

    ``requests``: complete HTTP/1.1 request bytes, or serialized gRPC
    ``ModelInferRequest`` messages; sent round-robin.
    """

    index: int
    protocol: str
    host: str
    port: int
    requests: list[bytes]
    request_timeout_s: float
    connect_timeout_s: float
    seed: int = 0
    #: gRPC: ``raw`` (:mod:`~pdserve.app.perf.h2grpc`) or ``grpcio`` (``grpc.aio``).
    grpc_client: str = "raw"


class _Recorder:
    """Completed requests (end time and latency, ns), failures by kind, counters.

    End times are appended as requests complete on one event loop with a
    monotonic clock, so each list is in ascending order and a window is found by
    bisection.
    """

    def __init__(self) -> None:
        self.ends: list[int] = []
        self.lats: list[int] = []
        self.sends: list[int] = []
        self.recvs: list[int] = []
        self.err_ends: list[int] = []
        self.err_keys: list[str] = []
        self.examples: dict[str, str] = {}
        self.sent = 0
        self.delayed = 0
        self._sent_mark = 0
        self._delayed_mark = 0
        self._cpu_mark = time.process_time()

    def error(self, key: str, example: str = "") -> None:
        self.err_ends.append(monotonic_ns())
        self.err_keys.append(key)
        if key not in self.examples:
            self.examples[key] = example[:EXAMPLE_BYTES]

    def collect(self, t0: int, t1: int) -> dict[str, Any]:
        i = bisect.bisect_left(self.ends, t1)
        j = bisect.bisect_left(self.ends, t0, 0, i)
        lat = array("q", self.lats[j:i])
        send_ns = sum(self.sends[j:i])
        recv_ns = sum(self.recvs[j:i])
        del self.ends[:i], self.lats[:i], self.sends[:i], self.recvs[:i]
        ei = bisect.bisect_left(self.err_ends, t1)
        ej = bisect.bisect_left(self.err_ends, t0, 0, ei)
        errors: dict[str, int] = {}
        for k in self.err_keys[ej:ei]:
            errors[k] = errors.get(k, 0) + 1
        del self.err_ends[:ei], self.err_keys[:ei]
        sent, self._sent_mark = self.sent - self._sent_mark, self.sent
        delayed, self._delayed_mark = self.delayed - self._delayed_mark, self.delayed
        cpu = time.process_time()
        cpu_s, self._cpu_mark = cpu - self._cpu_mark, cpu
        return {
            "cpu_s": cpu_s,
            "lat": lat.tobytes(),
            "send_ns": send_ns,
            "recv_ns": recv_ns,
            "errors": errors,
            "examples": {k: v for k, v in self.examples.items() if k in errors},
            "sent": sent,
            "delayed": delayed,
        }


def _conn_error_key(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError | asyncio.TimeoutError):
        return "connect timeout"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    return type(e).__name__


class _HttpConn(asyncio.Protocol):
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

    def __init__(self, load: _HttpLoad) -> None:
        import httptools

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


class _HttpLoad:
    """The HTTP load of one worker: closed loop, open loop or idle."""

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> None:
        self.spec = spec
        self.loop = loop
        self.rec = _Recorder()
        self.reqs = spec.requests
        self.ri = 0
        self.mode = "idle"
        self.target = 0
        self.max_conns = 0
        self.conns: set[_HttpConn] = set()
        self.idle: deque[_HttpConn] = deque()
        self.connecting = 0
        self.pending = 0
        self.timer: asyncio.TimerHandle | None = None
        self.next_t = 0
        self.interval_ns = 0.0
        self.poisson = False
        self.rng = random.Random(spec.seed + 7919 * spec.index)
        self.gaps: list[float] = []
        self.timeout_ns = int(spec.request_timeout_s * 1e9)
        self.checker = loop.call_later(TIMEOUT_CHECK_S, self._check_timeouts)
        self.closing = False

    # -- requests
    def _next_request(self) -> bytes:
        reqs = self.reqs
        if len(reqs) == 1:
            return reqs[0]
        r = reqs[self.ri]
        self.ri = (self.ri + 1) % len(reqs)
        return r

    def ready(self, conn: _HttpConn) -> None:
        """``conn`` finished a request (or just connected): give it work or park it."""
        if self.mode == "concurrency":
            if len(self.conns) + self.connecting > self.target:
                self.conns.discard(conn)
                conn.close()
                return
            conn.send(self._next_request())
        elif self.mode == "rate" and self.pending > 0:
            self.pending -= 1
            conn.send(self._next_request())
        else:
            self.idle.append(conn)

    def lost(self, conn: _HttpConn) -> None:
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

    def _wants_connection(self) -> bool:
        have = len(self.conns) + self.connecting
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
        backoff = 0.005
        conn: _HttpConn | None = None
        try:
            while not self.closing:
                # This attempt counts in self.connecting: want one more than the others.
                have = len(self.conns) + self.connecting - 1
                if self.mode == "concurrency":
                    wanted = have < self.target
                else:
                    wanted = self.mode == "rate" and self.pending > 0 and have < self.max_conns
                if not wanted:
                    return
                try:
                    _, made = await asyncio.wait_for(
                        self.loop.create_connection(
                            lambda: _HttpConn(self), self.spec.host, self.spec.port
                        ),
                        self.spec.connect_timeout_s,
                    )
                except (TimeoutError, OSError) as e:
                    self.rec.error(_conn_error_key(e), str(e))
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                    continue
                self.conns.add(made)
                conn = made
                break
        finally:
            self.connecting -= 1
        if conn is not None:
            self.ready(conn)

    def _check_timeouts(self) -> None:
        now = monotonic_ns()
        for conn in list(self.conns):
            if conn.busy and now - conn.t0 > self.timeout_ns:
                conn.busy = False
                conn.failed = True
                self.rec.error("timeout", f"no answer within {self.spec.request_timeout_s:g} s")
                conn.close()
        if not self.closing:
            self.checker = self.loop.call_later(TIMEOUT_CHECK_S, self._check_timeouts)

    # -- modes
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

    def set_rate(self, rate: float, phase_s: float, max_conns: int, distribution: str) -> None:
        self._stop_timer()
        self.mode = "rate"
        self.max_conns = max(1, max_conns)
        self.pending = 0
        self.interval_ns = 1e9 / rate
        self.poisson = distribution == "poisson"
        self.gaps = []
        first = self._gap() if self.poisson else phase_s * 1e9
        self.next_t = monotonic_ns() + int(first)
        self._tick()

    def set_idle(self) -> None:
        self._stop_timer()
        self.mode = "idle"
        self.pending = 0

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _gap(self) -> float:
        if not self.poisson:
            return self.interval_ns
        if not self.gaps:
            self.gaps = [self.rng.expovariate(1.0 / self.interval_ns) for _ in range(1024)]
        return self.gaps.pop()

    def _tick(self) -> None:
        if self.mode != "rate":
            return
        now = monotonic_ns()
        while self.next_t <= now:
            self._dispatch()
            self.next_t += int(self._gap())
        self.timer = self.loop.call_later((self.next_t - now) / 1e9, self._tick)

    def _dispatch(self) -> None:
        if self.idle:
            self.idle.popleft().send(self._next_request())
            return
        if self.pending >= MAX_PENDING:
            self.rec.error("dropped", "the client could not keep up with the request rate")
            return
        self.pending += 1
        if len(self.conns) + self.connecting < self.max_conns:
            self._open()
        else:
            self.rec.delayed += 1

    def outstanding(self) -> int:
        return sum(1 for c in self.conns if c.busy)

    async def aclose(self) -> None:
        self.closing = True
        self._stop_timer()
        self.checker.cancel()
        for conn in list(self.conns):
            conn.close()
        await asyncio.sleep(0)


class _GrpcLoad:
    """The gRPC load of one worker (``grpc.aio``, one channel)."""

    METHOD = "/inference.GRPCInferenceService/ModelInfer"

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> None:
        import grpc

        self.grpc = grpc
        self.spec = spec
        self.loop = loop
        self.rec = _Recorder()
        self.reqs = spec.requests
        self.ri = 0
        self.mode = "idle"
        self.target = 0
        self.active = 0
        self.inflight = 0
        self.max_conns = 0
        self.pending = 0
        self.timer: asyncio.TimerHandle | None = None
        self.next_t = 0
        self.interval_ns = 0.0
        self.poisson = False
        self.gaps: list[float] = []
        self.rng = random.Random(spec.seed + 7919 * spec.index)
        self.closing = False
        self.channel = grpc.aio.insecure_channel(
            f"{spec.host}:{spec.port}",
            options=[
                ("grpc.max_send_message_length", -1),
                ("grpc.max_receive_message_length", -1),
            ],
        )
        self.call = self.channel.unary_unary(
            self.METHOD, request_serializer=None, response_deserializer=None
        )
        self.tasks: set[asyncio.Task[None]] = set()

    def _next_request(self) -> bytes:
        reqs = self.reqs
        if len(reqs) == 1:
            return reqs[0]
        r = reqs[self.ri]
        self.ri = (self.ri + 1) % len(reqs)
        return r

    async def _one(self) -> None:
        rec = self.rec
        req = self._next_request()
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
        rec.ends.append(t1)
        rec.lats.append(t1 - t0)
        rec.sends.append(0)
        rec.recvs.append(0)

    def _spawn(self, coro: Any) -> None:
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

    def set_rate(self, rate: float, phase_s: float, max_conns: int, distribution: str) -> None:
        self._stop_timer()
        self.mode = "rate"
        self.max_conns = max(1, max_conns)
        self.pending = 0
        self.interval_ns = 1e9 / rate
        self.poisson = distribution == "poisson"
        self.gaps = []
        first = self._gap() if self.poisson else phase_s * 1e9
        self.next_t = monotonic_ns() + int(first)
        self._tick()

    def set_idle(self) -> None:
        self._stop_timer()
        self.mode = "idle"
        self.pending = 0

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _gap(self) -> float:
        if not self.poisson:
            return self.interval_ns
        if not self.gaps:
            self.gaps = [self.rng.expovariate(1.0 / self.interval_ns) for _ in range(1024)]
        return self.gaps.pop()

    def _tick(self) -> None:
        if self.mode != "rate":
            return
        now = monotonic_ns()
        while self.next_t <= now:
            if self.inflight < self.max_conns:
                self._spawn(self._rate_task())
            elif self.pending >= MAX_PENDING:
                self.rec.error("dropped", "the client could not keep up with the request rate")
            else:
                self.pending += 1
                self.rec.delayed += 1
            self.next_t += int(self._gap())
        self.timer = self.loop.call_later((self.next_t - now) / 1e9, self._tick)

    def outstanding(self) -> int:
        return self.active if self.mode == "concurrency" else self.inflight

    async def aclose(self) -> None:
        self.closing = True
        self._stop_timer()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.channel.close(grace=None)


class _H2Load:
    """The gRPC load of one worker over :class:`~pdserve.app.perf.h2grpc.H2Connection`
    (one HTTP/2 connection carrying every call in flight; a new one replaces it when
    it closes or the server sends GOAWAY)."""

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> None:
        from pdserve.app.perf.h2grpc import grpc_message

        self.spec = spec
        self.loop = loop
        self.rec = _Recorder()
        self.reqs = [grpc_message(r) for r in spec.requests]
        self.ri = 0
        self.mode = "idle"
        self.target = 0
        self.max_conns = 0
        self.pending = 0
        self.inflight = 0
        self.conn: Any = None
        self.conns: set[Any] = set()
        self.connecting = False
        self.streak = 0
        self.timer: asyncio.TimerHandle | None = None
        self.next_t = 0
        self.interval_ns = 0.0
        self.poisson = False
        self.gaps: list[float] = []
        self.rng = random.Random(spec.seed + 7919 * spec.index)
        self.timeout_ns = int(spec.request_timeout_s * 1e9)
        self.closing = False
        self.checker = loop.call_later(TIMEOUT_CHECK_S, self._check_timeouts)

    def _next_request(self) -> bytes:
        reqs = self.reqs
        if len(reqs) == 1:
            return reqs[0]
        r = reqs[self.ri]
        self.ri = (self.ri + 1) % len(reqs)
        return r

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
            conn.call(self._next_request())
            self.inflight += 1
            self.rec.sent += 1

    def _finished(self, st: Any, error: str | None, message: str) -> None:
        t1 = monotonic_ns()
        self.inflight -= 1
        rec = self.rec
        if error is None:
            self.streak = 0
            rec.ends.append(t1)
            rec.lats.append(t1 - st.t0)
            rec.sends.append(0)
            rec.recvs.append(0)
        else:
            rec.error(error, message)
        self._fill()

    def _lost(self, conn: Any) -> None:
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
        from pdserve.app.perf.h2grpc import H2Connection

        backoff = 0.005
        host, port = self.spec.host, self.spec.port
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            while not self.closing and self._wanted() > 0:
                try:
                    _, conn = await asyncio.wait_for(
                        self.loop.create_connection(
                            lambda: H2Connection(
                                authority, self._finished, self._lost, monotonic_ns
                            ),
                            self.spec.host,
                            self.spec.port,
                        ),
                        self.spec.connect_timeout_s,
                    )
                except (TimeoutError, OSError) as e:
                    self.rec.error(_conn_error_key(e), str(e))
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                    continue
                self.conn = conn
                self.conns.add(conn)
                break
        finally:
            self.connecting = False
        self._fill()

    def _check_timeouts(self) -> None:
        now = monotonic_ns()
        expired = [
            (c, st)
            for c in self.conns
            for st in list(c.streams.values())
            if now - st.t0 > self.timeout_ns
        ]
        for conn, st in expired:
            conn.cancel(st)
            self.inflight -= 1
            self.rec.error("timeout", f"no answer within {self.spec.request_timeout_s:g} s")
        if expired:
            self._fill()
        if not self.closing:
            self.checker = self.loop.call_later(TIMEOUT_CHECK_S, self._check_timeouts)

    def set_concurrency(self, n: int) -> None:
        self._stop_timer()
        self.mode = "concurrency"
        self.target = n
        self.pending = 0
        self._fill()

    def set_rate(self, rate: float, phase_s: float, max_conns: int, distribution: str) -> None:
        self._stop_timer()
        self.mode = "rate"
        self.max_conns = max(1, max_conns)
        self.pending = 0
        self.interval_ns = 1e9 / rate
        self.poisson = distribution == "poisson"
        self.gaps = []
        first = self._gap() if self.poisson else phase_s * 1e9
        self.next_t = monotonic_ns() + int(first)
        self._tick()

    def set_idle(self) -> None:
        self._stop_timer()
        self.mode = "idle"
        self.pending = 0

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _gap(self) -> float:
        if not self.poisson:
            return self.interval_ns
        if not self.gaps:
            self.gaps = [self.rng.expovariate(1.0 / self.interval_ns) for _ in range(1024)]
        return self.gaps.pop()

    def _tick(self) -> None:
        if self.mode != "rate":
            return
        now = monotonic_ns()
        while self.next_t <= now:
            if self.pending >= MAX_PENDING:
                self.rec.error("dropped", "the client could not keep up with the request rate")
            else:
                if self.inflight + self.pending >= self.max_conns:
                    self.rec.delayed += 1
                self.pending += 1
            self.next_t += int(self._gap())
        self._fill()
        self.timer = self.loop.call_later((self.next_t - now) / 1e9, self._tick)

    def outstanding(self) -> int:
        return self.inflight

    async def aclose(self) -> None:
        self.closing = True
        self._stop_timer()
        self.checker.cancel()
        for conn in list(self.conns):
            conn.close()
        await asyncio.sleep(0)


class _Worker:
    """Reads the coordinator's commands from the pipe and applies them to the load."""

    def __init__(self, conn: Connection, spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> None:
        self.conn = conn
        self.loop = loop
        self.load: _HttpLoad | _GrpcLoad | _H2Load
        if spec.protocol != "grpc":
            self.load = _HttpLoad(spec, loop)
        elif spec.grpc_client == "grpcio":
            self.load = _GrpcLoad(spec, loop)
        else:
            self.load = _H2Load(spec, loop)
        self.done: asyncio.Future[None] = loop.create_future()

    def on_command(self) -> None:
        try:
            while self.conn.poll():
                self.handle(self.conn.recv())
        except (EOFError, OSError):  # the coordinator is gone
            self.finish()
        except Exception:  # noqa: BLE001 - reported to the coordinator, then end
            with contextlib.suppress(OSError):
                self.conn.send(("fatal", traceback.format_exc()))
            self.finish()

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "load":
            if msg[1] == "concurrency":
                self.load.set_concurrency(int(msg[2]))
            else:
                self.load.set_rate(float(msg[2]), float(msg[3]), int(msg[4]), str(msg[5]))
        elif kind == "idle":
            self.load.set_idle()
        elif kind == "collect":
            window = self.load.rec.collect(int(msg[1]), int(msg[2]))
            window["outstanding"] = self.load.outstanding()
            self.conn.send(("window", window))
        elif kind == "exit":
            self.finish()

    def finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _serve(conn: Connection, spec: WorkerSpec) -> None:
    loop = asyncio.get_running_loop()
    worker = _Worker(conn, spec, loop)
    loop.add_reader(conn.fileno(), worker.on_command)
    conn.send(("ready", os.getpid()))
    try:
        await worker.done
    finally:
        loop.remove_reader(conn.fileno())
        await worker.load.aclose()


def main(conn: Connection, spec: WorkerSpec) -> None:
    """Serve the coordinator's commands on ``conn`` until ``exit`` or until the
    pipe closes. Ctrl-C is left to the coordinator (it stops the workers and keeps
    the results so far)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if spec.protocol == "http" or spec.grpc_client != "grpcio":
            try:
                import uvloop

                uvloop.run(_serve(conn, spec))
                return
            except ImportError:
                pass
        asyncio.run(_serve(conn, spec))
    except Exception:  # noqa: BLE001 - reported to the coordinator
        with contextlib.suppress(OSError):
            conn.send(("fatal", traceback.format_exc()))


if __name__ == "__main__":
    # ``python -m pdserve.app.perf.worker FD``: FD is this end of a socket pair; the
    # first message on it is the pickled WorkerSpec. Started this way (not through
    # multiprocessing) a worker imports only asyncio, uvloop/httptools or grpc.
    _conn = Connection(int(sys.argv[1]))
    main(_conn, pickle.loads(_conn.recv_bytes()))
