"""OpenTelemetry tracing and Triton's trace extension, end to end (issue 17).

A real pdserve exports OTLP/HTTP to a receiver this module starts on loopback; the
receiver decodes each ``ExportTraceServiceRequest`` with opentelemetry-proto, and the
tests check the span trees (names, parent links, durations, attributes).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.conftest import EXAMPLE_REPO, GOLDENS, ROOT, ServerProcess, free_port, start_server

PY_MODELS = ROOT / "tests" / "data" / "python_models"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


# --------------------------------------------------------------------------- receiver


class Span:
    """One received span, decoded."""

    def __init__(self, pb: Any, resource: dict[str, Any]) -> None:
        self.name: str = pb.name
        self.trace_id = pb.trace_id.hex()
        self.span_id = pb.span_id.hex()
        self.parent_id = pb.parent_span_id.hex()
        self.start = pb.start_time_unix_nano
        self.end = pb.end_time_unix_nano
        self.attrs = {kv.key: _value(kv.value) for kv in pb.attributes}
        self.status_code = pb.status.code
        self.resource = resource

    @property
    def duration(self) -> int:
        return self.end - self.start

    def __repr__(self) -> str:
        return f"Span({self.name}, {self.span_id}<-{self.parent_id}, {self.duration / 1e3:.0f}us)"


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1 (``POST /v1/traces``, protobuf).

    ``delay``: seconds each export waits before its answer (a slow collector).
    """

    def __init__(self, delay: float = 0.0) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self.delay = delay
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if receiver.delay:
                    time.sleep(receiver.delay)
                msg = ExportTraceServiceRequest()
                msg.ParseFromString(body)
                with receiver.lock:
                    receiver.requests += 1
                    for rs in msg.resource_spans:
                        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            receiver.spans.extend(Span(s, resource) for s in ss.spans)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, pred: Any, timeout: float = 20.0) -> list[Span]:
        """Spans once ``pred(spans)`` holds (or fail after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                spans = list(self.spans)
            if pred(spans):
                return spans
            time.sleep(0.05)
        pytest.fail(f"spans never matched; received {len(spans)}: {spans[:40]}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def trace_flags(url: str, *extra: str) -> list[str]:
    args = [
        "--trace-config",
        "level=TIMESTAMPS",
        "--trace-config",
        "rate=1",
        "--trace-config",
        f"opentelemetry,url={url}",
        "--trace-config",
        "opentelemetry,bsp_schedule_delay=50",
    ]
    for e in extra:
        args += ["--trace-config", e]
    return args


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not EXAMPLE_REPO.is_dir():
        pytest.fail("examples/model_repository is missing: run `python examples/build.py`")
    dst = tmp_path_factory.mktemp("trace_repo")
    for name in ("image_classifier", "preprocess", "efficientnet_lite0", "postprocess", "tiny"):
        shutil.copytree(EXAMPLE_REPO / name, dst / name, symlinks=True)
    for name in ("add_sub", "bls_traced", "custom_span"):
        shutil.copytree(PY_MODELS / name, dst / name)
    shutil.copytree(EXAMPLE_REPO / "tiny", dst / "tiny_cached", symlinks=True)
    cfg = dst / "tiny_cached" / "config.pbtxt"
    text = cfg.read_text().replace('name: "tiny"', 'name: "tiny_cached"')
    cfg.write_text(text + "\nresponse_cache { enable: true }\n")
    return dst


@pytest.fixture(scope="module")
def server(
    repo: Path, receiver: Receiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("trace_server") / "pdserve.log"
    srv = start_server(
        repo, log, *trace_flags(receiver.url), "--response-cache-byte-size", "1048576"
    )
    yield srv
    srv.stop()


def _children(spans: list[Span], parent: Span) -> list[Span]:
    return sorted((s for s in spans if s.parent_id == parent.span_id), key=lambda s: s.start)


def _one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, spans)
    return found[0]


def _is_below(spans: list[Span], span: Span, ancestor: Span) -> bool:
    by_id = {s.span_id: s for s in spans}
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        if span is ancestor:
            return True
    return False


def _inside(child: Span, parent: Span) -> None:
    assert parent.start <= child.start <= child.end <= parent.end, (child, parent)


def _check_model_span(spans: list[Span], model: Span, python: bool) -> None:
    """A model span: queue then compute (input / infer / output adding up)."""
    kids = _children(spans, model)
    names = [s.name for s in kids]
    assert "queue" in names and "compute" in names, names
    queue, compute = _one(kids, "queue"), _one(kids, "compute")
    for k in kids:
        _inside(k, model)
    assert queue.end <= compute.start
    assert queue.duration + compute.duration <= model.duration
    parts = _children(spans, compute)
    assert [p.name for p in parts] == ["compute_input", "compute_infer", "compute_output"]
    assert sum(p.duration for p in parts) == compute.duration
    assert parts[0].start == compute.start and parts[2].end == compute.end
    assert compute.attrs["pdserve.batch_size"] >= 1
    assert compute.attrs["pdserve.batch_requests"] >= 1
    if python:
        hop = _one(_children(spans, parts[1]), "python_worker")
        _inside(hop, parts[1])
        execute = _one(_children(spans, hop), "execute")
        _inside(execute, hop)
        assert hop.attrs["pdserve.worker_pid"] > 0


# --------------------------------------------------------------------------- span trees


def test_image_pipeline_span_tree(server: ServerProcess, receiver: Receiver) -> None:
    """One image through the PD-separated ensemble: root -> ensemble -> 3 steps, each
    with queue / compute (input, infer, output) and the python steps' worker hop."""
    images = np.load(GOLDENS / "image_classifier.npz")
    raw = images["image_bytes_coffee"].tobytes()
    client = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("input_image_bytes", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[raw]], dtype=object), binary_data=True)
    result = client.infer(
        "image_classifier", [inp], request_id="img-1", headers={"traceparent": TRACEPARENT}
    )
    assert result.as_numpy("top5_labels").shape == (1, 5)

    spans = receiver.wait_for(
        lambda s: any(x.name == "InferRequest" for x in s if x.trace_id == CLIENT_TRACE)
    )
    spans = receiver.trace(CLIENT_TRACE)
    root = _one(spans, "InferRequest")
    assert root.parent_id == CLIENT_SPAN  # joins the client's trace
    assert root.resource["service.name"] == "pdserve"
    assert root.attrs["triton.model_name"] == "image_classifier"
    assert root.attrs["triton.request_id"] == "img-1"
    (ens,) = _children(spans, root)
    assert ens.name == "image_classifier"
    assert ens.attrs["triton.model_name"] == "image_classifier"
    assert ens.attrs["triton.model_version"] == 1
    assert ens.attrs["pdserve.batch_size"] == 1
    _inside(ens, root)
    steps = _children(spans, ens)
    assert [s.name for s in steps] == ["preprocess", "efficientnet_lite0", "postprocess"]
    for i, step in enumerate(steps):
        _inside(step, ens)
        assert step.attrs["pdserve.ensemble_step"] == i
        assert step.attrs["pdserve.ensemble"] == "image_classifier"
        assert step.attrs["triton.model_version"] == 1
        assert step.attrs["pdserve.batch_size"] == 1
        _check_model_span(spans, step, python=step.name != "efficientnet_lite0")
    # steps run one after the other and fit in the ensemble span
    assert steps[0].end <= steps[1].start and steps[1].end <= steps[2].start
    assert sum(s.duration for s in steps) <= ens.duration
    assert all(s.status_code == 0 for s in spans)


