"""InferenceServer: the protocol-neutral core every frontend calls.

Frontends (HTTP, gRPC) turn the wire into :class:`~pdserve.core.types.InferRequest`
and call :meth:`InferenceServer.infer`; they never touch models or backends.
The server looks the model version up (the manager's table; traffic control for a
request naming no version of a model with traffic settings), checks the request against
the configuration, submits it to that model's scheduler and records its success or
failure, once for every protocol; the scheduler records executions and compute times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Collection, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve import __version__
from pdserve.config import ENSEMBLE_PLATFORM, ConfigError, parse_config_override
from pdserve.core import tracing
from pdserve.core.cancel import CancelToken, arm_cancellation, run_cancellable, token_of
from pdserve.core.errors import ErrorCode, InferError, client_gone, internal, unavailable
from pdserve.core.stats import NOT_QUEUED
from pdserve.core.streaming import ResponseStream, StreamItem, StreamRequired, StreamResponse
from pdserve.core.types import InferRequest, InferResponse
from pdserve.repository.breaker import BreakerBoard, CircuitBreaker, is_failure
from pdserve.repository.control import EXPLICIT_MODES, MODES
from pdserve.repository.health import DEFAULT_HANG_TIMEOUT_S, HealthBoard
from pdserve.repository.manager import ModelManager
from pdserve.repository.model import ModelVersion
from pdserve.repository.rollout import TrafficControl
from pdserve.repository.staging import check_model_name
from pdserve.repository.statistics import statistics_of
from pdserve.repository.warmup import warmup as run_warmup

if TYPE_CHECKING:
    import numpy as np

    from pdserve.backends.base import ExecRequest
    from pdserve.cache import AnyResponseCache
    from pdserve.core.api import InferenceCore, ModelHost
    from pdserve.core.monitor import ResponseMonitor
    from pdserve.core.stats import ModelStats
    from pdserve.core.tracing import RequestTracer, TraceRef
    from pdserve.repository.control import RepositoryHost

log = logging.getLogger("pdserve.server")

#: Protocol extensions advertised in server metadata (Triton names).
EXTENSIONS = [
    "classification",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "logging",
    "trace",
]


class InferenceServer:
    """The server core: health, metadata, inference, statistics, repository.

    Implements every protocol of :mod:`pdserve.core.api` (:class:`InferenceCore` for
    the frontends and the app, :class:`ModelRunner` / :class:`ModelHost` for ensembles,
    BLS and the model manager), the poller's ``RepositoryHost`` and the metrics'
    ``MetricsSource``.

    Args:
        model_repository: the model repository root.
        strict_readiness: ``ready()`` is False while any model meant to be loaded
            is not ready (Triton's ``--strict-readiness``).
        load_models: names to load at start (``None``: every model).
        host_policies: host policy name -> CPU ids the instances of that policy
            are pinned to (``--host-policy``, see :mod:`pdserve.backends.host_policy`).
        model_control_mode: ``none`` | ``poll`` | ``explicit`` (Triton's
            ``--model-control-mode``, see :mod:`pdserve.repository.control`) or
            ``on_demand`` (pdserve's: ``explicit``, and :meth:`infer` loads a model
            that is not loaded). Only ``explicit`` (the default for a library user)
            and ``on_demand`` accept repository load / unload requests; polling itself is run by the caller
            (:class:`~pdserve.repository.control.RepositoryPoller`).
        response_cache: the :class:`pdserve.cache.ResponseCache` used by models with
            ``response_cache { enable: true }`` (``--response-cache-byte-size``), or a
            :class:`pdserve.cache.RedisResponseCache` (``--cache-config redis,...``);
            None: no cache.
        memory_budget: bytes the loaded models may take together
            (``--model-memory-budget``, :mod:`pdserve.repository.budget`); None: no
            budget.
        pinned_models: models that are never evicted (``--pin-model``).
        load_wait_s: ``on_demand`` mode: how long a request waits for the load of its
            model when it gives no ``timeout`` parameter (``--model-load-wait-secs``).
        breakers: the circuit breakers (:class:`~pdserve.repository.breaker.BreakerBoard`,
            with the ``--circuit-breaker`` default policy); None: only models with a
            ``circuit_breaker`` parameter have one.
        instance_hang_timeout: ``--instance-hang-timeout``: seconds a model instance may
            hold a batch without progress before it is declared wedged; a model's
            ``instance_hang_timeout`` parameter overrides it; 0: off
            (:mod:`pdserve.scheduling.watchdog`).

    Raises:
        ValueError: an unknown ``model_control_mode``.
    """

    #: the server metadata's name (tritonserver's ``--id``)
    server_id = "pdserve"

    def __init__(
        self,
        model_repository: Path | str,
        *,
        strict_readiness: bool = False,
        load_models: list[str] | None = None,
        host_policies: Mapping[str, Collection[int]] | None = None,
        model_control_mode: str = "explicit",
        response_cache: AnyResponseCache | None = None,
        memory_budget: int | None = None,
        pinned_models: Collection[str] = (),
        load_wait_s: float = 120.0,
        breakers: BreakerBoard | None = None,
        instance_hang_timeout: float = DEFAULT_HANG_TIMEOUT_S,
    ) -> None:
        if model_control_mode not in MODES:
            raise ValueError(
                f"model control mode must be one of {', '.join(MODES)}, got {model_control_mode!r}"
            )
        self.repository = Path(model_repository)
        self.manager = ModelManager(self.repository, server=self, host_policies=host_policies)
        self.strict_readiness = strict_readiness
        self.load_models = load_models
        self._started = False
        self._shutting_down = False
        #: the response cache (``--response-cache-byte-size``), used by models with
        #: ``response_cache``; None: no cache.
        self.response_cache: AnyResponseCache | None = response_cache
        #: ``none`` | ``poll`` | ``explicit`` | ``on_demand``: only ``explicit`` and
        #: ``on_demand`` accept repository load / unload requests.
        self.model_control_mode = model_control_mode
        self.manager.budget.budget_bytes = memory_budget
        self.manager.budget.pinned = frozenset(pinned_models)
        #: seconds an on-demand request waits for its model's load by default.
        self.load_wait_s = load_wait_s
        #: requests hold their model against eviction and mark it used (LRU): only
        #: needed with a budget or on-demand loads.
        self._track_use = memory_budget is not None or model_control_mode == "on_demand"
        #: canary split, shadow traffic and rollouts of requests that name no version
        #: (:mod:`pdserve.repository.rollout`).
        self.traffic = TrafficControl(self, self.manager)
        #: circuit breakers per model version (``--circuit-breaker`` and the
        #: ``circuit_breaker`` config.pbtxt parameter; :mod:`pdserve.repository.breaker`).
        self.breakers = breakers if breakers is not None else BreakerBoard()
        #: wedged instances, readiness hooks and canary probes of every served version
        #: (:mod:`pdserve.repository.health`).
        self.health = HealthBoard(instance_hang_timeout)
        #: the tracing hook (:class:`pdserve.observability.tracing.TraceManager`, set by
        #: the app); None: no request is traced and the trace extension is unavailable.
        self.tracer: RequestTracer | None = None
        #: the model-monitoring hook (payload logs, prediction distributions, drift:
        #: :class:`pdserve.observability.monitoring.monitor.Monitor`, set by the app);
        #: None: nothing is monitored.
        self.monitor: ResponseMonitor | None = None

    # -- lifecycle ------------------------------------------------------------

    @property
    def started(self) -> bool:
        """True once :meth:`start` has loaded the initial models."""
        return self._started

    async def start(self) -> None:
        """Load the initial models (a model that fails is logged, not fatal)."""
        await self.manager.load_all(self.load_models)
        self._started = True
        self.traffic.ensure_running()

    async def stop(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests, wait up to ``timeout`` s for in-flight ones, unload."""
        self._shutting_down = True
        await self.traffic.stop()
        await self.manager.close(timeout)

    # -- health and metadata --------------------------------------------------

    def live(self) -> bool:
        """Liveness: the process serves requests (``/v2/health/live``)."""
        return not self._shutting_down

    def ready(self) -> bool:
        """Readiness (``/v2/health/ready``): started, not shutting down, and with
        ``strict_readiness`` every model meant to be loaded has a ready version."""
        if not self._started or self._shutting_down:
            return False
        if self.strict_readiness:
            return all(
                any(mv.instances_ready() for mv in e.serving.values())
                for e in self.manager.models.values()
                if e.wanted
            )
        return True

    def metadata(self) -> dict[str, Any]:
        """V2 server metadata: ``{name, version, extensions}``."""
        return {"name": self.server_id, "version": __version__, "extensions": EXTENSIONS}

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        """V2 model metadata.

        ``versions`` lists every ready version when ``version`` is empty, else only
        ``version`` (Triton's ``TRITONSERVER_ServerModelMetadata``).

        Raises:
            InferError(NOT_FOUND / UNAVAILABLE): unknown model or version, or none ready.
        """
        mv = self.manager.get(name, version)
        return mv.metadata([mv.version_str] if version else self.manager.ready_versions(name))

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        """The model's (auto-completed) configuration in Triton's JSON form.

        Raises:
            InferError(NOT_FOUND / UNAVAILABLE): unknown model or version, or none ready.
        """
        return self.manager.get(name, version).config_json

    def model_ready(self, name: str, version: str = "") -> bool:
        """True when that model version (or, with no version, the default one) is
        ready: loaded, and its instances ready (a remote model's target answers ready)."""
        try:
            mv = self.manager.get(name, version)
        except InferError:
            return False
        return not self._shutting_down and mv.instances_ready()

    # -- inference ------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run one inference request.

        With a memory budget or in ``on_demand`` mode the request holds its model
        against eviction from arrival to response and marks it used (LRU); in
        ``on_demand`` mode a model of the repository that is not loaded is loaded
        first (:meth:`ModelManager.demand`), the request waiting at most its
        ``timeout`` parameter or :attr:`load_wait_s`.

        Returns:
            the response; outputs in the requested order (or config order), with
            the classification extension applied.

        Raises:
            InferError: ``NOT_FOUND`` unknown model/version; ``INVALID_ARG`` bad
                inputs; ``UNAVAILABLE`` not ready, queue full or shutting down;
                ``CLIENT_GONE`` the client went away; ``INTERNAL`` (or the model's
                code) the model failed.
        """
        if self._shutting_down:
            raise unavailable("Server is shutting down: no new requests are accepted")
        token = request.cancelled
        if token.__class__ is not CancelToken or "timeout" in request.parameters:
            token = arm_cancellation(request)  # a token to make, wrap or give a deadline
        try:
            return await self._infer_entry(request)
        except asyncio.CancelledError:
            # the frontend abandoned the call (gRPC cancel or deadline: grpc.aio cancels
            # the handler): tell whoever still runs the request (a python worker)
            token.cancel(client_gone())
            raise
        finally:
            if token.deadline_ns:
                token.finish()  # drops the deadline's timer too
            else:
                token.finished = True

    # The request path from here to _run_on is a chain of plain methods that pick the
    # next step and return its coroutine (a tail call) rather than coroutines that await
    # it: every coroutine level is walked twice per request (when it suspends on the
    # batcher's future and when it resumes), so the common path keeps infer -> _run_on
    # -> submit (schedulers that follow the request's token themselves).

    def _infer_entry(self, request: InferRequest) -> Coroutine[Any, Any, InferResponse]:
        """:meth:`infer` once the request's cancellation token is armed."""
        tracer = self.tracer
        if tracer is not None and (tracing.state.enabled or request.traceparent is not None):
            ref = tracer.begin(request)  # sampling (and the log trace id)
            if ref is not None:
                return self._infer_traced(tracer, request, ref)
        return self._route(request)

    def _route(self, request: InferRequest) -> Coroutine[Any, Any, InferResponse]:
        """:meth:`infer` once tracing is decided: on-demand loads and the memory
        budget's hold (:meth:`_route_tracked`), then :meth:`_dispatch`."""
        if not self._track_use:
            return self._dispatch(request)
        return self._route_tracked(request)

    async def _route_tracked(self, request: InferRequest) -> InferResponse:
        """:meth:`_route` with a memory budget or on-demand loads."""
        name = request.model_name
        budget = self.manager.budget
        budget.hold(name)  # from arrival to response: never evicted meanwhile
        try:
            try:
                self.manager.get(name, request.model_version)  # loaded? (else on demand)
            except InferError:
                if self.model_control_mode != "on_demand" or not self.manager.can_demand(name):
                    raise
                await self.manager.demand(name, self._load_wait(request))
            budget.touch(name)
            return await self._dispatch(request)
        finally:
            budget.release(name)

    def _dispatch(self, request: InferRequest) -> Coroutine[Any, Any, InferResponse]:
        """Serve ``request`` on the version it names; when it names none, on the default
        version of a model without traffic settings (``ModelEntry.traffic_free``), else
        through traffic control (split, pinned, mirrored, rolled out). Raises
        InferError(NOT_FOUND / UNAVAILABLE) at once for an unknown model or version."""
        name, version = request.model_name, request.model_version
        if version:
            return self.infer_on(self.manager.get(name, version), request)
        entry = self.manager.models.get(name)
        if entry is not None and entry.traffic_free and not request.pinned_version:
            if entry.default_version is not None:
                return self.infer_on(entry.default_version, request)
        mv, routed = self.traffic.route(request)
        running = self.infer_on(mv, request)
        return running if routed is None else self.traffic.observe(routed, request, running)

    def _load_wait(self, request: InferRequest) -> float:
        """Seconds an on-demand request waits for its model: its ``timeout``
        parameter (µs) when it gives a positive integer, else :attr:`load_wait_s`."""
        value = request.parameters.get("timeout")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value / 1e6
        return self.load_wait_s

    def memory_report(self) -> dict[str, Any]:
        """The model memory budget's state for metrics: ``budget_bytes`` (None: no
        budget), ``used_bytes`` (loaded models together) and ``models``: name ->
        :class:`~pdserve.repository.budget.ModelCounters` (loads, evictions, misses)."""
        budget = self.manager.budget
        return {
            "budget_bytes": budget.budget_bytes,
            "used_bytes": self.manager.used_bytes(),
            "models": dict(sorted(budget.counters.items())),
        }

    async def _infer_traced(
        self, tracer: RequestTracer, request: InferRequest, ref: TraceRef
    ) -> InferResponse:
        """:meth:`infer` for a traced request: the root span covers it from its arrival
        until the response is ready (encoding and sending excluded)."""
        request.trace = ref
        error: str | None = None
        try:
            return await self._route(request)
        except InferError as e:
            error = e.message
            raise
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            tracer.end(request, ref, error)

    def model_folders(self, name: str, version: str = "") -> list[str]:
        """The served version's folder and its model folder (absolute paths), where a
        front end reads files shipped beside the model (a tokenizer's chat template).

        Raises:
            InferError(404 / 503): as :meth:`model_version`.
        """
        spec = self.manager.get(name, version).spec
        return [str(spec.version_dir), str(spec.model_dir)]

    def model_version(self, name: str, version: str = "") -> ModelVersion:
        """The ready model version for a step or BLS request (see :meth:`infer_on`).

        Raises:
            InferError(404): unknown model, or a version that is not served.
            InferError(503): the model exists but no version is ready.
        """
        return self.manager.get(name, version)

    def infer_on(
        self, mv: ModelVersion, request: InferRequest
    ) -> Coroutine[Any, Any, InferResponse]:
        """Run ``request`` on an already resolved model version (ensembles, BLS):
        ``await server.infer_on(mv, request)``."""
        ref = request.trace
        if ref is not None:
            return self._infer_on_traced(mv, request, ref)
        return self._infer_on(mv, request)

    def _infer_on(
        self, mv: ModelVersion, request: InferRequest
    ) -> Coroutine[Any, Any, InferResponse]:
        """:meth:`infer_on` without the trace: through the version's circuit breaker
        (:meth:`_infer_on_breaker`) when it has one."""
        if not mv.breaker_known:  # once per version: the board's policy or its parameter
            mv.breaker = self.breakers.for_version(
                mv, mv.name, mv.version_str, mv.config.parameters
            )
            mv.breaker_known = True
        breaker = mv.breaker
        if breaker is None:
            return self._run_on(mv, request, mv.stats)
        return self._infer_on_breaker(mv, request, breaker)

    async def _infer_on_breaker(
        self, mv: ModelVersion, request: InferRequest, breaker: CircuitBreaker
    ) -> InferResponse:
        """:meth:`_infer_on` through the version's circuit breaker."""
        stats = mv.stats
        probe = breaker.admit()  # raises UNAVAILABLE while the circuit is open
        try:
            response = await self._run_on(mv, request, stats)
        except BaseException as e:
            if isinstance(e, Exception) and is_failure(e):
                breaker.record(probe, failed=True)
            else:
                breaker.release(probe)
            raise
        breaker.record(probe, failed=False)
        return response

    async def _run_on(
        self, mv: ModelVersion, request: InferRequest, stats: ModelStats
    ) -> InferResponse:
        """:meth:`_infer_on` past the circuit breaker: prepare, schedule, finish, count.

        A decoupled model's responses go into ``request.stream`` (:meth:`_open_stream`);
        its response here is empty, returned once the final one is in.
        """
        decoupled = mv.decoupled
        cache_hit = False
        if decoupled:
            exec_req, finished = self._open_stream(mv, request)
        else:
            exec_req = mv.prepare(request)
            if request.trace is not None:
                request.trace.batch_size = exec_req.batch_size
        mv.begin()
        try:
            try:
                if decoupled:
                    await mv.scheduler.submit(exec_req)
                    await asyncio.shield(finished)
                    outputs: dict[str, np.ndarray] = {}
                else:
                    cache = self.response_cache
                    if cache is not None and cache.enabled_for(mv):
                        outputs, cache_hit = await self._infer_cached(cache, mv, exec_req)
                    elif mv.scheduler.follows_token:
                        outputs = await mv.scheduler.submit(exec_req)
                    else:
                        outputs = await run_cancellable(
                            token_of(request), mv.scheduler.submit(exec_req)
                        )
                    outputs = mv.finish_outputs(request, outputs)
            except BaseException as e:
                ensemble = mv.platform == ENSEMBLE_PLATFORM
                replacement = stats.record_error(e, request.arrival_ns, ensemble)
                if mv.observer is not None:
                    mv.observer.observe(request, None, replacement or e)
                if replacement is None:
                    raise
                raise replacement from e
            total_ns = time.monotonic_ns() - request.arrival_ns
            queue_ns, compute_ns = exec_req.queue_ns, exec_req.compute_ns
            stats.record_success(exec_req.batch_size, total_ns, queue_ns, compute_ns, cache_hit)
            if request.timing is not None:  # asked for (pdserve.core.timing)
                request.timing.append((mv.name, queue_ns, 0, compute_ns, 0, total_ns))
        finally:
            mv.end()
        if mv.observer is not None and not decoupled:  # monitoring: never blocks
            mv.observer.observe(request, outputs, None)
        return InferResponse(mv.name, mv.version_str, outputs, request.id)

    async def _infer_on_traced(
        self, mv: ModelVersion, request: InferRequest, ref: TraceRef
    ) -> InferResponse:
        """:meth:`infer_on` for a traced request: the model span (Triton's: named after
        the model) around it; queue and compute spans come from the scheduler."""
        start = time.monotonic_ns()
        ref.span_id = tracing.new_span_id()
        attributes: dict[str, Any] = {
            "triton.model_name": mv.name,
            "triton.model_version": mv.version,
        }
        if request.id:
            attributes["triton.request_id"] = request.id
        if ref.attributes:
            attributes.update(ref.attributes)
        try:
            response = await self._infer_on(mv, request)
            attributes["pdserve.batch_size"] = ref.batch_size
        except InferError as e:
            attributes["pdserve.error"] = e.message
            raise
        except BaseException as e:
            attributes["pdserve.error"] = f"{type(e).__name__}: {e}"
            raise
        finally:
            ref.trace.add(
                mv.name, ref.parent_id, start, time.monotonic_ns(), attributes, ref.span_id
            )
        return response

    def _open_stream(
        self, mv: ModelVersion, request: InferRequest
    ) -> tuple[ExecRequest, asyncio.Future[None]]:
        """Check a request to a decoupled model and point its ``request.stream`` at the
        model (each response checked and finished as a whole result would be).

        Returns:
            the request to submit, and the future the stream resolves once its final
            response is in (an exception: the final one was an error).

        Raises:
            InferError(UNSUPPORTED): the request has no stream (``/infer``, ``ModelInfer``,
                a non-decoupled BLS call), as Triton refuses it.
            InferError(INVALID_ARG): as :meth:`ModelVersion.prepare`.
        """
        from pdserve.backends.base import ExecRequest

        stream: ResponseStream | None = request.stream
        if stream is None:
            raise StreamRequired(
                f"model '{mv.name}' uses the decoupled transaction policy (zero or several "
                "responses per request): call it through gRPC ModelStreamInfer or HTTP "
                f"/v2/models/{mv.name}/generate_stream (or /generate)",
                ErrorCode.UNSUPPORTED,
                reason=NOT_QUEUED,
            )
        exec_req = mv.prepare(request)
        # each response is checked against the configuration as a whole result would be
        checked = ExecRequest({}, list(exec_req.output_names), request, exec_req.batch_size)
        check = mv.output_check.check
        finish = mv.finish_outputs

        def convert(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray] | InferError:
            result = check(checked, outputs)
            return result if isinstance(result, InferError) else finish(request, result)

        stream.convert = convert
        stream.model = (mv.name, mv.version_str)
        return exec_req, stream.finished

    async def infer_stream(self, request: InferRequest) -> AsyncGenerator[StreamResponse, None]:
        """Run one request and yield its responses as they come (Triton's decoupled
        semantics, docs/user_guide/decoupled_models.md).

        A decoupled model yields each response it sends; the last item has
        ``final=True`` (its ``response`` None when the model sent the final flag
        alone). Any other model yields its one response, final. A failure is a final
        item with ``error`` set: the request's ``timeout`` parameter (µs from arrival)
        bounds the whole stream ("Request timeout expired", ``UNAVAILABLE``). Closing
        the iterator early (the client went away) tells the model
        (``response_sender.is_cancelled()``) and ends the request.

        Use it as ``async with contextlib.aclosing(server.infer_stream(r)) as items``.
        """
        loop = asyncio.get_running_loop()
        stream = ResponseStream()
        request.stream = stream
        deadline: float | None = None
        timeout = request.parameters.get("timeout")
        if isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > 0:
            elapsed = (time.monotonic_ns() - request.arrival_ns) / 1e9
            deadline = loop.time() + timeout / 1e6 - elapsed
        task = loop.create_task(self.infer(request))

        def done(t: asyncio.Task[InferResponse]) -> None:
            if t.cancelled():
                stream.fail(unavailable("the request was cancelled"))
                return
            error = t.exception()
            if error is not None:
                if not isinstance(error, InferError):
                    error = internal(f"{type(error).__name__}: {error}")
                stream.fail(error)
            elif not stream.closed:  # a model that is not decoupled: its one response
                response = t.result()
                stream.model = (response.model_name, response.model_version)
                stream.put_converted(response.outputs, final=True)

        task.add_done_callback(done)
        _STREAM_TASKS.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(_STREAM_TASKS.discard)
        try:
            while True:
                item = await stream.next(deadline)
                if item is None:  # the request's timeout passed: end it (Triton's message)
                    stream.cancel(unavailable("Request timeout expired"))
                    continue
                yield _stream_response(stream, request, item)
                if item.final:
                    return
        finally:
            if not stream.closed:
                stream.cancel(InferError("the client went away", ErrorCode.CLIENT_GONE, "CANCELED"))

    async def _infer_cached(
        self, cache: AnyResponseCache, mv: ModelVersion, exec_req: ExecRequest
    ) -> tuple[dict[str, np.ndarray], bool]:
        """Response cache lookup, ``(outputs, hit)``; on a miss run the request and
        store its outputs. A hit skips the scheduler (no queue or compute time, as in
        Triton); the lookup duration is recorded as ``cache_hit`` / ``cache_miss``."""
        start = time.monotonic_ns()
        key = cache.key(mv, exec_req)
        outputs = await cache.get(key)
        end = time.monotonic_ns()
        mv.stats.record_cache(outputs is not None, end - start)
        ref = exec_req.request.trace
        if ref is not None:
            ref.trace.add(
                "cache_lookup", ref.span_id, start, end, {"pdserve.cache_hit": outputs is not None}
            )
        if outputs is not None:
            return outputs, True
        outputs = await mv.scheduler.submit(exec_req)
        await cache.put(key, outputs)
        return outputs, False

    # -- trace extension --------------------------------------------------------

    def trace_setting(
        self, model: str = "", update: Mapping[str, Any] | None = None
    ) -> dict[str, str | list[str]]:
        """Triton's trace extension: the trace settings of ``model`` ("": global),
        updated first with ``update`` when given (see
        :meth:`pdserve.observability.tracing.TraceManager.update_setting`).

        Raises:
            InferError(UNAVAILABLE): the server has no tracer ("the server does not
                support tracing", Triton's answer when built without tracing).
            InferError(INVALID_ARG): ``model`` is not a ready model ("Request for
                unknown model : <m>", Triton's), or a bad update.
            InferError(UNSUPPORTED): the update names ``trace_file``.
        """
        tracer = self.tracer
        if tracer is None:
            raise unavailable("the server does not support tracing")
        if model and not self.model_ready(model):
            raise InferError(f"Request for unknown model : {model}")
        if update is not None:
            return tracer.update_setting(model, update)
        return tracer.get_setting(model)

    # -- statistics and repository -------------------------------------------

    def model_statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        """Triton's statistics extension: ``{"model_stats": [...]}``.

        With no name, every served version of every model; with a name and no
        version, every served version of that model.

        Raises:
            InferError(INVALID_ARG): the model is unknown or has no ready version, or
                ``version`` is not one of them (HTTP 400, gRPC INVALID_ARGUMENT, as
                Triton's ``TRITONSERVER_ServerModelStatistics`` answers).
        """
        return statistics_of(self.manager.models, name, version)

    def served_model_stats(self) -> list[ModelStats]:
        """Statistics of every served model version, by model name then version (metrics)."""
        return [
            entry.serving[version].stats
            for _, entry in sorted(self.manager.models.items())
            for version in sorted(entry.serving)
        ]

    def repository_index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Repository index rows ``{name, version, state, reason}``, plus
        ``memory_bytes`` / ``memory_source`` (and ``gpu_memory_bytes``, ``pinned``)
        where known (:meth:`ModelManager.index`).

        As Triton's ``TRITONSERVER_ServerModelIndex``: ``reason`` only where there is
        one (a READY version has none unless a reload of it failed), ``version`` and
        ``state`` only for models that were loaded at some point.
        """
        rows = []
        for row in self.manager.index():
            if ready_only and row.get("state") != "READY":
                continue
            if "reason" in row and not row["reason"]:
                row = {k: v for k, v in row.items() if k != "reason"}
            rows.append(row)
        return rows

    def _check_model_control(self) -> None:
        if self.model_control_mode not in EXPLICIT_MODES:
            raise unavailable(
                "explicit model load / unload is not allowed if polling is enabled "
                f"(model control mode is '{self.model_control_mode}'; start pdserve with "
                "--model-control-mode=explicit)"
            )

    async def load_model(
        self, name: str, config: Any = None, files: dict[str, bytes] | None = None
    ) -> None:
        """Load or reload a model (repository extension).

        New and changed versions load and warm up beside the serving ones and
        traffic switches when they are ready (see :class:`ModelManager`). An
        ensemble's steps that are not loaded load first, as steps only
        (:meth:`ModelManager.load_model`).

        Args:
            config: a configuration override: Triton's JSON form (a ``str``/``bytes``
                holding one JSON object, or a ``dict``) or a ``ModelConfig``; it
                replaces config.pbtxt for this load (rollback: ``version_policy
                {specific {versions: [N]}}``). What ``GET /v2/models/{m}/config``
                returns is accepted as it is.
            files: ``{"<version>/<file>": bytes}`` (Triton's ``file:`` parameters);
                requires ``config``. As in Triton the model is then loaded from a
                temporary folder holding only ``config`` and these files: the
                repository on disk is never written, whatever the outcome.

        Raises:
            InferError(UNAVAILABLE): the model control mode is not ``explicit`` or ``on_demand``.
            InferError(INVALID_ARG): a malformed request (bad model name, a ``config``
                that is empty, not JSON, nested too deep, not an object or not a
                ModelConfig, ``file:`` without ``config``, a bad ``file:`` path), the
                model is missing, or it fails to load. Messages hold no absolute path.
        """
        self._check_model_control()
        check_model_name(name)
        try:
            override = parse_config_override(config)
        except ConfigError as e:
            raise InferError(f"failed to load '{name}': {e}") from None
        await self.manager.load_model(name, override, files)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Unload a model (repository extension); in-flight requests finish first.

        The loaded ensembles that use it are unloaded too; ``unload_dependents`` on
        an ensemble also unloads its steps loaded only for it
        (:meth:`ModelManager.unload_model`).

        Raises:
            InferError(UNAVAILABLE): the model control mode is not ``explicit`` or ``on_demand``.
            InferError(INVALID_ARG): a malformed model name, or the model is not loaded.
        """
        self._check_model_control()
        await self.manager.unload_model(name, unload_dependents)

    async def warmup(self, mv: ModelVersion) -> None:
        """Warm a freshly loaded version up before it serves (ModelManager's hook).

        The ``model_warmup`` samples of its configuration; none without
        ``model_warmup``, as in Triton (see :mod:`pdserve.repository.warmup`).

        Then the version gets its monitoring observer (``payload_log``,
        ``prediction_metrics``, ``drift`` parameters).

        Raises:
            WarmupError: a configured sample failed; the version does not serve.
            InferError(INVALID_ARG): its monitoring settings are invalid.
        """
        await run_warmup(mv)
        if self.monitor is not None:  # after warm-up: its samples are not monitored
            try:
                mv.observer = self.monitor.attach(mv, mv.spec.model_dir)
            except ValueError as e:
                raise InferError(f"monitoring: {e}", ErrorCode.INVALID_ARG) from None
        await self.health.attach(mv)


#: The running ``infer`` tasks of :meth:`InferenceServer.infer_stream` (kept alive until done:
#: a request's task may outlive the iterator that started it).
_STREAM_TASKS: set[asyncio.Task[InferResponse]] = set()


def _stream_response(
    stream: ResponseStream, request: InferRequest, item: StreamItem
) -> StreamResponse:
    """A :class:`StreamResponse` for the frontends from a stream's item."""
    response = None
    if item.outputs is not None:
        response = InferResponse(stream.model[0], stream.model[1], item.outputs, request.id)
        if item.parameters:
            response.parameters = item.parameters
    return StreamResponse(response, item.error, item.final, stream.model)


if TYPE_CHECKING:  # mypy checks that InferenceServer implements every core protocol

    def _implements(
        server: InferenceServer,
    ) -> tuple[InferenceCore, RepositoryHost, ModelHost[ModelVersion]]:
        return (server, server, server)
