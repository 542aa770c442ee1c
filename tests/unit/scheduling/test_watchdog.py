"""The watchdog: a batch held past the bound without progress fails with UNAVAILABLE and
the instance is recovered; progress (decoupled responses) keeps it from being declared
wedged; repeated wedges back off."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from pdserve.backends.base import ExecRequest, ExecResult, ModelInstance
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest
from pdserve.scheduling.base import InstanceWatch, run_batch
from pdserve.scheduling.watchdog import Watchdog


class Stuck(ModelInstance):
    """Holds each batch until released; ``recover`` releases it (as killing a worker)."""

    def __init__(self, name: str, ticks: int = 0) -> None:
        self.name = name
        self.release = asyncio.Event()
        self.ticks = ticks  # progress steps made while held
        self.count = 0
        self.recovered: list[float] = []

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        for _ in range(self.ticks):
            await asyncio.sleep(0.05)
            self.count += 1
        if self.ticks:
            return [{"OUT": np.ones(1)} for _ in batch]
        await self.release.wait()
        return [InferError("worker died", ErrorCode.INTERNAL) for _ in batch]

    def progress(self) -> int:
        return self.count

    async def recover(self, delay_s: float, reason: str) -> bool:
        self.recovered.append(delay_s)
        self.release.set()
        self.restarts += 1
        return True


def _batch() -> list[ExecRequest]:
    return [ExecRequest({"IN": np.ones(1)}, ["OUT"], InferRequest("m", id="r1"))]


def test_wedged_batch_fails_unavailable_and_instance_recovers() -> None:
    async def main() -> None:
        inst = Stuck("m_0")
        dog = Watchdog("m", "1", 0.1)
        dog.attach([inst])
        try:
            (result,) = await asyncio.wait_for(run_batch(inst, _batch(), ModelStats("m", "1")), 5)
            assert isinstance(result, InferError)
            assert result.code == ErrorCode.UNAVAILABLE
            assert "'m_0'" in result.message and "'m'" in result.message
            await asyncio.sleep(0.05)
            assert inst.watch.wedges == 1 and inst.recovered == [0.0]
            assert inst.watch.healthy and dog.healthy() == 1
            samples = {s[0]: s[4] for s in dog.samples()}
            assert samples == {
                "pdserve_instance_wedges_total": 1.0,
                "pdserve_instance_restarts_total": 1.0,
            }
            # a second wedge soon after backs off before the restart
            inst.release.clear()
            await asyncio.wait_for(run_batch(inst, _batch(), ModelStats("m", "1")), 5)
            assert inst.recovered == [0.0, 1.0]
        finally:
            await dog.stop()
        assert inst.watch is None

    asyncio.run(main())


def test_progress_is_not_a_wedge() -> None:
    async def main() -> None:
        inst = Stuck("m_0", ticks=8)  # 0.4 s of steady progress, bound 0.1 s
        dog = Watchdog("m", "1", 0.1)
        dog.attach([inst])
        try:
            (result,) = await run_batch(inst, _batch(), ModelStats("m", "1"))
            assert isinstance(result, dict)
            assert inst.watch.wedges == 0 and inst.recovered == []
        finally:
            await dog.stop()

    asyncio.run(main())


class Quick(ModelInstance):
    """Answers at once; its progress counter is set by the test."""

    def __init__(self) -> None:
        self.name = "q_0"
        self.count = 0

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        return [{"OUT": np.ones(1)} for _ in batch]

    def progress(self) -> int:
        return self.count


def test_a_batch_only_stamps_the_watch() -> None:
    inst = Quick()
    watch = InstanceWatch("q", "1", 10.0, inst)
    inst.watch = watch
    before = time.monotonic_ns()
    (result,) = asyncio.run(run_batch(inst, _batch(), ModelStats("q", "1")))
    assert isinstance(result, dict)
    # the batch came and went: its start stamped, nothing compared or reset
    assert watch.batch is None and watch.start_ns >= before
    assert watch.seen_ns == -1 and watch.since == 0.0 and watch.mark == 0
    assert watch.healthy and not watch.wedged


def test_the_sweep_measures_from_the_start_and_progress_restarts_it() -> None:
    inst = Quick()
    watch = InstanceWatch("q", "1", 1.0, inst)
    assert watch.held_s(100.0) is None  # idle
    watch.batch, watch.start_ns = _batch(), 100_000_000_000  # started at 100 s
    inst.count = 5
    assert watch.held_s(100.5) == 0.5  # first look: the mark is taken
    assert watch.mark == 5 and watch.since == 100.0
    assert watch.held_s(100.9) == pytest.approx(0.9)
    assert watch.held_s(101.2) == pytest.approx(1.2)  # past the bound, no progress
    inst.count = 6
    assert watch.held_s(101.3) == 0.0 and watch.since == 101.3  # progress: from now
    assert watch.held_s(102.0) == pytest.approx(0.7)
    watch.start_ns = 103_000_000_000  # another batch: measured from its own start
    assert watch.held_s(103.25) == 0.25 and watch.since == 103.0
    watch.wedged = True
    assert watch.held_s(110.0) is None  # already declared


def test_an_unrecoverable_instance_is_healthy_again_when_its_wedged_batch_returns() -> None:
    class Frozen(Stuck):  # in-process: recover() cannot stop the call (the default)
        async def recover(self, delay_s: float, reason: str) -> bool:
            return False

    async def main() -> None:
        inst = Frozen("f_0")
        dog = Watchdog("f", "1", 0.1)
        dog.attach([inst])
        try:
            task = asyncio.ensure_future(run_batch(inst, _batch(), ModelStats("f", "1")))
            for _ in range(100):
                await asyncio.sleep(0.02)
                if inst.watch.wedged:
                    break
            await asyncio.sleep(0.05)  # the recovery attempt has ended
            assert inst.watch.wedged and not inst.watch.healthy and dog.healthy() == 0
            inst.release.set()
            (result,) = await task
            assert isinstance(result, InferError) and result.code == ErrorCode.UNAVAILABLE
            assert "'f_0'" in result.message and "wedged" in result.message
            assert inst.watch.healthy and not inst.watch.wedged and dog.healthy() == 1
            assert inst.watch.wedges == 1
        finally:
            await dog.stop()

    asyncio.run(main())
