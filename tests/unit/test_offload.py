"""Decode processes (pdserve.frontends.offload.off_process): results, errors with their
codes, a killed process, and large buffers that travel out of band."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.frontends import offload
from pdserve.frontends.http.decode import decode_infer_request


@pytest.fixture(autouse=True)
def fresh_pools() -> Iterator[None]:
    offload.shutdown()
    yield
    offload.shutdown()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def echo_array(buf: Any, dtype: str) -> np.ndarray:
    """Module level so that the decode process can import it."""
    return np.frombuffer(buf, dtype=dtype).copy()


def raise_value_error(text: str) -> None:
    raise ValueError(text)


class Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}/{b}")


def raise_unpicklable() -> None:
    raise Unpicklable(1, 2)


def sleep_then(secs: float, value: int) -> int:
    time.sleep(secs)
    return value


def test_decode_runs_in_another_process_and_returns_arrays() -> None:
    body = (
        b'{"id": "7", "inputs": [{"name": "x", "datatype": "INT32", "shape": [2], "data": [1, 2]}]}'
    )
    request = run(offload.off_process(decode_infer_request, body, None, "m", "3", 5))
    assert request.model_name == "m" and request.model_version == "3" and request.id == "7"
    assert request.arrival_ns == 5
    np.testing.assert_array_equal(request.inputs["x"], np.array([1, 2], dtype=np.int32))
    pids = offload.decode_processes()
    assert pids and os.getpid() not in pids


def test_large_buffers_travel_out_of_band_both_ways() -> None:
    arr = np.arange(3_000_000, dtype=np.float32)
    for arg in (arr.tobytes(), bytearray(arr.tobytes())):
        out = run(offload.off_process(echo_array, arg, "float32"))
        np.testing.assert_array_equal(out, arr)


def test_errors_keep_their_type_and_code() -> None:
    with pytest.raises(InferError) as info:
        run(offload.off_process(decode_infer_request, b'{"inputs": 3}', None, "m"))
    assert info.value.code is ErrorCode.INVALID_ARG
    assert "'inputs' list" in info.value.message
    with pytest.raises(ValueError, match="plain"):
        run(offload.off_process(raise_value_error, "plain"))
    with pytest.raises(RuntimeError, match="Unpicklable: 1/2"):
        run(offload.off_process(raise_unpicklable))
    # The process survived all of that.
    assert run(offload.off_process(sleep_then, 0, 4)) == 4


def test_a_killed_decode_process_fails_its_call_with_unavailable_and_is_replaced() -> None:
    async def scenario() -> tuple[BaseException | int, int]:
        assert await offload.off_process(sleep_then, 0, 1) == 1
        task = asyncio.ensure_future(offload.off_process(sleep_then, 30, 2))
        await asyncio.sleep(0.5)
        for pid in offload.decode_processes():
            os.kill(pid, signal.SIGKILL)
        try:
            first: BaseException | int = await asyncio.wait_for(task, 20)
        except InferError as exc:
            first = exc
        await asyncio.sleep(0.2)
        # Both threads' processes are dead: each next call gets a new one.
        again = await asyncio.gather(*(offload.off_process(sleep_then, 0.2, i) for i in range(4)))
        assert again == [0, 1, 2, 3]
        return first, await offload.off_process(sleep_then, 0, 3)

    first, after = run(scenario())
    assert isinstance(first, InferError) and first.code is ErrorCode.UNAVAILABLE
    assert "killed by signal 9" in first.message
    assert after == 3


def test_shutdown_stops_the_processes() -> None:
    run(offload.off_process(sleep_then, 0, 1))
    pids = offload.decode_processes()
    assert pids
    offload.shutdown()
    assert offload.decode_processes() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
