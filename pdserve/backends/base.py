"""The backend interface: what a scheduler hands a model instance, and what comes back.

As in Triton's backend API, a model instance sees a *batch of requests* (a list),
never HTTP or gRPC. Backends that run one merged tensor (ONNX Runtime) concatenate
the requests' inputs along the batch dimension themselves (:func:`merge_batch`)
and split the outputs back (:func:`split_batch`); the Python backend hands the
list to ``TritonPythonModel.execute(requests)`` unchanged.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pdserve.core.api import ModelRunner
from pdserve.core.errors import InferError, internal, unavailable
from pdserve.core.types import InferRequest

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2

log = logging.getLogger("pdserve.backends")


@dataclass(slots=True)
class ExecRequest:
    """One request as a model instance sees it.

    Attributes:
        inputs: input name -> array (batch dim first when the model batches).
        output_names: outputs to compute (every model output when none were asked).
        request: the originating request (id, parameters) — read-only.
        batch_size: rows in this request (1 when the model does not batch).
        queue_ns: set by the scheduler: ns from enqueue until an instance took it.
        compute_ns: set by the scheduler: ns its batch spent executing.
    """

    inputs: dict[str, np.ndarray]
    output_names: list[str]
    request: InferRequest
    batch_size: int = 1
    queue_ns: int = 0
    compute_ns: int = 0


#: What an instance returns per request: outputs by name, or the error for that request.
ExecResult = dict[str, np.ndarray] | InferError


@dataclass
class ModelSpec:
    """Everything a backend needs to load one version of one model.

    Attributes:
        name: model name.
        version: numeric version.
        config: the (auto-completed) ``ModelConfig`` protobuf.
        model_dir: ``<repository>/<model>``.
        version_dir: ``<repository>/<model>/<version>``.
        repository: the model repository root.
        server: the core, for ensemble steps and BLS calls
            (:class:`~pdserve.core.api.ModelRunner`); may be None.
        host_policies: the server's host policies, policy name -> CPU ids
            (``--host-policy``); a backend pins each instance to
            :func:`pdserve.backends.host_policy.instance_cores` of its group. Empty: no pinning.
    """

    name: str
    version: int
    config: model_config_pb2.ModelConfig
    model_dir: Path
    version_dir: Path
    repository: Path
    server: ModelRunner | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    host_policies: dict[str, frozenset[int]] = field(default_factory=dict)


class ModelInstance(abc.ABC):
    """One model instance (Triton's "model instance"): runs one batch at a time.

    Schedulers guarantee that :meth:`execute` is never entered twice at once on
    the same instance.
    """

    #: instance name, e.g. ``"tiny_0"`` (Triton names them ``<model>_<n>``).
    name: str = ""
    #: ``"KIND_CPU"`` / ``"KIND_GPU"`` / ``"KIND_MODEL"``.
    kind: str = "KIND_CPU"
    #: the watchdog's record of this instance
    #: (:class:`pdserve.scheduling.watchdog.InstanceWatch`); None: not watched.
    watch: Any = None
    #: times the instance was started again (a worker that died or was wedged).
    restarts: int = 0

    @abc.abstractmethod
    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """Run ``batch`` and return one result per request, in order.

        An exception raised here fails every request of the batch with a 500.
        """

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the instance's resources (sessions, worker processes)."""

    async def abort(self, grace: float) -> None:  # noqa: B027 - optional hook
        """Stop now, failing (503) the batch running: the shutdown timeout has passed.

        Backends that can (the python backend: kill the worker after ``grace`` s)
        end a batch that would never finish; the others let it run.
        """

    def ready(self) -> bool:
        """Whether the instance can serve now. True unless the backend knows better: a
        remote model's instance is ready only while its target is
        (:mod:`pdserve.backends.remote.backend`); the model version's readiness
        (``/v2/models/<m>/ready``) requires every instance to be."""
        return True

    def progress(self) -> int:
        """A counter that moves while the instance makes progress on its batch without
        finishing it (a decoupled model's responses); the watchdog does not declare an
        instance wedged while it moves. Default: 0 (only finishing counts)."""
        return 0

    async def check_ready(self, timeout_s: float) -> tuple[bool, str] | None:
        """The model's own readiness hook (a python model's ``is_ready()``), waited
        for at most ``timeout_s`` s: ``(ready, why not)``, or None when there is no
        hook or it cannot be asked now (the previous answer stands)."""
        return None

    def has_ready_hook(self) -> bool:
        """The model has a readiness hook (:meth:`check_ready` asks it)."""
        return False

    async def recover(self, delay_s: float, reason: str) -> bool:
        """Tear a wedged instance down and start it again, ``delay_s`` s after the
        teardown (the watchdog's back-off); its batch in flight ends as it may (its
        requests are failed by the watchdog).

        Returns:
            True once the instance serves again; False when it cannot be recovered
            (the default: an in-process instance cannot stop a call in progress; it
            counts as not ready until its batch returns).
        """
        return False

    def worker_pids(self) -> list[int]:
        """Process ids of the worker processes this instance runs in (empty: it runs
        in the server process). The model manager sums their resident memory to
        size the model version (``memory_source: worker_rss``)."""
        return []


class Backend(abc.ABC):
    """A backend: turns a :class:`ModelSpec` into model instances."""

    #: the ``backend`` name in config.pbtxt.
    name: str = ""
    #: instances live in the server process (their memory is measured as the server's
    #: Rss delta around the load, loads serialized); False: in worker processes
    #: (:meth:`ModelInstance.worker_pids`).
    in_process: bool = True

    def auto_complete(self, spec: ModelSpec) -> Awaitable[None] | None:  # noqa: B027 - optional hook
        """Fill in and check ``spec.config`` from the model file, in place.

        May be a coroutine (the python backend runs model code for it): the model
        manager awaits what it returns when that is awaitable.

        Raises:
            pdserve.config.ConfigError: the config disagrees with the model file.
        """

    def usable_gpus(self) -> list[int]:
        """The CUDA device ids this backend can put model instances on here.

        ``KIND_AUTO`` instance groups become ``KIND_GPU`` on these, ``KIND_CPU``
        when empty (Triton's ``NormalizeInstanceGroup``). Default: every GPU this
        process sees (:func:`pdserve.backends.devices.visible_gpus`); a backend
        that also needs a GPU build of its runtime narrows it.
        """
        from pdserve.backends.devices import visible_gpus

        return visible_gpus()

    @abc.abstractmethod
    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """Create the model's instances (per ``instance_group``).

        Raises:
            Exception: any failure; the model is then reported UNAVAILABLE with the
                exception's message as the reason.
        """


def merge_batch(batch: list[ExecRequest], ragged: Collection[str] = ()) -> dict[str, np.ndarray]:
    """Concatenate each input of several requests along dim 0.

    Args:
        batch: requests with the same input names, each array shaped
            ``[rows_i, ...]``; non-batch dims must agree (the dynamic batcher only
            groups requests whose shapes agree) except for ragged inputs.
        ragged: names of ``allow_ragged_batch`` inputs. As in Triton's ONNX
            Runtime backend, each is flattened and the requests' values are
            concatenated into one 1-D tensor ``[sum(elements_i)]`` (also for a
            single request); the model finds the boundaries in a batch input
            (:func:`batch_input_tensors`).

    Returns:
        input name -> array ``[sum(rows_i), ...]``. A single request without
        ragged inputs is returned without copying.
    """
    if len(batch) == 1 and not ragged:
        return batch[0].inputs
    names = batch[0].inputs.keys()
    return {
        n: np.concatenate([r.inputs[n].reshape(-1) for r in batch])
        if n in ragged
        else (
            batch[0].inputs[n] if len(batch) == 1 else np.concatenate([r.inputs[n] for r in batch])
        )
        for n in names
    }


#: ``BatchInput.Kind`` values of model_config.proto that :func:`batch_input_tensors` builds.
_BATCH_ELEMENT_COUNT = 0
_BATCH_ACCUMULATED_ELEMENT_COUNT = 1
_BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO = 2
_BATCH_MAX_ELEMENT_COUNT_AS_SHAPE = 3


def batch_input_tensors(
    batch_inputs: Iterable[model_config_pb2.BatchInput], batch: list[ExecRequest]
) -> dict[str, np.ndarray]:
    """The ``batch_input`` tensors of a batch (Triton's BackendInputCollector).

    For each ``BatchInput`` of the configuration, with ``count_i`` the element
    count of request *i*'s ``source_input`` (batch dim included):

    - ``BATCH_ELEMENT_COUNT``: ``[count_i ...]``, shape ``[requests]``;
    - ``BATCH_ACCUMULATED_ELEMENT_COUNT``: running sums, shape ``[requests]``;
    - ``BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO``: ``0`` then the running sums,
      shape ``[requests + 1]``;
    - ``BATCH_MAX_ELEMENT_COUNT_AS_SHAPE``: zeros of shape ``[max(count_i)]``.

    The dtype is FP32 when ``data_type`` is ``TYPE_FP32``, else INT32.

    Raises:
        InferError(INVALID_ARG): an unsupported kind (``BATCH_ITEM_SHAPE*``) or a request
            without the source input.
    """
    out: dict[str, np.ndarray] = {}
    for bi in batch_inputs:
        source = bi.source_input[0] if len(bi.source_input) else ""
        counts = []
        for r in batch:
            arr = r.inputs.get(source)
            if arr is None:
                raise InferError(f"batch input source '{source}' is missing from a request")
            counts.append(int(arr.size))
        dtype = np.float32 if bi.data_type == 11 else np.int32  # 11: TYPE_FP32
        if bi.kind == _BATCH_ELEMENT_COUNT:
            value = np.asarray(counts, dtype=dtype)
        elif bi.kind == _BATCH_ACCUMULATED_ELEMENT_COUNT:
            value = np.cumsum(counts).astype(dtype)
        elif bi.kind == _BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO:
            value = np.concatenate([[0], np.cumsum(counts)]).astype(dtype)
        elif bi.kind == _BATCH_MAX_ELEMENT_COUNT_AS_SHAPE:
            value = np.zeros(max(counts), dtype=dtype)
        else:
            raise InferError(f"batch input kind {bi.kind} is not supported")
        for target in bi.target_name:
            out[target] = value
    return out


def wanted_outputs(batch: list[ExecRequest]) -> list[str]:
    """Every output some request of ``batch`` asks for, once each, in order of first ask."""
    return list(dict.fromkeys(n for r in batch for n in r.output_names))


def split_batch(batch: list[ExecRequest], outputs: dict[str, np.ndarray]) -> list[ExecResult]:
    """Split merged outputs ``[sum(rows_i), ...]`` back per request (views, no copy).

    Each request gets only the outputs it asked for.

    A single request's outputs are returned as they are: the scheduler's output
    check (:class:`pdserve.scheduling.base.OutputCheck`) compares each request's outputs with
    the configuration.

    Raises:
        InferError(INTERNAL): an output's first dim does not equal the total rows
            (the message names the model, the output, the expected rows and the shape).
    """
    if len(batch) == 1:
        req = batch[0]
        return [{n: outputs[n] for n in req.output_names}]
    total = sum(r.batch_size for r in batch)
    checked: set[str] = set()  # each merged output's rows are checked once per batch
    results: list[ExecResult] = []
    offset = 0
    for req in batch:
        end = offset + req.batch_size
        out: dict[str, np.ndarray] = {}
        for n in req.output_names:
            arr = outputs[n]
            if n not in checked:
                if arr.ndim == 0 or arr.shape[0] != total:
                    shape = "[" + ",".join(str(d) for d in arr.shape) + "]"
                    got = arr.shape[0] if arr.ndim else "no"
                    raise internal(
                        f"model '{req.request.model_name}' returned output '{n}' with shape "
                        f"{shape}, expected [{total},...]: {got} rows for a batch of {total} "
                        f"rows from {len(batch)} requests"
                    )
                checked.add(n)
            out[n] = arr[offset:end]
        results.append(out)
        offset = end
    return results


_T = TypeVar("_T")


#: Nanoseconds the batch being executed spent handed over to its instance's thread and
#: back (the thread's wake-up, then the event loop's), added by :func:`run_on_thread`:
#: the scheduler leaves them out of the batch's compute time, which, as Triton's
#: backends measure it on the instance's thread, is the model's own execution.
HANDOFF_NS: ContextVar[int] = ContextVar("pdserve_handoff_ns", default=0)


async def run_on_thread(
    executor: ThreadPoolExecutor, closed: bool, instance: str, fn: Callable[..., _T], *args: object
) -> _T:
    """``fn(*args)`` on the own thread (``executor``) of the model instance ``instance``;
    the hand-over's nanoseconds are added to :data:`HANDOFF_NS`.

    Raises:
        InferError: :func:`unloading` when ``closed``, or when the executor was shut
            down meanwhile (the batch did not run).
    """
    if closed:
        raise unloading(instance)
    marks = [0, 0]  # on the thread: when fn started, when it ended

    def timed() -> _T:
        marks[0] = time.monotonic_ns()
        try:
            return fn(*args)
        finally:
            marks[1] = time.monotonic_ns()

    sent = time.monotonic_ns()
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, timed)
    except RuntimeError as e:
        if "shutdown" in str(e) and executor._shutdown:  # ThreadPoolExecutor's own flag
            raise unloading(instance) from None
        raise
    finally:
        if marks[1]:
            away = marks[0] - sent + time.monotonic_ns() - marks[1]
            HANDOFF_NS.set(HANDOFF_NS.get() + away)


