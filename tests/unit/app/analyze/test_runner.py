"""``pdserve analyze``'s search orders and sweep rules (:mod:`pdserve.app.analyze.search`,
:mod:`pdserve.app.analyze.sweep`), driven by a synthetic measurement: a known
throughput surface over the knobs, so the hill climbing's path, its stop and its
budget are checked exactly."""

from __future__ import annotations

from pdserve.app.analyze.recommend import ConfigResult, Constraints, LevelResult
from pdserve.app.analyze.search import grid_search, quick_search
from pdserve.app.analyze.space import Knobs, Point, build_space, point_key
from pdserve.app.analyze.sweep import bisect_bounds, sweep_stop_reason

SHIPPED = Knobs(instances=2, max_batch_size=32, preferred=(), delay_us=None)


def surface(k: Knobs) -> tuple[float, float]:
    """(throughput, p99 ms): batching helps, most at max_batch_size 8; 2 instances
    beat 1 and 3; queue delay costs latency."""
    tput = 100.0 * {1: 0.8, 2: 1.0, 3: 0.9}[k.instances]
    p99 = 10.0
    if k.batching:
        tput *= 1.0 + 0.5 * {1: 0, 2: 0.4, 4: 0.8, 8: 1.0, 16: 0.9, 32: 0.7}[k.max_batch_size]
        p99 += (k.delay_us or 0) / 100.0
        if k.preferred:
            tput *= 0.95
    return tput, p99


class Bench:
    """A synthetic ``measure``: results from :func:`surface`, counted."""

    def __init__(self) -> None:
        self.measured: list[Point] = []
        self.results: list[ConfigResult] = []

    def __call__(self, point: Point, shipped: bool) -> ConfigResult:
        self.measured.append(point)
        tput, p99 = surface(point["m"])
        r = ConfigResult(
            index=len(self.measured) - 1,
            point=point,
            shipped=shipped,
            levels=[LevelResult(1, tput, p99 / 2, p99)],
        )
        self.results.append(r)
        return r


def unlimited() -> tuple[bool, str]:
    return True, ""


def test_quick_search_climbs_to_the_optimum_with_few_measurements() -> None:
    space = build_space("m", {"m": SHIPPED}, cpus=3)
    bench = Bench()
    notes: list[str] = []
    why = quick_search(space, bench, unlimited, Constraints(p99_ms=12), 0.02, notes.append)
    assert why == "no configuration within 2 steps of the best is better"
    assert bench.measured[0] == {"m": SHIPPED}
    keys = [point_key(p) for p in bench.measured]
    assert len(keys) == len(set(keys))  # nothing measured twice
    top = max(bench.results, key=lambda r: r.score(12))
    # the optimum: 2 instances, batching at max_batch_size 8, no preferred sizes
    # (delays 0 and 500 us tie: p99 10 and 15 ms, and 15 is above the SLO)
    assert top.point == {"m": Knobs(2, 8, (), 0)}
    grid = {point_key(p) for i in space.grid() if (p := space.knobs(i)) is not None}
    assert len(bench.measured) < len(grid) / 3
    assert any(n.startswith("moving to #") for n in notes)


def test_quick_search_stops_when_no_neighbour_gains_the_margin() -> None:
    space = build_space(
        "m", {"m": SHIPPED}, instance_counts=[1, 2, 3], queue_delays_us=[None], cpus=2
    )
    bench = Bench()
    quick_search(space, bench, unlimited, Constraints(), 0.02)
    # shipped (2 instances) beats 1 and 3: only its two neighbours are measured
    assert [p["m"].instances for p in bench.measured] == [2, 1, 3]


def test_quick_search_respects_the_budget() -> None:
    space = build_space("m", {"m": SHIPPED}, cpus=3)
    bench = Bench()
    calls = []

    def budget() -> tuple[bool, str]:
        calls.append(1)
        return (len(bench.measured) < 3, "time budget")

    assert quick_search(space, bench, budget, Constraints(), 0.02) == "time budget"
    assert len(bench.measured) == 3


def test_grid_search_measures_each_configuration_once_shipped_first() -> None:
    space = build_space(
        "m",
        {"m": SHIPPED},
        instance_counts=[1, 2],
        max_batch_sizes=[8, 32],
        preferred=["none"],
        queue_delays_us=[None, 0],
    )
    bench = Bench()
    assert grid_search(space, bench, unlimited, Constraints()) == "every configuration measured"
    assert bench.measured[0] == {"m": SHIPPED}
    # off x 2 instances + on x 2 instances x 2 sizes
    assert len(bench.measured) == 2 + 4
    assert len({point_key(p) for p in bench.measured}) == 6
    bench = Bench()
    assert grid_search(space, bench, lambda: (len(bench.measured) < 4, "max"), Constraints()) == (
        "max"
    )
    assert len(bench.measured) == 4


def test_sweep_stops_at_the_slo_at_errors_and_on_a_plateau() -> None:
    def lv(c: int, t: float, p99: float, errors: int = 0) -> LevelResult:
        return LevelResult(c, t, p99 / 2, p99, errors)

    assert sweep_stop_reason([lv(1, 100, 5)], 10) == ""
    assert sweep_stop_reason([lv(1, 100, 5), lv(2, 150, 11)], 10) == "p99 above the SLO"
    assert sweep_stop_reason([lv(1, 100, 5), lv(2, 150, 11)], None) == ""
    assert sweep_stop_reason([lv(1, 100, 5, errors=1)], None) == "errors"
    # two levels in a row without 5% over the best before them
    flat = [lv(1, 100, 5), lv(2, 200, 6), lv(4, 205, 9)]
    assert sweep_stop_reason(flat, None) == ""
    assert sweep_stop_reason([*flat, lv(8, 208, 18)], None) == "throughput stopped growing"
    assert sweep_stop_reason([*flat, lv(8, 230, 18)], None) == ""


def test_bisection_bounds_bracket_the_slo() -> None:
    def lv(c: int, p99: float, errors: int = 0) -> LevelResult:
        return LevelResult(c, 100.0 * c, p99 / 2, p99, errors)

    assert bisect_bounds([lv(1, 5), lv(2, 8), lv(4, 30)], 10) == (2, 4)
    # a bisected level within the SLO narrows the interval
    assert bisect_bounds([lv(1, 5), lv(2, 8), lv(4, 30), lv(3, 9)], 10) == (3, 4)
    assert bisect_bounds([lv(1, 5), lv(2, 8), lv(4, 30), lv(3, 12)], 10) == (2, 3)
    assert bisect_bounds([lv(1, 15)], 10) is None  # nothing within the SLO
    assert bisect_bounds([lv(1, 5), lv(2, 8)], 10) is None  # nothing above it
    assert bisect_bounds([lv(1, 5), lv(2, 8, errors=1), lv(4, 30)], 10) == (1, 2)
