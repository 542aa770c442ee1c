"""Dynamic batcher against a real pdserve (issue 4), driven by ``tritonclient.http``.

Models are built at test time (tests/batching_models.py): a row-wise model whose
every output row depends on its own input row only — so each response must equal
the unbatched result for its own input — and a slow model that keeps its one
instance busy so the queue fills while a test watches.

Batch formation is asserted through the statistics extension (``batch_stats``,
``execution_count``); ordering, priorities and timeouts through when and how
each request completes. Timing assertions only use wide margins (a noisy 2-core
machine): the slow "blocker" request holds the instance for about a second.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.batching_models import (
    RAGGED_CONFIG,
    SLOW_IO,
    rowwise_expected,
    rowwise_io,
    write_model,
)
from tests.conftest import ServerProcess, start_server

ONE_THREAD = 'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n'
ONE_INSTANCE = "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
#: The slow model always runs on its instance thread: ``auto`` would run a fast
#: warm-up-sized request inline and then block the event loop with a long one.
ON_THREAD = 'parameters { key: "execution_thread" value { string_value: "thread" } }\n'

#: Seconds a blocker keeps the slow model's instance busy (:func:`block`).
BLOCK_S = 2.5
#: WORK the slow model is timed with to find :func:`block`'s.
_PROBE_WORK = 20000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("batching") / "repo"
    common = ONE_THREAD + ONE_INSTANCE
    write_model(
        repo,
        "rw_batch",
        "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 100000 }\n"
        + common
        + rowwise_io(16),
        "rowwise",
    )
    write_model(
        repo,
        "rw_pref",
        "max_batch_size: 8\ndynamic_batching { preferred_batch_size: [ 4 ] "
        "max_queue_delay_microseconds: 3000000 }\n" + common + rowwise_io(16),
        "rowwise",
    )
    write_model(
        repo,
        "rw_delay",
        "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 500000 }\n"
        + common
        + rowwise_io(16),
        "rowwise",
    )
    write_model(
        repo,
        "rw_var",
        "max_batch_size: 16\ndynamic_batching { max_queue_delay_microseconds: 20000 }\n"
        + common
        + rowwise_io(-1),
        "rowwise",
        width=None,
    )
    write_model(
        repo,
        "rw_direct",
        "max_batch_size: 8\n" + common + rowwise_io(16),
        "rowwise",
    )
    write_model(
        repo,
        "slow_prio",
        "max_batch_size: 8\ndynamic_batching { preferred_batch_size: [ 1 ] priority_levels: 2 "
        "default_priority_level: 2 }\n" + common + ON_THREAD + SLOW_IO,
        "slow",
    )
    write_model(
        repo,
        "slow_policy",
        "max_batch_size: 8\ndynamic_batching { default_queue_policy { "
        "allow_timeout_override: true max_queue_size: 2 } }\n" + common + ON_THREAD + SLOW_IO,
        "slow",
    )
    write_model(
        repo,
        "slow_order",
        "max_batch_size: 8\ndynamic_batching { preferred_batch_size: [ 1 ] "
        "preserve_ordering: true }\n"
        + ONE_THREAD
        + ON_THREAD
        + "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
        + SLOW_IO,
        "slow",
    )
    write_model(
        repo,
        "ragged",
        "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 100000 }\n"
        + common
        + RAGGED_CONFIG,
        "ragged",
    )
    srv = start_server(repo, repo.parent / "pdserve.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def block(server: ServerProcess) -> int:
    """WORK for a request that keeps the slow model's instance busy for ~:data:`BLOCK_S`
    seconds on this machine (timed on ``slow_policy``, whose tests count by differences)."""
    c = client(server)
    c.infer("slow_policy", slow_inputs(0, 1))
    start = time.monotonic()
    c.infer("slow_policy", slow_inputs(0, _PROBE_WORK))
    took = time.monotonic() - start
    return max(30000, int(_PROBE_WORK * BLOCK_S / max(took, 1e-3)))


def client(server: ServerProcess, concurrency: int = 1) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, concurrency=concurrency)


def rw_inputs(x: np.ndarray) -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return [inp]


def slow_inputs(value: float, work: int, rows: int = 1) -> list[httpclient.InferInput]:
    x = np.full((rows, 4), value, dtype=np.float32)
    w = np.full((rows, 1), work, dtype=np.int64)
    a = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    a.set_data_from_numpy(x)
    b = httpclient.InferInput("WORK", list(w.shape), "INT64")
    b.set_data_from_numpy(w)
    return [a, b]


def pending(server: ServerProcess, model: str) -> int:
    """``nv_inference_pending_request_count`` of ``model`` from /metrics."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    prefix = f'nv_inference_pending_request_count{{model="{model}",'
    for line in text.splitlines():
        if line.startswith(prefix):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError(f"no pending count for {model} in /metrics")


