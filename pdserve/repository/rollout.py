"""Traffic control at run time: canary split, pinned versions, shadow traffic and
SLO-driven rollouts of requests that name no version.

:meth:`TrafficControl.route` decides which served version takes a request (the model's
``traffic.yaml``, re-read with every load, or what ``POST /v2/models/{m}/traffic`` set
since, or a rollout's current step; see :mod:`pdserve.repository.traffic` for the rules);
the server runs it there and hands the run to :meth:`TrafficControl.observe`, which records
its outcome in the version's window (:mod:`pdserve.repository.windows`) and offers a mirror
to the shadow (:mod:`pdserve.repository.shadow`). A rollout
(:mod:`pdserve.repository.rollout_policy`) moves a canary through its steps while its
error rate, p99 latency and shadow divergence stay within bounds, and sets it to 0 % on
the first breach; every decision is a log line, a metric and an entry of
``GET /v2/models/{m}/rollout``. Errors that count against a version: every failure except
the caller's own (``INVALID_ARG``, ``NOT_FOUND``) and a caller that went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.core.errors import ErrorCode, InferError, not_found
from pdserve.core.types import InferRequest, InferResponse
from pdserve.repository.model_traffic import ModelTraffic
from pdserve.repository.rollout_policy import Rollout, RolloutPolicy
from pdserve.repository.shadow import ShadowMirror
from pdserve.repository.traffic import TrafficError, TrafficSpec, parse_traffic

if TYPE_CHECKING:
    from pdserve.core.api import ModelRunner
    from pdserve.repository.entry import ModelEntry
    from pdserve.repository.manager import ModelManager
    from pdserve.repository.model import ModelVersion

log = logging.getLogger("pdserve.rollout")

#: Error codes that are the caller's doing and do not count against a version.
_NOT_THE_VERSIONS_FAULT = {
    ErrorCode.INVALID_ARG,
    ErrorCode.NOT_FOUND,
    ErrorCode.CANCELLED,
    ErrorCode.CLIENT_GONE,
}


@dataclass(slots=True)
class Routed:
    """Where :meth:`TrafficControl.route` sent a request, for :meth:`TrafficControl.observe`.

    Attributes:
        st: the model's traffic state.
        mv: the version that serves the request.
        route: how it was chosen: ``pinned``, ``default``, ``split`` or ``sticky``.
    """

    st: ModelTraffic
    mv: ModelVersion
    route: str


class TrafficControl:
    """Routes, mirrors and rolls out versions of the models of one server.

    Args:
        runner: the core (:class:`~pdserve.core.api.ModelRunner`): the shadow mirror
            runs its copies of requests through it.
        manager: the model manager: served versions and each model's traffic file.
    """

    def __init__(self, runner: ModelRunner, manager: ModelManager) -> None:
        self.manager = manager
        self.models: dict[str, ModelTraffic] = {}
        self.shadow = ShadowMirror(runner, manager)
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # -- the request path ------------------------------------------------------

    def _state(self, name: str, entry: ModelEntry) -> ModelTraffic:
        """The traffic state of model ``name``, up to date with its last load."""
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

    def _adopt_rollout(self, st: ModelTraffic, raw: dict[str, object] | None, why: str) -> None:
        """Start, keep or stop ``st``'s rollout as the ``rollout`` section ``raw`` asks.

        Raises:
            TrafficError: the section is malformed, or no baseline version is served.
        """
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

    def route(self, request: InferRequest) -> tuple[ModelVersion, Routed | None]:
        """The version that serves a request naming no version.

        Returns:
            ``(version, routed)``; ``routed`` is None for a model without traffic
            settings (the default version, nothing to observe), else what
            :meth:`observe` takes.

        Raises:
            InferError: an unknown model, no ready version, or (404) a pinned version
                (``x-pdserve-model-version``) that is not served.
        """
        name = request.model_name
        manager = self.manager
        entry = manager.models.get(name)
        if entry is None:
            return manager.get(name, ""), None
        st = self._state(name, entry)
        if request.pinned_version:
            mv = manager.get(name, request.pinned_version)
            route = "pinned"
        elif st.file_spec is None and st.override is None and st.rollout is None:
            entry.traffic_free = True  # the server skips route until the traffic changes
            return manager.get(name, ""), None  # no traffic settings
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
        return mv, Routed(st, mv, route)

    async def observe(
        self, routed: Routed, request: InferRequest, running: Awaitable[InferResponse]
    ) -> InferResponse:
        """Await ``running`` (``request`` on ``routed.mv``): its outcome goes into the
        version's window, and a routed (not pinned) answer is offered to the shadow."""
        st, mv = routed.st, routed.mv
        start = time.monotonic_ns()
        try:
            response = await running
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
        if routed.route != "pinned":
            spec = st.spec()
            shadow = spec.shadow if spec is not None else None
            if shadow is not None and shadow.version != mv.version:
                if shadow.percent >= 100 or random.random() * 100 < shadow.percent:
                    self.shadow.offer(st, shadow, request, response)
        return response

    # -- rollout -----------------------------------------------------------------

    def _decide(self, st: ModelTraffic, action: str, reason: str, **extra: object) -> None:
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
        """Evaluate every running rollout, at the shortest interval any asks for."""
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
        checked = p.max_divergence_rate is not None
        divergence = st.divergence_rate_for(p.canary, p.window_secs) if checked else (0, 0.0)
        breach = p.breaches(win, divergence)
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
        """Model ``name``'s entry and traffic state; 404 when it serves nothing."""
        entry = self.manager.models.get(name)
        if entry is None or not entry.serving:
            raise not_found(f"Request for unknown model: '{name}' is not served")
        return entry, self._state(name, entry)

    def describe_traffic(self, name: str) -> dict[str, object]:
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

    def set_traffic(self, name: str, doc: object) -> dict[str, object]:
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
        how = "reset to the traffic file" if st.override is None else "set by the admin endpoint"
        log.info("model %s: traffic %s: %s", name, how, st.weights())
        st.forget_split()
        entry.traffic_free = False
        return self.describe_traffic(name)

    def describe_rollout(self, name: str) -> dict[str, object]:
        """``GET /v2/models/{m}/rollout``: the rollout's state, windows and decisions.

        Raises:
            InferError(NOT_FOUND): the model is not served.
        """
        _, st = self._entry(name)
        r = st.rollout
        out: dict[str, object] = {
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

    def rollout_action(self, name: str, doc: object) -> dict[str, object]:
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
        self.shadow.closing = True
        for st in self.models.values():
            self.shadow.stop(st)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
