"""Traffic between the versions of one model: the traffic file, the split, output comparison.

A model folder may hold ``traffic.yaml`` (:data:`TRAFFIC_FILENAME`), read with the model,
saying how requests that name **no version** are spread over the served versions::

    weights: {1: 90, 2: 10}      # percent per version; must sum to 100
    shadow: {version: 3, percent: 100, queue_size: 64, max_inflight: 8,
             compare: {OUTPUT0: {atol: 1.0e-5, rtol: 1.0e-3}, labels: {exact: true}}}
    rollout: {...}               # see pdserve.repository.rollout_policy.RolloutPolicy

A request naming a version, or pinned with ``x-pdserve-model-version``, is never split.
``x-pdserve-route-key`` makes the split sticky (the key hashed onto 10,000 buckets cut by
the weights, newest first). A named version that is not served gives its share to the
served ones. A malformed file is a load error; without one the default version serves.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdserve.repository.layout import TRAFFIC_FILENAME

#: Buckets a route key is hashed onto (a weight of 0.01 % is one bucket).
BUCKETS = 10_000
#: Default bound of a shadow queue (requests waiting to be mirrored).
DEFAULT_SHADOW_QUEUE = 64

_TOP_KEYS = {"weights", "shadow", "rollout"}
_SHADOW_KEYS = {"version", "percent", "queue_size", "max_inflight", "compare"}
#: Default ``max_inflight`` of a shadow: mirrors are shed while the caller's version
#: has more requests than this in flight.
DEFAULT_SHADOW_MAX_INFLIGHT = 8
_COMPARE_KEYS = {"atol", "rtol", "exact", "top_k"}


class TrafficError(ValueError):
    """A traffic file or an admin request that is not valid; the message says why."""


@dataclass(frozen=True)
class Tolerance:
    """How one output of the shadow is compared with the caller's.

    Attributes:
        atol / rtol: numbers agree when ``|a - b| <= atol + rtol * |b|`` element-wise
            (``numpy.allclose``); used unless ``exact`` or ``top_k``.
        exact: the outputs must be equal (the default for BYTES outputs: labels).
        top_k: classifiers: the k highest-scoring indices of each row (numbers) or the
            first k entries of each row (BYTES labels) must be the same set.
    """

    atol: float = 1e-6
    rtol: float = 1e-5
    exact: bool = False
    top_k: int = 0


@dataclass(frozen=True)
class ShadowSpec:
    """The ``shadow`` section of a traffic file.

    Attributes:
        version: the candidate version the mirrors go to.
        percent: share of split requests mirrored (0-100).
        queue_size: mirrors waiting at most; a full queue sheds the newest.
        max_inflight: a mirror is shed (not run) while the caller's version has more
            than this many requests in flight: under load the shadow goes first.
        compare: output name -> :class:`Tolerance`.
    """

    version: int
    percent: float = 100.0
    queue_size: int = DEFAULT_SHADOW_QUEUE
    max_inflight: int = DEFAULT_SHADOW_MAX_INFLIGHT
    compare: dict[str, Tolerance] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """The JSON form (as the traffic file writes it)."""
        return {
            "version": self.version,
            "percent": self.percent,
            "queue_size": self.queue_size,
            "max_inflight": self.max_inflight,
            "compare": {
                name: {k: v for k, v in t.__dict__.items() if v != getattr(Tolerance(), k)}
                for name, t in self.compare.items()
            },
        }


@dataclass(frozen=True)
class TrafficSpec:
    """A parsed traffic file (or admin request).

    Attributes:
        weights: version -> percent (sum 100); empty: the default version serves.
        shadow: the mirror, or None.
        rollout: the raw ``rollout`` section (parsed by
            :class:`pdserve.repository.rollout_policy.RolloutPolicy`), or None.
    """

    weights: dict[int, float] = field(default_factory=dict)
    shadow: ShadowSpec | None = None
    rollout: dict[str, object] | None = None

    def versions(self) -> set[int]:
        """Every version the spec names."""
        named = {v for v, w in self.weights.items()}
        if self.shadow is not None:
            named.add(self.shadow.version)
        return named


def check_keys(raw: dict[str, object], allowed: Collection[str], where: str) -> None:
    """Refuse the keys of ``raw`` that are not in ``allowed``.

    Raises:
        TrafficError: "unknown key(s) [...]; use [...]".
    """
    unknown = set(raw) - set(allowed)
    if unknown:
        raise TrafficError(f"{where}: unknown key(s) {sorted(unknown)}; use {sorted(allowed)}")


def _version(value: object, where: str) -> int:
    if isinstance(value, bool):
        raise TrafficError(f"{where}: version {value!r} is not a version number")
    if isinstance(value, int):
        v = value
    elif isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
        v = int(value)
    else:
        raise TrafficError(f"{where}: version {value!r} is not a version number")
    if v < 0 or v >= 2**63:
        raise TrafficError(f"{where}: version {v} is out of range")
    return v


def _number(value: object, where: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TrafficError(f"{where}: {value!r} is not a number")
    f = float(value)
    if not math.isfinite(f) or f < low or f > high:
        raise TrafficError(f"{where}: {value!r} must be between {low:g} and {high:g}")
    return f


def parse_weights(raw: object, where: str = "weights") -> dict[int, float]:
    """``{version: percent}`` from a mapping; the percents must sum to 100.

    Raises:
        TrafficError: not a mapping, a key that is not a version, a weight that is
            not a number in [0, 100], or weights that do not sum to 100 (±0.01).
    """
    if not isinstance(raw, dict) or not raw:
        raise TrafficError(f"{where}: must be a non-empty mapping of version -> percent")
    weights: dict[int, float] = {}
    for k, w in raw.items():
        v = _version(k, where)
        if v in weights:
            raise TrafficError(f"{where}: version {v} is given twice")
        weights[v] = _number(w, f"{where}.{v}", 0.0, 100.0)
    total = sum(weights.values())
    if abs(total - 100.0) > 0.01:
        raise TrafficError(
            f"{where}: weights sum to {total:g}, they must sum to 100 "
            f"(got {', '.join(f'{v}: {w:g}' for v, w in sorted(weights.items()))})"
        )
    if not any(w > 0 for w in weights.values()):
        raise TrafficError(f"{where}: at least one version needs a weight over 0")
    return weights


def _parse_tolerance(raw: object, where: str) -> Tolerance:
    if not isinstance(raw, dict):
        raise TrafficError(f"{where}: must be a mapping with atol/rtol, exact or top_k")
    check_keys(raw, _COMPARE_KEYS, where)
    exact = raw.get("exact", False)
    if not isinstance(exact, bool):
        raise TrafficError(f"{where}.exact: must be true or false")
    top_k = raw.get("top_k", 0)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise TrafficError(f"{where}.top_k: must be a positive integer")
    return Tolerance(
        atol=_number(raw.get("atol", 1e-6), f"{where}.atol", 0.0, math.inf),
        rtol=_number(raw.get("rtol", 1e-5), f"{where}.rtol", 0.0, math.inf),
        exact=exact,
        top_k=top_k,
    )


def parse_shadow(raw: object, where: str = "shadow") -> ShadowSpec:
    """The ``shadow`` section.

    Raises:
        TrafficError: a missing or bad ``version``, ``percent`` outside [0, 100],
            ``queue_size`` outside [1, 100000], a bad ``compare`` entry, unknown keys.
    """
    if not isinstance(raw, dict):
        raise TrafficError(f"{where}: must be a mapping with 'version'")
    check_keys(raw, _SHADOW_KEYS, where)
    if "version" not in raw:
        raise TrafficError(f"{where}: 'version' (the candidate to mirror to) is required")
    queue = raw.get("queue_size", DEFAULT_SHADOW_QUEUE)
    if isinstance(queue, bool) or not isinstance(queue, int) or not 1 <= queue <= 100_000:
        raise TrafficError(f"{where}.queue_size: must be an integer from 1 to 100000")
    inflight = raw.get("max_inflight", DEFAULT_SHADOW_MAX_INFLIGHT)
    if isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 0:
        raise TrafficError(f"{where}.max_inflight: must be an integer >= 0")
    compare_raw = raw.get("compare") or {}
    if not isinstance(compare_raw, dict):
        raise TrafficError(f"{where}.compare: must be a mapping of output name -> tolerance")
    compare = {
        str(name): _parse_tolerance(t, f"{where}.compare.{name}") for name, t in compare_raw.items()
    }
    return ShadowSpec(
        version=_version(raw["version"], f"{where}.version"),
        percent=_number(raw.get("percent", 100), f"{where}.percent", 0.0, 100.0),
        queue_size=queue,
        max_inflight=inflight,
        compare=compare,
    )


def parse_traffic(doc: object, where: str = TRAFFIC_FILENAME) -> TrafficSpec:
    """A :class:`TrafficSpec` from a decoded traffic file or admin request body.

    Raises:
        TrafficError: the document is malformed; the message names ``where`` and the key.
    """
    if doc is None:
        return TrafficSpec()
    if not isinstance(doc, dict):
        raise TrafficError(f"{where}: must be a mapping with 'weights', 'shadow' or 'rollout'")
    check_keys(doc, _TOP_KEYS, where)
    weights = parse_weights(doc["weights"], f"{where}: weights") if "weights" in doc else {}
    shadow = parse_shadow(doc["shadow"], f"{where}: shadow") if doc.get("shadow") else None
    rollout = doc.get("rollout")
    if rollout is not None and not isinstance(rollout, dict):
        raise TrafficError(f"{where}: rollout: must be a mapping")
    return TrafficSpec(weights, shadow, rollout)


def read_traffic_file(model_dir: Path) -> TrafficSpec | None:
    """``<model_dir>/traffic.yaml`` parsed, or None when there is none.

    Raises:
        TrafficError: the file cannot be read, is not YAML, or is malformed.
    """
    path = Path(model_dir) / TRAFFIC_FILENAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise TrafficError(f"{TRAFFIC_FILENAME}: cannot be read: {e}") from None
    import yaml  # PyYAML: only imported by models that have a traffic file

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TrafficError(f"{TRAFFIC_FILENAME}: not valid YAML: {e}") from None
    return parse_traffic(doc)


def bucket_of(key: str) -> int:
    """The bucket (0 .. :data:`BUCKETS` - 1) a route key hashes onto (stable across
    processes and restarts: blake2b, not Python's salted ``hash``)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


class Split:
    """Weighted choice among the served versions of a model.

    Args:
        weights: version -> percent, for the versions that are served (the others
            already removed); renormalised here, so they need not sum to 100.
    """

    __slots__ = ("versions", "cumulative", "total", "bounds")

    def __init__(self, weights: dict[int, float]) -> None:
        # Newest first: a canary (usually the highest version) owns the low buckets,
        # so raising its weight only moves keys onto it.
        items = sorted(((v, w) for v, w in weights.items() if w > 0), reverse=True)
        self.versions = [v for v, _ in items]
        self.total = sum(w for _, w in items)
        acc = 0.0
        self.cumulative: list[float] = []
        for _, w in items:
            acc += w
            self.cumulative.append(acc)
        self.bounds = [round(c / self.total * BUCKETS) for c in self.cumulative] if items else []

    def pick(self, key: str = "") -> int | None:
        """The version for one request: by ``key``'s bucket when given, else at
        random with the weights; None when no version has weight."""
        if not self.versions:
            return None
        if key:
            b = bucket_of(key)
            for v, bound in zip(self.versions, self.bounds, strict=True):
                if b < bound:
                    return v
            return self.versions[-1]
        r = random.random() * self.total
        for v, c in zip(self.versions, self.cumulative, strict=True):
            if r < c:
                return v
        return self.versions[-1]


def _as_array(value: object) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else np.asarray(value)


def _top_k_sets(arr: np.ndarray, k: int) -> list[frozenset[object]]:
    rows = arr.reshape(arr.shape[0], -1) if arr.ndim > 1 else arr.reshape(1, -1)
    if rows.dtype == object or rows.dtype.kind in "SU":
        return [frozenset(row[:k].tolist()) for row in rows]
    k = min(k, rows.shape[1])
    idx = np.argpartition(-rows.astype(np.float64), k - 1, axis=1)[:, :k]
    return [frozenset(r.tolist()) for r in idx]


def outputs_agree(primary: object, shadow: object, tol: Tolerance) -> tuple[bool, str]:
    """Compare one output of the caller's response with the shadow's.

    Returns:
        ``(agree, detail)``: ``detail`` says how they differ (shape, max abs diff,
        top-k sets) when they do not.
    """
    a, b = _as_array(primary), _as_array(shadow)
    if a.shape != b.shape:
        return False, f"shape {list(a.shape)} vs {list(b.shape)}"
    if tol.top_k:
        sa, sb = _top_k_sets(a, tol.top_k), _top_k_sets(b, tol.top_k)
        bad = sum(1 for x, y in zip(sa, sb, strict=True) if x != y)
        return (bad == 0, "" if bad == 0 else f"top-{tol.top_k} differs in {bad} row(s)")
    numeric = a.dtype.kind in "biuf" and b.dtype.kind in "biuf"
    if tol.exact or not numeric:
        same = bool(np.array_equal(a, b))
        return same, "" if same else "values differ (exact comparison)"
    af, bf = a.astype(np.float64), b.astype(np.float64)
    if np.allclose(af, bf, rtol=tol.rtol, atol=tol.atol, equal_nan=True):
        return True, ""
    diff = float(np.nanmax(np.abs(af - bf))) if af.size else 0.0
    return False, f"max abs diff {diff:.6g} (atol {tol.atol:g}, rtol {tol.rtol:g})"


def tolerance_for(spec: ShadowSpec, output: str) -> Tolerance:
    """The tolerance configured for ``output``, else the default (allclose with
    atol 1e-6, rtol 1e-5 for numbers; BYTES outputs are compared exactly)."""
    return spec.compare.get(output) or Tolerance()
