"""The HTTP front-end worker process's stand-ins for the core, the gate and the
shared-memory registry, so the worker runs the same
:class:`~pdserve.frontends.http.app.HttpApp` as a single-process server:

- :class:`ProxyCore`: every :class:`~pdserve.core.api.InferenceCore` method, forwarded to
  the main process over the worker's channel (:mod:`.channel`); a request's cancel token
  firing sends ``CANCEL``.
- :class:`ProxyGate`: auth, restricted APIs and rate limits are checked in the main
  process, so a key's rate limit counts every worker's requests as one process would.
- :class:`ProxySharedMemory`: the registry lives in the main process; a request that
  names a region runs there, whichever worker registered it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from pdserve.core.cancel import CancelToken
from pdserve.core.errors import InferError, unavailable
from pdserve.core.streaming import StreamResponse
from pdserve.core.types import InferRequest, InferResponse
from pdserve.frontends.shared_memory import SharedMemoryRegistry
from pdserve.frontends.traffic.auth import Principal
from pdserve.frontends.traffic.gate import TrafficGate, principal_name
from pdserve.frontends.workers import channel as ch
from pdserve.observability import logs

log = logging.getLogger("pdserve.workers")


def _gone() -> InferError:
    return unavailable("the server's main process is gone")


class WorkerClient:
    """The worker's end of the channel: call ids, and the futures / queues they answer."""

    def __init__(self) -> None:
        self.channel: ch.Channel | None = None
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[tuple[int, tuple[Any, ...]]]] = {}
        #: call id -> (the request's token, its callback) of an INFER in flight whose
        #: token's cancellation sends ``CANCEL`` (removed when the answer arrives)
        self._watched: dict[int, tuple[CancelToken, Callable[[CancelToken], None]]] = {}
        #: set by ``INIT``: (worker index, Settings, gate header names, shm enabled)
        self.init: asyncio.Future[tuple[Any, ...]] | None = None
        #: set when the main process says the server is shutting down
        self.draining = False
        self.gone = False
        #: set once the main process is gone
        self.closed: asyncio.Event | None = None

    def connect(self, channel_factory: Callable[..., ch.Channel]) -> ch.Channel:
        """Build the channel with this client's frame handlers."""
        self.init = asyncio.get_running_loop().create_future()
        self.closed = asyncio.Event()
        self.channel = channel_factory(self.on_frame, self.on_close)
        self.channel.on_messages = self.on_messages  # a frame's answers in one call
        return self.channel

    def on_messages(self, messages: list[tuple[int, tuple[Any, ...]]]) -> None:
        """One received frame's messages, in order: ``RESPONSE`` (the hot path) is
        answered here, the others go to :meth:`on_frame`. A bad message is logged; the
        others carry on."""
        calls = self._calls
        watched = self._watched
        for kind, body in messages:
            try:
                if kind == ch.RESPONSE:
                    call_id = body[0]
                    fut = calls.pop(call_id, None)
                    if watched:
                        held = watched.pop(call_id, None)
                        if held is not None:
                            held[0].remove_callback(held[1])
                    if fut is not None and not fut.done():
                        assert self.channel is not None
                        fut.set_result(ch.response_from_wire(body[1], self.channel.read))
                else:
                    self.on_frame(kind, body)
            except Exception:
                log.exception("HTTP worker: bad frame from the main process")

    def on_frame(self, kind: int, body: tuple[Any, ...]) -> None:
        """Dispatch one frame from the main process."""
        if kind == ch.RESPONSE or kind == ch.RESULT or kind == ch.ERROR:
            call_id = body[0]
            fut = self._calls.pop(call_id, None)
            if self._watched:
                watched = self._watched.pop(call_id, None)
                if watched is not None:
                    watched[0].remove_callback(watched[1])
            if fut is None:
                queue = self._streams.get(call_id)
                if queue is not None and kind == ch.ERROR:
                    queue.put_nowait((kind, body))
                return
            if fut.done():
                return
            if kind == ch.RESPONSE:
                assert self.channel is not None
                fut.set_result(ch.response_from_wire(body[1], self.channel.read))
            elif kind == ch.RESULT:
                fut.set_result(body[1])
            else:
                fut.set_exception(ch.error_from_wire(body[1]))
        elif kind == ch.ITEM:
            queue = self._streams.get(body[0])
            if queue is not None:
                queue.put_nowait((kind, body))
        elif kind == ch.LOGS:
            logs.update_settings(body[0])
        elif kind == ch.DRAIN:
            self.draining = True
        elif kind == ch.PING:  # the liveness check: answered from this event loop
            assert self.channel is not None
            self.channel.send(ch.PONG, body)
        elif kind == ch.INIT:
            if self.init is not None and not self.init.done():
                self.init.set_result(body)

    def on_close(self) -> None:
        """The main process is gone: every call in flight fails (the worker exits)."""
        self.gone = True
        if self.closed is not None:
            self.closed.set()
        calls, self._calls = self._calls, {}
        watched, self._watched = self._watched, {}
        for token, callback in watched.values():
            token.remove_callback(callback)
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(_gone())
        for queue in self._streams.values():
            queue.put_nowait((ch.ERROR, (0, ch.error_to_wire(_gone()))))
        if self.init is not None and not self.init.done():
            self.init.set_exception(ConnectionError("the main process closed the channel"))

    def _channel(self) -> ch.Channel:
        if self.gone or self.channel is None:
            raise _gone()
        return self.channel

    def request(
        self, kind: int, body_of: Callable[[int], tuple[object, ...]]
    ) -> tuple[int, asyncio.Future[Any]]:
        """Send a frame that expects one answer: ``(call id, future)``."""
        channel = self._channel()
        call_id = next(self._ids)
        fut = channel.loop.create_future()
        self._calls[call_id] = fut
        try:
            channel.send(kind, body_of(call_id))
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        return call_id, fut

    async def call(self, method: str, *args: object) -> Any:
        """Run core method ``method`` (one of :data:`~.channel.CALLS`) in the main process.

        Raises:
            InferError: what the method raised there; UNAVAILABLE when the main
                process is gone.
        """
        _, fut = self.request(ch.CALL, lambda cid: (cid, method, args))
        return await fut

    def cancel(self, call_id: int) -> None:
        """Tell the main process that call ``call_id``'s client went away."""
        if not self.gone and self.channel is not None:
            self.channel.send(ch.CANCEL, (call_id,))

    def open_stream(
        self, request: InferRequest
    ) -> tuple[int, asyncio.Queue[tuple[int, tuple[Any, ...]]]]:
        """Start ``infer_stream`` in the main process: ``(call id, queue of frames)``."""
        channel = self._channel()
        call_id = next(self._ids)
        queue: asyncio.Queue[tuple[int, tuple[Any, ...]]] = asyncio.Queue()
        self._streams[call_id] = queue
        channel.send(ch.STREAM, (call_id, ch.request_to_wire(request, channel.write)))
        return call_id, queue

    def close_stream(self, call_id: int) -> None:
        """Forget a stream (its consumer stopped)."""
        self._streams.pop(call_id, None)


