"""Model health beyond "loaded": wedged instances, readiness hooks and canary probes.

:class:`HealthBoard` (one per server) sets each freshly loaded version up from its
config.pbtxt ``parameters`` (a bad value fails the load, naming it):
``instance_hang_timeout`` (s; 0 off; default ``--instance-hang-timeout``: the
:class:`~pdserve.scheduling.watchdog.Watchdog` bound); ``is_ready_interval`` /
``is_ready_timeout`` (s, default 5 / 5, Triton's: a python model's ``is_ready()``);
``probe_interval`` (s; absent: no probe), ``probe_timeout`` (2), ``probe_failures`` (3),
``probe_input`` (JSON ``{"INPUT": nested list}``, default the first ``model_warmup``
sample): a canary inference failing ``probe_failures`` times in a row makes the model
not ready until one succeeds. Probes run on an instance of the scheduler's pool and
count in their own statistics (``pdserve_probe_total``), never as requests. Readiness
itself is :meth:`~pdserve.repository.model.ModelVersion.instances_ready`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.core.datatypes import V2_TO_NUMPY
from pdserve.core.errors import InferError
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest
from pdserve.repository.model import ModelVersion
from pdserve.repository.warmup import build_samples
from pdserve.scheduling.base import run_batch
from pdserve.scheduling.watchdog import Watchdog

log = logging.getLogger("pdserve.health")

#: ``--instance-hang-timeout``'s default, seconds.
DEFAULT_HANG_TIMEOUT_S = 300.0
#: The config.pbtxt ``parameters`` this module reads (see the module docstring).
HEALTH_PARAMETERS = frozenset(
    (
        "instance_hang_timeout",
        "is_ready_interval",
        "is_ready_timeout",
        "probe_interval",
        "probe_timeout",
        "probe_failures",
        "probe_input",
    )
)

Sample = tuple[str, str, str, dict[str, str], float]


def _seconds(cfg: cfgmod.ModelConfig, key: str, default: float, where: str) -> float:
    """A non-negative number of seconds from config parameter ``key``.

    Raises:
        pdserve.config.ConfigError: not a finite number >= 0.
    """
    p = cfg.parameters.get(key)
    if p is None:
        return default
    text = p.string_value.strip()
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise cfgmod.ConfigError(
            where, f"parameters.{key}", f"must be a number of seconds >= 0, got {text!r}"
        )
    return value


#: The shortest probe period: a probe is a real inference on an instance, and a
#: shorter period would keep an instance busy probing.
MIN_PROBE_INTERVAL_S = 0.1


def _probe_interval(cfg: cfgmod.ModelConfig, where: str) -> float:
    """The ``probe_interval`` parameter (s): 0 (absent) or at least the floor.

    Raises:
        pdserve.config.ConfigError: not a number of seconds, or under the floor.
    """
    interval = _seconds(cfg, "probe_interval", 0.0, where)
    if 0 < interval < MIN_PROBE_INTERVAL_S:
        raise cfgmod.ConfigError(
            where,
            "parameters.probe_interval",
            f"must be 0 (no probe) or at least {MIN_PROBE_INTERVAL_S:g} s, got {interval:g}",
        )
    return interval


#: Why a model cannot have a canary probe.
_NO_PROBE = (
    "canary probes need a model with instances that answers each request once (not an "
    "ensemble, a decoupled or a sequence model)"
)

#: Why a probe has nothing to send.
_NO_INPUT = "a probe needs an input: set parameters.probe_input or model_warmup"


@dataclass(frozen=True)
class HealthParams:
    """A version's health parameters, checked (see the module docstring): seconds, and
    the probe's input arrays (None: the first ``model_warmup`` sample, or no probe)."""

    hang_timeout_s: float
    hook_interval_s: float
    hook_timeout_s: float
    probe_interval_s: float
    probe_timeout_s: float
    probe_failures: int
    probe_inputs: dict[str, np.ndarray] | None


