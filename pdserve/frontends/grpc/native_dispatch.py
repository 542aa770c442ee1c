"""The calls of a native gRPC connection (:class:`CallDispatch`, mixed into
:class:`~pdserve.frontends.grpc.native.GrpcConnection`, which reads frames and writes).

A request is ``POST /<service>/<Method>`` with an ``application/grpc`` content type
(else HTTP 405 / 415); an unknown method is ``UNIMPLEMENTED``. Its messages are read
from DATA (``gzip`` / ``deflate`` decoded; one over ``max_message_bytes`` received or to
be sent: ``RESOURCE_EXHAUSTED``), its handler runs in its own task, and its responses go
out within the peer's flow-control windows, then the status trailers (Trailers-Only
when nothing was sent). ``grpc-timeout`` ends a call with ``DEADLINE_EXCEEDED``; that,
RST_STREAM or a lost connection cancels its work. A stream's handler is given no more
requests while :data:`~.native_call.STREAM_MAX_UNANSWERED` are unanswered, and its
receive window stays shut while :data:`~.native_call.STREAM_MAX_QUEUED` wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING

import grpc
from h2.errors import ErrorCodes

from pdserve.frontends.grpc.http2 import (
    ACCEPT_ENCODING,
    FRAME_HEADER,
    MESSAGE_PREFIX,
    OK_TRAILERS_BLOCK,
    RESPONSE_HEADERS_BLOCK,
    U32,
    Decompressor,
    RequestHead,
    TrailingMetadata,
    encode_block,
    frame,
    parse_timeout,
    status_trailers,
)
from pdserve.frontends.grpc.native_call import (
    END,
    STREAM_MAX_QUEUED,
    STREAM_MAX_UNANSWERED,
    NativeCall,
    NativeContext,
    Refused,
    ServerSide,
)
from pdserve.frontends.grpc.service import MalformedMessage
from pdserve.frontends.grpc.sync_bridge import BridgedAbort

log = logging.getLogger("pdserve.grpc")

#: The name of every call's task (see :meth:`GrpcConnection._start`).
_CALL_TASK_NAME = "pdserve-grpc-call"


class CallDispatch:
    """The call side of a :class:`~pdserve.frontends.grpc.native.GrpcConnection`."""

    server: ServerSide
    loop: asyncio.AbstractEventLoop
    calls: dict[int, NativeCall]
    out: list[bytes]
    peer: str
    closed: bool
    stalled: bool
    send_window: int
    stream_window: int
    max_frame: int
    write_ready: asyncio.Event | None
    idle_since: float
    draining: bool
    flush_pending: bool

    if TYPE_CHECKING:  # the connection's writing side

        def _flush(self) -> None: ...

        def _close(self) -> None: ...

    def _flush_soon(self) -> None:
        """Write the queued frames once this turn of the event loop is done."""
        if not self.flush_pending:
            self.flush_pending = True
            self.loop.call_soon(self._flush)

    def _maybe_idle(self) -> None:
        """The last call ended: the connection is idle (and closes if it drains)."""
        if not self.calls:
            self.idle_since = time.monotonic()
            if self.draining:
                self._flush()
                self._close()
                self.server.check_drained()

    # -- requests ------------------------------------------------------------------------

    def _request(self, sid: int, head: RequestHead, end_stream: bool) -> None:
        if head.method != b"POST" or not head.content_type.startswith(b"application/grpc"):
            status = b"405" if head.method != b"POST" else b"415"
            block = encode_block([(b":status", status)])
            self.out.append(frame(1, 0x5, sid, block))
            if not end_stream:
                self.out.append(frame(3, 0, sid, U32.pack(ErrorCodes.NO_ERROR)))
            return
        route = head.route
        if route is None:
            service, _, name = head.path.rpartition(b"/")
            handler = direct = None
            if service == self.server.service_path:
                key = name.decode("latin-1")
                handler = self.server.handlers.get(key)
                direct = self.server.direct.get(key)
            route = head.route = (handler, direct)
        handler, direct = route
        call = NativeCall(sid, handler, direct)
        call.send_window = self.stream_window
        self.calls[sid] = call
        try:
            if handler is None:
                raise Refused(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"Method not found: {head.path.decode('latin-1', 'replace')}",
                )
            encoding = head.encoding
            if encoding != b"identity":
                limit = self.server.max_message_bytes
                if encoding == b"gzip":
                    call.decompress = Decompressor(16 + zlib.MAX_WBITS, limit)
                elif encoding == b"deflate":
                    call.decompress = Decompressor(zlib.MAX_WBITS, limit)
                else:
                    raise Refused(
                        grpc.StatusCode.UNIMPLEMENTED,
                        f"Compression algorithm '{encoding.decode('latin-1', 'replace')}' "
                        "is not supported",
                        ((b"grpc-accept-encoding", ACCEPT_ENCODING),),
                    )
            deadline = None
            if head.timeout is not None:
                seconds = parse_timeout(head.timeout)
                if seconds is None:
                    raise Refused(grpc.StatusCode.INTERNAL, "malformed grpc-timeout")
                deadline = time.monotonic() + seconds
                call.timer = self.loop.call_later(seconds, self._expire, call)
            call.ctx = NativeContext(call, head.metadata, self.peer, deadline, self.loop)
        except Refused as e:
            self._finish(call, e.code, e.details, e.extra)
            return
        if handler.stream_stream is not None:
            call.queue = asyncio.Queue()
            call.task = self._start(self._run_stream(call))
        if end_stream:
            self._remote_end(call)

    def _messages(self, call: NativeCall, data: bytes) -> None:
        """Read the complete length-prefixed messages of the call's data."""
        buf = call.buf
        if buf:
            buf += data
        elif len(data) >= 5:  # the common case: one whole message in one frame
            flag, length = MESSAGE_PREFIX.unpack_from(data)
            if flag == 0 and len(data) == 5 + length and length <= self.server.max_message_bytes:
                self._message(call, data[5:])
                return
            buf += data
        else:
            buf += data
        limit = self.server.max_message_bytes
        while len(buf) >= 5:
            flag, length = MESSAGE_PREFIX.unpack_from(buf)
            if length > limit:
                self._finish(
                    call,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({length} vs. {limit})",
                )
                return
            if len(buf) < 5 + length:
                return
            payload = bytes(buf[5 : 5 + length])
            del buf[: 5 + length]
            if flag:
                if flag != 1 or call.decompress is None:
                    self._finish(
                        call,
                        grpc.StatusCode.INTERNAL,
                        "compressed message without a grpc-encoding"
                        if flag == 1
                        else f"bad message flag {flag}",
                    )
                    return
                try:
                    payload = call.decompress(payload)
                except OverflowError:
                    self._finish(
                        call,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Received message larger than max (more than {limit} bytes decompressed)",
                    )
                    return
                except zlib.error as e:
                    self._finish(
                        call, grpc.StatusCode.INTERNAL, f"could not decompress the message: {e}"
                    )
                    return
            if not self._message(call, payload):
                return

    def _message(self, call: NativeCall, payload: bytes) -> bool:
        request = call.handler.request_deserializer(payload)
        if call.queue is not None:
            call.queue.put_nowait(request)
        elif call.request is END:
            call.request = request
        else:
            self._finish(
                call,
                grpc.StatusCode.UNIMPLEMENTED,
                "more than one request message on a unary call",
            )
            return False
        return True

    def _remote_end(self, call: NativeCall) -> None:
        call.remote_ended = True
        if call.finished:
            if call.sid in self.calls and call.trailers is None and not call.out:
                self._forget(call)
            return
        if call.buf:
            self._finish(call, grpc.StatusCode.INTERNAL, "the request ended inside a message")
            return
        if call.queue is not None:
            call.queue.put_nowait(END)
            return
        if call.request is END:
            self._finish(call, grpc.StatusCode.UNIMPLEMENTED, "no request message on a unary call")
            return
        call.task = self._start(self._run_unary(call))

    def _start(self, coro: Coroutine[object, None, None]) -> asyncio.Task[None]:
        """Run a call's coroutine in its own task: ``asyncio.Task`` with a fixed name
        rather than ``loop.create_task`` (no "Task-N" formatting, no uvloop wrapper;
        pdserve's loops set no task factory), as the native HTTP transport does."""
        return asyncio.Task(coro, loop=self.loop, name=_CALL_TASK_NAME)

    def _window(self, sid: int) -> None:
        if sid:
            call = self.calls.get(sid)
            if call is not None and (call.out or call.trailers is not None):
                self._pump(call)
            return
        if not self.stalled:  # no call waits for window: nothing to scan
            return
        self.stalled = False
        for call in list(self.calls.values()):
            if self.send_window <= 0:
                self.stalled = True
                return
            if call.out or call.trailers is not None:
                self._pump(call)  # (marks the connection stalled again if still blocked)

    # -- calls ---------------------------------------------------------------------------

    async def _run_unary(self, call: NativeCall) -> None:
        ctx = call.ctx
        assert ctx is not None
        try:
            handler = call.handler
            request = call.request
            direct = call.direct
            try:
                if direct is not None and not isinstance(request, MalformedMessage):
                    response = await direct(request, ctx)  # the servicer's method itself
                else:
                    response = await handler.unary_unary(request, ctx)
            except BridgedAbort as e:
                self._finish(call, e.code, e.details, ctx.trailers)
                return
            except asyncio.CancelledError:
                return
            except Exception as e:  # noqa: BLE001 - one call must not take the connection down
                log.exception("gRPC call failed")
                self._finish(
                    call,
                    grpc.StatusCode.UNKNOWN,
                    f"Unexpected error in handler: {type(e).__name__}: {e}",
                )
                return
            if call.finished or call.cancelled:
                return
            if ctx.code is not None and ctx.code is not grpc.StatusCode.OK:
                self._finish(call, ctx.code, ctx.details, ctx.trailers)
                return
            data = handler.response_serializer(response)
            n = len(data)
            if n > self.server.max_message_bytes:
                self._finish(
                    call,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Sent message larger than max ({n} vs. {self.server.max_message_bytes})",
                )
                return
            call.finished = True
            trailers = (
                encode_block(status_trailers(grpc.StatusCode.OK, ctx.details, ctx.trailers))
                if ctx.trailers or ctx.details
                else OK_TRAILERS_BLOCK
            )
            if n + 5 <= min(call.send_window, self.send_window, self.max_frame):
                # the common case: headers, the message and trailers in one write
                call.send_window -= n + 5
                self.send_window -= n + 5
                self.out.append(
                    frame(1, 0x4, call.sid, RESPONSE_HEADERS_BLOCK)
                    + FRAME_HEADER.pack(n + 5 << 8, 0, call.sid)  # DATA
                    + MESSAGE_PREFIX.pack(0, n)
                    + data
                    + frame(1, 0x5, call.sid, trailers)
                )
                self._done_sending(call)
            else:
                self.out.append(frame(1, 0x4, call.sid, RESPONSE_HEADERS_BLOCK))
                call.out.append(MESSAGE_PREFIX.pack(0, n) + data)
                call.trailers_block = trailers
                call.trailers = []
                self._pump(call)
            self._flush_soon()
        finally:
            call.ctx = None  # ctx refers to the call: no cycle left for the collector

    async def _requests(self, call: NativeCall) -> AsyncIterator[object]:
        """The stream's requests for its handler; none more while
        :data:`STREAM_MAX_UNANSWERED` given ones are unanswered (backpressure)."""
        queue = call.queue
        assert queue is not None
        while True:
            while (
                call.delivered - call.yielded >= STREAM_MAX_UNANSWERED
                and not call.cancelled
                and not self.closed
            ):
                call.resume = asyncio.Event()
                await call.resume.wait()
            request = await queue.get()
            if request is END:
                return
            call.delivered += 1
            if call.held and queue.qsize() < STREAM_MAX_QUEUED and not call.cancelled:
                call.held = False
                self.out.append(frame(8, 0, call.sid, U32.pack(call.received)))
                call.received = 0
                self._flush_soon()
            yield request

    async def _run_stream(self, call: NativeCall) -> None:
        ctx = call.ctx
        assert ctx is not None
        try:
            handler = call.handler
            limit = self.server.max_message_bytes
            headers_sent = False
            code, details = grpc.StatusCode.OK, ""
            extra: TrailingMetadata = ()
            try:
                async for response in handler.stream_stream(self._requests(call), ctx):
                    if call.finished or call.cancelled:
                        return
                    data = handler.response_serializer(response)
                    if len(data) > limit:
                        code = grpc.StatusCode.RESOURCE_EXHAUSTED
                        details = f"Sent message larger than max ({len(data)} vs. {limit})"
                        break
                    if not headers_sent:
                        self.out.append(frame(1, 0x4, call.sid, RESPONSE_HEADERS_BLOCK))
                        headers_sent = True
                    call.out.append(MESSAGE_PREFIX.pack(0, len(data)) + data)
                    call.yielded += 1
                    if call.resume is not None:  # one fewer unanswered: read on
                        call.resume.set()
                        call.resume = None
                    self._pump(call)
                    self._flush_soon()
                    await self._writable(call)
                else:
                    if ctx.code is not None:
                        code, details = ctx.code, ctx.details
                    extra = ctx.trailers
            except BridgedAbort as e:
                code, details, extra = e.code, e.details, ctx.trailers
            except asyncio.CancelledError:
                return
            except Exception as e:  # noqa: BLE001
                log.exception("gRPC stream failed")
                code = grpc.StatusCode.UNKNOWN
                details = f"Unexpected error in handler: {type(e).__name__}: {e}"
            if call.finished or call.cancelled:
                return
            if headers_sent:
                call.finished = True
                call.trailers_block = encode_block(status_trailers(code, details, extra))
                call.trailers = []
                self._pump(call)
                self._flush_soon()
            else:
                self._finish(call, code, details, extra)
        finally:
            call.ctx = None  # ctx refers to the call: no cycle left for the collector

    async def _writable(self, call: NativeCall) -> None:
        """Wait while the call's data waits for flow-control window or the transport's
        buffer is full."""
        while call.out and not call.cancelled and not self.closed:
            call.writable = asyncio.Event()
            await call.writable.wait()
        while self.write_ready is not None and not self.closed:
            await self.write_ready.wait()

    def _pump(self, call: NativeCall) -> None:
        """Send what flow control allows of the call's queued data, then its trailers."""
        if call.cancelled:
            call.out.clear()
            return
        out = call.out
        sid = call.sid
        while out:
            size = min(call.send_window, self.send_window, self.max_frame)
            if size <= 0:
                self.stalled = True  # a WINDOW_UPDATE of the connection pumps it again
                return
            data = out[0]
            if len(data) <= size:
                out.popleft()
            else:
                out[0] = data[size:]
                data = data[:size]
            n = len(data)
            call.send_window -= n
            self.send_window -= n
            self.out.append(FRAME_HEADER.pack(n << 8, 0, sid) + data)  # DATA
        if call.writable is not None:
            call.writable.set()
            call.writable = None
        if call.trailers is not None:
            call.trailers = None
            self.out.append(frame(1, 0x5, sid, call.trailers_block))
            self._done_sending(call)
        self._flush_soon()

    def _done_sending(self, call: NativeCall) -> None:
        """The call's trailers are out: close the stream."""
        if not call.remote_ended:  # the client is still sending: stop it
            self.out.append(frame(3, 0, call.sid, U32.pack(ErrorCodes.NO_ERROR)))
        self._forget(call)

    def _reset(self, call: NativeCall, code: int) -> None:
        """RST_STREAM ``code`` and cancel the call."""
        self.out.append(frame(3, 0, call.sid, U32.pack(code)))
        self.calls.pop(call.sid, None)
        self._cancel(call)
        self._maybe_idle()

    def _finish(
        self, call: NativeCall, code: grpc.StatusCode, details: str, extra: TrailingMetadata = ()
    ) -> None:
        """End a call that has sent nothing with a Trailers-Only response."""
        if call.finished or call.cancelled:
            return
        call.finished = True
        block = encode_block(
            [(b":status", b"200"), (b"content-type", b"application/grpc")]
            + status_trailers(code, details, extra)
        )
        self.out.append(frame(1, 0x5, call.sid, block))
        self._done_sending(call)
        self._flush_soon()

    def _forget(self, call: NativeCall) -> None:
        call.finished = True
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        if self.calls.pop(call.sid, None) is not None:
            self._maybe_idle()

    def _cancel(self, call: NativeCall) -> None:
        """The client reset the stream, the deadline passed or the connection went:
        stop the call's work (its CancelToken via the done callbacks, then the task)."""
        if call.cancelled:
            return
        call.cancelled = True
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        if call.writable is not None:
            call.writable.set()
        if call.resume is not None:
            call.resume.set()
        if call.task is not None and not call.task.done():
            if call.ctx is not None:
                call.ctx.run_callbacks()
            call.task.cancel()

    def _expire(self, call: NativeCall) -> None:
        """``grpc-timeout`` passed: DEADLINE_EXCEEDED, and the work is stopped."""
        call.timer = None
        if call.finished or call.cancelled:
            return
        self._finish(call, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        self._cancel(call)
        self._flush()
