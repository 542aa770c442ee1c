"""pdserve.observability.monitoring.logger: sampling and filters, a request path that
never waits on a stalled sink (full queue: dropped and counted), and counts that add up:
sampled = written + dropped + queued."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pdserve.core.datatypes import bytes_array
from pdserve.core.types import InferRequest, InferResponse
from pdserve.frontends.http.decode import decode_infer_request
from pdserve.frontends.http.encode import encode_infer_response_parts
from pdserve.observability.monitoring import logger as logger_mod
from pdserve.observability.monitoring.events import (
    REQUEST_TYPE,
    RESPONSE_TYPE,
    Entry,
    JsonLines,
    tensor_from_json,
)
from pdserve.observability.monitoring.logger import PayloadLogger
from pdserve.observability.monitoring.monitor import Monitor, VersionMonitor
from pdserve.observability.monitoring.sinks import SinkError
from pdserve.observability.monitoring.spec import LogSpec, ModelMonitoring

X = {"IN": np.zeros((1, 2), np.float32)}


def _spec(text: str) -> LogSpec:
    spec = LogSpec.parse(text)
    assert spec is not None
    return spec


class StalledSink:
    """Blocks in write until released; counts what it got."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.got = 0

    def write(self, entries: list[Entry]) -> int:
        self.release.wait(10)
        self.got += len(entries)
        return len(entries)

    def tick(self) -> int:
        return 0

    def close(self) -> int:
        return 0


class FailingSink(StalledSink):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[float] = []

    def write(self, entries: list[Entry]) -> int:
        self.calls.append(time.monotonic())
        raise SinkError("disk full", len(entries))


def test_stalled_sink_never_blocks_the_caller() -> None:
    sink = StalledSink()
    logger = PayloadLogger("m", _spec("sink=jsonl:/unused,queue=10"), "s", sink)
    start = time.monotonic()
    for i in range(1000):
        logger.record("1", f"r{i}", X, X, None, {})
    assert time.monotonic() - start < 1.0
    assert logger.sampled == 1000
    assert logger.dropped["queue_full"] >= 1000 - 10 - 256
    sink.release.set()
    logger.close(5)
    assert logger.written == sink.got
    assert logger.sampled == logger.written + sum(logger.dropped.values())
    assert logger.queued == 0


def test_sink_errors_are_counted() -> None:
    logger = PayloadLogger("m", _spec("sink=jsonl:/unused"), "s", FailingSink())
    for i in range(20):
        logger.record("1", f"r{i}", X, X, None, {})
    logger.close(5)
    assert (logger.sampled, logger.written, logger.dropped["sink_error"]) == (20, 0, 20)


def test_a_failing_sink_is_retried_after_a_backoff(monkeypatch: Any) -> None:
    """After a failure the thread waits BACKOFF_S, doubling, before the next write: the
    queue fills meanwhile and the request path drops (counted) without waiting."""
    monkeypatch.setattr(logger_mod, "BACKOFF_S", 0.2)
    monkeypatch.setattr(logger_mod, "ROUND_S", 0.01)
    sink = FailingSink()
    logger = PayloadLogger("m", _spec("sink=jsonl:/unused,queue=5"), "s", sink)
    deadline = time.monotonic() + 10
    while len(sink.calls) < 3 and time.monotonic() < deadline:
        for i in range(10):
            logger.record("1", f"r{i}", X, X, None, {})
        time.sleep(0.005)
    calls = list(sink.calls[:3])
    logger.close(5)
    assert len(calls) == 3  # tries at 0, >= 0.2 and >= 0.2 + 0.4 s
    assert calls[1] - calls[0] >= 0.19 and calls[2] - calls[1] >= 0.39
    assert logger.dropped["queue_full"] > 0
    assert logger.sampled == logger.dropped["queue_full"] + logger.dropped["sink_error"]
    assert logger.written == 0 and logger.queued == 0


