"""The tracing seam of the core: span records every layer may write.

Tracing is decided and exported above the core (:mod:`pdserve.observability.tracing`,
OpenTelemetry), but the spans are opened below it: the server (model span, response
cache lookup), the schedulers (queue, compute and its input / infer / output parts),
ensembles (one model span per step) and the backends (the python worker hop and its
``execute``, BLS calls). Those layers may not import ``observability``, so this module
holds what they share, with no OpenTelemetry import.

:class:`Trace` holds one traced request's span records, :class:`TraceRef` is what a
traced :class:`~pdserve.core.types.InferRequest` carries, and :class:`ComputeMarks`
splits a batch's compute into Triton's input / infer / output. When nothing is traced,
``InferRequest.trace`` is None and a scheduler checks :data:`state` once per batch.
Times are ``time.monotonic_ns()``; the exporter converts them to wall-clock time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from random import getrandbits
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdserve.core.types import InferRequest


class _State:
    """Module-wide switch: ``enabled`` is True while any trace setting has a level
    other than OFF (set by :mod:`pdserve.observability.tracing`)."""

    __slots__ = ("enabled",)

    def __init__(self) -> None:
        self.enabled = False


#: ``state.enabled``: some trace setting samples requests (read per batch).
state = _State()

#: Live traces by trace id: a BLS call from a python worker names its parent span in a
#: ``traceparent``; the server finds the trace here to add the call's spans to it.
active: dict[str, Trace] = {}


def new_trace_id() -> str:
    """A random W3C trace id: 32 lowercase hex digits, not all zero."""
    return "%032x" % (getrandbits(128) or 1)


def new_span_id() -> str:
    """A random W3C span (parent) id: 16 lowercase hex digits, not all zero."""
    return "%016x" % (getrandbits(64) or 1)


_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def parse_traceparent(value: str | bytes | None) -> tuple[str, str, int] | None:
    """Parse a W3C ``traceparent`` header (https://www.w3.org/TR/trace-context/#traceparent-header).

    Returns:
        ``(trace_id, parent_span_id, flags)``, or None when the value is malformed: not
        ``version-traceid-parentid-flags`` in lowercase hex of 2-32-16-2 digits, an
        all-zero trace or parent id, version ``ff``, or a version-00 header with more
        fields. As the W3C spec asks, a malformed header is ignored (the request is
        traced, if at all, as a new trace); it never fails the request.
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    value = value.strip()
    m = _TRACEPARENT.fullmatch(value)
    if m is None:
        return None
    version, trace_id, parent_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return trace_id, parent_id, int(flags, 16)


@dataclass(slots=True, eq=False)
class SpanRecord:
    """One finished (or, for the root span, open) span of a :class:`Trace`.

    Attributes:
        name: the span name (``InferRequest``, a model name, ``queue``, ``compute``...).
        span_id / parent_id: 16-hex ids; ``parent_id`` "" for a root without a remote
            parent.
        start_ns / end_ns: ``time.monotonic_ns()`` values.
        attributes: OpenTelemetry attributes (str, int, float or bool values).
    """

    name: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] | None

    def __repr__(self) -> str:
        return (
            f"SpanRecord({self.name!r}, {self.span_id}, parent={self.parent_id or '-'}, "
            f"{(self.end_ns - self.start_ns) / 1e3:.0f} µs)"
        )


class Trace:
    """The spans of one traced request (and of its ensemble steps and BLS calls).

    Attributes:
        trace_id: 32-hex W3C trace id (the client's when it sent a valid ``traceparent``).
        remote_parent: the client's parent span id ("" when none): the root span's parent.
        spans: the span records, in the order they were added.
        closed: set when the trace was handed to the exporter; later spans are dropped.
    """

    __slots__ = ("trace_id", "remote_parent", "spans", "closed", "flags")

    def __init__(
        self, trace_id: str | None = None, remote_parent: str = "", flags: int = 1
    ) -> None:
        self.trace_id = trace_id or new_trace_id()
        self.remote_parent = remote_parent
        self.flags = flags | 1  # pdserve samples it: the sampled flag is set
        self.spans: list[SpanRecord] = []
        self.closed = False

    def add(
        self,
        name: str,
        parent_id: str,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, Any] | None = None,
        span_id: str | None = None,
    ) -> str:
        """Record a span; returns its id (``span_id``, or a new one)."""
        sid = span_id or new_span_id()
        if not self.closed:
            self.spans.append(SpanRecord(name, sid, parent_id, start_ns, end_ns, attributes))
        return sid

    def traceparent(self, span_id: str) -> str:
        """The W3C ``traceparent`` naming ``span_id`` of this trace as the parent."""
        return f"00-{self.trace_id}-{span_id}-{self.flags:02x}"


