"""pdserve.app.top: parsing, interval quantiles, the table and the TTY redraw."""

from __future__ import annotations

import io

import pytest

from pdserve.app import top

SCRAPE_1 = """# TYPE nv_inference_request_success counter
nv_inference_request_success{model="m",version="1"} 100
nv_inference_request_success{model="m",version="2"} 0
nv_inference_request_failure{model="m",version="1",reason="BACKEND"} 10
nv_inference_pending_request_count{model="m",version="1"} 0
pdserve_request_duration_seconds_bucket{model="m",version="1",le="0.001"} 50
pdserve_request_duration_seconds_bucket{model="m",version="1",le="0.01"} 100
pdserve_request_duration_seconds_bucket{model="m",version="1",le="+Inf"} 100
nv_cpu_utilization 0.5
"""
SCRAPE_2 = """nv_inference_request_success{model="m",version="1"} 180
nv_inference_request_success{model="m",version="2"} 20
nv_inference_request_failure{model="m",version="1",reason="BACKEND"} 30
nv_inference_pending_request_count{model="m",version="1"} 3
pdserve_request_duration_seconds_bucket{model="m",version="1",le="0.001"} 50
pdserve_request_duration_seconds_bucket{model="m",version="1",le="0.01"} 150
pdserve_request_duration_seconds_bucket{model="m",version="1",le="+Inf"} 200
pdserve_request_duration_seconds_bucket{model="m",version="2",le="0.001"} 0
pdserve_request_duration_seconds_bucket{model="m",version="2",le="0.01"} 0
pdserve_request_duration_seconds_bucket{model="m",version="2",le="+Inf"} 0
nv_inference_request_success{model="new",version="1"} 5
"""


def test_rows_between_two_scrapes() -> None:
    (m, new) = top.rows(top.parse(SCRAPE_1), top.parse(SCRAPE_2), 2.0)
    assert m.model == "m" and new.model == "new"
    assert m.qps == pytest.approx((100 + 20) / 2)
    assert m.err_per_s == pytest.approx(10) and m.err_ratio == pytest.approx(20 / 120)
    # the interval's 100 successes: 0 in (0, 1ms], 50 in (1ms, 10ms], 50 above 10 ms
    assert m.p50_ms == pytest.approx(10.0)
    assert m.p99_ms == pytest.approx(10.0)  # in +Inf: the highest finite bound
    assert m.queue == 3 and m.queue_p99_ms is None
    assert new.qps == pytest.approx(2.5) and new.p99_ms is None


def test_quantile_interpolates_like_prometheus() -> None:
    before = {0.1: 0.0, 0.2: 0.0, float("inf"): 0.0}
    after = {0.1: 10.0, 0.2: 20.0, float("inf"): 20.0}
    assert top.quantile(0.5, before, after) == pytest.approx(0.1)
    assert top.quantile(0.75, before, after) == pytest.approx(0.15)
    assert top.quantile(0.5, after, after) is None


def test_render_marks_missing_values() -> None:
    text = top.render(top.rows({}, top.parse(SCRAPE_1), 1.0), "http://x/metrics", 1.0)
    lines = text.splitlines()
    assert lines[1] == top.HEADER
    assert lines[2].split()[0] == "m"
    assert top.render([], "u", 1.0).splitlines()[-1] == "(no models served)"


def test_tty_redraws_in_place_and_count_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = iter([SCRAPE_1, SCRAPE_2, SCRAPE_2])
    monkeypatch.setattr(top, "scrape", lambda url: next(texts))
    out = io.StringIO()
    assert top.top("http://x/metrics", 0.1, 2, out, tty=True, sleep=lambda s: None) == 0
    assert out.getvalue().count("\x1b[H\x1b[2J") == 2
    assert out.getvalue().count("pdserve top --") == 2


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ("127.0.0.1:8002", "http://127.0.0.1:8002/metrics"),
        ("http://h:1/metrics", "http://h:1/metrics"),
        ("https://h/", "https://h/metrics"),
    ],
)
def test_metrics_url(given: str, want: str) -> None:
    assert top.metrics_url(given) == want
