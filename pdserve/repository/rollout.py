"""Traffic control at run time: canary split, shadow traffic, SLO-driven rollouts.

:class:`TrafficControl` sits between :meth:`InferenceServer.infer
<pdserve.server.InferenceServer.infer>` and the model versions for every request that
names no version (see :mod:`pdserve.repository.traffic` for the traffic file and the
routing rules). Per model it keeps:

- the **effective traffic**: the model's ``traffic.yaml`` (re-read with every load),
  or what ``POST /v2/models/{m}/traffic`` set since (until the file changes), or a
  rollout's current step;
- **windows** of outcomes per version (arrival to answer latency, error or not), the
  server's own data, so that a rollout needs no Prometheus;
- the **shadow**: a bounded queue and a worker task that mirror a share of the
  split requests to a candidate version after the caller's answer is ready, compare
  each output with the configured tolerance, and count divergences (a rolling rate
  per output over the last :data:`DIVERGENCE_WINDOW_S` seconds, and a sample of
  divergent requests in the log and in ``GET /v2/models/{m}/traffic``). The caller's
  answer never waits for it: a full queue, a caller's version with more than the
  shadow's ``max_inflight`` requests in flight (load), or a shadow version that
  refuses more work sheds the mirror (``shed``); a shadow that fails counts
  ``error``. One worker runs a model's mirrors, one at a time;
- the **rollout**: :class:`RolloutPolicy` (the ``rollout`` section of the traffic
  file) moves a canary through its steps (percent of traffic) while its error rate,
  p99 latency and shadow divergence over ``window_secs`` stay within bounds, and sets
  it to 0 % (the baseline version takes all traffic) on the first breach. Every
  decision is a log line (``pdserve.rollout``), a metric
  (``pdserve_rollout_decisions_total``) and an entry of ``GET
  /v2/models/{m}/rollout``. Switching weights is one assignment; requests already on
  the canary finish there, so a rollback fails no request by itself.

Errors that count against a version: every failure except the caller's own (bad
input ``INVALID_ARG``, ``NOT_FOUND``) and a caller that went away (``CANCELLED``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import random
import time
from bisect import bisect_left
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.core.errors import ErrorCode, InferError, not_found
from pdserve.core.types import InferRequest, InferResponse
from pdserve.repository.traffic import (
    ShadowSpec,
    Split,
    TrafficError,
    TrafficSpec,
    outputs_agree,
    parse_shadow,
    parse_traffic,
    parse_weights,
    tolerance_for,
)

if TYPE_CHECKING:
    from pdserve.core.api import ModelRunner
    from pdserve.repository.entry import ModelEntry
    from pdserve.repository.manager import ModelManager

log = logging.getLogger("pdserve.rollout")

#: The longest window, in seconds (``window_secs``): one-second buckets are kept
#: this long per version.
MAX_WINDOW_S = 3600
#: Seconds over which the rolling shadow divergence rate is computed.
DIVERGENCE_WINDOW_S = 60.0
#: Divergent requests kept per model for ``GET /v2/models/{m}/traffic``.
DIVERGENT_SAMPLES = 10
#: At most one divergence log line per output per this many seconds.
DIVERGENCE_LOG_EVERY_S = 5.0
#: Worker tasks that run one model's shadow requests: one, so that a shadow never
#: has more than one request in flight per model (it costs the callers at most what
#: one more closed-loop client would).
SHADOW_WORKERS = 1
#: Decisions kept per model for ``GET /v2/models/{m}/rollout``.
MAX_DECISIONS = 100

#: Error codes that are the caller's doing and do not count against a version.
_NOT_THE_VERSIONS_FAULT = {
    ErrorCode.INVALID_ARG,
    ErrorCode.NOT_FOUND,
    ErrorCode.CANCELLED,
    ErrorCode.CLIENT_GONE,
}

_ROLLOUT_KEYS = {
    "canary",
    "baseline",
    "steps",
    "step_secs",
    "window_secs",
    "min_requests",
    "max_error_rate",
    "max_p99_ms",
    "max_divergence_rate",
    "interval_secs",
}


# -------------------------------------------------------------------- rollout policy


@dataclass(frozen=True)
class RolloutPolicy:
    """The ``rollout`` section of a traffic file.

    Attributes:
        canary: the version being rolled out.
        baseline: the version it replaces (default: the highest served version below
            ``canary``); takes ``100 - step`` percent, and everything after a rollback.
        steps: the canary's percent at each step, ascending, ending at 100.
        step_secs: seconds the canary stays at least at one step before promotion.
        window_secs: the window error rate, p99 and divergence are computed over,
            1 to :data:`MAX_WINDOW_S` seconds (counted in whole seconds; the p99 is
            read from latency bins 15 % wide).
        min_requests: the canary needs this many requests in the window before a
            promotion, and before a breach counts (a breach of the error rate or p99
            with fewer requests is not acted on).
        max_error_rate: errors / requests of the canary in the window (0-1).
        max_p99_ms: the canary's p99 latency in the window, milliseconds.
        max_divergence_rate: shadow divergences / comparisons for the canary in the
            window (only when the shadow mirrors to the canary); None: not checked.
        interval_secs: how often the policy is evaluated.
    """

    canary: int
    baseline: int | None = None
    steps: tuple[float, ...] = (10.0, 25.0, 50.0, 100.0)
    step_secs: float = 30.0
    window_secs: float = 30.0
    min_requests: int = 50
    max_error_rate: float = 0.01
    max_p99_ms: float | None = None
    max_divergence_rate: float | None = None
    interval_secs: float = 0.5

    @classmethod
    def parse(cls, raw: Any, where: str = "rollout") -> RolloutPolicy:
        """Parse and check a ``rollout`` mapping.

        Raises:
            TrafficError: unknown keys, a missing ``canary``, steps that are not
                ascending percents ending at 100, a non-positive duration, rates
                outside [0, 1].
        """
        if not isinstance(raw, dict):
            raise TrafficError(f"{where}: must be a mapping with 'canary'")
        unknown = set(raw) - _ROLLOUT_KEYS
        if unknown:
            raise TrafficError(
                f"{where}: unknown key(s) {sorted(unknown)}; use {sorted(_ROLLOUT_KEYS)}"
            )
        if "canary" not in raw:
            raise TrafficError(f"{where}: 'canary' (the version to roll out) is required")

        def version(key: str) -> int:
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TrafficError(f"{where}.{key}: {v!r} is not a version number")
            return v

        def number(key: str, default: Any, low: float, high: float = math.inf) -> Any:
            v = raw.get(key, default)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int | float) or not low <= v <= high:
                raise TrafficError(f"{where}.{key}: {v!r} must be a number in [{low:g}, {high:g}]")
            return float(v)

        steps_raw = raw.get("steps", [10, 25, 50, 100])
        if not isinstance(steps_raw, list) or not steps_raw:
            raise TrafficError(f"{where}.steps: must be a list of percents ending at 100")
        steps = []
        for s in steps_raw:
            if isinstance(s, bool) or not isinstance(s, int | float) or not 0 < s <= 100:
                raise TrafficError(f"{where}.steps: {s!r} is not a percent in (0, 100]")
            steps.append(float(s))
        if steps != sorted(set(steps)) or steps[-1] != 100:
            raise TrafficError(f"{where}.steps: must be ascending percents ending at 100")
        min_req = raw.get("min_requests", 50)
        if isinstance(min_req, bool) or not isinstance(min_req, int) or min_req < 1:
            raise TrafficError(f"{where}.min_requests: must be a positive integer")
        canary = version("canary")
        baseline = version("baseline") if raw.get("baseline") is not None else None
        if baseline == canary:
            raise TrafficError(f"{where}: baseline and canary are the same version {canary}")
        return cls(
            canary=canary,
            baseline=baseline,
            steps=tuple(steps),
            step_secs=number("step_secs", 30.0, 0.0),
            window_secs=number("window_secs", 30.0, 1.0, MAX_WINDOW_S),
            min_requests=min_req,
            max_error_rate=number("max_error_rate", 0.01, 0.0, 1.0),
            max_p99_ms=number("max_p99_ms", None, 0.0),
            max_divergence_rate=number("max_divergence_rate", None, 0.0, 1.0),
            interval_secs=number("interval_secs", 0.5, 0.05, 60.0),
        )

    def as_dict(self) -> dict[str, Any]:
        """The JSON form."""
        d = dict(self.__dict__)
        d["steps"] = list(self.steps)
        return d


# -------------------------------------------------------------------- windows


#: Upper bounds (seconds) of the latency bins a window counts in: 0.1 ms to 100 s, 16
#: per decade (each 15 % wider than the one before), so a p99 is read within 15 %.
LATENCY_BINS: tuple[float, ...] = tuple(1e-4 * 10 ** (i / 16) for i in range(97))


class Window:
    """Recent outcomes of one version, in one-second buckets of ``[second, requests,
    errors, latency histogram]`` (:data:`LATENCY_BINS`): recording is O(1) and a
    summary reads at most :data:`MAX_WINDOW_S` buckets, whatever the request rate."""

    __slots__ = ("buckets",)

    def __init__(self) -> None:
        self.buckets: collections.deque[list[Any]] = collections.deque(maxlen=MAX_WINDOW_S)

    def add(self, latency_s: float, error: bool) -> None:
        """Record one answered request that took ``latency_s`` seconds."""
        sec = int(time.monotonic())
        b = self.buckets[-1] if self.buckets else None
        if b is None or b[0] != sec:
            b = [sec, 0, 0, [0] * (len(LATENCY_BINS) + 1)]
            self.buckets.append(b)
        b[1] += 1
        b[2] += error
        b[3][bisect_left(LATENCY_BINS, latency_s)] += 1

    def summary(self, window_s: float) -> dict[str, Any]:
        """``{requests, errors, error_rate, p99_ms}`` over the last ``window_s``
        seconds (whole seconds); ``p99_ms`` is the upper bound of the bin holding the
        99th percentile (None without requests)."""
        first = int(time.monotonic()) - max(0, math.ceil(window_s) - 1)
        n = errors = 0
        hist = [0] * (len(LATENCY_BINS) + 1)
        for sec, count, errs, h in reversed(self.buckets):
            if sec < first:
                break
            n += count
            errors += errs
            for i, c in enumerate(h):
                if c:
                    hist[i] += c
        p99 = None
        if n:
            rank, acc = math.ceil(0.99 * n), 0
            for i, c in enumerate(hist):
                acc += c
                if acc >= rank:
                    p99 = LATENCY_BINS[min(i, len(LATENCY_BINS) - 1)] * 1000.0
                    break
        return {
            "requests": n,
            "errors": errors,
            "error_rate": errors / n if n else 0.0,
            "p99_ms": p99,
        }


class Tally:
    """Counts in one-second buckets (``[second, Counter]``), summed over a window."""

    __slots__ = ("buckets",)

    def __init__(self) -> None:
        self.buckets: collections.deque[tuple[int, collections.Counter[Any]]] = collections.deque(
            maxlen=MAX_WINDOW_S
        )

    def add(self, key: Any, n: int = 1) -> None:
        """Count ``n`` of ``key`` now."""
        sec = int(time.monotonic())
        if not self.buckets or self.buckets[-1][0] != sec:
            self.buckets.append((sec, collections.Counter()))
        self.buckets[-1][1][key] += n

    def total(self, window_s: float) -> collections.Counter[Any]:
        """The counts of the last ``window_s`` seconds (whole seconds)."""
        first = int(time.monotonic()) - max(0, math.ceil(window_s) - 1)
        out: collections.Counter[Any] = collections.Counter()
        for sec, counts in reversed(self.buckets):
            if sec < first:
                break
            out.update(counts)
        return out


# -------------------------------------------------------------------- per-model state


@dataclass
class Rollout:
    """A rollout in progress or finished."""

    policy: RolloutPolicy
    baseline: int
    state: str = "running"  # running | promoted | rolled_back | aborted
    step: int = 0
    step_since: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.time)

    def weights(self) -> dict[int, float]:
        """The weights this rollout's state asks for."""
        if self.state == "promoted":
            return {self.policy.canary: 100.0}
        if self.state in ("rolled_back", "aborted"):
            return {self.baseline: 100.0}
        pct = self.policy.steps[self.step]
        return {self.policy.canary: pct, self.baseline: 100.0 - pct}


