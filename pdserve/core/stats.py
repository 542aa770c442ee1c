"""Per-model statistics in the shape of Triton's statistics extension.

Recorded once per request whatever the protocol (successes and failures by the server,
executions and compute times by the scheduler), so HTTP and gRPC report the same numbers. The JSON form follows Triton's ``GET /v2/models/{m}/stats`` response
(triton-inference-server/server docs/protocol/extension_statistics.md):
``inference_stats`` holds ``{count, ns}`` pairs for success, fail, queue,
compute_input, compute_infer, compute_output, cache_hit, cache_miss and cancel
(requests cancelled: client gone, gRPC cancel or deadline, ``timeout`` parameter
expired; each also counts in ``fail``, reason ``CANCELED``);
``batch_stats`` holds the compute durations per executed batch size.
All durations are nanoseconds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from bisect import bisect_left as _bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.errors import InferError, internal

#: The ``InferError.reason`` of a request a scheduler refused to queue (queue full,
#: model unloading): not counted as a failure (see :class:`ModelStats`).
NOT_QUEUED = "NOT_QUEUED"

log = logging.getLogger(__name__)

#: Upper bounds in seconds (``+Inf`` implicit) of every latency histogram the server
#: exports (100 µs .. 60 s): the request/queue/compute histograms of
#: :mod:`pdserve.observability.metrics` and the remote models' call durations
#: (:mod:`pdserve.backends.remote.stats`, below the metrics layer, so defined here).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

#: Batch-size bucket bounds (rows) of the ``pdserve_batch_size`` histogram.
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

#: Callables ``listener(stats)`` run when a :class:`ModelStats` is created — the
#: Prometheus exporter uses this to give every model version its :class:`ModelMetrics`.
LISTENERS: list[Callable[[ModelStats], object]] = []

#: Duration counters of the statistics extension (``inference_stats``), as every
#: KServe V2 server reports them.
INFERENCE_DURATIONS = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)

_STAT_NAMES = (*INFERENCE_DURATIONS, "cancel")


class Histogram:
    """A Prometheus histogram without locks (observed on the event loop only).

    Args:
        bounds: ascending upper bounds (``le``); ``+Inf`` is implicit.
    """

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[_bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count), ...]`` ending with ``+Inf``."""
        out = []
        total = 0
        for bound, c in zip(self.bounds, self.counts, strict=False):
            total += c
            out.append((_le(bound), total))
        out.append(("+Inf", self.count))
        return out


def _le(bound: float) -> str:
    """A bucket bound as Prometheus' ``le`` label writes it (``1``, ``0.25``)."""
    if isinstance(bound, int) or (not math.isinf(bound) and bound == int(bound)):
        return str(int(bound))
    return repr(float(bound))


class ModelMetrics:
    """What the Prometheus metrics render of one model version beyond its counters:
    latency and batch-size histograms and failures by reason, recorded by
    :class:`ModelStats` when it has them (``ModelStats.metrics``, given by the
    exporter's :data:`LISTENERS` entry) and read at scrape time."""

    __slots__ = ("request", "queue", "compute", "batch", "failures")

    def __init__(self) -> None:
        self.request = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)
        self.compute = Histogram(LATENCY_BUCKETS)
        self.batch = Histogram(BATCH_BUCKETS)
        self.failures: dict[str, int] = {}

    def success(self, request_ns: int, queue_ns: int, compute_ns: int) -> None:
        """One successful request (durations in ns)."""
        h = self.request
        value = request_ns * 1e-9
        h.counts[_bisect_left(h.bounds, value)] += 1
        h.sum += value
        h.count += 1
        if compute_ns:  # cache hits have neither queue nor compute time
            h = self.queue
            value = queue_ns * 1e-9
            h.counts[_bisect_left(h.bounds, value)] += 1
            h.sum += value
            h.count += 1
            h = self.compute
            value = compute_ns * 1e-9
            h.counts[_bisect_left(h.bounds, value)] += 1
            h.sum += value
            h.count += 1

    def failure(self, reason: str) -> None:
        """One failed request (``reason``: REJECTED, CANCELED, BACKEND, OTHER)."""
        reason = reason or "OTHER"
        self.failures[reason] = self.failures.get(reason, 0) + 1


