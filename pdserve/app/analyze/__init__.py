"""``pdserve analyze``: model_analyzer's role for pdserve. For one model (or an
ensemble's steps) it searches instance counts, ``max_batch_size``, preferred
batch sizes and queue delays, measures each configuration with ``pdserve perf``
and its resident memory, and recommends the one with the highest throughput under
a p99 latency SLO and a memory budget, with its ``config.pbtxt`` diff::

    res = run_analyze(AnalyzeOptions(model="tiny", p99_ms=20, max_minutes=2))

Modules: :mod:`.options` (what to run), :mod:`.space` (the lattice, configs and
diffs), :mod:`.search` (quick and grid search), :mod:`.sweep` (one configuration's
concurrency sweep), :mod:`.recommend` (results, constraints, ranking),
:mod:`.memory` (from ``/proc``), :mod:`.server` (own server, repository API),
:mod:`.runner` (the run), :mod:`.report` (terminal, JSON, CSV, plots, HTML),
:mod:`.cli` (the subcommand).
"""

from __future__ import annotations

from pdserve.app.analyze.options import AnalyzeOptions
from pdserve.app.analyze.runner import AnalyzeResult, run_analyze

__all__ = ["AnalyzeOptions", "AnalyzeResult", "run_analyze"]
