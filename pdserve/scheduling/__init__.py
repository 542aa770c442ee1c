"""Schedulers: direct (no batching), the dynamic batcher and the sequence batcher; the
rate limiter (:mod:`pdserve.scheduling.rate_limiter`) gates every batch when it is on.

:func:`create_scheduler` picks one from the model configuration, as Triton does:
``sequence_batching { }`` present -> sequence batcher (stateful models),
``dynamic_batching { }`` present -> dynamic batcher, otherwise each request runs
as it comes on the next free instance. Either checks every result against the
model configuration (:class:`~pdserve.scheduling.base.OutputCheck`).
"""

from __future__ import annotations

from pdserve.config import ENSEMBLE_PLATFORM
from pdserve.scheduling import rate_limiter
from pdserve.scheduling.base import DirectScheduler, InstancePool, ScheduledModel, Scheduler


def create_scheduler(model: ScheduledModel) -> Scheduler:
    """Build the scheduler for a loaded model version (instances already created), and
    register its instances with the rate limiter (:func:`rate_limiter.register`).

    Raises:
        pdserve.config.ConfigError: the rate limiter's resources no longer hold (see
            :meth:`~pdserve.scheduling.rate_limiter.RateLimiter.register`).
    """
    # an ensemble has no instances: its steps' schedulers do the work
    if model.config.platform == ENSEMBLE_PLATFORM:
        from pdserve.scheduling.ensemble import EnsembleScheduler

        return EnsembleScheduler(model)
    rate_limiter.register(model.config, model.instances)
    pool = InstancePool(model.instances)
    cfg = model.config
    if cfg.HasField("sequence_batching"):
        from pdserve.scheduling.sequence_batcher import SequenceBatcher

        return SequenceBatcher(pool, model.stats, model, model.output_check)
    if cfg.HasField("dynamic_batching"):  # max_batch_size 0: queued (policies), not batched
        from pdserve.scheduling.dynamic_batcher import DynamicBatcher

        return DynamicBatcher(pool, model.stats, model, model.output_check)
    return DirectScheduler(pool, model.stats, model.output_check)
