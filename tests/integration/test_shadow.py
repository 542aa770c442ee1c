"""Shadow traffic (issue 12, item 5): a share of split requests is mirrored to a
candidate version off the caller's path, outputs are compared with a tolerance, and
divergence is counted, rated and sampled; a shadow that diverges, is slow, crashes or
does not exist never changes what the caller gets."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import ServerProcess, start_server
from tests.traffic_helpers import (
    XF,
    faulty_model,
    http,
    infer_faulty,
    metric_value,
    scrape,
    wait_for,
)

MODEL = "shadowed"
TRAFFIC = """weights: {1: 100}
shadow:
  version: 2
  percent: 100
  queue_size: 4
  compare:
    Y: {atol: 0.01, rtol: 0}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("shadow")
    repo = tmp / "repo"
    repo.mkdir()
    faulty_model(repo, MODEL, 2, TRAFFIC)
    srv = start_server(repo, tmp / "pdserve.log")
    srv.repo = repo  # type: ignore[attr-defined]  # the tests switch faults in it
    yield srv
    srv.stop()


def _fault(server: ServerProcess, version: int, mode: str) -> None:
    path = Path(server.repo) / MODEL / f"fault.{version}"  # type: ignore[attr-defined]
    if mode:
        path.write_text(mode)
    else:
        path.unlink(missing_ok=True)


def _traffic(server: ServerProcess) -> dict:
    status, doc, _ = http(server, "GET", f"/v2/models/{MODEL}/traffic")
    assert status == 200, doc
    return doc


def _callers(server: ServerProcess, n: int) -> list[float]:
    """``n`` requests; each must be answered by version 1 with Y = X; their latencies."""
    latencies = []
    for _ in range(n):
        start = time.monotonic()
        status, doc = infer_faulty(server, MODEL)
        latencies.append(time.monotonic() - start)
        assert status == 200, doc
        assert doc["model_version"] == "1"
        assert doc["outputs"][0]["data"] == XF.ravel().tolist()
    return latencies


def _wait(server: ServerProcess, pred: Callable[[dict], bool], timeout: float = 30) -> dict:
    """Poll GET /traffic until ``pred(doc)``; the doc."""

    def check() -> dict | None:
        doc = _traffic(server)
        return doc if pred(doc) else None

    return wait_for(check, timeout, "the shadow's counters")


def _result(doc: dict, kind: str) -> int:
    return doc["shadow"]["results"].get("2", {}).get(kind, 0)


def test_agreeing_shadow_is_compared_and_does_not_diverge(server: ServerProcess) -> None:
    _fault(server, 2, "")
    _callers(server, 30)
    doc = _wait(server, lambda d: _result(d, "compared") >= 25)
    assert doc["shadow"]["divergence"].get("Y", 0) == 0
    assert doc["shadow"]["divergence_rate"]["Y"] == 0.0


def test_divergence_is_counted_rated_and_sampled(server: ServerProcess) -> None:
    before = _traffic(server)["shadow"]["divergence"].get("Y", 0)
    _fault(server, 2, "diverge")
    _callers(server, 20)
    doc = _wait(server, lambda d: d["shadow"]["divergence"].get("Y", 0) >= before + 15)
    assert doc["shadow"]["divergence_rate"]["Y"] > 0.2
    sample = doc["shadow"]["divergent_samples"][-1]
    assert sample["shadow_version"] == "2" and "max abs diff 0.5" in sample["outputs"]["Y"]
    text = scrape(server)
    assert metric_value(text, "pdserve_shadow_divergence_total", model=MODEL, output="Y") >= 15
    assert metric_value(text, "pdserve_shadow_divergence_rate", model=MODEL, output="Y") > 0
    assert "diverges from version 1 on output Y" in server.log()
    _fault(server, 2, "")


def test_slow_shadow_never_slows_the_caller_and_is_shed(server: ServerProcess) -> None:
    _fault(server, 2, "slow:1.0")
    try:
        latencies = _callers(server, 40)
    finally:
        _fault(server, 2, "")
    # the shadow takes 1 s per request; the callers never wait for it
    assert sorted(latencies)[int(0.95 * len(latencies))] < 0.5, latencies
    assert sum(latencies) < 15
    doc = _traffic(server)
    assert _result(doc, "shed") >= 20  # queue of 4: most mirrors are shed


def test_crashing_shadow_costs_the_caller_nothing(server: ServerProcess) -> None:
    _fault(server, 2, "crash")
    try:
        _callers(server, 15)
        wait_for(lambda: _result(_traffic(server), "error") >= 1, 60, "a shadow error")
    finally:
        _fault(server, 2, "")
    _callers(server, 5)
    assert server.proc.poll() is None


def test_shadow_target_that_does_not_exist(server: ServerProcess) -> None:
    status, doc, _ = http(
        server,
        "POST",
        f"/v2/models/{MODEL}/traffic",
        {"weights": {"1": 100}, "shadow": {"version": 7}},
    )
    assert status == 200
    _callers(server, 10)
    _wait(server, lambda d: d["shadow"]["results"].get("7", {}).get("missing", 0) >= 5)
    assert "shadow version 7 of model shadowed is not served" in server.log()
    status, _, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {"reset": True})
    assert status == 200
