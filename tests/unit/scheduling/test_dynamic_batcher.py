"""Unit tests of the dynamic batcher against fake model instances (no server).

The fake instance records every batch it is given and returns, per request,
``OUT = IN * 2 + row_sum`` so a test can check each request got its own rows back.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pdserve.backends.base import ExecRequest, ExecResult, ModelInstance, merge_batch, split_batch
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest
from pdserve.frontends.http.status import http_status
from pdserve.repository.model import IOSpec
from pdserve.scheduling.base import InstancePool
from pdserve.scheduling.dynamic_batcher import DynamicBatcher


class FakeInstance(ModelInstance):
    """Runs a batch after ``gate`` is set (or at once); records what it ran."""

    def __init__(self, name: str, log: list[tuple[str, list[int]]], running: list[int]) -> None:
        self.name = name
        self.log = log
        self.running = running
        self.gate: asyncio.Event | None = None
        self.delay = 0.0

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        self.running[0] += 1
        self.running[1] = max(self.running[1], self.running[0])
        try:
            self.log.append((self.name, [r.batch_size for r in batch]))
            if self.gate is not None:
                await self.gate.wait()
            if self.delay:
                await asyncio.sleep(self.delay)
            merged = merge_batch(batch)["IN"]
            out = merged * 2 + merged.sum(axis=tuple(range(1, merged.ndim)), keepdims=True)
            return split_batch(batch, {"OUT": out})
        finally:
            self.running[0] -= 1


def make_batcher(
    dyn: str = "",
    *,
    max_batch_size: int = 8,
    instances: int = 1,
    dims: list[int] | None = None,
) -> tuple[DynamicBatcher, list[FakeInstance], list[tuple[str, list[int]]], list[int]]:
    cfg = mc.ModelConfig(name="fake", max_batch_size=max_batch_size)
    text_format.Parse(dyn, cfg.dynamic_batching)
    log: list[tuple[str, list[int]]] = []
    running = [0, 0]
    insts = [FakeInstance(f"fake_{i}", log, running) for i in range(instances)]
    model = SimpleNamespace(
        name="fake",
        config=cfg,
        inputs={"IN": IOSpec("IN", "FP32", dims if dims is not None else [4])},
    )
    stats = ModelStats("fake", "1")
    return DynamicBatcher(InstancePool(insts), stats, model), insts, log, running  # type: ignore[arg-type]


def request(value: float, rows: int = 1, width: int = 4, **params: Any) -> ExecRequest:
    arr = np.full((rows, width), value, dtype=np.float32)
    req = InferRequest("fake", inputs={"IN": arr}, parameters=params)
    return ExecRequest({"IN": arr}, ["OUT"], req, rows)


def expected(value: float, rows: int = 1, width: int = 4) -> np.ndarray:
    arr = np.full((rows, width), value, dtype=np.float32)
    return arr * 2 + arr.sum(axis=1, keepdims=True)


async def submit_all(b: DynamicBatcher, reqs: list[ExecRequest]) -> list[Any]:
    tasks = [asyncio.ensure_future(b.submit(r)) for r in reqs]
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_merges_what_queued_while_the_instance_was_busy() -> None:
    async def main() -> None:
        b, (inst,), log, _ = make_batcher(max_batch_size=8)
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(100)))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(b.submit(request(i))) for i in range(10)]
        await asyncio.sleep(0.01)
        assert b.queued == 10
        inst.gate.set()
        results = await asyncio.gather(first, *rest)
        np.testing.assert_array_equal(results[0]["OUT"], expected(100))
        for i, r in enumerate(results[1:]):
            np.testing.assert_array_equal(r["OUT"], expected(i))
        assert [sizes for _, sizes in log] == [[1], [1] * 8, [1, 1]]
        assert sorted(b.stats.batches) == [1, 2, 8]

    asyncio.run(main())


def test_preferred_batch_size_cuts_the_batch() -> None:
    async def main() -> None:
        b, (inst,), log, _ = make_batcher("preferred_batch_size: [2, 4]", max_batch_size=8)
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(0)))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(b.submit(request(i))) for i in range(7)]
        await asyncio.sleep(0.01)
        inst.gate.set()
        await asyncio.gather(first, *rest)
        # 7 queued: 4 (largest preferred), then 2 (preferred), then 1 (delay 0).
        assert [sum(s) for _, s in log] == [1, 4, 2, 1]

    asyncio.run(main())


def test_multi_row_requests_never_exceed_max_batch_size() -> None:
    async def main() -> None:
        b, (inst,), log, _ = make_batcher(max_batch_size=8)
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(0, rows=8)))
        await asyncio.sleep(0)
        reqs = [request(i, rows=3) for i in range(5)]
        rest = [asyncio.ensure_future(b.submit(r)) for r in reqs]
        await asyncio.sleep(0.01)
        inst.gate.set()
        results = await asyncio.gather(first, *rest)
        for i, r in enumerate(results[1:]):
            np.testing.assert_array_equal(r["OUT"], expected(i, rows=3))
        assert [s for _, s in log] == [[8], [3, 3], [3, 3], [3]]

    asyncio.run(main())


def test_delay_waits_for_a_fuller_batch_but_not_longer_than_the_delay() -> None:
    async def main() -> None:
        b, _, log, _ = make_batcher(
            "max_queue_delay_microseconds: 200000 preferred_batch_size: [4]", max_batch_size=8
        )
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(b.submit(request(i))) for i in range(3)]
        await asyncio.sleep(0.05)
        assert not log  # waiting: 3 < preferred 4, delay not over
        tasks.append(asyncio.ensure_future(b.submit(request(3))))
        await asyncio.gather(*tasks)
        assert [s for _, s in log] == [[1, 1, 1, 1]]  # preferred size reached: sent at once
        assert time.monotonic() - t0 < 0.19
        # Alone: the delay expires and it runs with what it has.
        t1 = time.monotonic()
        await b.submit(request(9))
        waited = time.monotonic() - t1
        assert waited >= 0.2
        assert waited < 5
        assert log[-1][1] == [1]

    asyncio.run(main())


def test_different_shapes_never_merge() -> None:
    async def main() -> None:
        b, (inst,), log, _ = make_batcher(max_batch_size=8, dims=[-1])
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(0, width=3)))
        await asyncio.sleep(0)
        widths = [3, 3, 5, 5, 5, 3, 7]
        rest = [asyncio.ensure_future(b.submit(request(i, width=w))) for i, w in enumerate(widths)]
        await asyncio.sleep(0.01)
        inst.gate.set()
        results = await asyncio.gather(first, *rest)
        for i, (w, r) in enumerate(zip(widths, results[1:], strict=True)):
            np.testing.assert_array_equal(r["OUT"], expected(i, width=w))
        assert [len(s) for _, s in log] == [1, 2, 3, 1, 1]

    asyncio.run(main())


def test_instances_never_run_two_batches() -> None:
    async def main() -> None:
        b, insts, log, running = make_batcher(max_batch_size=4, instances=3)
        for inst in insts:
            inst.delay = 0.005
        results = await submit_all(b, [request(i) for i in range(200)])
        for i, r in enumerate(results):
            np.testing.assert_array_equal(r["OUT"], expected(i))
        assert running[1] <= 3
        assert sum(len(s) for _, s in log) == 200
        assert max(len(s) for _, s in log) <= 4
        assert {name for name, _ in log} == {"fake_0", "fake_1", "fake_2"}
        assert b.stats.pending == 0

    asyncio.run(main())


def test_priority_levels_run_high_priority_first() -> None:
    async def main() -> None:
        b, (inst,), log, _ = make_batcher(
            "priority_levels: 3 default_priority_level: 2 preferred_batch_size: [1]",
            max_batch_size=4,
        )
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(0)))
        await asyncio.sleep(0)
        order = [(10, 3), (11, 0), (12, 1), (13, 2), (14, 1), (15, 9)]  # 0 and 9 -> default 2
        rest = [asyncio.ensure_future(b.submit(request(v, priority=p))) for v, p in order]
        await asyncio.sleep(0.01)
        inst.gate.set()
        await asyncio.gather(first, *rest)
        assert len(log) == 7
        ran: list[int] = []
        orig = FakeInstance.execute

        async def spy(self: FakeInstance, batch: list[ExecRequest]) -> list[ExecResult]:
            ran.append(int(batch[0].inputs["IN"][0, 0]))
            return await orig(self, batch)

        FakeInstance.execute = spy  # type: ignore[method-assign]
        try:
            inst.gate = asyncio.Event()
            first = asyncio.ensure_future(b.submit(request(0)))
            await asyncio.sleep(0)
            rest = [asyncio.ensure_future(b.submit(request(v, priority=p))) for v, p in order]
            await asyncio.sleep(0.01)
            inst.gate.set()
            await asyncio.gather(first, *rest)
        finally:
            FakeInstance.execute = orig  # type: ignore[method-assign]
        assert ran == [0, 12, 14, 11, 13, 15, 10]

    asyncio.run(main())


def test_max_queue_size_rejects_at_once() -> None:
    async def main() -> None:
        b, (inst,), _, _ = make_batcher(
            "default_queue_policy { max_queue_size: 3 }", max_batch_size=8
        )
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(0)))
        await asyncio.sleep(0)
        queued = [asyncio.ensure_future(b.submit(request(i))) for i in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(InferError) as e:
            await b.submit(request(99))
        assert http_status(e.value.code) == 503
        assert "exceeds maximum queue size" in e.value.message
        inst.gate.set()
        await asyncio.gather(first, *queued)

    asyncio.run(main())


def test_timeout_reject_and_override() -> None:
    async def main() -> None:
        b, (inst,), _, _ = make_batcher(
            "default_queue_policy { default_timeout_microseconds: 10000000 "
            "allow_timeout_override: true }",
            max_batch_size=8,
        )
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(0)))
        await asyncio.sleep(0)
        short = asyncio.ensure_future(b.submit(request(1, timeout=20000)))  # 20 ms
        longer = asyncio.ensure_future(b.submit(request(2, timeout=50_000_000)))  # > default
        await asyncio.sleep(0.2)
        assert short.done()  # rejected while the instance was still busy
        with pytest.raises(InferError) as e:
            short.result()
        assert http_status(e.value.code) == 503
        assert "timeout" in e.value.message.lower()
        assert not longer.done()
        inst.gate.set()
        np.testing.assert_array_equal((await longer)["OUT"], expected(2))
        await first
        assert b.stats.pending == 0

    asyncio.run(main())


def test_timeout_delay_moves_behind_the_others() -> None:
    async def main() -> None:
        b, (inst,), log, _ = make_batcher(
            "preferred_batch_size: [1] default_queue_policy { timeout_action: DELAY "
            "default_timeout_microseconds: 10000000 allow_timeout_override: true }",
            max_batch_size=8,
        )
        ran: list[int] = []
        orig = inst.execute

        async def spy(batch: list[ExecRequest]) -> list[ExecResult]:
            ran.append(int(batch[0].inputs["IN"][0, 0]))
            return await orig(batch)

        inst.execute = spy  # type: ignore[method-assign]
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(0)))
        await asyncio.sleep(0)
        early = asyncio.ensure_future(b.submit(request(1, timeout=10000)))  # times out: DELAY
        others = [asyncio.ensure_future(b.submit(request(v))) for v in (2, 3)]
        await asyncio.sleep(0.1)
        inst.gate.set()
        results = await asyncio.gather(first, early, *others)
        np.testing.assert_array_equal(results[1]["OUT"], expected(1))
        assert ran == [0, 2, 3, 1]

    asyncio.run(main())


def test_cancelled_caller_and_gone_client_never_reach_an_instance() -> None:
    async def main() -> None:
        b, (inst,), log, _ = make_batcher(max_batch_size=8)
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(0)))
        await asyncio.sleep(0)
        cancelled = asyncio.ensure_future(b.submit(request(1)))
        gone_req = request(2)
        gone_req.request.cancelled = lambda: True
        gone = asyncio.ensure_future(b.submit(gone_req))
        kept = asyncio.ensure_future(b.submit(request(3)))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        inst.gate.set()
        np.testing.assert_array_equal((await kept)["OUT"], expected(3))
        await first
        with pytest.raises(InferError) as e:
            await gone
        assert e.value.reason == "CANCELED"
        assert [s for _, s in log] == [[1], [1]]
        assert b.stats.pending == 0

    asyncio.run(main())


def test_preserve_ordering_across_instances() -> None:
    async def main() -> None:
        b, insts, _, _ = make_batcher(
            "preserve_ordering: true preferred_batch_size: [1]", max_batch_size=4, instances=2
        )
        insts[0].delay = 0.05  # the first batch finishes last
        done: list[int] = []

        async def one(v: int) -> None:
            await b.submit(request(v))
            done.append(v)

        await asyncio.gather(*(one(v) for v in range(6)))
        assert done == sorted(done)

    asyncio.run(main())


def test_close_fails_queued_requests() -> None:
    async def main() -> None:
        b, (inst,), _, _ = make_batcher(max_batch_size=2)
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(request(0)))
        await asyncio.sleep(0)
        queued = asyncio.ensure_future(b.submit(request(1)))
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(b.close())
        await asyncio.sleep(0)
        with pytest.raises(InferError) as e:
            await queued
        assert http_status(e.value.code) == 503
        inst.gate.set()
        await first
        await closing
        with pytest.raises(InferError):
            await b.submit(request(2))

    asyncio.run(main())


def test_scan_resumes_and_rescans_in_priority_order_while_waiting() -> None:
    async def main() -> None:
        b, (inst,), log, _ = make_batcher(
            "priority_levels: 2 default_priority_level: 2 preferred_batch_size: [4] "
            "max_queue_delay_microseconds: 5000000",
            max_batch_size=8,
        )
        order: list[list[int]] = []
        orig = inst.execute

        async def spy(batch: list[ExecRequest]) -> list[ExecResult]:
            order.append([int(r.inputs["IN"][0, 0]) for r in batch])
            return await orig(batch)

        inst.execute = spy  # type: ignore[method-assign]
        tasks = [asyncio.ensure_future(b.submit(request(1)))]
        await asyncio.sleep(0.01)  # scanned; waiting for the delay
        tasks.append(asyncio.ensure_future(b.submit(request(2))))  # resumes the scan
        await asyncio.sleep(0.01)
        tasks.append(asyncio.ensure_future(b.submit(request(3, priority=1))))  # goes first
        await asyncio.sleep(0.01)
        assert not order
        tasks.append(asyncio.ensure_future(b.submit(request(4))))  # 4 rows: preferred size
        await asyncio.gather(*tasks)
        assert order == [[3, 1, 2, 4]]

    asyncio.run(main())


def test_deadline_heap_does_not_keep_finished_requests() -> None:
    async def main() -> None:
        b, _, _, _ = make_batcher(
            "default_queue_policy { default_timeout_microseconds: 60000000 }", max_batch_size=4
        )
        for _ in range(10):
            await submit_all(b, [request(i) for i in range(50)])
        assert len(b._deadlines) <= 2 * 50 + 64 + 1

    asyncio.run(main())


class FailingInstance(ModelInstance):
    """Fails every request of every batch (one error object for the whole batch)."""

    name = "failing_0"

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        raise InferError("the model failed", ErrorCode.INTERNAL)


def test_a_failed_request_is_freed_without_the_cyclic_gc() -> None:
    """future -> exception -> traceback -> frame -> future cycles would keep every failed
    request's tensors until a full collection; with the GC off they must still go."""
    import gc
    import weakref

    async def main() -> None:
        cfg = mc.ModelConfig(name="fake", max_batch_size=8)
        cfg.dynamic_batching.SetInParent()
        model = SimpleNamespace(name="fake", config=cfg, inputs={"IN": IOSpec("IN", "FP32", [4])})
        b = DynamicBatcher(InstancePool([FailingInstance()]), ModelStats("fake", "1"), model)  # type: ignore[arg-type]
        refs = []
        reqs = [request(float(i)) for i in range(4)]
        refs = [weakref.ref(r.inputs["IN"]) for r in reqs]
        results = await submit_all(b, reqs)
        assert all(isinstance(r, InferError) and http_status(r.code) == 500 for r in results)
        assert len({id(r) for r in results}) == 4, "requests must not share one error"
        del reqs, results
        await asyncio.sleep(0)
        alive = [r for r in refs if r() is not None]
        assert not alive, gc.get_referrers(alive[0]())

    gc.collect()
    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()


