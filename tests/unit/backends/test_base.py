"""pdserve.backends.base: :class:`InlineRuns`, where an in-process instance runs a batch
(inline on the event loop while its runs are short, else on its own thread), and
:func:`execute_on_thread` with it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from pdserve.backends.base import (
    INLINE_RUN_MAX_S,
    INLINE_STICKY_LIMIT_S,
    INLINE_STICKY_RUNS,
    INLINE_STICKY_WINDOW,
    INLINE_WARMUP_RUNS,
    ExecRequest,
    InlineRuns,
    execute_on_thread,
    run_on_thread,
)
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferRequest


def _burn(seconds: float) -> None:
    """Keep this thread's CPU busy for ``seconds`` of its CPU time (a model computing)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Model:
    """Runs computing ``costs`` seconds of CPU each in turn (then ``after``); records the
    thread of each run."""

    def __init__(self, costs: list[float], after: float = 0.0) -> None:
        self.costs = list(costs)
        self.after = after
        self.threads: list[str] = []

    def __call__(self, value: int) -> int:
        self.threads.append(threading.current_thread().name)
        _burn(self.costs.pop(0) if self.costs else self.after)
        return value


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="m_0")
    yield pool
    pool.shutdown(wait=True)


async def _step(
    runs: InlineRuns,
    executor: concurrent.futures.ThreadPoolExecutor,
    fn: Callable[[int], int],
    value: int,
    closed: bool = False,
) -> int:
    """One batch as an instance runs it: ask, then run inline or on the thread."""
    if runs.inline():
        mark = runs.start(closed)
        try:
            return fn(value)
        finally:
            runs.ran_inline(mark)

    def timed(v: int) -> int:
        mark = runs.start_on_thread()
        try:
            return fn(v)
        finally:
            runs.ran_on_thread(mark)

    return await run_on_thread(executor, closed, "m_0", timed, value)


def _drive(
    runs: InlineRuns,
    executor: concurrent.futures.ThreadPoolExecutor,
    model: Callable[[int], int],
    n: int,
) -> None:
    async def go() -> None:
        for i in range(n):
            assert await _step(runs, executor, model, i) == i

    asyncio.run(go())


