"""Scheduler interface, the instance pool, and batch execution: statistics, trace
spans and the check of every output against the model configuration.

A scheduler owns a model's queue: it decides which requests run together and on
which model instance. Every scheduler guarantees that an instance runs at most
one batch at a time, so batches in flight never exceed the instance count.
Every batch runs through :func:`run_batch`, whose :class:`OutputCheck` makes a
model's wrong output (shape, rows, datatype) an ``INTERNAL`` error, never a 200.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import HANDOFF_NS, ExecRequest, ExecResult, ModelInstance, ModelSpec
from pdserve.core import tracing
from pdserve.core.cancel import CancelToken
from pdserve.core.datatypes import V2_TO_NUMPY, WILDCARD_DIM, numpy_to_v2, shape_str
from pdserve.core.errors import InferError, client_gone, internal, unavailable
from pdserve.core.stats import NOT_QUEUED, ModelStats
from pdserve.scheduling import rate_limiter
from pdserve.scheduling.shapes import reshape_dims, shape_matches

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2


class InputDims(Protocol):
    """What a batcher reads of one configured input."""

    @property
    def dims(self) -> list[int]:
        """Configured dims without the batch dim; -1 is variable."""
        ...

    @property
    def optional(self) -> bool:
        """The request may omit it."""
        ...

    @property
    def ragged(self) -> bool:
        """``allow_ragged_batch``."""
        ...


class SchedulerSpec(Protocol):
    """What a batcher reads of the model version it serves (the repository's
    ``ModelVersion`` is one)."""

    @property
    def name(self) -> str:
        """The model's name."""
        ...

    @property
    def config(self) -> model_config_pb2.ModelConfig:
        """The (auto-completed) model configuration: batching, queue policies, sequences."""
        ...

    @property
    def inputs(self) -> Mapping[str, InputDims]:
        """The configured inputs by name."""
        ...


class ScheduledModel(SchedulerSpec, Protocol):
    """What :func:`pdserve.scheduling.create_scheduler` and the ensemble scheduler read:
    a :class:`SchedulerSpec` with its loaded instances, statistics recorder, output
    check and load spec (an ensemble's plan in ``spec.extra``, the core in ``spec.server``)."""

    @property
    def instances(self) -> list[ModelInstance]:
        """The loaded model instances (none for an ensemble)."""
        ...

    @property
    def stats(self) -> ModelStats:
        """Where the version's statistics are recorded."""
        ...

    @property
    def output_check(self) -> OutputCheck:
        """Checks every result against the configuration."""
        ...

    @property
    def spec(self) -> ModelSpec:
        """What the version was loaded from."""
        ...


class _Output:
    """One configured output, prepared for the per-request check."""

    __slots__ = ("name", "datatype", "dtype", "dims", "variable", "model_dims", "model_variable")

    def __init__(self, io: Any) -> None:
        self.name: str = io.name
        self.datatype = cfgmod.datatype_of(io)
        #: the numpy dtype (None for BYTES: object, bytes_ or str_ arrays are accepted)
        self.dtype: np.dtype | None = (
            None if self.datatype == "BYTES" else V2_TO_NUMPY.get(self.datatype)
        )
        #: served dims (batch dim excluded), as a tuple to compare with ``shape[1:]``
        self.dims: tuple[int, ...] = tuple(int(d) for d in io.dims)
        self.variable = WILDCARD_DIM in self.dims
        #: ``reshape.shape`` when configured: what the model is declared to produce
        self.model_dims: tuple[int, ...] | None = (
            tuple(int(d) for d in io.reshape.shape) if io.HasField("reshape") else None
        )
        self.model_variable = self.model_dims is not None and WILDCARD_DIM in self.model_dims

    def dtype_ok(self, dtype: np.dtype) -> bool:
        if self.dtype is None:
            return dtype.kind in "OSU"
        if dtype == self.dtype:
            return True
        try:  # same type, other byte order
            return numpy_to_v2(dtype) == self.datatype
        except InferError:
            return False


