"""The main process's side of the HTTP front-end workers' channels (:class:`FrontendHub`):
every worker's frames (:mod:`.channel`) are answered against the one core, so models,
batching, statistics, metrics, the response cache, the shared-memory registry, traffic
control and the gate stay in one place and count each request once.

- ``INFER``: the request (inputs are views of the worker's arena) runs through
  ``server.infer`` (or the shared-memory registry), with a cancel token that the
  worker's ``CANCEL`` fires.
- ``STREAM``: ``server.infer_stream``, each item sent back as ``ITEM``.
- ``CALL``: one of :data:`~.channel.CALLS`; a log-settings change is applied here and
  sent to every worker (``LOGS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from pdserve.core.api import InferenceCore
from pdserve.core.cancel import CancelToken
from pdserve.core.errors import InferError, client_gone, internal, not_found
from pdserve.core.types import InferRequest, InferResponse
from pdserve.frontends.shared_memory import (
    SharedMemoryRegistry,
    infer_with_shm,
    shm_output_names,
)
from pdserve.frontends.traffic.gate import TrafficGate, principal_name
from pdserve.frontends.workers import channel as ch
from pdserve.observability import logs

log = logging.getLogger("pdserve.workers")


class WorkerLink:
    """One worker's channel in the main process, with its calls in flight."""

    def __init__(self, hub: FrontendHub, index: int) -> None:
        self.hub = hub
        #: set by :meth:`FrontendHub.attach` once the channel is built
        self.channel: ch.Channel = None  # type: ignore[assignment]  # set right after
        self.index = index
        #: call id -> the token of an INFER in flight
        self.tokens: dict[int, CancelToken] = {}
        #: call id -> the task of a STREAM in flight (closed on CANCEL or the worker's death)
        self.streams: dict[int, asyncio.Task[None]] = {}
        #: the tasks of CALLs in flight (a load or unload runs to its end even when the
        #: worker that asked dies, as it does when an HTTP client goes away)
        self.calls: set[asyncio.Task[None]] = set()
        #: the worker's pid once it listens (its ``READY``)
        self.ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        #: ``time.monotonic()`` of the worker's last ``PONG`` (its attach until the first)
        self.last_pong = time.monotonic()


