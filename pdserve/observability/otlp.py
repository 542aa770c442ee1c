"""OpenTelemetry side of tracing: span records -> OTLP protobuf -> OTLP/HTTP.

Imported only when tracing is on (:func:`pdserve.observability.span_export.import_otel`);
it needs the ``tracing`` extra. Runs on the export thread, never on the event loop.
The spans keep the ids pdserve generated (:mod:`pdserve.core.tracing`), so a
``traceparent`` handed to a python worker or a BLS call names the exported span. They
are built directly as opentelemetry-proto messages (cheaper per span than the SDK's
``ReadableSpan`` and exporter) and posted as the OTLP/HTTP specification says
(:class:`OtlpHttpSender`, which lists the environment variables it honours).
"""

from __future__ import annotations

import gzip
import logging
import os
from collections.abc import Iterable, Mapping

import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Span, Status
from opentelemetry.util.re import parse_env_headers

from pdserve import __version__
from pdserve.core.tracing import Trace

log = logging.getLogger("pdserve.tracing")

_SERVER = Span.SpanKind.SPAN_KIND_SERVER
_INTERNAL = Span.SpanKind.SPAN_KIND_INTERNAL
_ERROR = Status.StatusCode.STATUS_CODE_ERROR
# Span.flags: the W3C trace flags (sampled) in bits 0-7; bit 8: whether the parent is
# remote is known, bit 9: it is remote (trace.proto, SpanFlags).
_FLAGS_LOCAL = 0x101
_FLAGS_REMOTE = 0x301


def _kv(key: str, value: object) -> KeyValue:
    """An OTLP attribute (str, bool, int or float value; anything else as its str)."""
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


class SpanConverter:
    """Builds OTLP ``ExportTraceServiceRequest`` messages of
    :class:`~pdserve.core.tracing.Trace` spans (opentelemetry-proto classes).

    Attribute messages, which repeat from span to span, are built once and cached.

    Args:
        resource: resource attributes (``service.name``...).
    """

    #: at most this many cached attribute messages
    CACHE = 4096

    def __init__(self, resource: Mapping[str, str]) -> None:
        self._resource = Resource(attributes=[_kv(k, v) for k, v in resource.items()])
        self._scope = InstrumentationScope(name="pdserve", version=__version__)
        self._attrs: dict[tuple[str, type, object], KeyValue] = {}

    def _attr(self, key: str, value: object) -> KeyValue:
        ck = (key, type(value), value)
        kv = self._attrs.get(ck)
        if kv is None:
            kv = _kv(key, value)
            if len(self._attrs) < self.CACHE:
                self._attrs[ck] = kv
        return kv

    def add_spans(self, scope_spans: ScopeSpans, trace: Trace, offset_ns: int) -> int:
        """Append the trace's spans to ``scope_spans.spans``; returns how many.

        Args:
            offset_ns: wall-clock minus monotonic time, ns (span times are monotonic).
        """
        trace_id = bytes.fromhex(trace.trace_id)
        remote = trace.remote_parent
        add = scope_spans.spans.add
        for rec in trace.spans:
            parent = rec.parent_id
            # field by field: ~10 % less CPU than add(**fields) (upb protobuf)
            span = add()
            span.trace_id = trace_id
            span.span_id = bytes.fromhex(rec.span_id)
            if parent:
                span.parent_span_id = bytes.fromhex(parent)
            span.name = rec.name
            # the root (no parent, or the client's span) serves the request
            span.kind = _SERVER if not parent or parent == remote else _INTERNAL
            span.start_time_unix_nano = rec.start_ns + offset_ns
            span.end_time_unix_nano = max(rec.end_ns, rec.start_ns) + offset_ns
            span.flags = _FLAGS_REMOTE if parent and parent == remote else _FLAGS_LOCAL
            attrs = rec.attributes
            if attrs:
                span.attributes.extend([self._attr(k, v) for k, v in attrs.items()])
                error = attrs.get("pdserve.error")
                if error is not None:
                    span.status.code = _ERROR
                    span.status.message = str(error)
        return len(trace.spans)

    def request(self, traces: Iterable[tuple[Trace, int]]) -> tuple[ExportTraceServiceRequest, int]:
        """One export request holding the spans of ``traces`` and its span count.

        Args:
            traces: ``(trace, offset_ns)`` pairs (see :meth:`add_spans`).
        """
        msg = ExportTraceServiceRequest()
        resource_spans = msg.resource_spans.add()
        resource_spans.resource.CopyFrom(self._resource)
        scope_spans = resource_spans.scope_spans.add()
        scope_spans.scope.CopyFrom(self._scope)
        n = 0
        for trace, offset_ns in traces:
            n += self.add_spans(scope_spans, trace, offset_ns)
        return msg, n


