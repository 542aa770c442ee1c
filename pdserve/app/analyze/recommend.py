"""What ``pdserve analyze`` measured of each configuration, and which one it
recommends.

A configuration is measured at increasing concurrency levels (closed loop, as
model_analyzer drives perf_analyzer); its *score* is the best throughput of a
level without errors whose p99 latency meets the SLO (``--p99-ms``). A
configuration is *feasible* when it has such a level and its resident memory is
within the budget (``--memory-budget``; an unknown memory passes). The
recommendation is the feasible configuration with the highest score (ties: less
memory, then the one measured first), as model_analyzer's default objective
(throughput) under its ``latency_budget`` and memory constraints.

Pure functions and data only (no I/O).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.app.analyze.space import Knobs, Point, describe_point

MIB = 1024 * 1024

#: A level's p99 counts only when it rests on at least this many requests
#: (perf_analyzer's ``--measurement-request-count`` default); slower models need
#: longer windows (``-p``).
MIN_LEVEL_REQUESTS = 50


@dataclass
class LevelResult:
    """One concurrency level of one configuration (client-side figures)."""

    concurrency: int
    infer_per_sec: float
    p50_ms: float
    p99_ms: float
    errors: int = 0
    stable: bool = True
    #: Mean rows per model execution (statistics extension), 0 when unknown.
    avg_batch: float = 0.0
    #: Successful requests the figures rest on (None: unknown).
    requests: int | None = None
    #: Why perf stopped this level early (a window without any response...).
    aborted: str | None = None

    @property
    def usable(self) -> bool:
        """Whether the level can count: no errors, not aborted, some throughput,
        and at least :data:`MIN_LEVEL_REQUESTS` requests behind its p99."""
        return (
            self.errors == 0
            and self.aborted is None
            and self.infer_per_sec > 0
            and (self.requests is None or self.requests >= MIN_LEVEL_REQUESTS)
        )

    def as_dict(self) -> dict[str, object]:
        """Plain JSON values."""
        return dict(self.__dict__)


@dataclass
class ConfigResult:
    """One configuration and what was measured of it.

    Attributes:
        index: order of measurement (0 = the first, the shipped configuration).
        point: model -> knobs.
        shipped: this is the shipped configuration.
        levels: concurrency levels measured, in order.
        memory_bytes: resident memory the configuration added to the server (its
            processes together) at its highest, None when not measured.
        memory_loaded_bytes: the same right after loading, before any request.
        status: ``ok``; ``partial`` (the time budget ended the sweep early; the
            levels measured count); ``failed`` (it did not load or serve, see
            ``error``).
        load_s: seconds the load took (repository API).
        elapsed_s: seconds the whole measurement took (server start to stop).
        repeat: 0 for the search's measurement, 1, 2... for confirmation runs.
    """

    index: int
    point: Point
    shipped: bool = False
    levels: list[LevelResult] = field(default_factory=list)
    memory_bytes: float | None = None
    memory_loaded_bytes: float | None = None
    #: The highest Pss sum minus the one before the load (shared pages split).
    memory_pss_bytes: float | None = None
    status: str = "ok"
    error: str | None = None
    load_s: float = 0.0
    elapsed_s: float = 0.0
    repeat: int = 0
    #: Why the concurrency sweep stopped (``p99 above the SLO``, ``no gain``...).
    stop_reason: str = ""

    @property
    def label(self) -> str:
        """``#3`` (``#0 shipped``)."""
        return f"#{self.index}" + (" shipped" if self.shipped else "")

    @property
    def description(self) -> str:
        """The knobs in words."""
        return describe_point(self.point)

    @property
    def instances(self) -> int:
        """Instances of every model together."""
        return sum(k.instances for k in self.point.values())

    def memory_per_instance(self) -> float | None:
        """``memory_bytes`` / instances (bytes), None when not measured."""
        if self.memory_bytes is None:
            return None
        return self.memory_bytes / max(1, self.instances)

    def best_level(self, p99_ms: float | None) -> LevelResult | None:
        """The level with the highest throughput among the :attr:`LevelResult.usable`
        ones whose p99 is within ``p99_ms`` (any p99 when None); None when there
        is none."""
        ok = [lv for lv in self.levels if lv.usable and (p99_ms is None or lv.p99_ms <= p99_ms)]
        return max(ok, key=lambda lv: (lv.infer_per_sec, -lv.concurrency)) if ok else None

    def score(self, p99_ms: float | None) -> float:
        """Throughput (infer/s) of :meth:`best_level`, 0 when none."""
        best = self.best_level(p99_ms)
        return best.infer_per_sec if best else 0.0

    def as_dict(self) -> dict[str, object]:
        """Plain JSON values."""
        return {
            "index": self.index,
            "label": self.label,
            "description": self.description,
            "shipped": self.shipped,
            "repeat": self.repeat,
            "point": {m: k.as_dict() for m, k in self.point.items()},
            "status": self.status,
            "error": self.error,
            "stop_reason": self.stop_reason,
            "memory_bytes": self.memory_bytes,
            "memory_loaded_bytes": self.memory_loaded_bytes,
            "memory_pss_bytes": self.memory_pss_bytes,
            "memory_per_instance_bytes": self.memory_per_instance(),
            "load_s": self.load_s,
            "elapsed_s": self.elapsed_s,
            "levels": [lv.as_dict() for lv in self.levels],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ConfigResult:
        """Inverse of :meth:`as_dict`."""
        return cls(
            index=int(d["index"]),
            point={m: Knobs.from_dict(k) for m, k in d["point"].items()},
            shipped=bool(d.get("shipped", False)),
            levels=[LevelResult(**lv) for lv in d.get("levels", [])],
            memory_bytes=d.get("memory_bytes"),
            memory_loaded_bytes=d.get("memory_loaded_bytes"),
            memory_pss_bytes=d.get("memory_pss_bytes"),
            status=d.get("status", "ok"),
            error=d.get("error"),
            load_s=float(d.get("load_s", 0.0)),
            elapsed_s=float(d.get("elapsed_s", 0.0)),
            repeat=int(d.get("repeat", 0)),
            stop_reason=d.get("stop_reason", ""),
        )


@dataclass(frozen=True)
class Constraints:
    """The objective's limits: p99 latency (ms) and resident memory (bytes); None
    = no limit."""

    p99_ms: float | None = None
    memory_bytes: float | None = None


def violations(result: ConfigResult, c: Constraints) -> list[str]:
    """Why a configuration is not feasible, in words ([] when it is)."""
    if result.status == "failed":
        return [f"failed: {result.error}"]
    out = []
    if result.best_level(c.p99_ms) is None:
        usable = [lv for lv in result.levels if lv.usable]
        if usable:
            low = min(lv.p99_ms for lv in usable)
            out.append(f"p99 {low:.1f} ms at best, above the {c.p99_ms:g} ms SLO")
        elif any(lv.errors or lv.aborted for lv in result.levels):
            out.append("no level without errors")
        elif result.levels:
            out.append(
                f"no level of {MIN_LEVEL_REQUESTS} requests or more (raise --measurement-interval)"
            )
        else:
            out.append("no level measured")
    if (
        c.memory_bytes is not None
        and result.memory_bytes is not None
        and result.memory_bytes > c.memory_bytes
    ):
        out.append(
            f"memory {result.memory_bytes / MIB:.0f} MiB above the "
            f"{c.memory_bytes / MIB:.0f} MiB budget"
        )
    return out


def feasible(result: ConfigResult, c: Constraints) -> bool:
    """A level meets the SLO and the memory is within the budget (or unknown)."""
    return not violations(result, c)


def rank_key(result: ConfigResult, c: Constraints) -> tuple[float, float, float]:
    """A sort key, larger = better: feasible configurations by throughput (then
    less memory) above infeasible ones, these by how far they miss (the larger of
    lowest p99 / SLO and memory / budget), failed ones last."""
    if result.status == "failed":
        return (0.0, -math.inf, 0.0)
    mem = result.memory_bytes if result.memory_bytes is not None else 0.0
    if feasible(result, c):
        return (2.0, result.score(c.p99_ms), -mem)
    miss = 1.0
    ok = [lv for lv in result.levels if lv.usable]
    if not ok:
        miss = math.inf
    elif c.p99_ms is not None:
        miss = max(miss, min(lv.p99_ms for lv in ok) / c.p99_ms)
    if c.memory_bytes is not None and result.memory_bytes is not None:
        miss = max(miss, result.memory_bytes / c.memory_bytes)
    return (1.0, -miss, result.score(c.p99_ms))


def better(a: ConfigResult, b: ConfigResult, c: Constraints, min_gain: float = 0.0) -> bool:
    """Whether ``a`` beats ``b``: a higher :func:`rank_key`, and when both are
    feasible a throughput at least ``1 + min_gain`` times ``b``'s (so that noise
    does not move the search)."""
    ka, kb = rank_key(a, c), rank_key(b, c)
    if ka[0] == 2.0 and kb[0] == 2.0:
        return ka[1] > kb[1] * (1.0 + min_gain)
    return ka > kb


def best(results: Sequence[ConfigResult], c: Constraints) -> ConfigResult | None:
    """The best result by :func:`rank_key` (earliest on ties), None for none."""
    top: ConfigResult | None = None
    for r in results:
        if top is None or rank_key(r, c) > rank_key(top, c):
            top = r
    return top


def recommend(results: Sequence[ConfigResult], c: Constraints) -> ConfigResult | None:
    """The feasible configuration with the highest throughput under the SLO (ties:
    less memory, then measured first); None when none is feasible. Confirmation
    runs (``repeat > 0``) are not candidates."""
    candidates = [r for r in results if r.repeat == 0 and feasible(r, c)]
    return best(candidates, c)


def gain(
    recommended: Sequence[ConfigResult], shipped: Sequence[ConfigResult], c: Constraints
) -> float | None:
    """Throughput ratio recommended / shipped under the SLO, each the median of its
    measurements; None when the shipped one meets the SLO at no level."""
    rec = sorted(r.score(c.p99_ms) for r in recommended)
    ship = sorted(r.score(c.p99_ms) for r in shipped)
    if not rec or not ship:
        return None
    ship_med = _median(ship)
    if ship_med <= 0:
        return None
    return _median(rec) / ship_med


@dataclass
class Decision:
    """What a run recommends (:func:`decide`)."""

    recommended: ConfigResult | None
    shipped: ConfigResult | None
    gain_search: float | None = None
    gain_confirmed: float | None = None
    #: The search's best, when the confirmation runs did not reproduce its gain.
    unconfirmed: ConfigResult | None = None


def decide(results: Sequence[ConfigResult], c: Constraints, min_gain: float = 0.0) -> Decision:
    """The recommendation (:func:`recommend` over the search's results) and its
    gain over the shipped configuration: in the search, and over the confirmation
    runs (``repeat > 0``, medians). When the confirmed gain is below ``1 +
    min_gain`` and the shipped configuration met the objective in one of its
    runs, the search's best was picked by noise: the shipped one is recommended
    and the other reported as ``unconfirmed``."""
    rec = recommend(results, c)
    ship = next((r for r in results if r.shipped and r.repeat == 0), None)
    out = Decision(rec, ship)
    if rec is None or ship is None or rec is ship:
        return out
    out.gain_search = gain([rec], [ship], c)
    again_r = [r for r in results if r.repeat > 0 and not r.shipped]
    again_s = [r for r in results if r.repeat > 0 and r.shipped]
    if not again_r or not again_s:
        return out
    out.gain_confirmed = gain(again_r, again_s, c)
    if (
        out.gain_confirmed is not None
        and out.gain_confirmed < 1.0 + min_gain
        and any(feasible(r, c) for r in (ship, *again_s))
    ):
        out.recommended, out.unconfirmed = ship, rec
    return out


def memory_fit(results: Sequence[ConfigResult]) -> tuple[float, float] | None:
    """``memory = fixed + per_instance * instances`` (bytes), fitted on the
    configurations that differ only in instance counts: the slope pooled within
    each group of equal batching knobs (least squares with one intercept per
    group), so that memory which grows with the batch size (ONNX Runtime's arena)
    does not pass for the instances'. ``fixed`` is what loading costs once
    (libraries, interpreters, shared parts), from the group with the most
    configurations. None without a group of two instance counts."""
    groups: dict[tuple[tuple[str, Knobs], ...], list[tuple[float, float]]] = {}
    for r in results:
        if r.memory_bytes is None:
            continue
        key = tuple(sorted((m, replace(k, instances=0)) for m, k in r.point.items()))
        groups.setdefault(key, []).append((float(r.instances), r.memory_bytes))
    useful = [g for g in groups.values() if len({x for x, _ in g}) >= 2]
    if not useful:
        return None
    sxy = sxx = 0.0
    for g in useful:
        mx = sum(x for x, _ in g) / len(g)
        my = sum(y for _, y in g) / len(g)
        sxy += sum((x - mx) * (y - my) for x, y in g)
        sxx += sum((x - mx) ** 2 for x, _ in g)
    slope = sxy / sxx
    main = max(useful, key=len)
    mx = sum(x for x, _ in main) / len(main)
    my = sum(y for _, y in main) / len(main)
    return my - slope * mx, slope


def _median(xs: Sequence[float]) -> float:
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
