"""The coordinator of ``pdserve perf``: :func:`run_sweep` measures each load level
in windows until stable, with the server-side breakdown of each window.

Per level (perf_analyzer's ``InferenceProfiler::ProfileHelper``): the workers switch
to the level's load (connections kept from the level before); windows of
``measurement_interval_ms`` follow back to back, and at each boundary the statistics
extension is read and every worker says what completed in the window. The level
ends when the last 3 windows are stable, after ``max_trials`` windows (``stable:
false``), or at a window without a successful response (``aborted``; the sweep
stops there).

Everything is bounded: each level by ``max_trials`` windows, each request by
``request_timeout_s``, each control call and worker answer by a timeout. Ctrl-C
stops the sweep and keeps what was measured so far.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import numpy as np

import pdserve
from pdserve.app.perf.control import Control, HttpControl, connect, split_host_port
from pdserve.app.perf.inputs import HttpRequest, ModelSpec, build_requests
from pdserve.app.perf.load import WindowRecord, WorkerSpec
from pdserve.app.perf.options import PerfError, PerfOptions
from pdserve.app.perf.stats import (
    PointResult,
    RunInfo,
    ServerCounters,
    Window,
    is_stable,
    point_result,
)
from pdserve.app.perf.worker import Command

#: Seconds a worker may take to start (spawn + imports) or to answer a collect.
WORKER_START_TIMEOUT_S = 60.0
WORKER_ANSWER_TIMEOUT_S = 30.0

#: A worker busier than this share of one CPU may itself limit the load (warned).
CLIENT_BUSY_WARNING = 0.9

#: Auto mode: at most this many worker processes per available CPU, and in all.
WORKERS_PER_CPU = 4
MAX_AUTO_WORKERS = 8


class Progress(Protocol):
    """Receives what happens during a sweep (the CLI's live display)."""

    def start(self, info: RunInfo) -> None:
        """Before the first level: ``model``, ``url``, ``protocol``, ``mode``,
        ``levels``, ``workers``, ``server_stats`` (bool), ``batch_size``."""

    def window(
        self, mode: str, level: float, trial: int, window: Window, stable: bool, batch_size: int
    ) -> None:
        """After each window (``trial`` counts from 1)."""

    def level_done(self, point: PointResult) -> None:
        """After each level."""

    def note(self, text: str) -> None:
        """A warning or remark for the user."""


class NullProgress:
    """A :class:`Progress` that shows nothing."""

    def start(self, info: RunInfo) -> None:
        """Nothing."""

    def window(
        self, mode: str, level: float, trial: int, window: Window, stable: bool, batch_size: int
    ) -> None:
        """Nothing."""

    def level_done(self, point: PointResult) -> None:
        """Nothing."""

    def note(self, text: str) -> None:
        """Nothing."""


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under ``taskset``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def auto_workers(opts: PerfOptions) -> int:
    """How many worker processes a run uses when ``opts.workers`` is 0: one per
    request in flight at the highest concurrency (the request-rate mode counts
    :data:`MAX_AUTO_WORKERS`), at most :data:`WORKERS_PER_CPU` per CPU this process
    may use and :data:`MAX_AUTO_WORKERS` in all.

    Several processes rather than one event loop: on a CPU shared with other
    processes each of them gets its own share of the scheduler (as perf_analyzer's
    thread per request does), which keeps the client's own queueing out of the
    latencies.
    """
    mode, levels = opts.levels()
    peak = int(max(levels)) if mode == "concurrency" else MAX_AUTO_WORKERS
    return max(1, min(peak, WORKERS_PER_CPU * available_cpus(), MAX_AUTO_WORKERS))


def split(total: int, parts: int) -> list[int]:
    """``total`` spread over ``parts`` as evenly as possible (first ones get more)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class WorkerPool:
    """The worker processes of one run and their pipes."""

    def __init__(self, count: int, spec: WorkerSpec) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pipes: list[Connection] = []
        env = dict(os.environ)
        # The workers import this very pdserve, wherever it is (installed or a checkout).
        root = str(Path(pdserve.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            for i in range(count):
                mine, theirs = socket.socketpair()
                proc = subprocess.Popen(
                    [sys.executable, "-m", "pdserve.app.perf.worker", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    env=env,
                )
                theirs.close()
                pipe = Connection(mine.detach())
                self.procs.append(proc)
                self.pipes.append(pipe)
                spec_i = WorkerSpec(**{**spec.__dict__, "index": i})
                pipe.send_bytes(pickle.dumps(spec_i))
            for i, pipe in enumerate(self.pipes):
                msg = self._recv(i, pipe, WORKER_START_TIMEOUT_S, "start")
                if msg[0] != "ready":
                    raise PerfError(f"load worker {i} did not start: {msg!r}")
        except BaseException:
            self.close()
            raise

    def _recv(self, i: int, pipe: Connection, timeout: float, what: str) -> tuple[Any, ...]:
        if not pipe.poll(timeout):
            raise PerfError(f"load worker {i} did not {what} within {timeout:g} s")
        try:
            msg = pipe.recv()
        except (EOFError, OSError):
            raise PerfError(f"load worker {i} ended unexpectedly") from None
        if msg[0] == "fatal":
            raise PerfError(f"load worker {i} failed:\n{msg[1]}")
        return tuple(msg)

    def _send_all(self, msgs: Sequence[Command]) -> None:
        for i, (pipe, msg) in enumerate(zip(self.pipes, msgs, strict=True)):
            try:
                pipe.send(msg)
            except (OSError, EOFError):
                raise PerfError(f"load worker {i} ended unexpectedly") from None

    def set_concurrency(self, total: int) -> None:
        """Closed loop with ``total`` requests in flight over all workers."""
        self._send_all(
            [("load", "concurrency", n) if n else ("idle",) for n in split(total, len(self.pipes))]
        )

    def set_rate(self, rate: float, max_conns: int, distribution: str) -> None:
        """Open loop at ``rate`` requests/s over all workers; constant arrivals are
        interleaved (worker ``i`` starts ``i / rate`` seconds in)."""
        n = len(self.pipes)
        conns = [max(1, c) for c in split(max_conns, n)]
        self._send_all(
            [("load", "rate", rate / n, i / rate, conns[i], distribution) for i in range(n)]
        )

    def idle(self) -> None:
        """Stop sending new requests."""
        self._send_all([("idle",)] * len(self.pipes))

    def collect(self, t0: int, t1: int) -> list[WindowRecord]:
        """Every worker's record of ``[t0, t1)``."""
        self._send_all([("collect", t0, t1)] * len(self.pipes))
        return [
            self._recv(i, pipe, WORKER_ANSWER_TIMEOUT_S, "answer")[1]
            for i, pipe in enumerate(self.pipes)
        ]

    def close(self) -> None:
        """Stop the workers (exit, then kill what is left after 3 s)."""
        for pipe in self.pipes:
            try:
                pipe.send(("exit",))
            except (OSError, EOFError):
                pass
        deadline = time.monotonic() + 3.0
        for p in self.procs:
            try:
                p.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for pipe in self.pipes:
            pipe.close()
        self.procs, self.pipes = [], []


def window_from_parts(
    parts: Sequence[WindowRecord], t0: int, t1: int, server: Reading | None
) -> Window:
    """Merge the workers' records of one window (``server``: the statistics delta
    over it, the model's and its composing models')."""
    lat = np.sort(
        np.concatenate([np.frombuffer(p["lat"], dtype=np.int64) for p in parts])
        if parts
        else np.zeros(0, dtype=np.int64)
    )
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for p in parts:
        for k, n in p["errors"].items():
            errors[k] = errors.get(k, 0) + n
        for k, text in p["examples"].items():
            examples.setdefault(k, text)
    return Window(
        start_ns=t0,
        end_ns=t1,
        latencies_ns=lat,
        send_ns=sum(p["send_ns"] for p in parts),
        recv_ns=sum(p["recv_ns"] for p in parts),
        errors=errors,
        error_examples=examples,
        sent=sum(p["sent"] for p in parts),
        delayed=sum(p["delayed"] for p in parts),
        server=server[0] if server is not None else None,
        composing=server[1] if server is not None else {},
        client_cpu_s=sum(p["cpu_s"] for p in parts),
        client_cpu_max_s=max((p["cpu_s"] for p in parts), default=0.0),
    )


def describe_failure(window: Window, label: str, outstanding: int) -> str:
    """Why a window without a successful response ends the sweep, for the user."""
    secs = window.duration_s
    if window.errors:
        counts = ", ".join(f"{k}: {n}" for k, n in sorted(window.errors.items()))
        key = max(window.errors, key=lambda k: window.errors[k])
        example = window.error_examples.get(key, "")
        text = f"no successful response in a {secs:g} s window at {label} ({counts})"
        return text + (f"; {key}: {example}" if example else "")
    return (
        f"no response in a {secs:g} s window at {label}: the server stalled "
        f"({outstanding} requests outstanding)"
    )


#: One statistics reading: the model's counters and its composing models' (by name).
Reading = tuple[ServerCounters, dict[str, ServerCounters]]


class StatsReader:
    """Reads the statistics extension for the model (and, for an ensemble, its
    composing models, as perf_analyzer does) at a window boundary."""

    def __init__(self, control: Control, opts: PerfOptions, spec: ModelSpec) -> None:
        self.control = control
        self.opts = opts
        self.composing = list(spec.composing)

    def read(self) -> Reading | None:
        """The counters now; None when the server gave no statistics."""
        stats = self.control.stats(all_models=bool(self.composing))
        if stats is None:
            return None
        main = ServerCounters.from_model_stats(stats, self.opts.model, self.opts.model_version)
        return main, {n: ServerCounters.from_model_stats(stats, n) for n in self.composing}


def _delta(after: Reading | None, before: Reading | None) -> Reading | None:
    if after is None or before is None:
        return None
    comp = {n: c - before[1][n] for n, c in after[1].items() if n in before[1]}
    return after[0] - before[0], comp


def _sleep_until(t_ns: int) -> None:
    while True:
        left = (t_ns - time.monotonic_ns()) / 1e9
        if left <= 0:
            return
        time.sleep(min(left, 0.5))


def measure_level(
    pool: WorkerPool,
    stats: StatsReader | None,
    opts: PerfOptions,
    mode: str,
    level: float,
    progress: Progress,
    windows: list[Window],
) -> PointResult:
    """Measure one level; ``windows`` (empty on entry) receives each window as it
    ends, so a caller interrupted midway still has them."""
    if mode == "concurrency":
        pool.set_concurrency(int(level))
    else:
        pool.set_rate(level, opts.max_connections, opts.distribution)
    label = f"concurrency {int(level)}" if mode == "concurrency" else f"rate {level:g} req/s"
    interval_ns = opts.measurement_interval_ms * 1_000_000
    before = stats.read() if stats is not None else None
    t0 = time.monotonic_ns()
    stable = False
    aborted = None
    for trial in range(1, opts.max_trials + 1):
        t1 = t0 + interval_ns
        _sleep_until(t1)
        after = stats.read() if stats is not None else None
        parts = pool.collect(t0, t1)
        w = window_from_parts(parts, t0, t1, _delta(after, before))
        windows.append(w)
        stable = is_stable(
            [x.requests_per_s() for x in windows],
            [x.stabilizing_latency_us(opts.percentile) for x in windows],
            opts.stability_percentage,
        )
        progress.window(mode, level, trial, w, stable, opts.batch_size)
        if w.requests == 0:
            aborted = describe_failure(w, label, sum(p["outstanding"] for p in parts))
            break
        if stable:
            break
        t0, before = t1, after
    return point_result(
        mode, level, opts.batch_size, windows, stable, opts.percentile, aborted=aborted
    )


def prepare(opts: PerfOptions) -> tuple[Control, ModelSpec, list[bytes] | list[HttpRequest]]:
    """Check the options, ask the server about the model, build the requests and
    send one of them (so a rejected request fails here, with the server's message).

    Raises:
        PerfError: bad options, server unreachable, model unknown, data that does
            not fit the model, or the trial request rejected.
    """
    opts.validate()
    control = connect(
        opts.protocol, opts.resolved_url(), opts.model, opts.model_version, opts.connect_timeout_s
    )
    try:
        meta = control.metadata()
        spec = ModelSpec.from_metadata(meta, control.config(), opts.model_version)
        requests = build_requests(opts, spec)
        first = requests[0]
        if isinstance(control, HttpControl):
            assert isinstance(first, HttpRequest)
            control.infer(first)
        else:
            assert isinstance(first, bytes)
            control.infer(first)
    except BaseException:
        control.close()
        raise
    return control, spec, requests


def run_sweep(opts: PerfOptions, progress: Progress | None = None) -> list[PointResult]:
    """Measure every load level of ``opts``, in order.

    Returns:
        one :class:`PointResult` per level measured. The sweep stops early (and
        the list is shorter) when a level has no successful response in a window
        (its result has ``aborted`` set), when ``latency_threshold_ms`` is reached,
        or on Ctrl-C (the level under way is kept, ``aborted="interrupted"``).

    Raises:
        PerfError: before any load: bad options, the server unreachable, the model
            unknown, input data that does not fit, the trial request rejected, or a
            load worker that does not start; during the load: a worker that fails.
    """
    progress = progress or NullProgress()
    control, spec, requests = prepare(opts)
    pool: WorkerPool | None = None
    results: list[PointResult] = []
    try:
        host, port = split_host_port(opts.resolved_url(), 8001 if opts.protocol == "grpc" else 80)
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        wire = [r.wire(authority) if isinstance(r, HttpRequest) else r for r in requests]
        server_stats = opts.server_stats and control.stats() is not None
        if opts.server_stats and not server_stats:
            progress.note("the server gives no statistics (extension): no server-side breakdown")
        count = opts.workers or auto_workers(opts)
        mode, levels = opts.levels()
        progress.start(
            sweep_info(
                opts,
                spec,
                mode,
                levels,
                url=f"{host}:{port}",
                workers=count,
                server_stats=server_stats,
                distinct_requests=len(wire),
            )
        )
        pool = worker_pool(count, opts, host, port, wire)
        stats = StatsReader(control, opts, spec) if server_stats else None
        for level in levels:
            windows: list[Window] = []
            try:
                point = measure_level(pool, stats, opts, mode, level, progress, windows)
            except KeyboardInterrupt:
                if windows:
                    point = interrupted_point(opts, mode, level, windows)
                    results.append(point)
                    progress.level_done(point)
                progress.note("interrupted: results so far are kept")
                break
            results.append(point)
            progress.level_done(point)
            if sweep_ends_at(point, opts, progress):
                break
        pool.idle()
    finally:
        if pool is not None:
            pool.close()
        control.close()
    return results


def sweep_info(
    opts: PerfOptions,
    spec: ModelSpec,
    mode: str,
    levels: Sequence[float],
    *,
    url: str,
    workers: int,
    server_stats: bool,
    distinct_requests: int,
) -> RunInfo:
    """What :meth:`Progress.start` is told of the model and the load."""
    return {
        "model": spec.name,
        "model_version": opts.model_version,
        "platform": spec.platform,
        "max_batch_size": spec.max_batch_size,
        "composing_models": spec.composing,
        "inputs": [{"name": t.name, "datatype": t.datatype, "dims": t.dims} for t in spec.inputs],
        "url": url,
        "protocol": opts.protocol,
        "mode": mode,
        "levels": levels,
        "workers": workers,
        "server_stats": server_stats,
        "batch_size": opts.batch_size,
        "distinct_requests": distinct_requests,
    }


def interrupted_point(
    opts: PerfOptions, mode: str, level: float, windows: Sequence[Window]
) -> PointResult:
    """The result of a level stopped by Ctrl-C, from its windows so far (those with
    responses, when there are any)."""
    good = [w for w in windows if w.requests > 0] or list(windows)
    return point_result(
        mode, level, opts.batch_size, good, False, opts.percentile, aborted="interrupted"
    )


def sweep_ends_at(point: PointResult, opts: PerfOptions, progress: Progress) -> bool:
    """Whether the sweep stops after ``point``: aborted, or its latency reached
    ``latency_threshold_ms`` (said to ``progress``). A client busy enough to be the
    limit is said too."""
    if point.client_busy >= CLIENT_BUSY_WARNING:
        progress.note(
            f"a load worker was busy {point.client_busy:.0%} of a CPU at {point.label}: "
            "the client may be the limit (give it more CPUs or --workers)"
        )
    if point.aborted:
        return True
    limit = opts.latency_threshold_ms
    if limit is not None and point.stabilizing_latency_us() >= limit * 1000:
        progress.note(
            f"latency {point.stabilizing_latency_us() / 1000:.2f} ms reached the "
            f"limit of {limit:g} ms at {point.label}: sweep stopped"
        )
        return True
    return False


def worker_pool(
    count: int, opts: PerfOptions, host: str, port: int, wire: Sequence[bytes]
) -> WorkerPool:
    """Start ``count`` workers sending ``wire`` requests to ``host:port``."""
    spec = WorkerSpec(
        index=0,
        protocol=opts.protocol,
        host=host,
        port=port,
        requests=list(wire),
        request_timeout_s=opts.request_timeout_s,
        connect_timeout_s=opts.connect_timeout_s,
        seed=opts.seed,
        grpc_client=opts.grpc_client,
    )
    return WorkerPool(count, spec)