def test_filters_and_rate(tmp_path: Path) -> None:
    spec = _spec(f"sink=jsonl:{tmp_path},status=error,versions=2,parameter=tenant:a")
    logger = PayloadLogger("m", spec, "s")
    logger.record("2", "ok", X, X, None, {"tenant": "a"})  # success: filtered
    logger.record("1", "v1", X, None, "boom", {"tenant": "a"})  # version 1: filtered
    logger.record("2", "other", X, None, "boom", {"tenant": "b"})  # tenant b: filtered
    logger.record("2", "kept", X, None, "boom", {"tenant": "a"})
    logger.close(5)
    assert (logger.sampled, logger.written) == (1, 1)
    lines = (next((tmp_path / "m").iterdir())).read_text().splitlines()
    assert len(lines) == 2 and '"kept"' in lines[0] and '"boom"' in lines[1]
    for rate, low, high in ((0.1, 350, 650), (1.0, 5000, 5000)):  # as the monitor samples
        sampled = _monitored(f"sink=jsonl:/unused,rate={rate}", StalledSink())
        for _ in range(5000):
            sampled.observe(InferRequest("m", inputs=X), X, None)
        assert sampled.logger is not None and low <= sampled.logger.sampled <= high
        sampled.logger.sink.release.set()  # type: ignore[attr-defined]
        sampled.logger.close(5)


def _monitored(log: str, sink: Any) -> VersionMonitor:
    """A version monitor whose payload log (``log``) writes to ``sink``."""
    spec = _spec(log)
    monitor = Monitor()
    monitor.loggers[("m", spec)] = PayloadLogger("m", spec, "s", sink)
    mv = SimpleNamespace(name="m", version_str="1", config=SimpleNamespace(input=[], output=[]))
    return VersionMonitor(monitor, mv, Path("."), ModelMonitoring(log=spec))


def test_sampling_gaps_are_geometric() -> None:
    """The countdown's gaps sample each request with probability ``rate`` independently:
    mean gap 1 / rate, P(gap = 1) = rate, P(gap > k) = (1 - rate) ** k."""
    random.seed(7)
    logger = PayloadLogger("m", _spec("sink=jsonl:/unused,rate=0.2"), "s", StalledSink())
    gaps = [logger.gap() for _ in range(20000)]
    assert min(gaps) == 1
    assert 4.8 < statistics.fmean(gaps) < 5.2
    assert 0.19 < gaps.count(1) / len(gaps) < 0.21
    assert 0.78**3 < sum(g > 3 for g in gaps) / len(gaps) < 0.82**3
    every = PayloadLogger("m", _spec("sink=jsonl:/unused"), "s", StalledSink())
    assert {every.gap() for _ in range(100)} == {1}
    for lg in (logger, every):
        lg.sink.release.set()  # type: ignore[attr-defined]
        lg.close(5)


def test_the_queue_is_bounded_in_bytes_too() -> None:
    sink = StalledSink()
    logger = PayloadLogger("m", _spec("sink=jsonl:/unused,queue_mb=1"), "s", sink)
    big = {"IN": np.zeros((1, 128 * 1024), np.float32)}  # 512 KiB
    for i in range(10):
        logger.record("1", f"r{i}", big, None, None, {})
    # 2 fit in 1 MiB, and one more each time the (stalled) thread takes a batch
    assert logger.dropped["queue_full"] >= 10 - 4
    assert logger.sampled == 10
    sink.release.set()
    logger.close(5)
    assert logger.sampled == logger.written + logger.dropped["queue_full"]