#: Seconds of history in ``pdserve_recent`` (:class:`RecentWindow`).
WINDOW_SECS = 60

#: Latency bucket upper bounds of the recent window, ns: 10 µs to ~100 s, each 12% wider
#: (bucket ``i`` holds ``(bound[i-1], bound[i]]``; the last one everything above).
_RATIO = 1.12
_RECENT_BOUNDS: tuple[float, ...] = tuple(10_000 * _RATIO**i for i in range(143))
_LAST = len(_RECENT_BOUNDS)
_monotonic = time.monotonic


class RecentWindow:
    """Successes, failures and success latencies of the last ``secs`` seconds.

    pdserve adds one field to each model's entry, ``pdserve_recent`` (HTTP only: gRPC's
    ``ModelStatistics`` message has no place for it; tritonclient keeps the JSON as is):
    the model version's health over the last :data:`WINDOW_SECS` seconds, from
    :class:`RecentWindow` --
    ``{"window_s": 60, "success": int, "failure": int, "error_rate": float 0-1,
    "qps": float, "latency_us": {"p50": float, "p90": float, "p99": float} | null}``
    (latency of successes, arrival to response, interpolated within log-spaced buckets
    12% wide, so a quantile is within about 12% of the exact one).

    A ring of one-second slots (each a success count, a failure count and a latency
    bucket array, allocated on first use), so recording is O(log buckets) and memory
    is bounded whatever the load; slots older than the window are skipped when read.
    Recorded and read on the event loop (no lock).
    """

    __slots__ = ("secs", "_ring")

    def __init__(self, secs: int = WINDOW_SECS) -> None:
        self.secs = secs
        #: slot i: [second stamp, successes, failures, bucket counts or None]
        self._ring: list[list[Any]] = [[-1, 0, 0, None] for _ in range(secs)]

    def _slot(self, now: int) -> list[Any]:
        slot = self._ring[now % self.secs]
        if slot[0] != now:
            slot[0] = now
            slot[1] = slot[2] = 0
            if slot[3] is not None:
                slot[3] = None
        return slot

    def record(self, ok: bool, request_ns: int = 0, now: float | None = None) -> None:
        """Count one request: a success that took ``request_ns``, or a failure."""
        second = int(_monotonic() if now is None else now)
        slot = self._ring[second % self.secs]
        if slot[0] != second:
            slot = self._slot(second)
        if not ok:
            slot[2] += 1
            return
        slot[1] += 1
        counts = slot[3]
        if counts is None:
            counts = slot[3] = [0] * (_LAST + 1)
        # bucket i holds (bound[i-1], bound[i]]; past the last bound: bucket _LAST
        counts[_bisect_left(_RECENT_BOUNDS, request_ns)] += 1

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """The window as ``pdserve_recent`` (see :class:`RecentWindow`)."""
        t = int(time.monotonic() if now is None else now)
        success = failure = 0
        merged = [0] * (len(_RECENT_BOUNDS) + 1)
        for stamp, ok, bad, counts in self._ring:
            if stamp < 0 or t - stamp >= self.secs:
                continue
            success += ok
            failure += bad
            if counts is not None:
                for i, c in enumerate(counts):
                    if c:
                        merged[i] += c
        total = success + failure
        latency = None
        if success:
            latency = {
                f"p{q}": round(_quantile(merged, success, q / 100) / 1000, 1) for q in (50, 90, 99)
            }
        return {
            "window_s": self.secs,
            "success": success,
            "failure": failure,
            "error_rate": round(failure / total, 6) if total else 0.0,
            "qps": round(total / self.secs, 3),
            "latency_us": latency,
        }


def _quantile(counts: list[int], total: int, q: float) -> float:
    """The ``q`` quantile (ns) of bucketed counts, interpolated linearly inside the
    bucket that holds it (as Prometheus' ``histogram_quantile``)."""
    rank = q * total
    seen = 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            lower = _RECENT_BOUNDS[i - 1] if i > 0 else 0
            upper = _RECENT_BOUNDS[i] if i < len(_RECENT_BOUNDS) else _RECENT_BOUNDS[-1]
            return lower + (upper - lower) * (rank - seen) / c
        seen += c
    return float(_RECENT_BOUNDS[-1])


