"""The channel between an HTTP front-end worker process and the main process.

``--http-workers N`` runs N front-end processes (:mod:`pdserve.app.http_workers`) that
decode HTTP requests and hand them to the main process, which owns the models. Each
worker has one ``AF_UNIX`` socketpair to the main process with :mod:`pdserve.shm` on it:
each side writes tensors into memfd arenas of its own
:class:`~pdserve.shm.pools.ArenaPool`, passes new arenas' descriptors over the socket
(``SCM_RIGHTS``), and the reader makes numpy views of them (no copy); a block goes back
to its writer when the reader's last view is garbage-collected. Tensors under
:data:`SHM_MIN_BYTES` travel inside the frame. Messages queued during one turn of the
event loop go out as one frame (:meth:`Channel.send`; format above the message kinds).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

import numpy as np

from pdserve import shm
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferRequest, InferResponse, RequestedOutput
from pdserve.shm import ArenaControl, Block, NewArena, TensorDesc

log = logging.getLogger("pdserve.workers")

# What one turn of the event loop sends is one frame of
# :func:`pdserve.shm.framing.encode_payload` (4-byte length + one pickle): the
# plain tuple ``(control, [(kind, body), ...])``: ``control`` the arena bookkeeping (new
# arenas, whose descriptors ride with the frame's first byte, and released blocks) or
# None, then the turn's messages in order, each ``kind`` one of the constants below and
# ``body`` a tuple of plain values (requests, responses and errors in the wire forms of
# :func:`request_to_wire`, :func:`response_to_wire`, :func:`error_to_wire`).
#
# =========  =============  ===================================================
# kind       direction      body
# =========  =============  ===================================================
# INIT       main->worker   ``(index, settings, gate_headers, shm_enabled)``
# READY      worker->main   ``(pid,)``: the worker listens
# CALL       worker->main   ``(call_id, method, args)``: a core method (:data:`CALLS`)
# RESULT     main->worker   ``(call_id, value)``
# ERROR      main->worker   ``(call_id, error)``
# INFER      worker->main   ``(call_id, request)``
# RESPONSE   main->worker   ``(call_id, response)``
# STREAM     worker->main   ``(call_id, request)``: ``infer_stream``
# ITEM       main->worker   ``(call_id, response | None, error | None, final, model)``
# CANCEL     worker->main   ``(call_id,)``: the client went away
# LOGS       main->worker   ``(changes,)``: apply these log settings
# DRAIN      main->worker   ``()``: the server is shutting down (``Connection: close``)
# PING       main->worker   ``(seq,)``: the liveness check (every second)
# PONG       worker->main   ``(seq,)``: the answer, from the worker's event loop
# =========  =============  ===================================================
(
    INIT,
    READY,
    CALL,
    RESULT,
    ERROR,
    INFER,
    RESPONSE,
    STREAM,
    ITEM,
    CANCEL,
    LOGS,
    DRAIN,
    PING,
    PONG,
) = range(14)

#: Tensors of at least this many bytes go through shared memory; smaller ones ride
#: inside the frame.
SHM_MIN_BYTES = 16 * 1024

#: The core methods a worker may call with ``CALL`` (nothing else is dispatched).
CALLS = frozenset(
    (
        "live",
        "ready",
        "metadata",
        "model_metadata",
        "model_config",
        "model_ready",
        "model_folders",
        "model_statistics",
        "repository_index",
        "load_model",
        "unload_model",
        "trace_setting",
        "traffic.describe_traffic",
        "traffic.set_traffic",
        "traffic.describe_rollout",
        "traffic.rollout_action",
        "shm.register",
        "shm.unregister",
        "shm.status",
        "logs.update",
        "gate.check",
    )
)

#: InferError attributes the frontends read, carried with an error.
_ERROR_EXTRAS = ("http_headers", "retry_after")

_new = tuple.__new__
_ndarray = np.ndarray

#: numpy kinds written inline by :meth:`Channel.write`'s fast path (not BYTES).
_INLINE_KINDS = frozenset("biufc")

#: ``write(array) -> the plain tuple of its TensorDesc``; ``read(that tuple) -> array``.
WriteTensor = Callable[[np.ndarray], tuple[object, ...]]
ReadTensor = Callable[[tuple[Any, ...]], np.ndarray]


# --------------------------------------------------------------------------- wire forms


def error_to_wire(error: InferError) -> tuple[object, ...]:
    """``(message, code value, reason, extras)`` of an error (extras: the attributes in
    :data:`_ERROR_EXTRAS` it has, e.g. ``retry_after`` of a 429)."""
    extras = {k: getattr(error, k) for k in _ERROR_EXTRAS if hasattr(error, k)}
    return (error.message, error.code.value, error.reason, extras)


def error_from_wire(wire: tuple[Any, ...]) -> InferError:
    """Inverse of :func:`error_to_wire` (an :class:`InferError`; subclasses are not kept)."""
    error = InferError(wire[0], ErrorCode(wire[1]), wire[2])
    for key, value in wire[3].items():
        setattr(error, key, value)
    return error


def request_to_wire(request: InferRequest, write: WriteTensor) -> tuple[object, ...]:
    """The wire form of a request; each input is copied once by ``write`` (a small
    numeric one straight into the frame, as :meth:`Channel.write` does it).

    ``cancelled``, ``trace`` and ``stream`` stay behind (the main process sets its own).
    """
    inputs: dict[str, tuple[object, ...]] = {}
    for name, arr in request.inputs.items():
        dtype = arr.dtype
        if arr.nbytes < SHM_MIN_BYTES and dtype.kind in _INLINE_KINDS and dtype.isnative:
            # Channel.write's fast path, inlined (the hot path: no call per tensor)
            inputs[name] = (dtype.char, arr.shape, arr.tobytes(), -1, 0, 0)
        else:
            inputs[name] = write(arr)
    outputs = request.outputs
    return (
        request.model_name,
        request.model_version,
        inputs,
        None
        if outputs is None
        else [(o.name, o.binary_data, o.classification, o.parameters) for o in outputs],
        request.id,
        request.parameters,
        request.arrival_ns,
        request.route_key,
        request.pinned_version,
        request.traceparent,
        request.shm_inputs,
    )


def request_from_wire(
    wire: tuple[Any, ...], read: ReadTensor, cancelled: Callable[[], bool] | None = None
) -> InferRequest:
    """Inverse of :func:`request_to_wire` (inputs are views of the sender's arenas or
    of the frame's bytes); ``cancelled`` becomes the request's cancellation token."""
    inputs = {}
    for name, desc in wire[2].items():
        inline = desc[2]
        if inline is not None and desc[0] != "BYTES":
            # Channel.read's fast path, inlined: a read-only array over the frame's
            # bytes (a buffer too small for the shape raises TypeError)
            inputs[name] = _ndarray(desc[1], desc[0], inline)
        else:
            inputs[name] = read(desc)
    outputs = wire[3]
    # positional: InferRequest's field order (cheaper than keywords on the hot path)
    return InferRequest(
        wire[0],  # model_name
        wire[1],  # model_version
        inputs,
        None if outputs is None else [RequestedOutput(*o) for o in outputs],
        wire[4],  # id
        wire[5],  # parameters
        wire[6],  # arrival_ns
        cancelled,
        wire[7],  # route_key
        wire[8],  # pinned_version
        wire[9],  # traceparent
        None,  # trace
        wire[10],  # shm_inputs
    )


def response_to_wire(response: InferResponse, write: WriteTensor) -> tuple[object, ...]:
    """The wire form of a response; each output is copied once by ``write`` (a small
    numeric array straight into the frame, as :meth:`Channel.write` does it)."""
    outputs: dict[str, tuple[object, ...]] = {}
    for name, arr in response.outputs.items():
        if type(arr) is not _ndarray:
            arr = np.asarray(arr)
        dtype = arr.dtype
        if arr.nbytes < SHM_MIN_BYTES and dtype.kind in _INLINE_KINDS and dtype.isnative:
            outputs[name] = (dtype.char, arr.shape, arr.tobytes(), -1, 0, 0)
        else:
            outputs[name] = write(arr)
    return (response.model_name, response.model_version, outputs, response.id, response.parameters)


def response_from_wire(wire: tuple[Any, ...], read: ReadTensor) -> InferResponse:
    """Inverse of :func:`response_to_wire` (outputs are views of the sender's arenas
    or of the frame's bytes)."""
    outputs = {}
    for name, desc in wire[2].items():
        inline = desc[2]
        if inline is not None and desc[0] != "BYTES":
            outputs[name] = _ndarray(desc[1], desc[0], inline)  # Channel.read's fast path
        else:
            outputs[name] = read(desc)
    return InferResponse(wire[0], wire[1], outputs, wire[3], wire[4])


def control_to_wire(control: ArenaControl | None) -> tuple[object, ...] | None:
    """The plain form of a frame's arena bookkeeping."""
    if control is None:
        return None
    return ([tuple(a) for a in control.new_arenas], [tuple(b) for b in control.releases])


def control_from_wire(wire: tuple[Any, ...] | None) -> ArenaControl | None:
    """Inverse of :func:`control_to_wire`."""
    if wire is None:
        return None
    return ArenaControl([_new(NewArena, a) for a in wire[0]], [_new(Block, b) for b in wire[1]])


# --------------------------------------------------------------------------- endpoint


class Channel:
    """One end of a worker's socketpair on the running event loop.

    The framing, write queue, reading and both directions' arenas are the python
    backend's :class:`~pdserve.shm.framing.FramedSocket` (:attr:`link`); this
    class adds the coalescing of a loop turn's messages into one frame and the
    dispatch of received messages.

    Args:
        sock: the connected ``AF_UNIX`` stream socket (made non-blocking here).
        label: names this end's arenas (``/proc/<pid>/fd`` shows ``pdserve:<label>.<n>``).
        on_frame: ``on_frame(kind, body)`` for every message received, in order (arena
            bookkeeping already applied). An exception it raises is logged.
        on_close: called once when the peer is gone (end of file or a socket error).
        on_messages: if given, called instead of ``on_frame`` with each received
            frame's whole message list ``[(kind, body), ...]`` (the main process's hub
            walks a frame's requests in one loop); it must log its own errors (one
            that escapes is logged and the frame's later messages are lost).
    """

    def __init__(
        self,
        sock: socket.socket,
        label: str,
        on_frame: Callable[[int, tuple[Any, ...]], None],
        on_close: Callable[[], None],
        on_messages: Callable[[list[tuple[int, tuple[Any, ...]]]], None] | None = None,
    ) -> None:
        self.on_frame = on_frame
        self.on_messages = on_messages
        self.on_close = on_close
        self.link = shm.FramedSocket(sock, label, self._on_payloads, self._closed)
        self.loop = self.link.loop
        self.pool = self.link.pool
        self.peer = self.link.peer
        self.frames = self.link.frames
        self._pending: list[tuple[int, tuple[object, ...]]] = []  # messages of this loop turn
        self._flush_scheduled = False

    @property
    def sock(self) -> socket.socket:
        """The socket (the link's)."""
        return self.link.sock

    @sock.setter
    def sock(self, value: socket.socket) -> None:
        self.link.sock = value

    @property
    def closed(self) -> bool:
        """True once the peer is gone or :meth:`close` ran."""
        return self.link.closed

    # -- tensors ----------------------------------------------------------------------

    def _alloc(self, nbytes: int) -> tuple[shm.Arena, int] | None:
        return self.pool.alloc(nbytes) if nbytes >= SHM_MIN_BYTES else None

    def write(self, arr: np.ndarray) -> tuple[object, ...]:
        """Describe ``arr`` for the peer (a :class:`TensorDesc` as a plain tuple): copied
        once into this end's arena, or inline when it is under :data:`SHM_MIN_BYTES`
        (or the pool is full)."""
        dtype = arr.dtype
        if arr.nbytes < SHM_MIN_BYTES and dtype.kind in _INLINE_KINDS and dtype.isnative:
            # the common small numeric tensor, without the general path's records; its
            # dtype as the one-letter code (both ends run on this machine: 6x cheaper
            # than ``dtype.str``, which formats a string on every call)
            return (dtype.char, arr.shape, arr.tobytes(), -1, 0, 0)
        return tuple(shm.write_tensor(arr, self._alloc))

    def read(self, desc: tuple[Any, ...]) -> np.ndarray:
        """The array a :meth:`write` tuple names: a read-only view of the peer's arena
        (its block goes back once the last view is gone) or of the frame's bytes."""
        inline = desc[2]
        if inline is not None and desc[0] != "BYTES":
            # a read-only array over the frame's bytes (half the cost of
            # frombuffer + reshape; a buffer too small for the shape raises TypeError)
            return _ndarray(desc[1], desc[0], inline)
        return self.peer.read(_new(TensorDesc, desc), release=True)

    # -- sending ----------------------------------------------------------------------

    def send(self, kind: int, body: tuple[object, ...]) -> None:
        """Queue one message; it goes out in one frame with the others of this loop
        turn. New arenas and the peer's released blocks ride along. Nothing happens
        once closed."""
        if self.link.closed:
            return
        self._pending.append((kind, body))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._end_of_turn)

    def _end_of_turn(self) -> None:
        self._flush_scheduled = False
        if self.link.closed or not self._pending:
            return
        messages, self._pending = self._pending, []
        # one pickle for the turn's messages, with the arena bookkeeping once (new
        # arenas come before the messages that use them: the reader applies it first)
        self.link.send(lambda control: shm.encode_payload((control_to_wire(control), messages)))

    # -- receiving --------------------------------------------------------------------

    def _on_payloads(self, payloads: list[Any]) -> None:
        on_frame = self.on_frame
        on_messages = self.on_messages
        for control, messages in payloads:
            if control is not None:
                try:
                    shm.apply_control(control_from_wire(control), self.frames, self.peer, self.pool)
                except Exception:
                    log.exception("%s: bad arena control from the peer", self.pool.label)
            if on_messages is not None:
                try:
                    on_messages(messages)
                except Exception:
                    log.exception("%s: bad frame from the peer", self.pool.label)
                continue
            for kind, body in messages:
                try:
                    on_frame(kind, body)
                except Exception:
                    log.exception("%s: bad frame from the peer", self.pool.label)

    def _closed(self) -> None:
        try:
            self.on_close()
        finally:
            self.close()

    def close(self) -> None:
        """Close the socket and drop both ends' arenas (views keep their memory)."""
        self._pending = []
        self.link.close()