def test_bls_spans_and_python_trace_context(server: ServerProcess, receiver: Receiver) -> None:
    """request.trace().get_context() names the worker's execute span; a BLS call with
    trace=request.trace() adds a bls span and the target's model span under it."""
    client = httpclient.InferenceServerClient(server.http_url)
    a = np.arange(4, dtype=np.float32)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        t = httpclient.InferInput(name, [4], "FP32")
        t.set_data_from_numpy(a)
        inputs.append(t)
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    result = client.infer(
        "bls_traced", inputs, headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
    context = json.loads(result.as_numpy("CONTEXT")[0].decode())
    receiver.wait_for(lambda s: any(x.name == "InferRequest" and x.trace_id == trace_id for x in s))
    spans = receiver.trace(trace_id)
    root = _one(spans, "InferRequest")
    (model,) = _children(spans, root)
    assert model.name == "bls_traced"
    _check_model_span(spans, model, python=True)
    bls = _one(spans, "bls")
    (execute,) = [s for s in spans if s.name == "execute" and s.span_id == bls.parent_id]
    assert _is_below(spans, execute, model)
    assert context == {"traceparent": f"00-{trace_id}-{execute.span_id}-01"}
    assert bls.attrs["pdserve.bls_model"] == "add_sub"
    _inside(bls, execute)
    (target,) = _children(spans, bls)
    assert target.name == "add_sub"
    _inside(target, bls)
    _check_model_span(spans, target, python=True)


def test_untraced_python_request_has_no_context(server: ServerProcess, receiver: Receiver) -> None:
    """With rate=1 every request is traced; after level OFF none is, and a python
    model's get_context() is None (CONTEXT empty)."""
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        client.update_trace_settings(settings={"trace_level": ["OFF"]})
        a = np.ones(4, dtype=np.float32)
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            t = httpclient.InferInput(name, [4], "FP32")
            t.set_data_from_numpy(a)
            inputs.append(t)
        result = client.infer("bls_traced", inputs)
        assert result.as_numpy("CONTEXT")[0] == b""
    finally:
        client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})


