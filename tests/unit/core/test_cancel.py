"""pdserve.core.cancel: tokens, deadlines, child tokens, run_cancellable, and the direct
scheduler that follows a token itself."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pdserve.backends.base import ExecRequest
from pdserve.core.cancel import (
    CancelToken,
    arm_cancellation,
    ensure_token,
    parse_timeout_us,
    run_cancellable,
)
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest
from pdserve.scheduling.base import DirectScheduler, InstancePool


def test_cancel_once_and_callbacks() -> None:
    token = CancelToken()
    seen: list[ErrorCode] = []
    token.add_callback(lambda t: seen.append(t.error.code))  # type: ignore[union-attr]
    assert not token()
    assert token.cancel()
    assert not token.cancel(InferError("again", ErrorCode.INTERNAL))  # once only
    assert token() and seen == [ErrorCode.CLIENT_GONE]
    late: list[bool] = []
    token.add_callback(lambda t: late.append(True))  # already cancelled: at once
    assert late == [True]


def test_probe_and_finish() -> None:
    gone = [False]
    token = CancelToken(lambda: gone[0])
    assert not token()
    gone[0] = True
    assert token() and token.error is not None and token.error.code is ErrorCode.CLIENT_GONE
    done = CancelToken()
    done.finish()
    assert not done.cancel() and not done()  # an answered request stays answered


def test_parse_timeout() -> None:
    assert parse_timeout_us({"timeout": 5}) == 5
    assert parse_timeout_us({"timeout": "7"}) == 7
    for bad in (0, -1, True, 1.5, "x", None):
        assert parse_timeout_us({"timeout": bad}) == 0


def test_deadline_child_and_run_cancellable() -> None:
    async def main() -> None:
        req = InferRequest("m", parameters={"timeout": 50_000})  # 50 ms
        token = arm_cancellation(req)
        assert ensure_token(req) is token and 0 < token.remaining_us() <= 50_000
        child = token.child()
        step = token.child(10_000)  # its own, earlier deadline: 10 ms
        with pytest.raises(InferError) as e:
            await run_cancellable(step, asyncio.sleep(5))
        assert e.value.code is ErrorCode.UNAVAILABLE and "timeout" in e.value.message.lower()
        assert not token() and not child()  # the step's deadline is its own
        with pytest.raises(InferError) as e:
            await run_cancellable(token, asyncio.sleep(5))
        assert e.value.reason == "CANCELED"
        assert child() and child.error is token.error  # forwarded, same error
        # the task is not left cancelled
        await asyncio.sleep(0)
        assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]

    asyncio.run(main())


def test_queue_owned_timeout_cancels_nothing() -> None:
    async def main() -> None:
        token = CancelToken()
        token.queue_owned = True
        token.set_deadline(1_000_000)  # 1 ms
        await asyncio.sleep(0.02)
        assert not token()

    asyncio.run(main())


class _SlowInstance:
    name = "slow"

    async def execute(self, batch: list[ExecRequest]) -> list[dict[str, np.ndarray]]:
        await asyncio.sleep(5)
        return [{"OUT": np.zeros(1)} for _ in batch]


class _FastInstance(_SlowInstance):
    async def execute(self, batch: list[ExecRequest]) -> list[dict[str, np.ndarray]]:
        return [{"OUT": np.zeros(1)} for _ in batch]


def _direct(instance: object, token: object) -> tuple[DirectScheduler, ExecRequest]:
    sched = DirectScheduler(InstancePool([instance]), ModelStats("m", "1"))  # type: ignore[list-item]  # a stand-in instance
    return sched, ExecRequest({}, ["OUT"], InferRequest("m", cancelled=token), 1)


def test_direct_scheduler_follows_the_token() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        token = CancelToken(None, loop)
        sched, req = _direct(_SlowInstance(), token)
        loop.call_later(0.05, token.cancel)
        with pytest.raises(InferError) as e:  # answered at once, not after the model's 5 s
            await asyncio.wait_for(sched.submit(req), 2)
        assert e.value.code is ErrorCode.CLIENT_GONE and token.waiters == []
        calls = [0]

        def probe() -> bool:  # gone at its second poll: after the instance is acquired
            calls[0] += 1
            return calls[0] >= 2

        sched, req = _direct(_FastInstance(), CancelToken(probe))
        with pytest.raises(InferError) as e:
            await sched.submit(req)
        assert e.value.code is ErrorCode.CLIENT_GONE and calls == [2]
        sched, req = _direct(_FastInstance(), CancelToken(None, loop))
        assert list(await sched.submit(req)) == ["OUT"]
        assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]

    asyncio.run(main())
