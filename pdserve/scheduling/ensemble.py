"""Ensembles (``platform: "ensemble"``): pipelines of models run as one model.

An ensemble's configuration lists *steps* (``ensemble_scheduling { step [...] }``);
each step names a model (``model_name``, ``model_version``, -1 for the version
policy's choice) and maps that model's inputs from ensemble tensors
(``input_map { key: "<model input>" value: "<ensemble tensor>" }``) and its
outputs to ensemble tensors (``output_map { key: "<model output>" value:
"<ensemble tensor>" }``). Ensemble tensors are the ensemble's inputs, its outputs
and any intermediate names the steps agree on.

:class:`EnsembleBackend` validates an ensemble at load; :class:`EnsembleScheduler`
runs its requests, each step through that step model's own scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import Backend, ExecRequest, ModelInstance, ModelSpec
from pdserve.config.ensemble import EnsemblePlan, EnsembleStep, StepLookup, validate_ensemble
from pdserve.core.api import ModelRef, ModelRunner
from pdserve.core.cancel import CancelToken, token_of
from pdserve.core.errors import InferError, client_gone, internal, unavailable
from pdserve.core.types import InferRequest, RequestedOutput
from pdserve.scheduling.base import InstancePool, ScheduledModel, Scheduler, is_cancelled

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2

# --------------------------------------------------------------------------- backend


class EnsembleBackend(Backend):
    """``platform: "ensemble"``: validates the steps at load; no model instances.

    Validation at load (:func:`validate_ensemble`, Triton's ``ValidateEnsembleConfig``
    in ``ensemble_utils.cc``): every step model is loaded; every key of a map is an
    input / output of that model; every required model input is mapped; every tensor a
    step reads is an ensemble input or produced by exactly one step; no step writes an
    ensemble input; every ensemble output is produced; every ensemble input is read by
    some step; the steps form no cycle; and wherever a tensor passes between the
    ensemble and a step or between two steps, datatypes are equal and shapes agree
    (a ``-1`` matches any size; batching models contribute a leading ``-1``). An
    ensemble that batches (``max_batch_size > 0``) needs steps whose
    ``max_batch_size`` is at least its own. Every error is a
    :class:`~pdserve.config.ConfigError` naming the ensemble, the step and the tensor.

    Args:
        lookup: where the step models' configurations come from. None (the model
            manager's): the models the server (``spec.server``) has loaded.
            ``pdserve check`` passes the configurations it has checked instead.
    """

    name = cfgmod.ENSEMBLE_PLATFORM

    def __init__(self, lookup: StepLookup | None = None) -> None:
        self.lookup = lookup

    def auto_complete(self, spec: ModelSpec) -> None:
        """Validate the ensemble against its step models; keep the plan.

        The plan is stored in ``spec.extra["ensemble_plan"]``.

        Raises:
            pdserve.config.ConfigError: see :func:`validate_ensemble`.
        """
        server = spec.server

        def loaded(model_name: str, version: str) -> model_config_pb2.ModelConfig | None:
            if server is None:
                return None
            try:
                return server.model_version(model_name, version).config
            except InferError:
                return None

        lookup = self.lookup or loaded
        where = str(spec.model_dir / cfgmod.CONFIG_FILENAME)
        spec.extra["ensemble_plan"] = validate_ensemble(spec.config, lookup, where)

    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """An ensemble has no instances (its steps' models have them)."""
        if "ensemble_plan" not in spec.extra:
            self.auto_complete(spec)
        return []


# --------------------------------------------------------------------------- scheduler


class EnsembleScheduler(Scheduler):
    """Runs an ensemble request step by step as the step inputs become available.

    Execution (:class:`EnsembleScheduler`): event-driven. A step starts as soon as all
    the tensors it reads exist, so independent steps run concurrently; each step's
    request goes through that step model's own scheduler
    (``InferenceServer.infer_on``), so the predictor step batches across concurrent
    pipeline requests and shows in that model's statistics. Only the steps needed for
    the requested outputs run. When the request is cancelled (client gone, gRPC cancel or
    deadline, ``timeout`` parameter: :mod:`pdserve.core.cancel`), no further step starts
    and the steps in flight are cancelled with it (their requests share its token); steps
    get the request's remaining ``timeout``. ``ensemble_scheduling { max_inflight_requests }``
    (Triton's; 0: unlimited) bounds the requests in flight at each step: one beyond it
    waits in the ensemble. pdserve's ensemble parameter ``step_timeout_us`` cancels a step
    that runs longer (503 "Request timeout expired"). An error in a step fails that
    ensemble request with the step's error (message and code) unchanged; other requests
    are untouched. Each step's outputs are checked against its model's configuration by
    that model's scheduler, and the ensemble's outputs against the ensemble's
    (:class:`~pdserve.scheduling.base.OutputCheck`): a wrong shape or datatype is ``INTERNAL``. The
    ensemble itself has no instances and no instance limit.

    Args:
        model: the ensemble's loaded version; its ``spec.extra["ensemble_plan"]``
            comes from :class:`EnsembleBackend`; its ``spec.server`` runs the steps.
    """

    def __init__(self, model: ScheduledModel) -> None:
        super().__init__(InstancePool([]), model.stats)
        self.model = model
        self.plan: EnsemblePlan = model.spec.extra["ensemble_plan"]
        self.server = model.spec.server
        #: ``ensemble_scheduling { max_inflight_requests }`` (0: unlimited): requests
        #: in flight at each step at most; a step's request beyond it waits (backpressure).
        self.max_inflight = int(model.config.ensemble_scheduling.max_inflight_requests)
        self._step_slots: dict[int, asyncio.Semaphore] = (
            {step.index: asyncio.Semaphore(self.max_inflight) for step in self.plan.steps}
            if self.max_inflight > 0
            else {}
        )
        #: pdserve's per-step timeout (ensemble parameter ``step_timeout_us``; 0: none):
        #: a step running longer is cancelled and fails its ensemble request with 503.
        self.step_timeout_ns = _step_timeout_ns(model.config)

    async def submit(self, request: ExecRequest) -> dict[str, np.ndarray]:
        """Run the steps needed for the requested outputs; return those outputs.

        Raises:
            InferError: the first failing step's error, unchanged; 503 when a step
                model is not available any more.
        """
        if request.request.stream is not None:
            return await self._submit_decoupled(request)
        start = time.monotonic_ns()
        plan = self.plan
        tensors: dict[str, np.ndarray] = dict(request.inputs)
        wanted = request.output_names or plan.outputs
        todo = set(plan.steps_for(wanted))
        running: dict[asyncio.Task[dict[str, np.ndarray]], EnsembleStep] = {}

        def launch_ready() -> None:
            if todo and is_cancelled(request):
                # cancelled (client gone, timeout): run no further step
                raise _cancel_error(request.request, plan.name)
            for index in sorted(todo):
                step = plan.steps[index]
                if step.reads.issubset(tensors):
                    todo.discard(index)
                    task = asyncio.ensure_future(self._run_step(step, tensors, request))
                    running[task] = step

        try:
            launch_ready()
            while running:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    step = running.pop(task)
                    outputs = task.result()  # raises the step's error
                    for model_out, tensor in step.output_map.items():
                        if model_out in outputs:
                            tensors[tensor] = outputs[model_out]
                launch_ready()
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
            # a failed step's error has a traceback through this frame, and the tasks
            # hold that error: drop them here so that no cycle keeps the tensors alive
            running.clear()
            done = task = None  # type: ignore[assignment]  # no task -> error -> frame cycle
        missing = [n for n in wanted if n not in tensors]
        if missing or todo:
            raise internal(f"ensemble '{plan.name}' could not produce {missing or sorted(todo)}")
        request.compute_ns = time.monotonic_ns() - start
        # each step's outputs were checked against its model's configuration; the
        # ensemble's own may be narrower (a step's -1 dim where the ensemble is fixed)
        result = self.model.output_check.check(request, {n: tensors[n] for n in wanted})
        if isinstance(result, InferError):
            raise result
        return result

    async def _submit_decoupled(self, request: ExecRequest) -> dict[str, np.ndarray]:
        """A decoupled ensemble (``model_transaction_policy { decoupled: true }``), as
        Triton runs one: each response of a decoupled step feeds the steps after it on
        its own, and every set of tensors that reaches the ensemble's outputs is one
        response into ``request.request.stream``; the final flag follows once every
        branch is done. Steps run one after the other along each branch.

        Raises:
            InferError: the first failing step's error (the responses sent before it
                stay sent; the stream ends with this error).
        """
        start = time.monotonic_ns()
        plan = self.plan
        stream = request.request.stream
        wanted = request.output_names or plan.outputs

        async def expand(tensors: dict[str, np.ndarray], todo: frozenset[int]) -> None:
            if todo and is_cancelled(request):
                raise client_gone(
                    f"request was cancelled: the client went away (ensemble '{plan.name}' "
                    "stopped between steps)"
                )
            ready = [i for i in sorted(todo) if plan.steps[i].reads.issubset(tensors)]
            if not ready:
                missing = [n for n in wanted if n not in tensors]
                if missing or todo:
                    raise internal(
                        f"ensemble '{plan.name}' could not produce {missing or sorted(todo)}"
                    )
                if not stream.closed:
                    stream.put({n: tensors[n] for n in wanted}, final=False)
                return
            step = plan.steps[ready[0]]
            rest = todo - {ready[0]}
            async for outputs in self._step_responses(step, tensors, request):
                branch = dict(tensors)
                for model_out, tensor in step.output_map.items():
                    if model_out in outputs:
                        branch[tensor] = outputs[model_out]
                await expand(branch, rest)

        await expand(dict(request.inputs), frozenset(plan.steps_for(wanted)))
        request.compute_ns = time.monotonic_ns() - start
        stream.put(None, final=True)
        return {}

    def _step_model(self, step: EnsembleStep) -> tuple[ModelRunner, ModelRef]:
        """The core and the ready version of ``step``'s model.

        Raises:
            InferError(UNAVAILABLE): the step model is not available any more.
        """
        server = self.server
        if server is None:  # unreachable: an ensemble loads only when its steps were found
            raise internal(f"ensemble '{self.plan.name}' has no server to run its steps")
        try:
            return server, server.model_version(step.model_name, step.model_version)
        except InferError as e:
            raise unavailable(
                f"ensemble '{self.plan.name}': step model '{step.model_name}' is not "
                f"available: {e.message}"
            ) from None

    async def _step_responses(
        self, step: EnsembleStep, tensors: dict[str, np.ndarray], parent: ExecRequest
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        """The outputs of each response of one step: one for a step model that is not
        decoupled, each non-empty one of a decoupled step model."""
        server, mv = self._step_model(step)
        if not mv.decoupled:
            yield await self._run_step(step, tensors, parent)
            return
        origin = parent.request
        sub = InferRequest(
            model_name=step.model_name,
            model_version=mv.version_str,
            inputs={m: tensors[t] for m, t in step.input_map.items() if t in tensors},
            outputs=[RequestedOutput(name) for name in step.output_map],
            id=origin.id,
            parameters=_step_parameters(origin.parameters),
            cancelled=origin.cancelled,
        )
        async with contextlib.aclosing(server.infer_stream(sub)) as items:
            async for item in items:
                if item.error is not None:
                    raise item.error
                if item.response is not None:
                    yield item.response.outputs

    async def _run_step(
        self, step: EnsembleStep, tensors: dict[str, np.ndarray], parent: ExecRequest
    ) -> dict[str, np.ndarray]:
        inputs = {m: tensors[t] for m, t in step.input_map.items() if t in tensors}
        origin = parent.request
        sub = InferRequest(
            model_name=step.model_name,
            model_version=step.model_version,
            inputs=inputs,
            outputs=[RequestedOutput(name) for name in step.output_map],
            id=origin.id,
            parameters=_step_parameters(origin.parameters),
            cancelled=origin.cancelled,
            timing=origin.timing,  # each step's entry goes into the ensemble request's
        )
        parent_token = token_of(origin)
        step_token: CancelToken | None = None
        if parent_token is not None:
            # the step inherits the ensemble request's remaining time; with a step
            # timeout it has its own (earlier) deadline on a child token
            if self.step_timeout_ns or parent_token.deadline_ns:
                step_token = sub.cancelled = parent_token.child(self.step_timeout_ns)
            remaining = (step_token or parent_token).remaining_us()
            if remaining:
                sub.parameters["timeout"] = remaining
        if origin.trace is not None:  # the step's model span hangs under the ensemble's
            sub.trace = origin.trace.child(
                {"pdserve.ensemble": self.plan.name, "pdserve.ensemble_step": step.index}
            )
        server, mv = self._step_model(step)
        slot = self._step_slots.get(step.index)
        try:
            if slot is None:
                response = await server.infer_on(mv, sub)
            else:
                async with slot:  # max_inflight_requests: wait for the step's room
                    if is_cancelled(parent):
                        raise _cancel_error(origin, self.plan.name)
                    response = await server.infer_on(mv, sub)
        finally:
            if step_token is not None:
                step_token.finish()
        return response.outputs


def _cancel_error(request: InferRequest, ensemble: str) -> InferError:
    """The error of an ensemble request cancelled between steps: its token's (client
    gone or timeout), else ``CLIENT_GONE``."""
    token = token_of(request)
    if token is not None and token.error is not None:
        err = token.error.fresh()
        err.message = f"{err.message} (ensemble '{ensemble}' stopped between steps)"
        return err
    return client_gone(
        f"request was cancelled: the client went away (ensemble '{ensemble}' stopped between steps)"
    )


def _step_timeout_ns(config: model_config_pb2.ModelConfig) -> int:
    """The ensemble's ``step_timeout_us`` parameter in ns (0: none or not a positive
    integer)."""
    param = config.parameters.get("step_timeout_us")
    text = param.string_value.strip() if param is not None else ""
    return int(text) * 1000 if text.isdigit() else 0


def _step_parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Request parameters handed on to steps: priority, timeout and user keys.

    Output-format keys of the frontends (``binary_data_output``...) stay with the
    ensemble's response.
    """
    return {k: v for k, v in parameters.items() if not k.startswith("binary_data")}
