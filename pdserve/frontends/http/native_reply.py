"""How the native transport answers its requests: the inference fast path, every other
route through :meth:`HttpApp.handle <pdserve.frontends.http.app.HttpApp.handle>`, the
response bytes (keep-alive, HEAD, gzip, chunked streams), and closing after the last
answer (a lingering close). :class:`Replies` is a part of
:class:`~pdserve.frontends.http.native.HttpConnection`."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote

from pdserve.core import timing as timing_mod
from pdserve.core.cancel import CancelToken
from pdserve.core.errors import InferError, client_gone
from pdserve.frontends.http.answer import CLOSE, Answer, error_answer, pump_stream
from pdserve.frontends.http.app import JOIN_LIMIT, OFFLOAD_BYTES, HttpApp, parse_infer_headers
from pdserve.frontends.http.compression import GZIP_MIN_BYTES, accepts_gzip, gzip_bytes
from pdserve.frontends.http.server import HttpLimits, _warn
from pdserve.frontends.http.wire import (
    CONTINUE,
    END_CLOSE,
    END_KEEP,
    END_KEEP10,
    GZIP_HEADERS,
    OK_JSON,
    OK_OCTETS,
    VARY,
    error_bytes,
    status_line,
    unread_bytes,
)
from pdserve.frontends.offload import off_loop
from pdserve.frontends.openai.codec import OpenAIError

logger = logging.getLogger("pdserve.http")

#: Inference paths whose decoded (model, version) a server keeps (see
#: ``NativeHttpServer.infer_routes``).
MAX_INFER_ROUTES = 256
#: The name of every inference request's task (see ``Replies._start``).
_INFER_TASK_NAME = "pdserve-http-infer"
#: Seconds a connection closed after an error answer keeps reading (and dropping) what
#: the client still sends, so that the answer is not lost to a reset (a lingering close,
#: as nginx's ``lingering_close``).
LINGER_SECONDS = 2.0
#: At most this many bytes are read and dropped after a refusal in a request's line or
#: headers (431, 400): enough for a legitimate client's oversized headers to finish
#: arriving, not a sink for an endless header.
LINGER_HEADER_BYTES = 2 * 1024 * 1024
#: A small one-model JSON answer with its Server-Timing: content length, the three
#: durations of :data:`pdserve.core.timing.ONE_MODEL`, the end of the head, the body.
_TIMED_JSON = (
    OK_JSON + b"%d\r\n" + timing_mod.RESPONSE_KEY.encode() + b": " + timing_mod.ONE_MODEL + b"%s%s"
)


def _answer_headers(json_length: int | None) -> list[tuple[bytes, bytes]]:
    """An inference answer's content headers: JSON, or binary tensors after a JSON
    header of ``json_length`` bytes (the binary tensor extension)."""
    if json_length is None:
        return [(b"content-type", b"application/json")]
    return [
        (b"content-type", b"application/octet-stream"),
        (b"inference-header-content-length", b"%d" % json_length),
    ]


# Deadline kinds of a connection.
NONE, IDLE, HEAD, BODY, LINGER = 0, 1, 2, 3, 4
# Reasons reading is paused (a bit mask).
PIPE, WRITE = 1, 2


@dataclass(slots=True, eq=False)
class ParsedRequest:
    """One parsed request waiting to be (or being) answered."""

    method: bytes
    url: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_alive: bool
    http10: bool
    #: the ``Accept-Encoding`` value (b"": none)
    accept: bytes

    def gzip(self) -> bool:
        """The client accepts a gzip response (asked only of a response large enough to
        be compressed)."""
        return bool(self.accept) and accepts_gzip(self.accept)


class _Server(Protocol):
    """What a connection reads of its :class:`~pdserve.frontends.http.native.NativeHttpServer`."""

    closing: bool
    infer_routes: dict[bytes, tuple[str, str]]
    draining: Callable[[], bool]


class Replies:
    """The answering half of a native connection (the parsing half, and the state
    declared here, are :class:`~pdserve.frontends.http.native.HttpConnection`'s)."""

    server: _Server
    app: HttpApp
    limits: HttpLimits
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    deadline: float
    deadline_kind: int
    _gone: bool
    _broken: bool
    _busy: bool
    _head_only: bool
    _awaiting_headers: bool
    _message_begun: bool
    _continue: bool
    _body_start: float
    _linger_left: int
    _queue: collections.deque[ParsedRequest]
    _pending_error: bytes | None
    _rejection: tuple[int, str] | None
    _url: bytes
    _token: CancelToken | None
    _write_paused: bool
    _drain_waiter: asyncio.Future[None] | None
    _disconnected: asyncio.Future[None] | None

    def _resume(self, reason: int) -> None:
        raise NotImplementedError

    def _pause(self, reason: int) -> None:
        raise NotImplementedError

    # -- requests -----------------------------------------------------------------------

    def _dispatch(self, request: ParsedRequest) -> None:
        self._busy = True
        self._head_only = request.method == b"HEAD"
        if self.server.closing:
            request.keep_alive = False
            self._finish(
                request,
                error_bytes(503, "the server is shutting down"),
            )
            return
        url = request.url
        if request.method == b"POST" and url.startswith(b"/v2/models/"):
            path = url.split(b"?", 1)[0] if b"?" in url else url
            routes = self.server.infer_routes
            route = routes.get(path)
            if route is not None:
                self._start(self._infer(request, route[0], route[1]))
                return
            if path.endswith(b"/infer"):
                parts = path.split(b"/")
                n = len(parts)
                if n == 5 or (n == 7 and parts[4] == b"versions" and parts[5]):
                    try:
                        model = self._segment(parts[3])
                        version = self._segment(parts[5]) if n == 7 else ""
                    except UnicodeDecodeError:
                        pass  # HttpApp.handle answers it
                    else:
                        if len(routes) >= MAX_INFER_ROUTES:
                            routes.clear()
                        routes[path] = (model, version)
                        self._start(self._infer(request, model, version))
                        return
        self.loop.create_task(self._serve(request))

    def _start(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run an inference request's coroutine in its own task: ``asyncio.Task`` with a
        fixed name (a task without one formats "Task-N" at creation; no task factory is
        set on pdserve's loops)."""
        asyncio.Task(coro, loop=self.loop, name=_INFER_TASK_NAME)

    @staticmethod
    def _segment(raw: bytes) -> str:
        text = raw.decode("ascii")
        return unquote(text) if "%" in text else text

    def _new_token(self) -> CancelToken:
        # No probe to poll: connection_lost cancels self._token, the only token of
        # this connection not yet answered (one request is served at a time).
        token = self._token = CancelToken(None, self.loop)
        if self._gone:
            token.cancel(client_gone())
        return token

    async def _infer(self, request: ParsedRequest, model: str, version: str) -> None:
        """``POST .../infer``: :meth:`HttpApp.infer <pdserve.frontends.http.app.HttpApp.infer>`'s
        steps run from this task, without the routing and exchange of ``handle`` (the
        transport's hot path: the route is cached, one coroutine level fewer)."""
        app = self.app
        arrival_ns = time.monotonic_ns()
        try:
            if not model:
                raise InferError("missing model name in the inference request path")
            headers = request.headers
            if app.gate is not None:
                path = request.url.split(b"?", 1)[0].decode("latin-1")
                await app.check_gate(unquote(path), headers)
            head = parse_infer_headers(headers)
            header_length = head[2]
            body = request.body
            if header_length is not None:  # 400 past the body, 413 over the JSON limit
                app.body.check_header_length(header_length, -1 if head[1] else len(body))
            if head[1]:
                body = await app.body.finish(body, head[1], header_length is None)
            # app.infer_body's steps, run here for the common small request: the server's
            # coroutine is awaited by this task directly (one coroutine level fewer)
            token = self._new_token()
            timing: list[timing_mod.Entry] | None = [] if timing_mod.state.enabled else None
            decoded = app.decode_inline(body, head, model, version, arrival_ns, token, timing)
            if decoded is None:
                parts, json_length, total = await app.infer_body(
                    body, head, model, version, arrival_ns, token, timing
                )
            else:
                response = await app.run_decoded(decoded)
                encoded = app.encode_inline(response, decoded)
                if encoded is None:
                    encoded = await app.encode_large(response, decoded)
                parts, json_length, total = encoded
        except Exception as exc:  # noqa: BLE001 - answered; the connection carries on
            self._answer_error(request, exc, "POST", model)
            return
        except BaseException:  # cancelled: no answer can be trusted; close
            request.keep_alive = False
            self._finish(request, None)
            raise
        if self._gone:
            self._finish(request, None)
            return
        if timing:  # the request asked for its Server-Timing (pdserve.core.timing)
            if total < GZIP_MIN_BYTES and json_length is None and len(parts) == 1:
                durations = timing_mod.one_model(timing)  # the usual one: one format
                if durations is not None:
                    end = self._end(request)
                    self._finish(request, _TIMED_JSON % (total, *durations, end, parts[0]))
                    return
            self._write_timed(request, parts, json_length, total, timing)
            return
        if total >= GZIP_MIN_BYTES and request.gzip():
            self._write_gzipped(request, parts, json_length)
            return
        if json_length is None:
            end = self._end(request)
            if total >= GZIP_MIN_BYTES:
                end = VARY + end
            self._finish(request, b"%s%d%s%s" % (OK_JSON, total, end, parts[0]))
            return
        end = self._end(request)
        if total >= GZIP_MIN_BYTES:
            end = VARY + end
        head_bytes = b"%s%d\r\ncontent-length: %d%s" % (OK_OCTETS, json_length, total, end)
        if self._gone:
            self._finish(request, None)
            return
        if total <= JOIN_LIMIT:
            self._finish(request, head_bytes + b"".join(parts))
            return
        if not self._head_only:
            self.transport.writelines([head_bytes, *parts])
        else:
            self.transport.write(head_bytes)
        self._finish(request, None)

    def _write_gzipped(
        self, request: ParsedRequest, parts: list[Any], json_length: int | None
    ) -> None:
        """An inference response large enough to compress, to a client that accepts gzip:
        JSON, or binary tensors after a JSON header of ``json_length`` bytes."""
        self._write_whole(request, 200, _answer_headers(json_length), parts)

    def _write_timed(
        self,
        request: ParsedRequest,
        parts: list[Any],
        json_length: int | None,
        total: int,
        timing: list[timing_mod.Entry],
    ) -> None:
        """An inference response with its ``Server-Timing`` header (other than the small
        one-model JSON answer, composed by the caller): in one format like the untimed
        responses when it is too small to compress, else by :meth:`_write_whole` (gzip,
        ``vary``)."""
        value = timing_mod.server_timing(timing).encode()
        if total < GZIP_MIN_BYTES:
            end = self._end(request)
            if json_length is None:
                head = b"%s%d\r\nserver-timing: %s%s" % (OK_JSON, total, value, end)
            else:
                head = b"%s%d\r\ncontent-length: %d\r\nserver-timing: %s%s" % (
                    OK_OCTETS,
                    json_length,
                    total,
                    value,
                    end,
                )
            self._finish(request, head + parts[0] if len(parts) == 1 else head + b"".join(parts))
            return
        headers = _answer_headers(json_length)
        headers.append((b"server-timing", value))
        self._write_whole(request, 200, headers, parts)

    def _end(self, request: ParsedRequest) -> bytes:
        """The end of the header block: the connection header, if one is needed."""
        if not request.keep_alive or self.server.draining() or self.server.closing:
            request.keep_alive = False
            return END_CLOSE
        if request.http10:
            return END_KEEP10
        return END_KEEP

    def _write_whole(
        self,
        request: ParsedRequest,
        status: int,
        headers: list[tuple[bytes, bytes]],
        parts: list[Any],
    ) -> None:
        """Write a whole response (gzip-compressed when the client accepts it and it is
        large enough); schedules the compression off the loop when it is large."""
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        if len(body) >= GZIP_MIN_BYTES and request.gzip():
            if len(body) > OFFLOAD_BYTES:
                self.loop.create_task(self._write_gzip_later(request, status, headers, body))
                return
            self._finish(request, self._compose(request, status, headers, gzip_bytes(body), True))
            return
        self._finish(request, self._compose(request, status, headers, body, False))

    async def _write_gzip_later(
        self, request: ParsedRequest, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        try:
            compressed = await off_loop(gzip_bytes, body)
        except Exception:  # noqa: BLE001 - send it uncompressed
            self._finish(request, self._compose(request, status, headers, body, False))
            return
        self._finish(request, self._compose(request, status, headers, compressed, True))

    def _compose(
        self,
        request: ParsedRequest,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        gzipped: bool,
    ) -> bytes:
        """A whole response: status line, ``headers`` (content-length and connection
        are set here), body."""
        out = [status_line(status)]
        for name, value in headers:
            if name in (b"content-length", b"connection", b"transfer-encoding"):
                continue
            if name == b"vary" and len(body) >= GZIP_MIN_BYTES:
                continue
            out.append(b"%s: %s\r\n" % (name, value))
        out.append(b"content-length: %d" % len(body))
        if gzipped:
            out.append(GZIP_HEADERS)
        elif len(body) >= GZIP_MIN_BYTES:
            out.append(VARY)
        out.append(self._end(request))
        if not self._head_only:
            out.append(body)
        return b"".join(out)

    def _answer_error(
        self, request: ParsedRequest, exc: BaseException, method: str, what: str
    ) -> None:
        answer = error_answer(exc, method, what)
        if CLOSE in answer.headers:
            request.keep_alive = False
            self._broken = True
        if self._gone:
            self._finish(request, None)
            return
        self._finish(
            request, self._compose(request, answer.status, answer.headers, answer.body, False)
        )

    def _finish(self, request: ParsedRequest, data: bytes | None) -> None:
        """Write ``data`` (the whole response; None: already written) and go on with
        the next request, or close."""
        transport = self.transport
        if data is not None and not self._gone and not transport.is_closing():
            if self._head_only:
                end = data.find(b"\r\n\r\n")
                if end >= 0:
                    data = data[: end + 4]
            transport.write(data)
        self._busy = False
        self._token = None
        if self._gone:
            return
        if not request.keep_alive or self.server.closing:
            self._linger_close()
            return
        if self._queue:
            self._resume(PIPE)
            self._dispatch(self._queue.popleft())
            return
        if self._pending_error is not None:
            transport.write(self._pending_error)
            self._pending_error = None
            self._linger_close()
            return
        if self._broken:
            # nothing after a refused request (or one that closes) was parsed: close
            transport.close()
            return
        if self._message_begun:
            if self._continue and not self._awaiting_headers:
                self._continue = False
                transport.write(CONTINUE)
                if self.deadline_kind == BODY:  # the client sends its body from now on
                    now = self._body_start = self.loop.time()
                    self.deadline = now + (self.app.body.timeout or 0)
            return  # its header/body deadline stands
        if self.limits.idle_timeout > 0:
            self.deadline = self.loop.time() + self.limits.idle_timeout
            self.deadline_kind = IDLE

    def _reject(self, status: int, message: str) -> None:
        """Answer ``status`` and close; after the responses due before it."""
        _warn(str(status), "HTTP request refused with %d: %s", status, message)
        self._broken = True
        self._rejection = None
        self.deadline = 0.0
        self.deadline_kind = NONE
        # a refused /v1/ request (the OpenAI routes) gets OpenAI's error body
        body = OpenAIError(status, message).body() if self._url.startswith(b"/v1/") else b""
        data = error_bytes(status, message, body=body)
        if self._busy or self._queue:
            self._pending_error = data
            return
        if not self.transport.is_closing():
            self.transport.write(data)
            self._linger_close()

    def _linger_close(self) -> None:
        """Close after the last answer. While the client may still be sending (a request
        is half read, or bytes are unread), only the sending side is shut and what comes
        is read and dropped for up to :data:`LINGER_SECONDS` (and :data:`LINGER_HEADER_BYTES`
        after a refused line or header block, the request limit after a refused body):
        closing a socket with
        unread bytes makes the kernel send a reset, and the client would lose the
        answer (a 413 for a body it is still sending)."""
        transport = self.transport
        if self._gone or transport.is_closing():
            return
        if not self._message_begun and not unread_bytes(transport):
            transport.close()
            return
        try:
            transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            transport.close()
            return
        self._broken = True  # what comes is dropped (data_received)
        # a body being refused may still be on its way (up to the request limit); a
        # refused line or header block gets a small allowance
        self._linger_left = (
            LINGER_HEADER_BYTES if self._awaiting_headers else self.app.body.max_request_bytes
        )
        self.deadline = self.loop.time() + LINGER_SECONDS
        self.deadline_kind = LINGER
        # (reading stays paused while the client does not read what it was sent)
        self._resume(PIPE)

    # -- every route but the inference fast path ---------------------------------------

    async def _serve(self, request: ParsedRequest) -> None:
        """Answer a request with :meth:`HttpApp.handle <pdserve.frontends.http.app.HttpApp.handle>`."""
        method = request.method.decode("latin-1")
        path = request.url.partition(b"?")[0].decode("latin-1")
        if "%" in path:
            path = unquote(path)
        stream: _StreamWriter | None = None
        try:
            answer = await self.app.handle(method, path, request.headers, _Exchange(self, request))
            if answer.stream is None:
                self._write_answer(request, answer)
                return
            stream = _StreamWriter(self, request, answer)
            disconnected = asyncio.shield(self.disconnected_future())
            await pump_stream(answer.stream, stream.start, stream.write, stream.end, disconnected)
        except Exception as exc:  # noqa: BLE001 - answered; the connection carries on
            if stream is None or not stream.started:
                if self._gone:
                    self._finish(request, None)
                    return
                self._answer_error(request, exc, method, path)
                return
            logger.exception("error serving %s", request.url[:200])
            request.keep_alive = False
        except BaseException:  # cancelled: close
            request.keep_alive = False
            self._finish(request, None)
            raise
        if stream is not None and not stream.complete:
            # ended mid-stream (or the client left): closing without the last chunk tells
            # the client that the body is incomplete
            request.keep_alive = False
        self._finish(request, None)

    def _write_answer(self, request: ParsedRequest, answer: Answer) -> None:
        """Write a whole answer (gzip-coded when the client accepts it and it is large
        enough, and small enough to code on the loop)."""
        body = answer.body if answer.parts is None else b"".join(answer.parts)
        encoded = False
        for name, value in answer.headers:
            if name == b"connection" and value.lower() == b"close":
                request.keep_alive = False
                self._broken = True
            elif name == b"content-encoding":
                encoded = True
        gzipped = (
            not encoded
            and GZIP_MIN_BYTES <= len(body) <= OFFLOAD_BYTES
            and not self._head_only
            and request.gzip()
        )
        if gzipped:
            body = gzip_bytes(body)
        self._finish(request, self._compose(request, answer.status, answer.headers, body, gzipped))

    def disconnected_future(self) -> asyncio.Future[None]:
        """Done when the client has gone."""
        if self._disconnected is None:
            self._disconnected = self.loop.create_future()
            if self._gone:
                self._disconnected.set_result(None)
        return self._disconnected

    async def drain(self) -> None:
        """Wait while the write buffer is above its high-water mark."""
        if self._write_paused and not self._gone:
            self._drain_waiter = self.loop.create_future()
            await self._drain_waiter


class _Exchange:
    """A native request as the handlers see it (:class:`~pdserve.frontends.http.answer.Exchange`):
    its body was read already, within the limits, by the connection."""

    __slots__ = ("conn", "request")

    def __init__(self, conn: Replies, request: ParsedRequest) -> None:
        self.conn = conn
        self.request = request

    def read_body(
        self, content_length: int, encoding: bytes, json: bool
    ) -> Coroutine[Any, Any, bytes]:
        return self.conn.app.body.finish(self.request.body, encoding, json)

    def cancel_token(self) -> CancelToken:
        return self.conn._new_token()

    def disconnected(self) -> asyncio.Future[None]:
        return asyncio.shield(self.conn.disconnected_future())


class _StreamWriter:
    """Writes a streaming answer: its head with ``transfer-encoding: chunked`` (HTTP/1.0:
    no length, the connection closes after it), each piece as a chunk, the last chunk."""

    __slots__ = ("conn", "request", "answer", "started", "complete", "chunked")

    def __init__(self, conn: Replies, request: ParsedRequest, answer: Answer) -> None:
        self.conn = conn
        self.request = request
        self.answer = answer
        self.started = False  # a response head was written
        self.complete = False
        self.chunked = False

    def _closed(self) -> bool:
        return self.conn._gone or self.conn.transport.is_closing()

    async def start(self) -> None:
        self.started = True
        if self._closed():
            return
        conn, request = self.conn, self.request
        out = [status_line(self.answer.status)]
        for name, value in self.answer.headers:
            if name != b"connection":
                out.append(b"%s: %s\r\n" % (name, value))
        if request.http10:
            request.keep_alive = False
        else:
            self.chunked = True
            out.append(b"transfer-encoding: chunked\r\n")
        out.append(conn._end(request)[2:])  # the connection header (if any), blank line
        conn.transport.write(b"".join(out))

    async def write(self, piece: bytes) -> None:
        conn = self.conn
        if self._closed():
            return
        if piece and not conn._head_only:
            if self.chunked:
                conn.transport.writelines([b"%x\r\n" % len(piece), piece, b"\r\n"])
            else:
                conn.transport.write(piece)
        await conn.drain()

    async def end(self) -> None:
        self.complete = True
        if not self._closed() and self.chunked and not self.conn._head_only:
            self.conn.transport.write(b"0\r\n\r\n")