def test_a_client_gone_after_batching_does_not_reach_the_instance() -> None:
    async def main() -> None:
        b, (inst,), log, _ = make_batcher(max_batch_size=8)
        gone = [False]
        req = request(1)
        req.request.cancelled = lambda: gone[0]
        task = asyncio.ensure_future(b.submit(req))
        kept = asyncio.ensure_future(b.submit(request(2)))
        await asyncio.sleep(0)  # the batch is formed (dispatched) here ...
        gone[0] = True  # ... and the client leaves before it runs
        with pytest.raises(InferError) as e:
            await task
        assert http_status(e.value.code) == 499
        np.testing.assert_array_equal((await kept)["OUT"], expected(2))
        assert [s for _, s in log] == [[1]]

    asyncio.run(main())


def test_close_with_a_timeout_does_not_wait_for_a_stuck_batch() -> None:
    async def main() -> None:
        b, (inst,), _, _ = make_batcher(max_batch_size=8)
        inst.gate = asyncio.Event()  # never set: the batch hangs
        stuck = asyncio.ensure_future(b.submit(request(1)))
        await asyncio.sleep(0.01)
        start = time.monotonic()
        assert await b.close(0.2) is False
        assert time.monotonic() - start < 1
        await b.cancel_running()
        with pytest.raises(InferError) as e:
            await stuck
        assert http_status(e.value.code) == 503

    asyncio.run(main())


