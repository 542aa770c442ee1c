"""``pdserve analyze``'s recommendation (:mod:`pdserve.app.analyze.recommend`) on
synthetic results: the best level under the SLO, feasibility under the memory
budget, ranking, the search's margin, the gain and the memory fit."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.app.analyze.recommend import (
    MIB,
    MIN_LEVEL_REQUESTS,
    ConfigResult,
    Constraints,
    LevelResult,
    better,
    decide,
    feasible,
    gain,
    memory_fit,
    rank_key,
    recommend,
    violations,
)
from pdserve.app.analyze.space import Knobs


def result(
    index: int,
    levels: list[tuple[int, float, float]],
    mem_mib: float | None = 100,
    instances: int = 1,
    **kw: Any,
) -> ConfigResult:
    """levels: (concurrency, infer/s, p99 ms)."""
    return ConfigResult(
        index=index,
        point={"m": Knobs(instances, 8, (), 0)},
        levels=[LevelResult(c, t, p99 / 2, p99) for c, t, p99 in levels],
        memory_bytes=None if mem_mib is None else mem_mib * MIB,
        **kw,
    )


def test_best_level_is_the_fastest_within_the_slo_without_errors() -> None:
    r = result(0, [(1, 100, 5), (2, 180, 9), (4, 250, 20), (8, 260, 45)])
    assert r.best_level(None).concurrency == 8
    assert r.best_level(25).concurrency == 4
    assert r.best_level(9).concurrency == 2
    assert r.best_level(4) is None
    assert r.score(25) == 250 and r.score(4) == 0
    r.levels[2].errors = 3
    assert r.best_level(25).concurrency == 2


def test_recommend_takes_the_highest_throughput_under_slo_and_budget() -> None:
    results = [
        result(0, [(1, 100, 5), (4, 300, 30)], mem_mib=200, shipped=True),
        result(1, [(1, 150, 4), (4, 420, 18)], mem_mib=900),  # best, but over the budget
        result(2, [(1, 140, 4), (4, 380, 19)], mem_mib=400),
        result(3, [(1, 160, 4), (4, 500, 60)], mem_mib=300),  # fastest, above the SLO at 4
    ]
    c = Constraints(p99_ms=20, memory_bytes=512 * MIB)
    rec = recommend(results, c)
    assert rec is results[2]
    assert violations(results[1], c) == ["memory 900 MiB above the 512 MiB budget"]
    assert feasible(results[3], c) and results[3].score(20) == 160
    # without the budget #1 wins; without the SLO #3's 500 wins
    assert recommend(results, Constraints(p99_ms=20)) is results[1]
    assert recommend(results, Constraints()) is results[3]


def test_ties_go_to_less_memory_then_the_first_measured() -> None:
    a = result(0, [(4, 300, 10)], mem_mib=300)
    b = result(1, [(4, 300, 10)], mem_mib=200)
    c = result(2, [(4, 300, 10)], mem_mib=200)
    assert recommend([a, b, c], Constraints(p99_ms=20)) is b


def test_unknown_memory_passes_the_budget() -> None:
    r = result(0, [(1, 100, 5)], mem_mib=None)
    assert feasible(r, Constraints(memory_bytes=1))


def test_nothing_feasible_gives_no_recommendation_and_says_why() -> None:
    results = [
        result(0, [(1, 100, 30)], mem_mib=100),
        result(1, [(1, 100, 5)], mem_mib=4096),
        ConfigResult(2, {"m": Knobs(1, 8)}, status="failed", error="does not load"),
        result(3, [(1, 0, 0)], mem_mib=10),
    ]
    results[3].levels[0].errors = 5
    c = Constraints(p99_ms=10, memory_bytes=1024 * MIB)
    assert recommend(results, c) is None
    assert violations(results[0], c) == ["p99 30.0 ms at best, above the 10 ms SLO"]
    assert violations(results[2], c) == ["failed: does not load"]
    assert violations(results[3], c) == ["no level without errors"]
    # ranked by how far they miss: 1.0x... p99 3x, memory 4x, errors, failed
    order = sorted(results, key=lambda r: rank_key(r, c), reverse=True)
    assert [r.index for r in order] == [0, 1, 3, 2]


def test_confirmation_runs_are_not_candidates() -> None:
    first = result(0, [(1, 100, 5)])
    again = result(1, [(1, 500, 5)], repeat=1)
    assert recommend([first, again], Constraints()) is first


def test_better_needs_the_margin_between_feasible_results() -> None:
    c = Constraints(p99_ms=10)
    base = result(0, [(1, 100, 5)])
    assert better(result(1, [(1, 103, 5)]), base, c, min_gain=0.02)
    assert not better(result(1, [(1, 101, 5)]), base, c, min_gain=0.02)
    assert better(result(1, [(1, 101, 5)]), base, c, min_gain=0.0)
    # feasible beats infeasible whatever the throughput
    assert better(result(1, [(1, 10, 5)]), result(2, [(1, 900, 50)]), c, min_gain=0.5)


def test_gain_is_the_ratio_of_medians() -> None:
    c = Constraints(p99_ms=10)
    rec = [result(0, [(1, 200, 5)]), result(1, [(1, 240, 5)]), result(2, [(1, 220, 5)])]
    ship = [result(3, [(1, 100, 5)]), result(4, [(1, 110, 5)])]
    assert gain(rec, ship, c) == pytest.approx(220 / 105)
    assert gain(rec, [result(5, [(1, 100, 50)])], c) is None  # shipped never within the SLO


def test_memory_fit_separates_the_fixed_cost_from_each_instance() -> None:
    rs = [result(0, [], mem_mib=100 + 30 * n, instances=n) for n in (1, 2, 4) for _ in range(2)]
    fixed, per = memory_fit(rs)
    assert fixed / MIB == pytest.approx(100) and per / MIB == pytest.approx(30)
    assert memory_fit([result(0, [], instances=2), result(1, [], instances=2)]) is None
    # batching knobs that add memory of their own do not pass for the instances'
    big = [result(0, [], mem_mib=400 + 30 * n, instances=n) for n in (1, 3)]
    for r in big:
        r.point = {"m": Knobs(r.instances, 32, (), 0)}
    lone = result(9, [], mem_mib=900, instances=5)
    lone.point = {"m": Knobs(5, 16, (), 0)}  # alone in its group: no slope from it
    fixed, per = memory_fit([*rs, *big, lone])
    assert per / MIB == pytest.approx(30) and fixed / MIB == pytest.approx(100)


def test_results_round_trip_through_json_values() -> None:
    r = result(3, [(1, 100, 5), (2, 150, 8)], shipped=True, stop_reason="p99 above the SLO")
    r.point = {"a": Knobs(2, 16, (4, 8), 100), "b": Knobs(1, 0)}
    d = r.as_dict()
    assert d["point"]["b"] == {
        "instances": 1,
        "max_batch_size": 0,
        "preferred": [],
        "delay_us": None,
    }
    back = ConfigResult.from_dict(d)
    assert back.as_dict() == d
    assert back.label == "#3 shipped"
    assert back.description == "a: 2 inst, batch 16, delay 100us, preferred 4+8; b: 1 inst"


def test_levels_with_few_requests_or_aborted_do_not_count() -> None:
    r = result(0, [(1, 100, 5), (2, 150, 8)])
    r.levels[1].requests = MIN_LEVEL_REQUESTS - 1
    assert r.best_level(10).concurrency == 1
    r.levels[1].requests = MIN_LEVEL_REQUESTS
    assert r.best_level(10).concurrency == 2
    r.levels[1].aborted = "no response in a 1 s window at concurrency 2: the server stalled"
    assert r.best_level(10).concurrency == 1
    few = result(1, [(1, 3, 5)])
    few.levels[0].requests = 9
    assert violations(few, Constraints(p99_ms=10)) == [
        "no level of 50 requests or more (raise --measurement-interval)"
    ]


def test_decide_reports_both_gains_and_keeps_a_confirmed_pick() -> None:
    c = Constraints(p99_ms=10)
    runs = [
        result(0, [(1, 100, 5)], shipped=True),
        result(1, [(1, 150, 5)]),
        result(2, [(1, 105, 5)], shipped=True, repeat=1),
        result(3, [(1, 140, 5)], repeat=1),
    ]
    d = decide(runs, c, min_gain=0.02)
    assert d.recommended is runs[1] and d.shipped is runs[0] and d.unconfirmed is None
    assert d.gain_search == pytest.approx(1.5)
    assert d.gain_confirmed == pytest.approx(140 / 105)


def test_decide_falls_back_to_shipped_when_the_gain_is_not_confirmed() -> None:
    c = Constraints(p99_ms=10)
    runs = [
        result(0, [(1, 100, 5)], shipped=True),
        result(1, [(1, 150, 5)]),  # a lucky measurement
        result(2, [(1, 110, 5)], shipped=True, repeat=1),
        result(3, [(1, 101, 5)], repeat=1),
    ]
    d = decide(runs, c, min_gain=0.02)
    assert d.recommended is runs[0] and d.unconfirmed is runs[1]
    assert d.gain_confirmed == pytest.approx(101 / 110)
    # a shipped configuration that never met the objective is no fallback
    runs[0].levels[0].p99_ms = runs[2].levels[0].p99_ms = 50
    d = decide(runs, c, min_gain=0.02)
    assert d.recommended is runs[1] and d.unconfirmed is None and d.gain_confirmed is None
    # no confirmation runs: the search's pick, its search gain only
    d = decide(runs[:2], Constraints(), min_gain=0.02)
    assert d.recommended is runs[1] and d.gain_confirmed is None