class FrontendHub:
    """Serves the front-end workers' channels against ``server``.

    Args:
        server: the core (:class:`~pdserve.core.api.InferenceCore`).
        shared_memory: the system shared-memory registry (shared with gRPC).
        gate: the auth / rate-limit gate, or None: a worker's ``gate.check`` is then
            refused (it never asks without one).
    """

    def __init__(
        self,
        server: InferenceCore,
        shared_memory: SharedMemoryRegistry,
        gate: TrafficGate | None = None,
    ) -> None:
        self.server = server
        self.shm = shared_memory
        self.gate = gate
        self.links: set[WorkerLink] = set()
        self._infer = server.infer

    def attach(self, sock: socket.socket, index: int, on_close: Callable[[], None]) -> WorkerLink:
        """Serve the main process's end of worker ``index``'s socketpair."""
        link = WorkerLink(self, index)

        def closed() -> None:
            self._gone(link)
            on_close()

        # a frame's messages go to _on_messages(link, messages) in one call (C
        # partials: no Python closure level per frame or message)
        link.channel = ch.Channel(
            sock,
            f"http-worker{index}.out",
            functools.partial(self._on_frame, link),
            closed,
            functools.partial(self._on_messages, link),
        )
        self.links.add(link)
        return link

    def broadcast(self, kind: int, body: tuple[object, ...]) -> None:
        """Send one frame to every worker."""
        for link in self.links:
            link.channel.send(kind, body)

    def _gone(self, link: WorkerLink) -> None:
        """The worker died: its clients are gone; cancel what it asked for."""
        self.links.discard(link)
        if not link.ready.done():
            link.ready.set_exception(ConnectionError("the worker exited while starting"))
            link.ready.exception()  # only a caller that waits on it cares
        for token in list(link.tokens.values()):
            token.cancel(client_gone("the HTTP front-end worker of this request exited"))
        for task in list(link.streams.values()):
            task.cancel()

    # -- frames -----------------------------------------------------------------------

    def _on_messages(self, link: WorkerLink, messages: list[tuple[int, tuple[Any, ...]]]) -> None:
        """One received frame's messages, in order: its ``INFER`` requests are rebuilt
        and started here in one loop (the hot path), the others go to
        :meth:`_on_frame`. A bad message is logged; the others carry on."""
        channel = link.channel
        loop = channel.loop
        read = channel.read
        tokens = link.tokens
        start = self._start_infer
        infer = self._infer
        answer = self._answer
        partial = functools.partial
        from_wire = ch.request_from_wire
        for kind, body in messages:
            try:
                if kind == ch.INFER:
                    call_id = body[0]
                    # with its loop known, run_cancellable's task lookup is a dict
                    # lookup (no getpid() system call on 3.11)
                    token = CancelToken(None, loop)
                    request = from_wire(body[1], read, token)
                    tokens[call_id] = token
                    if request.shm_inputs is None and not request.outputs:
                        # _start_infer's common case in line: no shared memory to read
                        # or write, so the server's coroutine is the task
                        task = loop.create_task(infer(request))
                        task.add_done_callback(partial(answer, link, call_id))
                    else:
                        start(link, call_id, request)
                else:
                    self._on_frame(link, kind, body)
            except Exception:
                log.exception("HTTP worker %d: bad frame from the worker", link.index)

    def _on_frame(self, link: WorkerLink, kind: int, body: tuple[Any, ...]) -> None:
        """A message other than ``INFER`` (those :meth:`_on_messages` starts itself)."""
        if kind == ch.INFER:
            self._on_messages(link, [(kind, body)])
        elif kind == ch.CANCEL:
            call_id = body[0]
            held = link.tokens.get(call_id)
            if held is not None:
                held.cancel(client_gone())
            task = link.streams.get(call_id)
            if task is not None:
                task.cancel()
        elif kind == ch.STREAM:
            call_id = body[0]
            request = ch.request_from_wire(body[1], link.channel.read)
            stream = link.channel.loop.create_task(self._run_stream(link, call_id, request))
            link.streams[call_id] = stream
            stream.add_done_callback(lambda _t: link.streams.pop(call_id, None))
        elif kind == ch.CALL:
            call_id, method, args = body
            call = link.channel.loop.create_task(self._run_call(link, call_id, method, args))
            link.calls.add(call)
            call.add_done_callback(link.calls.discard)
        elif kind == ch.PONG:
            link.last_pong = time.monotonic()
        elif kind == ch.READY:
            if not link.ready.done():
                link.ready.set_result(body[0])
        else:
            log.error("HTTP worker %d: unexpected frame kind %r", link.index, kind)

    def _start_infer(self, link: WorkerLink, call_id: int, request: InferRequest) -> None:
        """Run one ``INFER`` as a task of the server's own coroutine (no wrapping
        coroutine level); :meth:`_answer` sends its outcome."""
        try:
            if request.shm_inputs is None and (
                not request.outputs or shm_output_names(request) is None
            ):
                coro = self._infer(request)
            else:  # Triton's system shared-memory extension, on the main registry
                coro = infer_with_shm(self.shm, request, self._infer, shm_output_names(request))
        except Exception as exc:  # noqa: BLE001 - answered; the hub carries on
            link.tokens.pop(call_id, None)
            self._send_error(link, call_id, exc)
            return
        task = link.channel.loop.create_task(coro)
        task.add_done_callback(functools.partial(self._answer, link, call_id))

    def _answer(self, link: WorkerLink, call_id: int, task: asyncio.Task[InferResponse]) -> None:
        """Send an ``INFER``'s outcome: ``RESPONSE``, or ``ERROR`` (nothing when the
        task was cancelled, which happens only when the event loop stops)."""
        link.tokens.pop(call_id, None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            channel = link.channel
            try:
                wire = ch.response_to_wire(task.result(), channel.write)
            except Exception as e:  # noqa: BLE001 - e.g. an output the channel cannot carry
                exc = e
            else:
                channel.send(ch.RESPONSE, (call_id, wire))
                return
        self._send_error(link, call_id, exc)

    def _send_error(self, link: WorkerLink, call_id: int, exc: BaseException) -> None:
        """Answer call ``call_id`` with ``exc``: an :class:`InferError` as it is,
        anything else logged and sent as ``INTERNAL``."""
        if not isinstance(exc, InferError):
            log.error("HTTP worker %d: inference failed", link.index, exc_info=exc)
            exc = internal(f"{exc}")
        link.channel.send(ch.ERROR, (call_id, ch.error_to_wire(exc)))

    async def _run_stream(self, link: WorkerLink, call_id: int, request: InferRequest) -> None:
        channel = link.channel
        try:
            async with contextlib.aclosing(self.server.infer_stream(request)) as items:
                async for item in items:
                    response = item.response
                    channel.send(
                        ch.ITEM,
                        (
                            call_id,
                            None
                            if response is None
                            else ch.response_to_wire(response, channel.write),
                            None if item.error is None else ch.error_to_wire(item.error),
                            item.final,
                            item.model,
                        ),
                    )
        except InferError as exc:
            channel.send(ch.ERROR, (call_id, ch.error_to_wire(exc)))
        except Exception as exc:  # noqa: BLE001
            log.exception("HTTP worker %d: streaming inference failed", link.index)
            channel.send(ch.ERROR, (call_id, ch.error_to_wire(internal(f"{exc}"))))

    async def _run_call(
        self, link: WorkerLink, call_id: int, method: str, args: Iterable[object]
    ) -> None:
        channel = link.channel
        try:
            if method not in ch.CALLS:
                raise not_found(f"no such call: {method}")
            value = await self._call(method, tuple(args))
            channel.send(ch.RESULT, (call_id, value))
        except InferError as exc:
            channel.send(ch.ERROR, (call_id, ch.error_to_wire(exc)))
        except Exception as exc:  # noqa: BLE001
            log.exception("HTTP worker %d: %s failed", link.index, method)
            channel.send(ch.ERROR, (call_id, ch.error_to_wire(internal(f"{exc}"))))

    async def _call(self, method: str, args: tuple[Any, ...]) -> object:
        if method == "gate.check":
            if self.gate is None:
                raise not_found("this server has no gate")
            protocol, category, model, headers = args
            principal = await self.gate.check(protocol, category, model, headers.get)
            # the name (None: no credential checked), the model grants and the kind,
            # so the worker's principal filters a model list as this process's would
            return principal_name.get(), tuple(principal.models), principal.kind
        if method == "logs.update":
            settings = logs.update_settings(args[0])
            self.broadcast(ch.LOGS, (args[0],))
            return settings
        if method.startswith("shm."):
            func = getattr(self.shm, method[4:])
        elif method.startswith("traffic."):
            control = getattr(self.server, "traffic", None)
            if control is None:
                raise not_found("this server does not support traffic control")
            func = getattr(control, method[8:])
        else:
            func = getattr(self.server, method, None)
            if func is None:
                raise not_found(f"this server does not support {method}")
        result = func(*args)
        if inspect.isawaitable(result):
            result = await result
        return result