def test_server_frees_a_failed_batched_requests_inputs_without_the_gc(tmp_path: Any) -> None:
    """In-process InferenceServer, a batching ONNX model whose run fails (Reshape of 4
    values to [-1, 3]): with the cyclic GC off, the failed requests' inputs are freed."""
    import gc
    import weakref

    import onnx
    from onnx import TensorProto, helper

    from pdserve.server import InferenceServer

    x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 3])
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 3])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["INPUT0", "shape"], ["OUTPUT0"])], "bad", [x], [y], [shape]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (tmp_path / "bad" / "1").mkdir(parents=True)
    onnx.save(model, str(tmp_path / "bad" / "1" / "model.onnx"))
    (tmp_path / "bad" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
    )

    async def main() -> None:
        server = InferenceServer(tmp_path)
        await server.start()
        try:
            arrays = [np.ones((1, 4), np.float32) for _ in range(4)]
            refs = [weakref.ref(a) for a in arrays]
            reqs = [InferRequest("bad", inputs={"INPUT0": a}) for a in arrays]
            del arrays
            results = await asyncio.gather(*(server.infer(r) for r in reqs), return_exceptions=True)
            assert all(isinstance(r, InferError) and http_status(r.code) == 500 for r in results), (
                results
            )
            assert server.manager.get("bad").stats.as_dict()["execution_count"] >= 1
            del reqs, results
            # The instance's executor thread drops its work item (which holds the
            # feeds) only once it runs again after the result is handed over: give
            # it a moment — the GC stays off, so only reference counting can free them.
            for _ in range(100):
                if all(r() is None for r in refs):
                    break
                await asyncio.sleep(0.01)
            alive = [r() for r in refs if r() is not None]
            assert not alive, [type(o).__name__ for o in gc.get_referrers(alive[0])]
        finally:
            await server.stop(5)

    gc.collect()
    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()


