"""Serve the (``grpc.aio``-style) V2 servicer on grpcio's synchronous server, which costs
less CPU per unary call than ``grpc.aio``; the servicer runs on the server's event loop.

- unary: the grpc worker thread submits the handler's coroutine to the loop
  (``asyncio.run_coroutine_threadsafe``) and blocks on its result;
- stream-stream (``ModelStreamInfer``): the request iterator is read on a thread and
  fed to the loop; the responses come back through a thread-safe queue.

The handlers see a :class:`BridgedContext` (the ``grpc.aio.ServicerContext`` subset the
servicer uses, over the synchronous context); ``await context.abort(code, details)``
raises :class:`BridgedAbort` (a ``grpc.aio.AbortError``), and the grpc thread aborts the
real call with that status.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

if TYPE_CHECKING:
    from pdserve.frontends.grpc.http2 import Metadata, TrailingMetadata

#: End of a bridged stream (requests or responses).
_END = object()

#: A request message, passed through as grpc deserialized it.
_Req = TypeVar("_Req")


class BridgedAbort(grpc.aio.AbortError):
    """``await context.abort(...)`` on a :class:`BridgedContext`: the status to end
    the call with, raised on the loop and applied by the grpc thread.

    Attributes:
        code: the ``grpc.StatusCode``.
        details: the status message.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class BridgedContext:
    """The ``grpc.aio.ServicerContext`` subset the servicer uses, over a sync context.

    Args:
        context: the synchronous ``grpc.ServicerContext`` of the call.
        loop: the asyncio loop the servicer runs on (``add_done_callback``
            callbacks run there).
        handler_done: tells whether the handler has already given its answer
            (``add_done_callback`` callbacks are then skipped); None: never skipped.
    """

    __slots__ = ("_context", "_handler_done", "_loop", "_metadata")

    def __init__(
        self,
        context: grpc.ServicerContext,
        loop: asyncio.AbstractEventLoop,
        handler_done: Callable[[], bool] | None = None,
    ) -> None:
        self._context = context
        self._loop = loop
        self._metadata = context.invocation_metadata()
        self._handler_done = handler_done

    def invocation_metadata(self) -> Metadata:
        """The call's metadata (key, value) pairs."""
        return self._metadata

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: TrailingMetadata = ()
    ) -> None:
        """End the call with ``code`` / ``details`` (raises :class:`BridgedAbort`)."""
        if trailing_metadata:
            self._context.set_trailing_metadata(trailing_metadata)
        raise BridgedAbort(code, details)

    def set_trailing_metadata(self, trailing_metadata: TrailingMetadata) -> None:
        """Trailing metadata sent with the status."""
        self._context.set_trailing_metadata(trailing_metadata)

    def cancelled(self) -> bool:
        """Whether the call ended before its answer (client cancel, deadline, ...)."""
        return not self._context.is_active()

    def done(self) -> bool:
        """Whether the call has ended."""
        return not self._context.is_active()

    def add_done_callback(self, callback: Callable[[BridgedContext], None]) -> None:
        """Call ``callback(self)`` on the loop once the call ends before its handler
        has answered (client cancel, deadline, server stop). Unlike ``grpc.aio``, a
        call that ends after its unary handler returned does not run it: the
        callback exists to stop work still in progress (the request's
        :class:`~pdserve.core.cancel.CancelToken`), and skipping it saves a wake-up
        of the loop per call."""
        loop = self._loop
        handler_done = self._handler_done

        def ended() -> None:
            if handler_done is not None and handler_done():
                return
            if not loop.is_closed():
                loop.call_soon_threadsafe(callback, self)

        self._context.add_callback(ended)

    def peer(self) -> str:
        return self._context.peer()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._context.auth_context()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._context.set_code(code)

    def set_details(self, details: str) -> None:
        self._context.set_details(details)


def _finish(context: grpc.ServicerContext, error: BaseException) -> None:
    """Apply a handler's failure to the sync call: a :class:`BridgedAbort` as its
    status; anything else propagates (grpc answers UNKNOWN, as ``grpc.aio`` does)."""
    if isinstance(error, BridgedAbort):
        context.abort(error.code, error.details)  # raises
    raise error


