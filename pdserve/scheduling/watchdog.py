"""Wedged model instances: a batch held longer than the model's bound without progress.

:func:`pdserve.scheduling.base.run_batch` stamps the instance's
:class:`~pdserve.scheduling.base.InstanceWatch` with each batch and its start (two
attribute stores; nothing for an instance without a watch). One :class:`Watchdog` per
model version sweeps its instances every ``bound / 4`` (at most every second) and does
the comparing: a batch held ``bound`` seconds while the instance's
:meth:`~pdserve.backends.base.ModelInstance.progress` did not move since the sweep first
saw it (a decoupled model's responses move it) is declared wedged. Its requests fail
with ``UNAVAILABLE`` naming the model and instance, the instance is recovered
(:meth:`~pdserve.backends.base.ModelInstance.recover`: a python worker is killed, reaped
and started again) and, until it is, it counts as not ready. Wedges in quick succession
back off (1 s, 2 s, ... at most :data:`MAX_BACKOFF_S`). An instance that cannot be
recovered (in-process) stays not ready until its batch returns (its requests failing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pdserve.core.errors import InferError
from pdserve.scheduling.base import InstanceWatch

if TYPE_CHECKING:
    from pdserve.backends.base import ModelInstance

log = logging.getLogger("pdserve.watchdog")

#: Longest wait before restarting an instance that wedged again soon after its restart.
MAX_BACKOFF_S = 30.0
#: A wedge this many bounds after the previous one starts the back-off afresh.
BACKOFF_RESET_BOUNDS = 10.0


class Watchdog:
    """Declares a model version's instances wedged (see the module docstring).

    Args:
        model / version: names for messages, logs and metrics.
        bound_s: seconds a batch may be held without progress (> 0).
    """

    def __init__(self, model: str, version: str, bound_s: float) -> None:
        self.model = model
        self.version = version
        self.bound_s = bound_s
        self.watches: list[InstanceWatch] = []
        self._sweeper: asyncio.Task[None] | None = None

    def attach(self, instances: list[ModelInstance]) -> None:
        """Watch ``instances`` and start sweeping (on the running loop)."""
        for instance in instances:
            watch = InstanceWatch(self.model, self.version, self.bound_s, instance)
            instance.watch = watch
            self.watches.append(watch)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def stop(self) -> None:
        """Stop sweeping and recovering; the instances are no longer watched."""
        tasks = [w.recovering for w in self.watches if w.recovering is not None]
        if self._sweeper is not None:
            tasks.append(self._sweeper)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        for w in self.watches:
            w.instance.watch = None
        self._sweeper = None

    def healthy(self) -> int:
        """Instances not wedged nor being recovered."""
        return sum(1 for w in self.watches if w.healthy)

    async def _sweep(self) -> None:
        tick = min(max(self.bound_s / 4, 0.02), 1.0)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for w in self.watches:
                held = w.held_s(now)
                if held is not None and held >= self.bound_s:
                    self._wedge(w, now)

    def _wedge(self, w: InstanceWatch, now: float) -> None:
        batch = w.batch or []
        w.wedged = True
        w.healthy = False
        w.wedges += 1
        if now - w.last_wedge > BACKOFF_RESET_BOUNDS * self.bound_s + MAX_BACKOFF_S:
            w.streak = 0
        delay = 0.0 if w.streak == 0 else min(2.0 ** (w.streak - 1), MAX_BACKOFF_S)
        w.streak += 1
        w.last_wedge = now
        ids = [r.request.id or "-" for r in batch]
        log.error(
            "model instance '%s' of model '%s' version %s is wedged: a batch of %d "
            "request(s) (ids %s) held %.1f s without progress (bound %g s); recovering "
            "it%s",
            w.instance.name,
            self.model,
            self.version,
            len(batch),
            ", ".join(ids),
            now - w.since,
            self.bound_s,
            f" after {delay:g} s (wedge {w.streak} in a row)" if delay else "",
        )
        if w.recovering is None:
            w.recovering = asyncio.get_running_loop().create_task(self._recover(w, delay))

    async def _recover(self, w: InstanceWatch, delay: float) -> None:
        reason = f"wedged for more than {self.bound_s:g} s"
        try:
            recovered = await w.instance.recover(delay, reason)
        except InferError as e:
            log.error("recovering %s failed: %s", w.instance.name, e.message)
            recovered = False
        except Exception as e:  # noqa: BLE001 - logged; the next wedge tries again
            log.error("recovering %s failed: %s: %s", w.instance.name, type(e).__name__, e)
            recovered = False
        finally:
            w.recovering = None
        if recovered or not w.wedged:  # restarted, or its wedged batch is back already
            w.healthy = True
        if recovered:
            log.info("model instance '%s' of model '%s' recovered", w.instance.name, self.model)

    def samples(self) -> Iterator[tuple[str, str, str, dict[str, str], float]]:
        """Metric samples: ``pdserve_instance_wedges_total`` and
        ``pdserve_instance_restarts_total`` per instance (labels model, version,
        instance)."""
        for w in self.watches:
            labels = {"model": self.model, "version": self.version, "instance": w.instance.name}
            yield (
                "pdserve_instance_wedges_total",
                "counter",
                "Batches declared wedged (held past the instance hang timeout without progress)",
                labels,
                float(w.wedges),
            )
            yield (
                "pdserve_instance_restarts_total",
                "counter",
                "Model instances restarted (a python worker that died or was wedged)",
                labels,
                float(w.instance.restarts),
            )
