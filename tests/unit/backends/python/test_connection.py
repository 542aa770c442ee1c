"""The python backend's server side without a model: the connection to a worker
(pdserve.backends.python.connection), worker start-up helpers (launch), BLS
cancellation (bls) and pb_utils.ModelConfig (model_config)."""

from __future__ import annotations

import asyncio
import signal
import socket
from types import SimpleNamespace

import pytest

from pdserve.backends.python import launch
from pdserve.backends.python import triton_python_backend_utils as pb
from pdserve.backends.python.bls import bls_token
from pdserve.backends.python.connection import WorkerConnection
from pdserve.backends.python.messages import Ready, send_frame
from pdserve.backends.python.model_config import ModelConfig
from pdserve.core.cancel import CancelToken
from pdserve.core.errors import ErrorCode, unavailable


def test_exit_description_names_the_signal_or_the_code() -> None:
    assert launch.exit_description(-signal.SIGKILL) == "was killed by SIGKILL"
    assert launch.exit_description(3) == "exited with code 3"
    assert launch.exit_description(None) == "exited (status unknown)"


def test_bls_token_follows_every_request_of_the_batch() -> None:
    assert bls_token([None], {}).error is None  # a request without a token: its own
    one = CancelToken()
    child = bls_token([one], {})
    one.cancel(unavailable("gone"))
    assert child.error is not None and child.error.code is ErrorCode.UNAVAILABLE
    a, b = CancelToken(), CancelToken()
    both = bls_token([a, b], {})
    a.cancel()
    assert both.error is None  # one request of two is still waiting for the answer
    b.cancel()
    assert both.error is not None


def test_model_config_is_pb_utils_model_config() -> None:
    assert pb.ModelConfig is ModelConfig
    config = ModelConfig('{"name": "m"}')
    config.set_max_batch_size(4)
    assert config.as_dict()["max_batch_size"] == 4


def test_connection_reads_ready_and_reports_the_exit() -> None:
    async def run() -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        closed: list[bool] = []
        proc = SimpleNamespace(pid=4242, exitcode=0, close=lambda: closed.append(True))
        conn = WorkerConnection("m_0", proc, mine, None)  # type: ignore[arg-type]  # a stand-in process
        send_frame(theirs, Ready(4242))
        assert await asyncio.wait_for(conn.ready, 5) == 4242
        theirs.close()  # the worker is gone: end of file
        died = await asyncio.wait_for(conn.died, 5)
        assert "python model instance 'm_0' (pid 4242) exited with code 0" in died
        # the exited process object's descriptors (pipes to the fork server) are closed
        assert closed == [True]
        assert mine.fileno() == -1

    asyncio.run(run())


@pytest.mark.parametrize("cancelled_first", [True, False])
def test_bls_token_of_a_cancelled_parent_is_cancelled(cancelled_first: bool) -> None:
    parent = CancelToken()
    if cancelled_first:
        parent.cancel()
    token = bls_token([parent], {})
    if not cancelled_first:
        parent.cancel()
    assert token.error is not None


def test_check_ready_answers_as_soon_as_the_worker_does() -> None:
    """``is_ready()`` over the socket: the worker's answer (true, false, raised) comes
    back at once, silence is a timeout, and ``Ready`` says whether there is a hook."""
    from pdserve.backends.python.messages import ReadyState, read_frames
    from pdserve.shm import FrameReader

    async def run() -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = SimpleNamespace(pid=4242, exitcode=0, close=lambda: None)
        conn = WorkerConnection("m_0", proc, mine, None)  # type: ignore[arg-type]  # a stand-in process
        send_frame(theirs, Ready(4242, True))
        await asyncio.wait_for(conn.ready, 5)
        assert conn.has_is_ready
        theirs.setblocking(False)
        reader = FrameReader()
        loop = asyncio.get_running_loop()

        async def answer(ready: bool, error: str | None) -> None:
            while True:  # the ReadyCheck the server sent, then the worker's answer
                try:
                    data = theirs.recv(65536)
                except BlockingIOError:
                    await asyncio.sleep(0.005)
                    continue
                reader.feed(data, [])
                frames = read_frames(reader)
                if frames:
                    send_frame(theirs, ReadyState(frames[0].message.check_id, ready, error))
                    return

        for ready, error, expected in (
            (True, None, (True, "")),
            (False, None, (False, "is_ready() returned False")),
            (False, "RuntimeError: gone", (False, "is_ready() raised RuntimeError: gone")),
        ):
            task = loop.create_task(answer(ready, error))
            start = loop.time()
            assert await conn.check_ready(5.0) == expected
            assert loop.time() - start < 2.0  # not the whole timeout
            await task
        assert await conn.check_ready(0.1) == (False, "is_ready() did not answer within 0.1 s")
        theirs.close()
        await asyncio.wait_for(conn.died, 5)

    asyncio.run(run())