#: :class:`InlineRuns`' default: a batch runs inline on the event loop while the
#: instance's average run is shorter (handing it to a thread and back costs as much).
INLINE_RUN_MAX_S = 0.0005
#: Inline runs longer than this, INLINE_STICKY_RUNS of an instance's last
#: INLINE_STICKY_WINDOW inline runs, move an ``auto`` instance to its thread for good. A
#: share rather than a streak: a preempted process makes runs look long now and then, a
#: model whose work is on other threads makes every inline run long.
INLINE_STICKY_LIMIT_S = 0.002
INLINE_STICKY_RUNS = 4
INLINE_STICKY_WINDOW = 8
#: An instance's first runs, wherever they ran, never count toward that rule: a
#: framework's first calls optimise its graph and grow its buffers, and are long once.
INLINE_WARMUP_RUNS = 8
_WINDOW_MASK = (1 << INLINE_STICKY_WINDOW) - 1
#: Where :class:`InlineRuns` runs a batch.
RUN_MODES = ("auto", "loop", "thread")


class InlineRuns:
    """Where an in-process instance runs its batches: inline on the event loop while its
    runs are short, else on the instance's own thread.

    Modes: ``thread``, always on the instance's thread (an instance pinned by a host
    policy runs there: its thread is the pinned one); ``loop``, always inline; ``auto``,
    on the thread except while the moving average of a run is under ``max_s`` s, where
    the hand-off to the thread and back would cost about as much as the run.

    A run's duration is, on the thread, that thread's CPU time (waiting for the GIL to
    come back from a busy loop must not make a short run look long); inline, the
    smaller of wall and process CPU time (what the loop was blocked for, less time the
    process was preempted; a framework's own worker threads count). A run whose work is
    on other threads looks short on the thread however long it is: inline, runs over
    :data:`INLINE_STICKY_LIMIT_S`, :data:`INLINE_STICKY_RUNS` of the last
    :data:`INLINE_STICKY_WINDOW` inline runs, move ``auto`` to ``thread`` for good (once
    past the instance's first :data:`INLINE_WARMUP_RUNS` runs).
    One long inline run alone moves it only until the average comes down.

    The instance asks, then runs and reports (its own code is never called back from
    here, on the loop or on its thread): ::

        if runs.inline():
            mark = runs.start(closed)
            try:
                out = run(...)
            finally:
                runs.ran_inline(mark)
        else:
            out = await run_on_thread(executor, closed, name, timed_run, ...)

    where ``timed_run`` (on the thread) wraps ``run`` in :meth:`start_on_thread` /
    :meth:`ran_on_thread`.

    Args:
        instance: the instance's name (errors, the log).
        mode: ``auto``, ``loop`` or ``thread``.
        max_s: ``auto``'s bound on the average run, seconds.

    Raises:
        ValueError: ``mode`` is not one of :data:`RUN_MODES`.
    """

    def __init__(self, instance: str, mode: str = "auto", max_s: float = INLINE_RUN_MAX_S):
        if mode not in RUN_MODES:
            raise ValueError(f"run mode '{mode}' is not one of {', '.join(RUN_MODES)}")
        self.instance = instance
        self.mode = mode
        self.max_s = max_s
        #: moving average of a run, seconds (0: none yet).
        self.avg_run_s = 0.0
        #: the last INLINE_STICKY_WINDOW counted inline runs, one bit each (1: long)
        self._long_inline = 0
        self._runs = 0

    def inline(self) -> bool:
        """Whether the next batch runs inline on the event loop."""
        return self.mode == "loop" or (self.mode == "auto" and 0.0 < self.avg_run_s < self.max_s)

    def _note(self, seconds: float) -> None:
        self._runs += 1
        avg = self.avg_run_s
        self.avg_run_s = seconds if avg == 0.0 else avg * 0.9 + seconds * 0.1

    def start(self, closed: bool) -> tuple[float, float]:
        """The mark of an inline run starting now: (wall, process CPU time), seconds.

        Raises:
            InferError: :func:`unloading` when ``closed`` (the batch does not run).
        """
        if closed:
            raise unloading(self.instance)
        return time.perf_counter(), time.process_time()

    def ran_inline(self, mark: tuple[float, float]) -> None:
        """Note the inline run that began at ``mark`` (:meth:`start`) and has just ended."""
        seconds = min(time.perf_counter() - mark[0], time.process_time() - mark[1])
        self._note(seconds)
        if self.mode != "auto" or self._runs <= INLINE_WARMUP_RUNS:
            return
        window = (self._long_inline << 1 | (seconds > INLINE_STICKY_LIMIT_S)) & _WINDOW_MASK
        self._long_inline = window
        if window.bit_count() >= INLINE_STICKY_RUNS:
            self.mode = "thread"
            log.info(
                "%s: %d of its last %d inline runs took over %.0f ms (the last %.1f ms): it "
                "runs on its own thread from now on",
                self.instance,
                window.bit_count(),
                INLINE_STICKY_WINDOW,
                INLINE_STICKY_LIMIT_S * 1e3,
                seconds * 1e3,
            )

    def start_on_thread(self) -> float:
        """The mark of a run starting now on the instance's thread (called there): the
        thread's CPU time, seconds."""
        return time.thread_time()

    def ran_on_thread(self, mark: float) -> None:
        """Note the run on the instance's thread that began at ``mark``
        (:meth:`start_on_thread`) and has just ended (called there)."""
        self._note(time.thread_time() - mark)


