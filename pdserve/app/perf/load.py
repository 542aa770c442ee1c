"""What every load of a ``pdserve perf`` worker shares: its orders
(:class:`WorkerSpec`), the record of what completed (:class:`Recorder`), and
:class:`Load`, the base of the HTTP and gRPC loads (request rotation, the open
loop's arrival schedule, connecting with backoff, the timeout check).

Imported by the worker processes: no numpy, nothing of the coordinator.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import NotRequired, TypedDict, TypeVar

monotonic_ns = time.monotonic_ns

#: Most open-loop requests waiting for a connection; more are dropped (counted).
MAX_PENDING = 100_000
#: Longest wait between two connection attempts (seconds).
MAX_BACKOFF_S = 0.25
#: First wait between two connection attempts (seconds); doubles up to the longest.
FIRST_BACKOFF_S = 0.005
#: How often outstanding requests are checked against the timeout (seconds).
TIMEOUT_CHECK_S = 0.1
#: Bytes of an error response kept as its example.
EXAMPLE_BYTES = 300

_P = TypeVar("_P", bound=asyncio.BaseProtocol)


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


class WindowRecord(TypedDict):
    """One worker's share of a window, as :meth:`Recorder.collect` returns it."""

    cpu_s: float
    #: Latencies of the window's successes, ns, as an ``array('q')``'s bytes.
    lat: bytes
    send_ns: int
    recv_ns: int
    #: Failures by kind, and one example message per kind.
    errors: dict[str, int]
    examples: dict[str, str]
    sent: int
    delayed: int
    #: Requests in flight when the window was collected (added by the worker).
    outstanding: NotRequired[int]


class Recorder:
    """Completed requests (end time and latency, ns), failures by kind, counters. A
    latency runs from just before the request is written to the end of its answer.

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

    def ok(self, t1: int, latency: int) -> None:
        """A success ending at ``t1`` (a client without send/receive split)."""
        self.ends.append(t1)
        self.lats.append(latency)
        self.sends.append(0)
        self.recvs.append(0)

    def error(self, key: str, example: str = "") -> None:
        self.err_ends.append(monotonic_ns())
        self.err_keys.append(key)
        if key not in self.examples:
            self.examples[key] = example[:EXAMPLE_BYTES]

    def collect(self, t0: int, t1: int) -> WindowRecord:
        """What completed in ``[t0, t1)``; everything before ``t1`` is dropped."""
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


def conn_error_key(e: BaseException) -> str:
    """The failure kind of a connection attempt that raised ``e``."""
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError | asyncio.TimeoutError):
        return "connect timeout"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    return type(e).__name__


class Load:
    """The load of one worker: closed loop (``set_concurrency``), open loop
    (``set_rate``) or idle. Subclasses say what one open-loop arrival does
    (:meth:`arrival`), how the closed loop starts, and how they close."""

    def __init__(
        self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop, requests: list[bytes]
    ) -> None:
        self.spec = spec
        self.loop = loop
        self.rec = Recorder()
        self.reqs = requests
        self.ri = 0
        self.mode = "idle"
        self.target = 0
        self.max_conns = 0
        self.pending = 0
        self.timer: asyncio.TimerHandle | None = None
        self.checker: asyncio.TimerHandle | None = None
        self.next_t = 0
        self.interval_ns = 0.0
        self.poisson = False
        self.gaps: list[float] = []
        self.rng = random.Random(spec.seed + 7919 * spec.index)
        self.timeout_ns = int(spec.request_timeout_s * 1e9)
        self.closing = False

    # -- requests
    def next_request(self) -> bytes:
        """The next request, round-robin."""
        reqs = self.reqs
        if len(reqs) == 1:
            return reqs[0]
        r = reqs[self.ri]
        self.ri = (self.ri + 1) % len(reqs)
        return r

    def drop(self) -> None:
        """Count an open-loop arrival with :data:`MAX_PENDING` already waiting."""
        self.rec.error("dropped", "the client could not keep up with the request rate")

    def timed_out(self) -> None:
        """Count a request unanswered after ``request_timeout_s``."""
        self.rec.error("timeout", f"no answer within {self.spec.request_timeout_s:g} s")

    # -- modes
    def set_concurrency(self, n: int) -> None:
        """Closed loop: ``n`` requests in flight."""
        raise NotImplementedError

    def set_rate(self, rate: float, phase_s: float, max_conns: int, distribution: str) -> None:
        """Open loop: ``rate`` requests/s (``constant`` spacing, the first ``phase_s``
        in, or ``poisson`` arrivals), at most ``max_conns`` in flight."""
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
        """Send nothing new (connections stay open)."""
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
            self.arrival()
            self.next_t += int(self._gap())
        self.arrivals_done()
        self.timer = self.loop.call_later((self.next_t - now) / 1e9, self._tick)

    def arrival(self) -> None:
        """One open-loop request is due: send it, queue it, or drop it."""
        raise NotImplementedError

    def arrivals_done(self) -> None:
        """After the arrivals due at one tick."""

    def outstanding(self) -> int:
        """Requests in flight."""
        raise NotImplementedError

    # -- connections
    async def open_connection(
        self, factory: Callable[[], _P], wanted: Callable[[], bool]
    ) -> _P | None:
        """Connect to the server while ``wanted()``: a failed attempt is counted and
        retried after a backoff. None when no longer wanted (or closing)."""
        backoff = FIRST_BACKOFF_S
        while not self.closing and wanted():
            try:
                _, made = await asyncio.wait_for(
                    self.loop.create_connection(factory, self.spec.host, self.spec.port),
                    self.spec.connect_timeout_s,
                )
            except (TimeoutError, OSError) as e:
                self.rec.error(conn_error_key(e), str(e))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            return made
        return None

    def start_timeout_checks(self) -> None:
        """Check :meth:`expire` every :data:`TIMEOUT_CHECK_S` until closing."""
        self.checker = self.loop.call_later(TIMEOUT_CHECK_S, self._check_timeouts)

    def _check_timeouts(self) -> None:
        self.expire(monotonic_ns())
        if not self.closing:
            self.start_timeout_checks()

    def expire(self, now: int) -> None:
        """Fail the requests in flight for longer than ``request_timeout_s``."""

    def close_connections(self) -> None:
        """Abort every connection."""

    async def aclose(self) -> None:
        """Stop sending and close every connection."""
        self.closing = True
        self._stop_timer()
        if self.checker is not None:
            self.checker.cancel()
        self.close_connections()
        await asyncio.sleep(0)