@dataclass(slots=True)
class Duration:
    """A ``{count, ns}`` pair."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        """Add ``count`` events that took ``ns`` nanoseconds in total."""
        self.count += count
        self.ns += ns

    def as_dict(self) -> dict[str, int]:
        """``{"count": int, "ns": int}``."""
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchStats:
    """Compute durations of the batches of one size."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


class ModelStats:
    """Counters for one model version.

    Which failures count (``fail`` here, ``nv_inference_request_failure`` in metrics),
    as in Triton's core: a request counts once it has passed the request checks and
    reached the model's scheduler. Then it fails with a reason: ``REJECTED`` (its queue
    timeout expired), ``CANCELED`` (the client went away), ``BACKEND`` (the model
    failed), ``OTHER`` (anything else; every failure of an ensemble). Requests refused
    before that count nowhere, as Triton returns them from
    ``TRITONSERVER_ServerInferAsync`` without statistics: malformed requests (decoded by
    the frontends), unknown models or versions, inputs that do not match the
    configuration (``ModelVersion.prepare``; Triton's ``PrepareForInference``), and
    requests the scheduler refuses to queue (queue full, model unloading; Triton's
    ``Enqueue`` errors), which carry the reason :data:`NOT_QUEUED`.

    Attributes:
        inference_count: rows inferred (a batch-4 request counts 4), successes only.
        execution_count: batches executed by model instances.
        last_inference_ms: wall-clock ms since the epoch of the last success.
        metrics: the histograms and failure reasons the Prometheus metrics render
            (:class:`ModelMetrics`), recorded here when the exporter gave the version
            one; None: not recorded.
        memory_bytes: host memory the version costs, bytes, as measured at its load
            (None: not measured); ``memory_source`` says how (``rss_delta``,
            ``worker_rss``, ``ensemble``; see :mod:`pdserve.repository.manager`).
        gpu_memory_bytes: GPU memory it took at load (NVML, per process), or None
            where there is no GPU or NVML.
        output_shape_mismatches: output name -> responses that carried it with a
            shape other than its configuration's (a python model's, served as
            produced; ``pdserve_output_shape_mismatch_total``).
    """

    def __init__(self, name: str, version: str) -> None:
        self.name = name
        self.version = version
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.durations: dict[str, Duration] = {n: Duration() for n in _STAT_NAMES}
        self.batches: dict[int, BatchStats] = {}
        self.pending = 0
        self.recent = RecentWindow()
        self.metrics: ModelMetrics | None = None
        self._success = self.durations["success"]
        self._queue = self.durations["queue"]
        self.memory_bytes: int | None = None
        self.memory_source = ""
        self.gpu_memory_bytes: int | None = None
        self.output_shape_mismatches: dict[str, int] = {}
        #: the version's canary probe counts (``pdserve_probe`` in :meth:`as_dict`;
        #: :mod:`pdserve.repository.health`), or None: no probe.
        self.probe: Callable[[], dict[str, Any]] | None = None
        for listener in LISTENERS:
            listener(self)

    def record_success(
        self, rows: int, request_ns: int, queue_ns: int, compute_ns: int, cache_hit: bool = False
    ) -> None:
        """A request finished successfully.

        Args:
            rows: batch size of the request.
            request_ns: arrival to response, ns.
            queue_ns: time spent queued before an instance took it, ns.
            compute_ns: input + infer + output time of the batch it ran in, ns.
            cache_hit: answered from the response cache. Triton's statistics extension:
                "The 'inference_count' value DOES NOT include cache hits", while the
                "success" and "queue" counts do (core ``UpdateSuccessCacheHit``: no
                ``inference_count_``, no ``last_inference``, which only an execution
                moves).
        """
        d = self._success
        d.count += 1
        d.ns += request_ns
        d = self._queue
        d.count += 1
        d.ns += queue_ns
        if not cache_hit:
            self.inference_count += rows
            self.last_inference_ms = int(time.time() * 1000)
        self.recent.record(True, request_ns)
        metrics = self.metrics
        if metrics is not None:
            metrics.success(request_ns, queue_ns, compute_ns)

    def record_failure(self, request_ns: int, reason: str = "BACKEND") -> None:
        """A request that reached the scheduler failed (``reason``: REJECTED,
        CANCELED, BACKEND, OTHER; see the class docstring for what counts)."""
        self.durations["fail"].add(request_ns)
        if reason == "CANCELED":  # Triton's ``cancel`` statistics (a failure too)
            self.durations["cancel"].add(request_ns)
        self.recent.record(False)
        if self.metrics is not None:
            self.metrics.failure(reason)

    def record_error(
        self, error: BaseException, arrival_ns: int, ensemble: bool
    ) -> InferError | None:
        """Count a request that failed with ``error`` (``arrival_ns``: its
        ``time.monotonic_ns()`` on arrival; ``ensemble``: the model is an ensemble).

        As Triton, a request counts once it passed its checks and was queued: an error
        with reason :data:`NOT_QUEUED` counts nowhere. The reason is the error's,
        ``OTHER`` for every failure of an ensemble except a cancellation, ``CANCELED``
        for a cancelled task, ``OTHER`` for an unexpected exception (logged).

        Returns:
            the error to raise instead of ``error`` (``INTERNAL`` for an unexpected
            exception), or None to raise ``error`` itself.
        """
        request_ns = time.monotonic_ns() - arrival_ns
        if isinstance(error, InferError):
            if error.reason != NOT_QUEUED:
                reason = error.reason
                if ensemble and reason != "CANCELED":
                    reason = "OTHER"
                self.record_failure(request_ns, reason)
            return None
        if isinstance(error, asyncio.CancelledError):
            self.record_failure(request_ns, "CANCELED")
            return None
        if isinstance(error, Exception):
            log.exception("request to %s failed", self.name)
            self.record_failure(request_ns, "OTHER")
            return internal(f"{type(error).__name__}: {error}")
        return None

    def record_execution(
        self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int
    ) -> None:
        """One batch of ``batch_size`` rows ran on an instance.

        Triton counts compute_* once per request in ``inference_stats``; the batch
        totals go to ``batch_stats[batch_size]``.
        """
        self.execution_count += 1
        b = self.batches.get(batch_size)
        if b is None:
            b = self.batches[batch_size] = BatchStats()
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)
        if self.metrics is not None:
            self.metrics.batch.observe(batch_size)

    def record_compute(self, requests: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """Per-request compute durations of a batch holding ``requests`` requests."""
        self.durations["compute_input"].add(input_ns * requests, requests)
        self.durations["compute_infer"].add(infer_ns * requests, requests)
        self.durations["compute_output"].add(output_ns * requests, requests)

    def record_cache(self, hit: bool, ns: int) -> None:
        """A response cache lookup (hit or miss) that took ``ns``."""
        self.durations["cache_hit" if hit else "cache_miss"].add(ns)

    def memory_usage(self) -> list[dict[str, Any]]:
        """Triton's ``memory_usage`` entries (``{type, id, byte_size}``, the
        ``MemoryUsage`` message of its statistics): ``CPU`` (id 0) for host memory and
        ``GPU`` (id 0: summed over GPUs) when measured; empty when not measured."""
        usage: list[dict[str, Any]] = []
        if self.memory_bytes is not None:
            usage.append({"type": "CPU", "id": 0, "byte_size": self.memory_bytes})
        if self.gpu_memory_bytes:
            usage.append({"type": "GPU", "id": 0, "byte_size": self.gpu_memory_bytes})
        return usage

    def as_dict(self) -> dict[str, Any]:
        """One entry of Triton's ``model_stats`` list, plus pdserve's ``memory_bytes``
        and ``memory_source`` (HTTP JSON only; gRPC carries ``memory_usage``) and, for a
        version with a canary probe, ``pdserve_probe`` (``{success, failure,
        failing_in_row, last_error}``)."""
        extras: dict[str, Any] = {}
        if self.memory_bytes is not None:
            extras = {"memory_bytes": self.memory_bytes, "memory_source": self.memory_source}
        if self.probe is not None:  # canary probes: labelled apart, never user traffic
            extras["pdserve_probe"] = self.probe()
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {n: d.as_dict() for n, d in self.durations.items()},
            "response_stats": {},
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": b.compute_input.as_dict(),
                    "compute_infer": b.compute_infer.as_dict(),
                    "compute_output": b.compute_output.as_dict(),
                }
                for size, b in sorted(self.batches.items())
            ],
            "memory_usage": self.memory_usage(),
            "pdserve_recent": self.recent.summary(),
            **extras,
        }
