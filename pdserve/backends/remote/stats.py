"""Per-target counters of remote models, read by the metrics exporter at scrape time.

The backend (below the observability layer) only counts; :mod:`pdserve.observability.metrics`
renders ``pdserve_remote_*`` from :data:`TARGETS`. Everything is updated on the event
loop thread, so plain ints suffice.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from pdserve.core.stats import LATENCY_BUCKETS

#: Upper bounds (seconds) of the remote request duration histogram (``+Inf`` implicit):
#: the server's latency histograms' bounds.
DURATION_BUCKETS: tuple[float, ...] = LATENCY_BUCKETS


@dataclass
class TargetStats:
    """What one local remote model saw of its target.

    Attributes:
        target: the target's address as configured (``url`` parameter).
        model: the local model name.
        protocol: ``grpc`` or ``http``.
        up: the last health probe (or call) found the target's model ready.
        bucket_counts: per :data:`DURATION_BUCKETS` bound (plus ``+Inf``), calls to the
            target that got an answer (success or error), by duration.
        duration_sum: seconds, summed over those calls.
        requests: calls made (retries included).
        errors: error code name (pdserve's ``ErrorCode``) -> calls that failed with it.
        retries: calls repeated after an UNAVAILABLE failure.
    """

    target: str
    model: str
    protocol: str
    up: bool = False
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    duration_sum: float = 0.0
    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    retries: int = 0

    def observe(self, seconds: float) -> None:
        """Count one answered call that took ``seconds``."""
        self.bucket_counts[bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.duration_sum += seconds

    def error(self, code: str) -> None:
        """Count one failed call with ``code`` (an ``ErrorCode`` name)."""
        self.errors[code] = self.errors.get(code, 0) + 1


#: (target, local model) -> its counters, for every remote model loaded in this process
#: (kept after an unload so counters never go backwards within a process).
TARGETS: dict[tuple[str, str], TargetStats] = {}


def stats_for(target: str, model: str, protocol: str) -> TargetStats:
    """The counters of ``model`` forwarding to ``target`` (created on first use)."""
    key = (target, model)
    st = TARGETS.get(key)
    if st is None:
        st = TARGETS[key] = TargetStats(target, model, protocol)
    st.protocol = protocol
    return st