class ModelTraffic:
    """Everything traffic control keeps for one model."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.file_spec: TrafficSpec | None = None
        self.file_gen = -1
        self.override: TrafficSpec | None = None
        self.rollout: Rollout | None = None
        self.windows: dict[int, Window] = {}
        self.routed: collections.Counter[tuple[str, str]] = collections.Counter()
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_DECISIONS)
        self.decision_counts: collections.Counter[str] = collections.Counter()
        self._split: Split | None = None
        self._split_for: tuple[Any, ...] | None = None
        self.unserved: list[int] = []
        # shadow
        self.queue: asyncio.Queue[tuple[ShadowSpec, InferRequest, InferResponse]] | None = None
        self.workers: list[asyncio.Task[None]] = []
        self.shadow_results: collections.Counter[tuple[str, str]] = collections.Counter()
        self.divergence: collections.Counter[str] = collections.Counter()
        self.compared: collections.Counter[str] = collections.Counter()
        #: recent comparisons: ("out", output, diverged) and ("ver", version, diverged)
        self.recent = Tally()
        self.samples: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=DIVERGENT_SAMPLES
        )
        self._last_log: dict[str, float] = {}

    # effective configuration -------------------------------------------------

    def spec(self) -> TrafficSpec | None:
        """The traffic in force (admin override, else the file)."""
        return self.override if self.override is not None else self.file_spec

    def weights(self) -> dict[int, float]:
        """The weights in force: the rollout's, else the spec's (may be empty)."""
        if self.rollout is not None:
            return self.rollout.weights()
        spec = self.spec()
        return dict(spec.weights) if spec is not None else {}

    def source(self) -> str:
        """Where the weights in force come from."""
        if self.rollout is not None:
            return "rollout"
        if self.override is not None:
            return "admin"
        return "file" if self.file_spec is not None else "default"

    def split(self, entry: ModelEntry) -> Split | None:
        """The split over the served versions (cached until weights or versions change)."""
        weights = self.weights()
        key = (entry.serving, tuple(sorted(weights.items())))
        if self._split_for is not None and self._split_for[0] is key[0]:
            if self._split_for[1] == key[1]:
                return self._split
        served = {v: w for v, w in weights.items() if v in entry.serving}
        unserved = sorted(v for v, w in weights.items() if v not in entry.serving and w > 0)
        if unserved != self.unserved and unserved:
            log.warning(
                "model %s: traffic names version(s) %s that are not served; their share goes "
                "to the served versions %s",
                self.name,
                unserved,
                sorted(served),
            )
        self.unserved = unserved
        self._split = Split(served) if served and any(w > 0 for w in served.values()) else None
        self._split_for = key
        return self._split

    def window(self, version: int) -> Window:
        w = self.windows.get(version)
        if w is None:
            w = self.windows[version] = Window()
        return w

    def divergence_rates(self, window_s: float = DIVERGENCE_WINDOW_S) -> dict[str, float]:
        """Output -> divergent / compared over the last ``window_s`` seconds."""
        t = self.recent.total(window_s)
        seen: collections.Counter[str] = collections.Counter()
        for (kind, output, _), n in t.items():
            if kind == "out":
                seen[output] += n
        return {o: t[("out", o, True)] / n for o, n in seen.items() if n}

    def divergence_rate_for(self, version: int, window_s: float) -> tuple[int, float]:
        """``(requests compared, share that diverged in any output)`` for shadow
        ``version`` over the last ``window_s`` seconds."""
        t = self.recent.total(window_s)
        bad, good = t[("ver", version, True)], t[("ver", version, False)]
        n = bad + good
        return n, (bad / n if n else 0.0)


# -------------------------------------------------------------------- the controller


class TrafficControl:
    """Routes, mirrors and rolls out versions of the models of one server.

    Args:
        runner: the core (:class:`~pdserve.core.api.ModelRunner`): runs a request on a
            resolved version (``infer_on``: scheduler, statistics, cache).
        manager: the model manager: served versions and each model's traffic file.
    """

    def __init__(self, runner: ModelRunner, manager: ModelManager) -> None:
        self.runner = runner
        self.manager = manager
        self.models: dict[str, ModelTraffic] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # -- the request path ------------------------------------------------------

    def _state(self, name: str, entry: ModelEntry) -> ModelTraffic:
        st = self.models.get(name)
        if st is None or entry.traffic_gen != st.file_gen:
            st = self._reloaded(name, entry, st)
        return st

    def _reloaded(self, name: str, entry: ModelEntry, st: ModelTraffic | None) -> ModelTraffic:
        """The model (re)loaded: adopt its traffic file."""
        spec: TrafficSpec | None = entry.traffic
        if st is None:
            if spec is None:
                # nothing to do until a file or an admin request says otherwise
                st = self.models[name] = ModelTraffic(name)
                st.file_gen = entry.traffic_gen
                return st
            st = self.models[name] = ModelTraffic(name)
        changed = spec != st.file_spec
        st.file_spec = spec
        st.file_gen = entry.traffic_gen
        if changed:
            if st.override is not None:
                log.info("model %s: traffic.yaml changed: it replaces the admin traffic", name)
            st.override = None
            try:
                self._adopt_rollout(st, spec.rollout if spec is not None else None, "traffic.yaml")
            except TrafficError as e:  # checked at load; a baseline may be missing
                log.error("model %s: the rollout does not start: %s", name, e)
                st.rollout = None
        return st

    def _adopt_rollout(self, st: ModelTraffic, raw: dict[str, Any] | None, why: str) -> None:
        if raw is None:
            if st.rollout is not None and st.rollout.state == "running":
                self._decide(st, "stopped", f"{why} has no rollout section")
            st.rollout = None
            return
        policy = RolloutPolicy.parse(raw)
        if st.rollout is not None and st.rollout.policy == policy:
            return  # the same rollout: keep its progress (and a rollback stays rolled back)
        entry = self.manager.models.get(st.name)
        baseline = policy.baseline
        if baseline is None:
            below = [v for v in (entry.serving if entry else {}) if v < policy.canary]
            baseline = max(below) if below else -1
        if baseline < 0:
            raise TrafficError(
                f"rollout: no baseline version below canary {policy.canary} is served; "
                "name one with 'baseline'"
            )
        st.rollout = Rollout(policy, baseline)
        self._decide(st, "start", f"rollout of version {policy.canary} over {baseline} ({why})")
        self.ensure_running()

    def infer(self, request: InferRequest) -> Coroutine[Any, Any, InferResponse]:
        """Serve a request that names no version (see the module docstring):
        ``await traffic.infer(request)``. A model without traffic settings goes
        straight to the default version (the runner's coroutine, no extra level).

        Raises:
            InferError: as :meth:`InferenceServer.infer`; 404 when the pinned version
                (``x-pdserve-model-version``) is not served; an unknown model at once.
        """
        name = request.model_name
        manager = self.manager
        entry = manager.models.get(name)
        if entry is None:
            return self.runner.infer_on(manager.get(name, ""), request)
        st = self._state(name, entry)
        if (
            not request.pinned_version
            and st.file_spec is None
            and st.override is None
            and st.rollout is None
        ):
            return self.runner.infer_on(manager.get(name, ""), request)  # no traffic
        return self._infer_routed(request, entry, st)

    async def _infer_routed(
        self, request: InferRequest, entry: ModelEntry, st: ModelTraffic
    ) -> InferResponse:
        """:meth:`infer` for a pinned request or a model with traffic settings."""
        name = request.model_name
        manager = self.manager
        if request.pinned_version:
            mv = manager.get(name, request.pinned_version)
            route = "pinned"
        else:
            split = st.split(entry)
            v = split.pick(request.route_key) if split is not None else None
            if v is None:
                mv = manager.get(name, "")
                route = "default"
            else:
                mv = entry.serving[v]
                route = "sticky" if request.route_key else "split"
        st.routed[(mv.version_str, route)] += 1
        start = time.monotonic_ns()
        try:
            response = await self.runner.infer_on(mv, request)
        except InferError as e:
            if e.code not in _NOT_THE_VERSIONS_FAULT:
                st.window(mv.version).add((time.monotonic_ns() - start) / 1e9, True)
            raise
        except asyncio.CancelledError:
            raise
        except Exception:
            st.window(mv.version).add((time.monotonic_ns() - start) / 1e9, True)
            raise
        st.window(mv.version).add((time.monotonic_ns() - start) / 1e9, False)
        if route != "pinned":
            spec = st.spec()
            shadow = spec.shadow if spec is not None else None
            if shadow is not None and shadow.version != mv.version:
                if shadow.percent >= 100 or random.random() * 100 < shadow.percent:
                    self._offer(st, shadow, request, response)
        return response

    # -- shadow ------------------------------------------------------------------

    def _offer(
        self, st: ModelTraffic, shadow: ShadowSpec, request: InferRequest, response: InferResponse
    ) -> None:
        """Queue a mirror of ``request`` (never waits; a full queue sheds it)."""
        if self._closing:
            return
        if st.queue is None or st.queue.maxsize != shadow.queue_size:
            self._stop_shadow(st)
            st.queue = asyncio.Queue(shadow.queue_size)
            loop = asyncio.get_running_loop()
            st.workers = [
                loop.create_task(
                    self._shadow_worker(st, st.queue), name=f"pdserve-shadow-{st.name}"
                )
                for _ in range(SHADOW_WORKERS)
            ]
        try:
            st.queue.put_nowait((shadow, request, response))
        except asyncio.QueueFull:
            st.shadow_results[(str(shadow.version), "shed")] += 1

    def _stop_shadow(self, st: ModelTraffic) -> None:
        for t in st.workers:
            t.cancel()
        st.workers = []
        st.queue = None

    async def _shadow_worker(
        self, st: ModelTraffic, queue: asyncio.Queue[tuple[ShadowSpec, InferRequest, InferResponse]]
    ) -> None:
        while True:
            shadow, request, primary = await queue.get()
            try:
                await self._shadow_one(st, shadow, request, primary)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a shadow never stops the worker
                log.exception("model %s: shadow request failed unexpectedly", st.name)
                st.shadow_results[(str(shadow.version), "error")] += 1

    async def _shadow_one(
        self, st: ModelTraffic, shadow: ShadowSpec, request: InferRequest, primary: InferResponse
    ) -> None:
        version = str(shadow.version)
        entry = self.manager.models.get(st.name)
        mv = entry.serving.get(shadow.version) if entry is not None else None
        if mv is None:
            st.shadow_results[(version, "missing")] += 1
            self._log_every(
                st, "missing", "shadow version %s of model %s is not served", version, st.name
            )
            return
        primary_mv = entry.serving.get(int(primary.model_version)) if entry is not None else None
        if primary_mv is not None and primary_mv.inflight > shadow.max_inflight:
            st.shadow_results[(version, "shed")] += 1  # the callers are busy: shadow goes first
            return
        mirror = InferRequest(
            request.model_name,
            version,
            request.inputs,
            request.outputs,
            request.id,
            dict(request.parameters),
        )
        try:
            result = await self.runner.infer_on(mv, mirror)
        except InferError as e:
            kind = "shed" if e.code is ErrorCode.UNAVAILABLE else "error"
            st.shadow_results[(version, kind)] += 1
            self._log_every(
                st, "error", "model %s shadow version %s failed: %s", st.name, version, e
            )
            return
        st.shadow_results[(version, "compared")] += 1
        differences = {}
        for output, value in primary.outputs.items():
            other = result.outputs.get(output)
            if other is None:
                agree, detail = False, "missing from the shadow's response"
            else:
                agree, detail = outputs_agree(value, other, tolerance_for(shadow, output))
            st.compared[output] += 1
            st.recent.add(("out", output, not agree))
            if not agree:
                st.divergence[output] += 1
                differences[output] = detail
        st.recent.add(("ver", shadow.version, bool(differences)))
        if differences:
            sample = {
                "time": time.time(),
                "request_id": request.id,
                "version": primary.model_version,
                "shadow_version": version,
                "outputs": differences,
            }
            st.samples.append(sample)
            for output, detail in differences.items():
                self._log_every(
                    st,
                    f"div:{output}",
                    "model %s: shadow version %s diverges from version %s on output %s "
                    "(request id %r): %s",
                    st.name,
                    version,
                    primary.model_version,
                    output,
                    request.id,
                    detail,
                )

    def _log_every(self, st: ModelTraffic, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - st._last_log.get(key, -math.inf) >= DIVERGENCE_LOG_EVERY_S:
            st._last_log[key] = now
            log.warning(msg, *args)

    # -- rollout -----------------------------------------------------------------

    def _decide(self, st: ModelTraffic, action: str, reason: str, **extra: Any) -> None:
        """Record one decision: log line, metric, admin endpoint."""
        weights = st.weights()
        d = {
            "time": time.time(),
            "action": action,
            "reason": reason,
            "weights": {str(v): w for v, w in sorted(weights.items())},
            **extra,
        }
        st.decisions.append(d)
        st.decision_counts[action] += 1
        log.info(
            "rollout decision: model %s %s: %s; weights %s",
            st.name,
            action,
            reason,
            d["weights"],
        )

    def ensure_running(self) -> None:
        """Start the evaluation task (once, on the running loop)."""
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):
                self._task = asyncio.get_running_loop().create_task(
                    self._run(), name="pdserve-rollout"
                )

    async def _run(self) -> None:
        while not self._closing:
            interval = 1.0
            for st in list(self.models.values()):
                r = st.rollout
                if r is None or r.state != "running":
                    continue
                interval = min(interval, r.policy.interval_secs)
                try:
                    self.evaluate(st)
                except Exception:  # noqa: BLE001 - the loop must go on
                    log.exception("rollout of model %s: evaluation failed", st.name)
            await asyncio.sleep(interval)

    def evaluate(self, st: ModelTraffic) -> str | None:
        """Evaluate one model's running rollout once: promote, roll back or hold.

        Returns:
            the decision taken (``"promote"``, ``"promoted"``, ``"rollback"``) or None.
        """
        r = st.rollout
        if r is None or r.state != "running":
            return None
        p = r.policy
        entry = self.manager.models.get(st.name)
        if entry is None or p.canary not in entry.serving:
            return None
        win = st.window(p.canary).summary(p.window_secs)
        breach = []
        if win["requests"] >= p.min_requests:
            if win["error_rate"] > p.max_error_rate:
                breach.append(
                    f"error rate {win['error_rate']:.3f} > {p.max_error_rate:g} "
                    f"({win['errors']}/{win['requests']} in {p.window_secs:g}s)"
                )
            if p.max_p99_ms is not None and (win["p99_ms"] or 0) > p.max_p99_ms:
                breach.append(f"p99 {win['p99_ms']:.1f} ms > {p.max_p99_ms:g} ms")
        if p.max_divergence_rate is not None:
            n, rate = st.divergence_rate_for(p.canary, p.window_secs)
            if n >= p.min_requests and rate > p.max_divergence_rate:
                breach.append(
                    f"shadow divergence {rate:.3f} > {p.max_divergence_rate:g} ({n} compared)"
                )
        if breach:
            r.state = "rolled_back"
            self._decide(st, "rollback", "; ".join(breach), window=win)
            return "rollback"
        held = time.monotonic() - r.step_since
        if held >= p.step_secs and win["requests"] >= p.min_requests:
            if r.step + 1 < len(p.steps):
                r.step += 1
                r.step_since = time.monotonic()
                self._decide(
                    st,
                    "promote",
                    f"step {r.step + 1}/{len(p.steps)}: canary at {p.steps[r.step]:g}%",
                    window=win,
                )
                return "promote"
            r.state = "promoted"
            self._decide(st, "promoted", f"version {p.canary} serves 100%", window=win)
            return "promoted"
        return None

    # -- admin ---------------------------------------------------------------------

    def _entry(self, name: str) -> tuple[ModelEntry, ModelTraffic]:
        entry = self.manager.models.get(name)
        if entry is None or not entry.serving:
            raise not_found(f"Request for unknown model: '{name}' is not served")
        return entry, self._state(name, entry)

    def describe_traffic(self, name: str) -> dict[str, Any]:
        """``GET /v2/models/{m}/traffic``: the traffic in force and what it did.

        Raises:
            InferError(NOT_FOUND): the model is not served.
        """
        entry, st = self._entry(name)
        st.split(entry)
        spec = st.spec()
        routed: dict[str, dict[str, int]] = {}
        for (v, route), n in sorted(st.routed.items()):
            routed.setdefault(v, {})[route] = n
        shadow_counts: dict[str, dict[str, int]] = {}
        for (v, kind), n in sorted(st.shadow_results.items()):
            shadow_counts.setdefault(v, {})[kind] = n
        default = entry.default_version
        return {
            "model": name,
            "source": st.source(),
            "weights": {str(v): w for v, w in sorted(st.weights().items())},
            "served_versions": [str(v) for v in sorted(entry.serving)],
            "default_version": default.version_str if default is not None else None,
            "unserved": [str(v) for v in st.unserved],
            "routed": routed,
            "shadow": None
            if spec is None or spec.shadow is None
            else {
                **spec.shadow.as_dict(),
                "queued": st.queue.qsize() if st.queue is not None else 0,
                "results": shadow_counts,
                "divergence": dict(st.divergence),
                "compared": dict(st.compared),
                "divergence_rate": st.divergence_rates(),
                "divergent_samples": list(st.samples),
            },
        }

    def set_traffic(self, name: str, doc: Any) -> dict[str, Any]:
        """``POST /v2/models/{m}/traffic``: replace the traffic until the traffic file
        changes (``{"weights": {...}, "shadow": {...}}``; ``{"reset": true}`` goes back
        to the file). A ``rollout`` section starts that rollout.

        Raises:
            InferError(INVALID_ARG): the body is malformed (weights that do not sum to
                100...); nothing changes.
            InferError(NOT_FOUND): the model is not served.
        """
        entry, st = self._entry(name)
        if not isinstance(doc, dict):
            raise InferError("traffic: the body must be a JSON object")
        if not doc:
            raise InferError(
                "traffic: the body is empty: give 'weights', 'shadow' or 'rollout', "
                'or {"reset": true} to go back to the traffic file'
            )
        if "reset" in doc and (doc["reset"] is not True or len(doc) != 1):
            raise InferError("traffic: 'reset' must be true and alone: {\"reset\": true}")
        try:
            if doc.get("reset") is True:
                st.override = None
                self._adopt_rollout(
                    st, st.file_spec.rollout if st.file_spec is not None else None, "reset"
                )
            else:
                spec = parse_traffic(doc, "traffic")
                if spec.rollout is not None:
                    RolloutPolicy.parse(spec.rollout)
                st.override = spec
                self._adopt_rollout(st, spec.rollout, "admin request")
        except TrafficError as e:
            raise InferError(str(e)) from None
        log.info("model %s: traffic set by the admin endpoint: %s", name, st.weights())
        st._split_for = None
        return self.describe_traffic(name)

    def describe_rollout(self, name: str) -> dict[str, Any]:
        """``GET /v2/models/{m}/rollout``: the rollout's state, windows and decisions.

        Raises:
            InferError(NOT_FOUND): the model is not served.
        """
        _, st = self._entry(name)
        r = st.rollout
        out: dict[str, Any] = {
            "model": name,
            "state": r.state if r is not None else "none",
            "weights": {str(v): w for v, w in sorted(st.weights().items())},
            "decisions": list(st.decisions),
        }
        if r is not None:
            p = r.policy
            out.update(
                policy=p.as_dict(),
                canary=str(p.canary),
                baseline=str(r.baseline),
                step=r.step + 1,
                steps=len(p.steps),
                window={
                    "canary": st.window(p.canary).summary(p.window_secs),
                    "baseline": st.window(r.baseline).summary(p.window_secs),
                },
            )
        return out

    def rollout_action(self, name: str, doc: Any) -> dict[str, Any]:
        """``POST /v2/models/{m}/rollout``: ``{"action": "rollback" | "promote" |
        "abort" | "restart"}`` (``restart`` begins the current policy again, e.g.
        after a rollback once the canary is fixed).

        Raises:
            InferError(INVALID_ARG): an unknown action, or no rollout.
            InferError(NOT_FOUND): the model is not served.
        """
        _, st = self._entry(name)
        action = doc.get("action") if isinstance(doc, dict) else None
        r = st.rollout
        if r is None:
            raise InferError(f"model '{name}' has no rollout (add a 'rollout' section)")
        if action == "rollback":
            r.state = "rolled_back"
        elif action == "promote":
            r.state = "promoted"
        elif action == "abort":
            r.state = "aborted"
        elif action == "restart":
            st.rollout = Rollout(r.policy, r.baseline)
            self.ensure_running()
        else:
            raise InferError("rollout: 'action' must be one of rollback, promote, abort, restart")
        self._decide(st, str(action), "admin request")
        return self.describe_rollout(name)

    # -- metrics and lifecycle -----------------------------------------------------

    def metric_rows(self) -> list[tuple[str, dict[str, str], float]]:
        """``(metric name, labels, value)`` for every traffic metric (see
        :mod:`pdserve.observability.metrics`)."""
        rows: list[tuple[str, dict[str, str], float]] = []
        for name, st in sorted(self.models.items()):
            for ver, w in sorted(st.weights().items()):
                rows.append(("pdserve_traffic_weight", {"model": name, "version": str(ver)}, w))
            for (v, route), n in sorted(st.routed.items()):
                rows.append(
                    (
                        "pdserve_traffic_requests_total",
                        {"model": name, "version": v, "route": route},
                        n,
                    )
                )
            for (v, kind), n in sorted(st.shadow_results.items()):
                rows.append(
                    (
                        "pdserve_shadow_requests_total",
                        {"model": name, "version": v, "result": kind},
                        n,
                    )
                )
            for output, n in sorted(st.divergence.items()):
                rows.append(
                    ("pdserve_shadow_divergence_total", {"model": name, "output": output}, n)
                )
            for output, n in sorted(st.compared.items()):
                rows.append(("pdserve_shadow_compared_total", {"model": name, "output": output}, n))
            for output, rate in sorted(st.divergence_rates().items()):
                rows.append(
                    ("pdserve_shadow_divergence_rate", {"model": name, "output": output}, rate)
                )
            if st.queue is not None:
                rows.append(("pdserve_shadow_queue_size", {"model": name}, st.queue.qsize()))
            for action, n in sorted(st.decision_counts.items()):
                rows.append(
                    ("pdserve_rollout_decisions_total", {"model": name, "action": action}, n)
                )
            if st.rollout is not None:
                state = st.rollout.state
                for s in ("running", "promoted", "rolled_back", "aborted"):
                    rows.append(
                        ("pdserve_rollout_state", {"model": name, "state": s}, float(s == state))
                    )
        return rows

    async def stop(self) -> None:
        """Stop the evaluation task and the shadow workers (queued mirrors are dropped)."""
        self._closing = True
        tasks = [t for st in self.models.values() for t in st.workers]
        if self._task is not None:
            tasks.append(self._task)
        for st in self.models.values():
            self._stop_shadow(st)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = [
    "RolloutPolicy",
    "TrafficControl",
    "Window",
    "parse_shadow",
    "parse_weights",
]
