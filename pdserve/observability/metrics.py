"""Prometheus metrics on ``--metrics-port`` (default 8002) at ``/metrics``.

Names, types and labels follow Triton's metrics (docs/user_guide/metrics.md), so
dashboards and alerts written for Triton work unchanged; pdserve adds latency
histograms, model memory, traffic control, worker processes and readiness. The
families are listed on :class:`MetricsExporter`.

Everything is read at scrape time: the counters from
:class:`~pdserve.core.stats.ModelStats`, the histograms and failure reasons from the
:class:`~pdserve.core.stats.ModelMetrics` it records when :func:`install_hooks` gave it
one; no code here runs per request. The exposition is written here in the
Prometheus text format 0.0.4 (``prometheus_client`` would add ``_total`` to Triton's
counter names).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from pdserve.cache import AnyResponseCache, RedisResponseCache
from pdserve.core import stats as stats_mod
from pdserve.core.stats import Histogram, ModelMetrics, ModelStats

log = logging.getLogger("pdserve.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@runtime_checkable
class MetricsSource(Protocol):
    """What the Prometheus metrics read from the core at scrape time
    (:class:`pdserve.server.InferenceServer` implements it). The families of traffic
    control, worker processes and readiness read ``traffic``, ``manager`` and
    ``repository_index`` where the core has them."""

    @property
    def response_cache(self) -> AnyResponseCache | None:
        """The response cache, or None when the server has none."""
        ...

    def served_model_stats(self) -> list[ModelStats]:
        """Statistics of every served model version, by model name then version."""
        ...

    def memory_report(self) -> dict[str, Any]:
        """The model memory budget: ``budget_bytes`` (None: none), ``used_bytes`` and
        ``models``: name -> counters with ``loads``, ``evictions``, ``misses``."""
        ...


def attach(stats: ModelStats) -> ModelMetrics:
    """Give ``stats`` its :class:`~pdserve.core.stats.ModelMetrics` (once) and return it."""
    mm = stats.metrics
    if mm is None:
        mm = stats.metrics = ModelMetrics()
    return mm


# -- exposition ----------------------------------------------------------------


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


class Family:
    """One metric family being written: ``# HELP``, ``# TYPE`` and its samples."""

    def __init__(self, name: str, kind: str, doc: str) -> None:
        self.name = name
        self.kind = kind
        self.doc = doc
        self.lines: list[str] = []

    def add(self, labels: dict[str, str], value: float, suffix: str = "") -> None:
        """Add one sample ``name+suffix{labels} value``."""
        self.lines.append(f"{self.name}{suffix}{_labels(labels)} {_fmt(value)}\n")

    def add_histogram(self, labels: dict[str, str], h: Histogram) -> None:
        """Add ``_bucket`` (cumulative, per ``le``), ``_sum`` and ``_count`` samples."""
        for le, count in h.cumulative():
            self.add({**labels, "le": le}, count, "_bucket")
        self.add(labels, h.sum, "_sum")
        self.add(labels, h.count, "_count")

    def render(self) -> str:
        """The family in the text format (empty when it has no samples)."""
        if not self.lines:
            return ""
        doc = self.doc.replace("\\", "\\\\").replace("\n", "\\n")
        return f"# HELP {self.name} {doc}\n# TYPE {self.name} {self.kind}\n" + "".join(self.lines)


_MODEL_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("nv_inference_request_success", "counter", "Number of successful inference requests, all batch sizes"),
    ("nv_inference_count", "counter", "Number of inferences performed (does not include cached requests)"),
    ("nv_inference_exec_count", "counter", "Number of model executions performed (does not include cached requests)"),
    ("nv_inference_pending_request_count", "gauge", "Instantaneous number of pending requests awaiting execution per-model."),
    ("nv_inference_request_duration_us", "counter", "Cumulative inference request duration in microseconds (includes cached requests)"),
    ("nv_inference_queue_duration_us", "counter", "Cumulative inference queuing duration in microseconds (includes cached requests)"),
    ("nv_inference_compute_input_duration_us", "counter", "Cumulative compute input duration in microseconds (does not include cached requests)"),
    ("nv_inference_compute_infer_duration_us", "counter", "Cumulative compute inference duration in microseconds (does not include cached requests)"),
    ("nv_inference_compute_output_duration_us", "counter", "Cumulative inference compute output duration in microseconds (does not include cached requests)"),
    ("nv_cache_num_hits_per_model", "counter", "Number of cache hits per model"),
    ("nv_cache_num_misses_per_model", "counter", "Number of cache misses per model"),
    ("nv_cache_hit_duration_per_model", "counter", "Total cache hit duration per model, in microseconds"),
    ("nv_cache_miss_duration_per_model", "counter", "Total cache miss (insert + lookup) duration per model, in microseconds"),
)  # fmt: skip


