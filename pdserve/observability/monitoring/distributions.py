"""Prediction distributions with bounded memory, updated in bulk (the values of many
responses at once, :meth:`pdserve.observability.monitoring.monitor.VersionMonitor.fold`):
:class:`ScoreHistogram` (fixed buckets: Prometheus' ``histogram_quantile``
over ``rate(...[5m])`` gives streaming quantiles; values outside a configured range are
counted), :class:`ClassHistogram` (argmax per row, at most ``max_classes`` labels plus
``other``) and :class:`Window` (the last N values of a tensor, for drift).

Fixed buckets rather than a sketch library: one ``searchsorted`` + ``bincount`` per
update, exact merging across scrapes and replicas in Prometheus, and the same
bucketing serves the dashboard's quantiles and the drift bins.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: numpy dtype kinds whose values have a distribution (ints, floats; not BYTES/BOOL).
NUMERIC_KINDS = "iuf"


def numeric(array: np.ndarray) -> bool:
    """True for tensors whose values have a distribution (:data:`NUMERIC_KINDS`)."""
    return array.dtype.kind in NUMERIC_KINDS


class ScoreHistogram:
    """Counts of an output's values per bucket (upper bounds ``bounds``, then +Inf),
    their sum, and the values outside ``range``."""

    def __init__(self, bounds: Sequence[float], value_range: tuple[float, float] | None) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(self.bounds) + 1, dtype=np.int64)
        self.sum = 0.0
        self.range = value_range
        self.out_of_range = 0
        self.nan = 0
        #: equally spaced bounds: (first bound, 1 / spacing), the bucket computed rather
        #: than searched; None: searched (``searchsorted``)
        self._uniform: tuple[float, float] | None = None
        steps = np.diff(self.bounds)
        if len(steps) and steps[0] > 0 and np.allclose(steps, steps[0], rtol=1e-9, atol=0):
            self._uniform = (float(self.bounds[0]), 1.0 / float(steps[0]))
        #: per bucket, its upper and its lower bound (+Inf above the last; NaN below the
        #: first, which no value is at or under): where the arithmetic is settled
        self._upper = np.append(self.bounds, np.inf)
        self._lower = np.insert(self.bounds, 0, np.nan)

    def _buckets(self, values: np.ndarray) -> np.ndarray:
        """Per value (float64, no NaN), its bucket: how many bounds are below it, as
        ``searchsorted(bounds, values, side="left")`` gives."""
        if self._uniform is None:
            return np.searchsorted(self.bounds, values, side="left")
        first, scale = self._uniform
        with np.errstate(over="ignore", invalid="ignore"):  # +-inf and huge values: clipped
            guess = values - first
            guess *= scale
        np.ceil(guess, out=guess)
        np.clip(guess, 0, len(self.bounds), out=guess)
        idx = guess.astype(np.intp)
        # the arithmetic may be a bucket off next to a bound: settle on the bounds themselves
        idx += values > self._upper[idx]
        with np.errstate(invalid="ignore"):  # the first bucket's NaN lower bound
            idx -= values <= self._lower[idx]
        return idx

    @property
    def count(self) -> int:
        """Values counted (NaN excluded)."""
        return int(self.counts.sum())

    def add(self, array: np.ndarray) -> None:
        """Count every value of ``array`` (any shape, numeric); NaNs are counted apart."""
        values = np.asarray(array, dtype=np.float64).reshape(-1)
        nan = np.isnan(values)
        if nan.any():
            self.nan += int(nan.sum())
            values = values[~nan]
        self.counts += np.bincount(self._buckets(values), minlength=len(self.counts))
        self.sum += float(values.sum())
        if self.range is not None:
            low, high = self.range
            self.out_of_range += int(np.count_nonzero((values < low) | (values > high)))

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` per bucket, +Inf last (Prometheus' histogram)."""
        cum = np.cumsum(self.counts)
        les = [repr(float(b)) for b in self.bounds] + ["+Inf"]
        return list(zip(les, (int(c) for c in cum), strict=True))


class ClassHistogram:
    """Counts of the predicted class (argmax over the last axis of each row)."""

    def __init__(self, labels: Sequence[str] | None, max_classes: int) -> None:
        self.labels = list(labels or [])
        self.max_classes = max_classes
        self.counts = np.zeros(max_classes + 1, dtype=np.int64)  # the last: other

    def add(self, array: np.ndarray) -> None:
        """Count the argmax of each row of ``array`` (shape [..., classes])."""
        self.add_all([array])

    def add_all(self, arrays: list[np.ndarray]) -> None:
        """Count the argmax of each row of each of ``arrays`` (shapes [..., classes];
        arrays with as many classes are counted together)."""
        by_classes: dict[int, list[np.ndarray]] = {}
        for a in arrays:
            if a.ndim and a.shape[-1]:
                by_classes.setdefault(a.shape[-1], []).append(a.reshape(-1, a.shape[-1]))
        for rows in by_classes.values():
            winners = (
                np.concatenate(rows).argmax(axis=1) if len(rows) > 1 else rows[0].argmax(axis=1)
            )
            winners = np.minimum(winners, self.max_classes)
            self.counts += np.bincount(winners, minlength=len(self.counts))

    def items(self) -> list[tuple[str, int]]:
        """``(class label, count)`` for classes seen; index when there is no label."""
        out = []
        for i, n in enumerate(self.counts.tolist()):
            if n:
                if i == self.max_classes:
                    name = "other"
                else:
                    name = self.labels[i] if i < len(self.labels) else str(i)
                out.append((name, n))
        return out


class Window:
    """The last ``size`` values of a tensor (a ring), plus how many were ever added."""

    def __init__(self, size: int) -> None:
        self.ring = np.empty(size, dtype=np.float64)
        self.size = size
        self.pos = 0
        self.total = 0

    def add(self, values: np.ndarray) -> None:
        """Append the values of ``values`` (flattened; the newest ``size`` kept)."""
        flat = values.reshape(-1)
        n = len(flat)
        if n >= self.size:
            self.ring[:] = flat[n - self.size :]
            self.pos = 0
        else:
            end = self.pos + n
            if end <= self.size:
                self.ring[self.pos : end] = flat
            else:
                cut = self.size - self.pos
                self.ring[self.pos :] = flat[:cut]
                self.ring[: n - cut] = flat[cut:]
            self.pos = end % self.size
        self.total += n

    def values(self) -> np.ndarray:
        """A copy of the values held (order not kept)."""
        if self.total >= self.size:
            return self.ring.copy()
        return self.ring[: self.total].copy()