def wait_pending(server: ServerProcess, model: str, n: int, timeout: float = 20) -> None:
    """Wait until exactly ``n`` requests of ``model`` are queued."""
    deadline = time.monotonic() + timeout
    while (now := pending(server, model)) != n:
        assert time.monotonic() < deadline, f"{model}: {now} requests queued, expected {n}"
        time.sleep(0.02)


def wait_running(server: ServerProcess, model: str, blocker: Call) -> None:
    """Give the blocker time to reach its instance (the queue is then empty again).

    Nothing in the statistics shows a batch that is still running, so this waits
    0.5 s — the blocker runs for about BLOCK_S — and checks it has not finished.
    """
    time.sleep(0.5)
    wait_pending(server, model, 0)
    assert not blocker.done_at, (
        "the blocker finished too soon for this test to mean anything "
        f"(after {blocker.done_at - blocker.started_at:.2f} s; error: {blocker.error})"
    )


def stats_of(server: ServerProcess, model: str) -> dict[str, Any]:
    return client(server).get_inference_statistics(model)["model_stats"][0]


def batch_sizes(stats: dict[str, Any]) -> dict[int, int]:
    return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}


class Call(threading.Thread):
    """One inference on its own thread and client; records when it finished."""

    def __init__(self, server: ServerProcess, model: str, inputs: Any, **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.server, self.model, self.inputs, self.kwargs = server, model, inputs, kwargs
        self.result: Any = None
        self.error: InferenceServerException | None = None
        self.done_at = 0.0
        self.started_at = time.monotonic()
        self.start()

    def run(self) -> None:
        c = client(self.server)
        try:
            self.result = c.infer(self.model, self.inputs, **self.kwargs)
        except InferenceServerException as e:
            self.error = e
        finally:
            self.done_at = time.monotonic()
            c.close()

    def output(self) -> np.ndarray:
        self.join(60)
        assert self.error is None, self.error
        return self.result.as_numpy("OUTPUT0")


def test_concurrent_requests_are_batched_and_each_gets_its_own_result(
    server: ServerProcess,
) -> None:
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((1 + i % 3, 16)).astype(np.float32) for i in range(240)]
    c = client(server, concurrency=16)
    pending = [c.async_infer("rw_batch", rw_inputs(x)) for x in inputs]
    for x, p in zip(inputs, pending, strict=True):
        np.testing.assert_allclose(
            p.get_result().as_numpy("OUTPUT0"), rowwise_expected(x), rtol=1e-5, atol=1e-5
        )
    stats = stats_of(server, "rw_batch")
    rows = sum(x.shape[0] for x in inputs)
    sizes = batch_sizes(stats)
    assert stats["inference_count"] == rows
    assert stats["inference_stats"]["success"]["count"] == len(inputs)
    assert sum(size * n for size, n in sizes.items()) == rows
    assert sum(sizes.values()) == stats["execution_count"]
    assert max(sizes) <= 8
    assert stats["execution_count"] < len(inputs) * 0.75  # requests really were merged


def test_preferred_batch_size_forms_exact_batches(server: ServerProcess) -> None:
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(12)]
    c = client(server, concurrency=12)
    pending = [c.async_infer("rw_pref", rw_inputs(x)) for x in inputs]
    for x, p in zip(inputs, pending, strict=True):
        np.testing.assert_allclose(
            p.get_result().as_numpy("OUTPUT0"), rowwise_expected(x), rtol=1e-5, atol=1e-5
        )
    assert batch_sizes(stats_of(server, "rw_pref")) == {4: 3}


