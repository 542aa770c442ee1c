"""The python worker process: runs one instance of a Triton python model.

Started by :mod:`pdserve.backends.python.launch`, it talks to the server over one
``AF_UNIX`` socket with the frames of :mod:`pdserve.backends.python.messages`; tensors
live in shared-memory arenas (:mod:`pdserve.shm`). In ``"serve"`` mode it imports
``model.py``, runs ``initialize``, then ``execute`` on each batch (the whole list at
once, as Triton does) and ``finalize`` at :class:`~messages.Stop`; end of file on the
socket (the server is gone) exits at once. ``"autocomplete"`` mode runs the static
``auto_complete_config`` and answers :class:`~messages.AutoCompleteResult`.

There is no reader thread: whichever thread waits reads the socket
(:meth:`Worker.wait_until`): the idle main thread, a thread blocked in a BLS ``exec()``,
or the event loop of an ``async def execute``. A BLS call sends a
:class:`~messages.Bls` and waits for its :class:`~messages.BlsResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import inspect
import itertools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from pdserve import shm
from pdserve.backends.python import lifetime
from pdserve.backends.python import triton_python_backend_utils as pb
from pdserve.backends.python.messages import (
    AutoCompleteResult,
    Bls,
    BlsResult,
    Cancel,
    CancelStream,
    Error,
    Exec,
    Frame,
    InitError,
    Message,
    Ready,
    ReadyCheck,
    ReadyState,
    Respond,
    Result,
    Stop,
    WorkerInit,
    read_frames,
    send_frame,
)
from pdserve.shm import Block, TensorDesc

log = logging.getLogger("pdserve.python_worker")
_T = TypeVar("_T")


class LogContext(logging.Filter):
    """Adds the model and the running batch's request ids and trace id to every log
    line of the worker (the model's own ``pb_utils.Logger`` / ``logging`` lines too):
    ``[model=M request_id=a,b trace_id=T]`` as the server's text format; ``-`` for a
    request without an id, no trace id for untraced requests."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model
        self.suffix = f" [model={model}]"

    def begin(self, batch: Exec) -> None:
        """A batch starts: its requests' ids (and the first trace id) name the lines."""
        ids = ",".join(r.id or "-" for r in batch.requests)
        suffix = f" [model={self.model} request_id={ids}"
        for r in batch.requests:
            if r.trace:  # traceparent "00-<trace id>-<span id>-<flags>"
                suffix += f" trace_id={r.trace.split('-')[1]}"
                break
        self.suffix = suffix + "]"

    def end(self) -> None:
        """The batch is answered."""
        self.suffix = f" [model={self.model}]"

    def filter(self, record: logging.LogRecord) -> bool:
        """Set ``record.ids`` (the suffix)."""
        record.ids = self.suffix
        return True


#: The worker's log context (set up by :func:`worker_main`; None in other processes).
log_context: LogContext | None = None


def _format_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def load_model_module(model_file: str, version_dir: str, model_dir: str) -> ModuleType:
    """Import ``model.py`` the way Triton's stub does, with pb_utils importable.

    Raises:
        Exception: whatever importing the file raises.
    """
    pb.install()
    for path in (model_dir, version_dir):
        if path not in sys.path:
            sys.path.insert(0, path)
    spec = importlib.util.spec_from_file_location("model", model_file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {model_file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["model"] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "TritonPythonModel"):
        raise AttributeError(f"{model_file} does not define class TritonPythonModel")
    return module


class Worker:
    """One worker's side of the channel: arenas, sending, receiving, BLS."""

    def __init__(self, sock: socket.socket, init: WorkerInit) -> None:
        self.sock = sock
        self.init = init
        self.instance_name = init.instance_name
        self.pool = shm.ArenaPool(f"{self.instance_name}.out")
        self.peer = shm.PeerArenas()
        self.frames = shm.FrameReader()
        #: Messages for the main thread; None: end of file (the server is gone).
        self.inbox: deque[Exec | Stop | ReadyCheck | None] = deque()
        self._cond = threading.Condition()
        self._reading = False
        self.send_lock = threading.Lock()
        self.calls = itertools.count()
        self.bls_pending: dict[int, Future[pb.InferenceResponse]] = {}
        #: ``exec(decoupled=True)`` calls: call id -> their iterator.
        self.bls_streams: dict[int, BlsResponses] = {}
        self.stopping = False
        self.eof = False
        self.loop: asyncio.AbstractEventLoop | None = None
        #: (batch id, index) of the requests the server cancelled (:class:`Cancel`).
        self.cancelled: set[tuple[int, int]] = set()
        #: ``model_transaction_policy { decoupled: true }``: requests get response senders.
        self.decoupled = _is_decoupled(init.model_config)
        #: Decoupled requests whose final flag is not sent yet: (batch id, index) ->
        #: True once the server cancelled it (:class:`~messages.CancelStream`).
        self.streams: dict[tuple[int, int], bool] = {}
        self.streams_lock = threading.Lock()

    # -- channel ----------------------------------------------------------------

    def send(self, message: Message) -> None:
        """Send one message; new arenas and released peer blocks ride along."""
        with self.send_lock:
            control, arenas = shm.outgoing_control(self.pool, self.peer)
            send_frame(self.sock, message, control, [a.fd for a in arenas])
            self.pool.sent(arenas)

    def write(self, array: np.ndarray) -> TensorDesc:
        """Copy an output / BLS input into this worker's pool (one copy)."""
        return shm.write_tensor(array, self.pool.alloc)

    # -- receiving: whichever thread waits reads (no reader thread, no hand-off) --

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Block until ``done()``, reading and dispatching frames meanwhile.

        One waiting thread at a time reads the socket (the idle main thread, or a
        thread blocked in a BLS ``exec()``); the others sleep until a frame it
        dispatched may concern them. So an ``exec`` frame reaches the main thread
        without a thread switch.
        """
        while True:
            with self._cond:
                while not done() and self._reading:
                    self._cond.wait()
                if done():
                    return
                if self.eof:
                    raise pb.TritonModelException("the server closed the connection")
                self._reading = True
            try:
                self._read_once(blocking=True)
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()

    def next_message(self) -> Exec | Stop | ReadyCheck | None:
        """The next :class:`Exec`, :class:`ReadyCheck` or :class:`Stop` for the main
        thread; None: end of file."""
        if self.eof and not self.inbox:
            return None
        self.wait_until(lambda: bool(self.inbox))
        return self.inbox.popleft()

    def read_available(self) -> None:
        """Event-loop reader (``async def execute``): read what is there, if no
        other thread is reading."""
        with self._cond:
            if self._reading:
                return
            self._reading = True
        try:
            self._read_once(blocking=False)
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def _read_once(self, blocking: bool) -> None:
        try:
            data, ancdata, _, _ = self.sock.recvmsg(
                shm.RECV_BYTES, shm.ANCILLARY_SPACE, 0 if blocking else socket.MSG_DONTWAIT
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancdata = b"", []
        if not data:
            if not self.stopping:
                os._exit(0)  # the server is gone: nobody wants our results
            self.eof = True
            self.inbox.append(None)
            return
        self.frames.feed(data, ancdata)
        for frame in read_frames(self.frames):
            self._dispatch(frame)

    def _dispatch(self, frame: Frame) -> None:
        shm.apply_control(frame.control, self.frames, self.peer, self.pool)
        message = frame.message
        if isinstance(message, BlsResult):
            self._bls_result(message)
        elif isinstance(message, Cancel):
            self.cancelled.add((message.batch_id, message.position))
        elif isinstance(message, CancelStream):
            with self.streams_lock:
                key = (message.batch_id, message.slot)
                if key in self.streams:
                    self.streams[key] = True
        elif isinstance(message, (Exec, Stop, ReadyCheck)):
            if isinstance(message, Stop):
                self.stopping = True  # an end of file may follow at once
            self.inbox.append(message)
        else:
            log.error("unexpected message from the server: %s", type(message).__name__)

    # -- BLS ----------------------------------------------------------------------

    def _send_bls(self, call_id: int, request: pb.InferenceRequest, decoupled: bool) -> None:
        """Send a BLS request's :class:`Bls` (a decoupled call carries no trace context)."""
        arrays = {t.name(): t.as_numpy() for t in request.inputs()}  # the last of a name
        params = dict(request._parameters)
        if request.timeout():
            params.setdefault("timeout", request.timeout())
        version = "" if request.model_version in (-1, None, "") else str(request.model_version)
        self.send(
            Bls(
                call_id=call_id,
                model_name=request.model_name,
                version=version,
                request_id=request.request_id(),
                parameters=params,
                inputs={name: self.write(array) for name, array in arrays.items()},
                output_names=list(request.requested_output_names()),
                trace="" if decoupled else pb.traceparent_of(request),
                decoupled=decoupled,
            )
        )

    def submit_bls(self, request: pb.InferenceRequest) -> Future[pb.InferenceResponse]:
        """Send a BLS request to the server; the future resolves with its response."""
        future: Future[pb.InferenceResponse] = Future()
        call_id = next(self.calls)
        self.bls_pending[call_id] = future
        try:
            self._send_bls(call_id, request, decoupled=False)
        except BaseException:
            self.bls_pending.pop(call_id, None)
            raise
        return future

    def submit_bls_stream(self, request: pb.InferenceRequest) -> BlsResponses:
        """Send a decoupled BLS request (``exec(decoupled=True)``): an iterator of its
        responses, read as they come."""
        call_id = next(self.calls)
        responses = BlsResponses(self)
        self.bls_streams[call_id] = responses
        try:
            self._send_bls(call_id, request, decoupled=True)
        except BaseException:
            self.bls_streams.pop(call_id, None)
            raise
        return responses

    def _bls_result(self, message: BlsResult) -> None:
        stream = self.bls_streams.get(message.call_id)
        if stream is not None:
            if message.final:
                del self.bls_streams[message.call_id]
            stream.items.append(self._bls_response(message))
            if message.final:
                stream.done = True
            return
        future = self.bls_pending.pop(message.call_id, None)
        if future is None:
            return
        future.set_result(self._bls_response(message))

    def _bls_response(self, message: BlsResult) -> pb.InferenceResponse:
        error, outputs = message.error, message.outputs
        if error is not None or outputs is None:
            error = error or Error("BLS call answered without outputs", pb.TritonError.INTERNAL)
            response = pb.InferenceResponse([], error=pb.TritonError(error.message, error.code))
        else:
            tensors = [
                pb.Tensor(name, self.peer.read(desc, release=True))
                for name, desc in outputs.items()
            ]
            response = pb.InferenceResponse(tensors)
        return response

    def is_cancelled(self, batch_id: int, index: int) -> bool:
        """``request.is_cancelled()`` of request ``index`` of batch ``batch_id``: reads
        what the server sent (without blocking) and looks for its :class:`Cancel`."""
        key = (batch_id, index)
        if key in self.cancelled:
            return True
        self.read_available()
        return key in self.cancelled

    # -- execute ------------------------------------------------------------------

    def run_batch(self, model: Any, batch: Exec) -> None:
        """Build the requests, call ``execute``, send the results of the batch (its
        log lines name its requests: :class:`LogContext`)."""
        if log_context is not None:
            log_context.begin(batch)
        try:
            self._run_batch(model, batch)
        finally:
            if log_context is not None:
                log_context.end()

    def _run_batch(self, model: Any, batch: Exec) -> None:
        model_name = self.init.model_name
        version = int(self.init.model_version)
        requests = []
        for index, req in enumerate(batch.requests):
            tensors = [
                pb.Tensor(name, self.peer.read(desc, release=False))
                for name, desc in req.inputs.items()
            ]
            requests.append(
                pb.InferenceRequest(
                    model_name=model_name,
                    requested_output_names=req.output_names,
                    inputs=tensors,
                    request_id=req.id,
                    model_version=version,
                    parameters=req.parameters,
                    trace=pb.InferenceTrace.from_traceparent(req.trace),
                )
            )
            requests[-1]._cancel_probe = functools.partial(self.is_cancelled, batch.batch_id, index)
        if self.decoupled:
            self._run_decoupled(model, batch.batch_id, requests)
            return
        exec_start = time.monotonic_ns()
        try:
            responses = model.execute(requests)
            if inspect.isawaitable(responses):
                responses = self.run_coroutine(responses)
            if not isinstance(responses, (list, tuple)):
                raise pb.TritonModelException(
                    f"execute() must return a list of InferenceResponse, got "
                    f"{type(responses).__name__}"
                )
            if len(responses) != len(requests):
                raise pb.TritonModelException(
                    f"execute() returned {len(responses)} responses for {len(requests)} requests"
                )
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the server
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            error = self._execute_failed(exc)
            del requests
            exec_ns = (exec_start, time.monotonic_ns())
            self.send(Result(batch.batch_id, None, error, exec_ns))
            self._forget_cancelled(batch)
            return
        exec_ns = (exec_start, time.monotonic_ns())
        results = [
            self._encode_response(request, response)
            for request, response in zip(requests, responses, strict=True)
        ]
        del requests, responses
        self.send(Result(batch.batch_id, results, None, exec_ns))
        self._forget_cancelled(batch)

    def _execute_failed(self, exc: BaseException) -> Error:
        """Log an exception out of ``execute`` and make the error every request of the
        call gets (the code of a raised ``TritonError``, else INTERNAL)."""
        log.error(
            "execute() of %s failed:\n%s", self.instance_name, traceback.format_exc().rstrip()
        )
        code = exc.code() if isinstance(exc, pb.TritonError) else pb.TritonError.INTERNAL
        return Error(
            f"Failed to process the request(s) for model instance '{self.instance_name}', "
            f"message: {_format_exception(exc)}",
            code,
        )

    def _forget_cancelled(self, batch: Exec) -> None:
        """Drop the marks of this batch and of earlier ones (batch ids only grow; a
        :class:`Cancel` may cross the batch's :class:`Result`)."""
        if self.cancelled:
            self.cancelled = {k for k in self.cancelled if k[0] > batch.batch_id}

    # -- decoupled ------------------------------------------------------------------

    def _sender(
        self, batch_id: int, index: int, request: pb.InferenceRequest
    ) -> pb.InferenceResponseSender:
        """The response sender of one request of a decoupled model."""
        key = (batch_id, index)
        streams = self.streams

        def transmit(response: pb.InferenceResponse | None, final: bool) -> None:
            if final:
                with self.streams_lock:
                    cancelled = streams.pop(key, False)
            else:
                cancelled = streams.get(key, False)
            if cancelled:  # the server no longer listens: drop it
                return
            outputs = None if response is None else self._encode_response(request, response)
            params = None
            if type(outputs) is dict and isinstance(response, pb.InferenceResponse):
                params = response._parameters or None
            self.send(Respond(batch_id, index, outputs, final, params))

        def cancelled() -> bool:
            if not streams.get(key, False):
                self.read_available()  # a CancelStream may be waiting on the socket
            return streams.get(key, False)

        return pb.InferenceResponseSender(transmit, cancelled)

    def _run_decoupled(
        self, model: Any, batch_id: int, requests: list[pb.InferenceRequest]
    ) -> None:
        """``execute`` of a decoupled model: responses go out through the senders
        (:class:`~messages.Respond`); the :class:`~messages.Result` (no responses)
        says that ``execute`` returned, so that the instance takes the next batch.

        As Triton's python backend: ``execute`` must return None; when it raises or
        returns something else, every request whose final flag was not sent yet gets
        that error as its final response.
        """
        senders = []
        with self.streams_lock:
            for i in range(len(requests)):
                self.streams[(batch_id, i)] = False
        for i, request in enumerate(requests):
            sender = self._sender(batch_id, i, request)
            request._response_sender = sender
            senders.append(sender)
        error: Error | None = None
        try:
            returned = model.execute(requests)
            if inspect.isawaitable(returned):
                returned = self.run_coroutine(returned)
            if returned is not None and not (isinstance(returned, list) and not returned):
                raise pb.TritonModelException(
                    "execute() of a decoupled model must return None (its responses go "
                    f"through the response senders), got {type(returned).__name__}"
                )
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the server
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            error = self._execute_failed(exc)
        if error is not None:
            response = pb.InferenceResponse([], error=pb.TritonError(error.message, error.code))
            for sender in senders:
                with contextlib.suppress(Exception):
                    sender._close_with(response)
        del requests, senders
        self.send(Result(batch_id, [], None))

    def _encode_response(
        self, request: pb.InferenceRequest, response: object
    ) -> dict[str, TensorDesc] | Error:
        """One request's entry of a :class:`Result`: its outputs, written into this
        worker's arenas, or its error."""
        if not isinstance(response, pb.InferenceResponse):
            return Error(
                f"model instance '{self.instance_name}' returned {type(response).__name__} "
                "instead of an InferenceResponse",
                pb.TritonError.INTERNAL,
            )
        if response.has_error():
            error = response.error()
            assert error is not None
            return Error(str(error.message()), error.code())
        wanted = set(request.requested_output_names())
        outputs: dict[str, TensorDesc] = {}
        try:
            for tensor in response.output_tensors():
                if not isinstance(tensor, pb.Tensor):
                    raise pb.TritonModelException(
                        f"output_tensors must hold pb_utils.Tensor, got {type(tensor).__name__}"
                    )
                name = tensor.name()
                if wanted and name not in wanted:
                    continue  # Triton drops outputs nobody asked for
                if name in outputs:  # a repeated name: the last one counts
                    self._free([outputs.pop(name)])
                outputs[name] = self.write(tensor.as_numpy())
        except Exception as exc:
            self._free(list(outputs.values()))
            return Error(_format_exception(exc), pb.TritonError.INTERNAL)
        return outputs

    def _free(self, descs: list[TensorDesc]) -> None:
        """Return the blocks of tensors written but not sent."""
        self.pool.free_many([Block(d.arena, d.offset) for d in descs if d.inline is None])

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
        return self.loop

    def run_coroutine(self, coro: Awaitable[_T]) -> _T:
        """Run a coroutine of the model (``async def execute`` / ``initialize``).

        While it runs, the event loop reads the socket too, so that the futures
        of ``async_exec()`` resolve.
        """
        loop = self._event_loop()
        loop.add_reader(self.sock.fileno(), self.read_available)
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.remove_reader(self.sock.fileno())

    def wait_bls(self, future: Future[pb.InferenceResponse]) -> None:
        """Block until a BLS future resolves (``exec()``), reading the socket meanwhile."""
        self.wait_until(future.done)


class BlsResponses:
    """The iterator ``exec(decoupled=True)`` returns: the target's responses in order,
    the last one empty when the target sent its final flag alone (as in Triton).
    Iterating blocks, reading the worker's channel, until the next response is in."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.items: deque[pb.InferenceResponse] = deque()
        self.done = False

    def __iter__(self) -> BlsResponses:
        return self

    def __next__(self) -> pb.InferenceResponse:
        if not self.items and not self.done:
            self.worker.wait_until(lambda: bool(self.items) or self.done)
        if self.items:
            return self.items.popleft()
        raise StopIteration


def _is_decoupled(model_config: str) -> bool:
    """Whether Triton's JSON model configuration asks for the decoupled policy."""
    try:
        policy = json.loads(model_config).get("model_transaction_policy") or {}
    except (ValueError, AttributeError):
        return False
    return bool(policy.get("decoupled", False))


def _model_args(init: WorkerInit) -> dict[str, str]:
    """The ``args`` dict Triton passes to ``initialize`` (all values are strings)."""
    return {
        "model_config": init.model_config,
        "model_instance_kind": init.instance_kind,
        "model_instance_name": init.instance_name,
        "model_instance_device_id": str(init.device_id),
        "model_repository": init.model_dir,
        "model_version": str(init.model_version),
        "model_name": init.model_name,
    }


def _serve(worker: Worker) -> None:
    init = worker.init
    try:
        module = load_model_module(init.model_file, init.version_dir, init.model_dir)
        model = module.TritonPythonModel()
        if hasattr(model, "initialize"):
            result = model.initialize(_model_args(init))
            if inspect.isawaitable(result):
                worker.run_coroutine(result)
    except BaseException as exc:  # noqa: BLE001 - reported to the server
        log.error("initialize of %s failed:\n%s", worker.instance_name, traceback.format_exc())
        worker.send(InitError(_format_exception(exc)))
        return
    worker.send(Ready(os.getpid(), callable(getattr(model, "is_ready", None))))
    while True:
        message = worker.next_message()
        if isinstance(message, Exec):
            worker.run_batch(model, message)
        elif isinstance(message, ReadyCheck):
            worker.send(_ask_is_ready(worker, model, message.check_id))
        else:  # Stop, or end of file
            worker.stopping = True
            break
    if hasattr(model, "finalize"):
        try:
            result = model.finalize()
            if inspect.isawaitable(result):
                worker.run_coroutine(result)
        except Exception:
            log.error("finalize of %s failed:\n%s", worker.instance_name, traceback.format_exc())


def _ask_is_ready(worker: Worker, model: Any, check_id: int) -> ReadyState:
    """The model's ``is_ready()`` (a coroutine is run to its end) as a :class:`ReadyState`."""
    try:
        result = model.is_ready()
        if inspect.isawaitable(result):
            result = worker.run_coroutine(result)
        return ReadyState(check_id, bool(result), None)
    except Exception as exc:  # noqa: BLE001 - reported to the server: not ready
        return ReadyState(check_id, False, _format_exception(exc))


def _autocomplete(worker: Worker) -> None:
    """Import the model and run its ``auto_complete_config``; answer an
    :class:`~messages.AutoCompleteResult` (its ``stage``: ``"import"`` or
    ``"auto_complete_config"``, what raised)."""
    init = worker.init
    try:
        module = load_model_module(init.model_file, init.version_dir, init.model_dir)
    except BaseException as exc:  # noqa: BLE001 - reported to the server
        worker.send(AutoCompleteResult(None, _format_exception(exc), "import"))
        return
    try:
        cls = module.TritonPythonModel
        config = pb.ModelConfig(init.model_config)
        hook = getattr(cls, "auto_complete_config", None)
        if hook is not None:
            returned = hook(config)
            if isinstance(returned, pb.ModelConfig):
                config = returned
        worker.send(AutoCompleteResult(config.as_dict(), None))
    except BaseException as exc:  # noqa: BLE001 - reported to the server
        worker.send(AutoCompleteResult(None, _format_exception(exc)))


#: Signals a worker survives (see :func:`shield_from_group_signals`).
SHIELDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _shrug(signum: int, frame: object) -> None:
    """Handler of :data:`SHIELDED_SIGNALS` in a worker: nothing happens."""


def _default_signals_in_child() -> None:
    """``os.register_at_fork`` hook: a process the model forks gets default handlers."""
    for sig in SHIELDED_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def shield_from_group_signals() -> None:
    """Make this worker survive SIGINT/SIGTERM, leaving them default for its children.

    The signals are *caught* by a handler that does nothing, not ignored: an ignored
    signal stays ignored across ``fork`` and ``exec``, so every program a model starts
    (``subprocess``, ``os.system``) could not be stopped with SIGTERM, while a caught
    one reverts to the default at ``exec`` (POSIX). A child the model forks without
    exec (``os.fork``, ``multiprocessing``'s fork) gets the defaults back from an
    ``os.register_at_fork`` hook. Must run in the main thread.
    """
    for sig in SHIELDED_SIGNALS:
        signal.signal(sig, _shrug)
    os.register_at_fork(after_in_child=_default_signals_in_child)


def worker_main(sock: socket.socket, init: WorkerInit) -> None:
    """Entry point of a worker process (``multiprocessing`` target).

    Args:
        sock: this worker's end of the socketpair.
        init: what to run, and where (see :class:`~messages.WorkerInit`).
    """
    # Die with the server, even a SIGKILLed one, whatever the model is doing: the
    # kernel kills this process when its parent (the fork server, which exits with
    # the server) exits, and a thread watches the server itself (lifetime module).
    lifetime.set_parent_death_signal()
    if init.cuda_visible_devices is not None:  # KIND_GPU: only its own GPU, before any
        os.environ["CUDA_VISIBLE_DEVICES"] = init.cuda_visible_devices  # CUDA library loads
    cores = init.cpu_cores
    if cores:  # before model.py is imported: every thread it starts inherits the mask
        os.sched_setaffinity(0, cores)
    if init.server_pid:  # after the mask is set: the thread inherits it too
        lifetime.exit_when_gone(init.server_pid)
    # The server decides when a worker stops ("stop" frame, SIGKILL after a timeout;
    # a worker whose server vanished sees its socket close). A SIGINT or SIGTERM sent
    # to the whole process group (Ctrl-C, systemd's KillMode=control-group, timeout)
    # must not kill workers under the server's orderly shutdown.
    shield_from_group_signals()
    global log_context
    log_context = LogContext(init.model_name)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname).1s {init.instance_name or 'worker'}"
        f"[{os.getpid()}] %(name)s: %(message)s%(ids)s",
        stream=sys.stderr,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(log_context)
    sock.setblocking(True)
    worker = Worker(sock, init)
    pb._bls_submit = worker.submit_bls
    pb._bls_wait = worker.wait_bls
    pb._bls_stream = worker.submit_bls_stream
    try:
        if init.mode == "autocomplete":
            _autocomplete(worker)
        else:
            _serve(worker)
    finally:
        worker.stopping = True
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