#: What the calls still waiting on the loop get when the server stops for good.
_STOPPED = BridgedAbort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")


class _Pending:
    """One bridged unary call: its outcome, and a lock the grpc thread waits on
    (released on the loop when the coroutine ends; cheaper than
    ``asyncio.run_coroutine_threadsafe`` and its ``concurrent.futures.Future``).
    Only the loop thread sets the outcome (:meth:`settle`), so it is set once."""

    __slots__ = ("error", "lock", "owner", "result", "settled", "task")

    def __init__(self, owner: set[_Pending]) -> None:
        self.owner = owner  # the bridge's calls in flight; left when the task ends
        self.lock = threading.Lock()
        self.lock.acquire()
        self.result: object = None
        self.error: BaseException | None = None
        self.settled = False
        self.task: asyncio.Future[object] | None = None

    def is_settled(self) -> bool:
        """Whether the outcome is known (read from grpc's threads: a stale False
        only costs a needless callback)."""
        return self.settled

    def settle(self, result: object, error: BaseException | None) -> None:
        """Record the outcome and wake the grpc thread (first call only; on the loop)."""
        if self.settled:
            return
        self.settled = True
        self.result, self.error = result, error
        self.lock.release()

    def __call__(self, task: asyncio.Future[object]) -> None:
        """The task's done callback (on the loop)."""
        self.owner.discard(self)
        if task.cancelled():
            self.settle(None, _STOPPED)
        else:
            error = task.exception()
            self.settle(None if error is not None else task.result(), error)