def test_grpc_metadata_traceparent(server: ServerProcess, receiver: Receiver) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    x = np.ones((1, 64), dtype=np.float32)
    t = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    t.set_data_from_numpy(x)
    trace_id = "1234567890abcdef1234567890abcdef"
    client.infer("tiny", [t], headers={"traceparent": f"00-{trace_id}-1111111111111111-01"})
    receiver.wait_for(lambda s: any(x.name == "InferRequest" and x.trace_id == trace_id for x in s))
    spans = receiver.trace(trace_id)
    root = _one(spans, "InferRequest")
    assert root.parent_id == "1111111111111111"
    (model,) = _children(spans, root)
    assert model.name == "tiny"
    _check_model_span(spans, model, python=False)


def test_python_model_adds_its_own_span(server: ServerProcess, receiver: Receiver) -> None:
    """A python model opens its own OpenTelemetry span with the context of
    request.trace().get_context(): it lands under pdserve's execute span."""
    client = httpclient.InferenceServerClient(server.http_url)
    t = httpclient.InferInput("INPUT0", [4], "FP32")
    t.set_data_from_numpy(np.arange(4, dtype=np.float32))
    trace_id = "5b8efff798038103d269b633813fc60c"
    result = client.infer(
        "custom_span",
        [t],
        parameters={"otlp_url": receiver.url},
        headers={"traceparent": f"00-{trace_id}-eee19b7ec3c1b174-01"},
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(4) * 2)
    receiver.wait_for(
        lambda s: (
            {"InferRequest", "model_own_step"} <= {x.name for x in s if x.trace_id == trace_id}
        )
    )
    spans = receiver.trace(trace_id)
    own = _one(spans, "model_own_step")
    execute = _one(spans, "execute")
    assert own.parent_id == execute.span_id
    assert own.resource["service.name"] == "custom_span"
    assert own.attrs["rows"] == 4
    _inside(own, execute)


