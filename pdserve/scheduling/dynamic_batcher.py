"""The dynamic batcher (``dynamic_batching { }`` in config.pbtxt).

:class:`DynamicBatcher` queues a model's requests by priority level and merges them
along the batch dimension into batches for the next free instance, as Triton's
``DynamicBatchScheduler`` does (docs/user_guide/batcher.md): preferred batch sizes,
``max_queue_delay_microseconds``, queue policies (:mod:`pdserve.scheduling.queue_policy`),
``preserve_ordering`` and, beyond Triton, the ``padding`` policy
(:mod:`pdserve.scheduling.padding`). Its docstring states the rules.

No task or thread per request: ``submit`` appends to a deque and awaits a future; one
task per batch runs it; timers, never polling, wait for the queue delay.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.backends.base import ExecRequest, ExecResult, ModelInstance
from pdserve.core.cancel import CancelToken, queue_owns_timeout, token_of
from pdserve.core.errors import InferError, client_gone, internal, unavailable
from pdserve.core.stats import NOT_QUEUED, ModelStats
from pdserve.scheduling.base import (
    BatchingScheduler,
    InstancePool,
    OutputCheck,
    QueuedRequest,
    SchedulerSpec,
    run_batch,
)
from pdserve.scheduling.padding import PaddingPolicy, policy_of
from pdserve.scheduling.queue_policy import PriorityLevels

log = logging.getLogger("pdserve.batcher")

_QUEUED = 0
_DISPATCHED = 1
_DEAD = 2

_monotonic_ns = time.monotonic_ns


@dataclass(slots=True, eq=False)
class _Item(QueuedRequest):
    """One queued request (a queue finds it by identity)."""

    rows: int
    key: Any
    level: int
    deadline_ns: int
    state: int = field(default=_QUEUED, init=False)
    delayed: bool = field(default=False, init=False)
    #: the request's length along the padded dimension (padding policy; -1: none)
    length: int = field(default=-1, init=False)

    def __lt__(self, other: _Item) -> bool:  # heap tie-break only
        return self.enq_ns < other.enq_ns


class _Batch:
    """A dispatched batch awaiting delivery (``preserve_ordering`` only)."""

    __slots__ = ("items", "results")

    def __init__(self, items: list[_Item]) -> None:
        self.items = items
        self.results: list[ExecResult] | None = None


def _deliver(items: list[_Item], results: list[ExecResult]) -> None:
    for it, res in zip(items, results, strict=True):
        fut = it.fut
        if fut.done():
            continue
        if type(res) is dict:
            fut.set_result(res)
        elif isinstance(res, InferError):
            fut.set_exception(res.fresh())  # one error object per request: no shared tracebacks
        else:
            fut.set_result(res)


def _gone_error() -> InferError:
    return client_gone()


def _cancel_gone(items: list[_Item]) -> None:
    """Answer ``CLIENT_GONE`` to requests whose client went away (each its own error object)."""
    for it in items:
        if not it.fut.done():
            it.fut.set_exception(_gone_error())


class DynamicBatcher(BatchingScheduler):
    """Per-model dynamic batcher with priorities and queue policies.

    Triton semantics (docs/user_guide/batcher.md, model_config.proto
    ``ModelDynamicBatching``; batch formation follows Triton core's
    ``DynamicBatchScheduler::GetDynamicBatch``):

    - Queued requests are merged along the batch dimension, in queue order (highest
      priority level first, FIFO within a level, requests delayed by a ``DELAY``
      timeout after the others of their level), into batches of at most the largest
      preferred batch size (``max_batch_size`` when none is configured) rows. A batch
      is a *contiguous* run of that order: requests are never reordered to fill one.
    - A batch is sent as soon as an instance is free and any of: it cannot grow (the
      next request would exceed the limit, or has a different shape), it has reached
      the largest preferred size, the largest preferred size it can reach is found
      (the batch is cut there), its oldest request has waited
      ``max_queue_delay_microseconds``, or that delay is 0. Otherwise the batcher
      waits for more requests or for the delay to expire.
    - Requests whose non-batch dims differ (variable ``-1`` dims, or optional inputs
      present in one and not the other) never share a batch; inputs marked
      ``allow_ragged_batch`` are exempt from that check (the backend concatenates
      them).
    - Beyond Triton: a model with a ``padding`` parameter
      (:mod:`pdserve.scheduling.padding`) has its padded dimension left out of that
      check; instead requests are grouped by their padding group (bucket): a batch
      holds one group, and requests of other groups queued between them are skipped
      (they stay queued, in order, for the next batch) rather than ending the batch.
      When the batch runs, its padded inputs are padded to the group's bucket (or the
      batch's longest request: ``pad_to=max``, ``bucket_pad=longest``) and the listed
      outputs cut back to each request's own length. Statistics count the batch as it
      ran (its rows, one execution).
    - ``preserve_ordering``: responses are released in the order the requests were
      dispatched, even when a later batch finishes first on another instance.
    - Queue policies, priorities, ``max_queue_size`` and timeouts: see
      :mod:`pdserve.scheduling.queue_policy`. A full queue rejects at once with 503
      "exceeds maximum queue size"; a ``REJECT`` timeout fails the request with 503
      "Request timeout expired".
    - A request whose client went away is dropped when its batch is formed, before it
      reaches an instance; a cancelled request (:mod:`pdserve.core.cancel`) leaves the
      queue at once (the batcher follows its token and answers the token's error),
      freeing its ``max_queue_size`` slot.
      A level with ``allow_timeout_override`` applies the request's ``timeout`` itself.
    - Batches only form when an instance is free, so at most one batch runs per
      instance and batches in flight never exceed the instance count; while every
      instance is busy, the queue grows and the next batch is larger.

    Cost model: no task or thread per request. ``submit`` appends to a deque and
    awaits a future; batch formation resumes an incremental scan where it stopped
    (no rescan per arrival); one task per *batch* runs it; futures are resolved in
    bulk when it returns; waiting uses ``loop.call_later`` timers, never polling.
    uvloop timers have a 1 ms granularity and may fire early: the batcher re-checks
    ``time.monotonic_ns()`` and re-arms, so the delay is never cut short.

    Args:
        pool: the model's instances.
        stats: the model version's statistics (execution stats recorded per batch
            by :func:`run_batch`; ``pending`` kept equal to the queued requests).
        model: the model version's name, configuration and inputs.
        check: the model's output check (:class:`~pdserve.scheduling.base.OutputCheck`)
            run on every batch's results; None: unchecked.
    """

    follows_token = True  # see Scheduler.follows_token and submit

    # the batch-formation scan's position (set by _reset_scan)
    _cur_q: int
    _p_last_q: int
    _p_full: bool

    def __init__(
        self,
        pool: InstancePool,
        stats: ModelStats,
        model: SchedulerSpec,
        check: OutputCheck | None = None,
    ) -> None:
        super().__init__(pool, stats, check)
        cfg = model.config
        db = cfg.dynamic_batching
        self.name = model.name
        self.max_batch_size = max(1, int(cfg.max_batch_size))
        if cfg.max_batch_size > 0:
            preferred = sorted(
                {int(s) for s in db.preferred_batch_size if 0 < s <= cfg.max_batch_size}
            )
        else:
            preferred = []
        #: preferred batch sizes (rows); empty -> max_batch_size.
        self.preferred = frozenset(preferred)
        self.max_preferred = max(preferred) if preferred else self.max_batch_size
        self.delay_ns = int(db.max_queue_delay_microseconds) * 1000
        self.preserve_ordering = bool(db.preserve_ordering)
        self.levels = PriorityLevels.from_config(db)
        self._policies = self.levels.policies
        self._has_timeouts = any(p.timeout_ns or p.allow_override for p in self._policies)
        self._max_sizes = [p.max_queue_size for p in self._policies]
        self._bounded = any(self._max_sizes)
        # Inputs whose non-batch shape may vary between requests (and that are not
        # ragged), or that are optional: their shapes / presence form the batch key.
        self._key_inputs = tuple(
            name
            for name, spec in model.inputs.items()
            if not spec.ragged and (spec.optional or any(d < 0 for d in spec.dims))
        )
        #: the model's ``padding`` policy (:mod:`pdserve.scheduling.padding`), or None.
        #: With one, requests of one padding group (bucket) are batched together even
        #: when others queue between them, and padded inputs leave the batch key.
        self.padding: PaddingPolicy | None = policy_of(cfg)
        self._padded_axes: dict[str, int] = (
            {p.name: p.dim for p in self.padding.inputs} if self.padding is not None else {}
        )
        # Queues in scan order: level 1 main, level 1 delayed, level 2 main, ...
        nq = 2 * self.levels.count
        self._queues: list[deque[_Item]] = [deque() for _ in range(nq)]
        self._level_counts = [0] * self.levels.count
        self._queued = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._deadlines: list[tuple[int, _Item]] = []
        self._expiry_timer: asyncio.TimerHandle | None = None
        self._expiry_at = 0
        self._inorder: deque[_Batch] = deque()
        self._kicked = False
        self._reset_scan()

    # -- queueing -------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Requests waiting in the queue (not yet dispatched)."""
        return self._queued

    def _key(self, inputs: dict[str, np.ndarray]) -> Any:
        get = inputs.get
        key = []
        for name in self._key_inputs:
            arr = get(name)
            key.append(None if arr is None else arr.shape[1:])
        return tuple(key)

    def _padded_key(self, inputs: dict[str, np.ndarray], length: int) -> Any:
        """The batch key under a padding policy: the request's padding group (its
        bucket), then the shapes of the keyed inputs with the padded dimension left out."""
        assert self.padding is not None
        get = inputs.get
        axes = self._padded_axes
        key: list[Any] = [self.padding.group(length)]
        for name in self._key_inputs:
            arr = get(name)
            if arr is None:
                key.append(None)
                continue
            shape = arr.shape[1:]
            axis = axes.get(name)
            if axis is not None:
                shape = (*shape[:axis], -1, *shape[axis + 1 :])
            key.append(shape)
        return tuple(key)

    # hot path: runs once per request; a split adds a call per request (benchmarks/RESULTS.md)
    async def submit(self, request: ExecRequest) -> dict[str, np.ndarray]:
        """Queue ``request`` and wait for its outputs.

        Raises:
            InferError: ``UNAVAILABLE`` queue full ("exceeds maximum queue size"),
                queue timeout ("Request timeout expired") or model unloading;
                ``INVALID_ARG`` bad ``priority`` / ``timeout`` parameter;
                ``CLIENT_GONE`` client gone; ``INTERNAL`` (or the model's code) the
                model failed.
        """
        token = token_of(request.request)
        if token is not None and token():
            assert token.error is not None
            raise token.error.fresh()
        if self._closed:
            raise unavailable(
                f"model '{self.name}' is unloading: request not accepted", reason=NOT_QUEUED
            )
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        params = request.request.parameters
        level = self.levels.level_for(params) if params else self.levels.default - 1
        if self._bounded:
            limit = self._max_sizes[level]
            if limit and self._level_counts[level] >= limit:
                raise unavailable(
                    f"inference request to model '{self.name}' exceeds maximum queue size "
                    f"({limit} at priority level {level + 1})",
                    reason=NOT_QUEUED,
                )
        now = _monotonic_ns()
        deadline = 0
        if self._has_timeouts:
            timeout = self._policies[level].timeout_for(params)
            if timeout:
                deadline = now + timeout
            if self._policies[level].allow_override:
                queue_owns_timeout(request.request)  # Triton: the queue policy applies it
        length = -1
        if self.padding is not None:
            length = self.padding.length(request.inputs)  # INVALID_ARG: lengths disagree
            key = self._padded_key(request.inputs, length)
        else:
            key = self._key(request.inputs) if self._key_inputs else None
        fut: asyncio.Future[dict[str, np.ndarray]] = loop.create_future()
        rows = request.batch_size if request.batch_size > 0 else 1
        item = _Item(request, fut, now, rows, key, level, deadline)
        item.length = length
        qi = 2 * level
        self._queues[qi].append(item)
        if qi < self._cur_q:
            # The scan already passed this queue. If the pending batch holds nothing
            # from a later queue, resume the scan at the new item; else rescan.
            if qi >= self._p_last_q and not self._p_full:
                self._cur_q = qi
                self._cur_i = len(self._queues[qi]) - 1
            else:
                self._reset_scan()
        self._level_counts[level] += 1
        self._queued += 1
        self.stats.pending += 1
        if deadline:
            heap = self._deadlines
            if len(heap) > 2 * self._queued + 64:
                # Entries of dispatched / dropped requests linger until their deadline;
                # drop them now and then so the heap never holds finished requests long.
                heap[:] = [e for e in heap if e[1].state == _QUEUED]
                heapq.heapify(heap)
            heapq.heappush(heap, (deadline, item))
            if self._expiry_timer is None or deadline < self._expiry_at:
                self._arm_expiry(deadline, now)
        if self.pool._free and not self._kicked:
            # Form the batch at the end of this loop iteration, not now: every
            # request that arrived in the same iteration joins it (one call_soon
            # per batch, no added wait).
            self._kicked = True
            loop.call_soon(self._kick)
        if token is None:
            interrupt = None
        else:
            # The token cancelling (client gone, request timeout) answers its error at
            # once: a queued request leaves its queue, a batched one stops waiting (the
            # batch runs on; _deliver skips a future already done). This is what
            # run_cancellable does by cancelling the task, without a coroutine level
            # or a task lookup per request (follows_token).
            def interrupt(tok: CancelToken) -> None:
                if item.state == _QUEUED:
                    self._drop(item)
                if not fut.done() and tok.error is not None:
                    fut.set_exception(tok.error.fresh())

            token.add_callback(interrupt)
        try:
            return await fut
        except asyncio.CancelledError:
            if item.state == _QUEUED:
                self._drop(item)
            raise
        finally:
            if token is not None and interrupt is not None:
                token.remove_callback(interrupt)
            # A failed future's exception carries a traceback through this frame: without
            # this, future -> exception -> traceback -> frame -> future would be a cycle
            # keeping the request's tensors until a full garbage collection.
            fut = item = interrupt = None  # type: ignore[assignment]  # no future -> traceback -> frame cycle

    def _kick(self) -> None:
        self._kicked = False
        if self._queued:
            self._schedule()

    def _drop(self, item: _Item) -> None:
        """Take a queued item out of the counts (it stays in its deque, dead)."""
        item.state = _DEAD
        self._level_counts[item.level] -= 1
        self._queued -= 1
        self.stats.pending -= 1
        if self._p_items and item in self._p_items:
            self._reset_scan()

    # -- batch formation ------------------------------------------------------

    def _reset_scan(self) -> None:
        self._cur_q = 0
        self._cur_i = 0
        self._p_items: list[_Item] = []
        self._p_rows = 0
        self._p_key: Any = None
        self._p_oldest = 0
        self._p_best = 0
        self._p_full = False
        self._p_mismatch = False
        self._p_last_q = -1

    def _advance(self, now: int) -> None:
        """Extend the pending batch along the queue from where the scan stopped."""
        queues = self._queues
        nq = len(queues)
        items = self._p_items
        max_pref = self.max_preferred
        preferred = self.preferred
        check_key = bool(self._key_inputs) or self.padding is not None
        group = self.padding is not None
        q_i = self._cur_q
        i = self._cur_i
        while q_i < nq:
            q = queues[q_i]
            if i >= len(q):
                q_i += 1
                i = 0
                continue
            it = q[i]
            if it.state != _QUEUED:
                i += 1
                continue
            if it.deadline_ns and it.deadline_ns <= now:
                if self._expire(it, q, i):
                    continue  # moved to the delayed queue, after the cursor
                i += 1
                continue
            if items:
                if group and it.key != self._p_key:
                    # another padding group (bucket): it waits for a batch of its own
                    i += 1
                    continue
                if self._p_rows + it.rows > max_pref:
                    self._p_full = True
                    break
                if check_key and it.key != self._p_key:
                    self._p_full = self._p_mismatch = True
                    break
            else:
                self._p_key = it.key
                self._p_oldest = it.enq_ns
            items.append(it)
            self._p_last_q = q_i
            self._p_rows += it.rows
            if it.enq_ns < self._p_oldest:
                self._p_oldest = it.enq_ns
            i += 1
            if self._p_rows in preferred:
                self._p_best = len(items)
            if self._p_rows >= max_pref:
                self._p_full = True
                break
        self._cur_q = q_i
        self._cur_i = i

    def _expire(self, it: _Item, q: deque[_Item], index: int) -> bool:
        """Apply the timeout action to a timed-out queued item.

        Returns True when the item moved from ``q[index]`` to its level's delayed
        queue (DELAY), False when it was rejected (REJECT) or already delayed.
        """
        policy = self._policies[it.level]
        if policy.delay:
            if it.delayed:
                return False
            it.delayed = True
            it.deadline_ns = 0
            del q[index]
            self._queues[2 * it.level + 1].append(it)
            return True
        self._drop(it)
        it.fut.set_exception(unavailable("Request timeout expired", reason="REJECTED"))
        return False

    def _schedule(self) -> None:
        """Dispatch every batch that should run now on the free instances."""
        pool = self.pool
        while self._queued and pool._free:
            now = _monotonic_ns()
            if not self._p_full:
                self._advance(now)
            items = self._p_items
            if not items:
                self._compact()
                if not self._queued:
                    break
                self._reset_scan()
                continue
            if not self._p_full and self._p_rows < self.max_preferred:
                if self._p_best:
                    pass  # a preferred size is reachable: cut there
                elif self.delay_ns and now - self._p_oldest < self.delay_ns:
                    self._arm_timer(self._p_oldest + self.delay_ns, now)
                    return
            # Triton: a shape change sends the pending batch as it is; otherwise a
            # batch that is not itself a preferred size is cut at the largest one.
            n = self._p_best
            if n and not self._p_mismatch and self._p_rows not in self.preferred:
                batch = items[:n]
            else:
                batch = items
            self._dispatch(batch, now)

    def _compact(self) -> None:
        """Pop dead / dispatched items from the front of every queue."""
        for q in self._queues:
            while q and q[0].state != _QUEUED:
                q.popleft()

    def _dispatch(self, batch: list[_Item], now: int) -> None:
        instance = self.pool.try_acquire()
        assert instance is not None
        live: list[_Item] = []
        counts = self._level_counts
        gone = None
        for it in batch:
            it.state = _DISPATCHED
            counts[it.level] -= 1
            req = it.req
            req.queue_ns = now - it.enq_ns
            cancelled = req.request.cancelled  # polled here, not via is_cancelled: a call less
            if cancelled is not None and cancelled():
                gone = gone or []
                gone.append(it)
            else:
                live.append(it)
        n = len(batch)
        self._queued -= n
        self.stats.pending -= n
        self._compact()
        self._reset_scan()
        if gone:
            _cancel_gone(gone)
        if not live:
            self.pool.release(instance)
            return
        loop = self._loop
        assert loop is not None
        if self.preserve_ordering:
            b = _Batch(live)
            self._inorder.append(b)
            task = loop.create_task(self._run_ordered(instance, b))
        else:
            task = loop.create_task(self._run(instance, live))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _execute(self, instance: ModelInstance, items: list[_Item]) -> list[ExecResult]:
        """Run one batch on ``instance`` (released afterwards); one result per item.

        Requests whose client went away since the batch was formed are answered ``CLIENT_GONE``
        here, right before the batch reaches the instance, and do not run.
        """
        try:
            # (the tokens polled directly, as in _dispatch)
            gone = [it for it in items if (c := it.req.request.cancelled) is not None and c()]
            if not gone:
                return await self._run_batch(instance, items)
            _cancel_gone(gone)
            skip = {id(it) for it in gone}
            live = [it for it in items if id(it) not in skip]
            results = iter(await self._run_batch(instance, live)) if live else iter(())
            # the cancelled ones' futures are already done: _deliver skips them
            return [_gone_error() if id(it) in skip else next(results) for it in items]
        except asyncio.CancelledError:
            _deliver(items, [unavailable("batch cancelled: the model is unloading")] * len(items))
            raise
        except Exception as e:  # run_batch catches model errors; this is a safety net
            log.exception("dynamic batcher of %s failed to run a batch", self.name)
            return [internal(f"{type(e).__name__}: {e}") for _ in items]
        finally:
            self.pool.release(instance)

    async def _run_batch(self, instance: ModelInstance, items: list[_Item]) -> list[ExecResult]:
        """:func:`run_batch` on the items' requests; under a padding policy, the padded
        inputs are padded to the batch's target length first and the listed outputs
        cut back to each request's own length afterwards."""
        requests = [it.req for it in items]
        padding = self.padding
        if padding is None:
            return await run_batch(instance, requests, self.stats, self.check)
        lengths = [it.length for it in items]
        target = padding.batch_target(lengths)  # one group per batch
        if target >= 0:
            for r in requests:
                padding.pad(r, target)
        results = await run_batch(instance, requests, self.stats, self.check)
        if target < 0 or not padding.outputs:
            return results
        cut = padding.cut
        return [cut(self.name, res, n, target) for res, n in zip(results, lengths, strict=True)]

    async def _run(self, instance: ModelInstance, items: list[_Item]) -> None:
        results = await self._execute(instance, items)
        _deliver(items, results)
        if self._queued:
            self._schedule()

    async def _run_ordered(self, instance: ModelInstance, batch: _Batch) -> None:
        try:
            batch.results = await self._execute(instance, batch.items)
        finally:
            if batch.results is None:
                batch.results = [unavailable("batch cancelled")] * len(batch.items)
            order = self._inorder
            while order and order[0].results is not None:
                done = order.popleft()
                _deliver(done.items, done.results)  # type: ignore[arg-type]  # not None: the loop checked it
        if self._queued:
            self._schedule()

    # -- timers ---------------------------------------------------------------

    def _arm_timer(self, at_ns: int, now: int) -> None:
        if self._timer is not None:
            if self._timer_at <= at_ns:
                return
            self._timer.cancel()
        assert self._loop is not None
        self._timer_at = at_ns
        self._timer = self._loop.call_later((at_ns - now) / 1e9, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._schedule()

    def _arm_expiry(self, at_ns: int, now: int) -> None:
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
        assert self._loop is not None
        self._expiry_at = at_ns
        self._expiry_timer = self._loop.call_later(max(0.0, (at_ns - now) / 1e9), self._on_expiry)

    def _on_expiry(self) -> None:
        """Apply timeouts to requests that expired while no batch was formed."""
        self._expiry_timer = None
        now = _monotonic_ns()
        heap = self._deadlines
        changed = False
        while heap and heap[0][0] <= now:
            _, it = heapq.heappop(heap)
            if it.state != _QUEUED or it.delayed:
                continue
            changed = True
            if self._policies[it.level].delay:
                q = self._queues[2 * it.level]
                try:
                    index = q.index(it)
                except ValueError:  # pragma: no cover - defensive
                    continue
                self._expire(it, q, index)
            else:
                self._expire(it, self._queues[2 * it.level], 0)
        if heap:
            self._arm_expiry(heap[0][0], now)
        if changed:
            self._reset_scan()
            if self._queued and self.pool._free:
                self._schedule()

    # -- shutdown -------------------------------------------------------------

    async def close(self, timeout: float | None = None) -> bool:
        """Stop accepting; fail what is still queued with 503; wait for running batches.

        Returns:
            True when no batch is running any more; False when some were still
            running after ``timeout`` s (they keep running: the caller stops the
            instances, which fails them, or calls :meth:`cancel_running`).
        """
        self._closed = True
        for timer in (self._timer, self._expiry_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._expiry_timer = None
        message = f"model '{self.name}' was unloaded before the request ran"
        for q in self._queues:
            while q:
                it = q.popleft()
                if it.state == _QUEUED:
                    self._drop(it)
                    if not it.fut.done():
                        it.fut.set_exception(unavailable(message))
        self._reset_scan()
        return await self._wait_batches(timeout)