def _model_values(s: ModelStats) -> tuple[float, ...]:
    d = s.durations
    return (
        d["success"].count,
        s.inference_count,
        s.execution_count,
        s.pending,
        d["success"].ns // 1000,
        d["queue"].ns // 1000,
        d["compute_input"].ns // 1000,
        d["compute_infer"].ns // 1000,
        d["compute_output"].ns // 1000,
        d["cache_hit"].count,
        d["cache_miss"].count,
        d["cache_hit"].ns // 1000,
        d["cache_miss"].ns // 1000,
    )


def model_families(models: Iterable[ModelStats]) -> list[Family]:
    """Per-model families (Triton counters, failures by reason, histograms)."""
    families = [Family(n, k, doc) for n, k, doc in _MODEL_COUNTERS]
    failure = Family(
        "nv_inference_request_failure",
        "counter",
        "Number of failed inference requests, all batch sizes",
    )
    hists = [
        Family("pdserve_request_duration_seconds", "histogram", "Request duration (arrival to response) of successful requests, seconds"),
        Family("pdserve_queue_duration_seconds", "histogram", "Time requests waited in the queue before their batch started, seconds"),
        Family("pdserve_compute_duration_seconds", "histogram", "Compute time of the batch each request ran in, seconds"),
        Family("pdserve_batch_size", "histogram", "Rows per batch executed by model instances"),
    ]  # fmt: skip
    shapes = Family(
        "pdserve_output_shape_mismatch_total",
        "counter",
        "Responses with an output shaped other than the model configuration says, served as the python model produced it",
    )
    for s in models:
        labels = {"model": s.name, "version": s.version}
        for fam, value in zip(families, _model_values(s), strict=True):
            fam.add(labels, value)
        for output, count in sorted(s.output_shape_mismatches.items()):
            shapes.add({**labels, "output": output}, count)
        mm = s.metrics
        reasons = dict(mm.failures) if mm is not None else {}
        if not reasons and s.durations["fail"].count:
            reasons = {"OTHER": s.durations["fail"].count}
        for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
            reasons.setdefault(reason, 0)
        for reason, count in sorted(reasons.items()):
            failure.add({**labels, "reason": reason}, count)
        if mm is not None:
            hists[0].add_histogram(labels, mm.request)
            hists[1].add_histogram(labels, mm.queue)
            hists[2].add_histogram(labels, mm.compute)
            hists[3].add_histogram(labels, mm.batch)
    return [families[0], failure, *families[1:], *hists, shapes]


def memory_families(models: Iterable[ModelStats], report: dict[str, Any]) -> list[Family]:
    """Model memory and load / eviction / miss counter families (see the module
    docstring); ``report`` is :meth:`MetricsSource.memory_report`'s."""
    mem = Family(
        "pdserve_model_memory_bytes",
        "gauge",
        "Host memory a loaded model version cost at load, in bytes",
    )
    for s in models:
        if s.memory_bytes is not None:
            labels = {"model": s.name, "version": s.version, "source": s.memory_source}
            mem.add(labels, s.memory_bytes)
    counters = [
        ("pdserve_model_loads_total", "loads", "Number of model loads (any cause)"),
        ("pdserve_model_evictions_total", "evictions", "Number of models unloaded by the memory budget (least recently used first)"),
        ("pdserve_model_load_misses_total", "misses", "Number of requests that found their model not loaded and waited for an on-demand load"),
    ]  # fmt: skip
    out = [mem]
    models_counts = report.get("models", {})
    for name, attr, doc in counters:
        f = Family(name, "counter", doc)
        for model, c in models_counts.items():
            f.add({"model": model}, getattr(c, attr))
        out.append(f)
    used = Family(
        "pdserve_model_memory_used_bytes",
        "gauge",
        "Host memory the loaded model versions cost together, in bytes",
    )
    used.add({}, report.get("used_bytes", 0))
    out.append(used)
    if report.get("budget_bytes") is not None:
        budget = Family(
            "pdserve_model_memory_budget_bytes",
            "gauge",
            "The model memory budget (--model-memory-budget), in bytes",
        )
        budget.add({}, report["budget_bytes"])
        out.append(budget)
    return out