def test_short_runs_go_inline_after_the_first(
    executor: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """No average yet: the first run is on the thread; short runs then stay inline."""
    model = _Model([], after=0.0)
    runs = InlineRuns("m_0")
    _drive(runs, executor, model, 5)
    assert model.threads[0].startswith("m_0")
    assert model.threads[1:] == ["MainThread"] * 4
    assert 0.0 < runs.avg_run_s < INLINE_RUN_MAX_S


def test_long_runs_stay_on_the_thread(executor: concurrent.futures.ThreadPoolExecutor) -> None:
    model = _Model([], after=INLINE_RUN_MAX_S * 2)
    runs = InlineRuns("m_0")
    _drive(runs, executor, model, 4)
    assert all(t.startswith("m_0") for t in model.threads), model.threads
    assert runs.avg_run_s >= INLINE_RUN_MAX_S * 2
    assert not runs.inline()


def test_thread_mode_never_runs_inline(executor: concurrent.futures.ThreadPoolExecutor) -> None:
    """A host policy's pinned instance: every run on its thread, however short."""
    model = _Model([], after=0.0)
    runs = InlineRuns("m_0", "thread")
    _drive(runs, executor, model, 5)
    assert all(t.startswith("m_0") for t in model.threads), model.threads


def test_loop_mode_always_runs_inline(executor: concurrent.futures.ThreadPoolExecutor) -> None:
    model = _Model([], after=INLINE_STICKY_LIMIT_S * 2)
    runs = InlineRuns("m_0", "loop")
    _drive(runs, executor, model, INLINE_STICKY_RUNS + 1)
    assert model.threads == ["MainThread"] * (INLINE_STICKY_RUNS + 1)
    assert runs.mode == "loop"


def test_one_long_inline_run_moves_the_instance_only_for_a_while(
    executor: concurrent.futures.ThreadPoolExecutor,
) -> None:
    long = max(INLINE_STICKY_LIMIT_S, INLINE_RUN_MAX_S * 10) * 2  # lifts the average over
    model = _Model([0.0, 0.0, 0.0, long])  # thread, inline, inline, one long inline run
    runs = InlineRuns("m_0")
    _drive(runs, executor, model, 80)
    assert model.threads[1:4] == ["MainThread"] * 3
    assert model.threads[4].startswith("m_0")  # the average moved it to the thread
    assert model.threads[-1] == "MainThread"  # and back inline once it came down
    assert runs.mode == "auto"


def test_mostly_long_inline_runs_move_the_instance_for_good(
    executor: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """A run whose work is on other threads looks short on its own thread; inline it
    blocks the loop, which in INLINE_STICKY_RUNS of the last INLINE_STICKY_WINDOW inline
    runs ends inline runs for good."""
    long = INLINE_STICKY_LIMIT_S * 2
    runs = InlineRuns("m_0")
    calls: list[str] = []

    def pool_work(value: int) -> int:
        # the work's CPU time is on the calling thread only when it is the loop's
        calls.append(threading.current_thread().name)
        if threading.current_thread() is threading.main_thread():
            _burn(long)
        return value

    _drive(runs, executor, pool_work, 40)
    assert runs.mode == "thread"
    assert calls[INLINE_WARMUP_RUNS:].count("MainThread") == INLINE_STICKY_RUNS
    last_inline = len(calls) - 1 - calls[::-1].index("MainThread")
    assert all(t.startswith("m_0") for t in calls[last_inline + 1 :]), calls


def test_long_inline_runs_now_and_then_do_not_move_the_instance_for_good() -> None:
    """A busy machine makes some inline runs look long (the process was preempted): under
    INLINE_STICKY_RUNS of any INLINE_STICKY_WINDOW leave ``auto`` as it is."""
    runs = InlineRuns("m_0")

    def ran(seconds: float) -> None:
        runs.ran_inline((time.perf_counter() - seconds, time.process_time() - seconds))

    for i in range(INLINE_WARMUP_RUNS + 10 * INLINE_STICKY_WINDOW):
        # in a row, but never INLINE_STICKY_RUNS of any INLINE_STICKY_WINDOW
        long = i % INLINE_STICKY_WINDOW < INLINE_STICKY_RUNS - 1
        ran(INLINE_STICKY_LIMIT_S * 2 if long else 0.0)
    assert runs.mode == "auto"
    for _ in range(INLINE_STICKY_WINDOW):  # clear the window
        ran(0.0)
    for i in range(2 * INLINE_STICKY_RUNS - 1):  # long, short, long...: not a streak
        assert runs.mode == "auto"
        ran(INLINE_STICKY_LIMIT_S * 2 if i % 2 == 0 else 0.0)
    assert runs.mode == "thread"


def test_long_first_runs_do_not_move_the_instance_for_good(
    executor: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """A framework's first calls (graph optimisation) are long once: inline runs over the
    limit within the first INLINE_WARMUP_RUNS leave ``auto`` as it is."""
    long = INLINE_STICKY_LIMIT_S * 2
    model = _Model([0.0, long, long])  # thread, then two long inline runs in a row
    runs = InlineRuns("m_0")
    _drive(runs, executor, model, 80)
    assert model.threads[1:3] == ["MainThread"] * 2
    assert runs.mode == "auto"
    assert model.threads[-1] == "MainThread"  # short runs are back inline


def test_preemption_alone_does_not_count_as_a_long_inline_run(
    executor: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """An inline run's duration is at most the process's CPU time: a short run stalled
    without computing (the process preempted on a busy machine) stays short."""
    runs = InlineRuns("m_0")
    stalled: list[str] = []

    def stall(value: int) -> int:
        stalled.append(threading.current_thread().name)
        time.sleep(INLINE_STICKY_LIMIT_S * 2)  # wall time passes, no CPU time
        return value

    _drive(runs, executor, lambda v: v, 1)  # a first, short, run on the thread
    _drive(runs, executor, stall, INLINE_STICKY_RUNS + 2)
    assert stalled == ["MainThread"] * (INLINE_STICKY_RUNS + 2)
    assert runs.mode == "auto" and runs.avg_run_s < INLINE_RUN_MAX_S


@pytest.mark.parametrize("inline", [True, False])
def test_a_closed_instance_runs_nothing(
    executor: concurrent.futures.ThreadPoolExecutor, inline: bool
) -> None:
    model = _Model([])
    runs = InlineRuns("m_0")
    runs.avg_run_s = INLINE_RUN_MAX_S / (2 if inline else 0.5)
    assert runs.inline() is inline
    with pytest.raises(InferError) as err:
        asyncio.run(_step(runs, executor, model, 1, closed=True))
    assert err.value.code is ErrorCode.UNAVAILABLE and "'m_0' is unloading" in str(err.value)
    assert model.threads == []


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="run mode 'fast' is not one of auto, loop, thread"):
        InlineRuns("m_0", "fast")


def test_execute_on_thread_merges_runs_and_splits(
    executor: concurrent.futures.ThreadPoolExecutor,
) -> None:
    """Two requests merged, run on the instance's thread, split back per request."""
    ran: list[str] = []

    def double(inputs: dict[str, np.ndarray], wanted: list[str]) -> dict[str, np.ndarray]:
        ran.append(threading.current_thread().name)
        return {"Y": inputs["X"] * 2}

    def req(rows: list[float]) -> ExecRequest:
        x = np.asarray(rows, np.float32).reshape(-1, 1)
        return ExecRequest({"X": x}, ["Y"], InferRequest("m"), len(rows))

    results = asyncio.run(
        execute_on_thread([req([1.0]), req([2.0, 3.0])], executor, False, "m_0", double, str)
    )
    assert [r["Y"].reshape(-1).tolist() for r in results] == [[2.0], [4.0, 6.0]]  # type: ignore[index]
    assert len(ran) == 1 and ran[0].startswith("m_0")
