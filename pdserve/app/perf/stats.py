"""The arithmetic of ``pdserve perf``: latency percentiles, stability of measurement
windows, server-side statistics deltas, and one load level's result.

Everything here is pure (no I/O) and follows perf_analyzer's
``inference_profiler.cc`` (``triton-inference-server/client``):

- a percentile is ``sorted[int(p / 100 * (n - 1) + 0.5)]`` of the window's
  latencies (nearest rank, rounding half up);
- a level is stable when the last 3 windows each completed requests and, for both
  throughput and the stabilizing latency (the mean, or ``--percentile``),
  ``max / min <= 1 + stability_percentage / 100``;
- the reported result merges those 3 windows (latencies pooled, counts summed,
  throughput = requests x batch / summed duration, server counters summed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypedDict

import numpy as np

from pdserve.app.perf.options import PERCENTILES
from pdserve.core.stats import INFERENCE_DURATIONS

#: Windows that must agree before a level counts as stable (perf_analyzer's 3).
STABILITY_WINDOW = 3


def percentile_index(n: int, p: float) -> int:
    """Index of percentile ``p`` (0-100) in ``n`` sorted values, as perf_analyzer
    computes it: ``int(p / 100 * (n - 1) + 0.5)``.

    Raises:
        ValueError: ``n`` < 1 or ``p`` outside 0-100.
    """
    if n < 1:
        raise ValueError("no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside 0-100")
    return int(p / 100.0 * (n - 1) + 0.5)


def percentile(sorted_values: np.ndarray | Sequence[float], p: float) -> float:
    """Percentile ``p`` of ascending ``sorted_values`` (see :func:`percentile_index`).

    Raises:
        ValueError: no values, or ``p`` outside 0-100.
    """
    return float(sorted_values[percentile_index(len(sorted_values), p)])


def is_stable(
    throughputs: Sequence[float], latencies: Sequence[float], stability_percentage: float
) -> bool:
    """Whether the last :data:`STABILITY_WINDOW` windows are stable.

    Args:
        throughputs: per-window throughput (any unit), oldest first.
        latencies: per-window stabilizing latency (mean or chosen percentile), same
            length.
        stability_percentage: e.g. 10 for perf_analyzer's default.

    Returns:
        True when there are enough windows, none of the last ones had zero
        throughput, and max/min of each series over them is within
        ``1 + stability_percentage / 100``.
    """
    if len(throughputs) < STABILITY_WINDOW or len(latencies) < STABILITY_WINDOW:
        return False
    bound = 1.0 + stability_percentage / 100.0
    tp = list(throughputs[-STABILITY_WINDOW:])
    lat = list(latencies[-STABILITY_WINDOW:])
    if min(tp) <= 0 or min(lat) <= 0:
        return False
    return max(tp) / min(tp) <= bound and max(lat) / min(lat) <= bound


class RunInfo(TypedDict, total=False):
    """What a run measures, as :meth:`Progress.start` is told and the JSON report keeps it
    (empty before the run starts)."""

    model: str
    model_version: str
    platform: str
    max_batch_size: int
    composing_models: list[str]
    inputs: list[dict[str, object]]
    url: str
    protocol: str
    mode: str
    levels: Sequence[float]
    workers: int
    server_stats: bool
    batch_size: int
    distinct_requests: int


@dataclass
class ServerCounters:
    """Cumulative counters of one model from the statistics extension
    (``GET /v2/models/{m}/stats`` or gRPC ``ModelStatistics``), summed over the
    versions asked for; ``a - b`` is the activity between two readings.

    ``counts[k]`` / ``ns[k]`` for each of :data:`INFERENCE_DURATIONS`; ``inference_count`` is
    batch rows inferred, ``execution_count`` model executions.
    """

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INFERENCE_DURATIONS, 0))
    ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INFERENCE_DURATIONS, 0))
    inference_count: int = 0
    execution_count: int = 0

    @classmethod
    def from_model_stats(
        cls, model_stats: Sequence[Mapping[str, Any]], name: str, version: str = ""
    ) -> ServerCounters:
        """Sum the entries of a stats answer's ``model_stats`` list for ``name``
        (and ``version`` when not ""). Numbers may be ints or decimal strings (the
        gRPC answer as JSON); missing fields count 0.
        """
        out = cls()
        for entry in model_stats:
            if entry.get("name") != name:
                continue
            if version and str(entry.get("version", "")) != version:
                continue
            out.inference_count += int(entry.get("inference_count", 0) or 0)
            out.execution_count += int(entry.get("execution_count", 0) or 0)
            stats = entry.get("inference_stats") or {}
            for k in INFERENCE_DURATIONS:
                d = stats.get(k) or {}
                out.counts[k] += int(d.get("count", 0) or 0)
                out.ns[k] += int(d.get("ns", 0) or 0)
        return out

    def __sub__(self, other: ServerCounters) -> ServerCounters:
        return ServerCounters(
            {k: self.counts[k] - other.counts[k] for k in INFERENCE_DURATIONS},
            {k: self.ns[k] - other.ns[k] for k in INFERENCE_DURATIONS},
            self.inference_count - other.inference_count,
            self.execution_count - other.execution_count,
        )

    def __add__(self, other: ServerCounters) -> ServerCounters:
        return ServerCounters(
            {k: self.counts[k] + other.counts[k] for k in INFERENCE_DURATIONS},
            {k: self.ns[k] + other.ns[k] for k in INFERENCE_DURATIONS},
            self.inference_count + other.inference_count,
            self.execution_count + other.execution_count,
        )

    def avg_us(self, key: str) -> float:
        """Mean duration of ``key`` per counted request (microseconds; 0 when none)."""
        n = self.counts[key]
        return self.ns[key] / n / 1000.0 if n > 0 else 0.0

    def breakdown(self) -> dict[str, float]:
        """The server-side breakdown perf_analyzer prints (microseconds per request):
        ``request_us`` (whole request in the server), ``queue_us``,
        ``compute_input_us``, ``compute_infer_us``, ``compute_output_us``,
        ``overhead_us`` (request - queue - compute, at least 0), plus counts:
        ``success_count``, ``fail_count``, ``inference_count``, ``execution_count``
        and ``avg_batch_size`` (inferences per execution)."""
        queue = self.avg_us("queue")
        compute = self.avg_us("compute_input") + self.avg_us("compute_infer")
        compute += self.avg_us("compute_output")
        request = self.avg_us("success")
        return {
            "success_count": float(self.counts["success"]),
            "fail_count": float(self.counts["fail"]),
            "inference_count": float(self.inference_count),
            "execution_count": float(self.execution_count),
            "avg_batch_size": (
                self.inference_count / self.execution_count if self.execution_count else 0.0
            ),
            "request_us": request,
            "queue_us": queue,
            "compute_input_us": self.avg_us("compute_input"),
            "compute_infer_us": self.avg_us("compute_infer"),
            "compute_output_us": self.avg_us("compute_output"),
            "overhead_us": max(0.0, request - queue - compute),
            "cache_hit_count": float(self.counts["cache_hit"]),
        }


@dataclass
class Window:
    """One measurement window: what completed in ``[start_ns, end_ns)``
    (``time.monotonic_ns`` clock, shared by all processes on Linux).

    ``latencies_ns``: ascending, one per successful request (from writing the
    request to its last response byte). ``send_ns`` / ``recv_ns``: summed time
    spent writing requests and reading responses (HTTP; 0 for gRPC). ``errors``:
    failed requests by kind (``HTTP 400``, ``UNAVAILABLE``, ``timeout``,
    ``connection refused``...), ``error_examples`` one message per kind. ``sent``:
    requests started; ``delayed``: open-loop requests that waited for a free
    connection. ``server``: the statistics delta over the window (None when the
    server gave none). ``client_cpu_s``: CPU time of all load workers over the
    window, ``client_cpu_max_s`` that of the busiest one.
    """

    start_ns: int
    end_ns: int
    latencies_ns: np.ndarray
    send_ns: int = 0
    recv_ns: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)
    sent: int = 0
    delayed: int = 0
    server: ServerCounters | None = None
    #: An ensemble's composing models' deltas, by name.
    composing: dict[str, ServerCounters] = field(default_factory=dict)
    #: CPU seconds the load workers used, all together and the busiest one.
    client_cpu_s: float = 0.0
    client_cpu_max_s: float = 0.0

    @property
    def duration_s(self) -> float:
        """Window length in seconds."""
        return max(self.end_ns - self.start_ns, 1) / 1e9

    @property
    def requests(self) -> int:
        """Successful requests completed in the window."""
        return len(self.latencies_ns)

    @property
    def error_count(self) -> int:
        """Failed requests completed in the window."""
        return sum(self.errors.values())

    def requests_per_s(self) -> float:
        """Successful requests per second."""
        return self.requests / self.duration_s

    def mean_us(self) -> float:
        """Mean latency in microseconds (0 when no request completed)."""
        return float(self.latencies_ns.mean()) / 1000.0 if self.requests else 0.0

    def stabilizing_latency_us(self, pct: int | None) -> float:
        """The latency stability is judged on: the mean, or percentile ``pct``."""
        if not self.requests:
            return 0.0
        if pct is None:
            return self.mean_us()
        return percentile(self.latencies_ns, pct) / 1000.0


def merge_windows(windows: Sequence[Window]) -> Window:
    """One window made of consecutive ``windows``: latencies pooled and sorted,
    counts and durations summed, server deltas summed (None if any is None).

    Raises:
        ValueError: no windows.
    """
    if not windows:
        raise ValueError("no windows to merge")
    lat = np.sort(np.concatenate([w.latencies_ns for w in windows]))
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for w in windows:
        for k, n in w.errors.items():
            errors[k] = errors.get(k, 0) + n
        for k, text in w.error_examples.items():
            examples.setdefault(k, text)
    server: ServerCounters | None = None
    composing: dict[str, ServerCounters] = {}
    if all(w.server is not None for w in windows):
        server = ServerCounters()
        for w in windows:
            assert w.server is not None
            server = server + w.server
            for name, c in w.composing.items():
                composing[name] = composing.get(name, ServerCounters()) + c
    # Windows are consecutive: the merged one spans their summed durations.
    total_ns = sum(w.end_ns - w.start_ns for w in windows)
    return Window(
        start_ns=windows[0].start_ns,
        end_ns=windows[0].start_ns + total_ns,
        latencies_ns=lat,
        send_ns=sum(w.send_ns for w in windows),
        recv_ns=sum(w.recv_ns for w in windows),
        errors=errors,
        error_examples=examples,
        sent=sum(w.sent for w in windows),
        delayed=sum(w.delayed for w in windows),
        server=server,
        composing=composing,
        client_cpu_s=sum(w.client_cpu_s for w in windows),
        client_cpu_max_s=sum(w.client_cpu_max_s for w in windows),
    )


@dataclass
class PointResult:
    """The result of one load level (a concurrency or a request rate).

    Throughput and latencies come from the last :data:`STABILITY_WINDOW` windows
    merged (or fewer, when the level stopped early); ``errors`` counts failed
    requests over every window of the level. Latencies are microseconds from the
    client's side; ``server`` is the statistics-extension breakdown over the same
    windows (:func:`server_breakdown`), None when the server has no statistics
    extension.
    """

    mode: str
    level: float
    batch_size: int
    stable: bool
    trials: int
    duration_s: float
    request_count: int
    requests_per_sec: float
    infer_per_sec: float
    send_rate: float
    latency_us: dict[str, float]
    client_send_us: float
    client_recv_us: float
    errors: dict[str, int]
    error_examples: dict[str, str]
    delayed_requests: int
    server: dict[str, Any] | None
    #: Why measuring this level stopped before it was stable (no successful
    #: response, interrupted...), None otherwise.
    aborted: str | None
    #: Per window, in order: ``{"infer_per_sec", "latency_us", "errors"}``.
    history: list[dict[str, float]]
    #: The percentile stability was judged on (None: the mean).
    stabilizing_percentile: int | None = None
    #: Load workers' CPU time per successful request (microseconds), and the
    #: busiest worker's share of one CPU (0-1; near 1 the client may be the limit).
    client_cpu_us_per_request: float = 0.0
    client_busy: float = 0.0

    @property
    def error_count(self) -> int:
        """Failed requests over all windows of the level."""
        return sum(self.errors.values())

    @property
    def label(self) -> str:
        """``concurrency 8`` / ``rate 250 req/s``."""
        if self.mode == "concurrency":
            return f"concurrency {int(self.level)}"
        return f"rate {self.level:g} req/s"

    def stabilizing_latency_us(self) -> float:
        """Mean latency, or the percentile stability was judged on."""
        if self.stabilizing_percentile is None:
            return self.latency_us.get("avg", 0.0)
        return self.latency_us.get(f"p{self.stabilizing_percentile}", 0.0)

    def as_dict(self) -> dict[str, object]:
        """Plain JSON values."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PointResult:
        """Inverse of :meth:`as_dict` (unknown keys are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def latency_summary(sorted_ns: np.ndarray, extra_percentile: int | None = None) -> dict[str, float]:
    """``avg``, ``std``, ``min``, ``max`` and ``p50/p90/p95/p99`` (plus
    ``p{extra_percentile}``) of ascending nanosecond latencies, in microseconds;
    empty when there are none."""
    if len(sorted_ns) == 0:
        return {}
    arr = sorted_ns.astype(np.float64)
    out = {
        "avg": float(arr.mean()) / 1000.0,
        "std": float(arr.std(ddof=1)) / 1000.0 if len(arr) > 1 else 0.0,
        "min": float(arr[0]) / 1000.0,
        "max": float(arr[-1]) / 1000.0,
    }
    pcts = list(PERCENTILES)
    if extra_percentile is not None and extra_percentile not in pcts:
        pcts.append(extra_percentile)
    for p in sorted(pcts):
        out[f"p{p}"] = percentile(sorted_ns, p) / 1000.0
    return out


def server_breakdown(window: Window) -> dict[str, Any] | None:
    """The server side of a (merged) window: :meth:`ServerCounters.breakdown` of the
    model; for an ensemble, queue and compute are the sums of its composing models'
    per-request averages (perf_analyzer's ``GetTotalEnsembleDurations``) and
    ``composing`` holds each one's breakdown. None without statistics."""
    if window.server is None:
        return None
    out: dict[str, Any] = dict(window.server.breakdown())
    if window.composing:
        parts = {name: c.breakdown() for name, c in window.composing.items()}
        for key in ("queue_us", "compute_input_us", "compute_infer_us", "compute_output_us"):
            out[key] = sum(p[key] for p in parts.values())
        compute = out["compute_input_us"] + out["compute_infer_us"] + out["compute_output_us"]
        out["overhead_us"] = max(0.0, out["request_us"] - out["queue_us"] - compute)
        out["composing"] = parts
    return out


def point_result(
    mode: str,
    level: float,
    batch_size: int,
    windows: Sequence[Window],
    stable: bool,
    stabilizing_percentile: int | None,
    aborted: str | None = None,
) -> PointResult:
    """Summarize one level from its windows (oldest first): the last
    :data:`STABILITY_WINDOW` that completed requests are merged for throughput and
    latency; errors count over all windows.

    Raises:
        ValueError: no windows.
    """
    if not windows:
        raise ValueError("no windows")
    good = [w for w in windows if w.requests > 0]
    reported = good[-STABILITY_WINDOW:] if good else list(windows[-1:])
    merged = merge_windows(reported)
    everything = merge_windows(windows)
    n = merged.requests
    rps = n / merged.duration_s
    history = [
        {
            "infer_per_sec": w.requests_per_s() * batch_size,
            "latency_us": w.stabilizing_latency_us(stabilizing_percentile),
            "errors": float(w.error_count),
        }
        for w in windows
    ]
    return PointResult(
        mode=mode,
        level=level,
        batch_size=batch_size,
        stable=stable,
        trials=len(windows),
        duration_s=merged.duration_s,
        request_count=n,
        requests_per_sec=rps,
        infer_per_sec=rps * batch_size,
        send_rate=merged.sent / merged.duration_s,
        latency_us=latency_summary(merged.latencies_ns, stabilizing_percentile),
        client_send_us=merged.send_ns / n / 1000.0 if n else 0.0,
        client_recv_us=merged.recv_ns / n / 1000.0 if n else 0.0,
        errors=dict(sorted(everything.errors.items())),
        error_examples=everything.error_examples,
        delayed_requests=merged.delayed,
        server=server_breakdown(merged),
        aborted=aborted,
        history=history,
        stabilizing_percentile=stabilizing_percentile,
        client_cpu_us_per_request=merged.client_cpu_s / n * 1e6 if n else 0.0,
        client_busy=merged.client_cpu_max_s / merged.duration_s,
    )
