"""``pdserve perf``: a load generator for any KServe V2 server (pdserve, Triton,
KServe, MLServer), in perf_analyzer's role and with its flags. Python API (used by
the CLI, and by ``pdserve analyze`` to measure each configuration)::

    from pdserve.app.perf import PerfOptions, run_sweep

    results = run_sweep(PerfOptions(model="tiny", url="127.0.0.1:8000",
                                    concurrency=[1, 4, 16]))

Modules: :mod:`.options` (what to measure, range syntax), :mod:`.inputs` (input
data and request bytes), :mod:`.control` (metadata, statistics), :mod:`.worker`
(a load process), :mod:`.load` / :mod:`.http_load` / :mod:`.grpc_load` (its loads;
:mod:`.h2grpc` the raw HTTP/2 client), :mod:`.runner` (windows, stability, the
sweep), :mod:`.stats` (results), :mod:`.report` (display, files), :mod:`.cli`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.app.perf.options import PerfError, PerfOptions
    from pdserve.app.perf.runner import NullProgress, Progress, run_sweep
    from pdserve.app.perf.stats import PointResult

__all__ = ["NullProgress", "PerfError", "PerfOptions", "PointResult", "Progress", "run_sweep"]

#: Exported name -> its module, imported on first use (a load worker process
#: imports this package and should not pay for numpy and the coordinator).
_EXPORTS = {
    "PerfError": "options",
    "PerfOptions": "options",
    "NullProgress": "runner",
    "Progress": "runner",
    "run_sweep": "runner",
    "PointResult": "stats",
}


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"pdserve.app.perf.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