def health_params(mv: ModelVersion, default_hang_s: float, where: str) -> HealthParams:
    """Check and read ``mv``'s health parameters from its configuration, as a load and
    ``pdserve check`` both do (nothing runs; ``mv`` needs no instances).

    Args:
        default_hang_s: ``--instance-hang-timeout``, for a model without its own.
        where: the config file, named in errors.

    Raises:
        pdserve.config.ConfigError: a value of the wrong type or range, a probe on a
            model that cannot have one, a ``probe_input`` that is not JSON, names an
            unknown input or does not fit the model, or a probe with no input at all.
    """
    cfg = mv.config
    hang = _seconds(cfg, "instance_hang_timeout", default_hang_s, where)
    hook_interval = _seconds(cfg, "is_ready_interval", 5.0, where) or 5.0
    hook_timeout = _seconds(cfg, "is_ready_timeout", 5.0, where) or 5.0
    probe_interval = _probe_interval(cfg, where)
    probe_timeout = _seconds(cfg, "probe_timeout", 2.0, where) or 2.0
    p = cfg.parameters.get("probe_failures")
    failures = 3
    if p is not None:
        text = p.string_value.strip()
        if not text.isdigit() or int(text) < 1:
            raise cfgmod.ConfigError(
                where, "parameters.probe_failures", f"must be an integer >= 1, got {text!r}"
            )
        failures = int(text)
    inputs = None
    if probe_interval > 0:
        if (
            mv.decoupled
            or cfg.HasField("sequence_batching")
            or mv.platform == cfgmod.ENSEMBLE_PLATFORM
        ):
            raise cfgmod.ConfigError(where, "parameters.probe_interval", _NO_PROBE)
        p = cfg.parameters.get("probe_input")
        if p is not None:
            inputs = _probe_inputs(mv, p.string_value, where)
            try:
                mv.prepare(InferRequest(mv.name, mv.version_str, dict(inputs)))
            except InferError as e:
                raise cfgmod.ConfigError(where, "parameters.probe_input", e.message) from None
        elif not cfg.model_warmup:
            raise cfgmod.ConfigError(
                where,
                "parameters.probe_interval",
                _NO_INPUT,
            )
    return HealthParams(
        hang, hook_interval, hook_timeout, probe_interval, probe_timeout, failures, inputs
    )