def parse_headers(value: str) -> dict[str, str]:
    """Headers from an ``OTEL_EXPORTER_OTLP_*HEADERS`` value: ``k1=v1,k2=v2``, keys and
    values URL-encoded (the W3C-baggage-like format of the OpenTelemetry specification,
    parsed by ``opentelemetry.util.re.parse_env_headers``; malformed entries are
    skipped with a warning). Keys are lower-cased."""
    return dict(parse_env_headers(value, liberal=True))


class OtlpHttpSender:
    """Posts serialized ``ExportTraceServiceRequest`` messages over OTLP/HTTP (protobuf).

    Honours, as the OpenTelemetry OTLP exporters do (the ``TRACES`` variable wins over
    the generic one): ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` / ``OTEL_EXPORTER_OTLP_HEADERS``
    (extra headers, e.g. ``authorization=Bearer%20abc``), ``..._COMPRESSION`` (``gzip``
    or ``none``, the default) and ``..._CERTIFICATE`` (a CA bundle for an ``https``
    endpoint). The endpoint itself is ``--trace-config opentelemetry,url=`` (Triton's
    setting), not ``OTEL_EXPORTER_OTLP_ENDPOINT``. No retries: a failed post is counted
    and its spans dropped.

    Args:
        url: the OTLP/HTTP traces endpoint (e.g. ``http://localhost:4318/v1/traces``).
        timeout_s: one post's time limit (connect and each read), seconds.
        env: the environment to read (default ``os.environ``).

    Raises:
        ValueError: an unknown compression.
    """

    def __init__(self, url: str, timeout_s: float, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env

        def setting(name: str) -> str:
            return (
                env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}")
                or env.get(f"OTEL_EXPORTER_OTLP_{name}")
                or ""
            ).strip()

        self.url = url
        self.timeout_s = timeout_s
        compression = setting("COMPRESSION").lower() or "none"
        if compression not in ("gzip", "none"):
            raise ValueError(
                f"OTEL_EXPORTER_OTLP_TRACES_COMPRESSION must be gzip or none, got '{compression}'"
            )
        self.gzip = compression == "gzip"
        self.session = requests.Session()
        self.session.headers.update(parse_headers(setting("HEADERS")))
        self.session.headers["Content-Type"] = "application/x-protobuf"
        if self.gzip:
            self.session.headers["Content-Encoding"] = "gzip"
        certificate = setting("CERTIFICATE")
        if certificate:
            self.session.verify = certificate

    def post(self, data: bytes) -> str:
        """Post one serialized request; "" when the endpoint accepted it (2xx), else why not.

        Raises:
            requests.RequestException: the endpoint cannot be reached or timed out.
        """
        if self.gzip:
            data = gzip.compress(data, compresslevel=6)
        with self.session.post(self.url, data=data, timeout=self.timeout_s) as response:
            if 200 <= response.status_code < 300:
                return ""
            return f"HTTP {response.status_code}: {response.text[:200]}"

    def close(self) -> None:
        """Close the connection pool."""
        self.session.close()
