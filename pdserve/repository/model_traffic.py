"""What traffic control keeps for one model: the traffic in force, the split it makes,
outcome windows per version, shadow counters and rollout decisions."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

from pdserve.core.types import InferRequest, InferResponse
from pdserve.repository.rollout_policy import Rollout
from pdserve.repository.traffic import ShadowSpec, Split, TrafficSpec
from pdserve.repository.windows import Tally, TallyKey, Window

if TYPE_CHECKING:
    from pdserve.repository.entry import ModelEntry

log = logging.getLogger("pdserve.rollout")

#: Seconds over which the rolling shadow divergence rate is computed.
DIVERGENCE_WINDOW_S = 60.0
#: Divergent requests kept per model for ``GET /v2/models/{m}/traffic``.
DIVERGENT_SAMPLES = 10
#: Decisions kept per model for ``GET /v2/models/{m}/rollout``.
MAX_DECISIONS = 100


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
        self.decisions: collections.deque[dict[str, object]] = collections.deque(
            maxlen=MAX_DECISIONS
        )
        self.decision_counts: collections.Counter[str] = collections.Counter()
        self._split: Split | None = None
        self._split_for: tuple[object, tuple[tuple[int, float], ...]] | None = None
        self.unserved: list[int] = []
        # shadow
        self.queue: asyncio.Queue[tuple[ShadowSpec, InferRequest, InferResponse]] | None = None
        self.workers: list[asyncio.Task[None]] = []
        self.shadow_results: collections.Counter[tuple[str, str]] = collections.Counter()
        self.divergence: collections.Counter[str] = collections.Counter()
        self.compared: collections.Counter[str] = collections.Counter()
        #: recent comparisons: ("out", output, diverged) and ("ver", version, diverged)
        self.recent: Tally[TallyKey] = Tally()
        self.samples: collections.deque[dict[str, object]] = collections.deque(
            maxlen=DIVERGENT_SAMPLES
        )
        self.last_log: dict[str, float] = {}

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

    def forget_split(self) -> None:
        """Make the next :meth:`split` compute the split again (the weights changed)."""
        self._split_for = None

    def window(self, version: int) -> Window:
        """The outcome window of ``version`` (made on first use)."""
        w = self.windows.get(version)
        if w is None:
            w = self.windows[version] = Window()
        return w

    def divergence_rates(self, window_s: float = DIVERGENCE_WINDOW_S) -> dict[str, float]:
        """Output -> divergent / compared over the last ``window_s`` seconds."""
        t = self.recent.total(window_s)
        seen: collections.Counter[str] = collections.Counter()
        for (kind, output, _), n in t.items():
            if kind == "out" and isinstance(output, str):
                seen[output] += n
        return {o: t[("out", o, True)] / n for o, n in seen.items() if n}

    def divergence_rate_for(self, version: int, window_s: float) -> tuple[int, float]:
        """``(requests compared, share that diverged in any output)`` for shadow
        ``version`` over the last ``window_s`` seconds."""
        t = self.recent.total(window_s)
        bad, good = t[("ver", version, True)], t[("ver", version, False)]
        n = bad + good
        return n, (bad / n if n else 0.0)