# -- padding policy (issue 16 item 3) ----------------------------------------------------


class TokenInstance(ModelInstance):
    """A token model: ``IDS``, ``MASK`` INT64 [rows, L] -> ``EMB`` FP32 [rows, L, 2]
    (``[ids * mask, mask]`` per position) and ``SUM`` FP32 [rows, 1] (``sum(ids * mask)``).

    It merges the batch (so requests of different lengths would fail in
    ``np.concatenate``) and records each batch's request count and padded length.
    """

    name = "tok_0"

    def __init__(self) -> None:
        self.log: list[tuple[int, int]] = []
        self.gate: asyncio.Event | None = None

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        if self.gate is not None:
            await self.gate.wait()
        merged = merge_batch(batch)
        ids, mask = merged["IDS"], merged["MASK"]
        self.log.append((len(batch), ids.shape[1]))
        emb = np.stack([ids * mask, mask], axis=2).astype(np.float32)
        total = (ids * mask).sum(axis=1, keepdims=True).astype(np.float32)
        return split_batch(batch, {"EMB": emb, "SUM": total})


def token_batcher(padding: str, dyn: str = "") -> tuple[DynamicBatcher, TokenInstance]:
    cfg = text_format.Parse(
        f"""
        name: "tok" max_batch_size: 16
        input {{ name: "IDS" data_type: TYPE_INT64 dims: [ -1 ] }}
        input {{ name: "MASK" data_type: TYPE_INT64 dims: [ -1 ] }}
        output {{ name: "EMB" data_type: TYPE_FP32 dims: [ -1, 2 ] }}
        output {{ name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] }}
        dynamic_batching {{ {dyn} }}
        parameters {{ key: "padding" value: {{ string_value: "{padding}" }} }}
        """,
        mc.ModelConfig(),
    )
    model = SimpleNamespace(
        name="tok",
        config=cfg,
        inputs={"IDS": IOSpec("IDS", "INT64", [-1]), "MASK": IOSpec("MASK", "INT64", [-1])},
    )
    inst = TokenInstance()
    stats = ModelStats("tok", "1")
    return DynamicBatcher(InstancePool([inst]), stats, model), inst  # type: ignore[arg-type]


