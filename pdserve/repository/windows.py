"""Recent outcomes of a model version in one-second buckets: request counts, errors and
a latency histogram (:class:`Window`), and counts of anything (:class:`Tally`)."""

from __future__ import annotations

import collections
import math
import time
from bisect import bisect_left
from collections.abc import Hashable
from typing import Any, Generic, TypedDict, TypeVar

#: The longest window, in seconds (``window_secs``): one-second buckets are kept
#: this long per version.
MAX_WINDOW_S = 3600

#: Upper bounds (seconds) of the latency bins a window counts in: 0.1 ms to 100 s, 16
#: per decade (each 15 % wider than the one before), so a p99 is read within 15 %.
LATENCY_BINS: tuple[float, ...] = tuple(1e-4 * 10 ** (i / 16) for i in range(97))


K = TypeVar("K", bound=Hashable)

#: A :class:`Tally` key of shadow comparisons: ``("out", output, diverged)`` or
#: ``("ver", version, diverged)``.
TallyKey = tuple[str, str, bool] | tuple[str, int, bool]


class WindowSummary(TypedDict):
    """A :class:`Window` over its last seconds (see :meth:`Window.summary`)."""

    requests: int
    errors: int
    error_rate: float
    p99_ms: float | None


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

    def summary(self, window_s: float) -> WindowSummary:
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


class Tally(Generic[K]):
    """Counts in one-second buckets (``[second, Counter]``), summed over a window."""

    __slots__ = ("buckets",)

    def __init__(self) -> None:
        self.buckets: collections.deque[tuple[int, collections.Counter[K]]] = collections.deque(
            maxlen=MAX_WINDOW_S
        )

    def add(self, key: K, n: int = 1) -> None:
        """Count ``n`` of ``key`` now."""
        sec = int(time.monotonic())
        if not self.buckets or self.buckets[-1][0] != sec:
            self.buckets.append((sec, collections.Counter()))
        self.buckets[-1][1][key] += n

    def total(self, window_s: float) -> collections.Counter[K]:
        """The counts of the last ``window_s`` seconds (whole seconds)."""
        first = int(time.monotonic()) - max(0, math.ceil(window_s) - 1)
        out: collections.Counter[K] = collections.Counter()
        for sec, counts in reversed(self.buckets):
            if sec < first:
                break
            out.update(counts)
        return out