def test_queue_delay_bounds_the_wait_of_a_lone_request(server: ServerProcess) -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    c = client(server)
    t0 = time.monotonic()
    out = c.infer("rw_delay", rw_inputs(x)).as_numpy("OUTPUT0")
    waited = time.monotonic() - t0
    np.testing.assert_allclose(out, rowwise_expected(x), atol=1e-5)
    assert 0.45 <= waited < 10  # waited for the 500 ms delay, then ran alone
    stats = stats_of(server, "rw_delay")
    assert batch_sizes(stats) == {1: 1}
    assert stats["inference_stats"]["queue"]["ns"] >= 450_000_000
    # A batch that reaches the preferred size (8 = max_batch_size) goes at once.
    c8 = client(server, concurrency=8)
    xs = [np.full((1, 16), i, dtype=np.float32) for i in range(8)]
    pending = [c8.async_infer("rw_delay", rw_inputs(v)) for v in xs]
    for v, p in zip(xs, pending, strict=True):
        np.testing.assert_allclose(
            p.get_result().as_numpy("OUTPUT0"), rowwise_expected(v), atol=1e-5
        )
    assert batch_sizes(stats_of(server, "rw_delay")).get(8) == 1


def test_requests_of_different_shapes_never_merge_wrongly(server: ServerProcess) -> None:
    rng = np.random.default_rng(3)
    inputs = [
        rng.standard_normal((1 + i % 2, (3, 5, 7)[i % 3])).astype(np.float32) for i in range(90)
    ]
    c = client(server, concurrency=12)
    pending = [c.async_infer("rw_var", rw_inputs(x)) for x in inputs]
    for x, p in zip(inputs, pending, strict=True):
        out = p.get_result().as_numpy("OUTPUT0")
        assert out.shape == x.shape
        np.testing.assert_allclose(out, rowwise_expected(x), rtol=1e-5, atol=1e-5)
    stats = stats_of(server, "rw_var")
    assert stats["inference_count"] == sum(x.shape[0] for x in inputs)
    assert stats["inference_stats"]["fail"]["count"] == 0


def test_models_without_dynamic_batching_run_each_request_alone(server: ServerProcess) -> None:
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal((2, 16)).astype(np.float32) for _ in range(40)]
    c = client(server, concurrency=8)
    pending = [c.async_infer("rw_direct", rw_inputs(x)) for x in inputs]
    for x, p in zip(inputs, pending, strict=True):
        np.testing.assert_allclose(
            p.get_result().as_numpy("OUTPUT0"), rowwise_expected(x), rtol=1e-5, atol=1e-5
        )
    stats = stats_of(server, "rw_direct")
    assert batch_sizes(stats) == {2: 40}
    assert stats["execution_count"] == 40


def test_higher_priority_requests_run_first(server: ServerProcess, block: int) -> None:
    blocker = Call(server, "slow_prio", slow_inputs(0, block))
    wait_running(server, "slow_prio", blocker)
    low = [Call(server, "slow_prio", slow_inputs(10 + i, 200), priority=2) for i in range(3)]
    wait_pending(server, "slow_prio", 3)
    high = [Call(server, "slow_prio", slow_inputs(20 + i, 200), priority=1) for i in range(3)]
    wait_pending(server, "slow_prio", 6)
    assert not blocker.done_at, "the blocker finished too soon for this test to mean anything"
    np.testing.assert_array_equal(blocker.output(), np.full((1, 4), 1, np.float32))
    for i, call in enumerate(low):
        np.testing.assert_array_equal(call.output(), np.full((1, 4), 11 + i, np.float32))
    for i, call in enumerate(high):
        np.testing.assert_array_equal(call.output(), np.full((1, 4), 21 + i, np.float32))
    assert max(c.done_at for c in high) < min(c.done_at for c in low)
    assert blocker.done_at < min(c.done_at for c in high)
    assert batch_sizes(stats_of(server, "slow_prio")) == {1: 7}


