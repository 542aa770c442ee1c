"""pdserve.observability.monitoring.distributions: bucket counts, out-of-range and NaN
counts, class histograms and the sliding window hold exactly what was added."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.observability.monitoring.distributions import (
    ClassHistogram,
    ScoreHistogram,
    Window,
    numeric,
)
from pdserve.observability.monitoring.spec import MetricsSpec


def test_score_histogram_buckets() -> None:
    h = ScoreHistogram([0.0, 1.0, 2.0], (0.0, 1.5))
    h.add(np.array([[-1.0, 0.0, 0.5], [1.0, 1.7, 9.0]], dtype=np.float32))
    h.add(np.array([np.nan, 2.0]))
    # le=0: -1, 0 | le=1: 0.5, 1 | le=2: 1.7, 2 | +Inf: 9
    assert h.cumulative() == [("0.0", 2), ("1.0", 4), ("2.0", 6), ("+Inf", 7)]
    assert h.count == 7 and h.nan == 1
    assert h.sum == np.float32(-1) + 0 + 0.5 + 1 + float(np.float32(1.7)) + 9 + 2
    assert h.out_of_range == 4  # -1, 1.7, 9, 2


def test_class_histogram() -> None:
    c = ClassHistogram(["cat", "dog"], max_classes=3)
    logits = np.zeros((5, 6), dtype=np.float32)
    for row, cls in enumerate([0, 1, 1, 2, 5]):
        logits[row, cls] = 1.0
    c.add(logits)
    assert c.items() == [("cat", 1), ("dog", 2), ("2", 1), ("other", 1)]


def test_window_keeps_the_newest() -> None:
    w = Window(5)
    w.add(np.arange(3))
    assert sorted(w.values()) == [0, 1, 2]
    w.add(np.arange(3, 7))
    assert sorted(w.values()) == [2, 3, 4, 5, 6] and w.total == 7
    w.add(np.arange(100, 112))
    assert sorted(w.values()) == [107, 108, 109, 110, 111]


def test_numeric() -> None:
    assert numeric(np.zeros(1, np.float16)) and numeric(np.zeros(1, np.uint8))
    assert not numeric(np.zeros(1, bool)) and not numeric(np.array([b"x"], dtype=object))


def test_class_histogram_counts_many_arrays_at_once() -> None:
    one, many = ClassHistogram(None, max_classes=4), ClassHistogram(None, max_classes=4)
    rng = np.random.default_rng(2)
    arrays = [rng.random((n, c)).astype(np.float32) for n, c in [(3, 5), (1, 5), (2, 3), (4, 5)]]
    for a in arrays:
        one.add(a)
    many.add_all(arrays)
    want = np.bincount(
        np.minimum(np.concatenate([a.argmax(axis=1) for a in arrays]), 4), minlength=5
    )
    assert one.counts.tolist() == many.counts.tolist() == want.tolist()


@pytest.mark.parametrize(
    "bins", ["bins=0:10:40", "bins=-1:1:7", "bins=0.1:0.3:3", "range=0:5", "on"]
)
def test_buckets_are_searchsorted_exactly(bins: str) -> None:
    """Equally spaced bounds are computed, not searched: the same bucket as
    ``searchsorted`` for every value, on, next to and far from a bound, and +-inf."""
    spec = MetricsSpec.parse(bins)
    assert spec is not None
    h = ScoreHistogram(spec.bins, None)
    assert (h._uniform is None) == (bins == "on")  # the default bounds are not equal
    b = h.bounds
    rng = np.random.default_rng(4)
    values = np.concatenate(
        [
            rng.uniform(b[0] - 1, b[-1] + 1, 20000),
            b,
            np.nextafter(b, np.inf),
            np.nextafter(b, -np.inf),
            np.linspace(b[0], b[-1], 1001),
            [np.inf, -np.inf, 1e300, -1e300],
        ]
    )
    want = np.searchsorted(b, values, side="left")
    np.testing.assert_array_equal(h._buckets(values), want)
    finite = np.isfinite(values)
    h.add(values[finite])
    assert h.counts.tolist() == np.bincount(want[finite], minlength=len(b) + 1).tolist()