class ModelHealth:
    """The readiness hooks and the canary probe of one model version."""

    def __init__(self, mv: ModelVersion, params: HealthParams) -> None:
        self.mv = mv
        self.params = params
        self.watchdog: Watchdog | None = None
        self.probe_request: InferRequest | None = None
        self.probe_stats = ModelStats(mv.name, mv.version_str)
        self.failed_in_row = 0
        self.last_error = ""
        self._probe_task: asyncio.Task[bool] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        #: run once stopped (the board forgets the version)
        self.on_stop: Callable[[], None] | None = None

    async def prepare(self, where: str) -> None:
        """Check the probe's input and ask each readiness hook once.

        Raises:
            pdserve.config.ConfigError: a probe on a model that cannot have one, a
                ``probe_input`` that is not JSON or names an unknown input, no sample to
                probe with, or a readiness hook that raised.
        """
        mv = self.mv
        if self.params.probe_interval_s > 0:
            self.probe_request = await self._probe_sample(where)
            mv.stats.probe = self.summary
        for inst in mv.instances:
            if not inst.has_ready_hook():
                continue
            answer = await inst.check_ready(self.params.hook_timeout_s)
            if answer is not None and not answer[0] and "raised" in answer[1]:
                raise cfgmod.ConfigError(where, "is_ready", f"instance {inst.name}: {answer[1]}")
            if answer is not None and not answer[0]:
                mv.hooks_down.add(inst.name)

    async def _probe_sample(self, where: str) -> InferRequest:
        mv = self.mv
        if not mv.instances:
            raise cfgmod.ConfigError(where, "parameters.probe_interval", _NO_PROBE)
        inputs = self.params.probe_inputs
        if inputs is None:
            samples = await build_samples(mv)
            if not samples:
                raise cfgmod.ConfigError(
                    where,
                    "parameters.probe_interval",
                    _NO_INPUT,
                )
            request = samples[0][1]
        else:
            request = InferRequest(mv.name, mv.version_str, dict(inputs))
        try:
            mv.prepare(request)
        except InferError as e:
            raise cfgmod.ConfigError(where, "parameters.probe_input", e.message) from None
        request.id = "pdserve-probe"
        return request

    def start(self) -> None:
        """Start the hook and probe loops (only those the model has)."""
        loop = asyncio.get_running_loop()
        if any(inst.has_ready_hook() for inst in self.mv.instances):
            self._tasks.append(loop.create_task(self._hooks()))
        if self.probe_request is not None:
            self._tasks.append(loop.create_task(self._probes()))

    async def stop(self) -> None:
        """Stop the loops and the watchdog."""
        tasks: list[asyncio.Task[Any]] = list(self._tasks)
        if self._probe_task is not None:
            tasks.append(self._probe_task)
        for task in tasks:
            task.cancel()
        if tasks:  # a probe stuck in a wedged worker ends when the instances are aborted
            await asyncio.wait(tasks, timeout=1.0)
        if self.watchdog is not None:
            await self.watchdog.stop()
        if self.on_stop is not None:
            self.on_stop()

    async def _hooks(self) -> None:
        mv = self.mv
        while True:
            await asyncio.sleep(self.params.hook_interval_s)
            answers = await asyncio.gather(
                *(inst.check_ready(self.params.hook_timeout_s) for inst in mv.instances)
            )
            for inst, answer in zip(mv.instances, answers, strict=False):
                if answer is None:
                    continue
                ready, why = answer
                if ready and inst.name in mv.hooks_down:
                    mv.hooks_down.discard(inst.name)
                    log.info("model %s instance %s: is_ready() is true again", mv.name, inst.name)
                elif not ready and inst.name not in mv.hooks_down:
                    mv.hooks_down.add(inst.name)
                    log.warning("model %s instance %s is not ready: %s", mv.name, inst.name, why)

    async def _probes(self) -> None:
        while True:
            await asyncio.sleep(self.params.probe_interval_s)
            ok, why = await self._probe_once()
            mv = self.mv
            if ok:
                if mv.probe_down:
                    log.info("model %s: canary probe succeeded; ready again", mv.name)
                mv.probe_down = False
                self.failed_in_row = 0
                continue
            self.failed_in_row += 1
            self.last_error = why
            if self.failed_in_row >= self.params.probe_failures and not mv.probe_down:
                mv.probe_down = True
                log.error(
                    "model %s version %s: canary probe failed %d times in a row (%s); "
                    "not ready until a probe succeeds",
                    mv.name,
                    mv.version_str,
                    self.failed_in_row,
                    why,
                )

    async def _probe_once(self) -> tuple[bool, str]:
        """One probe: ``(succeeded, why not)``; a probe still running from the last
        interval counts as failed without starting another."""
        task = self._probe_task
        if task is None or task.done():
            task = self._probe_task = asyncio.get_running_loop().create_task(self._run_probe())
        done, _ = await asyncio.wait([task], timeout=self.params.probe_timeout_s)
        if not done:
            return False, f"no answer within {self.params.probe_timeout_s:g} s"
        self._probe_task = None
        try:
            task.result()
        except InferError as e:
            return False, e.message
        except Exception as e:  # noqa: BLE001 - a failed probe
            return False, f"{type(e).__name__}: {e}"
        return True, ""

    async def _run_probe(self) -> bool:
        mv = self.mv
        assert self.probe_request is not None
        exec_req = mv.prepare(self.probe_request)
        pool = mv.scheduler.pool
        instance = await pool.acquire()
        try:
            (result,) = await run_batch(instance, [exec_req], self.probe_stats, mv.output_check)
        finally:
            pool.release(instance)
        if isinstance(result, InferError):
            self.probe_stats.record_failure(0)
            raise result
        self.probe_stats.record_success(exec_req.batch_size, exec_req.compute_ns, 0, 0)
        return True

    def summary(self) -> dict[str, Any]:
        """``pdserve_probe`` in the model's statistics: probe successes and failures."""
        d = self.probe_stats.durations
        return {
            "success": d["success"].count,
            "failure": d["fail"].count,
            "failing_in_row": self.failed_in_row,
            "last_error": self.last_error,
        }


