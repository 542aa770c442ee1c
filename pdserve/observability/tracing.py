"""Request tracing: Triton's trace settings, the trace extension, and sampling.

:class:`TraceManager` holds the global and per-model trace settings (started from
``--trace-config``, :mod:`~pdserve.observability.trace_config`) and serves the trace
extension (``/v2/trace/setting``, ``/v2/models/{m}/trace/setting``, gRPC
``TraceSetting``) with Triton's shapes, errors and update rules: a model's setting
overrides the global one field by field, a ``null`` value clears a field, and each
update restarts that setting's sampling counter. Sampling follows Triton's
``TraceSetting::SampleTrace``; a request with a valid W3C ``traceparent`` is always
traced while the level is not OFF, and its spans join the client's trace.

Finished traces go to :class:`~pdserve.observability.span_export.SpanExport`.
OpenTelemetry is the optional extra ``pdserve[tracing]``, imported only when a setting
turns tracing on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.core import context
from pdserve.core import tracing as core_tracing
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.tracing import Trace, TraceRef, new_span_id, parse_traceparent
from pdserve.observability.span_export import ExportCounts, SpanExport
from pdserve.observability.trace_config import (
    I32_MAX,
    LEVELS,
    MIN_TRACE_COUNT,
    U32_MAX,
    TraceConfig,
)

if TYPE_CHECKING:
    from pdserve.core.types import InferRequest

log = logging.getLogger("pdserve.tracing")

#: The fields of a trace setting the extension reads and updates.
FIELDS = ("trace_level", "trace_rate", "trace_count", "log_frequency")

#: Name of the root span of every trace (Triton's).
ROOT_SPAN = "InferRequest"


# --------------------------------------------------------------------------- settings


@dataclass
class TraceSetting:
    """One effective trace setting (global, or a model's) and its sampling state.

    Attributes:
        level / rate / count / log_frequency: the values in force.
        specified: the fields this setting sets itself; the others follow its fallback
            (a model's: the global setting; the global one: the startup values).
        sampled: requests seen since the setting was made (Triton's ``sample_``).
    """

    level: tuple[str, ...]
    rate: int
    count: int
    log_frequency: int
    specified: frozenset[str] = frozenset()
    sampled: int = 0

    @property
    def on(self) -> bool:
        """The level traces something."""
        return self.level != ("OFF",)

    def invalid_reason(self) -> str:
        """Why this setting cannot trace (Triton's ``TraceSetting::Valid``), "" if it can."""
        if not self.on:
            return "tracing is disabled"
        if self.rate == 0:
            return "sample rate must be non-zero"
        if self.count == 0:
            return "trace count is 0: no trace left to take"
        return ""

    def sample(self, force: bool) -> bool:
        """Triton's ``SampleTrace``: count this request; True when it is traced.

        ``force``: the client propagated a trace context (always traced).
        """
        hit = False
        if self.rate != 0:
            if not force and self.count == 0:
                return False
            self.sampled += 1
            hit = self.sampled % self.rate == 0
            if hit and self.count > 0:
                self.count -= 1
            elif hit and self.count == 0:
                hit = False
        return hit or force

    def as_json(self, extra: Mapping[str, str | list[str]]) -> dict[str, str | list[str]]:
        """The trace-extension response: every value a string, ``trace_level`` a list."""
        out: dict[str, str | list[str]] = {
            "trace_level": list(self.level),
            "trace_rate": str(self.rate),
            "trace_count": str(self.count),
            "log_frequency": str(self.log_frequency),
        }
        out.update(extra)
        return out

    def value(self, name: str) -> Any:
        return {
            "trace_level": self.level,
            "trace_rate": self.rate,
            "trace_count": self.count,
            "log_frequency": self.log_frequency,
        }[name]


def _setting(values: Mapping[str, Any], specified: Iterable[str]) -> TraceSetting:
    return TraceSetting(
        level=values["trace_level"],
        rate=values["trace_rate"],
        count=values["trace_count"],
        log_frequency=values["log_frequency"],
        specified=frozenset(specified),
    )


def parse_setting_update(changes: Mapping[str, object]) -> dict[str, object]:
    """Check a trace-setting update, as Triton's HTTP and gRPC handlers do.

    Args:
        changes: setting name -> ``None`` (clear: follow the fallback again), a string,
            or a list of strings (HTTP JSON values; gRPC values arrive as lists, an
            empty list meaning clear).

    Returns:
        field -> ``None`` (clear) or the parsed value (a tuple of levels, an int).

    Raises:
        InferError(UNSUPPORTED): ``trace_file`` (Triton: "trace file location can not be
            updated through network protocol").
        InferError(INVALID_ARG): an unknown setting name; a value of the wrong JSON type;
            ``OFF`` with another level; an unknown level; more than one value for a
            number; a number that does not parse or is out of range (Triton's
            ``Unable to parse '<name>'...`` messages).
    """
    if "trace_file" in changes:
        raise InferError(
            "trace file location can not be updated through network protocol",
            ErrorCode.UNSUPPORTED,
        )
    out: dict[str, object] = {}
    for name, raw in changes.items():
        if name not in FIELDS:
            raise InferError(
                f"unknown trace setting '{name}' (settings that can be updated: "
                f"{', '.join(FIELDS)})"
            )
        if raw is None or (isinstance(raw, list) and not raw):
            out[name] = None
            continue
        values: list[str] = []
        for v in raw if isinstance(raw, list) else [raw]:
            if not isinstance(v, str):
                raise InferError(
                    f"trace setting '{name}' must be a string or a list of strings "
                    f"(or null to clear it), got {v!r}"
                )
            values.append(v)
        if name == "trace_level":
            levels: set[str] = set()
            for v in values:
                if v == "OFF":
                    if len(values) != 1:
                        raise InferError("Expect only one trace level 'OFF' is specified")
                    levels.add("OFF")
                elif v in ("TIMESTAMPS", "TENSORS"):
                    levels.add(v)
                else:
                    raise InferError(
                        f"unknown trace level '{v}' (choose OFF, or TIMESTAMPS and/or TENSORS)"
                    )
            out[name] = tuple(lv for lv in LEVELS if lv in levels)
            continue
        if len(values) != 1:
            raise InferError(f"expect only 1 value for '{name}'")
        text = values[0]
        low, high = (MIN_TRACE_COUNT, I32_MAX) if name == "trace_count" else (0, U32_MAX)
        try:
            n = int(text.strip(), 10)
        except ValueError:
            raise InferError(f"Unable to parse '{name}', got: {text}") from None
        if name == "trace_count" and n < MIN_TRACE_COUNT:
            raise InferError(
                f"Unable to parse '{name}'. Expecting value >= {MIN_TRACE_COUNT}, got: {text}"
            )
        if not low <= n <= high:
            raise InferError(
                f"Unable to parse '{name}', value is out of range [ {low}, {high} ], got: {text}"
            )
        out[name] = n
    return out


# --------------------------------------------------------------------------- manager


class TraceExport(Protocol):
    """Where finished traces go (:class:`SpanExport`, or a test's sink)."""

    def submit(self, trace: Trace) -> None: ...

    def stop(self, timeout: float = 5.0) -> None: ...


class TraceManager:
    """Trace settings (global and per model), sampling, and the export of traces.

    Implements the server's tracing hook (:class:`pdserve.core.tracing.RequestTracer`):
    :meth:`begin` decides whether a request is traced and opens its root span;
    :meth:`end` closes it and hands the trace to the export.

    Args:
        config: the ``--trace-config`` options (the startup, "default" values).
        export: where finished traces go; None: a :class:`SpanExport` to
            ``config.url`` is started the first time a setting turns tracing on.

    Raises:
        InferError(UNAVAILABLE): (from the constructor) ``config`` turns tracing on
            but OpenTelemetry (``pdserve[tracing]``) cannot be imported.
    """

    def __init__(self, config: TraceConfig, export: TraceExport | None = None) -> None:
        self.config = config
        defaults = {
            "trace_level": config.level,
            "trace_rate": config.rate,
            "trace_count": config.count,
            "log_frequency": config.log_frequency,
        }
        self._default = _setting(defaults, ())
        self._global = _setting(defaults, ())
        self._models: dict[str, TraceSetting] = {}
        self._export = export
        self._export_lock = threading.Lock()
        self._refresh()

    # -- settings -------------------------------------------------------------

    def _extra(self) -> dict[str, str | list[str]]:
        c = self.config
        return {
            "trace_mode": "opentelemetry",
            "url": c.url,
            "resource": list(c.resource),
            "bsp_max_queue_size": str(c.bsp_max_queue_size),
            "bsp_schedule_delay": str(c.bsp_schedule_delay_ms),
            "bsp_max_export_batch_size": str(c.bsp_max_export_batch_size),
        }

    def get_setting(self, model: str = "") -> dict[str, str | list[str]]:
        """The settings in force for ``model`` ("" : the global ones), in the trace
        extension's JSON shape (strings, ``trace_level`` a list of strings)."""
        setting = self._models.get(model, self._global) if model else self._global
        return setting.as_json(self._extra())

    def update_setting(
        self, model: str, changes: Mapping[str, object]
    ) -> dict[str, str | list[str]]:
        """Update the global settings (``model`` "") or a model's; return those in force.

        Triton's ``UpdateTraceSetting``: each field is the update's value, else the
        setting's own earlier value when it set one, else its fallback's (the global
        setting for a model, the startup values for the global setting); ``None``
        clears a field. A model setting that no longer sets any field is removed, and a
        global update also rebuilds the model settings that follow it. Every setting
        made restarts its sampling counter (and its remaining ``trace_count``).

        Raises:
            InferError: what :func:`parse_setting_update` raises; INVALID_ARG when the
                result would trace with an invalid setting ("Attempting to set invalid
                trace setting: sample rate must be non-zero"); UNAVAILABLE when the
                update turns tracing on and OpenTelemetry is not installed.
        """
        parsed = parse_setting_update(changes)
        if model:
            made = self._make(self._models.get(model), self._global, parsed)
            if made is not None and made.on:
                self._ensure_export()
            if made is None:
                self._models.pop(model, None)
            else:
                self._models[model] = made
        else:
            made = self._make(self._global, self._default, parsed)
            assert made is not None
            if made.on:
                self._ensure_export()
            self._global = made
            for name, s in list(self._models.items()):
                if s.specified != frozenset(FIELDS):
                    rebuilt = self._make(s, self._global, {})
                    if rebuilt is not None:
                        self._models[name] = rebuilt
        self._refresh()
        return self.get_setting(model)

    def _make(
        self, current: TraceSetting | None, fallback: TraceSetting, new: Mapping[str, object]
    ) -> TraceSetting | None:
        values: dict[str, Any] = {}
        specified: list[str] = []
        for name in FIELDS:
            if name in new and new[name] is None:
                values[name] = fallback.value(name)
            elif name in new:
                values[name] = new[name]
                specified.append(name)
            elif current is not None and name in current.specified:
                values[name] = current.value(name)
                specified.append(name)
            else:
                values[name] = fallback.value(name)
        if current is not self._global and not specified and fallback is self._global:
            return None  # a model setting that sets nothing: the model follows the global one
        made = _setting(values, specified)
        reason = made.invalid_reason()
        if (
            made.on
            and reason
            and not (reason.startswith("trace count") and "trace_count" not in new)
        ):
            raise InferError(f"Attempting to set invalid trace setting: {reason}")
        return made

    def _refresh(self) -> None:
        core_tracing.state.enabled = self._global.on or any(s.on for s in self._models.values())

    # -- requests -------------------------------------------------------------

    def begin(self, request: InferRequest) -> TraceRef | None:
        """Decide whether ``request`` is traced; open its root span when it is.

        Also sets :data:`pdserve.core.context.trace_id` when the request is traced or
        carries a valid ``traceparent``.

        Returns:
            the reference the server puts in ``request.trace`` (its model span hangs
            under the root span), or None.
        """
        parsed = parse_traceparent(request.traceparent) if request.traceparent is not None else None
        model = request.model_name
        setting = self._models.get(model, self._global) if self._models else self._global
        if not setting.on or not setting.sample(parsed is not None):
            # a task may serve several requests (a keep-alive connection): set it either way
            context.trace_id.set(parsed[0] if parsed is not None else None)
            return None
        trace = Trace(parsed[0], parsed[1], parsed[2]) if parsed else Trace()
        core_tracing.active[trace.trace_id] = trace
        context.trace_id.set(trace.trace_id)
        return TraceRef(trace, new_span_id())

    def end(self, request: InferRequest, ref: TraceRef, error: str | None = None) -> None:
        """Close the root span of a traced request (opened at ``request.arrival_ns``) and
        hand the trace to the export; never blocks or raises."""
        trace = ref.trace
        attributes: dict[str, object] = {"triton.model_name": request.model_name}
        if request.model_version:
            attributes["triton.model_version"] = request.model_version
        if request.id:
            attributes["triton.request_id"] = request.id
        if error is not None:
            attributes["pdserve.error"] = error
        trace.add(
            ROOT_SPAN,
            trace.remote_parent,
            request.arrival_ns,
            time.monotonic_ns(),
            attributes,
            span_id=ref.parent_id,
        )
        trace.closed = True
        if core_tracing.active.get(trace.trace_id) is trace:
            del core_tracing.active[trace.trace_id]
        export = self._export
        if export is not None:
            export.submit(trace)

    # -- export ---------------------------------------------------------------

    def _ensure_export(self) -> None:
        if self._export is not None:
            return
        with self._export_lock:
            if self._export is None:
                self._export = SpanExport(self.config)

    @property
    def export(self) -> TraceExport | None:
        """The export the traces go to (None until tracing was first turned on)."""
        return self._export

    def samples(self) -> Iterator[tuple[str, str, str, dict[str, str], float]]:
        """Metric samples ``(name, type, help, labels, value)`` of the span export (a
        :attr:`pdserve.observability.metrics.MetricsExporter.sources` entry):
        ``pdserve_trace_spans_exported_total`` (spans the OTLP endpoint accepted) and
        ``pdserve_trace_spans_dropped_total{reason}`` (``queue_full``: the bounded queue
        was full, or still held them at shutdown; ``export_failed``: their post failed).
        Zero until tracing is first turned on."""
        counts = getattr(self._export, "counts", None) or ExportCounts()
        yield (
            "pdserve_trace_spans_exported_total", "counter",
            "Trace spans the OTLP endpoint accepted",
            {}, counts.exported,
        )  # fmt: skip
        for reason, n in (
            ("queue_full", counts.dropped_queue_full),
            ("export_failed", counts.dropped_failed),
        ):
            yield (
                "pdserve_trace_spans_dropped_total", "counter",
                "Trace spans dropped, by reason (queue_full: the export queue was full; "
                "export_failed: the OTLP post failed)",
                {"reason": reason}, n,
            )  # fmt: skip

    def start(self) -> None:
        """Start the export now when the startup settings trace.

        Raises:
            InferError(UNAVAILABLE): OpenTelemetry is not installed.
        """
        if self._global.on:
            self._ensure_export()

    def stop(self, timeout: float = 5.0) -> None:
        """Export what is queued (waiting at most ``timeout`` s), then stop the export."""
        export = self._export
        if export is not None:
            export.stop(timeout)