class Bridge:
    """Runs handlers' coroutines on ``loop`` for grpc's threads, and ends what is
    still waiting when the server stops (:meth:`release_all`).

    Args:
        loop: the event loop that runs the servicer (and the rest of the server).
        streams: the pool running ``ModelStreamInfer`` handlers (one thread per open
            stream: its responses are sent from it).
        readers: the pool reading streams' requests (one blocked read per open stream).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        streams: concurrent.futures.ThreadPoolExecutor,
        readers: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        self.loop = loop
        self.streams = streams
        self.readers = readers
        self.pending: set[_Pending] = set()  # touched on the loop only
        self.pumps: set[concurrent.futures.Future[None]] = set()
        self.closed = False

    def release_all(self) -> None:
        """On the loop: answer every unary call still waiting with UNAVAILABLE,
        cancel its coroutine, and cancel every stream's pump (the server is stopping
        for good)."""
        self.closed = True
        for pending in list(self.pending):
            pending.settle(None, _STOPPED)
            if pending.task is not None:
                pending.task.cancel()
        for pump in list(self.pumps):
            pump.cancel()

    def unary(
        self, behavior: Callable[[_Req, BridgedContext], Coroutine[object, None, object]]
    ) -> Callable[[_Req, grpc.ServicerContext], object]:
        """A sync unary handler running ``await behavior(request, context)`` on the
        loop (the grpc thread blocks until it ends)."""
        loop = self.loop
        pending_set = self.pending

        def handle(request: _Req, context: grpc.ServicerContext) -> object:
            pending = _Pending(pending_set)
            bridged = BridgedContext(context, loop, pending.is_settled)

            def start() -> None:
                if self.closed:
                    pending.settle(None, _STOPPED)
                    return
                try:
                    task = loop.create_task(behavior(request, bridged))
                except BaseException as e:  # noqa: BLE001 - handed to the grpc thread
                    pending.settle(None, e)
                    return
                pending.task = task
                pending_set.add(pending)
                task.add_done_callback(pending)

            try:
                loop.call_soon_threadsafe(start)
            except RuntimeError:  # the loop is closed
                context.abort(_STOPPED.code, _STOPPED.details)
            pending.lock.acquire()
            if pending.error is not None:
                _finish(context, pending.error)
            return pending.result

        return handle

    def stream(
        self, behavior: Callable[[AsyncIterator[_Req], BridgedContext], AsyncIterator[object]]
    ) -> Callable[[Iterator[_Req], grpc.ServicerContext], Iterator[object]]:
        """A sync stream-stream handler running the async generator
        ``behavior(request_iterator, context)`` on the loop: requests are read on a
        ``readers`` thread and handed to it, its responses come back through a
        queue that the grpc thread (from ``streams``) sends from."""
        loop = self.loop
        readers = self.readers

        def handle(requests: Iterator[_Req], context: grpc.ServicerContext) -> Iterator[object]:
            bridged = BridgedContext(context, loop)
            out: queue.SimpleQueue[object] = queue.SimpleQueue()

            def next_request() -> Any:
                try:
                    return next(requests)
                except StopIteration:
                    return _END
                except grpc.RpcError:  # the call ended (client gone, cancelled)
                    return _END

            async def request_iterator() -> AsyncIterator[_Req]:
                while True:
                    item = await loop.run_in_executor(readers, next_request)
                    if item is _END:
                        return
                    yield item

            async def pump() -> None:
                try:
                    async for response in behavior(request_iterator(), bridged):
                        out.put(response)
                except BaseException as e:  # noqa: BLE001 - handed to the grpc thread
                    out.put(e)
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    return
                out.put(_END)

            if self.closed:
                context.abort(_STOPPED.code, _STOPPED.details)
            future = asyncio.run_coroutine_threadsafe(pump(), loop)
            self.pumps.add(future)
            future.add_done_callback(self.pumps.discard)
            # the call ends (client cancelled, deadline, server stop): stop the pump
            context.add_callback(future.cancel)
            # a pump cancelled before it ran puts nothing: end the stream then too
            future.add_done_callback(lambda f: out.put(_END) if f.cancelled() else None)
            while True:
                item = out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        return
                    _finish(context, item)
                yield item

        handle.experimental_thread_pool = self.streams  # type: ignore[attr-defined]  # grpcio reads it
        return handle


def bridge_handlers(
    handlers: dict[str, grpc.RpcMethodHandler], bridge: Bridge
) -> dict[str, grpc.RpcMethodHandler]:
    """``handlers`` (``grpc.aio``-style coroutines and async generators) as handlers
    for the synchronous server, run on ``bridge``'s loop.

    Raises:
        ValueError: a handler that is neither unary-unary nor stream-stream.
    """
    bridged: dict[str, grpc.RpcMethodHandler] = {}
    for method, h in handlers.items():
        if h.unary_unary is not None:
            h = h._replace(unary_unary=bridge.unary(h.unary_unary))
        elif h.stream_stream is not None:
            h = h._replace(stream_stream=bridge.stream(h.stream_stream))
        else:  # pragma: no cover - the V2 service has no other kinds
            raise ValueError(f"cannot bridge gRPC method {method}")
        bridged[method] = h
    return bridged


class SyncServer:
    """A started synchronous ``grpc.Server`` with ``grpc.aio.Server``'s ``stop``.

    Args:
        server: the grpc server.
        bridge: its :class:`Bridge`.
        pools: the thread pools it uses (shut down once it has stopped).
    """

    def __init__(
        self,
        server: grpc.Server,
        bridge: Bridge,
        pools: tuple[concurrent.futures.ThreadPoolExecutor, ...],
    ) -> None:
        self.server = server
        self.bridge = bridge
        self.pools = pools

    async def stop(self, grace: float | None) -> None:
        """Stop accepting calls, let in-flight ones finish for up to ``grace``
        seconds, then cancel the rest (each call still waiting on the loop is
        answered UNAVAILABLE, so no grpc thread is left blocked)."""
        stopped: threading.Event = self.server.stop(grace)
        loop = asyncio.get_running_loop()
        if grace:
            await loop.run_in_executor(None, stopped.wait, grace + 1.0)
        self.bridge.release_all()
        await loop.run_in_executor(None, stopped.wait, 5.0)
        self.close()

    def close(self) -> None:
        """Release the thread pools (threads still busy end on their own)."""
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)