TOKEN_POLICY = "inputs=IDS:0:0, MASK:0:0; outputs=EMB:0; pad_to=8,16"


def token_request(length: int, mask_length: int | None = None, **params: Any) -> ExecRequest:
    ids = np.arange(1, length + 1, dtype=np.int64).reshape(1, length)
    mask = np.ones((1, mask_length if mask_length is not None else length), np.int64)
    req = InferRequest("tok", inputs={"IDS": ids, "MASK": mask}, parameters=params)
    return ExecRequest({"IDS": ids, "MASK": mask}, ["EMB", "SUM"], req, 1)


def assert_own_length(result: dict[str, np.ndarray], length: int) -> None:
    """The outputs of an unpadded run of a request of ``length`` tokens."""
    ids = np.arange(1, length + 1, dtype=np.float32)
    np.testing.assert_array_equal(result["EMB"], np.stack([ids, np.ones(length)], 1)[None])
    np.testing.assert_array_equal(result["SUM"], [[ids.sum()]])


def test_padding_groups_requests_by_bucket_and_cuts_outputs_back() -> None:
    async def main() -> None:
        b, inst = token_batcher(TOKEN_POLICY)
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(token_request(2)))
        await asyncio.sleep(0)
        # interleaved lengths: buckets 8, 16, 8, 16, 8, oversize 20, 8, oversize 20
        lengths = [3, 12, 5, 9, 8, 20, 1, 20]
        rest = [asyncio.ensure_future(b.submit(token_request(n))) for n in lengths]
        await asyncio.sleep(0.01)
        inst.gate.set()
        results = await asyncio.gather(first, *rest)
        for n, r in zip([2, *lengths], results, strict=True):
            assert_own_length(r, n)
        # one bucket per batch, the oldest request's bucket first; the two requests
        # longer than every bucket run together unpadded (20 = their own length)
        assert inst.log == [(1, 8), (4, 8), (2, 16), (2, 20)]
        # statistics count the batches as they ran
        assert {n: s.compute_infer.count for n, s in b.stats.batches.items()} == {1: 1, 4: 1, 2: 2}
        assert b.stats.execution_count == 4
        assert b.queued == 0 and b.stats.pending == 0

    asyncio.run(main())