class OutputCheck:
    """Checks (and reshapes) the outputs of one model's requests.

    **Reshape** (``model_config.proto`` ``ModelTensorReshape``): ``dims`` is the shape a
    client sends / receives, ``reshape.shape`` the shape the model itself takes /
    produces; the batch dimension (``max_batch_size > 0``) stays first and is not part of
    either. Variable-size (``-1``) dimensions keep their values, in order: Triton core
    takes the sizes at the ``-1`` positions of the shape it converts from and puts them,
    in the same order, at the ``-1`` positions of the shape it converts to
    (``InferenceRequest::Normalize`` for inputs, ``InferenceResponse::Output::Reshape``
    for outputs). :func:`reshape_dims` does this once for every backend: inputs are
    reshaped when a request is checked (``ModelVersion.prepare``), outputs by
    :class:`OutputCheck`.

    **Output check** (:class:`OutputCheck`, run by the schedulers on every result of
    every backend, ensemble steps included — the steps run on their models' schedulers —
    and on an ensemble's own outputs): each requested output must be present, have the
    configured datatype, and have the shape ``[rows] + dims`` (``rows``: the request's
    batch size, when the model batches; ``-1`` dims accept any size). An output whose
    model configuration has a ``reshape`` may come back shaped as ``reshape.shape`` (what
    the model is declared to produce; it is then reshaped to ``dims``) or already as
    ``dims``. Anything else fails that request with ``INTERNAL`` (HTTP 500, gRPC
    INTERNAL) naming the model, the output, the expected and the actual shape or
    datatype; the other requests of the batch and the server carry on.

    Triton is looser here, and pdserve deliberately stricter (a wrong output is never a
    200 — DESIGN.md), with one exception: Triton's python backend sends whatever shape
    the model returned, and python models written for it rely on that, so a model
    given ``on_shape_mismatch`` (the python backend's, unless the model asks for
    strict shapes: :mod:`pdserve.backends.python.output_shapes`) has a shape mismatch
    reported to that hook and the output served as produced. Datatypes are checked
    for every model. Triton's ONNX Runtime backend fails a request only when the batch
    output has *fewer* rows than the batch (``UNSUPPORTED``, "failed to split the
    output tensor"), silently cutting off extra rows. Triton converts no datatype, so
    neither does pdserve.

    Cost: a few tuple and dtype comparisons per output of each request; no work per
    element (a reshape is a numpy view).

    Args:
        config: the model's (auto-completed) ``ModelConfig``.
        on_shape_mismatch: None: a shape mismatch fails the request. Else it is told
            of each one (output name, expected shape: ``[rows] + dims`` when the model
            batches, the produced shape) and the output is served as produced.
    """

    __slots__ = ("model", "batching", "_outputs", "on_shape_mismatch")

    def __init__(
        self,
        config: Any,
        on_shape_mismatch: Callable[[str, list[int], tuple[int, ...]], None] | None = None,
    ) -> None:
        self.model: str = config.name
        self.batching: bool = config.max_batch_size > 0
        self._outputs: dict[str, _Output] = {o.name: _Output(o) for o in config.output}
        self.on_shape_mismatch = on_shape_mismatch

    def results(self, batch: list[ExecRequest], results: list[ExecResult]) -> list[ExecResult]:
        """:meth:`check` every successful result of ``batch`` (one result per request).

        Returns:
            ``results`` with each output dict checked / reshaped, or replaced by its
            ``INTERNAL`` error; errors already there are kept.
        """
        check = self.check
        for i, (request, result) in enumerate(zip(batch, results, strict=True)):
            if type(result) is dict:
                results[i] = check(request, result)
        return results

    def check(
        self, request: ExecRequest, outputs: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray] | InferError:
        """Check the outputs of one request against the configuration.

        Args:
            request: the request (its ``output_names`` and ``batch_size``).
            outputs: output name -> array, as the backend returned them.

        Returns:
            ``outputs`` (a new dict when an output was reshaped from
            ``reshape.shape`` to ``dims``), or an ``INTERNAL`` :class:`InferError`
            naming the model, the output, and the expected and actual shape /
            datatype (or the missing output).
        """
        specs = self._outputs
        reshaped: dict[str, np.ndarray] | None = None
        for name in request.output_names:
            arr = outputs.get(name)
            if arr is None:
                return internal(
                    f"model '{self.model}' did not return requested output '{name}' "
                    f"(it returned {sorted(outputs) or 'none'})"
                )
            spec = specs.get(name)
            if spec is None:  # not in the configuration: prepare() refuses to ask for it
                continue
            dtype = arr.dtype
            if dtype is not spec.dtype and not spec.dtype_ok(dtype):
                try:
                    got = numpy_to_v2(dtype)
                except InferError:
                    got = f"numpy {dtype}"
                return internal(
                    f"model '{self.model}' returned output '{name}' as {got}, but its "
                    f"model configuration says {spec.datatype}"
                )
            shape = arr.shape
            if self.batching:
                rows = request.batch_size
                if not shape or shape[0] != rows:
                    error = self._mismatch(spec, shape, rows)
                    if error is not None:
                        return error
                    continue
                rest = shape[1:]
            else:
                rows = -1
                rest = shape
            if rest == spec.dims or (spec.variable and shape_matches(rest, spec.dims)):
                continue
            model_dims = spec.model_dims
            if model_dims is not None and (
                rest == model_dims or (spec.model_variable and shape_matches(rest, model_dims))
            ):
                try:
                    served = reshape_dims(rest, model_dims, spec.dims)
                    arr = arr.reshape((rows, *served) if self.batching else served)
                except ValueError:  # pragma: no cover - the configuration check prevents it
                    return self._shape_error(spec, shape, rows)
                if reshaped is None:
                    reshaped = dict(outputs)
                reshaped[name] = arr
                continue
            error = self._mismatch(spec, shape, rows)
            if error is not None:
                return error
        return outputs if reshaped is None else reshaped

    def _mismatch(self, spec: _Output, shape: tuple[int, ...], rows: int) -> InferError | None:
        """An output shaped other than configured: the error that fails the request, or
        None after telling ``on_shape_mismatch`` (the output is served as produced)."""
        hook = self.on_shape_mismatch
        if hook is None:
            return self._shape_error(spec, shape, rows)
        hook(spec.name, ([rows] if self.batching else []) + list(spec.dims), shape)
        return None

    def _shape_error(self, spec: _Output, shape: tuple[int, ...], rows: int) -> InferError:
        lead = [rows] if self.batching else []
        expected = shape_str(lead + list(spec.dims))
        if spec.model_dims is not None:
            expected += f" (or its reshape.shape {shape_str(lead + list(spec.model_dims))})"
        message = (
            f"model '{self.model}' returned output '{spec.name}' with shape "
            f"{shape_str(shape)}, expected {expected}"
        )
        if self.batching:
            got_rows = shape[0] if shape else "no"
            if got_rows != rows:
                message += f": {got_rows} rows for a request of {rows} rows"
        return internal(message)


