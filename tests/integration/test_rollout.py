"""SLO-driven promotion and rollback (issue 12, item 6), under continuous load: a
healthy canary is promoted step by step; a canary that errors on every request and a
canary that is slow are rolled back within seconds, no request fails because of the
rollback itself, and every decision is a log line, a metric and an admin-endpoint
entry. A malformed rollout section is a clear load error."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.conftest import ServerProcess, start_server
from tests.traffic_helpers import Load, faulty_model, http, metric_value, scrape, wait_for

POLICY = """weights: {1: 100}
rollout:
  canary: 2
  steps: [10, 50, 100]
  step_secs: 1
  window_secs: 10
  min_requests: 20
  max_error_rate: 0.05
  max_p99_ms: 250
  interval_secs: 0.2
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("rollout")
    repo = tmp / "repo"
    repo.mkdir()
    faulty_model(repo, "healthy", 2, POLICY)
    faulty_model(repo, "erroring", 2, POLICY)
    (repo / "erroring" / "fault.2").write_text("error")
    faulty_model(repo, "slow", 2, POLICY, instances=2)
    (repo / "slow" / "fault.2").write_text("slow:0.3")
    faulty_model(repo, "badroll", 2, POLICY.replace("[10, 50, 100]", "[50, 10, 100]"))
    srv = start_server(repo, tmp / "pdserve.log")
    srv.repo = repo  # type: ignore[attr-defined]  # tests switch faults in it
    yield srv
    srv.stop()


def _rollout(server: ServerProcess, model: str) -> dict:
    status, doc, _ = http(server, "GET", f"/v2/models/{model}/rollout")
    assert status == 200, doc
    return doc


def _wait_state(server: ServerProcess, model: str, state: str, timeout: float) -> dict:
    def check() -> dict | None:
        doc = _rollout(server, model)
        return doc if doc["state"] == state else None

    return wait_for(check, timeout, f"{model} rollout {state}")


def test_healthy_canary_is_promoted_step_by_step(server: ServerProcess) -> None:
    with Load(server, "healthy") as load:
        doc = _wait_state(server, "healthy", "promoted", 120)
        time.sleep(0.5)
    actions = [d["action"] for d in doc["decisions"]]
    assert actions == ["start", "promote", "promote", "promoted"], doc["decisions"]
    assert [d["weights"].get("2") for d in doc["decisions"]] == [10.0, 50.0, 100.0, 100.0]
    assert doc["weights"] == {"2": 100.0}
    assert load.failures() == 0
    versions = {v for _, s, v in load.results}
    assert versions == {"1", "2"}
    assert load.results[-1][2] == "2"
    text = scrape(server)
    assert (
        metric_value(text, "pdserve_rollout_decisions_total", model="healthy", action="promote")
        == 2
    )
    assert metric_value(text, "pdserve_rollout_state", model="healthy", state="promoted") == 1
    assert "rollout decision: model healthy promoted" in server.log()


def test_erroring_canary_is_rolled_back_within_seconds(server: ServerProcess) -> None:
    with Load(server, "erroring") as load:
        doc = _wait_state(server, "erroring", "rolled_back", 60)
        rolled = time.monotonic()
        time.sleep(2.0)
    rollback = doc["decisions"][-1]
    assert rollback["action"] == "rollback" and "error rate" in rollback["reason"]
    assert rollback["weights"] == {"1": 100.0}
    assert doc["window"]["canary"]["errors"] >= 20
    # the canary's own errors fail requests until the rollback; the rollback fails none
    # (allow for requests that were already in flight on the canary when it happened)
    assert load.failures(since=rolled + 0.5) == 0
    assert 0 < load.failures() < 200
    assert all(v == "1" for t, s, v in load.results if t > rolled + 0.5)
    text = scrape(server)
    assert (
        metric_value(text, "pdserve_rollout_decisions_total", model="erroring", action="rollback")
        == 1
    )
    assert "rollout decision: model erroring rollback: error rate" in server.log()


def test_slow_canary_is_rolled_back(server: ServerProcess) -> None:
    with Load(server, "slow", threads=4) as load:
        doc = _wait_state(server, "slow", "rolled_back", 90)
        rolled = time.monotonic()
        time.sleep(1.0)
    assert "p99" in doc["decisions"][-1]["reason"]
    assert load.failures() == 0  # slow is not failed
    assert all(v == "1" for t, s, v in load.results if t > rolled + 1.0)


def test_admin_actions_and_restart_after_a_fix(server: ServerProcess) -> None:
    status, doc, _ = http(server, "POST", "/v2/models/erroring/rollout", {"action": "explode"})
    assert status == 400 and "action" in doc["error"]
    (server.repo / "erroring" / "fault.2").unlink()  # type: ignore[attr-defined]
    status, doc, _ = http(server, "POST", "/v2/models/erroring/rollout", {"action": "restart"})
    assert status == 200 and doc["state"] == "running" and doc["weights"]["2"] == 10.0
    status, doc, _ = http(server, "POST", "/v2/models/erroring/rollout", {"action": "rollback"})
    assert status == 200 and doc["state"] == "rolled_back"
    assert doc["decisions"][-1] == {
        **doc["decisions"][-1],
        "action": "rollback",
        "reason": "admin request",
    }
    status, doc, _ = http(server, "GET", "/v2/models/nosuch/rollout")
    assert status == 404


def test_bad_rollout_section_is_a_load_error(server: ServerProcess) -> None:
    status, rows, _ = http(server, "POST", "/v2/repository/index", {})
    row = next(r for r in rows if r["name"] == "badroll")
    assert row.get("state") == "UNAVAILABLE"
    assert "rollout" in row["reason"] and "steps" in row["reason"]
    assert server.proc.poll() is None
