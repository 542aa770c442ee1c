"""Circuit breaker per model version: a version whose requests keep failing is cut off
for a while.

**closed**: requests run and outcomes are counted; the circuit opens after
``consecutive_failures`` failures in a row, or when at least ``min_requests`` ran in the
last ``window_secs`` and the failed share reaches ``failure_rate``. **open**: every
request gets a fast ``UNAVAILABLE`` (HTTP 503 with ``Retry-After``) for ``open_secs``.
**half-open**: up to ``half_open_probes`` requests run; that many successes close the
circuit, one failure opens it again. A failure is ``INTERNAL``, ``UNKNOWN`` or
``UNAVAILABLE`` or an unexpected exception; a bad, cancelled or abandoned request counts
as neither. Policies come from ``--circuit-breaker`` and a model's ``circuit_breaker``
parameter (``key=value,...`` or ``off``). Every transition is logged and counted. The
breaker runs on the event loop only (no locks).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace

from pdserve.core.errors import ErrorCode, InferError

log = logging.getLogger("pdserve.breaker")

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
#: ``pdserve_circuit_state`` values.
STATE_VALUES = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}

#: Error codes that count as a failure of the model version.
FAILURE_CODES = frozenset({ErrorCode.INTERNAL, ErrorCode.UNKNOWN, ErrorCode.UNAVAILABLE})

#: The config.pbtxt parameter naming a model's own policy.
PARAMETER = "circuit_breaker"


class BreakerSpecError(ValueError):
    """A ``--circuit-breaker`` / ``circuit_breaker`` parameter value is malformed."""


@dataclass(frozen=True)
class BreakerPolicy:
    """When a circuit opens and how it recovers (see the module docstring).

    Attributes:
        consecutive_failures: open after this many failures in a row (0: not used).
        failure_rate: open when the failed share of the window reaches this (0-1;
            0: not used).
        window_secs: the window of ``failure_rate``, seconds (whole seconds, 1-3600).
        min_requests: the fewest requests in the window before ``failure_rate`` applies.
        open_secs: how long an open circuit refuses requests, seconds.
        half_open_probes: requests let through at once while half-open; that many
            successes close the circuit.
    """

    consecutive_failures: int = 5
    failure_rate: float = 0.5
    window_secs: int = 10
    min_requests: int = 20
    open_secs: float = 5.0
    half_open_probes: int = 1

    @classmethod
    def parse(cls, spec: str, base: BreakerPolicy | None = None) -> BreakerPolicy | None:
        """``key=value,...`` over ``base`` (default: the class defaults); ``off`` -> None;
        ``on`` / ``default`` / empty -> ``base``.

        Raises:
            BreakerSpecError: an unknown key, a value of the wrong type or out of range.
        """
        text = spec.strip()
        policy = base or cls()
        if text.lower() in ("off", "false", "none", "0"):
            return None
        if text.lower() in ("", "on", "true", "default"):
            return policy
        types = {f.name: f.type for f in fields(cls)}
        changes: dict[str, int | float] = {}
        for item in text.split(","):
            key, sep, value = item.strip().partition("=")
            key = key.strip()
            if not sep or key not in types:
                raise BreakerSpecError(
                    f"bad circuit breaker setting {item.strip()!r}; expected KEY=VALUE with KEY "
                    f"one of {', '.join(types)}"
                )
            try:
                changes[key] = int(value) if types[key] == "int" else float(value)
            except ValueError:
                raise BreakerSpecError(
                    f"circuit breaker {key} must be a number, got {value.strip()!r}"
                ) from None
        policy = replace(policy, **changes)  # type: ignore[arg-type]  # keys checked above
        policy.check()
        return policy

    def check(self) -> None:
        """Raises BreakerSpecError when a value is out of range."""
        if self.consecutive_failures < 0:
            raise BreakerSpecError("circuit breaker consecutive_failures must be >= 0")
        if not (0.0 <= self.failure_rate <= 1.0):
            raise BreakerSpecError("circuit breaker failure_rate must be 0-1")
        if self.consecutive_failures == 0 and self.failure_rate == 0:
            raise BreakerSpecError(
                "circuit breaker needs consecutive_failures > 0 or failure_rate > 0"
            )
        if not 1 <= self.window_secs <= 3600:
            raise BreakerSpecError("circuit breaker window_secs must be 1-3600")
        if self.min_requests < 1:
            raise BreakerSpecError("circuit breaker min_requests must be >= 1")
        if not (math.isfinite(self.open_secs) and self.open_secs > 0):
            raise BreakerSpecError("circuit breaker open_secs must be > 0")
        if self.half_open_probes < 1:
            raise BreakerSpecError("circuit breaker half_open_probes must be >= 1")


class CircuitBreaker:
    """The breaker of one model version.

    Use: :meth:`admit` before running a request (raises when refused; returns a
    token), then exactly one of :meth:`record` (the outcome) or :meth:`release` (no
    outcome: a bad or cancelled request) with that token.

    Args:
        model / version: for log lines, errors and metrics.
        policy: the :class:`BreakerPolicy`.
        clock: monotonic seconds (tests pass their own).
        on_transition: called ``(breaker, old_state, new_state, why)`` on each change.
    """

    def __init__(
        self,
        model: str,
        version: str,
        policy: BreakerPolicy,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Callable[[CircuitBreaker, str, str, str], None] | None = None,
    ) -> None:
        self.model = model
        self.version = version
        self.policy = policy
        self.clock = clock
        self.on_transition = on_transition
        self.state = CLOSED
        self.opened_at = 0.0
        self.consecutive = 0
        self.probes_running = 0
        self.probe_successes = 0
        n = policy.window_secs
        self._second = [-1] * n  # which whole second each slot counts
        self._total = [0] * n
        self._failed = [0] * n
        #: transitions by new state, and requests refused while open / half-open
        self.transitions: dict[str, int] = {CLOSED: 0, OPEN: 0, HALF_OPEN: 0}
        self.rejected = 0

    # -- the request path -----------------------------------------------------------

    def admit(self) -> bool:
        """Let a request through, or refuse it.

        Returns:
            True when the request is a half-open probe (pass it back to
            :meth:`record` / :meth:`release`), False for a normal request.

        Raises:
            InferError(UNAVAILABLE, reason "REJECTED"): the circuit is open (or
                half-open with every probe slot taken); ``retry_after`` (seconds, int)
                is set on the error.
        """
        state = self.state
        if state is CLOSED:
            return False
        now = self.clock()
        if state is OPEN:
            if now - self.opened_at < self.policy.open_secs:
                raise self._refuse(now)
            self._move(HALF_OPEN, f"{self.policy.open_secs:g} s open: probing")
        if self.probes_running >= self.policy.half_open_probes:
            raise self._refuse(now)
        self.probes_running += 1
        return True

    def record(self, probe: bool, failed: bool) -> None:
        """The outcome of an admitted request (``failed``: see :data:`FAILURE_CODES`)."""
        if probe:
            self.probes_running = max(0, self.probes_running - 1)
            if self.state is not HALF_OPEN:
                return
            if failed:
                self._open("a half-open probe failed")
                return
            self.probe_successes += 1
            if self.probe_successes >= self.policy.half_open_probes:
                self._move(CLOSED, f"{self.probe_successes} probe(s) succeeded")
            return
        if self.state is not CLOSED:
            return  # a request admitted before the circuit opened
        policy = self.policy
        now = self.clock()
        sec = int(now)
        i = sec % policy.window_secs
        if self._second[i] != sec:
            self._second[i] = sec
            self._total[i] = 0
            self._failed[i] = 0
        self._total[i] += 1
        if not failed:
            self.consecutive = 0
            return
        self._failed[i] += 1
        self.consecutive += 1
        if policy.consecutive_failures and self.consecutive >= policy.consecutive_failures:
            self._open(f"{self.consecutive} consecutive failures")
            return
        if policy.failure_rate:
            total, bad = self.window_counts(now)
            if total >= policy.min_requests and bad >= policy.failure_rate * total:
                self._open(
                    f"{bad} of {total} requests failed in {policy.window_secs} s "
                    f"(failure_rate {policy.failure_rate:g})"
                )

    def release(self, probe: bool) -> None:
        """An admitted request ended without an outcome that counts."""
        if probe:
            self.probes_running = max(0, self.probes_running - 1)

    # -- state ----------------------------------------------------------------------

    def window_counts(self, now: float | None = None) -> tuple[int, int]:
        """(requests, failures) counted over the last ``window_secs`` seconds."""
        sec = int(self.clock() if now is None else now)
        oldest = sec - self.policy.window_secs + 1
        total = bad = 0
        for s, t, f in zip(self._second, self._total, self._failed, strict=True):
            if s >= oldest:
                total += t
                bad += f
        return total, bad

    def retry_after(self, now: float | None = None) -> float:
        """Seconds until an open circuit lets a probe through (0 when not open)."""
        if self.state is not OPEN:
            return 0.0
        t = self.clock() if now is None else now
        return max(0.0, self.policy.open_secs - (t - self.opened_at))

    def _refuse(self, now: float) -> InferError:
        self.rejected += 1
        wait = max(1, math.ceil(self.retry_after(now)))
        err = InferError(
            f"circuit breaker open for model '{self.model}' version {self.version}: "
            f"the model version has been failing; retry in {wait} s",
            ErrorCode.UNAVAILABLE,
            reason="REJECTED",
        )
        err.retry_after = wait  # type: ignore[attr-defined]  # read by the frontends
        return err

    def _open(self, why: str) -> None:
        self.opened_at = self.clock()
        self._move(OPEN, why)

    def _move(self, new: str, why: str) -> None:
        old = self.state
        self.state = new
        self.transitions[new] += 1
        self.consecutive = 0
        self.probe_successes = 0
        if new is CLOSED:
            self._second = [-1] * self.policy.window_secs
        log.warning(
            "circuit breaker %s version %s: %s -> %s (%s)", self.model, self.version, old, new, why
        )
        if self.on_transition is not None:
            try:
                self.on_transition(self, old, new, why)
            except Exception:  # noqa: BLE001 - a listener must not break the request path
                log.exception("circuit breaker transition listener failed")


class BreakerBoard:
    """The breakers of a server, one per model version, made on first use.

    Args:
        default: the policy of models without their own ``circuit_breaker``
            parameter (``--circuit-breaker``); None: only models with the parameter
            have a breaker.
    """

    def __init__(self, default: BreakerPolicy | None = None) -> None:
        self.default = default
        #: (model, version) -> (the ModelVersion object, weakly; its breaker or None)
        self._by_version: dict[
            tuple[str, str], tuple[weakref.ref[object], CircuitBreaker | None]
        ] = {}

    def for_version(
        self, mv: object, model: str, version: str, params: object
    ) -> CircuitBreaker | None:
        """The breaker of a model version (None: it has none).

        A reloaded version (another ModelVersion object) gets a fresh breaker, with
        the policy of its new configuration.

        Args:
            mv: the ModelVersion (identity only).
            params: its ``ModelConfig.parameters`` map (protobuf map of
                ``ModelParameter``); read once per ModelVersion.
        """
        entry = self._by_version.get((model, version))
        if entry is not None and entry[0]() is mv:
            return entry[1]
        breaker: CircuitBreaker | None = None
        policy = self.default
        try:
            p = params.get(PARAMETER) if hasattr(params, "get") else None
            if p is not None:
                policy = BreakerPolicy.parse(p.string_value, self.default)
        except BreakerSpecError as e:
            log.error(
                "model %s: config.pbtxt parameter %s: %s; using the server's policy",
                model,
                PARAMETER,
                e,
            )
        if policy is not None:
            breaker = CircuitBreaker(model, version, policy)
        self._by_version[(model, version)] = (weakref.ref(mv), breaker)
        return breaker

    def samples(self) -> Iterator[tuple[str, str, str, dict[str, str], float]]:
        """Metric samples ``(name, type, help, labels, value)`` of every breaker:
        ``pdserve_circuit_state`` (0 closed, 1 open, 2 half-open),
        ``pdserve_circuit_transitions_total{to}``, ``pdserve_circuit_rejected_total``."""
        for b in self.breakers():
            labels = {"model": b.model, "version": b.version}
            yield (
                "pdserve_circuit_state", "gauge",
                "Circuit breaker state per model version: 0 closed, 1 open, 2 half-open",
                labels, STATE_VALUES[b.state],
            )  # fmt: skip
            for state, n in b.transitions.items():
                yield (
                    "pdserve_circuit_transitions_total", "counter",
                    "Circuit breaker transitions per model version, by the state entered",
                    {**labels, "to": state}, n,
                )  # fmt: skip
            yield (
                "pdserve_circuit_rejected_total", "counter",
                "Requests refused fast (503) by an open or half-open circuit breaker",
                labels, b.rejected,
            )  # fmt: skip

    def breakers(self) -> list[CircuitBreaker]:
        """Every breaker made so far, by model then version."""
        out = [b for (_, b) in self._by_version.values() if b is not None]
        return sorted(out, key=lambda b: (b.model, b.version))


def is_failure(error: BaseException) -> bool:
    """Whether an error counts against the model version (see :data:`FAILURE_CODES`).

    A cancelled request (reason ``CANCELED``: its client went away or its own
    ``timeout`` parameter expired) never counts: the client chose it, so one client
    with a tiny timeout cannot open the circuit for everyone."""
    if isinstance(error, InferError):
        return error.code in FAILURE_CODES and error.reason != "CANCELED"
    return True
