"""pdserve.scheduling.base.run_batch: a batch's compute time is its model's execution,
without the hand-over to its instance's thread and back (as Triton's backends measure
it on the instance's thread)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pdserve.backends.base import ExecRequest, ExecResult, ModelInstance, execute_on_thread
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest
from pdserve.scheduling.base import run_batch


class Threaded(ModelInstance):
    """Runs each batch for ``run_s`` seconds on its own thread."""

    def __init__(self, executor: ThreadPoolExecutor, run_s: float) -> None:
        self.name = "m_0"
        self.executor = executor
        self.run_s = run_s

    def _run(self, inputs: dict[str, np.ndarray], wanted: list[str]) -> dict[str, np.ndarray]:
        time.sleep(self.run_s)
        return {"OUT": inputs["IN"] * 2}

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        return await execute_on_thread(batch, self.executor, False, self.name, self._run, str)


def test_compute_leaves_out_the_wait_for_the_instance_thread() -> None:
    """The instance's thread is busy for 0.3 s when the batch is handed to it: the batch's
    compute is its own 0.05 s run, not the 0.35 s the execute took."""

    async def main() -> tuple[int, list[ExecResult], float]:
        executor = ThreadPoolExecutor(1)
        t0 = time.monotonic()  # before the sleep starts: took covers it whole
        executor.submit(time.sleep, 0.3)  # the thread is taken when the batch comes
        batch = [ExecRequest({"IN": np.ones((1, 2))}, ["OUT"], InferRequest("m", id="r1"))]
        results = await run_batch(Threaded(executor, 0.05), batch, ModelStats("m", "1"))
        took = time.monotonic() - t0
        executor.shutdown()
        return batch[0].compute_ns, results, took

    compute_ns, results, took = asyncio.run(main())
    assert took >= 0.35
    assert 0.05e9 <= compute_ns < 0.2e9
    assert isinstance(results[0], dict)
    np.testing.assert_array_equal(results[0]["OUT"], [[2.0, 2.0]])