class ProxyCore:
    """An :class:`~pdserve.core.api.InferenceCore` whose work happens in the main
    process (see the module docstring). Health, metadata and statistics methods are
    coroutines here (the HTTP app awaits whatever a core returns)."""

    def __init__(self, client: WorkerClient) -> None:
        self.client = client
        self.traffic = _ProxyTraffic(client)

    @property
    def started(self) -> bool:
        """The worker serves once the main process has started it."""
        return True

    async def live(self) -> bool:
        """Liveness, as the main process answers it."""
        return bool(await self.client.call("live"))

    async def ready(self) -> bool:
        """Readiness, as the main process answers it."""
        return bool(await self.client.call("ready"))

    async def metadata(self) -> dict[str, object]:
        """Server metadata."""
        return dict(await self.client.call("metadata"))

    async def model_metadata(self, name: str, version: str = "") -> dict[str, object]:
        """Model metadata (raises as the core does)."""
        return dict(await self.client.call("model_metadata", name, version))

    async def model_config(self, name: str, version: str = "") -> dict[str, object]:
        """Model configuration (raises as the core does)."""
        return dict(await self.client.call("model_config", name, version))

    async def model_ready(self, name: str, version: str = "") -> bool:
        """Model readiness."""
        return bool(await self.client.call("model_ready", name, version))

    async def model_folders(self, name: str, version: str = "") -> list[str]:
        """The served version's folder and model folder (same machine: the worker
        reads files there itself)."""
        return list(await self.client.call("model_folders", name, version))

    async def model_statistics(self, name: str = "", version: str = "") -> dict[str, object]:
        """Statistics, kept (once) in the main process."""
        return dict(await self.client.call("model_statistics", name, version))

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, object]]:
        """The repository index."""
        return list(await self.client.call("repository_index", ready_only))

    async def load_model(
        self, name: str, config: object = None, files: dict[str, bytes] | None = None
    ) -> None:
        """Load a model in the main process."""
        await self.client.call("load_model", name, config, files)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Unload a model in the main process."""
        await self.client.call("unload_model", name, unload_dependents)

    async def trace_setting(
        self, model: str, update: Mapping[str, object] | None
    ) -> dict[str, str | list[str]]:
        """Triton's trace settings (kept in the main process)."""
        return await self.client.call("trace_setting", model, update)

    async def log_settings(self, update: Mapping[str, object] | None) -> dict[str, object]:
        """The log settings; an update is applied in the main process and every worker."""
        if update is None:
            return logs.settings_dict()
        return dict(await self.client.call("logs.update", update))

    def infer(self, request: InferRequest) -> asyncio.Future[InferResponse]:
        """Run ``request`` in the main process; its inputs are copied once into this
        worker's arena (or ride inline when small).

        Returns the call's future itself (an awaitable, no coroutine level per
        request): its result is the response. While the call is in flight a
        cancellation of the request's :class:`~pdserve.core.cancel.CancelToken` (the
        client went away) sends ``CANCEL``; the callback is removed when the answer
        arrives (:meth:`WorkerClient.on_frame`).

        Raises:
            InferError: (from awaiting the future) what the core raised; UNAVAILABLE
                when the main process is gone (also at once, before anything is sent).
        """
        client = self.client
        channel = client.channel
        if client.gone or channel is None:
            raise _gone()
        # WorkerClient.request inlined (the hot path: no closure per request)
        call_id = next(client._ids)
        fut: asyncio.Future[InferResponse] = channel.loop.create_future()
        client._calls[call_id] = fut
        try:
            channel.send(ch.INFER, (call_id, ch.request_to_wire(request, channel.write)))
        except BaseException:
            client._calls.pop(call_id, None)
            raise
        token = request.cancelled
        if isinstance(token, CancelToken):
            # the client going away sends CANCEL until the answer arrives (on_frame
            # then drops this callback)
            def on_cancel(_t: CancelToken) -> None:
                if client._watched.pop(call_id, None) is not None:
                    client.cancel(call_id)

            client._watched[call_id] = (token, on_cancel)
            token.add_callback(on_cancel)
        return fut

    async def infer_stream(self, request: InferRequest) -> AsyncGenerator[StreamResponse, None]:
        """``infer_stream`` in the main process; closing the generator (the client went
        away) cancels it there."""
        client = self.client
        call_id, queue = client.open_stream(request)
        finished = False
        try:
            while True:
                kind, body = await queue.get()
                if kind == ch.ERROR:
                    finished = True
                    raise ch.error_from_wire(body[1])
                _, wire, error, final, model = body
                assert client.channel is not None
                response = (
                    None if wire is None else ch.response_from_wire(wire, client.channel.read)
                )
                item = StreamResponse(
                    response, None if error is None else ch.error_from_wire(error), final, model
                )
                if final:
                    finished = True
                yield item
                if final:
                    return
        finally:
            client.close_stream(call_id)
            if not finished:
                client.cancel(call_id)


