"""Unit tests of the sequence batcher against fake model instances (no server).

The fake instance is a running accumulator: per request ``OUT = previous + IN``, the
previous value kept either by the batcher (implicit state ``ACC_IN``/``ACC_OUT``) or
by the instance itself keyed by the CORRID control tensor. It records every batch:
its requests' READY / START / END / CORRID control values.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pdserve import config as cfgmod
from pdserve.backends.base import ExecRequest, ExecResult, ModelInstance
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest
from pdserve.scheduling.base import InstancePool
from pdserve.scheduling.sequence_batcher import SequenceBatcher

CONTROLS = """
control_input [
  { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
  { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
  { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
  { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
]
"""
STATE = """
state [ { input_name: "ACC_IN" output_name: "ACC_OUT" data_type: TYPE_FP32 dims: [ 1 ]
          initial_state [ { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "z" } ] } ]
"""


class Accumulator(ModelInstance):
    """``OUT = acc + IN``; ``acc`` from ACC_IN (implicit state) or its own dict by CORRID."""

    def __init__(self, name: str, log: list[list[tuple[bool, bool, bool, int]]]) -> None:
        self.name = name
        self.log = log
        self.acc: dict[int, np.ndarray] = {}
        self.gate: asyncio.Event | None = None
        self.fail_on: float | None = None

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        entry = []
        results: list[ExecResult] = []
        for r in batch:
            ready = bool(r.inputs["READY"].reshape(-1)[0])
            start = float(r.inputs["START"].reshape(-1)[0]) == 1.0
            end = int(r.inputs["END"].reshape(-1)[0]) == 1
            cid = int(r.inputs["CORRID"].reshape(-1)[0])
            assert r.inputs["START"].dtype == np.float32 and r.inputs["END"].dtype == np.int32
            assert r.inputs["READY"].shape == (1, 1)
            entry.append((ready, start, end, cid))
            x = r.inputs["IN"]
            if self.fail_on is not None and float(x.reshape(-1)[0]) == self.fail_on:
                results.append(InferError("boom", ErrorCode.INTERNAL))
                continue
            if "ACC_IN" in r.inputs:
                prev = r.inputs["ACC_IN"]
            else:
                prev = np.zeros_like(x) if start else self.acc.get(cid, np.zeros_like(x))
            out = prev + x
            if ready and "ACC_IN" not in r.inputs:
                self.acc[cid] = out
            res = {"OUT": out}
            if "ACC_OUT" in r.output_names:
                res["ACC_OUT"] = out
            results.append(res)
        self.log.append(entry)
        return results


def make(
    seq: str = "",
    *,
    state: bool = True,
    max_batch_size: int = 4,
    instances: int = 1,
) -> tuple[SequenceBatcher, list[Accumulator], list[list[tuple[bool, bool, bool, int]]]]:
    cfg = mc.ModelConfig(name="acc", max_batch_size=max_batch_size)
    text_format.Parse(CONTROLS + (STATE if state else "") + seq, cfg.sequence_batching)
    cfgmod.apply_defaults(cfg)
    log: list[list[tuple[bool, bool, bool, int]]] = []
    insts = [Accumulator(f"acc_{i}", log) for i in range(instances)]
    model = SimpleNamespace(name="acc", config=cfg)
    stats = ModelStats("acc", "1")
    return SequenceBatcher(InstancePool(insts), stats, model), insts, log  # type: ignore[arg-type]


def request(value: float, cid: Any, start: bool = False, end: bool = False) -> ExecRequest:
    arr = np.full((1, 1), value, dtype=np.float32)
    params: dict[str, Any] = {"sequence_id": cid}
    if start:
        params["sequence_start"] = True
    if end:
        params["sequence_end"] = True
    return ExecRequest({"IN": arr}, ["OUT"], InferRequest("acc", parameters=params), 1)


async def run_sequence(b: SequenceBatcher, cid: Any, values: list[float]) -> list[float]:
    out = []
    for i, v in enumerate(values):
        await asyncio.sleep(random.random() * 0.002)
        r = await b.submit(request(v, cid, start=i == 0, end=i == len(values) - 1))
        assert set(r) == {"OUT"}  # the state output never reaches the client
        out.append(float(r["OUT"][0, 0]))
    return out


@pytest.mark.parametrize("strategy", ["direct { }", "oldest { max_candidate_sequences: 3 }"])
@pytest.mark.parametrize("state", [True, False])
def test_interleaved_sequences_each_get_their_own_sums(strategy: str, state: bool) -> None:
    async def main() -> None:
        b, _, log = make(strategy, state=state, instances=2)
        rng = random.Random(7)
        seqs = {
            cid: [float(rng.randint(1, 9)) for _ in range(rng.randint(1, 6))]
            for cid in range(1, 21)
        }
        results = await asyncio.gather(*(run_sequence(b, c, v) for c, v in seqs.items()))
        for (_cid, values), got in zip(seqs.items(), results, strict=True):
            assert got == list(np.cumsum(values))
        real = [e for batch in log for e in batch if e[0]]
        assert len(real) == sum(len(v) for v in seqs.values())
        assert sum(1 for e in real if e[1]) == 20 and sum(1 for e in real if e[2]) == 20
        for batch in log:  # at most one request of a sequence per batch
            cids = [e[3] for e in batch if e[0]]
            assert len(cids) == len(set(cids))
        assert b.stats.pending == 0
        assert not b._active and all(s.seq is None for lane in b.lanes for s in lane.slots)

    asyncio.run(main())


def test_direct_puts_each_sequence_at_its_slot_with_null_requests() -> None:
    async def main() -> None:
        b, (inst,), log = make("direct { }", max_batch_size=4)
        inst.gate = asyncio.Event()
        # four sequences take slots 0..3; only slots 1 and 3 send a second request
        starts = [
            asyncio.ensure_future(b.submit(request(1, c, start=True))) for c in (11, 12, 13, 14)
        ]
        await asyncio.sleep(0.01)
        inst.gate.set()
        await asyncio.gather(*starts)
        # 11 ran alone at once (slot 0); 12..14 queued meanwhile and ran at slots 1..3
        assert log[0] == [(True, True, False, 11)]
        assert log[1] == [(False, False, False, 0)] + [(True, True, False, c) for c in (12, 13, 14)]
        inst.gate.clear()
        r13 = asyncio.ensure_future(b.submit(request(1, 13)))  # runs alone, holds the instance
        await asyncio.sleep(0.005)
        r12 = asyncio.ensure_future(b.submit(request(5, 12)))
        r14 = asyncio.ensure_future(b.submit(request(7, 14, end=True)))
        await asyncio.sleep(0.01)
        inst.gate.set()
        assert float((await r13)["OUT"][0, 0]) == 2.0
        assert float((await r12)["OUT"][0, 0]) == 6.0
        assert float((await r14)["OUT"][0, 0]) == 8.0
        # null requests (READY false, CORRID 0) fill the slots below the highest in use
        assert log[2] == [(False, False, False, 0)] * 2 + [(True, False, False, 13)]
        assert log[3] == [
            (False, False, False, 0),
            (True, False, False, 12),
            (False, False, False, 0),
            (True, False, True, 14),
        ]
        assert b.stats.execution_count == 4  # null requests count no rows

    asyncio.run(main())


def test_oldest_batches_across_sequences_one_request_each() -> None:
    async def main() -> None:
        b, (inst,), log = make("oldest { max_candidate_sequences: 4 }", max_batch_size=4)
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(1, 1, start=True)))
        await asyncio.sleep(0.005)
        # while the first batch runs, sequence 1 queues 2 more, sequence 2 and 3 start
        more = [
            asyncio.ensure_future(b.submit(r))
            for r in (
                request(2, 1),
                request(3, 1, end=True),
                request(10, 2, start=True),
                request(20, 3, start=True, end=True),
            )
        ]
        await asyncio.sleep(0.005)
        inst.gate.set()
        await first
        got = [float(r["OUT"][0, 0]) for r in await asyncio.gather(*more)]
        assert got == [3.0, 6.0, 10.0, 20.0]
        assert [[e[3] for e in batch] for batch in log] == [[1], [1, 2, 3], [1]]

    asyncio.run(main())


def test_backlog_waits_for_a_free_slot() -> None:
    async def main() -> None:
        b, _, _ = make("direct { }", max_batch_size=1)
        await b.submit(request(1, 1, start=True))
        second = asyncio.ensure_future(b.submit(request(5, 2, start=True, end=True)))
        await asyncio.sleep(0.02)
        assert not second.done()  # the only slot is sequence 1's
        assert float((await b.submit(request(2, 1, end=True)))["OUT"][0, 0]) == 3.0
        assert float((await second)["OUT"][0, 0]) == 5.0

    asyncio.run(main())


def test_string_correlation_ids_need_a_string_corrid_control() -> None:
    async def main() -> None:
        b, _, _ = make()
        with pytest.raises(InferError, match="must be an unsigned integer, not a string"):
            await b.submit(request(1, "abc", start=True))
        cfg_ctrl = CONTROLS.replace("TYPE_UINT64", "TYPE_STRING")
        cfg = mc.ModelConfig(name="s", max_batch_size=2)
        text_format.Parse(cfg_ctrl, cfg.sequence_batching)
        seen: list[Any] = []

        class Inst(ModelInstance):
            name = "s_0"

            async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
                seen.extend(r.inputs["CORRID"].reshape(-1)[0] for r in batch)
                return [{"OUT": r.inputs["IN"]} for r in batch]

        sb = SequenceBatcher(
            InstancePool([Inst()]),
            ModelStats("s", "1"),
            SimpleNamespace(name="s", config=cfg),  # type: ignore[arg-type]
        )
        await sb.submit(request(1, "abc", start=True, end=True))
        await sb.submit(request(1, 42, start=True, end=True))
        assert seen == [b"abc", b"42"]

    asyncio.run(main())


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({}, "must specify a non-zero or non-empty correlation ID"),
        ({"sequence_id": 0, "sequence_start": True}, "non-zero or non-empty"),
        ({"sequence_id": "", "sequence_start": True}, "non-zero or non-empty"),
        (
            {"sequence_id": 77},
            "inference request for sequence 77 to model 'acc' must specify the START flag "
            "on the first request of the sequence",
        ),
    ],
)
def test_bad_sequence_requests_are_refused(params: dict[str, Any], words: str) -> None:
    async def main() -> None:
        b, _, log = make()
        req = ExecRequest(
            {"IN": np.ones((1, 1), np.float32)}, ["OUT"], InferRequest("acc", parameters=params), 1
        )
        with pytest.raises(InferError) as e:
            await b.submit(req)
        assert e.value.code == ErrorCode.INVALID_ARG and words in str(e.value)
        assert not log and b.stats.pending == 0

    asyncio.run(main())


def test_batch_of_two_rows_is_refused() -> None:
    async def main() -> None:
        b, _, _ = make()
        req = request(1, 5, start=True)
        req.batch_size = 2
        with pytest.raises(InferError, match="must specify batch-size 1"):
            await b.submit(req)

    asyncio.run(main())


def test_request_after_end_and_reused_id() -> None:
    async def main() -> None:
        b, _, _ = make()
        assert float((await b.submit(request(4, 9, start=True)))["OUT"][0, 0]) == 4.0
        # a START for an id still in progress restarts it (Triton: previous terminated early)
        assert float((await b.submit(request(1, 9, start=True)))["OUT"][0, 0]) == 1.0
        assert float((await b.submit(request(2, 9, end=True)))["OUT"][0, 0]) == 3.0
        with pytest.raises(InferError, match="must specify the START flag"):
            await b.submit(request(1, 9))
        # the id can start a new sequence after its END
        assert float((await b.submit(request(6, 9, start=True, end=True)))["OUT"][0, 0]) == 6.0

    asyncio.run(main())


def test_idle_sequence_is_released_and_refused_clearly() -> None:
    async def main() -> None:
        b, _, _ = make("max_sequence_idle_microseconds: 50000", max_batch_size=1)
        await b.submit(request(1, 3, start=True))
        waiting = asyncio.ensure_future(b.submit(request(1, 4, start=True, end=True)))
        await asyncio.sleep(0.2)
        # the idle sequence released its slot to the backlogged one
        assert float((await waiting)["OUT"][0, 0]) == 1.0
        with pytest.raises(InferError) as e:
            await b.submit(request(1, 3))
        assert e.value.code == ErrorCode.INVALID_ARG
        assert "must specify the START flag" in str(e.value)
        assert "idle for more than max_sequence_idle_microseconds = 50000" in str(e.value)

    asyncio.run(main())


def test_model_error_fails_only_its_request_and_keeps_state() -> None:
    async def main() -> None:
        b, (inst,), _ = make()
        inst.fail_on = 99.0
        await b.submit(request(2, 1, start=True))
        with pytest.raises(InferError, match="boom"):
            await b.submit(request(99, 1))
        assert float((await b.submit(request(3, 1, end=True)))["OUT"][0, 0]) == 5.0

    asyncio.run(main())


def test_missing_state_output_is_internal() -> None:
    async def main() -> None:
        b, (inst,), _ = make()

        async def no_state(batch: list[ExecRequest]) -> list[ExecResult]:
            return [{"OUT": r.inputs["IN"]} for r in batch]

        inst.execute = no_state  # type: ignore[method-assign]
        with pytest.raises(InferError) as e:
            await b.submit(request(1, 1, start=True))
        assert e.value.code == ErrorCode.INTERNAL and "state output 'ACC_OUT'" in str(e.value)

    asyncio.run(main())


def test_close_fails_queued_requests() -> None:
    async def main() -> None:
        b, (inst,), _ = make(max_batch_size=1)
        inst.gate = asyncio.Event()
        running = asyncio.ensure_future(b.submit(request(1, 1, start=True)))
        await asyncio.sleep(0.005)
        queued = asyncio.ensure_future(b.submit(request(1, 1)))
        await asyncio.sleep(0.005)
        closing = asyncio.ensure_future(b.close(timeout=5))
        await asyncio.sleep(0.005)
        with pytest.raises(InferError) as e:
            await queued
        assert e.value.code == ErrorCode.UNAVAILABLE
        inst.gate.set()
        assert float((await running)["OUT"][0, 0]) == 1.0
        assert await closing

    asyncio.run(main())


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (
            'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] } ]',
            "sequence_batching.control_input[0].control",
            "exactly one of",
        ),
        (
            'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START '
            "int32_false_true: [ 1 ] } ] } ]",
            "sequence_batching.control_input[0].control",
            "exactly 2 entries",
        ),
        (
            'control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID '
            "data_type: TYPE_FP32 } ] } ]",
            "sequence_batching.control_input[0].control",
            "TYPE_UINT64",
        ),
        (
            'state [ { input_name: "A" output_name: "B" dims: [ 1 ] } ]',
            "sequence_batching.state[0].data_type",
            "data_type",
        ),
        (
            'state [ { input_name: "A" output_name: "B" data_type: TYPE_FP32 dims: [ 1 ] '
            'initial_state [ { data_type: TYPE_FP32 dims: [ 1 ] data_file: "f" } ] } ]',
            "sequence_batching.state[0].initial_state",
            "zero_data",
        ),
        ("iterative_sequence: true", "sequence_batching.iterative_sequence", "not supported"),
    ],
)
def test_config_validation(edit: str, field: str, words: str) -> None:
    cfg = mc.ModelConfig(name="m", backend="python", max_batch_size=2)
    text_format.Parse(edit, cfg.sequence_batching)
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.validate_config(cfg, "/x/m/config.pbtxt")
    assert e.value.field == field and words in e.value.message


def test_config_defaults_idle_timeout() -> None:
    cfg = mc.ModelConfig(name="m", backend="python", max_batch_size=2)
    cfg.sequence_batching.SetInParent()
    cfgmod.apply_defaults(cfg)
    assert cfg.sequence_batching.max_sequence_idle_microseconds == 1_000_000
    cfgmod.validate_config(cfg, "/x/m/config.pbtxt")


def test_cancelled_end_request_still_frees_the_slot() -> None:
    """A queued END whose client went away is answered CLIENT_GONE when its turn comes,
    and its sequence's slot goes to the backlog."""

    async def main() -> None:
        b, (inst,), log = make("direct { }", max_batch_size=1)
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(1, 1, start=True)))
        await asyncio.sleep(0.005)
        end = asyncio.ensure_future(b.submit(request(2, 1, end=True)))
        other = asyncio.ensure_future(b.submit(request(5, 2, start=True, end=True)))
        await asyncio.sleep(0.005)
        end.cancel()
        inst.gate.set()
        assert float((await first)["OUT"][0, 0]) == 1.0
        assert float((await other)["OUT"][0, 0]) == 5.0
        assert [[e[3] for e in batch] for batch in log] == [[1], [2]]
        assert b.stats.pending == 0 and all(s.seq is None for s in b.lanes[0].slots)

    asyncio.run(main())


def test_oldest_waits_max_queue_delay_for_a_fuller_batch() -> None:
    async def main() -> None:
        b, _, log = make(
            "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 300000 }",
            max_batch_size=2,
        )
        one = asyncio.ensure_future(b.submit(request(1, 1, start=True, end=True)))
        await asyncio.sleep(0.02)
        assert not one.done()  # waiting for a second sequence (up to 300 ms)
        two = asyncio.ensure_future(b.submit(request(2, 2, start=True, end=True)))
        await asyncio.gather(one, two)
        assert [[e[3] for e in batch] for batch in log] == [[1, 2]]

    asyncio.run(main())


def test_no_batching_model_gets_rank_one_controls_and_state() -> None:
    async def main() -> None:
        cfg = mc.ModelConfig(name="nb", max_batch_size=0)
        text_format.Parse(CONTROLS + STATE, cfg.sequence_batching)
        shapes: list[dict[str, tuple[int, ...]]] = []

        class Inst(ModelInstance):
            name = "nb_0"

            async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
                shapes.extend({k: v.shape for k, v in r.inputs.items()} for r in batch)
                return [
                    {"OUT": r.inputs["ACC_IN"] + r.inputs["IN"], "ACC_OUT": r.inputs["ACC_IN"] + 1}
                    for r in batch
                ]

        sb = SequenceBatcher(
            InstancePool([Inst()]),
            ModelStats("nb", "1"),
            SimpleNamespace(name="nb", config=cfg),  # type: ignore[arg-type]
        )

        def req(v: float, **p: Any) -> ExecRequest:
            arr = np.full((1,), v, np.float32)
            return ExecRequest({"IN": arr}, ["OUT"], InferRequest("nb", parameters=p), 1)

        assert (await sb.submit(req(5, sequence_id=1, sequence_start=True)))["OUT"][0] == 5.0
        assert (await sb.submit(req(5, sequence_id=1, sequence_end=True)))["OUT"][0] == 6.0
        assert shapes[0] == {
            "IN": (1,),
            "START": (1,),
            "END": (1,),
            "READY": (1,),
            "CORRID": (1,),
            "ACC_IN": (1,),
        }

    asyncio.run(main())
