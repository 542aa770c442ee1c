"""The search orders of ``pdserve analyze``: :func:`quick_search` (hill climbing
from the shipped configuration, as model_analyzer's quick search) and
:func:`grid_search` (every point of the lattice). Both see measuring only through
a ``measure`` function, so they are tested with a synthetic one."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.app.analyze.recommend import ConfigResult, Constraints, best, better
from pdserve.app.analyze.space import Point, PointKey, Space, point_key

#: The quick search's widest neighbourhood (steps; model_analyzer's radius is 2).
MAX_RADIUS = 2
#: ``measure(point, shipped) -> result`` (the search's view of measuring).
MeasureFn = Callable[[Point, bool], ConfigResult]
#: ``budget() -> (may measure one more, why not)``.
BudgetFn = Callable[[], tuple[bool, str]]


def grid_search(
    space: Space,
    measure: MeasureFn,
    budget: BudgetFn,
    c: Constraints,
    min_gain: float = 0.0,
    note: Callable[[str], None] = lambda _: None,
) -> str:
    """Every configuration of the lattice (:meth:`Space.grid`: the shipped one
    first), each once, while ``budget`` allows; returns why it stopped."""
    seen: set[PointKey] = set()
    for index in space.grid():
        point = space.knobs(index)
        if point is None or point_key(point) in seen:
            continue
        if seen:
            ok, why = budget()
            if not ok:
                return why
        seen.add(point_key(point))
        measure(point, index == space.start)
    return "every configuration measured"


def quick_search(
    space: Space,
    measure: MeasureFn,
    budget: BudgetFn,
    c: Constraints,
    min_gain: float = 0.02,
    note: Callable[[str], None] = lambda _: None,
) -> str:
    """Hill climbing from the shipped configuration (model_analyzer's quick search
    on this lattice): measure every unmeasured configuration one step from the
    current one (:meth:`Space.neighbours`), move to the best configuration measured
    so far if it :func:`~.recommend.better` the current one by ``min_gain``; when
    none does, measure the ones :data:`MAX_RADIUS` steps away and go on from the
    best; stop when those do not beat it either, or ``budget`` says so. Returns
    why it stopped."""
    seen: dict[PointKey, tuple[int, ...]] = {}
    start = space.shipped_point()
    seen[point_key(start)] = space.start
    current = measure(start, True)
    measured = [current]
    index = space.start
    radius = 1
    while True:
        fresh = []
        for nb in space.neighbours(index, radius):
            point = space.knobs(nb)
            if point is None or point_key(point) in seen:
                continue
            seen[point_key(point)] = nb
            fresh.append(point)
        for point in fresh:
            ok, why = budget()
            if not ok:
                return why
            measured.append(measure(point, False))
        top = best(measured, c)
        if top is not None and top is not current and better(top, current, c, min_gain):
            current = top
            index = seen[point_key(top.point)]
            radius = 1
            note(f"moving to {top.label}: {top.description}")
        elif radius < MAX_RADIUS:
            radius += 1
            note(f"no better neighbour of {current.label}: looking {radius} steps away")
        else:
            return f"no configuration within {MAX_RADIUS} steps of the best is better"
