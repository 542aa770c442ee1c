"""One loaded model version: its configuration, instances, scheduler, statistics.

:class:`ModelVersion` also owns the per-request checks that Triton makes before a
request reaches a scheduler (input names, datatypes, shapes, batch size, requested
outputs) and the classification extension on the way out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import ExecRequest, ModelInstance, ModelSpec
from pdserve.backends.python import output_shapes
from pdserve.core.datatypes import NUMPY_TO_V2, WILDCARD_DIM, bytes_array, numpy_to_v2
from pdserve.core.errors import InferError
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest, RequestedOutput
from pdserve.scheduling.base import OutputCheck, Scheduler, Unloaded
from pdserve.scheduling.shapes import reshape_dims

if TYPE_CHECKING:
    from pdserve.core.monitor import VersionObserver
    from pdserve.repository.breaker import CircuitBreaker

log = logging.getLogger("pdserve.model")

#: Seconds an instance aborted at the shutdown / unload timeout gets before it is
#: killed (the python backend: its worker process, SIGKILL).
ABORT_GRACE_S = 1.0
#: Seconds to wait, after aborting the instances, for the requests they held to fail.
ABORT_WAIT_S = 5.0


@dataclass(slots=True)
class IOSpec:
    """One input or output as the configuration declares it.

    Attributes:
        name: tensor name.
        datatype: V2 datatype name (``"FP32"``, ``"BYTES"``...).
        dims: configured dims *without* the batch dim; -1 is variable.
        optional: inputs only: the request may omit it.
        ragged: inputs only: ``allow_ragged_batch``.
        labels: outputs only: lines of ``label_filename`` (classification).
        reshape: inputs only: ``reshape.shape`` when configured (the shape the model
            gets instead of ``dims``, batch dim excluded), else None.
    """

    name: str
    datatype: str
    dims: list[int]
    optional: bool = False
    ragged: bool = False
    labels: list[str] | None = None
    reshape: tuple[int, ...] | None = None


def _shape_str(shape: Iterable[int]) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


class ModelVersion:
    """A model version that is loaded (or being loaded / unloaded).

    Attributes:
        name / version: identity; ``version`` is the numeric version.
        config: the auto-completed ``ModelConfig``.
        max_batch_size: 0 when the model does not batch.
        inputs / outputs: :class:`IOSpec` by name, in config order.
        instances: the model instances.
        scheduler: runs requests (set by the manager once instances exist; until then
            one that refuses every request).
        stats: statistics extension counters.
        inflight: requests accepted and not yet answered.
    """

    def __init__(self, spec: ModelSpec, platform: str, backend: str) -> None:
        cfg = spec.config
        self.spec = spec
        self.name = spec.name
        self.version = spec.version
        self.version_str = str(spec.version)
        self.config = cfg
        self.platform = platform
        self.backend = backend
        self.max_batch_size = cfg.max_batch_size
        #: ``model_transaction_policy { decoupled: true }``: streamed responses only
        #: (``InferenceServer.infer_stream``).
        self.decoupled = bool(cfg.model_transaction_policy.decoupled)
        self.inputs: dict[str, IOSpec] = {}
        for i in cfg.input:
            self.inputs[i.name] = IOSpec(
                i.name,
                cfgmod.datatype_of(i),
                list(i.dims),
                optional=i.optional,
                ragged=i.allow_ragged_batch,
                reshape=tuple(i.reshape.shape) if i.HasField("reshape") else None,
            )
        self.outputs: dict[str, IOSpec] = {}
        for o in cfg.output:
            labels = None
            if o.label_filename:
                path = spec.model_dir / o.label_filename
                labels = path.read_text(encoding="utf-8").splitlines()
            self.outputs[o.name] = IOSpec(
                o.name, cfgmod.datatype_of(o), list(o.dims), labels=labels
            )
        self.required_inputs = [n for n, s in self.inputs.items() if not s.optional]
        #: input name -> its dims as a tuple when none is -1 and it is not ragged (the
        #: shape check is then one tuple comparison), else None
        self._fixed_dims: dict[str, tuple[int, ...] | None] = {
            n: tuple(s.dims) if -1 not in s.dims and not s.ragged else None
            for n, s in self.inputs.items()
        }
        #: checks (and reshapes) every result the scheduler gets back (datatype, rows, dims)
        self.stats = ModelStats(self.name, self.version_str)
        # a python model's output is served with the shape it produced, as in Triton,
        # unless it asks for strict shapes (pdserve.backends.python.output_shapes)
        hook = None
        if backend == cfgmod.PYTHON_BACKEND:
            hook = output_shapes.tolerance(
                cfg, self.stats, str(spec.model_dir / cfgmod.CONFIG_FILENAME)
            )
        self.output_check = OutputCheck(cfg, hook)
        self.instances: list[ModelInstance] = []
        #: replaced by the model manager once the instances are loaded
        self.scheduler: Scheduler = Unloaded(self.stats)
        self.inflight = 0
        #: the version's circuit breaker (None: it has none), looked up by the server
        #: on the version's first request (``breaker_known``)
        self.breaker: CircuitBreaker | None = None
        self.breaker_known = False
        #: the monitoring observer (:class:`pdserve.core.monitor.VersionObserver`) the
        #: server attaches after warm-up; None: not monitored.
        self.observer: VersionObserver | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.config_json: dict[str, Any] = cfgmod.config_to_json(cfg)
        self._metadata: dict[str, Any] | None = None
        #: the version's :class:`~pdserve.repository.health.ModelHealth` (set by the
        #: server once it is warmed up; stopped at close); None: none.
        self.health: Any = None
        #: instances whose readiness hook (``is_ready()``) says not ready.
        self.hooks_down: set[str] = set()
        #: the canary probe failed its allowed number of times in a row.
        self.probe_down = False

    def instances_ready(self) -> bool:
        """The version can serve now: its canary probe is not failing and at least
        one instance is healthy: :meth:`ModelInstance.ready` (a python worker runs; a
        remote model's target answers ready), not wedged
        (:mod:`pdserve.scheduling.watchdog`), its readiness hook not false. A version
        without instances (an ensemble) is ready."""
        if self.probe_down:
            return False
        instances = self.instances
        if not instances:
            return True
        down = self.hooks_down
        for inst in instances:
            watch = getattr(inst, "watch", None)
            if inst.ready() and (watch is None or watch.healthy) and inst.name not in down:
                return True
        return False

    # -- metadata -------------------------------------------------------------

    def io_shape(self, spec: IOSpec) -> list[int]:
        """Full shape as V2 metadata reports it (batch dim -1 first when batching)."""
        return ([-1] if self.max_batch_size > 0 else []) + spec.dims

    def metadata(self, versions: list[str]) -> dict[str, Any]:
        """V2 model metadata (``GET /v2/models/{m}[/versions/{v}]``).

        Args:
            versions: the ``versions`` to list: every ready version when the request
                named none, else only the one it named (as Triton does).
        """
        return {
            "name": self.name,
            "versions": versions,
            "platform": self.platform,
            "inputs": [
                {"name": s.name, "datatype": s.datatype, "shape": self.io_shape(s)}
                for s in self.inputs.values()
            ],
            "outputs": [
                {"name": s.name, "datatype": s.datatype, "shape": self.io_shape(s)}
                for s in self.outputs.values()
            ],
        }

    # -- request checks -------------------------------------------------------

    # hot path: runs once per request; a split adds a call per request (benchmarks/RESULTS.md)
    def prepare(self, request: InferRequest) -> ExecRequest:
        """Check ``request`` against the configuration and build its ExecRequest.

        Raises:
            InferError(INVALID_ARG): unknown/missing input, datatype or shape that
                disagrees with the configuration, batch size over
                ``max_batch_size``, inputs with different batch sizes, unknown
                requested output, classification asked of a non-numeric output.
        """
        name = self.name
        batch_size = 1
        seen_batch: int | None = None
        inputs: dict[str, np.ndarray] | None = None
        fixed_dims = self._fixed_dims
        for in_name, arr in request.inputs.items():
            spec = self.inputs.get(in_name)
            if spec is None:
                raise InferError(
                    f"unexpected inference input '{in_name}' for model '{name}'; "
                    f"expected one of {list(self.inputs)}"
                )
            dt = NUMPY_TO_V2.get(arr.dtype) or numpy_to_v2(arr.dtype)
            if dt != spec.datatype:
                raise InferError(
                    f"inference input '{in_name}' data-type is '{dt}', but model '{name}' "
                    f"expects '{spec.datatype}'"
                )
            shape = arr.shape
            dims = spec.dims
            if self.max_batch_size > 0:
                if len(shape) == 0:
                    raise InferError(
                        f"inference input '{in_name}' for model '{name}' has no batch dimension"
                    )
                rows = shape[0]
                if rows < 1 or rows > self.max_batch_size:
                    raise InferError(
                        f"inference request batch-size must be <= {self.max_batch_size} "
                        f"for '{name}' (got {rows} for input '{in_name}')"
                    )
                if seen_batch is not None and rows != seen_batch:
                    raise InferError(
                        f"inputs of a request to model '{name}' must share one batch size; "
                        f"'{in_name}' has {rows}, another input has {seen_batch}"
                    )
                seen_batch = batch_size = rows
                rest = shape[1:]
            else:
                rest = shape
            fixed = fixed_dims[in_name]
            if fixed is not None:
                if rest != fixed:
                    expected = ([-1] if self.max_batch_size > 0 else []) + dims
                    raise InferError(
                        f"unexpected shape for input '{in_name}' for model '{name}'. "
                        f"Expected {_shape_str(expected)}, got {_shape_str(shape)}"
                    )
            elif not spec.ragged and (
                len(rest) != len(dims)
                or any(d != -1 and d != s for d, s in zip(dims, rest, strict=False))
            ):
                expected = ([-1] if self.max_batch_size > 0 else []) + dims
                raise InferError(
                    f"unexpected shape for input '{in_name}' for model '{name}'. "
                    f"Expected {_shape_str(expected)}, got {_shape_str(shape)}"
                )
            if spec.reshape is not None:
                if inputs is None:
                    inputs = dict(request.inputs)
                inputs[in_name] = self._reshape_input(spec, arr, rest)
        if len(request.inputs) < len(self.inputs):
            missing = [n for n in self.required_inputs if n not in request.inputs]
            if missing:
                raise InferError(self._missing_inputs_message(request, missing))
        if request.outputs:
            output_names = []
            for out in request.outputs:
                spec = self.outputs.get(out.name)
                if spec is None:
                    raise InferError(f"unexpected inference output '{out.name}' for model '{name}'")
                if out.classification and spec.datatype == "BYTES":
                    raise InferError(
                        f"classification is not supported for output '{out.name}' of datatype BYTES"
                    )
                if out.classification < 0:
                    raise InferError(f"classification count for '{out.name}' must be >= 0")
                output_names.append(out.name)
        else:
            output_names = list(self.outputs)
        if inputs is None:
            inputs = dict(request.inputs)
        return ExecRequest(inputs, output_names, request, batch_size)

    def _reshape_input(self, spec: IOSpec, arr: np.ndarray, rest: tuple[int, ...]) -> np.ndarray:
        """``arr`` (shape ``[batch] + rest``) as the model gets it: ``rest`` reshaped from
        ``dims`` to ``reshape.shape`` (:func:`~pdserve.scheduling.shapes.reshape_dims`),
        a view, as Triton's ``InferenceRequest::Normalize`` does for every backend.

        Raises:
            InferError(INVALID_ARG): a ragged input (its shape is not checked against
                ``dims``) that does not fit the reshape.
        """
        target = spec.reshape
        assert target is not None
        try:
            if WILDCARD_DIM in target:
                target = reshape_dims(rest, spec.dims, target)
            return arr.reshape((arr.shape[0], *target) if self.max_batch_size > 0 else target)
        except ValueError as e:
            raise InferError(
                f"input '{spec.name}' of shape {_shape_str(arr.shape)} for model '{self.name}' "
                f"cannot be reshaped from dims {_shape_str(spec.dims)} to reshape.shape "
                f"{_shape_str(spec.reshape or ())}: {e}"
            ) from None

    def _missing_inputs_message(self, request: InferRequest, missing: list[str]) -> str:
        """Triton's message for a request without every required input
        (``InferenceRequest::ValidateRequestInputs``): it names every missing one."""
        given = "[" + ",".join(f"'{n}'" for n in request.inputs) + "]"
        absent = "[" + ",".join(f"'{n}'" for n in missing) + "]"
        total, required = len(self.inputs), len(self.required_inputs)
        expected = (
            f"{total} inputs"
            if total == required
            else f"number of inputs between {required} and {total}"
        )
        return (
            f"expected {expected} but got {len(request.inputs)} inputs for model "
            f"'{self.name}'. Got input(s) {given}, but missing required input(s) {absent}. "
            "Please provide all required input(s)."
        )

    # -- responses ------------------------------------------------------------

    def finish_outputs(
        self, request: InferRequest, outputs: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Order outputs as requested and apply the classification extension."""
        if not request.outputs:
            return {n: outputs[n] for n in self.outputs if n in outputs}
        result: dict[str, np.ndarray] = {}
        for out in request.outputs:
            arr = outputs[out.name]
            if out.classification:
                arr = self._classify(arr, out, self.outputs[out.name].labels)
            result[out.name] = arr
        return result

    def _classify(
        self, arr: np.ndarray, out: RequestedOutput, labels: list[str] | None
    ) -> np.ndarray:
        """Top-K of each batch row as BYTES ``"score:index[:label]"``.

        Triton's classification extension: for a batching model the result has
        shape ``[batch, K]``, otherwise ``[K]``; scores printed with 6 decimals;
        ``label`` comes from the output's ``label_filename`` when it has one.
        """
        batched = self.max_batch_size > 0
        rows = arr.reshape(arr.shape[0], -1) if batched else arr.reshape(1, -1)
        k = min(out.classification, rows.shape[1])
        result = []
        for row in rows:
            idx = np.argsort(-row.astype(np.float64), kind="stable")[:k]
            items = []
            for i in idx:
                score = row[i]
                text = f"{float(score):f}:{int(i)}"
                if labels is not None and i < len(labels):
                    text += f":{labels[i]}"
                items.append(text)
            result.append(bytes_array(items))
        stacked = np.stack(result) if result else np.empty((0, k), dtype=object)
        return stacked if batched else stacked.reshape(k)

    # -- lifecycle ------------------------------------------------------------

    def begin(self) -> None:
        """A request was accepted."""
        self.inflight += 1
        if self.inflight == 1:  # (idle is set exactly while nothing is in flight)
            self._idle.clear()

    def end(self) -> None:
        """A request was answered."""
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False if ``timeout`` s passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def warm_up(self, warm: Callable[[ModelVersion], Awaitable[None]]) -> None:
        """Run ``warm(self)`` (the server's warm-up); close the version when it fails.

        A cancelled load (the server shuts down while the version warms up) aborts the
        instances at once (a python worker is killed after :data:`ABORT_GRACE_S`): a
        warm-up sample blocked in the model holds its instance until the model
        answers, and would hold the shutdown with it.

        Raises:
            Exception: what ``warm`` raised (``WarmupError``), after closing.
            asyncio.CancelledError: the load was cancelled, after aborting and closing.
        """
        task = asyncio.ensure_future(warm(self))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # raised below
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()  # ends a sample that waits on the server (a thread, the queue)
            await asyncio.gather(
                *(i.abort(ABORT_GRACE_S) for i in self.instances), return_exceptions=True
            )
            await asyncio.wait([task], timeout=ABORT_WAIT_S)
            await self.close(0)
            raise
        except Exception:
            await self.close()
            raise

    async def close(self, timeout: float | None = None) -> None:
        """Close the scheduler and every instance, in about ``timeout`` s at most.

        Queued requests fail with 503 at once; running ones get ``timeout`` s
        (``None``: no limit) to finish. After that the instances are aborted (a
        python worker stuck in ``execute`` is killed after :data:`ABORT_GRACE_S`)
        and what is still in flight fails with 503, so a hung model never keeps the
        server from stopping or a retired version from unloading.
        """
        if self.health is not None:
            await self.health.stop()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(0.0, timeout)

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - loop.time())

        finished = await self.scheduler.close(left())
        if finished and self.inflight and self.platform != cfgmod.ENSEMBLE_PLATFORM:
            finished = await self.drain(left())
        if not finished:
            log.warning(
                "model %s version %s: %d requests still running after the timeout; "
                "stopping its instances",
                self.name,
                self.version_str,
                self.inflight,
            )
            await asyncio.gather(
                *(i.abort(ABORT_GRACE_S) for i in self.instances), return_exceptions=True
            )
            if not await self.drain(ABORT_WAIT_S):
                await self.scheduler.cancel_running()
        await asyncio.gather(*(i.close() for i in self.instances), return_exceptions=True)
        self.instances = []


def now_ns() -> int:
    """``time.monotonic_ns()`` (one clock for every duration in statistics)."""
    return time.monotonic_ns()