def test_sent_json_bodies_are_queued_as_lines(tmp_path: Path) -> None:
    """``sent`` queues a JSON request's lines made from its bodies; without a JSON
    response (binary outputs) it records the tensors instead; ids made up are distinct;
    behind a stalled sink a full queue drops and counts: sampled = written + dropped."""
    logger = PayloadLogger("m", _spec(f"sink=jsonl:{tmp_path}"), "s")
    assert logger.encoder is not None
    body = b'{"inputs": [{"name": "IN", "shape": [1, 2], "datatype": "FP32", "data": [0, 0]}]}'
    request = decode_infer_request(body, None, "m", keep_json=True)
    out = {"OUT": np.array([1.5], np.float32)}
    response = b'{"model_name":"m","model_version":"1","outputs":[{"name":"OUT",'
    response += b'"datatype":"FP32","shape":[1],"data":[1.5]}]}'
    logger.sent("1", request, out, response)
    logger.sent("1", request, out, None)  # formatted from the arrays by the writer
    logger.sent("1", request, out, response)
    logger.close(5)
    assert (logger.sampled, logger.written) == (3, 3)
    events = [json.loads(x) for f in (tmp_path / "m").iterdir() for x in f.read_text().splitlines()]
    assert len(events) == 6 and len({e["id"] for e in events}) == 3
    for e in events:
        assert e["data"]["id"] == e["id"] and e["data"]["model_version"] == "1"
        tensors = e["data"]["inputs" if e["type"].endswith("request") else "outputs"]
        assert [t["data"] for t in tensors] in ([[0, 0]], [[1.5]])

    sink = StalledSink()
    sink.encoder = JsonLines("all", "s")  # type: ignore[attr-defined]
    stalled = PayloadLogger("m", _spec("sink=jsonl:/unused,queue=10"), "s", sink)
    assert stalled.encoder is sink.encoder  # type: ignore[attr-defined]
    for _ in range(1000):
        stalled.sent("1", request, out, response)
    assert stalled.sampled == 1000 and stalled.dropped["queue_full"] >= 1000 - 10 - 256
    sink.release.set()
    stalled.close(5)
    assert stalled.sampled == stalled.written + sum(stalled.dropped.values())
    assert stalled.written == sink.got


def test_monitored_json_requests_are_recorded_once_answered(tmp_path: Path) -> None:
    """The monitor defers a sampled JSON request to the front end's answer (the request's
    ``answered``); a request that failed, or has no JSON body, is recorded at once."""
    mv = SimpleNamespace(name="m", version_str="1", config=SimpleNamespace(input=[], output=[]))
    spec = ModelMonitoring(log=_spec(f"sink=jsonl:{tmp_path}"))
    vm = VersionMonitor(Monitor(), mv, tmp_path, spec)
    body = b'{"id": "j", "inputs": [{"name": "IN", "shape": [1], "datatype": "FP32", "data": [2]}]}'
    json_request = decode_infer_request(body, None, "m", keep_json=True)
    vm.observe(json_request, {"OUT": np.zeros(1, np.float32)}, None)
    assert vm.logger is not None and vm.logger.sampled == 0 and json_request.answered is not None
    json_request.answered(json_request, {"OUT": np.zeros(1, np.float32)}, None)
    failed = decode_infer_request(body.replace(b'"j"', b'"f"'), None, "m", keep_json=True)
    vm.observe(failed, None, ValueError("boom"))
    assert failed.answered is None
    asked = b', "outputs": [{"name": "OUT", "parameters": {"classification": 1}}]}'
    classes = body[:-1] + asked
    classified = decode_infer_request(classes, None, "m", keep_json=True)
    assert classified.outputs and classified.outputs[0].classification == 1
    vm.observe(classified, {"OUT": bytes_array([b"1.0:0"])}, None)
    assert classified.answered is None
    vm.logger.close(5)
    assert (vm.logger.sampled, vm.logger.written) == (3, 3)


class LinesSink:
    """A JSON Lines sink that keeps what it is given, encoded (as FileSink does)."""

    json_bodies = True
    format = "jsonl"

    def __init__(self, record: str = "all") -> None:
        self.encoder = JsonLines(record, "pdserve://host")
        self.text = b""

    def write(self, entries: list[Any]) -> int:
        self.text += b"".join(self.encoder.lines(entries))
        return len(entries)

    def tick(self) -> int:
        return 0

    def close(self) -> int:
        return 0


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


