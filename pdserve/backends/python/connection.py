"""The server's side of one python worker process: its socket and arenas, the batch it
runs, its decoupled streams and BLS calls, its death and its stop.

A worker that dies (segfault, ``os._exit``, SIGKILL, OOM kill) is seen as end of file
on its socket at once; the requests it held fail with ``INTERNAL`` saying so, and
:attr:`WorkerConnection.died` resolves with how it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.context import ForkServerProcess
from typing import Any

import numpy as np

from pdserve import shm
from pdserve.backends.base import ExecRequest
from pdserve.backends.python import launch
from pdserve.backends.python.bls import run_bls
from pdserve.backends.python.messages import (
    AutoCompleteResult,
    Bls,
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
    Request,
    Respond,
    Result,
    Stop,
    Wire,
    WorkerInit,
    encode_frame,
    from_wire,
)
from pdserve.core import tracing
from pdserve.core.api import ModelRunner
from pdserve.core.cancel import CancelToken, token_of
from pdserve.core.errors import ErrorCode, InferError, internal, unavailable
from pdserve.core.streaming import ResponseStream
from pdserve.core.tracing import TraceRef
from pdserve.shm import Block, TensorDesc

log = logging.getLogger("pdserve.python")

#: A decoupled request's stream and the check of each response's outputs (the checked
#: outputs, or the error that fails the response).
OutputCheck = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray] | InferError]
StreamEntry = tuple[ResponseStream, OutputCheck]

#: Seconds ``finalize`` may take at unload before the worker is killed.
STOP_TIMEOUT_S = 10.0


class WorkerConnection:
    """The server's side of one worker process: socket, arenas, in-flight work.

    Created by :meth:`start`; :attr:`died` resolves (with a description) when the
    worker is gone, expectedly or not.
    """

    def __init__(
        self,
        name: str,
        proc: ForkServerProcess,
        sock: socket.socket,
        server: ModelRunner | None,
    ) -> None:
        self.name = name
        self.proc = proc
        self.pid: int = proc.pid or 0
        self.server = server
        self.loop = asyncio.get_running_loop()
        #: the socketpair's framing, write queue and arenas (``.in``: server -> worker)
        self.link = shm.FramedSocket(sock, f"{name}.in", self._on_payloads, self._on_eof)
        self.sock = sock
        self.pool = self.link.pool
        self.peer = self.link.peer
        self.frames = self.link.frames
        self.ready: asyncio.Future[int] = self.loop.create_future()
        self.autocomplete: asyncio.Future[AutoCompleteResult] = self.loop.create_future()
        self.died: asyncio.Future[str] = self.loop.create_future()
        self.batch_ids = itertools.count()
        #: The batch the worker is running: (its id, the future of its Result).
        self.batch: tuple[int, asyncio.Future[Result]] | None = None
        #: The cancellation tokens of that batch's requests (None: a request has none);
        #: a BLS call of the worker meanwhile is cancelled with them (:func:`~pdserve.backends.python.bls.bls_token`).
        self.batch_tokens: list[CancelToken | None] = []
        self.stopping = False
        #: the worker's exit code, kept when the process object is closed
        self._exitcode: int | None = None
        self._bls_tasks: set[asyncio.Task[None]] = set()
        #: Open decoupled requests: (batch id, index) -> their stream and the check
        #: of each response's outputs.
        self.streams: dict[tuple[int, int], StreamEntry] = {}
        #: decoupled responses received (the watchdog's progress counter).
        self.responses_seen = 0
        #: the model defines ``is_ready()`` (told by :class:`Ready`).
        self.has_is_ready = False
        #: ``is_ready()`` checks awaiting their :class:`ReadyState`, by id.
        self._ready_checks: dict[int, asyncio.Future[ReadyState]] = {}
        self._check_ids = itertools.count()

    # -- start ------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        name: str,
        init: WorkerInit,
        server: ModelRunner | None,
        cores: frozenset[int] | None = None,
    ) -> WorkerConnection:
        """Start a worker process (forkserver) and connect to it.

        Args:
            server: the core the worker's BLS calls run through (``ModelSpec.server``);
                None: BLS calls fail with 500.
            cores: CPU ids to pin the process to (its host policy), or None.

        Raises:
            OSError: the process could not be started.
            pdserve.backends.host_policy.HostPolicyError: it could not be pinned to ``cores``.
        """
        proc, sock = await launch.start_process(name, init, cores)
        return cls(name, proc, sock, server)

    # -- sending ----------------------------------------------------------------

    def send(self, message: Message) -> None:
        """Queue one message; new arenas and released worker blocks ride along."""
        if self.died.done():
            return
        self.link.send(lambda control: encode_frame(message, control))

    # -- receiving --------------------------------------------------------------

    def _on_payloads(self, payloads: list[Wire]) -> None:
        for payload in payloads:
            try:
                self._dispatch(from_wire(payload))
            except Exception:
                log.exception("%s: bad message from worker", self.name)

    def _dispatch(self, frame: Frame) -> None:
        shm.apply_control(frame.control, self.frames, self.peer, self.pool)
        message = frame.message
        if isinstance(message, Result):
            if self.batch is not None and self.batch[0] == message.batch_id:
                future = self.batch[1]
                self.batch = None
                if not future.done():
                    future.set_result(message)
        elif isinstance(message, Respond):
            self._respond(message)
        elif isinstance(message, Bls):
            task = self.loop.create_task(run_bls(self, message))
            self._bls_tasks.add(task)
            task.add_done_callback(self._bls_tasks.discard)
        elif isinstance(message, ReadyState):
            check = self._ready_checks.pop(message.check_id, None)
            if check is not None and not check.done():
                check.set_result(message)
        elif isinstance(message, Ready):
            self.has_is_ready = bool(message.has_is_ready)
            if not self.ready.done():
                self.ready.set_result(message.pid)
        elif isinstance(message, InitError):
            if not self.ready.done():
                self.ready.set_exception(RuntimeError(message.message))
        elif isinstance(message, AutoCompleteResult):
            if not self.autocomplete.done():
                self.autocomplete.set_result(message)
        else:
            log.error("%s: unexpected message %s", self.name, type(message).__name__)

    def _on_eof(self) -> None:
        """The worker closed its socket: it exited or died."""
        self.loop.create_task(self._reap())

    async def _reap(self) -> None:
        exitcode = await self._wait_exit(2.0)
        if exitcode is None:  # closed its socket but lives on: not usable any more
            self._kill()
            exitcode = await self._wait_exit(5.0)
        how = launch.exit_description(exitcode)
        description = (
            f"worker process of python model instance '{self.name}' (pid {self.pid}) {how}"
        )
        if not self.stopping:
            log.error("%s", description)
            error = internal(
                f"{description} while executing this request; the worker is being restarted"
            )
        else:  # stopped by us: the model is unloading or the server is shutting down
            error = unavailable(
                f"{description}: the model is unloading or the server is shutting down "
                "and this request did not finish in time"
            )
        if self.batch is not None and not self.batch[1].done():
            self.batch[1].set_exception(error)
            self.batch = None
        for fut in (self.ready, self.autocomplete):
            if not fut.done():
                fut.set_exception(RuntimeError(f"{description} while starting"))
                fut.exception()  # only a caller that waits on it cares
        for task in list(self._bls_tasks):
            task.cancel()
        streams, self.streams = self.streams, {}
        for stream, _ in streams.values():
            stream.fail(error.fresh())
        self._close_resources()
        if not self.died.done():
            self.died.set_result(description)

    async def _wait_exit(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                code = self.proc.exitcode  # non-blocking poll of the forkserver sentinel
            except ValueError:  # closed (only once it had exited)
                return self._exitcode
            if code is not None or time.monotonic() >= deadline:
                return code
            await asyncio.sleep(0.005)

    def kill_wedged(self) -> None:
        """SIGKILL a worker the watchdog declared wedged (also a stopped one); the
        death is handled as any other (its batch fails, the instance restarts it)."""
        self._kill()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            os.kill(self.pid, signal.SIGKILL)

    def _close_resources(self) -> None:
        """Close the socket and arenas and, once the worker has exited, the process
        object's two descriptors (the fork server's status pipe and the data pipe's
        duplicate that ``multiprocessing`` keeps until the object is closed)."""
        self.link.close()
        with contextlib.suppress(ValueError):
            self._exitcode = self.proc.exitcode
        launch.close_process(self.proc)

    # -- work -------------------------------------------------------------------

    async def run_batch(
        self, batch: list[ExecRequest], streams: list[StreamEntry] | None = None
    ) -> Result:
        """Send a batch, wait for the worker's :class:`Result` (raw descriptors).

        Args:
            streams: a decoupled model's batch: each request's stream and response
                check (:meth:`_respond` feeds them, also after the Result).

        Raises:
            InferError(INTERNAL): the worker died before answering.
        """
        blocks: list[Block] = []

        def alloc(nbytes: int) -> tuple[shm.Arena, int] | None:
            placed = self.pool.alloc(nbytes)
            if placed is not None:
                blocks.append(Block(placed[0].id, placed[1]))
            return placed

        marks = tracing.current_marks()
        spans: list[tuple[TraceRef, str, str, str]] = []  # ref, infer, hop, execute span
        reqs = []
        for r in batch:
            inputs = {name: shm.write_tensor(arr, alloc) for name, arr in r.inputs.items()}
            params = dict(r.request.parameters) if r.request.parameters else {}
            traceparent = ""
            if marks is not None and id(r) in marks.infer_spans:
                ref, infer_id = marks.infer_spans[id(r)]
                hop_id, exec_id = tracing.new_span_id(), tracing.new_span_id()
                spans.append((ref, infer_id, hop_id, exec_id))
                traceparent = ref.trace.traceparent(exec_id)
            reqs.append(Request(r.request.id, params, inputs, list(r.output_names), traceparent))
        batch_id = next(self.batch_ids)
        if streams is not None:
            for index, entry in enumerate(streams):
                self._open_stream(batch_id, index, entry)
        future: asyncio.Future[Result] = self.loop.create_future()
        self.batch = (batch_id, future)
        tracing.mark_input_end()
        sent = time.monotonic_ns()
        self.send(Exec(batch_id, reqs))
        hooks = self._tell_cancellations(batch_id, batch)
        try:
            try:
                result = await asyncio.shield(future)
                if spans:
                    self._trace_hop(spans, sent, result)
                return result
            except asyncio.CancelledError:
                # The worker is still busy with this batch: keep the instance taken
                # until it answers, or the next batch would overtake this one.
                while not future.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(future)
                raise
        finally:
            for token, hook in hooks:
                token.remove_callback(hook)
            self.batch_tokens = []
            self.pool.free_many(blocks)
            # a failed future's exception has a traceback through this frame:
            # future -> exception -> traceback -> frame -> future would be a cycle
            future = None  # type: ignore[assignment]  # dropped to break the cycle

    def _tell_cancellations(
        self, batch_id: int, batch: list[ExecRequest]
    ) -> list[tuple[CancelToken, Callable[[CancelToken], None]]]:
        """Send the worker a :class:`Cancel` when a request of the running batch is
        cancelled (its ``request.is_cancelled()`` turns True); returns the callbacks
        to remove once the batch is answered."""
        hooks: list[tuple[CancelToken, Callable[[CancelToken], None]]] = []
        tokens: list[CancelToken | None] = []
        for index, r in enumerate(batch):
            token = token_of(r.request)
            tokens.append(token)
            if token is None:
                continue

            def hook(_t: CancelToken, index: int = index) -> None:
                if self.batch is not None and self.batch[0] == batch_id and not self.stopping:
                    with contextlib.suppress(OSError):
                        self.send(Cancel(batch_id, index))

            token.add_callback(hook)
            hooks.append((token, hook))
        self.batch_tokens = tokens
        return hooks

    def _trace_hop(
        self, spans: list[tuple[TraceRef, str, str, str]], sent: int, result: Result
    ) -> None:
        """Record the shared-memory hop (``python_worker``: sent -> answer read) and the
        worker's ``execute`` (its own clock, ``Result.exec_ns``) of each traced request."""
        received = time.monotonic_ns()
        tracing.mark_output_start()
        attrs = {"pdserve.worker_pid": self.pid or 0, "pdserve.model_instance": self.name}
        for ref, infer_id, hop_id, exec_id in spans:
            trace = ref.trace
            trace.add("python_worker", infer_id, sent, received, attrs, hop_id)
            if result.exec_ns is not None:
                begin, end = result.exec_ns
                trace.add("execute", hop_id, max(begin, sent), min(end, received), None, exec_id)

    async def check_ready(self, timeout: float) -> tuple[bool, str]:
        """Ask the model's ``is_ready()`` (between batches: the worker answers once its
        running batch is done).

        Returns:
            ``(ready, why not)``: False with the reason when it returned a false value,
            raised, did not answer within ``timeout`` s, or the worker died.
        """
        if self.died.done():
            return False, "its worker process is not running"
        check_id = next(self._check_ids)
        future: asyncio.Future[ReadyState] = self.loop.create_future()
        self._ready_checks[check_id] = future
        self.send(ReadyCheck(check_id))
        try:
            waits: list[asyncio.Future[Any]] = [future, self.died]
            done, _ = await asyncio.wait(
                waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self._ready_checks.pop(check_id, None)
        if future in done:
            state = future.result()
            if state.error is not None:
                return False, f"is_ready() raised {state.error}"
            return state.ready, "" if state.ready else "is_ready() returned False"
        if self.died.done():
            return False, "its worker process died"
        return False, f"is_ready() did not answer within {timeout:g} s"

    # -- decoupled ----------------------------------------------------------------

    def _open_stream(self, batch_id: int, index: int, entry: StreamEntry) -> None:
        key = (batch_id, index)
        stream = entry[0]
        self.streams[key] = entry

        def cancel() -> None:  # the client went away or the request timed out
            if self.streams.pop(key, None) is not None:
                self.send(CancelStream(batch_id, index))

        if stream.closed:  # cancelled while it waited for this instance
            cancel()
        else:
            stream.on_cancel = cancel

    def _respond(self, message: Respond) -> None:
        """One response of a decoupled request: into its stream (dropped, its blocks
        released, when nobody listens any more)."""
        self.responses_seen += 1
        key = (message.batch_id, message.slot)
        entry = self.streams.get(key)
        out = message.outputs
        outputs = None
        if type(out) is dict:
            outputs = self.read_outputs(out)  # released when the views are gone
        if entry is None:
            return
        stream, check = entry
        if message.final:
            del self.streams[key]
        if isinstance(out, Error):
            error = InferError(out.message, ErrorCode.from_triton(out.code), reason="BACKEND")
            stream.fail(error, final=message.final)
            return
        if outputs is not None:
            checked = check(outputs)
            if isinstance(checked, InferError):
                stream.fail(checked, final=message.final)
                return
            outputs = checked
        stream.put(outputs, message.final, message.parameters)

    def read_outputs(self, outputs: dict[str, TensorDesc]) -> dict[str, np.ndarray]:
        """Views of a result's output tensors (released when garbage-collected)."""
        return {name: self.peer.read(desc, release=True) for name, desc in outputs.items()}

    # -- stop -------------------------------------------------------------------

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the worker to finalize and exit; kill it after ``timeout`` seconds."""
        self.stopping = True
        if not self.died.done():
            self.send(Stop())
            try:
                await asyncio.wait_for(asyncio.shield(self.died), timeout)
            except TimeoutError:
                log.warning("%s did not stop within %.0f s: killing it", self.name, timeout)
                self._kill()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self.died), 5.0)
        if not self.died.done():  # pragma: no cover - unreachable unless the OS misbehaves
            self._close_resources()
            self.died.set_result("stopped")

    async def kill(self) -> None:
        """SIGKILL the worker now (no ``finalize``) and wait (5 s at most) until it is gone.

        For a start that is abandoned (the server shuts down while the model loads):
        a worker busy in ``initialize`` could not answer a stop.
        """
        self.stopping = True
        if not self.died.done():
            self._kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.died), 5.0)
        if not self.died.done():  # pragma: no cover - unreachable unless the OS misbehaves
            self._close_resources()
            self.died.set_result("killed")
