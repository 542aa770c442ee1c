"""pdserve.core.streaming.ResponseStream: order, final, cancel, convert, deadline."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pdserve.core import streaming
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.streaming import MAX_PENDING_BYTES, MAX_PENDING_RESPONSES, ResponseStream


def test_items_in_order_then_final_and_later_puts_dropped() -> None:
    async def run() -> None:
        stream = ResponseStream()
        stream.put({"Y": np.array([1])}, final=False)
        stream.put(None, final=True)
        stream.put({"Y": np.array([2])}, final=False)  # after the final: dropped
        first, last = await stream.next(), await stream.next()
        assert first is not None and first.outputs["Y"].tolist() == [1] and not first.final
        assert last is not None and last.outputs is None and last.final and last.error is None
        assert stream.closed and stream.finished.result() is None
        assert await stream.next(asyncio.get_running_loop().time() + 0.01) is None

    asyncio.run(run())


def test_cancel_calls_the_hook_once_and_ends_with_the_error() -> None:
    async def run() -> None:
        stream = ResponseStream()
        calls: list[int] = []
        stream.on_cancel = lambda: calls.append(1)
        stream.cancel(InferError("gone", ErrorCode.CLIENT_GONE))
        stream.cancel(InferError("again", ErrorCode.CLIENT_GONE))
        assert calls == [1]
        item = await stream.next()
        assert item is not None and item.final and item.error is not None
        assert item.error.message == "gone"
        with pytest.raises(InferError, match="gone"):
            stream.finished.result()

    asyncio.run(run())


def test_convert_turns_a_bad_response_into_an_error_item() -> None:
    async def run() -> None:
        stream = ResponseStream()
        stream.convert = lambda outputs: InferError("bad", ErrorCode.INTERNAL)
        stream.put({"Y": np.array([1])}, final=True)
        item = await stream.next()
        assert item is not None and item.outputs is None and item.error is not None
        assert item.error.code is ErrorCode.INTERNAL and item.final

    asyncio.run(run())


def test_next_wakes_when_an_item_arrives() -> None:
    async def run() -> None:
        stream = ResponseStream()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, stream.put, {"Y": np.array([3])}, True)
        item = await stream.next(loop.time() + 5)
        assert item is not None and item.outputs["Y"].tolist() == [3]

    asyncio.run(run())


def test_a_consumer_that_takes_nothing_gets_the_request_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_PENDING_RESPONSES untaken responses, none taken for STALL_SECS (0
    here), the stream ends with a RESOURCE_EXHAUSTED error (the model is told once);
    what was queued is still given, and taking responses makes room again before that."""
    monkeypatch.setattr(streaming, "STALL_SECS", 0.0)

    async def run() -> None:
        stream = ResponseStream()
        calls: list[int] = []
        stream.on_cancel = lambda: calls.append(1)
        for i in range(MAX_PENDING_RESPONSES):
            stream.put({"Y": np.array([i])}, final=False)
        first = await stream.next()  # one taken: room for one more
        assert first is not None and first.outputs["Y"].tolist() == [0]
        stream.put({"Y": np.array([-1])}, final=False)
        assert not stream.closed and calls == []
        stream.put({"Y": np.array([-2])}, final=False)  # one too many
        stream.put({"Y": np.array([-3])}, final=False)  # after the end: dropped
        assert stream.closed and calls == [1]
        items = [await stream.next() for _ in range(MAX_PENDING_RESPONSES + 1)]
        assert all(i is not None and i.error is None for i in items[:-1])
        last = items[-1]
        assert last is not None and last.final and last.error is not None
        assert last.error.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "untaken" in last.error.message
        with pytest.raises(InferError, match="untaken"):
            stream.finished.result()

    asyncio.run(run())


def test_untaken_output_bytes_are_bounded_too() -> None:
    async def run() -> None:
        stream = ResponseStream()
        big = np.zeros(MAX_PENDING_BYTES // 2 + 1, np.uint8)
        stream.put({"Y": big}, final=False)
        stream.put({"Y": big}, final=False)  # over the byte bound: cancelled
        first, last = await stream.next(), await stream.next()
        assert first is not None and first.error is None
        assert last is not None and last.error is not None and last.final
        assert last.error.code is ErrorCode.RESOURCE_EXHAUSTED

        again = ResponseStream()  # taking a response frees its bytes
        again.put({"Y": big}, final=False)
        await again.next()
        again.put({"Y": big}, final=False)
        assert not again.closed

    asyncio.run(run())


def test_a_consumer_that_reads_behind_a_burst_is_not_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst far past MAX_PENDING_RESPONSES is kept while the consumer took one within
    STALL_SECS; only HARD_PENDING_RESPONSES cancels it regardless."""

    async def run() -> None:
        stream = ResponseStream()
        for i in range(MAX_PENDING_RESPONSES * 3):
            stream.put({"Y": np.array([i])}, final=False)
        assert not stream.closed
        monkeypatch.setattr(streaming, "HARD_PENDING_RESPONSES", MAX_PENDING_RESPONSES * 3)
        stream.put({"Y": np.array([-1])}, final=False)
        assert stream.closed
        items = [await stream.next() for _ in range(MAX_PENDING_RESPONSES * 3 + 1)]
        last = items[-1]
        assert last is not None and last.error is not None
        assert last.error.code is ErrorCode.RESOURCE_EXHAUSTED
        assert f"more than {MAX_PENDING_RESPONSES * 3}" in last.error.message

    asyncio.run(run())
