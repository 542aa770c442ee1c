"""One configuration's concurrency sweep in ``pdserve analyze``: ``pdserve perf``
at the levels in order, stopped at the SLO, at a throughput plateau, on errors or
at the deadline; then, when it crossed the SLO, a bisection between the last level
within it and the first above, so the score does not jump by a factor 2."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdserve.app.analyze.options import Progress
from pdserve.app.analyze.recommend import LevelResult
from pdserve.app.analyze.server import AnalyzeError
from pdserve.app.perf import PerfError, PerfOptions, run_sweep
from pdserve.app.perf.stats import PointResult, RunInfo, Window

#: A concurrency sweep stops once two levels in a row gain less than this
#: fraction of throughput over the best level before them.
PLATEAU_GAIN = 0.05


class StopSweep(Exception):
    """Raised from the perf progress hooks to end a concurrency sweep early."""


class SweepWatcher:
    """A :class:`pdserve.app.perf.Progress` that forwards to analyze's progress,
    keeps the levels, and stops the sweep (SLO, plateau, deadline)."""

    def __init__(
        self, progress: Progress, p99_ms: float | None, deadline: float, batch_size: int
    ) -> None:
        self.progress = progress
        self.p99_ms = p99_ms
        self.deadline = deadline
        self.batch_size = batch_size
        self.levels: list[LevelResult] = []
        self.reason = ""
        self.timed_out = False

    def start(self, info: RunInfo) -> None:
        """Nothing."""

    def window(
        self, mode: str, level: float, trial: int, window: Window, stable: bool, batch_size: int
    ) -> None:
        """Forward; stop when the time budget is out."""
        self.progress.window(int(level), trial, window, batch_size)
        if time.monotonic() > self.deadline:
            self.timed_out = True
            self.reason = "time budget"
            raise StopSweep

    def level_done(self, point: PointResult) -> None:
        """Keep the level; stop on SLO, plateau or errors."""
        lv = level_from_point(point)
        self.levels.append(lv)
        self.progress.level(lv)
        reason = sweep_stop_reason(self.levels, self.p99_ms)
        if point.aborted:
            self.reason = point.aborted
        elif reason:
            self.reason = reason
            raise StopSweep

    def note(self, text: str) -> None:
        """Forward."""
        self.progress.note(text)


def level_from_point(point: PointResult) -> LevelResult:
    """A perf level's result as analyze keeps it."""
    lat = point.latency_us
    return LevelResult(
        concurrency=int(point.level),
        infer_per_sec=point.infer_per_sec,
        p50_ms=lat.get("p50", 0.0) / 1000.0,
        p99_ms=lat.get("p99", 0.0) / 1000.0,
        errors=point.error_count,
        stable=point.stable,
        avg_batch=(point.server or {}).get("avg_batch_size", 0.0),
        requests=point.request_count,
        aborted=point.aborted,
    )


def sweep_stop_reason(levels: Sequence[LevelResult], p99_ms: float | None) -> str:
    """Why a concurrency sweep ends after ``levels`` ("" when it goes on): errors,
    the last p99 above the SLO, or two levels without :data:`PLATEAU_GAIN` more
    throughput than the best before them."""
    last = levels[-1]
    if last.errors or last.aborted:
        return "errors"
    if p99_ms is not None and last.p99_ms > p99_ms:
        return "p99 above the SLO"
    if len(levels) >= 3:
        before = max(lv.infer_per_sec for lv in levels[:-2])
        if max(lv.infer_per_sec for lv in levels[-2:]) < before * (1.0 + PLATEAU_GAIN):
            return "throughput stopped growing"
    return ""


def bisect_bounds(levels: Sequence[LevelResult], p99_ms: float) -> tuple[int, int] | None:
    """(highest concurrency within the SLO without errors, lowest one above it),
    the interval the SLO bisection searches; None when either is missing."""
    ok = [lv.concurrency for lv in levels if lv.usable and lv.p99_ms <= p99_ms]
    if not ok:
        return None
    above = [lv.concurrency for lv in levels if lv.concurrency > max(ok)]
    return (max(ok), min(above)) if above else None


def sweep(perf: PerfOptions, watcher: SweepWatcher, levels: Sequence[int]) -> None:
    """``pdserve perf`` with ``perf`` at ``levels`` in order; the levels land in
    ``watcher``.

    Raises:
        AnalyzeError: perf failed before any level (e.g. the request is refused).
    """
    perf.concurrency = list(levels)
    try:
        run_sweep(perf, watcher)
    except StopSweep:
        pass
    except PerfError as e:
        if not watcher.levels:
            raise AnalyzeError(str(e)) from None
        watcher.reason = str(e)


def bisect(
    levels: list[LevelResult],
    slo_ms: float,
    steps: int,
    measure: Callable[[int], SweepWatcher],
) -> bool:
    """The doubling sweep crossed the SLO between two of ``levels``: measure up to
    ``steps`` concurrencies between them (binary search, as model_analyzer searches
    concurrency against its latency budget) with ``measure(concurrency)``, adding
    them to ``levels``. Returns whether the time budget cut it."""
    bounds = bisect_bounds(levels, slo_ms)
    if bounds is None:
        return False
    lo, hi = bounds
    for _ in range(steps):
        mid = (lo + hi) // 2
        if mid <= lo:
            break
        step = measure(mid)
        levels.extend(step.levels)
        if step.timed_out:
            return True
        if not step.levels:
            break
        lv = step.levels[-1]
        if lv.usable and lv.p99_ms <= slo_ms:
            lo = mid
        else:
            hi = mid
    return False
