"""The responses of one request to a decoupled model, on their way to a frontend.

A decoupled model (``model_transaction_policy { decoupled: true }``, Triton's
docs/user_guide/decoupled_models.md) answers a request with zero or more responses
and then a *final* flag, possibly on a response of its own or alone (an "empty final
response"). :meth:`pdserve.server.InferenceServer.infer_stream` gives the request a
:class:`ResponseStream`; the backend puts each response into it as it arrives
(:meth:`ResponseStream.put`), the frontend reads them (:meth:`ResponseStream.next`).

Every accepted request ends exactly once: with the model's final flag, with an error
as final item (the model raised, its worker died, the request timed out), or because
the consumer went away (:meth:`ResponseStream.cancel`; the backend's ``on_cancel``
hook then tells the model, whose ``response_sender.is_cancelled()`` turns True).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferResponse

#: A request whose consumer leaves this many of its responses untaken and has taken
#: none for :data:`STALL_SECS` is cancelled with ``RESOURCE_EXHAUSTED`` (the model is
#: told, as when the client goes away). This is a client that stays connected but
#: reads no more while the model goes on producing (an ``until_cancelled`` stream whose
#: gRPC flow-control window closed). A client that reads, however far behind a burst
#: it falls, is never cancelled below :data:`HARD_PENDING_RESPONSES`.
MAX_PENDING_RESPONSES = 1024
#: Seconds without a response taken, past :data:`MAX_PENDING_RESPONSES`.
STALL_SECS = 5.0
#: Untaken responses that cancel the request however recently one was taken.
HARD_PENDING_RESPONSES = 65536
#: Bytes of the untaken responses' output arrays that cancel it the same way.
MAX_PENDING_BYTES = 256 << 20


class StreamRequired(InferError):
    """``UNSUPPORTED``: a request without a stream (HTTP ``/infer``, gRPC ``ModelInfer``,
    a BLS call without ``decoupled=True``) to a decoupled model, as Triton refuses it.
    A frontend that can stream (gRPC ``ModelStreamInfer``) catches it and runs the
    request again through ``InferenceServer.infer_stream``."""


class StreamItem(NamedTuple):
    """One response of a decoupled model, as the backend hands it over."""

    #: Output name -> array; None: no response, only the final flag (an empty final).
    outputs: dict[str, np.ndarray] | None
    #: The response's error (outputs None), or None.
    error: InferError | None
    #: The request's last item.
    final: bool
    #: The response's parameters (a python model's ``InferenceResponse(parameters=)``).
    parameters: dict[str, Any] | None = None


class StreamResponse(NamedTuple):
    """One item of :meth:`pdserve.server.InferenceServer.infer_stream`, for a frontend."""

    #: The response; None for an error or an empty final response.
    response: InferResponse | None
    #: The error of this response, or None.
    error: InferError | None
    #: The request's last item (Triton's ``triton_final_response``).
    final: bool
    #: (model name, version) that answered (("", "") when no version was reached).
    model: tuple[str, str]


class ResponseStream:
    """Queue of one decoupled request's responses (one producer, one consumer; all on
    the server's event loop).

    Attributes:
        finished: resolves when the final item was put (an exception: the final item
            was an error) or the stream was cancelled; the core waits on it to count
            the request as done.
        on_cancel: set by the backend: called once when the consumer cancels, to tell
            the model (None: nothing to tell).
        convert: set by the core: turns a response's outputs into what the frontend
            gets (output check and order, classification); may return an InferError.
    """

    __slots__ = (
        "_items",
        "_waiter",
        "_pending_bytes",
        "_last_take",
        "closed",
        "finished",
        "on_cancel",
        "convert",
        "model",
    )

    def __init__(self) -> None:
        self._items: deque[StreamItem] = deque()
        self._pending_bytes = 0  # output bytes of the items not yet taken
        self._last_take = asyncio.get_running_loop().time()  # when the consumer last took one
        self._waiter: asyncio.Future[None] | None = None
        #: True once the final item is queued (later puts are dropped).
        self.closed = False
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.on_cancel: Callable[[], None] | None = None
        self.convert: Callable[[dict[str, np.ndarray]], Any] | None = None
        #: (model name, version) that answers, set by the core.
        self.model: tuple[str, str] = ("", "")

    def put(
        self,
        outputs: dict[str, np.ndarray] | None,
        final: bool,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        """Queue one response (``outputs`` None: the final flag alone) with its
        response ``parameters``."""
        if self.closed:
            return
        error: InferError | None = None
        if outputs is not None and self.convert is not None:
            converted = self.convert(outputs)
            if isinstance(converted, InferError):
                outputs, error = None, converted
            else:
                outputs = converted
        self._push(StreamItem(outputs, error, final, parameters))

    def put_converted(self, outputs: dict[str, np.ndarray], final: bool) -> None:
        """Queue a response whose outputs are already converted (no ``convert``)."""
        if not self.closed:
            self._push(StreamItem(outputs, None, final))

    def fail(self, error: InferError, final: bool = True) -> None:
        """Queue an error response (by default the request's last item)."""
        if not self.closed:
            self._push(StreamItem(None, error, final))

    def cancel(self, error: InferError) -> None:
        """The consumer no longer listens (client gone) or gave up (timeout): end the
        stream with ``error`` and tell the backend (``on_cancel``)."""
        if self.closed:
            return
        hook = self.on_cancel
        self._push(StreamItem(None, error, True))
        if hook is not None:
            hook()

    def _push(self, item: StreamItem) -> None:
        size = _nbytes(item.outputs)
        if not item.final:
            why = self._backlog_limit(size)
            if why is not None:
                # the consumer does not take responses: end the request rather than
                # hold an unbounded backlog (the ones already queued are still given)
                self.cancel(
                    InferError(
                        f"request cancelled: its consumer left {len(self._items)} responses "
                        f"({self._pending_bytes} bytes of outputs) untaken: {why} (read a "
                        "decoupled model's responses as they come)",
                        ErrorCode.RESOURCE_EXHAUSTED,
                    )
                )
                return
        self._pending_bytes += size
        self._items.append(item)
        if item.final:
            self.closed = True
            self.on_cancel = None
            if not self.finished.done():
                if item.error is not None:
                    self.finished.set_exception(item.error.fresh())
                    self.finished.exception()  # retrieved: the core may not wait on it
                else:
                    self.finished.set_result(None)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _backlog_limit(self, size: int) -> str | None:
        """Why one more untaken response of ``size`` output bytes is too many (see
        :data:`MAX_PENDING_RESPONSES`), or None."""
        pending = len(self._items)
        if pending >= HARD_PENDING_RESPONSES:
            return f"more than {HARD_PENDING_RESPONSES}"
        if self._pending_bytes + size > MAX_PENDING_BYTES:
            return f"more than {MAX_PENDING_BYTES} bytes"
        if pending >= MAX_PENDING_RESPONSES:
            idle = asyncio.get_running_loop().time() - self._last_take
            if idle >= STALL_SECS:
                return (
                    f"none taken for {idle:.1f} s with more than {MAX_PENDING_RESPONSES} "
                    f"waiting (limit {STALL_SECS:g} s)"
                )
        return None

    async def next(self, deadline: float | None = None) -> StreamItem | None:
        """The next item; None when ``deadline`` (``loop.time()``) passed first.

        Raises:
            asyncio.CancelledError: the consumer was cancelled.
        """
        while not self._items:
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            try:
                if deadline is None:
                    await self._waiter
                else:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        return None
                    try:
                        await asyncio.wait_for(self._waiter, remaining)
                    except TimeoutError:
                        if not self._items:
                            return None
            finally:
                self._waiter = None
        item = self._items.popleft()
        self._last_take = asyncio.get_running_loop().time()
        if item.outputs is not None:
            self._pending_bytes -= _nbytes(item.outputs)
        return item


def _nbytes(outputs: Any) -> int:
    """Bytes of a response's output arrays (0: no outputs, or a converted form without
    arrays)."""
    if not isinstance(outputs, dict):
        return 0
    return sum(getattr(a, "nbytes", 0) for a in outputs.values())