async def execute_on_thread(
    batch: list[ExecRequest],
    executor: ThreadPoolExecutor,
    closed: bool,
    instance: str,
    run: Callable[[dict[str, np.ndarray], list[str]], dict[str, np.ndarray]],
    failure: Callable[[Exception], str],
) -> list[ExecResult]:
    """An in-process instance's ``execute``: merge ``batch`` along its batch dimension,
    call ``run(inputs, wanted_outputs)`` on the instance's own thread, split the outputs
    back per request.

    Raises:
        InferError: :func:`unloading` (503) as :func:`run_on_thread`; an ``InferError``
            ``run`` raised (the model's own); any other exception a 500 whose message is
            ``failure(exception)`` (it names the framework and the model).
    """
    inputs = merge_batch(batch)
    wanted = wanted_outputs(batch)
    try:
        outputs = await run_on_thread(executor, closed, instance, run, inputs, wanted)
    except InferError:
        raise
    except Exception as e:
        raise internal(failure(e)) from e
    return split_batch(batch, outputs)


async def gather_loads(
    futures: list[asyncio.Future[_T]], executors: Iterable[ThreadPoolExecutor | None]
) -> list[_T]:
    """The results of the instances' loads (one future each, on their ``executors``).

    Raises:
        BaseException: the first load's error, once every other load has finished and
            every executor has been shut down (without waiting for its thread).
    """
    try:
        return await asyncio.gather(*futures)
    except BaseException:
        await asyncio.gather(*futures, return_exceptions=True)
        for executor in executors:
            if executor is not None:
                executor.shutdown(wait=False)
        raise


def unloading(instance: str) -> InferError:
    """The error of a batch that reached an instance already closed (UNAVAILABLE)."""
    return unavailable(f"model instance '{instance}' is unloading: the request did not run")