def _sent(body: bytes, outputs: dict[str, np.ndarray], record: str = "all") -> Any:
    """What a logger writes for ``body`` (decoded as the HTTP front end does) and the
    response the front end encodes for ``outputs``: (events, request, response body)."""
    sink = LinesSink(record)
    logger = PayloadLogger("m", _spec(f"sink=jsonl:/unused,record={record}"), "s", sink)
    request = decode_infer_request(body, None, "m", "", keep_json=True)
    response = InferResponse("m", "3", outputs, request.id)
    parts, length, _ = encode_infer_response_parts(response, request)
    logger.sent("3", request, outputs, parts[0] if length is None else None)
    logger.close(5)
    assert logger.sampled == logger.written == 1
    events = [json.loads(x, object_pairs_hook=_unique_keys) for x in sink.text.splitlines()]
    return events, request, parts[0]


@pytest.mark.parametrize("client_id", ["r1", ""])
def test_sent_lines_are_the_bodies_as_sent(client_id: str) -> None:
    """A JSON request's lines hold its body as received (newlines made spaces) and the
    response as sent, with the id and model names once each: the same tensors as the
    events formatted from the arrays."""
    doc: dict[str, Any] = {"inputs": [{"name": "X", "shape": [2, 2], "datatype": "FP32",
                           "data": [[1.5, 2], [3, 4]]}], "parameters": {"p": 1}}  # fmt: skip
    if client_id:
        doc["id"] = client_id
    body = b"\n  " + json.dumps(doc, indent=2).encode() + b"\r\n"
    outputs = {"Y": np.array([[0.25, -1]], np.float32), "N": np.array([7, 8], np.int64)}
    (req, res), request, response = _sent(body, outputs)
    assert req["type"] == REQUEST_TYPE and res["type"] == RESPONSE_TYPE
    rid = req["id"]
    assert rid == (client_id or rid) and rid.endswith("-1" if not client_id else client_id)
    assert res["id"] == req["data"]["id"] == res["data"]["id"] == rid
    assert req["modelversion"] == res["modelversion"] == "3"
    want = {**doc, "id": rid, "model_name": "m", "model_version": "3"}
    assert req["data"] == want and res["data"] == {**json.loads(response), "id": rid}
    x = tensor_from_json(req["data"]["inputs"][0])
    np.testing.assert_array_equal(x, request.inputs["X"])
    assert x.dtype == np.float32
    for t in res["data"]["outputs"]:
        got = tensor_from_json(t)
        assert got.dtype == outputs[t["name"]].dtype
        np.testing.assert_array_equal(got, outputs[t["name"]])


def test_sent_lines_fall_back_where_the_bodies_cannot_stand() -> None:
    """NaN / Infinity in the response: the tensors are formatted (base64-free numbers,
    null for NaN) instead; a body naming a model, with an empty id or with BYTES inputs
    is not kept by the decoder; one event per record mode."""
    body = b'{"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}]}'
    for bad in (np.array([np.nan, 1], np.float32), np.array([np.inf], np.float64)):
        (req, res), _, response = _sent(body, {"F": bad})
        assert b"NaN" in response or b"Infinity" in response
        assert "parameters" not in req["data"] and req["data"]["inputs"][0]["data"] == [1.0]
        assert res["data"]["outputs"][0]["data"][0] is None  # as orjson writes them
    for kept_not in (b'{"model_name": "m", ', b'{"id": "", ', b'{"model_version": "1", '):
        assert (
            decode_infer_request(kept_not + body[1:], None, "m", keep_json=True).json_body is None
        )
    nan = body.replace(b"[1]}", b"[NaN]}")  # read leniently (as Triton): not JSON to log
    assert decode_infer_request(nan, None, "m", keep_json=True).json_body is None
    strings = b'{"inputs": [{"name": "S", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}'
    assert decode_infer_request(strings, None, "m", keep_json=True).json_body is None
    assert decode_infer_request(body, None, "m").json_body is None  # not asked
    for record, kind in (("inputs", REQUEST_TYPE), ("outputs", RESPONSE_TYPE)):
        (event,), _, _ = _sent(body, {"F": np.array([2.0], np.float32)}, record)
        assert event["type"] == kind
