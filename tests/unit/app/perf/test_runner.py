"""The coordinator of ``pdserve perf`` (pdserve.app.perf.runner): worker counts, load
shares, merging the workers' window records, and the message that ends a sweep; and the
control client's address parsing (pdserve.app.perf.control)."""

from __future__ import annotations

import array

import pytest

from pdserve.app.perf import runner
from pdserve.app.perf.control import GrpcControl, HttpControl, connect, split_host_port
from pdserve.app.perf.load import WindowRecord
from pdserve.app.perf.options import PerfError, PerfOptions
from pdserve.app.perf.runner import (
    MAX_AUTO_WORKERS,
    auto_workers,
    describe_failure,
    split,
    window_from_parts,
)
from pdserve.app.perf.stats import ServerCounters


def test_split_spreads_evenly_first_parts_get_more() -> None:
    assert split(10, 3) == [4, 3, 3]
    assert split(2, 4) == [1, 1, 0, 0]
    assert split(8, 2) == [4, 4]
    assert sum(split(1001, 7)) == 1001


def test_auto_workers_follows_the_peak_concurrency_bounded_by_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner, "available_cpus", lambda: 1)
    assert auto_workers(PerfOptions(model="m", concurrency=[1, 2, 3])) == 3
    assert auto_workers(PerfOptions(model="m", concurrency=[16])) == 4  # 4 per CPU
    assert auto_workers(PerfOptions(model="m", request_rates=[5.0])) == 4
    monkeypatch.setattr(runner, "available_cpus", lambda: 64)
    assert auto_workers(PerfOptions(model="m", concurrency=[64])) == MAX_AUTO_WORKERS
    assert auto_workers(PerfOptions(model="m", request_rates=[5.0])) == MAX_AUTO_WORKERS
    assert auto_workers(PerfOptions(model="m")) == 1  # concurrency 1 by default


def _record(lat: list[int], cpu: float, errors: dict[str, int] | None = None) -> WindowRecord:
    return WindowRecord(
        cpu_s=cpu,
        lat=array.array("q", lat).tobytes(),
        send_ns=10 * len(lat),
        recv_ns=20 * len(lat),
        errors=errors or {},
        examples={k: f"{k} example" for k in errors or {}},
        sent=len(lat) + sum((errors or {}).values()),
        delayed=1,
    )


def test_window_from_parts_merges_the_workers_records() -> None:
    counters = ServerCounters()
    window = window_from_parts(
        [_record([30, 10], 0.5, {"timeout": 1}), _record([20], 0.25, {"timeout": 2, "503": 1})],
        1_000,
        2_000_001_000,
        (counters, {"step": counters}),
    )
    assert window.latencies_ns.tolist() == [10, 20, 30]
    assert (window.send_ns, window.recv_ns) == (30, 60)
    assert window.errors == {"timeout": 3, "503": 1}
    assert window.error_examples == {"timeout": "timeout example", "503": "503 example"}
    assert (window.sent, window.delayed) == (7, 2)
    assert window.client_cpu_s == 0.75 and window.client_cpu_max_s == 0.5
    assert window.server is counters and window.composing == {"step": counters}
    assert window.duration_s == 2.0

    empty = window_from_parts([], 0, 10, None)
    assert empty.latencies_ns.size == 0 and empty.server is None and empty.composing == {}
    assert empty.client_cpu_max_s == 0.0


def test_describe_failure_names_the_errors_or_the_stall() -> None:
    failed = window_from_parts([_record([], 0.1, {"timeout": 1, "503": 4})], 0, 1_500_000_000, None)
    assert describe_failure(failed, "concurrency 2", 0) == (
        "no successful response in a 1.5 s window at concurrency 2 (503: 4, timeout: 1)"
        "; 503: 503 example"
    )
    stalled = window_from_parts([_record([], 0.1)], 0, 2_000_000_000, None)
    assert describe_failure(stalled, "concurrency 4", 4) == (
        "no response in a 2 s window at concurrency 4: the server stalled (4 requests outstanding)"
    )


@pytest.mark.parametrize(
    ("url", "default", "expected"),
    [
        ("localhost:8000", 80, ("localhost", 8000)),
        ("http://example.org:9000/", 80, ("example.org", 9000)),
        ("example.org", 8001, ("example.org", 8001)),
        ("[::1]:8001", 80, ("::1", 8001)),
        ("[::1]", 8001, ("::1", 8001)),
        (":8000", 80, ("localhost", 8000)),
        ("", 80, ("localhost", 80)),
    ],
)
def test_split_host_port(url: str, default: int, expected: tuple[str, int]) -> None:
    assert split_host_port(url, default) == expected


def test_split_host_port_rejects_a_port_that_is_not_a_number() -> None:
    with pytest.raises(PerfError, match="'host:http': the port must be a number"):
        split_host_port("host:http", 80)


def test_connect_picks_the_protocol_and_its_default_port() -> None:
    http = connect("http", "http://127.0.0.1/", "m", "2", 1.0)
    assert isinstance(http, HttpControl) and http.url == "127.0.0.1:80"
    assert http._model_path() == "/v2/models/m/versions/2"
    grpc = connect("grpc", "127.0.0.1:1", "a/b", "", 1.0)
    try:
        assert isinstance(grpc, GrpcControl)
    finally:
        grpc.close()
    assert HttpControl("h:1", "a/b", "", 1.0)._model_path() == "/v2/models/a%2Fb"