def test_response_cache_lookup_span(server: ServerProcess, receiver: Receiver) -> None:
    """A cache miss runs the model (queue, compute); a hit has only the lookup."""
    client = httpclient.InferenceServerClient(server.http_url)
    t = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    t.set_data_from_numpy(np.full((1, 64), 0.25, dtype=np.float32))
    ids = []
    for i in range(2):
        trace_id = f"{i + 1:032x}"
        ids.append(trace_id)
        client.infer("tiny_cached", [t], headers={"traceparent": f"00-{trace_id}-{i + 1:016x}-01"})
    receiver.wait_for(
        lambda s: all(any(x.name == "InferRequest" and x.trace_id == t for x in s) for t in ids)
    )
    miss, hit = (receiver.trace(t) for t in ids)
    for spans, was_hit in ((miss, False), (hit, True)):
        model = _one(spans, "tiny_cached")
        lookup = _one(spans, "cache_lookup")
        assert lookup.parent_id == model.span_id
        assert lookup.attrs["pdserve.cache_hit"] is was_hit
        _inside(lookup, model)
        assert any(s.name == "compute" for s in spans) is not was_hit


@pytest.mark.parametrize(
    "header",
    [
        "garbage",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero parent id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",  # short trace id
    ],
)
def test_malformed_traceparent_is_ignored(
    server: ServerProcess, receiver: Receiver, header: str
) -> None:
    """W3C: a malformed traceparent is ignored: the request succeeds and is traced as a
    new trace (rate=1), with a root span that has no parent."""
    client = httpclient.InferenceServerClient(server.http_url)
    x = np.full((1, 64), 0.5, dtype=np.float32)
    t = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    t.set_data_from_numpy(x)
    rid = f"bad-tp-{abs(hash(header))}"
    result = client.infer("tiny", [t], request_id=rid, headers={"traceparent": header})
    assert result.as_numpy("OUTPUT0").shape == (1, 64)
    spans = receiver.wait_for(
        lambda s: any(
            x.attrs.get("triton.request_id") == rid and x.name == "InferRequest" for x in s
        )
    )
    root = next(
        s for s in spans if s.attrs.get("triton.request_id") == rid and s.name == "InferRequest"
    )
    assert root.parent_id == ""
    assert root.trace_id not in ("4bf92f3577b34da6a3ce929d0e0e4736", "0" * 32)
    assert len(receiver.trace(root.trace_id)) >= 6  # root, model, queue, compute x4


# --------------------------------------------------------------------------- trace extension


