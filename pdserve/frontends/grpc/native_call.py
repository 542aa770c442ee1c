"""The state of one call on a native gRPC connection: its stream (:class:`NativeCall`)
and the ``grpc.aio.ServicerContext`` subset its handler sees (:class:`NativeContext`)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from pdserve.frontends.grpc.engine import GrpcKeepalive
from pdserve.frontends.grpc.http2 import Header, Metadata, TrailingMetadata
from pdserve.frontends.grpc.sync_bridge import BridgedAbort

if TYPE_CHECKING:
    from pdserve.frontends.grpc.service import UnaryBehavior

log = logging.getLogger("pdserve.grpc")

#: ModelStreamInfer (any bidirectional stream) backpressure: the handler is given no
#: more requests while this many it was given are unanswered (responses are yielded
#: one at a time, each once the previous one is out: a client that does not read
#: them, its flow-control window closed, stops the reading of its requests)...
STREAM_MAX_UNANSWERED = 128
#: ... and the stream's receive window is not reopened (no WINDOW_UPDATE) while this
#: many requests wait to be given: the client can send no more than the window.
STREAM_MAX_QUEUED = 64
#: No request message yet (a unary call's), or the end of a stream's requests.
END = object()


class ServerSide(Protocol):
    """What a connection reads of the server it belongs to
    (:class:`~pdserve.frontends.grpc.native.NativeGrpcServer`)."""

    loop: asyncio.AbstractEventLoop
    keepalive: GrpcKeepalive
    handlers: dict[str, grpc.RpcMethodHandler]
    direct: dict[str, UnaryBehavior]
    service_path: bytes
    max_message_bytes: int
    max_connections: int
    connections: set[Any]

    def check_drained(self) -> None: ...


class NativeContext:
    """The ``grpc.aio.ServicerContext`` subset the servicer uses, for one call.

    Args:
        call: the call (its cancellation state and status live there).
        metadata: the request's custom metadata, ``(key, value)`` pairs (``str``
            values; ``-bin`` keys keep their raw header bytes).
        peer: ``ipv4:host:port``-style peer name.
        deadline: ``time.monotonic()`` when the call's ``grpc-timeout`` passes; None: none.
        loop: the connection's event loop (:attr:`native_loop`).

    Attributes:
        native_loop: the event loop the call runs on. Its presence tells
            :func:`~pdserve.frontends.grpc.service.grpc_cancel_token` that every early
            end of the call (RST_STREAM, deadline, connection lost) runs the done
            callbacks (:meth:`GrpcConnection._cancel`), so the request's token needs no
            probe polled (the dynamic batcher polls a token up to 3 times a request).
    """

    __slots__ = (
        "_call",
        "_callbacks",
        "_metadata",
        "_peer",
        "code",
        "deadline",
        "details",
        "native_loop",
        "trailers",
    )

    def __init__(
        self,
        call: NativeCall,
        metadata: Metadata,
        peer: str,
        deadline: float | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.native_loop = loop
        self._call = call
        self._metadata = metadata
        self._peer = peer
        self._callbacks: list[Callable[[NativeContext], None]] | None = None
        self.deadline = deadline
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailers: TrailingMetadata = ()

    def invocation_metadata(self) -> Metadata:
        """The call's metadata ``(key, value)`` pairs."""
        return self._metadata

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: TrailingMetadata = ()
    ) -> None:
        """End the call with ``code`` / ``details`` (raises
        :class:`~pdserve.frontends.grpc.sync_bridge.BridgedAbort`, a ``grpc.aio.AbortError``)."""
        if trailing_metadata:
            self.trailers = trailing_metadata
        raise BridgedAbort(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        """The status to end the call with when the handler returns."""
        self.code = code

    def set_details(self, details: str) -> None:
        """The status message to end the call with."""
        self.details = details

    def set_trailing_metadata(self, trailing_metadata: TrailingMetadata) -> None:
        """Trailing metadata sent with the status."""
        self.trailers = trailing_metadata

    def cancelled(self) -> bool:
        """Whether the call ended before its answer (RST_STREAM, deadline, connection lost)."""
        return self._call.cancelled

    def done(self) -> bool:
        """Whether the call has ended."""
        return self._call.finished or self._call.cancelled

    def add_done_callback(self, callback: Callable[[NativeContext], None]) -> None:
        """Call ``callback(self)`` when the call is cancelled before its answer (as the
        ``threads`` server's bridge: the callback exists to stop work in progress)."""
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)

    def run_callbacks(self) -> None:
        """Run the done callbacks (once; on cancellation)."""
        callbacks, self._callbacks = self._callbacks, None
        for cb in callbacks or ():
            try:
                cb(self)
            except Exception:  # noqa: BLE001 - a callback must not break the connection
                log.exception("gRPC done callback failed")

    def peer(self) -> str:
        """The client's address, grpc style (``ipv4:127.0.0.1:5000``)."""
        return self._peer

    def time_remaining(self) -> float | None:
        """Seconds until the deadline; None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class NativeCall:
    """One stream (RPC) on a connection."""

    __slots__ = (
        "buf",
        "cancelled",
        "ctx",
        "delivered",
        "direct",
        "held",
        "decompress",
        "finished",
        "handler",
        "out",
        "queue",
        "received",
        "remote_ended",
        "request",
        "resume",
        "sid",
        "task",
        "send_window",
        "timer",
        "trailers",
        "trailers_block",
        "writable",
        "yielded",
    )

    def __init__(
        self,
        sid: int,
        handler: Any,  # its grpc.RpcMethodHandler; None for an unknown method (refused)
        direct: UnaryBehavior | None = None,
    ) -> None:
        self.sid = sid
        self.handler = handler
        self.direct = direct  # the unary servicer method without its wrapper (direct_unary)
        self.buf = bytearray()
        self.ctx: NativeContext | None = None
        self.decompress: Callable[[bytes], bytes] | None = None
        self.request: object = END  # the request message, or END
        self.queue: asyncio.Queue[object] | None = None  # request messages, then END
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.out: collections.deque[bytes] = collections.deque()
        self.trailers: list[Header] | None = None  # not None: the trailers wait to go out
        self.trailers_block = b""
        self.send_window = 65535
        self.received = 0
        self.writable: asyncio.Event | None = None
        # streams: requests given to the handler, responses it yielded, its request
        # reader waiting for them to go out, the receive window withheld
        self.delivered = 0
        self.yielded = 0
        self.resume: asyncio.Event | None = None
        self.held = False
        self.cancelled = False
        self.finished = False  # our side has ended (trailers queued or sent)
        self.remote_ended = False


class Refused(Exception):
    """A call ended before its handler runs: its status."""

    def __init__(self, code: grpc.StatusCode, details: str, extra: TrailingMetadata = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.extra = code, details, extra
