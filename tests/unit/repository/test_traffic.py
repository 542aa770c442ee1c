"""Traffic file parsing, the weighted / sticky split and output comparison
(pdserve.repository.traffic), and the rollout policy and windows (rollout)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from pdserve.repository.rollout_policy import RolloutPolicy
from pdserve.repository.traffic import (
    Split,
    Tolerance,
    TrafficError,
    outputs_agree,
    parse_traffic,
)
from pdserve.repository.windows import Window


def test_weights_must_sum_to_100() -> None:
    assert parse_traffic({"weights": {1: 90, "2": 10}}).weights == {1: 90.0, 2: 10.0}
    with pytest.raises(TrafficError, match="weights sum to 95"):
        parse_traffic({"weights": {1: 90, 2: 5}})
    for bad in ({1: -10, 2: 110}, {1: "x"}, {"v1": 100}, {}, {1: True}):
        with pytest.raises(TrafficError):
            parse_traffic({"weights": bad})
    with pytest.raises(TrafficError, match="unknown key"):
        parse_traffic({"weight": {1: 100}})
    with pytest.raises(TrafficError, match="version"):
        parse_traffic({"shadow": {"percent": 10}})
    with pytest.raises(TrafficError, match="top_k"):
        parse_traffic({"shadow": {"version": 2, "compare": {"y": {"top_k": -1}}}})


def test_split_shares_and_stickiness() -> None:
    split = Split({1: 90, 2: 10})
    seen = collections.Counter(split.pick() for _ in range(20_000))
    assert abs(seen[2] / 20_000 - 0.10) < 0.015
    keys = [f"k{i}" for i in range(5000)]
    first = {k: split.pick(k) for k in keys}
    assert all(split.pick(k) == first[k] for k in keys[:200])
    assert abs(sum(v == 2 for v in first.values()) / 5000 - 0.10) < 0.02
    # raising the canary only moves keys onto it
    bigger = Split({1: 75, 2: 25})
    assert all(bigger.pick(k) == 2 for k, v in first.items() if v == 2)
    assert Split({}).pick("x") is None


def test_outputs_agree() -> None:
    a = np.array([[1.0, 2.0, 3.0]], np.float32)
    assert outputs_agree(a, a + 1e-7, Tolerance())[0]
    ok, detail = outputs_agree(a, a + 0.5, Tolerance(atol=0.1, rtol=0))
    assert not ok and "max abs diff 0.5" in detail
    assert not outputs_agree(a, a[:, :2], Tolerance())[0]
    labels = np.array([[b"cat", b"dog"]], dtype=object)
    assert outputs_agree(labels, labels.copy(), Tolerance())[0]
    assert not outputs_agree(labels, np.array([[b"dog", b"cat"]], dtype=object), Tolerance())[0]
    assert outputs_agree(labels, np.array([[b"dog", b"cat"]], dtype=object), Tolerance(top_k=2))[0]
    scores = np.array([[0.1, 0.5, 0.3, 0.05]])
    assert outputs_agree(scores, scores * 2, Tolerance(top_k=2))[0]
    assert not outputs_agree(scores, np.array([[0.9, 0.5, 0.3, 0.05]]), Tolerance(top_k=2))[0]


def test_rollout_policy_and_window() -> None:
    p = RolloutPolicy.parse({"canary": 2, "steps": [5, 50, 100], "max_p99_ms": 100})
    assert p.steps == (5.0, 50.0, 100.0) and p.baseline is None
    for bad in ({}, {"canary": 2, "steps": [50, 10, 100]}, {"canary": 2, "steps": [10]},
                {"canary": 2, "max_error_rate": 2}, {"canary": 2, "baseline": 2},
                {"canary": 2, "surprise": 1}):  # fmt: skip
        with pytest.raises(TrafficError):
            RolloutPolicy.parse(bad)
    w = Window()
    for i in range(100):
        w.add(0.001 * (i + 1), i % 10 == 0)
    s = w.summary(60)
    assert s["requests"] == 100 and s["errors"] == 10
    assert s["p99_ms"] == pytest.approx(99.0, rel=0.16)
    assert Window().summary(10)["p99_ms"] is None
