"""ModelStats.record_error: which failures count, under which reason (Triton's rules)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.stats import NOT_QUEUED, ModelStats


def _failures(stats: ModelStats) -> int:
    return stats.durations["fail"].count


def test_not_queued_counts_nowhere() -> None:
    stats = ModelStats("m", "1")
    error = InferError("queue full", ErrorCode.UNAVAILABLE, reason=NOT_QUEUED)
    assert stats.record_error(error, time.monotonic_ns(), ensemble=False) is None
    assert _failures(stats) == 0


@pytest.mark.parametrize("ensemble", [False, True])
def test_an_infer_error_counts_once(ensemble: bool) -> None:
    stats = ModelStats("m", "1")
    error = InferError("backend failed", ErrorCode.INTERNAL)
    assert stats.record_error(error, time.monotonic_ns(), ensemble) is None
    assert (_failures(stats), stats.durations["cancel"].count) == (1, 0)


def test_a_cancelled_task_counts_as_cancel() -> None:
    stats = ModelStats("m", "1")
    assert stats.record_error(asyncio.CancelledError(), time.monotonic_ns(), False) is None
    assert (_failures(stats), stats.durations["cancel"].count) == (1, 1)


def test_an_unexpected_exception_becomes_internal() -> None:
    stats = ModelStats("m", "1")
    replacement = stats.record_error(ValueError("bad"), time.monotonic_ns(), False)
    assert replacement is not None and replacement.code is ErrorCode.INTERNAL
    assert "ValueError: bad" in str(replacement)
    assert _failures(stats) == 1
    assert stats.record_error(KeyboardInterrupt(), time.monotonic_ns(), False) is None
