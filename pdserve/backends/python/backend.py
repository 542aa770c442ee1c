"""The python backend (``backend: "python"``): Triton python models in worker processes.

A model folder holds ``<version>/model.py`` defining ``TritonPythonModel`` exactly
as for Triton's python backend (``initialize(args)``, ``execute(requests)``,
``finalize()``, optional static ``auto_complete_config``). pdserve runs **one worker
process per model instance** (``instance_group`` count; default 1), so the
pre/post-processing stages of a pipeline use every core instead of sharing one GIL.

Process model (DESIGN.md, "Passing a tensor to a worker process"):

* workers are started with the ``multiprocessing`` **forkserver** method, the fork
  server having imported numpy and the worker module once (a worker starts in
  milliseconds); extra modules to preload can be named in the environment variable
  ``PDSERVE_PYTHON_PRELOAD`` (comma-separated, e.g. ``cv2,PIL.Image``);
* each worker has one ``AF_UNIX`` socketpair to the server for small control
  frames (the records of :mod:`~pdserve.backends.python.messages`); tensors travel
  through memfd shared-memory arenas (:mod:`pdserve.shm`), copied
  once each way;
* the scheduler hands an instance a batch of requests; the worker gets them as one
  list in one ``execute`` call, as in Triton (requests are never merged), and
  answers one result per request.
* a ``KIND_GPU`` instance on GPU ``<id>`` gets ``args["model_instance_kind"] == "GPU"``
  and ``args["model_instance_device_id"] == "<id>"`` (Triton's), and its worker's
  ``CUDA_VISIBLE_DEVICES`` names that one GPU
  (:func:`pdserve.backends.devices.cuda_visible_devices_for`), set before ``model.py``
  is imported: the model sees only its own GPU, which CUDA numbers ``cuda:0`` inside the
  worker (use ``torch.device("cuda")``). CUDA reads the variable when it initialises,
  so this holds even with torch preloaded in the fork server
  (``PDSERVE_PYTHON_PRELOAD``). A GPU id this process cannot see fails the load.

Errors (a ``TritonError`` code is the :class:`~pdserve.core.errors.ErrorCode` of the
same value; the status each gets is in
:mod:`~pdserve.backends.python.triton_python_backend_utils`):

* a response with ``error=pb_utils.TritonError(msg, code)`` fails that request
  only, with ``code`` unchanged (``INVALID_ARG`` -> HTTP 400, gRPC INVALID_ARGUMENT;
  the default ``INTERNAL`` -> 500 / INTERNAL, as in Triton);
* an exception out of ``execute`` fails every request of that call (``INTERNAL``, or
  the code of a raised ``TritonError``), naming the instance and the exception;
* a worker that dies (segfault, ``os._exit``, SIGKILL, OOM kill) is seen as end of
  file on its socket at once; the requests it held fail with ``INTERNAL`` saying so,
  and the worker is restarted (the model stays available; requests wait for the
  new worker; when it cannot be started they get ``UNAVAILABLE``, and the next request tries
  again after a back-off of up to :data:`MAX_RESTART_DELAY_S`);
* an output of the wrong datatype, or a requested output the model did not
  return, is ``INTERNAL`` naming the output.

Host policies (``--host-policy``, :mod:`pdserve.backends.host_policy`): each worker of an
instance whose group's policy has cores is pinned to them — by the server with
``os.sched_setaffinity(pid, cores)`` as soon as the process exists, and by the
worker itself before it imports ``model.py`` (so threads the model starts inherit
the mask) — at start and again at every restart after a crash.

Workers stop with the model (``finalize()`` runs; a worker that does not exit
within :data:`STOP_TIMEOUT_S` is killed) and, since the shared memory is memfd
based, nothing is left in ``/dev/shm`` even when the server itself is killed.

BLS: a worker's ``pb_utils.InferenceRequest(...).exec()`` comes back over its
socket and runs through the server core (``InferenceServer.infer_on``), so it is
scheduled, batched and counted like any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pdserve import config as cfgmod
from pdserve import shm
from pdserve.backends import host_policy
from pdserve.backends.base import Backend, ExecRequest, ExecResult, ModelInstance, ModelSpec
from pdserve.backends.devices import check_gpu_ids, cuda_visible_devices_for
from pdserve.backends.host_policy import instance_cores
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
    Request,
    Respond,
    Result,
    Stop,
    WorkerInit,
    encode_frame,
    from_wire,
)
from pdserve.core import tracing
from pdserve.core.api import ModelRunner
from pdserve.core.cancel import CancelToken, parse_timeout_us, token_of
from pdserve.core.errors import ErrorCode, InferError, internal, unavailable
from pdserve.core.streaming import ResponseStream
from pdserve.core.tracing import TraceRef
from pdserve.core.types import InferRequest, RequestedOutput
from pdserve.shm import Block, TensorDesc

log = logging.getLogger("pdserve.python")

#: Seconds a worker may take to import model.py and run ``initialize``.
START_TIMEOUT_S = 600.0
#: Seconds ``finalize`` may take at unload before the worker is killed.
STOP_TIMEOUT_S = 10.0
#: Longest wait between two attempts to restart a worker that keeps failing.
MAX_RESTART_DELAY_S = 10.0
#: Seconds ``finalize`` may take in an instance that had started when its model's
#: load was abandoned (the server shuts down while the model loads).
CANCEL_GRACE_S = 2.0

_ctx_lock = threading.Lock()
_start_lock = threading.Lock()
_ctx: Any = None


_launching = threading.local()


def _install_preparation_filter() -> None:
    """Keep workers from re-importing the server's ``__main__`` module.

    A ``spawn``/``forkserver`` child normally runs the parent's main script (or
    ``-m`` module) again as ``__mp_main__`` before its target: a script without an
    ``if __name__ == "__main__"`` guard would then start a second server, and
    heavy scripts would be imported in every worker. Workers need nothing from
    it, so while this module starts one, the main-module entries are left out of
    the preparation data (``multiprocessing.spawn.get_preparation_data``).
    """
    from multiprocessing import spawn

    original = spawn.get_preparation_data
    if getattr(original, "_pdserve", False):
        return

    def get_preparation_data(name: str) -> dict[str, Any]:
        data = original(name)
        if getattr(_launching, "active", False):
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
        return data

    get_preparation_data._pdserve = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


def _mp_context() -> Any:
    """The forkserver context, with numpy and the worker module preloaded."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            _install_preparation_filter()
            ctx = multiprocessing.get_context("forkserver")
            # lifetime: the fork server exits as soon as this process is gone
            preload = [
                "numpy",
                "pdserve.backends.python.lifetime",
                "pdserve.backends.python.worker",
            ]
            extra = os.environ.get("PDSERVE_PYTHON_PRELOAD", "")
            preload += [m.strip() for m in extra.split(",") if m.strip()]
            ctx.set_forkserver_preload(preload)
            _ctx = ctx
        return _ctx


