"""Trace settings, sampling and traceparent parsing (pdserve.observability.tracing,
pdserve.core.tracing): Triton's --trace-config and trace-extension semantics."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.core import context
from pdserve.core import tracing as core_tracing
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.tracing import Trace, parse_traceparent
from pdserve.core.types import InferRequest
from pdserve.observability.span_export import ExportCounts
from pdserve.observability.trace_config import TraceConfig, TraceConfigError, parse_trace_config
from pdserve.observability.tracing import TraceManager, parse_setting_update


@pytest.fixture(autouse=True)
def _reset_tracing() -> Any:
    """TraceManager sets module-wide state: leave it as found."""
    yield
    core_tracing.state.enabled = False
    core_tracing.active.clear()
    context.trace_id.set(None)


# -- W3C traceparent -------------------------------------------------------------------


def test_traceparent_valid() -> None:
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert parse_traceparent(tp) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1)
    assert parse_traceparent(tp.encode()) == parse_traceparent(tp)
    # a future version may carry more fields
    assert parse_traceparent("01-" + tp[3:] + "-more") is not None


@pytest.mark.parametrize(
    "value",
    [
        "",
        "nonsense",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        b"\xff\xfe",
    ],
)
def test_traceparent_malformed(value: Any) -> None:
    assert parse_traceparent(value) is None


def test_trace_ids_and_traceparent() -> None:
    t = Trace()
    assert len(t.trace_id) == 32 and int(t.trace_id, 16)
    sid = t.add("x", "", 1, 2)
    assert len(sid) == 16 and t.spans[0].span_id == sid
    assert t.traceparent(sid) == f"00-{t.trace_id}-{sid}-01"
    t.closed = True
    t.add("late", sid, 3, 4)
    assert len(t.spans) == 1


# -- --trace-config ----------------------------------------------------------------------


def test_trace_config_defaults_and_triton_forms() -> None:
    assert parse_trace_config([]) == TraceConfig()
    c = parse_trace_config(
        [
            "rate=100",
            "level=TIMESTAMPS",
            "level=tensors",
            "count=5",
            "mode=opentelemetry",
            "opentelemetry,url=http://collector:4318/v1/traces",
            "opentelemetry,resource=service.name=edge",
            "opentelemetry,resource=deployment=prod",
            "opentelemetry,bsp_schedule_delay=50",
            "opentelemetry,bsp_max_queue_size=100",
            "opentelemetry,bsp_max_export_batch_size=10",
            "triton,log-frequency=7",
        ]
    )
    assert c.rate == 100 and c.count == 5 and c.log_frequency == 7
    assert c.level == ("TIMESTAMPS", "TENSORS") and c.enabled
    assert c.url == "http://collector:4318/v1/traces"
    assert c.resource_attributes() == {"service.name": "edge", "deployment": "prod"}
    assert (c.bsp_schedule_delay_ms, c.bsp_max_queue_size, c.bsp_max_export_batch_size) == (
        50,
        100,
        10,
    )
    assert parse_trace_config(["level=OFF"]).level == ("OFF",)
    assert parse_trace_config(["level=on"]).level == ("TIMESTAMPS",)  # Triton's synonym


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("rate", "option format is"),
        ("rate=", "option format is"),
        (",rate=1", "No trace mode specified"),
        ("rate=x", "'rate' must be an integer, got 'x'"),
        ("rate=-1", "'rate' must be in [0, 4294967295]"),
        ("count=-2", "'count' must be in [-1,"),
        ("level=loud", "invalid value for trace level option: loud"),
        ("mode=zipkin", "invalid value for trace mode option: zipkin"),
        ("mode=triton", "mode=triton (Triton's JSON trace file) is not supported"),
        ("triton,file=/tmp/t.json", "Triton's JSON trace file is not supported"),
        ("jaeger,url=x", "invalid value for trace mode option: jaeger"),
        ("speed=1", "unknown global trace setting 'speed'"),
        ("opentelemetry,port=1", "unknown opentelemetry trace setting 'port'"),
        ("opentelemetry,resource=novalue", "must be <key>=<value>"),
        ("opentelemetry,bsp_max_queue_size=0", "must be in [1,"),
    ],
)
def test_trace_config_errors(option: str, message: str) -> None:
    with pytest.raises(TraceConfigError) as e:
        parse_trace_config([option])
    assert message in str(e.value)


def test_trace_config_batch_larger_than_queue() -> None:
    with pytest.raises(TraceConfigError, match="bsp_max_export_batch_size must be <="):
        parse_trace_config(
            ["opentelemetry,bsp_max_queue_size=10", "opentelemetry,bsp_max_export_batch_size=11"]
        )


# -- trace-setting updates -----------------------------------------------------------------


def test_update_parsing() -> None:
    assert parse_setting_update(
        {"trace_level": ["TENSORS", "TIMESTAMPS"], "trace_rate": "10", "trace_count": None}
    ) == {"trace_level": ("TIMESTAMPS", "TENSORS"), "trace_rate": 10, "trace_count": None}
    assert parse_setting_update({"trace_rate": []}) == {"trace_rate": None}  # gRPC clear
    assert parse_setting_update({"trace_level": "OFF"}) == {"trace_level": ("OFF",)}


@pytest.mark.parametrize(
    ("changes", "code", "message"),
    [
        ({"trace_file": "x"}, ErrorCode.UNSUPPORTED, "trace file location can not be updated"),
        ({"trace_rate": "ten"}, ErrorCode.INVALID_ARG, "Unable to parse 'trace_rate', got: ten"),
        ({"trace_rate": ["1", "2"]}, ErrorCode.INVALID_ARG, "expect only 1 value for 'trace_rate'"),
        ({"trace_count": "-5"}, ErrorCode.INVALID_ARG, "Expecting value >= -1, got: -5"),
        ({"trace_count": "2147483648"}, ErrorCode.INVALID_ARG, "out of range [ -1, 2147483647 ]"),
        ({"trace_level": ["OFF", "TENSORS"]}, ErrorCode.INVALID_ARG, "only one trace level 'OFF'"),
        ({"trace_level": [1]}, ErrorCode.INVALID_ARG, "must be a string"),
        ({"bogus": "1"}, ErrorCode.INVALID_ARG, "unknown trace setting 'bogus'"),
    ],
)
def test_update_errors(changes: dict[str, Any], code: ErrorCode, message: str) -> None:
    with pytest.raises(InferError) as e:
        parse_setting_update(changes)
    assert e.value.code is code
    assert message in e.value.message


class _Sink:
    def __init__(self) -> None:
        self.traces: list[Trace] = []

    def submit(self, trace: Trace) -> None:
        self.traces.append(trace)


def _manager(*options: str) -> tuple[TraceManager, _Sink]:
    sink = _Sink()
    return TraceManager(parse_trace_config(options), export=sink), sink


def test_model_setting_overrides_and_follows_global() -> None:
    m, _ = _manager("level=TIMESTAMPS", "rate=10")
    assert m.get_setting()["trace_rate"] == "10"
    got = m.update_setting("a", {"trace_rate": "3"})
    assert got["trace_rate"] == "3" and got["trace_level"] == ["TIMESTAMPS"]
    m.update_setting("", {"trace_count": "9", "trace_rate": "20"})
    a = m.get_setting("a")
    assert (a["trace_rate"], a["trace_count"]) == ("3", "9")  # count follows the global
    assert m.get_setting("b")["trace_rate"] == "20"
    # clearing the only field a model sets removes its setting
    assert m.update_setting("a", {"trace_rate": None})["trace_rate"] == "20"
    assert "a" not in m._models
    # clearing a global field returns to the startup value
    assert m.update_setting("", {"trace_rate": None})["trace_rate"] == "10"


def test_invalid_settings_are_refused_unchanged() -> None:
    m, _ = _manager("level=TIMESTAMPS")
    with pytest.raises(InferError, match="sample rate must be non-zero"):
        m.update_setting("", {"trace_rate": "0"})
    with pytest.raises(InferError, match="trace count is 0"):
        m.update_setting("", {"trace_count": "0"})
    assert m.get_setting()["trace_rate"] == "1000"
    # turning tracing off is always allowed, even with rate 0
    assert m.update_setting("", {"trace_level": ["OFF"], "trace_rate": "0"})["trace_rate"] == "0"


def _req(model: str = "m", traceparent: str | None = None) -> InferRequest:
    return InferRequest(model_name=model, traceparent=traceparent)


def test_sampling_rate_count_and_state() -> None:
    m, sink = _manager("level=TIMESTAMPS", "rate=3", "count=2")
    assert core_tracing.state.enabled
    picked = []
    for i in range(12):
        r = _req()
        ref = m.begin(r)
        if ref is not None:
            picked.append(i)
            m.end(r, ref)
    assert picked == [2, 5]  # every 3rd request, 2 traces in all
    assert m.get_setting()["trace_count"] == "0"
    assert len(sink.traces) == 2
    root = sink.traces[0].spans[-1]
    assert root.name == "InferRequest" and root.parent_id == ""
    m.update_setting("", {"trace_level": ["OFF"]})
    assert not core_tracing.state.enabled


def test_propagated_context_always_traced_while_level_on() -> None:
    m, sink = _manager("level=TIMESTAMPS", "rate=0")
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert m.begin(_req()) is None  # rate 0: only propagated contexts
    r = _req(traceparent=tp)
    ref = m.begin(r)
    assert ref is not None and ref.trace.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert context.trace_id.get() == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert core_tracing.active[ref.trace.trace_id] is ref.trace
    m.end(r, ref, error="boom")
    assert ref.trace.trace_id not in core_tracing.active
    root = sink.traces[0].spans[-1]
    assert root.parent_id == "00f067aa0ba902b7" and root.attributes is not None
    assert root.attributes["pdserve.error"] == "boom"
    # a malformed traceparent is ignored: sampled as a request without one
    assert m.begin(_req(traceparent="00-bad")) is None
    # level OFF: not traced, but the log trace id is the client's
    m.update_setting("", {"trace_level": ["OFF"]})
    context.trace_id.set(None)
    assert m.begin(_req(traceparent=tp)) is None
    assert context.trace_id.get() == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_model_setting_decides_sampling() -> None:
    m, _ = _manager()  # level OFF globally
    assert m.begin(_req("a")) is None
    m.update_setting("a", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    assert core_tracing.state.enabled
    assert m.begin(_req("a")) is not None
    assert m.begin(_req("b")) is None
    m.update_setting("a", {"trace_level": None, "trace_rate": None})
    assert not core_tracing.state.enabled


# -- OTLP encoding -------------------------------------------------------------------------


def test_otlp_encoding_decodes_with_opentelemetry_proto() -> None:
    """The export request, serialized and read back with opentelemetry-proto."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from pdserve.observability.otlp import SpanConverter

    t = Trace("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
    root = t.add("InferRequest", "00f067aa0ba902b7", 1_000, 9_000, {"triton.model_name": "m"})
    t.add(
        "m",
        root,
        2_000,
        8_000,
        {"triton.model_version": 3, "ok": True, "ratio": 0.5, "pdserve.error": "it broke"},
    )
    conv = SpanConverter({"service.name": "pdserve", "zone": "a"})
    message, n = conv.request([(t, 10**18), (t, 10**18)])
    assert n == 4
    data = message.SerializeToString()
    msg = ExportTraceServiceRequest()
    msg.ParseFromString(data)
    (rs,) = msg.resource_spans
    assert {kv.key: kv.value.string_value for kv in rs.resource.attributes} == {
        "service.name": "pdserve",
        "zone": "a",
    }
    (ss,) = rs.scope_spans
    assert ss.scope.name == "pdserve"
    assert len(ss.spans) == 4
    r, m = ss.spans[0], ss.spans[1]
    assert r.trace_id.hex() == t.trace_id and r.span_id.hex() == root
    assert r.parent_span_id.hex() == "00f067aa0ba902b7"
    assert r.kind == 2 and m.kind == 1  # SERVER (remote parent), INTERNAL
    assert r.flags == 0x301 and m.flags == 0x101
    assert (r.start_time_unix_nano, r.end_time_unix_nano) == (10**18 + 1_000, 10**18 + 9_000)
    assert m.name == "m" and m.parent_span_id.hex() == root
    attrs = {kv.key: kv.value for kv in m.attributes}
    assert attrs["triton.model_version"].int_value == 3
    assert attrs["ok"].bool_value is True and attrs["ratio"].double_value == 0.5
    assert m.status.code == 2 and m.status.message == "it broke"
    assert r.status.code == 0


def test_log_trace_id_follows_each_request() -> None:
    m, _ = _manager("level=TIMESTAMPS", "rate=2")
    ref = None
    while ref is None:
        ref = m.begin(_req())
    assert context.trace_id.get() == ref.trace.trace_id
    assert m.begin(_req()) is None  # the next one is not sampled: no stale trace id
    assert context.trace_id.get() is None


# -- OTLP/HTTP post and the export counters --------------------------------------------


class _Collector:
    """A loopback OTLP/HTTP endpoint recording each post; answers ``status``."""

    def __init__(self, status: int = 200) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.posts: list[tuple[dict[str, str], bytes]] = []
        self.status = status
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                collector.posts.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(collector.status)
                self.send_header("Content-Length", "4")
                self.end_headers()
                self.wfile.write(b"nope")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_otlp_sender_headers_compression_and_errors() -> None:
    """OTEL_EXPORTER_OTLP_TRACES_* win over OTEL_EXPORTER_OTLP_*; headers are URL-decoded
    (the W3C-baggage-like format); gzip bodies; a non-2xx answer is a failure."""
    import gzip

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from pdserve.observability.otlp import OtlpHttpSender, SpanConverter

    collector = _Collector()
    try:
        env = {
            "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=generic,x-shared=yes",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "Authorization=Bearer%20abc,x-tenant=t1",
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
        }
        sender = OtlpHttpSender(collector.url, 5.0, env)
        t = Trace()
        t.add("InferRequest", "", 1_000, 2_000, {"triton.model_name": "m"})
        message, n = SpanConverter({"service.name": "pdserve"}).request([(t, 0)])
        assert sender.post(message.SerializeToString()) == ""
        ((headers, body),) = collector.posts
        assert headers["authorization"] == "Bearer abc"
        assert headers["x-tenant"] == "t1" and "x-shared" not in headers
        assert headers["content-type"] == "application/x-protobuf"
        assert headers["content-encoding"] == "gzip"
        got = ExportTraceServiceRequest()
        got.ParseFromString(gzip.decompress(body))
        assert got == message and n == 1
        collector.status = 503
        assert sender.post(b"") == "HTTP 503: nope"
        sender.close()
        plain = OtlpHttpSender(collector.url, 5.0, {"OTEL_EXPORTER_OTLP_HEADERS": "a=1"})
        assert plain.post(b"x") == "HTTP 503: nope"
        headers, body = collector.posts[-1]
        assert body == b"x" and headers["a"] == "1" and "content-encoding" not in headers
        plain.close()
    finally:
        collector.close()
    with pytest.raises(ValueError, match="gzip or none, got 'zstd'"):
        OtlpHttpSender(collector.url, 5.0, {"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"})


def _metric_lines(m: TraceManager) -> set[str]:
    from pdserve.observability.metrics import sample_families

    text = "".join(f.render() for f in sample_families(m.samples()))
    return {line for line in text.splitlines() if not line.startswith("#")}


def test_export_counts_dropped_is_both_reasons() -> None:
    assert ExportCounts(dropped_queue_full=4, dropped_failed=8).dropped == 12
    assert ExportCounts().dropped == 0


def test_export_counters_exported_failed_and_queue_full() -> None:
    """pdserve_trace_spans_exported_total / _dropped_total{reason} follow what the
    export did: accepted posts, refused posts, spans beyond the queue bound."""
    assert _metric_lines(TraceManager(TraceConfig())) == {
        "pdserve_trace_spans_exported_total 0",
        'pdserve_trace_spans_dropped_total{reason="queue_full"} 0',
        'pdserve_trace_spans_dropped_total{reason="export_failed"} 0',
    }
    collector = _Collector()
    m = TraceManager(
        parse_trace_config(
            [
                "level=TIMESTAMPS",
                "rate=1",
                f"opentelemetry,url={collector.url}",
                "opentelemetry,bsp_schedule_delay=60000",
                "opentelemetry,bsp_max_queue_size=10",
                "opentelemetry,bsp_max_export_batch_size=10",
            ]
        )
    )
    try:
        m.start()

        def traced(n_spans: int) -> None:
            ref = m.begin(_req())
            assert ref is not None
            for i in range(n_spans - 1):
                ref.trace.add(f"s{i}", ref.parent_id, 1, 2)
            m.end(_req(), ref)

        traced(3)
        traced(3)
        m.export.flush(10.0)
        assert len(collector.posts) == 1
        collector.status = 500
        traced(4)
        traced(4)
        traced(4)  # 12 > the 10-span queue: dropped whole
        m.export.flush(10.0)
        assert len(collector.posts) == 2
        assert _metric_lines(m) == {
            "pdserve_trace_spans_exported_total 6",
            'pdserve_trace_spans_dropped_total{reason="queue_full"} 4',
            'pdserve_trace_spans_dropped_total{reason="export_failed"} 8',
        }
        assert m.export.counts.failures == ["HTTP 500: nope"]
    finally:
        m.stop(5.0)
        collector.close()
