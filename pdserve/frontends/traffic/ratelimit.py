"""Rate limits per key, per model and global (:class:`RateLimiter`), on the ``limits``
library and, in memory, pdserve's own :class:`TokenBucket`.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve.core.errors import ErrorCode, InferError

if TYPE_CHECKING:
    from limits import RateLimitItem

log = logging.getLogger("pdserve.ratelimit")

STRATEGIES = ("auto", "token-bucket", "moving-window", "sliding-window-counter", "fixed-window")
FAIL_MODES = ("open", "closed")
#: Seconds a failed storage is left alone before it is tried again.
RETRY_SECS = 1.0
#: Seconds a Redis command may take before it counts as a storage failure.
REDIS_TIMEOUT_SECS = 0.25


class RateLimitConfigError(ValueError):
    """A malformed rate limit, storage URI, strategy or fail mode."""


def parse_rate(text: str) -> RateLimitItem:
    """A ``limits`` RateLimitItem from ``100/second``, ``5 per 10 seconds``...

    Raises:
        RateLimitConfigError: the text is not one limit, or the extra is missing.
    """
    try:
        import limits
    except ImportError as e:
        raise RateLimitConfigError(
            f"rate limits need the 'limits' package (pip install 'pdserve[traffic]'): {e}"
        ) from None
    try:
        items = limits.parse_many(text)
    except ValueError:
        raise RateLimitConfigError(
            f"bad rate limit {text!r}; expected e.g. '100/second' or '5 per 10 seconds'"
        ) from None
    if len(items) != 1:
        raise RateLimitConfigError(f"bad rate limit {text!r}: give exactly one limit")
    return items[0]


def check_storage_uri(uri: str) -> None:
    """Raises RateLimitConfigError unless ``uri`` is ``memory://`` or a Redis URI."""
    if uri != "memory://" and not uri.startswith(("redis://", "rediss://")):
        raise RateLimitConfigError(
            f"rate limit storage must be memory:// or redis://host:port[/db], got {uri!r}"
        )


