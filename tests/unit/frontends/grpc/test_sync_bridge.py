"""pdserve.frontends.grpc.sync_bridge: ``grpc.aio``-style handlers on grpcio's
synchronous server, run on an event loop; a real server and channel on loopback."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest

from pdserve.frontends.grpc.sync_bridge import Bridge, SyncServer, bridge_handlers

SERVICE = "test.Bridge"


class LoopThread:
    """An asyncio loop on its own thread (the server's event loop stands in)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _identity(b: bytes) -> bytes:
    return b


def _serve(handlers: dict[str, Callable[..., Any]], lt: LoopThread) -> tuple[SyncServer, str]:
    """Start a sync server whose ``handlers`` (async) are bridged onto ``lt``'s loop."""
    pools = tuple(concurrent.futures.ThreadPoolExecutor(64) for _ in range(3))
    bridge = Bridge(lt.loop, pools[1], pools[2])
    raw: dict[str, grpc.RpcMethodHandler] = {}
    for name, fn in handlers.items():
        if name.startswith("Stream"):
            raw[name] = grpc.stream_stream_rpc_method_handler(fn, _identity, _identity)
        else:
            raw[name] = grpc.unary_unary_rpc_method_handler(fn, _identity, _identity)
    sync = grpc.server(pools[0])
    sync.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, bridge_handlers(raw, bridge)),)
    )
    port = sync.add_insecure_port("127.0.0.1:0")
    sync.start()
    return SyncServer(sync, bridge, pools), f"127.0.0.1:{port}"


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    t = LoopThread()
    yield t
    t.close()


def test_unary_runs_on_the_loop_and_answers(lt: LoopThread) -> None:
    seen: dict[str, Any] = {}

    async def echo(request: bytes, context: Any) -> bytes:
        if request == b"abc":
            seen["thread"] = threading.get_ident()
            seen["metadata"] = dict(context.invocation_metadata())
            # a call answered normally does not run its done callbacks (nothing to stop)
            context.add_done_callback(lambda ctx: seen.setdefault("callback", True))
        await asyncio.sleep(0.01)
        return b"echo:" + request

    srv, target = _serve({"Echo": echo}, lt)
    try:
        with grpc.insecure_channel(target) as ch:
            call = ch.unary_unary(f"/{SERVICE}/Echo")
            assert call(b"abc", metadata=(("traceparent", "00-x"),), timeout=10) == b"echo:abc"
            # concurrent calls all answered, each with its own result
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                results = list(pool.map(lambda i: call(b"%d" % i, timeout=10), range(64)))
            assert results == [b"echo:%d" % i for i in range(64)]
    finally:
        lt.run(srv.stop(1))
    assert seen["thread"] == lt.thread.ident
    assert seen["metadata"]["traceparent"] == "00-x"
    assert "callback" not in seen


def test_abort_maps_to_the_status_and_keeps_trailing_metadata(lt: LoopThread) -> None:
    async def refuse(request: bytes, context: Any) -> bytes:
        context.set_trailing_metadata((("retry-after", "3"),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down")
        raise AssertionError("abort returned")

    async def broken(request: bytes, context: Any) -> bytes:
        raise ValueError("boom")

    srv, target = _serve({"Refuse": refuse, "Broken": broken}, lt)
    try:
        with grpc.insecure_channel(target) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(f"/{SERVICE}/Refuse")(b"", timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.details() == "slow down"
            assert ("retry-after", "3") in tuple(e.value.trailing_metadata())
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(f"/{SERVICE}/Broken")(b"", timeout=10)
            # as grpc.aio: an unexpected exception is UNKNOWN
            assert e.value.code() == grpc.StatusCode.UNKNOWN
    finally:
        lt.run(srv.stop(1))


def test_client_cancel_reaches_the_handler(lt: LoopThread) -> None:
    ended = threading.Event()
    state: dict[str, Any] = {}

    async def slow(request: bytes, context: Any) -> bytes:
        def done(ctx: Any) -> None:
            state["cancelled"] = ctx.cancelled()
            state["thread"] = threading.get_ident()
            ended.set()

        context.add_done_callback(done)
        for _ in range(200):
            if context.cancelled():
                state["probe"] = True
                break
            await asyncio.sleep(0.02)
        return b"late"

    srv, target = _serve({"Slow": slow}, lt)
    try:
        with grpc.insecure_channel(target) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(f"/{SERVICE}/Slow")(b"", timeout=0.3)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert ended.wait(10)
        deadline = time.monotonic() + 10
        while "probe" not in state and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        lt.run(srv.stop(1))
    assert state["cancelled"] is True
    assert state["thread"] == lt.thread.ident  # the callback runs on the loop
    assert state["probe"] is True


def test_stream_both_ways_and_abort_mid_stream(lt: LoopThread) -> None:
    async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for r in requests:
            if r == b"stop":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "told to stop")
            yield b"re:" + r
            yield b"again:" + r

    srv, target = _serve({"Stream": stream}, lt)
    try:
        with grpc.insecure_channel(target) as ch:
            call = ch.stream_stream(f"/{SERVICE}/Stream")
            got = list(call(iter([b"a", b"b"]), timeout=10))
            assert got == [b"re:a", b"again:a", b"re:b", b"again:b"]
            responses = call(iter([b"a", b"stop", b"never"]), timeout=10)
            assert next(responses) == b"re:a"
            assert next(responses) == b"again:a"
            with pytest.raises(grpc.RpcError) as e:
                next(responses)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == "told to stop"
    finally:
        lt.run(srv.stop(1))


def test_stream_cancelled_by_the_client_stops_the_handler(lt: LoopThread) -> None:
    closed = threading.Event()

    async def forever(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"tick"
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    srv, target = _serve({"StreamForever": forever}, lt)
    try:
        with grpc.insecure_channel(target) as ch:
            responses = ch.stream_stream(f"/{SERVICE}/StreamForever")(iter(()), timeout=10)
            assert next(responses) == b"tick"
            responses.cancel()
            assert closed.wait(10)
    finally:
        lt.run(srv.stop(1))


def test_stop_answers_calls_still_waiting_unavailable(lt: LoopThread) -> None:
    started = threading.Event()
    cancelled = threading.Event()

    async def hang(request: bytes, context: Any) -> bytes:
        started.set()
        try:
            await asyncio.Event().wait()  # never ends by itself
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return b""

    srv, target = _serve({"Hang": hang}, lt)
    with grpc.insecure_channel(target) as ch:
        future = ch.unary_unary(f"/{SERVICE}/Hang").future(b"", timeout=30)
        assert started.wait(10)
        t0 = time.monotonic()
        lt.run(srv.stop(0.2))
        assert time.monotonic() - t0 < 10
        with pytest.raises(grpc.RpcError) as e:
            future.result(10)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    # the handler's coroutine is cancelled and no grpc worker is left blocked on it
    assert cancelled.wait(10)
    deadline = time.monotonic() + 10
    while srv.bridge.pending and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not srv.bridge.pending