class InstancePool:
    """Free model instances handed out in strict FIFO order of the waiters.

    (An ``asyncio.Queue`` let one coroutine grab back the instance it had just
    freed and starve the others — DESIGN.md — so waiters are served in order.)
    """

    def __init__(self, instances: list[ModelInstance]) -> None:
        self.instances = list(instances)
        self._free: deque[ModelInstance] = deque(instances)
        self._waiters: deque[asyncio.Future[ModelInstance]] = deque()

    @property
    def idle(self) -> int:
        """Number of instances not running a batch."""
        return len(self._free)

    def try_acquire(self) -> ModelInstance | None:
        """An idle instance, or None when all are busy or others wait first."""
        if self._free and not self._waiters:
            return self._free.popleft()
        return None

    async def acquire(self) -> ModelInstance:
        """Wait for an idle instance (FIFO among waiters)."""
        inst = self.try_acquire()
        if inst is not None:
            return inst
        fut: asyncio.Future[ModelInstance] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            raise

    def release(self, instance: ModelInstance) -> None:
        """Give ``instance`` to the oldest waiter, or mark it idle."""
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(instance)
                return
        self._free.append(instance)


class InstanceWatch:
    """What the watchdog (:mod:`pdserve.scheduling.watchdog`) knows of one instance: its
    batch in flight, which :func:`run_batch` stamps, and its health.

    :func:`run_batch` only stores ``batch`` and ``start_ns`` when a batch starts and
    clears ``batch`` when it returns (reading ``wedged``); the watchdog's periodic sweep
    does all the comparing, so a watched batch costs two attribute stores.

    Attributes:
        batch: the batch the instance runs (None: idle).
        start_ns: ``time.monotonic_ns()`` of that batch's start (set with ``batch``).
        seen_ns: the ``start_ns`` of the batch the sweep last took ``mark`` for (a
            different value: a batch the sweep has not looked at yet).
        since: ``time.monotonic()`` seconds of the batch's start or its last progress.
        mark: the instance's progress counter when last looked at.
        wedged: the running batch was declared wedged (its requests fail).
        healthy: False from a wedge until the instance is recovered (or, when it
            cannot be, until the wedged batch returns).
        wedges / streak: wedges in all / in quick succession (the back-off's step).
    """

    __slots__ = (
        "model",
        "version",
        "bound_s",
        "instance",
        "batch",
        "start_ns",
        "seen_ns",
        "since",
        "mark",
        "wedged",
        "healthy",
        "wedges",
        "streak",
        "last_wedge",
        "recovering",
    )

    def __init__(self, model: str, version: str, bound_s: float, instance: ModelInstance) -> None:
        self.model, self.version, self.bound_s = model, version, bound_s
        self.instance = instance
        self.batch: list[ExecRequest] | None = None
        self.start_ns = 0
        self.seen_ns = -1
        self.since = 0.0
        self.mark = 0
        self.wedged = False
        self.healthy = True
        self.wedges = 0
        self.streak = 0
        self.last_wedge = 0.0
        self.recovering: asyncio.Task[None] | None = None

    def held_s(self, now: float) -> float | None:
        """Seconds the running batch has gone without progress at ``time.monotonic()``
        ``now``; None when the instance is idle or its batch is already wedged. The
        first look at a batch takes the instance's progress mark (progress counts from
        then on); later looks restart the clock when the mark moved."""
        if self.batch is None or self.wedged:
            return None
        if self.seen_ns != self.start_ns:  # a batch not looked at yet
            self.seen_ns = self.start_ns
            self.since = self.start_ns / 1e9
            self.mark = self.instance.progress()
        elif now - self.since >= self.bound_s:
            mark = self.instance.progress()
            if mark != self.mark:  # a decoupled model sent responses: it moves
                self.mark, self.since = mark, now
        return now - self.since

    def returned(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """The wedged ``batch`` returned: ``UNAVAILABLE`` for each of its requests; the
        instance is healthy again unless it is being recovered."""
        self.wedged = False
        if self.recovering is None:
            self.healthy = True
        message = (
            f"model instance '{self.instance.name}' of model '{self.model}' version "
            f"{self.version} was wedged: it held this request more than {self.bound_s:g} s "
            "without progress and is being restarted"
        )
        return [unavailable(message) for _ in batch]


async def run_batch(
    instance: ModelInstance,
    batch: list[ExecRequest],
    stats: ModelStats,
    check: OutputCheck | None = None,
) -> list[ExecResult]:
    """Execute ``batch`` on ``instance``, record execution statistics.

    Sets ``compute_ns`` on every request. An exception from the instance becomes
    the result (an :class:`InferError`, ``INTERNAL`` unless it is one) of every
    request in the batch, so one bad batch never escapes into the scheduler.
    With ``check`` (the model's :class:`OutputCheck`),
    every request's outputs are checked against the configuration (datatype, rows,
    dims; ``reshape`` applied); a request whose outputs are wrong gets ``INTERNAL``.

    With the rate limiter on (:mod:`pdserve.scheduling.rate_limiter`), the batch first
    waits for the resources the instance's group names (the wait counts as queue time)
    and gives them back when it ends, however it ends.

    When a request of the batch is traced (:mod:`pdserve.core.tracing`), its ``queue``
    and ``compute`` spans (``compute_input`` / ``compute_infer`` / ``compute_output``
    inside, split where the backend marked them) are added under its model span.
    """
    limiter = rate_limiter.active
    slot = None if limiter is None else limiter.slot(instance)
    if slot is not None:
        await slot.limiter.acquire(slot, batch)
    try:
        traced = None
        if tracing.state.enabled and (
            batch[0].request.trace is not None
            or (len(batch) > 1 and any(r.request.trace is not None for r in batch))
        ):
            traced = _trace_begin(batch)
        watch = getattr(instance, "watch", None)  # duck-typed instances have none
        handoff = HANDOFF_NS.set(0)
        start = time.monotonic_ns()
        if watch is not None:  # InstanceWatch: the watchdog's sweep compares
            watch.batch = batch
            watch.start_ns = start
        try:
            results = await instance.execute(batch)
            if len(results) != len(batch):
                raise internal(
                    f"model instance {instance.name} returned {len(results)} responses for "
                    f"{len(batch)} requests"
                )
        except InferError as e:
            # one error object per request, without this frame's traceback: a shared or
            # traceback-holding error would keep every request of the batch alive
            results = [e.fresh() for _ in batch]
        except RuntimeError as e:
            if "after shutdown" in str(e):  # an executor closed under us: the server is stopping
                results = [
                    unavailable(f"model instance {instance.name} is shutting down: {e}")
                    for _ in batch
                ]
            else:
                results = [internal(f"RuntimeError: {e}") for _ in batch]
        except Exception as e:  # a backend fault fails its batch only
            results = [internal(f"{type(e).__name__}: {e}") for _ in batch]
        except BaseException:  # cancelled: the batch is over for the watchdog too
            if watch is not None:
                watch.batch = None
                if watch.wedged:
                    watch.returned(batch)
            raise
        if watch is not None:
            watch.batch = None
            if watch.wedged:  # declared wedged (scheduling.watchdog): its requests fail
                results = watch.returned(batch)
        # the model's execution: not the hand-over to its instance's thread and back
        elapsed = time.monotonic_ns() - start - HANDOFF_NS.get()
        HANDOFF_NS.reset(handoff)
        rows = sum(r.batch_size for r in batch)
        stats.record_execution(rows, 0, elapsed, 0)
        stats.record_compute(len(batch), 0, elapsed, 0)
        for r in batch:
            r.compute_ns = elapsed
        if traced is not None:
            _trace_end(traced, instance, batch, start, start + elapsed)
        if check is not None:
            results = check.results(batch, results)
    finally:
        if slot is not None:
            slot.limiter.release(slot)
    return results


_Traced = tuple[Any, tracing.ComputeMarks, list[tuple[ExecRequest, tracing.TraceRef, str, str]]]


def _trace_begin(batch: list[ExecRequest]) -> _Traced:
    """Install the batch's :class:`~pdserve.core.tracing.ComputeMarks` (span ids chosen
    now, so that a backend can hang its own spans under ``compute_infer``)."""
    marks = tracing.ComputeMarks()
    ids = []
    for r in batch:
        ref = r.request.trace
        if ref is not None:
            compute_id, infer_id = tracing.new_span_id(), tracing.new_span_id()
            ids.append((r, ref, compute_id, infer_id))
            marks.infer_spans[id(r)] = (ref, infer_id)
    return tracing.set_marks(marks), marks, ids


def _trace_end(
    traced: _Traced, instance: ModelInstance, batch: list[ExecRequest], start: int, end: int
) -> None:
    """Record the queue and compute spans of the batch's traced requests."""
    token, marks, ids = traced
    tracing.reset_marks(token)
    input_end = min(max(marks.input_end_ns or start, start), end)
    output_start = min(max(marks.output_start_ns or end, input_end), end)
    attrs = {
        "pdserve.batch_size": sum(r.batch_size for r in batch),
        "pdserve.batch_requests": len(batch),
        "pdserve.model_instance": instance.name,
    }
    for r, ref, compute_id, infer_id in ids:
        trace, parent = ref.trace, ref.span_id or ref.parent_id
        trace.add("queue", parent, start - r.queue_ns, start)
        trace.add("compute", parent, start, end, attrs, compute_id)
        trace.add("compute_input", compute_id, start, input_end)
        trace.add("compute_infer", compute_id, input_end, output_start, None, infer_id)
        trace.add("compute_output", compute_id, output_start, end)


class Scheduler(abc.ABC):
    """Accepts requests for one model version and runs them on its instances."""

    #: ``submit`` follows the request's :class:`~pdserve.core.cancel.CancelToken` itself
    #: (answers the token's error as soon as it cancels, taking a queued request out of
    #: its queue): the server awaits it without :func:`~pdserve.core.cancel.run_cancellable`.
    follows_token = False

    def __init__(
        self, pool: InstancePool, stats: ModelStats, check: OutputCheck | None = None
    ) -> None:
        self.pool = pool
        self.stats = stats
        #: checks every result against the model configuration (None: unchecked)
        self.check = check

    @abc.abstractmethod
    async def submit(self, request: ExecRequest) -> dict[str, np.ndarray]:
        """Run one request; return its outputs.

        Raises:
            InferError: rejected (queue full or timeout: ``UNAVAILABLE``), cancelled
                (``CLIENT_GONE``), or failed in the model (``INTERNAL`` or the model's
                code, with the model's message).
        """

    async def close(self, timeout: float | None = None) -> bool:
        """Stop accepting; queued requests are finished or failed, not dropped.

        Returns:
            True when the scheduler has nothing running any more, False when work
            was still running after ``timeout`` seconds (``None``: no limit).
        """
        return True

    async def cancel_running(self) -> None:  # noqa: B027 - optional hook
        """Fail (``UNAVAILABLE``) what the scheduler still runs; the instances are stopping."""


@dataclass(slots=True, eq=False)
class QueuedRequest:
    """A request waiting in a batcher's queue: the future its ``submit`` awaits and
    when it was queued (``time.monotonic_ns``). Equal only to itself."""

    req: ExecRequest
    fut: asyncio.Future[dict[str, np.ndarray]]
    enq_ns: int


class BatchingScheduler(Scheduler):
    """A scheduler that runs each batch as its own task (the dynamic and sequence
    batchers): it keeps the running tasks in ``_tasks`` until they are done."""

    def __init__(
        self, pool: InstancePool, stats: ModelStats, check: OutputCheck | None = None
    ) -> None:
        super().__init__(pool, stats, check)
        #: the running batches (a task adds ``_tasks.discard`` as its done callback)
        self._tasks: set[asyncio.Task[None]] = set()

    async def _wait_batches(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` s (``None``: no limit) for the running batches.

        Returns:
            True when none is running any more.
        """
        if not self._tasks:
            return True
        if timeout is not None and timeout <= 0:
            return False
        _, pending = await asyncio.wait(list(self._tasks), timeout=timeout)
        return not pending

    async def cancel_running(self) -> None:
        """Cancel the batches still running: their requests get ``UNAVAILABLE`` at once."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)


def is_cancelled(request: ExecRequest) -> bool:
    """True when the client that sent ``request`` has gone away (or its token cancelled):
    a pushed :class:`~pdserve.core.cancel.CancelToken` is read, anything else polled."""
    cancelled = request.request.cancelled
    if cancelled is None:
        return False
    if cancelled.__class__ is CancelToken and cancelled.probe is None:
        return cancelled.error is not None
    return bool(cancelled())


class Unloaded(Scheduler):
    """The scheduler of a model version whose instances are not loaded yet: refuses
    every request (``UNAVAILABLE``, not queued)."""

    def __init__(self, stats: ModelStats) -> None:
        super().__init__(InstancePool([]), stats)

    async def submit(self, request: ExecRequest) -> dict[str, np.ndarray]:
        """Refuse ``request``."""
        raise unavailable(
            f"model '{self.stats.name}' has no loaded instances: request not accepted",
            reason=NOT_QUEUED,
        )


class DirectScheduler(Scheduler):
    """No batching: each request runs alone on the next free instance (FIFO)."""

    follows_token = True  # see Scheduler.follows_token and submit

    async def submit(self, request: ExecRequest) -> dict[str, np.ndarray]:
        """Wait for a free instance and run ``request`` alone on it.

        The request's token cancelling meanwhile (client gone, ``timeout``) cancels
        this wait and answers the token's error, as
        :func:`~pdserve.core.cancel.run_cancellable` does: the task waits in
        ``token.waiters``, and no token method runs unless the token cancels.
        """
        token = request.request.cancelled
        task = None
        if token.__class__ is CancelToken:
            if token.probe is not None:
                token()  # polled: cancels it when the probe says the client went away
            if token.error is not None:
                raise token.error.fresh()
            task = asyncio.current_task(token.loop)
            assert task is not None
            token.waiters.append(task)
        try:
            enqueued = time.monotonic_ns()
            self.stats.pending += 1
            try:
                instance = await self.pool.acquire()
            finally:
                self.stats.pending -= 1
            try:
                request.queue_ns = time.monotonic_ns() - enqueued
                if is_cancelled(request):
                    raise client_gone()
                (result,) = await run_batch(instance, [request], self.stats, self.check)
            finally:
                self.pool.release(instance)
            if isinstance(result, InferError):
                try:
                    raise result
                finally:
                    result = None  # type: ignore[assignment]  # no error -> traceback -> frame cycle
            return result
        except asyncio.CancelledError:
            error = None if task is None else token.interruption(task)
            if error is None:
                raise
            raise error from None
        finally:
            if task is not None:
                if token.error is None:  # not cancelled: the task is still a waiter
                    token.waiters.remove(task)
                else:
                    token.leave(task)
                task = None  # no error -> traceback -> frame -> task cycle