def test_padding_to_the_longest_puts_every_length_in_one_batch() -> None:
    async def main() -> None:
        b, inst = token_batcher("inputs=IDS:0:0, MASK:0:0; outputs=EMB:0; pad_to=max")
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(token_request(2)))
        await asyncio.sleep(0)
        lengths = [3, 30, 5, 9]
        rest = [asyncio.ensure_future(b.submit(token_request(n))) for n in lengths]
        await asyncio.sleep(0.01)
        inst.gate.set()
        results = await asyncio.gather(first, *rest)
        for n, r in zip([2, *lengths], results, strict=True):
            assert_own_length(r, n)
        assert inst.log == [(1, 2), (4, 30)]

    asyncio.run(main())


def test_bucket_pad_longest_pads_a_bucket_to_its_longest_request() -> None:
    async def main() -> None:
        b, inst = token_batcher(f"{TOKEN_POLICY}; bucket_pad=longest")
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(token_request(2)))
        await asyncio.sleep(0)
        lengths = [3, 12, 5, 9, 7]
        rest = [asyncio.ensure_future(b.submit(token_request(n))) for n in lengths]
        await asyncio.sleep(0.01)
        inst.gate.set()
        results = await asyncio.gather(first, *rest)
        for n, r in zip([2, *lengths], results, strict=True):
            assert_own_length(r, n)
        assert inst.log == [(1, 2), (3, 7), (2, 12)]  # bucket 8 padded to 7, bucket 16 to 12

    asyncio.run(main())


