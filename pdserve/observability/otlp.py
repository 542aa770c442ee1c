"""OpenTelemetry side of tracing: span records -> SDK spans -> OTLP/HTTP (issue 17).

Imported only when tracing is on (:func:`pdserve.observability.tracing._import_otel`);
it needs the ``tracing`` extra (``opentelemetry-sdk``,
``opentelemetry-exporter-otlp-proto-http``). Runs on the export thread, never on the
event loop.

The spans are built as finished :class:`opentelemetry.sdk.trace.ReadableSpan` objects
with the ids pdserve generated (:mod:`pdserve.core.tracing`), so that a ``traceparent``
handed to a python worker or a BLS call before its span ended names the exported span.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from pdserve import __version__
from pdserve.core.tracing import Trace

_SCOPE = InstrumentationScope("pdserve", __version__)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)


class SpanConverter:
    """Turns a :class:`~pdserve.core.tracing.Trace` into OpenTelemetry SDK spans.

    Args:
        resource: resource attributes (``service.name``...).
    """

    def __init__(self, resource: dict[str, str]) -> None:
        self.resource = Resource.create(resource)

    def convert(self, trace: Trace, offset_ns: int) -> list[Any]:
        """The trace's spans as ``ReadableSpan`` objects.

        Args:
            offset_ns: wall-clock minus monotonic time, ns (span times are monotonic).
        """
        trace_id = int(trace.trace_id, 16)
        remote = trace.remote_parent
        out = []
        for rec in trace.spans:
            ctx = SpanContext(trace_id, int(rec.span_id, 16), False, _SAMPLED)
            parent = None
            if rec.parent_id:
                parent = SpanContext(
                    trace_id, int(rec.parent_id, 16), rec.parent_id == remote, _SAMPLED
                )
            attrs = rec.attributes or {}
            status = _OK
            if "pdserve.error" in attrs:
                status = Status(StatusCode.ERROR, str(attrs["pdserve.error"]))
            kind = SpanKind.SERVER if parent is None or parent.is_remote else SpanKind.INTERNAL
            out.append(
                ReadableSpan(
                    name=rec.name,
                    context=ctx,
                    parent=parent,
                    resource=self.resource,
                    attributes=attrs,
                    kind=kind,
                    status=status,
                    start_time=rec.start_ns + offset_ns,
                    end_time=max(rec.end_ns, rec.start_ns) + offset_ns,
                    instrumentation_scope=_SCOPE,
                )
            )
        return out


def make_exporter(url: str, timeout_s: float) -> Any:
    """The OTLP/HTTP (protobuf) span exporter to ``url`` (e.g.
    ``http://localhost:4318/v1/traces``), each export limited to ``timeout_s``."""
    return OTLPSpanExporter(endpoint=url, timeout=timeout_s)


def export(exporter: Any, spans: list[Any]) -> bool:
    """Export ``spans``; True when the endpoint accepted them."""
    return bool(exporter.export(spans) == SpanExportResult.SUCCESS)
