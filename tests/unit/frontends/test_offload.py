"""Decode processes (pdserve.frontends.offload.off_process): results, errors with their
codes, a killed process, and large buffers that travel out of band."""

from __future__ import annotations

import asyncio
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.frontends import offload
from pdserve.frontends.http.decode import decode_infer_request
from pdserve.frontends.offload_worker import read_message, run_call, write_message
from pdserve.frontends.parameters import check_request_parameters


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


# -- the decode process itself (pdserve.frontends.offload_worker) ---------------------------


def test_worker_messages_round_trip_with_out_of_band_buffers() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    stream = io.BytesIO()
    size = write_message(stream, ("call", array, pickle.PickleBuffer(b"raw")))
    assert size == len(stream.getvalue())
    stream.seek(0)
    message = read_message(stream)
    assert message is not None
    (tag, got, raw), read_size = message
    assert read_size == size
    assert tag == "call" and bytes(raw) == b"raw"
    np.testing.assert_array_equal(got, array)
    assert read_message(stream) is None  # the end of the stream between messages
    stream = io.BytesIO(stream.getvalue()[: size - 5])
    with pytest.raises(EOFError):
        read_message(stream)


def test_worker_run_call_reports_each_outcome() -> None:
    assert run_call((divmod, (7, 2))) == ("ok", (3, 1))
    assert run_call((check_request_parameters, ({"priority": -1},))) == (
        "infer_error",
        "request parameter 'priority' must be a non-negative integer, got -1",
        ErrorCode.INVALID_ARG,
        "REJECTED",
    )
    kind, exc = run_call((int, ("x",)))
    assert kind == "error" and isinstance(exc, ValueError) and "'x'" in str(exc)

    def cannot_travel() -> None:
        raise ValueError(threading.Lock())

    kind, exc = run_call((cannot_travel, ()))
    assert kind == "error" and type(exc) is RuntimeError
    assert str(exc).startswith("ValueError: <unlocked _thread.lock object")


def test_worker_process_serves_calls_until_stdin_ends() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.frontends.offload_worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        write_message(proc.stdin, (print, ("printed by the work",)))  # goes to stderr
        write_message(proc.stdin, (np.add, (np.ones(3), 2)))
        write_message(proc.stdin, (int, ("x",)))
        first = read_message(proc.stdout)
        second = read_message(proc.stdout)
        third = read_message(proc.stdout)
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert first is not None and first[0] == ("ok", None)
    assert second is not None and second[0][0] == "ok"
    np.testing.assert_array_equal(second[0][1], [3.0, 3.0, 3.0])
    assert third is not None and third[0][0] == "error" and isinstance(third[0][1], ValueError)
    assert read_message(proc.stdout) is None
    assert proc.stderr is not None and b"printed by the work" in proc.stderr.read()
