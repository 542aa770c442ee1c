"""pdserve.core.stats.RecentWindow: the ``pdserve_recent`` stats extra (issue 17)."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.core.stats import ModelStats, RecentWindow


def test_quantiles_error_rate_and_qps() -> None:
    w = RecentWindow(60)
    rng = np.random.default_rng(3)
    lat_ns = rng.uniform(1e6, 3e6, 1000)  # 1-3 ms
    for i, ns in enumerate(lat_ns):
        w.record(True, int(ns), now=1000 + i % 30)
    for i in range(250):
        w.record(False, now=1000 + i % 30)
    s = w.summary(now=1029)
    assert (s["success"], s["failure"], s["window_s"]) == (1000, 250, 60)
    assert s["error_rate"] == pytest.approx(0.2)
    assert s["qps"] == pytest.approx(1250 / 60, abs=1e-3)
    for q in (50, 90, 99):
        exact = np.percentile(lat_ns, q) / 1000
        assert s["latency_us"][f"p{q}"] == pytest.approx(exact, rel=0.12), q


def test_old_seconds_leave_the_window() -> None:
    w = RecentWindow(60)
    w.record(True, 5_000_000, now=100)
    w.record(False, now=130)
    assert w.summary(now=159)["success"] == 1
    s = w.summary(now=160)  # 100 is 60 s old: out
    assert (s["success"], s["failure"], s["latency_us"]) == (0, 1, None)
    w.record(True, 1_000, now=160 + 60 * 3)  # reuses slot 100's position
    s = w.summary(now=240)
    assert (s["success"], s["failure"]) == (1, 0)
    assert s["latency_us"]["p50"] <= 11.2  # first bucket: <= 10 µs, interpolated


def test_empty_window() -> None:
    s = RecentWindow().summary(now=5)
    assert s == {
        "window_s": 60,
        "success": 0,
        "failure": 0,
        "error_rate": 0.0,
        "qps": 0.0,
        "latency_us": None,
    }


def test_model_stats_entry_keeps_tritons_fields_and_adds_recent() -> None:
    st = ModelStats("m", "1")
    st.record_success(1, 2_000_000, 100, 1_000_000)
    st.record_failure(3_000_000)
    d = st.as_dict()
    assert list(d)[:9] == [
        "name", "version", "last_inference", "inference_count", "execution_count",
        "inference_stats", "response_stats", "batch_stats", "memory_usage",
    ]  # fmt: skip
    recent = d["pdserve_recent"]
    assert (recent["success"], recent["failure"], recent["error_rate"]) == (1, 1, 0.5)
    assert recent["latency_us"]["p50"] == pytest.approx(2000, rel=0.12)
