"""The serving collector settings of :mod:`pdserve.core.procmem` (its memory readings are
tested with the budget, in test_budget.py)."""

from __future__ import annotations

import gc


def test_settle_gc_freezes_start_up_objects_and_raises_the_thresholds() -> None:
    from pdserve.core.procmem import SERVING_GC_THRESHOLDS, settle_gc

    before = gc.get_threshold()
    try:
        settle_gc()
        assert gc.get_threshold() == SERVING_GC_THRESHOLDS == (50_000, 20, 20)
        assert gc.get_freeze_count() > 1000  # this process's modules, at least
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert gc.get_freeze_count() == 0