class TraceRef:
    """What a traced :class:`~pdserve.core.types.InferRequest` carries.

    Attributes:
        trace: the :class:`Trace` the request's spans go to.
        parent_id: the span the request's model span hangs under (the root span for a
            client's request, the ensemble's model span for a step, the BLS span for a
            BLS call).
        span_id: the request's model span, once the server opened it ("" before).
        attributes: extra attributes for the model span (an ensemble step's index...).
        batch_size: the request's rows (set by the server once the request is checked).
    """

    __slots__ = ("trace", "parent_id", "span_id", "attributes", "batch_size")

    def __init__(
        self, trace: Trace, parent_id: str, attributes: dict[str, Any] | None = None
    ) -> None:
        self.trace = trace
        self.parent_id = parent_id
        self.span_id = ""
        self.attributes = attributes
        self.batch_size = 0

    def child(self, attributes: dict[str, Any] | None = None) -> TraceRef:
        """A reference for a request made on behalf of this one (an ensemble step):
        its model span hangs under this request's model span."""
        return TraceRef(self.trace, self.span_id or self.parent_id, attributes)


def ref_from_traceparent(traceparent: str) -> TraceRef | None:
    """The live trace a ``traceparent`` from a python worker (BLS) names, or None.

    Only traces of this process still running are found (:data:`active`): a worker's
    BLS call is part of the request it serves.
    """
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return None
    trace = active.get(parsed[0])
    if trace is None or trace.closed:
        return None
    return TraceRef(trace, parsed[1])


class ComputeMarks:
    """Compute-phase timestamps of one batch (Triton's ``COMPUTE_INPUT_END`` and
    ``COMPUTE_OUTPUT_START``), set by the backend while the scheduler traces the batch.

    Attributes:
        input_end_ns / output_start_ns: ``monotonic_ns`` or 0 when the backend did not
            mark them (then the whole compute time counts as infer).
        infer_spans: ``id(ExecRequest)`` -> ``(TraceRef, compute_infer span id)`` of the
            traced requests of the batch: a backend hangs its own spans (the python
            worker hop) under that span.
    """

    __slots__ = ("input_end_ns", "output_start_ns", "infer_spans")

    def __init__(self) -> None:
        self.input_end_ns = 0
        self.output_start_ns = 0
        self.infer_spans: dict[int, tuple[TraceRef, str]] = {}


_marks: ContextVar[ComputeMarks | None] = ContextVar("pdserve_compute_marks", default=None)


def current_marks() -> ComputeMarks | None:
    """The :class:`ComputeMarks` of the batch being executed, when it is traced."""
    return _marks.get()


def set_marks(marks: ComputeMarks | None) -> Any:
    """Install ``marks`` for the running batch; returns the token for :func:`reset_marks`."""
    return _marks.set(marks)


def reset_marks(token: Any) -> None:
    """Undo :func:`set_marks`."""
    _marks.reset(token)


def mark_input_end() -> None:
    """A backend has its inputs ready (merged, copied): compute input ends here."""
    m = _marks.get()
    if m is not None:
        m.input_end_ns = time.monotonic_ns()


def mark_output_start() -> None:
    """A backend's model returned: compute output (splitting, copying) starts here."""
    m = _marks.get()
    if m is not None:
        m.output_start_ns = time.monotonic_ns()


class RequestTracer(Protocol):
    """The server's tracing hook (:class:`pdserve.observability.tracing.TraceManager`)."""

    def begin(self, request: InferRequest) -> TraceRef | None:
        """Decide whether ``request`` is traced; when it is, open its root span and
        return the reference for ``request.trace``."""
        ...

    def end(self, request: InferRequest, ref: TraceRef, error: str | None = None) -> None:
        """Close the root span of a traced request and hand its trace to the export."""
        ...

    def get_setting(self, model: str = "") -> dict[str, str | list[str]]:
        """The trace settings in force for ``model`` ("": the global ones)."""
        ...

    def update_setting(self, model: str, changes: Mapping[str, Any]) -> dict[str, str | list[str]]:
        """Update the global (``model`` "") or a model's trace settings; return them."""
        ...
