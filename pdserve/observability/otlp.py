"""OpenTelemetry side of tracing: span records -> OTLP protobuf -> OTLP/HTTP (issue 17).

Imported only when tracing is on (:func:`pdserve.observability.tracing._import_otel`);
it needs the ``tracing`` extra (``opentelemetry-proto``,
``opentelemetry-exporter-otlp-proto-http``, ``opentelemetry-sdk``). Runs on the export
thread, never on the event loop.

The spans keep the ids pdserve generated (:mod:`pdserve.core.tracing`), so that a
``traceparent`` handed to a python worker or a BLS call before its span ended names the
exported span. They are written straight into an ``ExportTraceServiceRequest``
(opentelemetry-proto) rather than built as SDK ``ReadableSpan`` objects and encoded by
the SDK: measured here, that path cost ~6x more CPU per span (about 90 µs against
14 µs), and with one core that CPU is taken from serving requests. The request is
posted by the OTLP/HTTP exporter's own HTTP client (``OTLPSpanExporter``: its TLS,
``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, compression and retry-within-timeout apply).
That client is the exporter's private ``_client`` (of the pinned 1.45.2): should a later
version rename it, every export fails with a clear error, counted and logged as drops.
"""

from __future__ import annotations

import struct
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1 import trace_pb2

from pdserve import __version__
from pdserve.core.tracing import Trace

_SERVER = 2  # Span.SpanKind.SPAN_KIND_SERVER
_INTERNAL = 1  # SPAN_KIND_INTERNAL
_ERROR = 2  # Status.StatusCode.STATUS_CODE_ERROR
_pack_q = struct.Struct("<Q").pack
_pack_i = struct.Struct("<I").pack


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


# Span fields of opentelemetry/proto/trace/v1/trace.proto, as their wire tags.
_KIND = {_SERVER: b"\x30\x02", _INTERNAL: b"\x30\x01"}  # 6: kind (varint)
_START = b"\x39"  # 7: start_time_unix_nano (fixed64)
_END = b"\x41"  # 8: end_time_unix_nano (fixed64)
_FLAGS = b"\x85\x01"  # 16: flags (fixed32)


class SpanConverter:
    """Encodes :class:`~pdserve.core.tracing.Trace` spans as OTLP protobuf.

    The ``Span`` messages are written field by field (names and attributes, which
    repeat from span to span, are encoded once and cached): building them as
    protobuf objects cost ~4x more CPU. The export tests decode what this writes with
    opentelemetry-proto.

    Args:
        resource: resource attributes (``service.name``...).
    """

    #: at most this many cached encodings of names and attributes
    CACHE = 4096

    def __init__(self, resource: dict[str, str]) -> None:
        self._resource = Resource(
            attributes=[_kv(k, v) for k, v in resource.items()]
        ).SerializeToString()
        self._names: dict[str, bytes] = {}
        self._attrs: dict[tuple[str, type, Any], bytes] = {}

    def _name(self, name: str) -> bytes:
        enc = self._names.get(name)
        if enc is None:
            enc = _field(5, name.encode())
            if len(self._names) < self.CACHE:
                self._names[name] = enc
        return enc

    def _attr(self, key: str, value: Any) -> bytes:
        ck = (key, type(value), value)
        enc = self._attrs.get(ck)
        if enc is None:
            enc = _field(9, _kv(key, value).SerializeToString())
            if len(self._attrs) < self.CACHE:
                self._attrs[ck] = enc
        return enc

    def convert(self, trace: Trace, offset_ns: int) -> list[bytes]:
        """The trace's spans, each an encoded ``Span`` message.

        Args:
            offset_ns: wall-clock minus monotonic time, ns (span times are monotonic).
        """
        tid = b"\x0a\x10" + bytes.fromhex(trace.trace_id)  # 1: trace_id
        remote = trace.remote_parent
        out = []
        for rec in trace.spans:
            parent = rec.parent_id
            is_root = not parent or parent == remote
            parts = [
                tid,
                b"\x12\x08" + bytes.fromhex(rec.span_id),  # 2: span_id
                b"\x22\x08" + bytes.fromhex(parent) if parent else b"",  # 4: parent_span_id
                self._name(rec.name),
                _KIND[_SERVER if is_root else _INTERNAL],
                _START + _pack_q(rec.start_ns + offset_ns),
                _END + _pack_q(max(rec.end_ns, rec.start_ns) + offset_ns),
            ]
            attrs = rec.attributes
            if attrs:
                parts.extend(self._attr(k, v) for k, v in attrs.items())
                error = attrs.get("pdserve.error")
                if error is not None:
                    status = trace_pb2.Status(code=_ERROR, message=str(error))  # type: ignore[arg-type]
                    parts.append(_field(15, status.SerializeToString()))
            # sampled; bit 8: the parent's remoteness is known, bit 9: it is remote
            parts.append(_FLAGS + _pack_i(0x301 if parent and parent == remote else 0x101))
            out.append(_field(2, b"".join(parts)))  # ScopeSpans.spans (2)
        return out

    def request(self, spans: list[bytes]) -> bytes:
        """One serialized ``ExportTraceServiceRequest`` holding ``spans``."""
        resource = _field(1, self._resource)  # ResourceSpans.resource
        scope = _field(1, b"\x0a" + _varint(7) + b"pdserve" + _field(2, __version__.encode()))
        scope_spans = _field(2, scope + b"".join(spans))  # ResourceSpans.scope_spans
        return _field(1, resource + scope_spans)  # ExportTraceServiceRequest.resource_spans


def make_exporter(url: str, timeout_s: float) -> Any:
    """The OTLP/HTTP (protobuf) span exporter to ``url`` (e.g.
    ``http://localhost:4318/v1/traces``), each export limited to ``timeout_s``."""
    return OTLPSpanExporter(endpoint=url, timeout=timeout_s)


def post(exporter: Any, data: bytes) -> bool:
    """Send one serialized export request; True when the endpoint accepted it.

    Raises:
        RuntimeError: the exporter has no HTTP client this module knows.
    """
    client = getattr(exporter, "_client", None)
    send = getattr(client, "export", None)
    if send is None:
        raise RuntimeError("this OTLPSpanExporter has no _client.export(bytes)")
    return bool(send(data).success)
