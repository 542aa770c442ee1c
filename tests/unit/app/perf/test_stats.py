"""Unit tests: ``pdserve perf`` arithmetic (pdserve.app.perf.stats): percentiles,
stability, server statistics deltas, merging windows into a level's result."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.app.perf.stats import (
    PointResult,
    ServerCounters,
    Window,
    is_stable,
    latency_summary,
    merge_windows,
    percentile,
    percentile_index,
    point_result,
    server_breakdown,
)


def test_percentile_index_is_perf_analyzers() -> None:
    # perf_analyzer: index = int(p / 100 * (n - 1) + 0.5)
    assert percentile_index(1, 50) == 0
    assert percentile_index(2, 50) == 1  # 0.5 rounds up
    assert percentile_index(100, 50) == 50  # 49.5 -> 50
    assert percentile_index(100, 99) == 98  # 98.01 -> 98
    assert percentile_index(101, 99) == 99
    assert percentile_index(10, 0) == 0 and percentile_index(10, 100) == 9
    with pytest.raises(ValueError):
        percentile_index(0, 50)
    with pytest.raises(ValueError):
        percentile_index(10, 101)


def test_percentile_values() -> None:
    values = np.arange(1, 1001)  # 1..1000
    assert percentile(values, 50) == 501  # index int(499.5 + 0.5) = 500
    assert percentile(values, 90) == 900  # int(899.1 + 0.5) = 899
    assert percentile(values, 99) == 990  # int(989.01 + 0.5) = 989
    assert percentile([7], 99) == 7


def test_latency_summary_us() -> None:
    ns = np.array([1000, 2000, 3000, 4000], dtype=np.int64)
    s = latency_summary(ns, extra_percentile=75)
    assert s["avg"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0
    assert s["p50"] == 3.0  # int(1.5 + 0.5) = 2 -> 3000 ns
    assert s["p75"] == 3.0  # int(2.25 + 0.5) = 2
    assert s["p99"] == 4.0
    assert s["std"] == pytest.approx(np.std([1, 2, 3, 4], ddof=1))
    assert latency_summary(np.zeros(0, dtype=np.int64)) == {}


@pytest.mark.parametrize(
    ("tp", "lat", "pct", "stable"),
    [
        ([100, 100, 100], [5, 5, 5], 10, True),
        ([100, 105, 109], [5, 5.2, 5.4], 10, True),  # 109/100 and 5.4/5 within 1.1
        ([100, 105, 111], [5, 5, 5], 10, False),  # 111/100 > 1.1
        ([100, 100, 100], [5, 5, 5.6], 10, False),  # latency 1.12
        ([100, 100], [5, 5], 10, False),  # fewer than 3 windows
        ([10, 500, 100, 102, 101], [1, 9, 5, 5, 5], 10, True),  # only the last 3 count
        ([0, 0, 0], [0, 0, 0], 10, False),  # nothing completed is never stable
        ([100, 120, 110], [5, 5, 5], 25, True),
    ],
)
def test_is_stable(tp: list[float], lat: list[float], pct: float, stable: bool) -> None:
    assert is_stable(tp, lat, pct) is stable


def _stats(success: int, queue_ns: int, infer_ns: int, execs: int) -> list[dict[str, object]]:
    return [
        {
            "name": "m",
            "version": "1",
            "inference_count": success,
            "execution_count": execs,
            "inference_stats": {
                "success": {"count": success, "ns": (queue_ns + infer_ns) * 2},
                "queue": {"count": success, "ns": queue_ns},
                "compute_input": {"count": success, "ns": 0},
                "compute_infer": {"count": success, "ns": infer_ns},
                "compute_output": {"count": success, "ns": 0},
            },
        },
        {"name": "other", "version": "1", "inference_count": 99},
    ]


def test_server_counters_delta_and_breakdown() -> None:
    a = ServerCounters.from_model_stats(_stats(10, 1_000_000, 2_000_000, 10), "m")
    b = ServerCounters.from_model_stats(_stats(110, 11_000_000, 42_000_000, 60), "m")
    d = (b - a).breakdown()
    assert d["success_count"] == 100
    assert d["queue_us"] == pytest.approx(100.0)  # 10 ms over 100 requests
    assert d["compute_infer_us"] == pytest.approx(400.0)
    assert d["request_us"] == pytest.approx(1000.0)
    assert d["overhead_us"] == pytest.approx(500.0)
    assert d["avg_batch_size"] == pytest.approx(2.0)  # 100 rows in 50 executions
    # gRPC's JSON form carries uint64 as strings; the version filter applies.
    g = ServerCounters.from_model_stats(
        [{"name": "m", "version": "3", "inference_stats": {"success": {"count": "5", "ns": "7"}}}],
        "m",
        "3",
    )
    assert g.counts["success"] == 5 and g.ns["success"] == 7
    assert ServerCounters.from_model_stats(_stats(1, 1, 1, 1), "m", "2").counts["success"] == 0


def _window(start_s: float, lat_us: list[float], errors: dict[str, int] | None = None) -> Window:
    return Window(
        start_ns=int(start_s * 1e9),
        end_ns=int((start_s + 1) * 1e9),
        latencies_ns=np.sort(np.asarray([x * 1000 for x in lat_us], dtype=np.int64)),
        send_ns=len(lat_us) * 2000,
        recv_ns=len(lat_us) * 1000,
        errors=errors or {},
        error_examples={k: f"example {k}" for k in errors or {}},
        sent=len(lat_us),
        server=ServerCounters.from_model_stats(_stats(len(lat_us), 1000, 1000, 1), "m"),
        client_cpu_s=0.001 * len(lat_us),
        client_cpu_max_s=0.0005 * len(lat_us),
    )


def test_merge_and_point_result() -> None:
    w = [
        _window(0, [10_000] * 2),  # a slow first window: not among the last 3
        _window(1, [100] * 10, {"HTTP 503": 1}),
        _window(2, [200] * 10),
        _window(3, [300] * 10, {"HTTP 503": 2, "timeout": 1}),
    ]
    merged = merge_windows(w[1:])
    assert merged.requests == 30 and merged.duration_s == pytest.approx(3.0)
    assert merged.errors == {"HTTP 503": 3, "timeout": 1}
    assert merged.server is not None and merged.server.counts["success"] == 30

    r = point_result("concurrency", 4, 2, w, stable=False, stabilizing_percentile=None)
    assert r.trials == 4 and r.request_count == 30
    assert r.requests_per_sec == pytest.approx(10.0)
    assert r.infer_per_sec == pytest.approx(20.0)  # batch 2
    assert r.latency_us["p50"] == 200.0 and r.latency_us["avg"] == pytest.approx(200.0)
    assert r.client_send_us == pytest.approx(2.0) and r.client_recv_us == pytest.approx(1.0)
    # Errors count over every window of the level, the first window's included.
    assert r.errors == {"HTTP 503": 3, "timeout": 1} and r.error_count == 4
    assert r.server is not None and r.server["success_count"] == 30
    assert [h["infer_per_sec"] for h in r.history] == pytest.approx([4.0, 20.0, 20.0, 20.0])
    # The load workers' CPU: 1 ms per request in all, the busiest worker half of it.
    assert r.client_cpu_us_per_request == pytest.approx(1000.0)
    assert r.client_busy == pytest.approx(0.0005 * 30 / 3)
    assert PointResult.from_dict(r.as_dict()) == r
    assert r.label == "concurrency 4"


def test_point_result_without_success() -> None:
    w = [_window(0, [], {"connection refused": 7})]
    w[0].server = None
    r = point_result("request_rate", 50, 1, w, False, 95, aborted="no successful response")
    assert r.request_count == 0 and r.infer_per_sec == 0 and r.latency_us == {}
    assert r.errors == {"connection refused": 7} and r.server is None
    assert r.aborted and r.label == "rate 50 req/s"
    assert r.stabilizing_latency_us() == 0.0


def test_stabilizing_latency_uses_percentile() -> None:
    lat = [100.0] * 98 + [5000.0, 9000.0]
    w = [_window(i, lat) for i in range(3)]
    assert point_result(
        "concurrency", 1, 1, w, True, None
    ).stabilizing_latency_us() == pytest.approx(np.mean(lat))
    assert point_result("concurrency", 1, 1, w, True, 99).stabilizing_latency_us() == 5000.0


def test_ensemble_breakdown_sums_composing_models() -> None:
    w = _window(0, [100] * 10)
    w.composing = {
        "pre": ServerCounters.from_model_stats(_stats(10, 1_000_000, 2_000_000, 10), "m"),
        "net": ServerCounters.from_model_stats(_stats(10, 3_000_000, 5_000_000, 5), "m"),
    }
    s = server_breakdown(w)
    assert s is not None
    assert s["queue_us"] == pytest.approx(100 + 300) and s["compute_infer_us"] == pytest.approx(700)
    assert s["composing"]["net"]["avg_batch_size"] == pytest.approx(2.0)
    merged = merge_windows([w, w])
    assert merged.composing["pre"].counts["success"] == 20