def _post(url: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_trace_setting_get_post_model_override_and_clear(server: ServerProcess) -> None:
    base = f"http://{server.http_url}/v2"
    status, doc = _get(f"{base}/trace/setting")
    assert status == 200
    assert doc["trace_level"] == ["TIMESTAMPS"]
    assert doc["trace_rate"] == "1" and doc["trace_count"] == "-1"
    assert doc["log_frequency"] == "0" and doc["trace_mode"] == "opentelemetry"
    assert doc["url"].endswith("/v1/traces") and doc["bsp_schedule_delay"] == "50"
    # a model setting overrides the global one field by field
    status, doc = _post(f"{base}/models/tiny/trace/setting", {"trace_rate": "7"})
    assert status == 200 and doc["trace_rate"] == "7" and doc["trace_level"] == ["TIMESTAMPS"]
    # a global update reaches the fields the model does not set
    status, doc = _post(f"{base}/trace/setting", {"trace_count": "50", "log_frequency": "3"})
    assert status == 200 and doc["trace_count"] == "50" and doc["log_frequency"] == "3"
    status, doc = _get(f"{base}/models/tiny/trace/setting")
    assert (doc["trace_rate"], doc["trace_count"], doc["log_frequency"]) == ("7", "50", "3")
    status, doc = _get(f"{base}/models/image_classifier/trace/setting")
    assert doc["trace_rate"] == "1"
    # null clears: the model follows the global rate again; the global count its startup value
    status, doc = _post(f"{base}/models/tiny/trace/setting", {"trace_rate": None})
    assert status == 200 and doc["trace_rate"] == "1"
    status, doc = _post(f"{base}/trace/setting", {"trace_count": None, "log_frequency": None})
    assert status == 200 and doc["trace_count"] == "-1" and doc["log_frequency"] == "0"
    # tritonclient's own calls
    client = httpclient.InferenceServerClient(server.http_url)
    got = client.update_trace_settings("tiny", {"trace_level": ["TIMESTAMPS", "TENSORS"]})
    assert got["trace_level"] == ["TIMESTAMPS", "TENSORS"]
    assert client.get_trace_settings()["trace_level"] == ["TIMESTAMPS"]
    client.update_trace_settings("tiny", {"trace_level": None})


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"trace_rate": "abc"}, 400, "Unable to parse 'trace_rate', got: abc"),
        ({"trace_rate": "4294967296"}, 400, "value is out of range [ 0, 4294967295 ]"),
        ({"trace_count": "-2"}, 400, "Expecting value >= -1, got: -2"),
        ({"log_frequency": "-1"}, 400, "Unable to parse 'log_frequency', value is out of range"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, 400, "Expect only one trace level 'OFF'"),
        ({"trace_level": ["LOUD"]}, 400, "unknown trace level 'LOUD'"),
        ({"trace_rate": 5}, 400, "must be a string"),
        ({"trace_rate": "0"}, 400, "invalid trace setting: sample rate must be non-zero"),
        ({"trace_file": "/tmp/x"}, 501, "trace file location can not be updated"),
        ({"trace_mode": "triton"}, 400, "unknown trace setting 'trace_mode'"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b"{not json", 400, "failed to parse"),
    ],
)
def test_trace_setting_bad_values(
    server: ServerProcess, body: Any, status: int, message: str
) -> None:
    base = f"http://{server.http_url}/v2"
    before = _get(f"{base}/trace/setting")[1]
    got, doc = _post(f"{base}/trace/setting", body)
    assert got == status, doc
    assert message in doc["error"], doc
    assert _get(f"{base}/trace/setting")[1] == before  # nothing changed


def test_trace_setting_unknown_model_and_method(server: ServerProcess) -> None:
    base = f"http://{server.http_url}/v2"
    status, doc = _get(f"{base}/models/nope/trace/setting")
    assert status == 400 and doc["error"] == "Request for unknown model : nope"
    req = urllib.request.Request(f"{base}/trace/setting", method="DELETE")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 405