def _exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "exited (status unknown)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


class WorkerConnection:
    """The server's side of one worker process: socket, arenas, in-flight work.

    Created by :meth:`start`; :attr:`died` resolves (with a description) when the
    worker is gone, expectedly or not.
    """

    def __init__(
        self, name: str, proc: Any, sock: socket.socket, server: ModelRunner | None
    ) -> None:
        self.name = name
        self.proc = proc
        self.pid: int = proc.pid
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
        #: a BLS call of the worker meanwhile is cancelled with them (:func:`bls_token`).
        self.batch_tokens: list[CancelToken | None] = []
        self.stopping = False
        self._bls_tasks: set[asyncio.Task[None]] = set()
        #: Open decoupled requests: (batch id, index) -> their stream and the check
        #: of each response's outputs.
        self.streams: dict[tuple[int, int], tuple[ResponseStream, Any]] = {}

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
        ctx = _mp_context()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        from pdserve.backends.python.worker import worker_main

        proc = ctx.Process(
            target=worker_main, args=(child, init), name=f"pdserve-{name}", daemon=False
        )

        def launch() -> None:
            with _start_lock:
                _launching.active = True
                try:
                    proc.start()
                finally:
                    _launching.active = False
            if cores:
                try:
                    host_policy.pin(proc.pid, cores)
                except ProcessLookupError:
                    pass  # died at once: seen as end of file on its socket
                except host_policy.HostPolicyError:
                    proc.kill()
                    proc.join(5.0)
                    raise

        launched = asyncio.get_running_loop().run_in_executor(None, launch)
        try:
            await asyncio.shield(launched)
        except asyncio.CancelledError:  # shutdown while loading: kill what was started
            with contextlib.suppress(BaseException):
                await launched
            if proc.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGKILL)
            parent.close()
            raise
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        return cls(name, proc, parent, server)

    # -- sending ----------------------------------------------------------------

    def send(self, message: Message) -> None:
        """Queue one message; new arenas and released worker blocks ride along."""
        if self.died.done():
            return
        self.link.send(lambda control: encode_frame(message, control))

    # -- receiving --------------------------------------------------------------

    def _on_payloads(self, payloads: list[Any]) -> None:
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
            task = self.loop.create_task(self._run_bls(message))
            self._bls_tasks.add(task)
            task.add_done_callback(self._bls_tasks.discard)
        elif isinstance(message, Ready):
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
        how = _exit_description(exitcode)
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
            code = self.proc.exitcode  # non-blocking poll of the forkserver sentinel
            if code is not None or time.monotonic() >= deadline:
                return code
            await asyncio.sleep(0.005)

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            os.kill(self.pid, signal.SIGKILL)

    def _close_resources(self) -> None:
        self.link.close()

    # -- work -------------------------------------------------------------------

    async def run_batch(
        self, batch: list[ExecRequest], streams: list[tuple[ResponseStream, Any]] | None = None
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
            future = None  # type: ignore[assignment]

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

    # -- decoupled ----------------------------------------------------------------

    def _open_stream(self, batch_id: int, index: int, entry: tuple[ResponseStream, Any]) -> None:
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
        stream.put(outputs, message.final)

    def read_outputs(self, outputs: dict[str, TensorDesc]) -> dict[str, np.ndarray]:
        """Views of a result's output tensors (released when garbage-collected)."""
        return {name: self.peer.read(desc, release=True) for name, desc in outputs.items()}

    async def _run_bls(self, call: Bls) -> None:
        """Run a BLS request from the worker through the server core, send the result."""
        call_id = call.call_id
        token: CancelToken | None = None

        if call.decoupled:
            await self._run_bls_stream(call)
            return
        try:
            if self.server is None:
                raise internal("BLS is not available: the model has no server")
            arrays = {
                name: self.peer.read(desc, release=True) for name, desc in call.inputs.items()
            }
            request = InferRequest(
                model_name=call.model_name,
                model_version=call.version,
                inputs=arrays,
                outputs=[RequestedOutput(n) for n in call.output_names] or None,
                id=call.request_id,
                parameters=call.parameters,
            )
            del arrays
            token = request.cancelled = bls_token(self.batch_tokens, call.parameters)
            ref = tracing.ref_from_traceparent(call.trace) if call.trace else None
            if ref is not None:  # BLS with trace=request.trace(): a "bls" span, the model under it
                bls_start = time.monotonic_ns()
                bls_id = tracing.new_span_id()
                request.trace = tracing.TraceRef(ref.trace, bls_id)
            try:
                mv = self.server.model_version(call.model_name, call.version)
                response = await self.server.infer_on(mv, request)
            finally:
                if ref is not None:
                    ref.trace.add(
                        "bls",
                        ref.parent_id,
                        bls_start,
                        time.monotonic_ns(),
                        {"pdserve.bls_model": call.model_name},
                        bls_id,
                    )
            del request
            descs = {
                name: shm.write_tensor(arr, self.pool.alloc)
                for name, arr in response.outputs.items()
            }
            self.send(BlsResult(call_id, descs, None))
        except asyncio.CancelledError:
            raise
        except InferError as e:
            self.send(BlsResult(call_id, None, Error(e.message, e.code.triton_code.value)))
        except Exception as e:  # a server fault still answers the worker
            log.exception("BLS call from %s failed", self.name)
            error = Error(f"{type(e).__name__}: {e}", ErrorCode.INTERNAL.value)
            self.send(BlsResult(call_id, None, error))
        finally:
            if token is not None:
                token.finish()

    async def _run_bls_stream(self, call: Bls) -> None:
        """A decoupled BLS call (``exec(decoupled=True)``): one :class:`BlsResult` per
        response of the target, the last one ``final`` (``outputs={}`` for a final flag
        sent alone, an error as the final answer)."""
        call_id = call.call_id
        final_sent = False
        try:
            if self.server is None:
                raise internal("BLS is not available: the model has no server")
            arrays = {
                name: self.peer.read(desc, release=True) for name, desc in call.inputs.items()
            }
            request = InferRequest(
                model_name=call.model_name,
                model_version=call.version,
                inputs=arrays,
                outputs=[RequestedOutput(n) for n in call.output_names] or None,
                id=call.request_id,
                parameters=call.parameters,
            )
            del arrays
            async with contextlib.aclosing(self.server.infer_stream(request)) as items:
                async for item in items:
                    if item.error is not None:
                        error = Error(item.error.message, item.error.code.triton_code.value)
                        self.send(BlsResult(call_id, None, error, item.final))
                    else:
                        outputs = item.response.outputs if item.response is not None else {}
                        descs = {
                            name: shm.write_tensor(arr, self.pool.alloc)
                            for name, arr in outputs.items()
                        }
                        self.send(BlsResult(call_id, descs, None, item.final))
                    final_sent = item.final
        except asyncio.CancelledError:
            raise
        except InferError as e:
            if not final_sent:
                error = Error(e.message, e.code.triton_code.value)
                self.send(BlsResult(call_id, None, error, True))
        except Exception as e:  # a server fault still answers the worker
            log.exception("decoupled BLS call from %s failed", self.name)
            if not final_sent:
                error = Error(f"{type(e).__name__}: {e}", ErrorCode.INTERNAL.value)
                self.send(BlsResult(call_id, None, error, True))

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


def bls_token(parents: list[CancelToken | None], parameters: dict[str, Any]) -> CancelToken:
    """The cancellation token of a BLS call made while a batch runs: cancelled once
    every request of that batch is (a batch of one: with its request; the same error),
    or when the call's own ``timeout`` parameter (µs) expires."""
    timeout_ns = parse_timeout_us(parameters) * 1000
    live = [t for t in parents if t is not None]
    if live and len(live) == len(parents):
        if len(live) == 1:
            return live[0].child(timeout_ns)
        token = CancelToken()
        left = [len(live)]

        def one_gone(parent: CancelToken) -> None:
            left[0] -= 1
            if left[0] == 0:
                token.cancel(parent.error)

        for t in live:
            t.add_callback(one_gone)
        if timeout_ns:
            token.set_deadline(timeout_ns)
        return token
    token = CancelToken()
    if timeout_ns:
        token.set_deadline(timeout_ns)
    return token


def _model_file(spec: ModelSpec) -> Path:
    return cfgmod.find_model_file(spec.config, spec.version_dir)


def _init_message(
    spec: ModelSpec,
    mode: str,
    instance: str,
    kind: str,
    device: int,
    cores: frozenset[int] | None = None,
) -> WorkerInit:
    return WorkerInit(
        mode=mode,
        model_file=str(_model_file(spec)),
        version_dir=str(spec.version_dir),
        model_dir=str(spec.model_dir),
        model_name=spec.name,
        model_version=spec.version,
        model_config=json.dumps(cfgmod.config_to_json(spec.config)),
        instance_name=instance,
        instance_kind=kind,
        device_id=device,
        cpu_cores=sorted(cores) if cores else None,
        server_pid=os.getpid(),
        cuda_visible_devices=cuda_visible_devices_for(device) if kind == "GPU" else None,
    )


class PythonBackend(Backend):
    """Runs ``model.py`` models (``backend: "python"``) in worker processes.

    Args:
        import_always: auto-complete imports every model in a worker, also one
            without ``auto_complete_config`` (``pdserve check`` proves that each
            imports); the server imports only those that define it, at auto-complete.
        autocomplete_timeout_s: seconds the auto-complete worker may take to import
            the model and answer before it is killed.
    """

    name = cfgmod.PYTHON_BACKEND
    in_process = False

    def __init__(
        self, *, import_always: bool = False, autocomplete_timeout_s: float = START_TIMEOUT_S
    ) -> None:
        self.import_always = import_always
        self.autocomplete_timeout_s = autocomplete_timeout_s

    async def auto_complete(self, spec: ModelSpec) -> None:
        """Run the model's static ``auto_complete_config`` in a worker, if it has one.

        A coroutine (the model code runs in a worker process): the model manager
        awaits what ``Backend.auto_complete`` returns when it is awaitable.

        The worker gets the configuration as Triton's JSON, imports ``model.py``,
        calls ``TritonPythonModel.auto_complete_config(pb_utils.ModelConfig)`` and
        returns the (possibly changed) configuration, which replaces ``spec.config``.

        Raises:
            FileNotFoundError: no ``model.py`` in the version folder.
            pdserve.config.ConfigError: importing the model raised (field
                ``import``, path: the model file), ``auto_complete_config`` raised or
                returned a configuration that does not parse, or the worker died or
                did not answer within :attr:`autocomplete_timeout_s` (field
                ``auto_complete_config``, path: config.pbtxt).
        """
        model_file = _model_file(spec)
        source = model_file.read_text(encoding="utf-8", errors="replace")
        if not self.import_always and "auto_complete_config" not in source:
            return
        where = str(spec.model_dir / cfgmod.CONFIG_FILENAME)
        init = _init_message(spec, "autocomplete", f"{spec.name}_autocomplete", "CPU", 0)
        conn = await WorkerConnection.start(f"{spec.name}_autocomplete", init, spec.server)
        timeout = self.autocomplete_timeout_s
        try:
            answer = await asyncio.wait_for(conn.autocomplete, timeout)
        except RuntimeError as e:
            await conn.stop(5.0)
            raise cfgmod.ConfigError(where, "auto_complete_config", str(e)) from None
        except TimeoutError:
            await conn.kill()  # a hung import does not read "stop"
            raise cfgmod.ConfigError(
                where,
                "auto_complete_config",
                f"the worker importing {model_file} did not answer within {timeout:g} s "
                "(an import or auto_complete_config that hangs?); it was killed",
            ) from None
        except BaseException:  # cancelled (shutdown while loading): no waiting
            await conn.kill()
            raise
        await conn.stop(5.0)
        if answer.error is not None and answer.stage == "import":
            raise cfgmod.ConfigError(model_file, "import", f"importing it raised {answer.error}")
        if answer.error is not None or answer.config is None:
            raise cfgmod.ConfigError(
                where,
                "auto_complete_config",
                f"auto_complete_config of {model_file} raised {answer.error}",
            )
        spec.config.CopyFrom(cfgmod.config_from_json(answer.config, where))

    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """Start one worker per instance (``instance_group``), wait for ``initialize``.

        Raises:
            RuntimeError: a worker failed to import the model or ``initialize``
                raised (the message names the instance and the exception), or a
                ``KIND_GPU`` group names a GPU this process cannot see
                (:func:`pdserve.backends.devices.check_gpu_ids`; Triton refuses such a
                group too).
        """
        from tritonclient.grpc import model_config_pb2 as mc

        plans: list[tuple[str, str, int, frozenset[int] | None]] = []
        groups = list(spec.config.instance_group) or [None]
        for gi, group in enumerate(groups):
            count = group.count if group is not None and group.count > 0 else 1
            gname = group.name if group is not None and group.name else f"{spec.name}_{gi}"
            kind = "CPU"
            devices = [0]
            if group is not None:
                kind_name = mc.ModelInstanceGroup.Kind.Name(group.kind)
                if kind_name == "KIND_GPU":
                    kind, devices = "GPU", (list(group.gpus) or [0])
                    check_gpu_ids(gname, devices)
                elif kind_name == "KIND_MODEL":
                    kind = "MODEL"
            n = 0
            for device in devices:
                cores = instance_cores(spec.host_policies, group, device)
                for _ in range(count):
                    plans.append((f"{gname}_{n}", kind, device, cores))
                    n += 1
        instances = [PythonInstance(spec, *plan) for plan in plans]
        try:
            results = await asyncio.gather(*(i.start() for i in instances), return_exceptions=True)
        except asyncio.CancelledError:  # shutdown while loading: starting workers are
            # killed by their own cancelled start; stop the ones already initialized
            await asyncio.gather(
                *(i.abort(CANCEL_GRACE_S) for i in instances), return_exceptions=True
            )
            raise
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await asyncio.gather(*(i.close() for i in instances), return_exceptions=True)
            raise failures[0]
        return list(instances)


class PythonInstance(ModelInstance):
    """One model instance = one worker process (restarted when it dies).

    Args:
        cores: the host policy's CPU ids; each worker (the first and every
            restarted one) is pinned to them. None: not pinned.
    """

    def __init__(
        self,
        spec: ModelSpec,
        name: str,
        kind: str,
        device: int,
        cores: frozenset[int] | None = None,
    ) -> None:
        self.spec = spec
        self.name = name
        self.kind = f"KIND_{kind}"
        #: CPU ids the worker process is pinned to (host policy), or None.
        self.cores = cores
        self._init = _init_message(spec, "serve", name, kind, device, cores)
        self.conn: WorkerConnection | None = None
        self._restarting: asyncio.Task[WorkerConnection] | None = None
        self._closing = False
        self._watch: asyncio.Task[None] | None = None
        self.restarts = 0
        self._retry_delay = 0.05
        self._retry_at = 0.0
        self._out_types = {o.name: cfgmod.datatype_of(o) for o in spec.config.output}
        for st in spec.config.sequence_batching.state:  # implicit state: the batcher keeps it
            self._out_types[st.output_name] = cfgmod.datatype_of(st)

        self._decoupled = bool(spec.config.model_transaction_policy.decoupled)

    async def start(self) -> None:
        """Start the worker and wait for ``initialize`` to finish.

        Raises:
            RuntimeError: import or ``initialize`` failed, or the worker died.
        """
        self.conn = await self._start_once()

    def worker_pids(self) -> list[int]:
        """The worker process's pid while one runs (empty between a death and its
        restart)."""
        return [self.conn.pid] if self.conn is not None else []

    async def _start_once(self) -> WorkerConnection:
        conn = await WorkerConnection.start(self.name, self._init, self.spec.server, self.cores)
        try:
            await asyncio.wait_for(asyncio.shield(conn.ready), START_TIMEOUT_S)
        except asyncio.CancelledError:  # shutdown while loading: initialize may block
            await conn.kill()
            raise
        except BaseException as e:
            await conn.stop(2.0)
            if isinstance(e, TimeoutError):
                raise RuntimeError(
                    f"python model instance '{self.name}' did not initialize within "
                    f"{START_TIMEOUT_S:.0f} s"
                ) from None
            if isinstance(e, RuntimeError):
                raise RuntimeError(
                    f"failed to initialize python model instance '{self.name}': {e}"
                ) from None
            raise
        self._watch = asyncio.get_running_loop().create_task(self._watch_death(conn))
        return conn

    async def _watch_death(self, conn: WorkerConnection) -> None:
        await conn.died
        if self._closing or conn.stopping or self.conn is not conn:
            return
        self.conn = None
        self._begin_restart()

    def _begin_restart(self) -> asyncio.Task[WorkerConnection]:
        task = asyncio.get_running_loop().create_task(self._restart_once())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # reported by waiters
        self._restarting = task
        return task

    async def _restart_once(self) -> WorkerConnection:
        """One attempt to replace a dead worker.

        Raises:
            Exception: the new worker failed to start (the next request tries again,
                no sooner than the back-off delay).
        """
        try:
            conn = await self._start_once()
        except Exception as e:
            self._retry_at = time.monotonic() + self._retry_delay
            log.error(
                "restarting %s failed: %s (next attempt in >= %.1f s)",
                self.name,
                e,
                self._retry_delay,
            )
            self._retry_delay = min(self._retry_delay * 2, MAX_RESTART_DELAY_S)
            raise
        if self._closing:
            await conn.stop()
            raise unavailable(f"model instance '{self.name}' is unloading")
        self._retry_delay = 0.05
        self.restarts += 1
        self.conn = conn
        log.info("restarted %s (worker pid %d)", self.name, conn.pid)
        return conn

    async def _connection(self) -> WorkerConnection:
        """The live worker, waiting for a restart in progress (or starting one).

        Raises:
            InferError(UNAVAILABLE): unloading, or the worker could not be restarted.
        """
        conn = self.conn
        if conn is not None and not conn.died.done():
            return conn
        if self._closing:
            raise unavailable(f"model instance '{self.name}' is unloading")
        self.conn = None
        task = self._restarting
        failed = task is not None and task.done() and (task.cancelled() or task.exception())
        if task is None or (failed and time.monotonic() >= self._retry_at):
            task = self._begin_restart()
        try:
            return await asyncio.shield(task)
        except InferError as e:
            raise e.fresh() from None
        except Exception as e:
            raise unavailable(
                f"python model instance '{self.name}' is unavailable: its worker process "
                f"died and could not be restarted: {e}"
            ) from None
        finally:
            task = None  # no task -> error -> frame cycle

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """Run ``batch`` in the worker: one ``execute(requests)`` call, one result each."""
        if self._decoupled:
            return await self._execute_decoupled(batch)
        conn = await self._connection()
        result = await conn.run_batch(batch)
        if result.error is not None or result.responses is None:
            error = result.error or Error("the worker sent no responses", ErrorCode.INTERNAL.value)
            error_code = ErrorCode.from_triton(error.code)
            return [InferError(error.message, error_code, reason="BACKEND") for _ in batch]
        out: list[ExecResult] = []
        for request, response in zip(batch, result.responses, strict=True):
            if isinstance(response, Error):
                out.append(
                    InferError(
                        response.message, ErrorCode.from_triton(response.code), reason="BACKEND"
                    )
                )
                continue
            outputs = conn.read_outputs(response)
            out.append(self._check_outputs(request, outputs))
        return out

    async def _execute_decoupled(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """A decoupled model's batch: the responses go into each request's
        ``request.stream`` as the worker sends them; returns once ``execute`` returned
        (the instance is free again), with an empty result per request.

        Raises:
            InferError(INTERNAL): a request without a stream (the core refuses those).
        """
        streams: list[tuple[ResponseStream, Any]] = []
        for r in batch:
            stream = r.request.stream
            if stream is None:
                raise internal("a request to a decoupled model needs a response stream")
            streams.append((stream, self._check_names))
        conn = await self._connection()
        result = await conn.run_batch(batch, streams)
        if result.error is not None:  # not sent by a live worker; kept for safety
            error = InferError(
                result.error.message, ErrorCode.from_triton(result.error.code), reason="BACKEND"
            )
            for stream, _ in streams:
                stream.fail(error.fresh())
        for r in batch:
            r.output_names = []  # the responses were checked one by one, in the stream
        return [{} for _ in batch]

    def _check_names(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray] | InferError:
        """Outputs of one streamed response must be declared (the core checks that the
        requested ones are there, their datatypes and shapes)."""
        for name in outputs:
            if name not in self._out_types:
                return internal(
                    f"python model '{self.spec.name}' returned output '{name}', which its "
                    f"model configuration does not declare"
                )
        return outputs

    def _check_outputs(
        self, request: ExecRequest, outputs: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray] | InferError:
        model = self.spec.name
        for name in request.output_names:
            if name not in outputs:
                return internal(
                    f"python model '{model}' did not return requested output '{name}' "
                    f"(it returned {sorted(outputs) or 'none'})"
                )
        for name in outputs:
            if name not in self._out_types:
                return internal(
                    f"python model '{model}' returned output '{name}', which its model "
                    f"configuration does not declare"
                )
        # datatypes, rows and dims: the scheduler's output check (pdserve.scheduling.shapes)
        return {name: outputs[name] for name in request.output_names}

    async def abort(self, grace: float) -> None:
        """Stop the worker now: ``finalize`` if it answers within ``grace`` s, else SIGKILL.

        A batch still running in it fails with ``UNAVAILABLE`` (the worker is not restarted).
        """
        self._closing = True
        if self._restarting is not None:
            self._restarting.cancel()
        conn, self.conn = self.conn, None
        if conn is not None:
            await conn.stop(grace)

    async def close(self) -> None:
        """Stop the worker (``finalize`` runs) and release its shared memory."""
        self._closing = True
        if self._restarting is not None:
            self._restarting.cancel()
            with contextlib.suppress(BaseException):
                await self._restarting
        conn, self.conn = self.conn, None
        if conn is not None:
            await conn.stop()
        if self._watch is not None:
            self._watch.cancel()