def cache_families(cache: AnyResponseCache | None) -> list[Family]:
    """Server-wide response cache families (none without a cache). A Redis cache has
    the lookup counters of this replica and ``pdserve_cache_errors_total`` (failed
    Redis calls); entries, evictions and utilization are Redis's own (INFO)."""
    if cache is None:
        return []
    rows: list[tuple[str, str, str, float]]
    if isinstance(cache, RedisResponseCache):
        rows = [
            ("nv_cache_num_lookups", "counter", "Number of cache lookups in response cache", cache.hits + cache.misses),
            ("nv_cache_num_hits", "counter", "Number of cache hits in response cache", cache.hits),
            ("nv_cache_num_misses", "counter", "Number of cache misses in response cache", cache.misses),
            ("pdserve_cache_errors_total", "counter", "Failed calls to the Redis response cache", cache.errors),
        ]  # fmt: skip
        return _families(rows)
    rows = [
        ("nv_cache_num_entries", "gauge", "Number of responses stored in response cache", len(cache)),
        ("nv_cache_num_lookups", "counter", "Number of cache lookups in response cache", cache.hits + cache.misses),
        ("nv_cache_num_hits", "counter", "Number of cache hits in response cache", cache.hits),
        ("nv_cache_num_misses", "counter", "Number of cache misses in response cache", cache.misses),
        ("nv_cache_num_evictions", "counter", "Number of cache evictions in response cache", cache.evictions),
        ("nv_cache_util", "gauge", "Cache utilization [0.0 - 1.0]", cache.bytes_used / cache.capacity_bytes),
    ]  # fmt: skip
    return _families(rows)


def _families(rows: Iterable[tuple[str, str, str, float]]) -> list[Family]:
    out = []
    for name, kind, doc, value in rows:
        f = Family(name, kind, doc)
        f.add({}, value)
        out.append(f)
    return out


#: Traffic control's metrics (:mod:`pdserve.repository.rollout`): name -> (type, help).
TRAFFIC_METRICS: dict[str, tuple[str, str]] = {
    "pdserve_traffic_weight": ("gauge", "Percent of a model's unversioned requests a version is to get"),
    "pdserve_traffic_requests_total": ("counter", "Unversioned requests served per version, by route (split, sticky, pinned, default)"),
    "pdserve_shadow_requests_total": ("counter", "Shadow (mirrored) requests per shadow version, by result (compared, shed, error, missing)"),
    "pdserve_shadow_compared_total": ("counter", "Shadow comparisons per output"),
    "pdserve_shadow_divergence_total": ("counter", "Shadow comparisons per output that diverged beyond the output's tolerance"),
    "pdserve_shadow_divergence_rate": ("gauge", "Share of shadow comparisons per output that diverged over the last 60 s"),
    "pdserve_shadow_queue_size": ("gauge", "Mirrored requests waiting in a model's shadow queue"),
    "pdserve_rollout_decisions_total": ("counter", "Rollout decisions per model, by action (start, promote, promoted, rollback...)"),
    "pdserve_rollout_state": ("gauge", "1 for a model's current rollout state"),
}  # fmt: skip


def traffic_families(server: MetricsSource) -> list[Family]:
    """Traffic control's families (split, shadow, rollout), when the server has it."""
    control = getattr(server, "traffic", None)
    if control is None:
        return []
    fams = {name: Family(name, kind, doc) for name, (kind, doc) in TRAFFIC_METRICS.items()}
    for name, labels, value in control.metric_rows():
        fam = fams.get(name)
        if fam is not None:
            fam.add(labels, value)
    return list(fams.values())


#: A metric sample from a source: (name, type, help, labels, value).
Sample = tuple[str, str, str, dict[str, str], float]


def sample_families(samples: Iterable[Sample]) -> list[Family]:
    """Families of ``samples``, grouped by name in first-seen order; a histogram's
    samples are named with their suffix (``_bucket``, ``_sum``, ``_count``)."""
    by_name: dict[str, Family] = {}
    for name, kind, doc, labels, value in samples:
        base, suffix = name, ""
        if kind == "histogram":
            for end in ("_bucket", "_sum", "_count"):
                if name.endswith(end):
                    base, suffix = name[: -len(end)], end
                    break
        fam = by_name.get(base)
        if fam is None:
            fam = by_name[base] = Family(base, kind, doc)
        fam.add(labels, value, suffix)
    return list(by_name.values())


