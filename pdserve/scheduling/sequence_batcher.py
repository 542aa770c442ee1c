"""The sequence batcher (``sequence_batching { }`` in config.pbtxt): stateful models.

:class:`SequenceBatcher` binds each sequence (its correlation id) to a sequence slot
of one model instance, runs its requests there in order, adds the control tensors
and keeps its implicit state, with Triton's ``direct`` and ``oldest`` strategies
(docs/user_guide/architecture.md "Stateful Models"). Its docstring states the rules.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import ExecRequest, ExecResult, ModelInstance
from pdserve.core.datatypes import V2_TO_NUMPY
from pdserve.core.errors import InferError, client_gone, internal, unavailable
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest
from pdserve.scheduling.base import (
    BatchingScheduler,
    InstancePool,
    OutputCheck,
    QueuedRequest,
    SchedulerSpec,
    is_cancelled,
    run_batch,
)

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2

log = logging.getLogger("pdserve.sequence")

_SB = cfgmod.model_config_pb2.ModelSequenceBatching
_Control = _SB.Control

#: how many released (idle) correlation ids are remembered for a clearer refusal
_EXPIRED_MEMORY = 4096


@dataclass(slots=True, eq=False)
class _Item(QueuedRequest):
    """One queued request of a sequence."""

    start: bool
    end: bool
    dead: bool = field(default=False, init=False)


class _Seq:
    """One sequence: its queue, slot and implicit state."""

    __slots__ = ("cid", "queue", "slot", "state", "last_ns", "running", "done")

    def __init__(self, cid: int | str, now: int) -> None:
        self.cid = cid
        self.queue: deque[_Item] = deque()
        self.slot: _Slot | None = None
        #: implicit state: input_name -> array (empty until the first request ran)
        self.state: dict[str, np.ndarray] = {}
        self.last_ns = now
        self.running = False
        #: its END request was taken (or it was released): frees the slot when idle
        self.done = False


class _Slot:
    __slots__ = ("lane", "index", "seq")

    def __init__(self, lane: _Lane, index: int) -> None:
        self.lane = lane
        self.index = index
        self.seq: _Seq | None = None


class _Lane:
    """One model instance and its sequence slots."""

    __slots__ = ("instance", "slots", "busy", "timer", "timer_at")

    def __init__(self, instance: ModelInstance, slots: int) -> None:
        self.instance = instance
        self.slots = [_Slot(self, i) for i in range(slots)]
        self.busy = False
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0


class _ControlSpec:
    """One control tensor: its input name, kind, numpy dtype and false/true values."""

    __slots__ = ("name", "kind", "dtype", "false", "true", "string")

    def __init__(self, name: str, control: model_config_pb2.ModelSequenceBatching.Control) -> None:
        self.name = name
        self.kind = control.kind
        self.string = False
        if control.kind == _Control.CONTROL_SEQUENCE_CORRID:
            dt = cfgmod.model_config_pb2.DataType.Name(control.data_type)[len("TYPE_") :]
            dt = "BYTES" if dt == "STRING" else dt
            self.string = dt == "BYTES"
            self.dtype = np.dtype(object) if self.string else np.dtype(V2_TO_NUMPY[dt])
            self.false: Any = None
            self.true: Any = None
        elif len(control.int32_false_true):
            self.dtype = np.dtype(np.int32)
            self.false, self.true = control.int32_false_true
        elif len(control.fp32_false_true):
            self.dtype = np.dtype(np.float32)
            self.false, self.true = control.fp32_false_true
        else:
            self.dtype = np.dtype(np.bool_)
            self.false, self.true = control.bool_false_true


class _StateSpec:
    __slots__ = ("input_name", "output_name", "dtype", "shape")

    def __init__(self, state: model_config_pb2.ModelSequenceBatching.State, batching: bool) -> None:
        self.input_name = state.input_name
        self.output_name = state.output_name
        dt = cfgmod.model_config_pb2.DataType.Name(state.data_type)[len("TYPE_") :]
        self.dtype = np.dtype(object) if dt == "STRING" else np.dtype(V2_TO_NUMPY[dt])
        self.shape = ((1,) if batching else ()) + tuple(int(d) for d in state.dims)

    def initial(self) -> np.ndarray:
        """The ``zero_data`` initial state (``b""`` for BYTES)."""
        if self.dtype == np.dtype(object):
            return np.full(self.shape, b"", dtype=object)
        return np.zeros(self.shape, dtype=self.dtype)


def sequence_flags(request: InferRequest, model: str) -> tuple[int | str, bool, bool]:
    """The correlation id, START and END flags of a request (its V2 parameters).

    Raises:
        InferError(INVALID_ARG): no ``sequence_id``, or ``0`` / ``""`` (Triton's message).
    """
    params = request.parameters
    cid = params.get("sequence_id") if params else None
    if cid is None or cid == 0 or cid == "" or type(cid) not in (int, str):
        raise InferError(
            f"inference request to model '{model}' must specify a non-zero or non-empty "
            "correlation ID"
        )
    return cid, bool(params.get("sequence_start", False)), bool(params.get("sequence_end", False))


class SequenceBatcher(BatchingScheduler):
    """Per-model sequence batcher (``direct`` or ``oldest``).

    Triton semantics (docs/user_guide/architecture.md "Stateful Models", model_config.proto
    ``ModelSequenceBatching``, core ``src/sequence_batch_scheduler``):

    - A request belongs to the sequence named by its correlation id: the V2 request
      parameter ``sequence_id`` (an unsigned 64-bit integer or a string, as tritonclient
      sends it over HTTP and gRPC); ``sequence_start`` / ``sequence_end`` (booleans) mark
      its first and last request. A missing, ``0`` or ``""`` id is refused
      (``INVALID_ARG``, "must specify a non-zero or non-empty correlation ID"), and so is a
      request of more than one row ("must specify batch-size 1 due to requirements of
      sequence batcher").
    - A sequence is bound, on its START request, to one *sequence slot* of one model
      instance and every request of it runs there, in arrival order, one at a time. Slots
      per instance: ``max_batch_size`` (at least 1) for the ``direct`` strategy,
      ``oldest.max_candidate_sequences`` for ``oldest`` (0 -> ``max_batch_size``). A START
      that finds every slot taken waits in a FIFO *backlog* until a sequence ends.
    - A request that is not a START and whose id has no sequence is refused
      (``INVALID_ARG``, Triton's message "inference request for sequence N to model 'M'
      must specify the START flag on the first request of the sequence"; when the id was
      released by the idle timeout the message says so too). A START for an id whose
      sequence has not ended (a reused id) is accepted as Triton does: the previous
      sequence is terminated early (its queued requests still run, then the new sequence
      starts in the same slot; implicit state is reset) and a warning is logged.
    - ``max_sequence_idle_microseconds`` (default 1 s): a sequence with nothing queued or
      running whose last request arrived longer ago is released (slot freed, state
      dropped); its next request is refused as above.
    - Control tensors (``control_input``) are added to every request the model gets:
      ``CONTROL_SEQUENCE_START`` / ``END`` / ``READY`` with the configured false/true
      values (``int32_false_true``, ``fp32_false_true``, ``bool_false_true``) and
      ``CONTROL_SEQUENCE_CORRID`` with the id in its ``data_type``; shape ``[1]``, or
      ``[1, 1]`` when the model batches.
    - ``direct``: a batch holds at most one request per slot of the instance, the slot
      number being the request's position in the batch; slots without a request below
      the highest one in use get a *null request* (inputs zero, READY false) whose result
      is discarded, as Triton does. ``max_queue_delay_microseconds`` with
      ``minimum_slot_utilization`` wait for more slots to be ready.
    - ``oldest``: the instance's candidate sequences are batched dynamically, the oldest
      head requests first, at most one request per sequence, up to the largest
      ``preferred_batch_size`` (or ``max_batch_size``), waiting up to
      ``max_queue_delay_microseconds`` for a fuller batch.
    - Implicit state (``state``): the batcher keeps each sequence's state tensors. The
      model gets ``input_name`` (the START request: the ``initial_state``, zeros by
      default) and must return ``output_name`` (``[1] + dims`` when batching, else
      ``dims``, of the state's ``data_type``), which is fed back as ``input_name`` on the
      sequence's next request and never sent to the client. A request whose model result
      lacks the state or has it wrong fails with ``INTERNAL``; the state then stays as it
      was.

    Every accepted request gets exactly one outcome; a model fault fails only its batch;
    closing the model fails what is still queued with ``UNAVAILABLE``.

    Args:
        pool: the model's instances (each becomes one lane of sequence slots).
        stats: the model version's statistics (executions recorded per batch by
            :func:`run_batch`; null requests count no rows).
        model: the model version's name and configuration.
        check: the model's output check, run on every result.
    """

    def __init__(
        self,
        pool: InstancePool,
        stats: ModelStats,
        model: SchedulerSpec,
        check: OutputCheck | None = None,
    ) -> None:
        super().__init__(pool, stats, check)
        cfg = model.config
        sb = cfg.sequence_batching
        self.name = model.name
        self.batching = cfg.max_batch_size > 0
        mbs = max(1, int(cfg.max_batch_size))
        self.oldest = sb.HasField("oldest")
        if self.oldest:
            slots = int(sb.oldest.max_candidate_sequences) or mbs
            preferred = [int(s) for s in sb.oldest.preferred_batch_size if 0 < s <= mbs]
            self.max_batch = max(preferred) if preferred else mbs
            self.delay_ns = int(sb.oldest.max_queue_delay_microseconds) * 1000
            self.min_util = 0.0
        else:
            slots = mbs
            self.max_batch = mbs
            self.delay_ns = int(sb.direct.max_queue_delay_microseconds) * 1000
            self.min_util = float(sb.direct.minimum_slot_utilization)
        idle_us = int(sb.max_sequence_idle_microseconds) or cfgmod.DEFAULT_MAX_SEQUENCE_IDLE_US
        self.idle_us = idle_us
        self.idle_ns = idle_us * 1000
        self.lanes = [_Lane(inst, slots) for inst in pool.instances]
        self.controls = [_ControlSpec(ci.name, c) for ci in sb.control_input for c in ci.control]
        self.states = [_StateSpec(s, self.batching) for s in sb.state]
        self._corrid_string = next(
            (c.string for c in self.controls if c.kind == _Control.CONTROL_SEQUENCE_CORRID),
            None,
        )
        #: correlation id -> sequence not yet ended (slotted or in the backlog)
        self._active: dict[int | str, _Seq] = {}
        self._backlog: deque[_Seq] = deque()
        self._expired: OrderedDict[int | str, None] = OrderedDict()
        self._reaper: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # -- accepting ------------------------------------------------------------

    async def submit(self, request: ExecRequest) -> dict[str, np.ndarray]:
        """Queue ``request`` on its sequence; return its outputs.

        Raises:
            InferError: ``INVALID_ARG`` for a bad correlation id, a batch of more than
                one row, a non-START request of an unknown (or idle-released)
                sequence, a string id for a numeric CORRID control; ``UNAVAILABLE``
                when the model is unloading; else as :meth:`Scheduler.submit`.
        """
        if self._closed:
            raise unavailable(f"model '{self.name}' is unloading")
        cid, start, end = sequence_flags(request.request, self.name)
        if request.batch_size > 1:
            raise InferError(
                f"inference request to model '{self.name}' must specify batch-size 1 due "
                "to requirements of sequence batcher"
            )
        if self._corrid_string is False and type(cid) is str:
            raise InferError(
                f"inference request for sequence {cid} to model '{self.name}': the model's "
                "CONTROL_SEQUENCE_CORRID control is numeric, so the correlation ID must be "
                "an unsigned integer, not a string"
            )
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        now = time.monotonic_ns()
        seq = self._active.get(cid)
        if seq is None:
            if not start:
                message = (
                    f"inference request for sequence {cid} to model '{self.name}' must "
                    "specify the START flag on the first request of the sequence"
                )
                if cid in self._expired:
                    message += (
                        f" (sequence {cid} was released after being idle for more than "
                        f"max_sequence_idle_microseconds = {self.idle_us})"
                    )
                raise InferError(message)
            self._expired.pop(cid, None)
            seq = _Seq(cid, now)
            self._active[cid] = seq
            self._assign(seq)
        elif start:
            log.warning(
                "sequence %s for model '%s' has a conflict. The previous sequence did not "
                "end before this sequence start. Previous sequence will be terminated early.",
                cid,
                self.name,
            )
        seq.last_ns = now
        if end:
            # a later request with this id starts a new sequence (Triton forgets the id now)
            del self._active[cid]
        fut: asyncio.Future[dict[str, np.ndarray]] = loop.create_future()
        item = _Item(request, fut, now, start, end)
        seq.queue.append(item)
        self.stats.pending += 1
        self._arm_reaper()
        if seq.slot is not None:
            self._try_run(seq.slot.lane)
        try:
            return await fut
        except asyncio.CancelledError:
            if not item.dead and not fut.done():
                item.dead = True  # dropped when its turn comes (an END still frees the slot)
            raise
        finally:
            fut = item = None  # type: ignore[assignment]  # no future -> traceback -> frame cycle

    def _assign(self, seq: _Seq) -> None:
        """Give ``seq`` a free slot (the lane with the most free slots), or backlog it."""
        best: _Slot | None = None
        best_free = 0
        for lane in self.lanes:
            free = [s for s in lane.slots if s.seq is None]
            if len(free) > best_free:
                best, best_free = free[0], len(free)
        if best is None:
            self._backlog.append(seq)
            return
        best.seq = seq
        seq.slot = best

    def _release(self, slot: _Slot) -> None:
        """Free ``slot``; hand it to the oldest backlogged sequence still wanted."""
        seq = slot.seq
        if seq is not None:
            seq.slot = None
        slot.seq = None
        while self._backlog:
            nxt = self._backlog.popleft()
            if nxt.done and not nxt.queue:
                continue
            slot.seq = nxt
            nxt.slot = slot
            return

    # -- batch formation ------------------------------------------------------

    def _heads(self, lane: _Lane) -> list[tuple[_Slot, _Item]]:
        """Each slot's next live request; drops dead / abandoned ones and frees the
        slots of sequences that have ended."""
        heads: list[tuple[_Slot, _Item]] = []
        for slot in lane.slots:
            while slot.seq is not None:
                seq = slot.seq
                q = seq.queue
                while q:
                    it = q[0]
                    if it.dead or it.fut.done() or is_cancelled(it.req):
                        q.popleft()
                        self.stats.pending -= 1
                        if not it.fut.done():
                            it.fut.set_exception(client_gone())
                        if it.end:
                            seq.done = True
                        continue
                    break
                if q:
                    heads.append((slot, q[0]))
                elif seq.done:
                    self._release(slot)  # may hand the slot to a backlogged sequence
                    continue
                break
        return heads

    def _try_run(self, lane: _Lane) -> None:
        """Form and dispatch the lane's next batch when the instance is idle."""
        if lane.busy or self._closed:
            return
        heads = self._heads(lane)
        if not heads:
            return
        now = time.monotonic_ns()
        oldest = min(it.enq_ns for _, it in heads)
        if self.oldest:
            heads.sort(key=lambda h: h[1].enq_ns)
            want_more = len(heads) < self.max_batch
            heads = heads[: self.max_batch]
        else:
            want_more = len(heads) < self.min_util * len(lane.slots)
        if want_more and self.delay_ns and now - oldest < self.delay_ns:
            at = oldest + self.delay_ns
            if lane.timer is None or lane.timer_at > at:
                if lane.timer is not None:
                    lane.timer.cancel()
                assert self._loop is not None
                lane.timer_at = at
                lane.timer = self._loop.call_later((at - now) / 1e9, self._on_timer, lane)
            return
        if lane.timer is not None:
            lane.timer.cancel()
            lane.timer = None
        self._dispatch(lane, heads, now)

    def _on_timer(self, lane: _Lane) -> None:
        lane.timer = None
        self._try_run(lane)

    def _dispatch(self, lane: _Lane, heads: list[tuple[_Slot, _Item]], now: int) -> None:
        items: list[_Item] = []
        seqs: list[_Seq] = []
        for slot, it in heads:
            seq = slot.seq
            assert seq is not None
            seq.queue.popleft()
            self.stats.pending -= 1
            seq.running = True
            if it.end:
                seq.done = True
            it.req.queue_ns = now - it.enq_ns
            self._prepare(it, seq)
            items.append(it)
            seqs.append(seq)
        if self.oldest:
            batch = [it.req for it in items]
            positions = list(range(len(items)))
        else:
            # direct: batch position = slot number; null requests fill the gaps
            by_slot = {slot.index: it for (slot, _), it in zip(heads, items, strict=True)}
            top = max(by_slot)
            batch = []
            positions = []
            template = items[0].req
            for i in range(top + 1):
                at = by_slot.get(i)
                if at is None:
                    batch.append(self._null_request(template))
                else:
                    positions.append(i)
                    batch.append(at.req)
        lane.busy = True
        assert self._loop is not None
        task = self._loop.create_task(self._run(lane, batch, positions, items, seqs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _control_inputs(self, item: _Item | None, cid: int | str) -> dict[str, np.ndarray]:
        shape = (1, 1) if self.batching else (1,)
        out: dict[str, np.ndarray] = {}
        for c in self.controls:
            kind = c.kind
            if kind == _Control.CONTROL_SEQUENCE_CORRID:
                if c.string:
                    value: Any = str(cid).encode()
                else:
                    value = cid if type(cid) is int else 0
                arr = np.empty(shape, dtype=c.dtype)
                arr.fill(value)
                out[c.name] = arr
                continue
            if kind == _Control.CONTROL_SEQUENCE_START:
                flag = item is not None and item.start
            elif kind == _Control.CONTROL_SEQUENCE_END:
                flag = item is not None and item.end
            else:  # READY
                flag = item is not None
            out[c.name] = np.full(shape, c.true if flag else c.false, dtype=c.dtype)
        return out

    def _prepare(self, it: _Item, seq: _Seq) -> None:
        """Add the control and state inputs (and state outputs) to the request."""
        req = it.req
        if not self.controls and not self.states:
            return
        inputs = dict(req.inputs)
        inputs.update(self._control_inputs(it, seq.cid))
        if self.states:
            if it.start:
                seq.state = {}
            names = list(req.output_names)
            for st in self.states:
                prev = seq.state.get(st.input_name)
                inputs[st.input_name] = st.initial() if prev is None else prev
                if st.output_name not in names:
                    names.append(st.output_name)
            req.output_names = names
        req.inputs = inputs

    def _null_request(self, template: ExecRequest) -> ExecRequest:
        """A READY-false request shaped like ``template`` (direct strategy's empty slots)."""
        inputs: dict[str, np.ndarray] = {}
        for name, arr in template.inputs.items():
            if arr.dtype == np.dtype(object):
                inputs[name] = np.full(arr.shape, b"", dtype=object)
            else:
                inputs[name] = np.zeros_like(arr)
        inputs.update(self._control_inputs(None, 0))
        for st in self.states:
            inputs[st.input_name] = st.initial()
        return ExecRequest(
            inputs, list(template.output_names), InferRequest(self.name), batch_size=0
        )

    # -- running --------------------------------------------------------------

    async def _run(
        self,
        lane: _Lane,
        batch: list[ExecRequest],
        positions: list[int],
        items: list[_Item],
        seqs: list[_Seq],
    ) -> None:
        results: list[ExecResult]
        try:
            all_results = await run_batch(lane.instance, batch, self.stats, self.check)
            results = [all_results[p] for p in positions]
        except asyncio.CancelledError:
            results = [unavailable(f"model '{self.name}' is unloading")] * len(items)
        except Exception as e:  # run_batch catches model errors; this is a safety net
            log.exception("sequence batcher of %s failed to run a batch", self.name)
            results = [internal(f"{type(e).__name__}: {e}") for _ in items]
        now = time.monotonic_ns()
        for it, seq, res in zip(items, seqs, results, strict=True):
            seq.running = False
            seq.last_ns = now
            if self.states and type(res) is dict:
                res = self._take_state(seq, res)
            fut = it.fut
            if not fut.done():
                if isinstance(res, InferError):
                    fut.set_exception(res.fresh())
                else:
                    fut.set_result(res)
        lane.busy = False
        # the lanes whose slots a backlogged sequence may now get are woken too
        for seq in seqs:
            if seq.done and not seq.queue and seq.slot is not None:
                self._release(seq.slot)
        self._wake()

    def _take_state(self, seq: _Seq, outputs: dict[str, np.ndarray]) -> ExecResult:
        """Move the state outputs of a result into ``seq.state``; INTERNAL when wrong."""
        new: dict[str, np.ndarray] = {}
        for st in self.states:
            arr = outputs.pop(st.output_name, None)
            if arr is None:
                return internal(
                    f"model '{self.name}' did not return state output '{st.output_name}'"
                )
            if arr.dtype != st.dtype or arr.shape != st.shape:
                return internal(
                    f"model '{self.name}' returned state output '{st.output_name}' with "
                    f"dtype {arr.dtype} and shape {list(arr.shape)}; the state is "
                    f"{st.dtype} {list(st.shape)}"
                )
            new[st.input_name] = arr
        seq.state.update(new)
        return outputs

    def _wake(self) -> None:
        for lane in self.lanes:
            if not lane.busy:
                self._try_run(lane)

    # -- idle sequences -------------------------------------------------------

    def _arm_reaper(self) -> None:
        if self._reaper is None and self._loop is not None and not self._closed:
            self._reaper = self._loop.call_later(self.idle_ns / 1e9, self._reap)

    def _reap(self) -> None:
        """Release the sequences idle for more than ``max_sequence_idle_microseconds``."""
        self._reaper = None
        now = time.monotonic_ns()
        next_at: int | None = None
        for cid, seq in list(self._active.items()):
            if seq.queue or seq.running:
                continue
            due = seq.last_ns + self.idle_ns
            if due > now:
                next_at = due if next_at is None else min(next_at, due)
                continue
            log.info(
                "sequence %s of model '%s' released after being idle for more than %d us",
                cid,
                self.name,
                self.idle_us,
            )
            del self._active[cid]
            seq.done = True
            self._expired[cid] = None
            if len(self._expired) > _EXPIRED_MEMORY:
                self._expired.popitem(last=False)
            if seq.slot is not None:
                self._release(seq.slot)
        if self._active and self._loop is not None and not self._closed:
            delay = (next_at - now) if next_at is not None else self.idle_ns
            self._reaper = self._loop.call_later(max(delay, 1_000_000) / 1e9, self._reap)
        self._wake()

    # -- shutdown -------------------------------------------------------------

    async def close(self, timeout: float | None = None) -> bool:
        """Stop accepting; fail what is queued with ``UNAVAILABLE``; wait for running batches.

        Returns:
            True when no batch runs any more, False when some still ran after ``timeout`` s.
        """
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        message = f"model '{self.name}' was unloaded before the request ran"
        seqs = list(self._active.values()) + [
            s.seq for lane in self.lanes for s in lane.slots if s.seq is not None
        ]
        seqs += list(self._backlog)
        for lane in self.lanes:
            if lane.timer is not None:
                lane.timer.cancel()
                lane.timer = None
        for seq in seqs:
            while seq.queue:
                it = seq.queue.popleft()
                self.stats.pending -= 1
                if not it.fut.done():
                    it.fut.set_exception(unavailable(message))
        self._active.clear()
        self._backlog.clear()
        return await self._wait_batches(timeout)
