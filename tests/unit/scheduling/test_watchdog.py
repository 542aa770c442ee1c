"""The watchdog: a batch held past the bound without progress fails with UNAVAILABLE and
the instance is recovered; progress (decoupled responses) keeps it from being declared
wedged; repeated wedges back off."""

from __future__ import annotations

import asyncio

import numpy as np

from pdserve.backends.base import ExecRequest, ExecResult, ModelInstance
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest
from pdserve.scheduling.base import run_batch
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
