"""A rollout: the ``rollout`` section of a traffic file (:class:`RolloutPolicy`), its
progress (:class:`Rollout`), and the bounds a canary's window must stay within."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from pdserve.repository.traffic import TrafficError, check_keys
from pdserve.repository.windows import MAX_WINDOW_S, WindowSummary

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
    def parse(cls, raw: object, where: str = "rollout") -> RolloutPolicy:
        """Parse and check a ``rollout`` mapping.

        Raises:
            TrafficError: unknown keys, a missing ``canary``, steps that are not
                ascending percents ending at 100, a non-positive duration, rates
                outside [0, 1].
        """
        if not isinstance(raw, dict):
            raise TrafficError(f"{where}: must be a mapping with 'canary'")
        check_keys(raw, _ROLLOUT_KEYS, where)
        if "canary" not in raw:
            raise TrafficError(f"{where}: 'canary' (the version to roll out) is required")

        def version(key: str) -> int:
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TrafficError(f"{where}.{key}: {v!r} is not a version number")
            return v

        def optional_number(key: str, low: float, high: float = math.inf) -> float | None:
            return None if raw.get(key) is None else number(key, 0.0, low, high)

        def number(key: str, default: float, low: float, high: float = math.inf) -> float:
            v = raw.get(key, default)
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
            max_p99_ms=optional_number("max_p99_ms", 0.0),
            max_divergence_rate=optional_number("max_divergence_rate", 0.0, 1.0),
            interval_secs=number("interval_secs", 0.5, 0.05, 60.0),
        )

    def breaches(self, win: WindowSummary, divergence: tuple[int, float]) -> list[str]:
        """The bounds the canary's window breaks, in words (empty: none).

        Args:
            win: the canary's :meth:`Window.summary <pdserve.repository.windows.Window.summary>`
                over :attr:`window_secs`.
            divergence: ``(requests compared, share that diverged)`` of the shadow
                mirroring to the canary over the same window.
        """
        breach = []
        if win["requests"] >= self.min_requests:
            if win["error_rate"] > self.max_error_rate:
                breach.append(
                    f"error rate {win['error_rate']:.3f} > {self.max_error_rate:g} "
                    f"({win['errors']}/{win['requests']} in {self.window_secs:g}s)"
                )
            if self.max_p99_ms is not None and (win["p99_ms"] or 0) > self.max_p99_ms:
                breach.append(f"p99 {win['p99_ms']:.1f} ms > {self.max_p99_ms:g} ms")
        if self.max_divergence_rate is not None:
            n, rate = divergence
            if n >= self.min_requests and rate > self.max_divergence_rate:
                breach.append(
                    f"shadow divergence {rate:.3f} > {self.max_divergence_rate:g} ({n} compared)"
                )
        return breach

    def as_dict(self) -> dict[str, object]:
        """The JSON form."""
        d = dict(self.__dict__)
        d["steps"] = list(self.steps)
        return d


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