def test_grpc_trace_setting(server: ServerProcess) -> None:
    channel = grpc.insecure_channel(server.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    resp = stub.TraceSetting(service_pb2.TraceSettingRequest())
    assert list(resp.settings["trace_level"].value) == ["TIMESTAMPS"]
    assert list(resp.settings["trace_rate"].value) == ["1"]
    req = service_pb2.TraceSettingRequest(model_name="tiny")
    req.settings["trace_rate"].value.append("9")
    resp = stub.TraceSetting(req)
    assert list(resp.settings["trace_rate"].value) == ["9"]
    req = service_pb2.TraceSettingRequest(model_name="tiny")
    req.settings["trace_rate"].SetInParent()  # an empty value list clears
    resp = stub.TraceSetting(req)
    assert list(resp.settings["trace_rate"].value) == ["1"]
    bad = service_pb2.TraceSettingRequest()
    bad.settings["trace_rate"].value.extend(["1", "2"])
    with pytest.raises(grpc.RpcError) as e:
        stub.TraceSetting(bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "expect only 1 value for 'trace_rate'" in e.value.details()
    bad = service_pb2.TraceSettingRequest(model_name="nope")
    with pytest.raises(grpc.RpcError) as e:
        stub.TraceSetting(bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got = client.get_trace_settings(as_json=True)
    assert got["settings"]["trace_mode"]["value"] == ["opentelemetry"]
    channel.close()


def test_trace_count_and_rate(repo: Path, tmp_path: Path) -> None:
    """rate=2 traces every 2nd request; count=3 stops after 3 traces (GET shows 0)."""
    rec = Receiver()
    srv = start_server(
        repo,
        tmp_path / "log",
        *trace_flags(rec.url, "rate=2", "count=3"),
        "--load-model",
        "tiny",
        "--model-control-mode",
        "explicit",
    )
    try:
        client = httpclient.InferenceServerClient(srv.http_url)
        t = httpclient.InferInput("INPUT0", [1, 64], "FP32")
        t.set_data_from_numpy(np.ones((1, 64), dtype=np.float32))
        for i in range(10):
            client.infer("tiny", [t], request_id=f"r{i}")
        spans = rec.wait_for(lambda s: sum(x.name == "InferRequest" for x in s) >= 3)
        time.sleep(0.5)
        roots = sorted(x.attrs["triton.request_id"] for x in rec.spans if x.name == "InferRequest")
        assert roots == ["r1", "r3", "r5"]
        assert client.get_trace_settings()["trace_count"] == "0"
        del spans
    finally:
        srv.stop()
        rec.close()


# --------------------------------------------------------------------------- export metrics


def _trace_metrics(srv: ServerProcess) -> dict[str, float]:
    """The ``pdserve_trace_spans_*`` samples of ``/metrics`` (name{labels} -> value)."""
    url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve_trace_spans_"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_export_metrics_count_what_the_collector_got(
    server: ServerProcess, receiver: Receiver
) -> None:
    """pdserve_trace_spans_exported_total is the number of pdserve's spans the collector
    received; nothing dropped while the collector answers."""
    client = httpclient.InferenceServerClient(server.http_url)
    t = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    t.set_data_from_numpy(np.ones((1, 64), dtype=np.float32))
    client.infer("tiny", [t], headers={"traceparent": TRACEPARENT})
    receiver.wait_for(lambda spans: any(s.trace_id == CLIENT_TRACE for s in spans))
    deadline = time.monotonic() + 20
    while True:
        with receiver.lock:  # a python model's own spans come from its own exporter
            got = sum(1 for s in receiver.spans if s.resource.get("service.name") == "pdserve")
        m = _trace_metrics(server)
        if m["pdserve_trace_spans_exported_total"] == got or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert m == {
        "pdserve_trace_spans_exported_total": got,
        'pdserve_trace_spans_dropped_total{reason="queue_full"}': 0,
        'pdserve_trace_spans_dropped_total{reason="export_failed"}': 0,
    }
    assert got >= 7


# --------------------------------------------------------------------------- a bad endpoint


def _tiny_latencies(srv: ServerProcess, n: int) -> list[float]:
    client = httpclient.InferenceServerClient(srv.http_url)
    t = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    t.set_data_from_numpy(np.ones((1, 64), dtype=np.float32))
    out = []
    for _ in range(n):
        start = time.perf_counter()
        client.infer("tiny", [t])
        out.append(time.perf_counter() - start)
    return out


def test_endpoint_down_never_fails_requests(repo: Path, tmp_path: Path) -> None:
    """Nothing listens at the OTLP url: every request succeeds, the drops are counted."""
    url = f"http://127.0.0.1:{free_port()}/v1/traces"
    srv = start_server(
        repo,
        tmp_path / "log",
        *trace_flags(url, "opentelemetry,export_timeout=500"),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "tiny",
    )
    try:
        lat = _tiny_latencies(srv, 200)
        assert max(lat) < 2.0, max(lat)
        time.sleep(1.5)
        m = _trace_metrics(srv)
        assert m["pdserve_trace_spans_exported_total"] == 0
        assert m['pdserve_trace_spans_dropped_total{reason="export_failed"}'] >= 200 * 6 - 200
    finally:
        assert srv.stop() == 0
    log = srv.log()
    assert "spans dropped" in log
    line = [x for x in log.splitlines() if "spans exported in" in x][-1]
    assert " 0 spans exported" in line and "failed exports" in line
    dropped = int(line.split(" dropped")[0].rsplit(" ", 1)[1])
    assert dropped >= 200 * 6 - 100, line  # ~6 spans per request, nearly all lost


def test_slow_endpoint_never_slows_requests(repo: Path, tmp_path: Path) -> None:
    """A collector that takes 3 s per export: requests keep their latency, the bounded
    queue drops what does not fit, and the drops are counted."""
    rec = Receiver(delay=3.0)
    srv = start_server(
        repo,
        tmp_path / "log",
        *trace_flags(
            rec.url,
            "opentelemetry,bsp_max_queue_size=60",
            "opentelemetry,bsp_max_export_batch_size=30",
        ),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "tiny",
    )
    try:
        lat = _tiny_latencies(srv, 300)
        assert sorted(lat)[len(lat) // 2] < 0.05, sorted(lat)[len(lat) // 2]
        assert max(lat) < 2.0
    finally:
        srv.stop()
        rec.close()
    log = srv.log()
    assert "spans dropped" in log
    line = [x for x in log.splitlines() if "spans exported in" in x][-1]
    dropped = int(line.split(" dropped")[0].rsplit(" ", 1)[1])
    assert dropped > 300 * 6 - 200, line


def test_start_error_without_the_extra(repo: Path, tmp_path: Path) -> None:
    """Tracing asked for, OpenTelemetry not importable: a start error naming the flag."""
    fake = tmp_path / "shadow" / "opentelemetry"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no opentelemetry here')\n")
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(fake.parent))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "serve",
            "--model-repository",
            str(repo),
            "--http-port",
            str(free_port()),
            "--no-allow-grpc",
            "--no-allow-metrics",
            "--trace-config",
            "level=TIMESTAMPS",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "--trace-config level=TIMESTAMPS" in proc.stderr
    assert "pdserve[tracing]" in proc.stderr


def test_bad_trace_config_flag(repo: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "serve",
            "--model-repository",
            str(repo),
            "--trace-config",
            "rate=often",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "argument --trace-config: 'rate' must be an integer, got 'often'" in proc.stderr


REMOTE_TINY = """\
name: "tiny_remote"
backend: "remote"
max_batch_size: 128
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 64 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 64 ] } ]
parameters { key: "url" value: { string_value: "%s" } }
parameters { key: "protocol" value: { string_value: "%s" } }
parameters { key: "model_name" value: { string_value: "tiny" } }
"""


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_remote_call_is_a_span_the_target_continues(
    server: ServerProcess, receiver: Receiver, tmp_path: Path, protocol: str
) -> None:
    """A transformer's remote model sends its call's traceparent: the predictor's root
    span is a child of the transformer's ``remote_infer`` span, in one trace."""
    target = server.http_url if protocol == "http" else server.grpc_url
    (tmp_path / "repo" / "tiny_remote" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "tiny_remote" / "config.pbtxt").write_text(
        REMOTE_TINY % (target, protocol)
    )
    front = start_server(tmp_path / "repo", tmp_path / "front.log", *trace_flags(receiver.url))
    try:
        client = httpclient.InferenceServerClient(front.http_url)
        t = httpclient.InferInput("INPUT0", [1, 64], "FP32")
        t.set_data_from_numpy(np.ones((1, 64), dtype=np.float32))
        trace_id = ("ab" if protocol == "http" else "cd") * 16
        client.infer(
            "tiny_remote", [t], headers={"traceparent": f"00-{trace_id}-2222222222222222-01"}
        )
        receiver.wait_for(
            lambda s: sum(x.name == "InferRequest" and x.trace_id == trace_id for x in s) == 2
        )
    finally:
        front.stop()
    spans = receiver.trace(trace_id)
    remote = _one(spans, "remote_infer")
    assert remote.attrs["pdserve.remote_target"].endswith(target)
    roots = sorted((s for s in spans if s.name == "InferRequest"), key=lambda s: s.start)
    assert roots[0].parent_id == "2222222222222222"  # the transformer's, under the client
    assert roots[1].parent_id == remote.span_id  # the predictor's, under the remote call
    assert _is_below(spans, remote, roots[0])
    _inside(roots[1], remote)