class _ProxyTraffic:
    """Traffic control's admin calls (``/v2/models/{m}/traffic|rollout``), in the main
    process."""

    def __init__(self, client: WorkerClient) -> None:
        self.client = client

    async def describe_traffic(self, model: str) -> dict[str, object]:
        return await self.client.call("traffic.describe_traffic", model)

    async def set_traffic(self, model: str, doc: object) -> dict[str, object]:
        return await self.client.call("traffic.set_traffic", model, doc)

    async def describe_rollout(self, model: str) -> dict[str, object]:
        return await self.client.call("traffic.describe_rollout", model)

    async def rollout_action(self, model: str, doc: object) -> dict[str, object]:
        return await self.client.call("traffic.rollout_action", model, doc)


class ProxyGate(TrafficGate):
    """The gate of a worker: each check runs in the main process (see the module
    docstring). ``header_names``: the request headers the main gate may read (the
    credentials' and the restricted APIs' headers), sent along with the check."""

    def __init__(self, client: WorkerClient, header_names: list[str]) -> None:
        super().__init__()
        self.client = client
        self.header_names = list(header_names)

    @property
    def active(self) -> bool:
        """Always: a worker gets a ProxyGate only when the main process has a gate."""
        return True

    async def check(
        self,
        protocol: str,
        category: str,
        model: str,
        header: Callable[[str], str | None],
    ) -> Principal:
        """Admit one request or raise what the main gate raised (401, 403, 429...).

        Returns the principal as the main gate found it: its name and the models it
        may use (its API grants were checked there and are left empty here)."""
        headers = {}
        for name in self.header_names:
            value = header(name)
            if value is not None:
                headers[name] = value
        name, models, kind = await self.client.call(
            "gate.check", protocol, category, model, headers
        )
        if name is not None:
            principal_name.set(name)
        return Principal(name=name or "", models=tuple(models), apis=frozenset(), kind=kind)


class ProxySharedMemory(SharedMemoryRegistry):
    """The system shared-memory registry of a worker: a view of the main process's
    (see the module docstring). The control calls are coroutines here (the HTTP app
    awaits whatever they return); :attr:`delegate_infer` runs requests that name
    regions in the main process."""

    def __init__(self, client: WorkerClient, core: ProxyCore, enabled: bool) -> None:
        super().__init__(enabled=enabled)
        self.client = client
        self.core = core
        self.delegate_infer = self._delegate

    async def _delegate(
        self, request: InferRequest, shm_outputs: frozenset[str] | None
    ) -> InferResponse:
        return await self.core.infer(request)  # the main process reads/writes the regions

    def register(  # type: ignore[override]  # awaitable: the HTTP app awaits it
        self, name: str, key: object, offset: object, byte_size: object
    ) -> Awaitable[None]:
        """Register in the main process."""
        return self.client.call("shm.register", name, key, offset, byte_size)

    def unregister(self, name: str = "") -> Awaitable[None]:  # type: ignore[override]  # awaited
        """Unregister in the main process."""
        return self.client.call("shm.unregister", name)

    def status(  # type: ignore[override]  # awaitable: the HTTP app awaits it
        self, name: str = ""
    ) -> Awaitable[list[dict[str, object]]]:
        """The main process's regions."""
        return self.client.call("shm.status", name)

    def close(self) -> None:
        """Nothing is held here."""
