"""Memory a loaded model version costs, measured once at load, after warm-up.

``memory_source`` says how (``memory_bytes`` in the repository index and statistics):
``rss_delta`` for in-process backends (onnxruntime): the server's resident memory after
the load minus before it; such loads run one at a time (:attr:`MemoryMeter.lock`) so the
delta is that model's, and the largest delta measured for a version since start is kept
(allocator caching can make a reload read lower). ``worker_rss`` for python models: the
summed ``Rss`` of the instances' worker processes (shared pages counted in each: an upper
bound). ``ensemble``: 0, the steps count theirs. ``gpu_memory_bytes`` is the GPU memory
NVML reports for those processes after the load minus before, where ``pynvml`` and a GPU
are present.
"""

from __future__ import annotations

import asyncio
import os

from pdserve.core import procmem
from pdserve.repository.model import ModelVersion

#: ``memory_source`` values.
RSS_DELTA = "rss_delta"
WORKER_RSS = "worker_rss"
ENSEMBLE_SOURCE = "ensemble"


class MemoryMeter:
    """Measures model versions' memory; keeps the largest Rss delta per version."""

    def __init__(self) -> None:
        #: held around each in-process version load, so its Rss delta is its own.
        self.lock = asyncio.Lock()
        #: (name, version) -> the largest Rss delta measured for it (bytes).
        self._rss_delta: dict[tuple[str, int], int] = {}

    def measure(
        self,
        mv: ModelVersion,
        in_process: bool,
        ensemble: bool,
        rss_before: int | None,
        gpu_before: dict[int, int] | None,
    ) -> None:
        """Set ``mv.stats.memory_bytes`` / ``memory_source`` / ``gpu_memory_bytes``;
        leaves them None when nothing can be read."""
        stats = mv.stats
        pids = [os.getpid()] if in_process else []
        if ensemble:
            stats.memory_bytes, stats.memory_source = 0, ENSEMBLE_SOURCE
            return
        if in_process:
            after = procmem.own_rss()
            if rss_before is not None and after is not None:
                key = (mv.name, mv.version)
                delta = max(0, after - rss_before, self._rss_delta.get(key, 0))
                self._rss_delta[key] = delta
                stats.memory_bytes, stats.memory_source = delta, RSS_DELTA
        else:
            pids = [p for inst in mv.instances for p in inst.worker_pids()]
            readings = [procmem.process_memory(p) for p in pids]
            if pids and all(r is not None for r in readings):
                stats.memory_bytes = sum(r[0] for r in readings if r is not None)
                stats.memory_source = WORKER_RSS
        if gpu_before is not None and pids:
            gpu_after = procmem.gpu_memory_by_pid() or {}
            stats.gpu_memory_bytes = max(
                0, sum(gpu_after.get(p, 0) - gpu_before.get(p, 0) for p in pids)
            )