def test_padding_keeps_priorities_and_preferred_sizes() -> None:
    async def main() -> None:
        b, inst = token_batcher(
            TOKEN_POLICY,
            "priority_levels: 2 default_priority_level: 2 preferred_batch_size: [2]",
        )
        inst.gate = asyncio.Event()
        first = asyncio.ensure_future(b.submit(token_request(2)))
        await asyncio.sleep(0)
        order = [(3, 2), (12, 2), (4, 2), (10, 1), (11, 2), (5, 2), (6, 2)]
        rest = [asyncio.ensure_future(b.submit(token_request(n, priority=p))) for n, p in order]
        await asyncio.sleep(0.01)
        inst.gate.set()
        results = await asyncio.gather(first, *rest)
        for n, r in zip([2, *[n for n, _ in order]], results, strict=True):
            assert_own_length(r, n)
        # the priority-1 request (10, bucket 16) leads; batches are cut at 2 requests;
        # its bucket-mates (12, 11) join from the lower level before the 8-bucket runs
        assert inst.log == [(1, 8), (2, 16), (2, 8), (1, 16), (2, 8)]

    asyncio.run(main())


def test_padded_inputs_of_different_lengths_are_refused() -> None:
    async def main() -> None:
        b, inst = token_batcher(TOKEN_POLICY)
        with pytest.raises(InferError) as info:
            await b.submit(token_request(4, mask_length=5))
        assert info.value.code == ErrorCode.INVALID_ARG
        assert http_status(info.value.code) == 400
        assert "'IDS' and 'MASK' are padded together" in str(info.value)
        assert b.queued == 0 and b.stats.pending == 0 and inst.log == []
        assert_own_length(await b.submit(token_request(4)), 4)  # the batcher carries on

    asyncio.run(main())


def test_padding_an_output_the_model_shortened_is_an_internal_error() -> None:
    class Shortening(TokenInstance):
        async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
            results = await super().execute(batch)
            return [{"EMB": r["EMB"][:, :-1], "SUM": r["SUM"]} for r in results]  # type: ignore[index]

    async def main() -> None:
        b, _ = token_batcher(TOKEN_POLICY)
        b.pool = InstancePool([Shortening()])
        with pytest.raises(InferError) as info:
            await b.submit(token_request(3))
        assert info.value.code == ErrorCode.INTERNAL
        assert "dimension 1 should have the padded length 8" in str(info.value)

    asyncio.run(main())