def _probe_inputs(mv: ModelVersion, text: str, where: str) -> dict[str, np.ndarray]:
    """``probe_input``'s JSON object as arrays of the configured datatypes.

    Raises:
        pdserve.config.ConfigError: not a JSON object of arrays, or an unknown input.
    """
    field = "parameters.probe_input"
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise cfgmod.ConfigError(where, field, f"is not JSON: {e}") from None
    if not isinstance(doc, dict) or not doc:
        raise cfgmod.ConfigError(where, field, "must be a JSON object {input name: values}")
    inputs: dict[str, np.ndarray] = {}
    for name, values in doc.items():
        spec = mv.inputs.get(name)
        if spec is None:
            raise cfgmod.ConfigError(
                where,
                field,
                f"names input '{name}', which the model does not have "
                f"(inputs: {', '.join(mv.inputs)})",
            )
        if spec.datatype == "BYTES":
            arr = np.array(values, dtype=object)
            arr = np.vectorize(lambda v: str(v).encode(), otypes=[object])(arr)
        else:
            try:
                arr = np.asarray(values, dtype=V2_TO_NUMPY[spec.datatype])
            except (TypeError, ValueError) as e:
                raise cfgmod.ConfigError(where, field, f"input '{name}': {e}") from None
        inputs[name] = arr
    return inputs


class HealthBoard:
    """Every served version's watchdog and health (see the module docstring).

    Args:
        hang_timeout_s: ``--instance-hang-timeout``: the bound of models without an
            ``instance_hang_timeout`` parameter; 0: no watchdog.
    """

    def __init__(self, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> None:
        self.hang_timeout_s = hang_timeout_s
        self.versions: set[ModelVersion] = set()

    async def attach(self, mv: ModelVersion) -> None:
        """Set ``mv``'s health up from its configuration and start it.

        Raises:
            pdserve.config.ConfigError: a bad health parameter (the load fails).
        """
        where = str(mv.spec.model_dir / cfgmod.CONFIG_FILENAME)
        params = health_params(mv, self.hang_timeout_s, where)
        bound = params.hang_timeout_s
        health = ModelHealth(mv, params)
        await health.prepare(where)
        if bound > 0 and mv.instances:
            health.watchdog = Watchdog(mv.name, mv.version_str, bound)
            health.watchdog.attach(mv.instances)
        health.start()
        health.on_stop = lambda: self.versions.discard(mv)
        mv.health = health
        self.versions.add(mv)

    def samples(self) -> Iterator[Sample]:
        """Metric samples of every version: the watchdog's wedges and restarts per
        instance; ``pdserve_probe_total{result}`` per version with a probe."""
        for mv in sorted(self.versions, key=lambda m: (m.name, m.version)):
            health = mv.health
            if not isinstance(health, ModelHealth):
                continue
            if health.watchdog is not None:
                yield from health.watchdog.samples()
            if health.probe_request is not None:
                s = health.summary()
                for result in ("success", "failure"):
                    labels = {"model": mv.name, "version": mv.version_str, "result": result}
                    yield (
                        "pdserve_probe_total",
                        "counter",
                        "Canary probe inferences by result (not counted as requests)",
                        labels,
                        float(s[result]),
                    )