def test_timeout_override_and_full_queue_reject(server: ServerProcess, block: int) -> None:
    before = stats_of(server, "slow_policy")
    blocker = Call(server, "slow_policy", slow_inputs(0, block))
    wait_running(server, "slow_policy", blocker)
    timed = Call(server, "slow_policy", slow_inputs(1, 1), timeout=100_000)  # 100 ms in queue
    timed.join(30)
    assert not blocker.done_at, "the blocker finished too soon for this test to mean anything"
    assert timed.error is not None and "timeout" in str(timed.error).lower()
    queued = [Call(server, "slow_policy", slow_inputs(2 + i, 1)) for i in range(2)]
    wait_pending(server, "slow_policy", 2)
    c = client(server)
    with pytest.raises(InferenceServerException) as e:
        c.infer("slow_policy", slow_inputs(9, 1))
    assert "exceeds maximum queue size" in str(e.value)
    assert "503" in str(e.value.status())
    assert not blocker.done_at
    blocker.output()
    for i, call in enumerate(queued):
        np.testing.assert_array_equal(call.output(), np.full((1, 4), 3 + i, np.float32))
    after = stats_of(server, "slow_policy")
    fails = after["inference_stats"]["fail"]["count"] - before["inference_stats"]["fail"]["count"]
    assert fails == 1  # as in Triton: the queue timeout counts, the full-queue refusal does not
    assert after["inference_count"] - before["inference_count"] == 3


def test_request_of_a_client_that_went_away_never_reaches_the_model(
    server: ServerProcess, block: int
) -> None:
    before = stats_of(server, "slow_policy")
    blocker = Call(server, "slow_policy", slow_inputs(0, block))
    wait_running(server, "slow_policy", blocker)
    body = (
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]},'
        b'{"name":"WORK","shape":[1,1],"datatype":"INT64","data":[1]}]}'
    )
    with socket.create_connection(("127.0.0.1", server.http_port)) as s:
        s.sendall(
            b"POST /v2/models/slow_policy/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_pending(server, "slow_policy", 1)  # queued behind the blocker; now hang up
    assert not blocker.done_at, "the blocker finished too soon for this test to mean anything"
    blocker.output()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = stats_of(server, "slow_policy")
        if after["inference_stats"]["fail"]["count"] > before["inference_stats"]["fail"]["count"]:
            break
        time.sleep(0.1)
    assert (
        after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"] + 1
    )
    assert after["execution_count"] == before["execution_count"] + 1  # the blocker only
    assert after["inference_count"] == before["inference_count"] + 1


def test_preserve_ordering_holds_back_a_response_that_finished_early(
    server: ServerProcess, block: int
) -> None:
    first = Call(server, "slow_order", slow_inputs(0, block))
    wait_running(server, "slow_order", first)
    second = Call(server, "slow_order", slow_inputs(1, 1))  # runs on the other instance
    np.testing.assert_array_equal(first.output(), np.full((1, 4), 1, np.float32))
    np.testing.assert_array_equal(second.output(), np.full((1, 4), 2, np.float32))
    # Both responses are released together; without preserve_ordering the second
    # would come back about a second earlier. 50 ms absorbs client thread jitter.
    assert second.done_at >= first.done_at - 0.05
    assert first.done_at - first.started_at > 0.3
    assert batch_sizes(stats_of(server, "slow_order")) == {1: 2}


def test_bad_priority_parameter_is_a_clear_400(server: ServerProcess) -> None:
    body = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
                {"name": "WORK", "shape": [1, 1], "datatype": "INT64", "data": [1]},
            ],
            "parameters": {"priority": "high"},
        }
    ).encode()
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/slow_prio/infer", data=body, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    assert "priority" in json.loads(e.value.read())["error"]


def test_ragged_inputs_are_concatenated_with_a_batch_input(server: ServerProcess) -> None:
    """allow_ragged_batch: requests of different lengths share a batch; the model
    gets one 1-D tensor plus BATCH_ACCUMULATED_ELEMENT_COUNT and sums each request."""
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1, n)).astype(np.float32) for n in [3, 9, 1, 5, 12, 2, 7, 4] * 3]
    c = client(server, concurrency=8)
    pending = []
    for x in xs:
        inp = httpclient.InferInput("INPUT", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        pending.append(c.async_infer("ragged", [inp]))
    for x, p in zip(xs, pending, strict=True):
        out = p.get_result().as_numpy("OUTPUT")
        assert out.shape == (1, 1)
        np.testing.assert_allclose(out[0, 0], x.sum(), rtol=1e-4, atol=1e-4)
    stats = stats_of(server, "ragged")
    assert stats["inference_count"] == len(xs)
    assert stats["execution_count"] < len(xs)  # different lengths did share batches