class CpuSampler:
    """System CPU utilisation between scrapes and memory, from /proc (Linux)."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = self._read_stat()

    @staticmethod
    def _read_stat() -> tuple[int, int] | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                parts = f.readline().split()
        except OSError:
            return None
        values = [int(x) for x in parts[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return sum(values), idle

    def families(self) -> list[Family]:
        """``nv_cpu_utilization``, ``nv_cpu_memory_total_bytes``, ``nv_cpu_memory_used_bytes``."""
        out = []
        now = self._read_stat()
        if now is not None:
            util = 0.0
            if self._last is not None and now[0] > self._last[0]:
                total = now[0] - self._last[0]
                util = 1.0 - (now[1] - self._last[1]) / total
            self._last = now
            f = Family("nv_cpu_utilization", "gauge", "CPU utilization rate [0.0 - 1.0]")
            f.add({}, round(max(0.0, min(1.0, util)), 6))
            out.append(f)
        try:
            info: dict[str, int] = {}
            with open("/proc/meminfo", encoding="ascii") as fh:
                for line in fh:
                    key, _, rest = line.partition(":")
                    info[key] = int(rest.split()[0]) * 1024
            total_b = info["MemTotal"]
            used_b = total_b - info.get("MemAvailable", info.get("MemFree", 0))
        except (OSError, KeyError, ValueError, IndexError):
            return out
        f = Family("nv_cpu_memory_total_bytes", "gauge", "CPU total memory (RAM), in bytes")
        f.add({}, total_b)
        out.append(f)
        f = Family("nv_cpu_memory_used_bytes", "gauge", "CPU used memory (RAM), in bytes")
        f.add({}, used_b)
        out.append(f)
        return out


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_process(pid: int) -> tuple[float, int] | None:
    """``(cpu seconds, resident bytes)`` of process ``pid`` from /proc, or None when it
    is gone or /proc is absent. CPU is user + system time (``/proc/PID/stat`` fields
    14-15, clock ticks); RSS is ``/proc/PID/statm``'s second field (pages)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        with open(f"/proc/{pid}/statm", "rb") as fh:
            statm = fh.read().split()
        fields = stat[stat.rindex(b")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
        return cpu, int(statm[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def worker_processes(server: MetricsSource) -> list[tuple[dict[str, str], int]]:
    """``[(labels {model, version, instance}, pid)]`` of every python-backend worker
    process of the served model versions.

    Read through the core's model manager (``server.manager.models[name].serving``,
    each version's ``instances``, a python instance's live ``conn.pid``); a core
    without a manager, or instances without worker processes (ONNX Runtime runs in
    the server process), give none.
    """
    manager = getattr(server, "manager", None)
    models = getattr(manager, "models", None)
    if not isinstance(models, dict):
        return []
    out = []
    for name, entry in sorted(models.items()):
        for version, mv in sorted(getattr(entry, "serving", {}).items()):
            for inst in getattr(mv, "instances", ()):
                pid = getattr(getattr(inst, "conn", None), "pid", None)
                if isinstance(pid, int) and pid > 0:
                    labels = {"model": name, "version": str(version), "instance": inst.name}
                    out.append((labels, pid))
    return out


def worker_families(server: MetricsSource) -> list[Family]:
    """Per python-backend worker process: ``pdserve_worker_cpu_seconds_total`` (counter)
    and ``pdserve_worker_resident_memory_bytes`` (gauge), labels model, version,
    instance. Sum them ``by (model)`` for a model's CPU and RSS."""
    cpu = Family(
        "pdserve_worker_cpu_seconds_total",
        "counter",
        "User and system CPU time of a model instance's worker process, seconds",
    )
    rss = Family("pdserve_worker_resident_memory_bytes", "gauge", "Resident memory of a model instance's worker process, bytes")  # fmt: skip
    for labels, pid in worker_processes(server):
        reading = read_process(pid)
        if reading is None:
            continue
        cpu.add(labels, reading[0])
        rss.add(labels, reading[1])
    return [cpu, rss]


def readiness_families(server: MetricsSource) -> list[Family]:
    """``pdserve_model_ready{model, version}``: 1 for a READY version that is ready now
    (``model_ready``: not wedged, hooks and probe passing), 0 for a version that is not,
    or is loading, failed or unavailable -- every row of the repository index that
    has a version, except versions unloaded on request (reason ``unloaded``)."""
    index = getattr(server, "repository_index", None)
    fam = Family("pdserve_model_ready", "gauge", "1 when the model version is ready to serve, 0 when it is loading, failed or unavailable")  # fmt: skip
    if index is None:
        return []
    try:
        rows = index()
    except Exception as e:  # noqa: BLE001 - a scrape never fails on this
        log.debug("repository index unavailable for metrics: %s", e)
        return []
    model_ready = getattr(server, "model_ready", None)
    for row in rows:
        version = row.get("version")
        if not version or str(row.get("reason", "")).startswith("unloaded"):
            continue
        ready = row.get("state") == "READY"
        if ready and model_ready is not None:  # wedged, hook or probe (repository.health)
            ready = bool(model_ready(row["name"], str(version)))
        fam.add({"model": row["name"], "version": str(version)}, 1 if ready else 0)
    return [fam]


def remote_families() -> list[Family]:
    """Per remote model target (:mod:`pdserve.backends.remote.stats`), labels ``target``
    (``grpc://host:port`` / ``http://host:port``) and ``model`` (the local model):
    ``pdserve_remote_request_duration_seconds`` (histogram of calls the target answered,
    retries included), ``pdserve_remote_requests_total`` (calls made),
    ``pdserve_remote_errors_total`` (failed calls, label ``code``: pdserve's error code),
    ``pdserve_remote_retries_total`` (calls repeated) and ``pdserve_remote_up`` (1 while
    the target's model answers ready). None before a remote model was loaded."""
    from pdserve.backends.remote.stats import DURATION_BUCKETS, TARGETS

    if not TARGETS:
        return []
    duration = Family("pdserve_remote_request_duration_seconds", "histogram", "Duration of calls to a remote model's target that got an answer, seconds")  # fmt: skip
    requests = Family("pdserve_remote_requests_total", "counter", "Calls made to a remote model's target (retries included)")  # fmt: skip
    errors = Family("pdserve_remote_errors_total", "counter", "Failed calls to a remote model's target, by error code")  # fmt: skip
    retries = Family("pdserve_remote_retries_total", "counter", "Calls to a remote model's target repeated after UNAVAILABLE or a failed connection")  # fmt: skip
    up = Family("pdserve_remote_up", "gauge", "1 while a remote model's target answers its model ready, else 0")  # fmt: skip
    for (target, model), st in sorted(TARGETS.items()):
        labels = {"target": target, "model": model}
        h = Histogram(DURATION_BUCKETS)
        h.counts = list(st.bucket_counts)
        h.count = sum(st.bucket_counts)
        h.sum = st.duration_sum
        duration.add_histogram(labels, h)
        requests.add(labels, st.requests)
        for code, n in sorted(st.errors.items()):
            errors.add({**labels, "code": code}, n)
        retries.add(labels, st.retries)
        up.add(labels, 1 if st.up else 0)
    return [duration, requests, errors, retries, up]


class GpuSampler:
    """NVML GPU metrics; :meth:`create` returns None without pynvml or a GPU."""

    def __init__(self, nvml: ModuleType, handles: list[tuple[str, object]]) -> None:
        self.nvml = nvml
        self.handles = handles

    @classmethod
    def create(cls) -> GpuSampler | None:
        """Initialise NVML; None (silently) when it or a GPU is absent."""
        try:
            import pynvml  # type: ignore[import-not-found]  # optional, ships no stubs
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            handles = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                if isinstance(uuid, bytes):
                    uuid = uuid.decode()
                handles.append((uuid, h))
        except Exception as e:  # noqa: BLE001 - no driver / no GPU: no GPU metrics
            log.debug("no GPU metrics: %s", e)
            return None
        return cls(pynvml, handles) if handles else None

    def families(self) -> list[Family]:
        """Per-GPU utilisation, memory, power and energy families."""
        nv = self.nvml
        fams = {
            "util": Family("nv_gpu_utilization", "gauge", "GPU utilization rate [0.0 - 1.0)"),
            "mem_total": Family("nv_gpu_memory_total_bytes", "gauge", "GPU total memory, in bytes"),
            "mem_used": Family("nv_gpu_memory_used_bytes", "gauge", "GPU used memory, in bytes"),
            "power": Family("nv_gpu_power_usage", "gauge", "GPU power usage in watts"),
            "limit": Family("nv_gpu_power_limit", "gauge", "GPU power management limit in watts"),
            "energy": Family("nv_energy_consumption", "counter", "GPU energy consumption in joules since pdserve started"),
        }  # fmt: skip
        readers: list[tuple[str, Callable[[object], float]]] = [
            ("util", lambda h: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
            ("mem_total", lambda h: nv.nvmlDeviceGetMemoryInfo(h).total),
            ("mem_used", lambda h: nv.nvmlDeviceGetMemoryInfo(h).used),
            ("power", lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("limit", lambda h: nv.nvmlDeviceGetPowerManagementLimit(h) / 1000.0),
            ("energy", lambda h: nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0),
        ]
        for uuid, h in self.handles:
            for key, read in readers:
                try:
                    fams[key].add({"gpu_uuid": uuid}, read(h))
                except Exception:  # noqa: BLE001,S112 - a reading this GPU does not support
                    continue
        return list(fams.values())


class MetricsExporter:
    """Renders every metric of a server.

    Names, types and labels follow Triton's metrics (docs/user_guide/metrics.md), so
    dashboards and alerts written for Triton work unchanged. Per model version,
    labels ``model`` and ``version``:

    =============================================  =======  ==========================================
    ``nv_inference_request_success``               counter  successful requests (cache hits included)
    ``nv_inference_request_failure``               counter  failed requests, label ``reason``:
                                                            REJECTED, CANCELED, BACKEND, OTHER
    ``nv_inference_count``                         counter  inferences (batch rows) of successes
    ``nv_inference_exec_count``                    counter  batches executed by model instances
    ``nv_inference_pending_request_count``         gauge    requests queued, not yet executing
    ``nv_inference_request_duration_us``           counter  cumulative request duration, µs
    ``nv_inference_queue_duration_us``             counter  cumulative queue duration, µs
    ``nv_inference_compute_input_duration_us``     counter  cumulative compute-input duration, µs
    ``nv_inference_compute_infer_duration_us``     counter  cumulative compute-infer duration, µs
    ``nv_inference_compute_output_duration_us``    counter  cumulative compute-output duration, µs
    ``nv_cache_num_hits_per_model``                counter  response cache hits
    ``nv_cache_num_misses_per_model``              counter  response cache misses
    ``nv_cache_hit_duration_per_model``            counter  cumulative cache-hit lookup duration, µs
    ``nv_cache_miss_duration_per_model``           counter  cumulative cache-miss lookup duration, µs
    =============================================  =======  ==========================================

    Latency histograms (pdserve's own; Triton only has summaries for these, behind
    ``--metrics-config summary_latencies=true``), so ``histogram_quantile`` gives
    p50/p90/p99 per model:

    - ``pdserve_request_duration_seconds`` — arrival to response, successes only;
    - ``pdserve_queue_duration_seconds`` — queued until an instance took the batch;
    - ``pdserve_compute_duration_seconds`` — the executed batch's compute time;
    - ``pdserve_batch_size`` — rows per executed batch (label-free of ``reason``).

    ``pdserve_output_shape_mismatch_total{model,version,output}`` (counter): responses
    of a python model whose output was served with the shape the model produced, not
    the configured one (:mod:`pdserve.backends.python.output_shapes`); a series
    appears with the first mismatch.

    Model memory (pdserve's; :mod:`pdserve.repository.budget`):
    ``pdserve_model_memory_bytes{model,version}`` (gauge: what the version cost at load,
    label ``source``: rss_delta / worker_rss / ensemble), ``pdserve_model_loads_total``,
    ``pdserve_model_evictions_total`` and ``pdserve_model_load_misses_total`` (counters,
    label ``model``: loads, unloads by the memory budget, requests that found the model
    not loaded in on_demand mode), ``pdserve_model_memory_used_bytes`` and, with a budget,
    ``pdserve_model_memory_budget_bytes``.
    Traffic control (:mod:`pdserve.repository.rollout`; see :data:`TRAFFIC_METRICS`):
    ``pdserve_traffic_weight`` and ``pdserve_traffic_requests_total`` (labels ``model``,
    ``version``, ``route``), ``pdserve_shadow_requests_total`` (``result``),
    ``pdserve_shadow_compared_total`` / ``pdserve_shadow_divergence_total`` /
    ``pdserve_shadow_divergence_rate`` (label ``output``), ``pdserve_shadow_queue_size``,
    ``pdserve_rollout_decisions_total`` (``action``) and ``pdserve_rollout_state``.

    Server-wide: ``nv_cache_num_entries``, ``nv_cache_num_lookups``,
    ``nv_cache_num_hits``, ``nv_cache_num_misses``, ``nv_cache_num_evictions``,
    ``nv_cache_util`` (response cache); ``nv_cpu_utilization`` (0-1, since the last
    scrape), ``nv_cpu_memory_total_bytes``, ``nv_cpu_memory_used_bytes`` (system,
    from /proc); ``process_*`` from ``prometheus_client``'s ``ProcessCollector``
    (CPU seconds, resident memory...) of the server process;
    ``pdserve_worker_cpu_seconds_total`` and ``pdserve_worker_resident_memory_bytes``
    (labels ``model``, ``version``, ``instance``) of each python-backend worker process
    (models run by ONNX Runtime share the server process's figures);
    ``pdserve_remote_*{target, model}`` of remote models (:func:`remote_families`);
    ``pdserve_model_ready{model, version}`` (1 ready, 0 loading/failed/unavailable); and, only when ``pynvml`` imports and NVML
    finds a GPU, ``nv_gpu_utilization``, ``nv_gpu_memory_total_bytes``,
    ``nv_gpu_memory_used_bytes``, ``nv_gpu_power_usage``, ``nv_gpu_power_limit``,
    ``nv_energy_consumption`` (label ``gpu_uuid``). Without a GPU there are no GPU
    series and no error.

    Traffic control, from the sources :mod:`pdserve.app.main` registers in
    :attr:`MetricsExporter.sources`: ``pdserve_circuit_state`` (gauge: 0 closed, 1 open,
    2 half-open), ``pdserve_circuit_transitions_total{to}``,
    ``pdserve_circuit_rejected_total`` per model version; ``pdserve_auth_failures_total
    {protocol,reason}``, ``pdserve_auth_config_reloads_total{result}``,
    ``pdserve_rate_limited_total{scope,model,key}`` (``key`` is the key's configured name,
    never the key), ``pdserve_rate_limit_storage_errors_total``.
    Tracing, from :meth:`pdserve.observability.tracing.TraceManager.samples`:
    ``pdserve_trace_spans_exported_total`` and ``pdserve_trace_spans_dropped_total{reason}``
    (``queue_full``, ``export_failed``).

    Args:
        server: the core (:class:`MetricsSource`): its served model
            versions' statistics and its response cache, read at each scrape.
        cpu: include CPU / memory metrics.
        gpu: try NVML GPU metrics.
    """

    def __init__(self, server: MetricsSource, *, cpu: bool = True, gpu: bool = True) -> None:
        self.server = server
        #: more samples read at each scrape, as ``() -> iterable of (name, type, help,
        #: labels, value)`` (traffic control: auth, rate limits, circuit breakers)
        self.sources: list[Callable[[], Iterable[Sample]]] = []
        self.cpu = CpuSampler() if cpu else None
        self.gpu = GpuSampler.create() if gpu else None
        self._process = None
        if cpu:
            try:
                from prometheus_client import CollectorRegistry, ProcessCollector

                self._process = CollectorRegistry(auto_describe=False)
                ProcessCollector(registry=self._process)
            except ImportError:  # pragma: no cover - prometheus-client is a dependency
                self._process = None

    def model_stats(self) -> list[ModelStats]:
        """Statistics of every served model version, by name then version."""
        return self.server.served_model_stats()

    def render(self) -> bytes:
        """The whole exposition, Prometheus text format 0.0.4."""
        served = self.model_stats()
        fams = model_families(served)
        fams += memory_families(served, self.server.memory_report())
        fams += cache_families(self.server.response_cache)
        fams += readiness_families(self.server)
        fams += traffic_families(self.server)
        for source in self.sources:
            fams += sample_families(source())
        fams += remote_families()
        if self.cpu is not None:
            fams += self.cpu.families()
            fams += worker_families(self.server)
        if self.gpu is not None:
            fams += self.gpu.families()
        text = "".join(f.render() for f in fams).encode()
        if self._process is not None:
            from prometheus_client import generate_latest

            text += generate_latest(self._process)
        return text


def install_hooks() -> None:
    """Give every ModelStats created from now on its :class:`ModelMetrics` (recorded
    per request by the stats themselves)."""
    if attach not in stats_mod.LISTENERS:
        stats_mod.LISTENERS.append(attach)