class TokenBucket:
    """In-process token buckets, one per identifier, for ``N per P seconds`` limits.

    Not shared between processes; O(1) per check; called on the event loop only.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        #: identifiers -> [tokens, last refill time, capacity, rate per second]
        self._buckets: dict[tuple[str, ...], list[float]] = {}

    def hit(self, capacity: float, rate: float, key: tuple[str, ...]) -> float:
        """Take a token from bucket ``key`` (``capacity`` tokens, ``rate`` back per second).

        Returns:
            0.0 when taken, else the seconds until a token is back.
        """
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None or bucket[2] != capacity or bucket[3] != rate:  # new, or limit changed
            if len(self._buckets) >= 100_000:  # bounded: drop full (idle) buckets
                self._buckets = {k: b for k, b in self._buckets.items() if b[0] < b[2]}
            bucket = self._buckets[key] = [capacity, now, capacity, rate]
        tokens = bucket[0] + (now - bucket[1]) * rate
        if tokens > capacity:
            tokens = capacity
        bucket[1] = now
        if tokens >= 1.0:
            bucket[0] = tokens - 1.0
            return 0.0
        bucket[0] = tokens
        return (1.0 - tokens) / rate


class RateLimitExceededError(InferError):
    """429 / ``RESOURCE_EXHAUSTED``: ``retry_after`` seconds (int >= 1)."""

    def __init__(self, message: str, scope: str, retry_after: int) -> None:
        super().__init__(message, ErrorCode.RESOURCE_EXHAUSTED, reason="REJECTED")
        self.scope = scope
        self.retry_after = retry_after


class RateLimiter:
    """Checks inference requests against their limits.

    Configured in the auth config file's ``rate_limits`` section (and each key's
    ``rate_limit``)::

        rate_limits:
          global: 1000/second          # every inference request of this server (or of all
                                       # replicas sharing one Redis)
          models:                      # fnmatch pattern -> limit, each model counted apart;
            "resnet*": 200/second      # the first pattern that matches applies
            bert: 50 per 10 seconds

    Limits are ``limits`` strings (``N/second``, ``N per M minutes``...). Only inference
    requests are counted. A request is checked against its key's limit, then its
    model's, then the global one; the first used up answers HTTP 429 with
    ``Retry-After`` (seconds until the window frees a slot, at least 1) or gRPC
    ``RESOURCE_EXHAUSTED`` with ``retry-after`` trailing metadata.

    Storage (``--rate-limit-storage``): ``memory://`` (default; per process) or
    ``redis://host:port[/db]`` (``rediss://`` for TLS): replicas sharing a Redis share
    one budget. Strategy (``--rate-limit-strategy``): ``auto`` (default) is a token
    bucket in memory and ``limits``' moving window in Redis; ``token-bucket`` (memory
    only), ``moving-window``, ``sliding-window-counter`` and ``fixed-window`` (the
    ``limits`` strategies) choose one.

    In memory (``auto``, ``token-bucket``) pdserve uses its own :class:`TokenBucket`: the
    ``limits`` in-memory strategies take an ``asyncio.Lock`` and several coroutines per
    check, too much per request. A limit ``N per P seconds`` is a bucket of N tokens refilled
    at N/P per second: bursts up to N, N per P on average. Against Redis the network round
    trip dominates, and the shared state is what ``limits`` is for.

    When the storage fails (Redis down at start, or going away), the request is let
    through (``--rate-limit-fail-mode open``, the default: a limiter outage must not
    become a serving outage) or refused with 503 / ``UNAVAILABLE`` (``closed``). Either
    way the failure is logged once per outage, counted
    (``pdserve_rate_limit_storage_errors_total``), and the storage is not asked again
    for :data:`RETRY_SECS` seconds (so a dead Redis costs no time per request).

    Args:
        section: the ``rate_limits`` section (``global``, ``models``).
        storage_uri: ``memory://`` or ``redis://...``.
        strategy: one of :data:`STRATEGIES`.
        fail_open: let requests through while the storage fails.

    Raises:
        RateLimitConfigError: a bad limit, URI or strategy.
    """

    def __init__(
        self,
        section: dict[str, Any],
        storage_uri: str = "memory://",
        strategy: str = "auto",
        fail_open: bool = True,
    ) -> None:
        from limits.aio import strategies
        from limits.storage import storage_from_string

        check_storage_uri(storage_uri)
        if strategy not in STRATEGIES:
            raise RateLimitConfigError(
                f"rate limit strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
            )
        self.storage_uri = storage_uri
        self.fail_open = fail_open
        if strategy == "auto":
            strategy = "token-bucket" if storage_uri == "memory://" else "moving-window"
        if strategy == "token-bucket" and storage_uri != "memory://":
            raise RateLimitConfigError(
                "the token-bucket strategy keeps its state in memory only; with Redis use "
                "moving-window, sliding-window-counter or fixed-window"
            )
        self.strategy = strategy
        #: pdserve's in-process token bucket (memory:// with token-bucket), else None
        self.bucket = TokenBucket() if strategy == "token-bucket" else None
        self.global_limit: RateLimitItem | None = None
        self.model_limits: list[tuple[str, RateLimitItem]] = []
        self.set_limits(section)
        if storage_uri == "memory://":
            storage = storage_from_string("async+memory://")
        else:
            storage = storage_from_string(
                "async+" + storage_uri,
                implementation="redispy",
                socket_timeout=REDIS_TIMEOUT_SECS,
                socket_connect_timeout=REDIS_TIMEOUT_SECS,
                key_prefix="pdserve",
            )
        self.storage = storage
        cls = {
            "token-bucket": strategies.MovingWindowRateLimiter,  # unused: the bucket
            "moving-window": strategies.MovingWindowRateLimiter,
            "sliding-window-counter": strategies.SlidingWindowCounterRateLimiter,
            "fixed-window": strategies.FixedWindowRateLimiter,
        }[strategy]
        self.limiter = (
            None if self.bucket is not None else cls(storage)  # type: ignore[abstract]  # the dict joins the concrete classes
        )
        self._item_cache: dict[str, RateLimitItem] = {}
        #: limit item -> (capacity, tokens per second), for the token bucket
        self._rates: dict[RateLimitItem, tuple[float, float]] = {}
        self._model_cache: dict[str, RateLimitItem | None] = {}
        self._down_until = 0.0
        self.storage_down = False
        #: requests refused, by (scope, model, key name)
        self.limited: dict[tuple[str, str, str], int] = {}
        self.storage_errors = 0

    def set_limits(self, section: dict[str, Any]) -> None:
        """(Re)read the ``rate_limits`` section (on reload).

        Raises:
            RateLimitConfigError: a bad limit; nothing is changed then.
        """
        unknown = set(section) - {"global", "models"}
        if unknown:
            raise RateLimitConfigError(
                f"rate_limits: unknown field(s) {', '.join(sorted(map(str, unknown)))}; "
                "expected global, models"
            )
        g = section.get("global")
        global_limit = parse_rate(g) if g is not None else None
        models = section.get("models") or {}
        if not isinstance(models, dict):
            raise RateLimitConfigError("rate_limits.models must map model patterns to limits")
        model_limits = [(str(p), parse_rate(str(v))) for p, v in models.items()]
        self.global_limit = global_limit
        self.model_limits = model_limits
        self._model_cache = {}

    @property
    def active(self) -> bool:
        """True when any global or model limit is configured."""
        return self.global_limit is not None or bool(self.model_limits)

    def _model_limit(self, model: str) -> RateLimitItem | None:
        try:
            return self._model_cache[model]
        except KeyError:
            pass
        found = None
        for pattern, item in self.model_limits:
            if fnmatch.fnmatchcase(model, pattern):
                found = item
                break
        if len(self._model_cache) < 10_000:
            self._model_cache[model] = found
        return found

    def _item(self, text: str) -> RateLimitItem:
        item = self._item_cache.get(text)
        if item is None:
            item = self._item_cache[text] = parse_rate(text)
        return item

    async def check(self, model: str, key_name: str, key_limit: str | None) -> None:
        """Count one inference request of ``model`` by ``key_name``.

        Raises:
            RateLimitExceededError: a limit is used up.
            InferError(UNAVAILABLE): the storage fails and the fail mode is closed.
        """
        checks: list[tuple[str, RateLimitItem, tuple[str, ...]]] = []
        if key_limit is not None:
            checks.append(("key", self._item(key_limit), ("key", key_name)))
        model_item = self._model_limit(model) if self.model_limits else None
        if model_item is not None:
            checks.append(("model", model_item, ("model", model)))
        if self.global_limit is not None:
            checks.append(("global", self.global_limit, ("global",)))
        if not checks:
            return
        bucket = self.bucket
        if bucket is not None:  # in memory: no storage to fail
            rates = self._rates
            for scope, item, ids in checks:
                rate = rates.get(item)
                if rate is None:
                    amount = float(item.amount)
                    rate = rates[item] = (amount, amount / float(item.get_expiry()))
                wait_s = bucket.hit(rate[0], rate[1], ids)
                if wait_s:
                    self._refuse(scope, item, model, key_name, max(1, math.ceil(wait_s)))
            return
        limiter = self.limiter
        assert limiter is not None
        if self._down_until and time.monotonic() < self._down_until:
            self._storage_failed(None)
            return
        try:
            for scope, item, ids in checks:
                if not await limiter.hit(item, *ids):
                    stats = await limiter.get_window_stats(item, *ids)
                    wait = max(1, math.ceil(stats.reset_time - time.time()))
                    self._refuse(scope, item, model, key_name, wait)
        except RateLimitExceededError:
            raise
        except Exception as e:  # noqa: BLE001 - redis errors, timeouts: the storage failed
            self._storage_failed(e)
            return
        if self.storage_down:
            self.storage_down = False
            self._down_until = 0.0
            log.warning("rate limit storage %s is back", self.where())

    def _refuse(
        self, scope: str, item: RateLimitItem, model: str, key_name: str, wait: int
    ) -> None:
        label = (scope, model if scope == "model" else "", key_name if scope == "key" else "")
        self.limited[label] = self.limited.get(label, 0) + 1
        what = {
            "key": f"of key '{key_name}'",
            "model": f"of model '{model}'",
            "global": "of this server",
        }[scope]
        raise RateLimitExceededError(
            f"rate limit {what} exceeded ({item}); retry in {wait} s", scope, wait
        )

    def where(self) -> str:
        """The storage URI without its password (for logs)."""
        uri = self.storage_uri
        at = uri.rfind("@")  # never log a password in the URI
        return uri if at < 0 else uri.split("://", 1)[0] + "://" + uri[at + 1 :]

    def _storage_failed(self, error: Exception | None) -> None:
        self.storage_errors += 1
        if error is not None:
            self._down_until = time.monotonic() + RETRY_SECS
            if not self.storage_down:
                self.storage_down = True
                log.error(
                    "rate limit storage %s failed (%s); failing %s: requests are %s until it answers",
                    self.where(),
                    type(error).__name__,
                    "open" if self.fail_open else "closed",
                    "let through without a limit" if self.fail_open else "refused with 503",
                )
        if not self.fail_open:
            raise InferError(
                "rate limit storage unavailable; request refused (--rate-limit-fail-mode closed)",
                ErrorCode.UNAVAILABLE,
            )
