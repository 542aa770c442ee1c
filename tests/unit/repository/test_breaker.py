"""The circuit breaker per model version (issue 12, item 3): policies, transitions."""

from __future__ import annotations

import logging

import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.repository.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    BreakerBoard,
    BreakerPolicy,
    BreakerSpecError,
    CircuitBreaker,
    is_failure,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(spec: str, clock: Clock) -> CircuitBreaker:
    policy = BreakerPolicy.parse(spec)
    assert policy is not None
    return CircuitBreaker("m", "1", policy, clock=clock)


def run(b: CircuitBreaker, failed: bool) -> None:
    probe = b.admit()
    b.record(probe, failed)


def test_parse_spec_defaults_and_off() -> None:
    assert BreakerPolicy.parse("on") == BreakerPolicy()
    assert BreakerPolicy.parse("off") is None
    p = BreakerPolicy.parse("consecutive_failures=3, open_secs=0.5")
    assert p == BreakerPolicy(consecutive_failures=3, open_secs=0.5)
    base = BreakerPolicy(min_requests=4)
    assert BreakerPolicy.parse("failure_rate=0.2", base) == BreakerPolicy(
        min_requests=4, failure_rate=0.2
    )


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("bogus=1", "expected KEY=VALUE"),
        ("open_secs", "expected KEY=VALUE"),
        ("open_secs=soon", "must be a number"),
        ("failure_rate=2", "0-1"),
        ("consecutive_failures=0,failure_rate=0", "needs consecutive_failures"),
        ("window_secs=0", "1-3600"),
        ("open_secs=0", "> 0"),
        ("half_open_probes=0", ">= 1"),
        ("min_requests=0", ">= 1"),
    ],
)
def test_bad_spec_is_a_clear_error(spec: str, match: str) -> None:
    with pytest.raises(BreakerSpecError, match=match):
        BreakerPolicy.parse(spec)


def test_consecutive_failures_open_then_half_open_probe_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    b = make("consecutive_failures=3,failure_rate=0,open_secs=5,half_open_probes=1", clock)
    caplog.set_level(logging.WARNING, "pdserve.breaker")
    run(b, True)
    run(b, True)
    run(b, False)  # a success resets the run
    run(b, True)
    run(b, True)
    assert b.state == CLOSED
    run(b, True)
    assert b.state == OPEN
    assert "circuit breaker m version 1: closed -> open (3 consecutive failures)" in caplog.text
    clock.now += 2
    with pytest.raises(InferError) as e:
        b.admit()
    assert e.value.code is ErrorCode.UNAVAILABLE
    assert e.value.retry_after == 3  # type: ignore[attr-defined]
    assert "circuit breaker open for model 'm' version 1" in e.value.message
    assert b.rejected == 1
    clock.now += 3
    probe = b.admit()
    assert probe is True and b.state == HALF_OPEN
    with pytest.raises(InferError):  # one probe at a time
        b.admit()
    b.record(probe, failed=False)
    assert b.state == CLOSED
    assert b.transitions == {CLOSED: 1, OPEN: 1, HALF_OPEN: 1}
    assert "half_open -> closed" in caplog.text


def test_failed_probe_opens_again() -> None:
    clock = Clock()
    b = make("consecutive_failures=1,open_secs=1", clock)
    run(b, True)
    assert b.state == OPEN
    clock.now += 1.5
    probe = b.admit()
    b.record(probe, failed=True)
    assert b.state == OPEN
    with pytest.raises(InferError):
        b.admit()
    clock.now += 1.0
    probe = b.admit()
    b.release(probe)  # a probe without an outcome frees its slot
    assert b.probes_running == 0 and b.state == HALF_OPEN


def test_failure_rate_needs_min_requests_within_the_window() -> None:
    clock = Clock()
    b = make("consecutive_failures=0,failure_rate=0.5,min_requests=10,window_secs=5", clock)
    for _ in range(4):  # 4 failures, 4 successes: under min_requests
        run(b, True)
        run(b, False)
    assert b.state == CLOSED
    assert b.window_counts() == (8, 4)
    clock.now += 10  # all of it leaves the window
    assert b.window_counts() == (0, 0)
    for _ in range(6):
        run(b, False)
    for _ in range(3):
        run(b, True)
    assert b.state == CLOSED  # 3 of 9
    run(b, True)
    run(b, True)  # 5 of 11 < 0.5
    assert b.state == CLOSED
    run(b, True)  # 6 of 12 = 0.5
    assert b.state == OPEN


def test_outcomes_that_count() -> None:
    assert is_failure(InferError("x", ErrorCode.INTERNAL))
    assert is_failure(InferError("x", ErrorCode.UNAVAILABLE))
    assert is_failure(RuntimeError("boom"))
    assert not is_failure(InferError("x", ErrorCode.INVALID_ARG))
    assert not is_failure(InferError("x", ErrorCode.CLIENT_GONE))
    assert not is_failure(InferError("x", ErrorCode.NOT_FOUND))
    # a request's own `timeout` parameter expired (core.cancel): the client chose it
    from pdserve.core.cancel import timeout_error

    assert not is_failure(timeout_error())
    assert is_failure(InferError("Request timeout expired", ErrorCode.UNAVAILABLE))  # queue


class Param:
    def __init__(self, value: str) -> None:
        self.string_value = value


class ModelVersionStub:
    """Identity only (the board keys breakers on the object, weakly)."""


def test_board_policy_per_model_and_fresh_breaker_on_reload(
    caplog: pytest.LogCaptureFixture,
) -> None:
    board = BreakerBoard(BreakerPolicy(consecutive_failures=7))
    mv1, mv2, mv3 = ModelVersionStub(), ModelVersionStub(), ModelVersionStub()
    b1 = board.for_version(mv1, "a", "1", {})
    assert b1 is not None and b1.policy.consecutive_failures == 7
    assert board.for_version(mv1, "a", "1", {}) is b1
    assert board.for_version(mv2, "b", "1", {"circuit_breaker": Param("off")}) is None
    b3 = board.for_version(mv3, "c", "1", {"circuit_breaker": Param("open_secs=9")})
    assert b3 is not None and b3.policy == BreakerPolicy(consecutive_failures=7, open_secs=9)
    reloaded = ModelVersionStub()
    assert board.for_version(reloaded, "a", "1", {}) is not b1
    bad = board.for_version(ModelVersionStub(), "d", "1", {"circuit_breaker": Param("x")})
    assert bad is not None and bad.policy.consecutive_failures == 7
    assert "config.pbtxt parameter circuit_breaker" in caplog.text
    assert BreakerBoard().for_version(ModelVersionStub(), "e", "1", {}) is None


def test_board_samples_for_metrics() -> None:
    board = BreakerBoard(BreakerPolicy(consecutive_failures=1))
    mv = ModelVersionStub()
    b = board.for_version(mv, "a", "2", {})
    assert b is not None
    run(b, True)
    samples = {(s[0], tuple(sorted(s[3].items()))): s[4] for s in board.samples()}
    assert samples[("pdserve_circuit_state", (("model", "a"), ("version", "2")))] == 1
    key = ("pdserve_circuit_transitions_total", (("model", "a"), ("to", "open"), ("version", "2")))
    assert samples[key] == 1
