"""Request tracing: Triton's trace settings and sampling, OpenTelemetry export (issue 17).

What this module does, and what Triton does (``docs/user_guide/trace.md`` and
``docs/protocol/extension_trace.md`` of triton-inference-server/server; the
semantics below follow its ``src/tracer.cc`` and ``src/command_line_parser.cc``):

- ``--trace-config`` (repeatable, Triton's form): global settings ``rate=N`` (every
  N-th request is traced, default 1000), ``level=OFF|TIMESTAMPS|TENSORS`` (default
  OFF: nothing is traced), ``count=N`` (traces left to take, -1 = no limit, the
  default), ``mode=opentelemetry``; ``opentelemetry,url=...`` (the OTLP/HTTP traces
  endpoint, default ``http://localhost:4318/v1/traces``), ``opentelemetry,resource=k=v``
  (resource attributes, repeatable; default ``service.name=pdserve``),
  ``opentelemetry,bsp_max_queue_size|bsp_schedule_delay|bsp_max_export_batch_size=N``
  (the batch export: queue bound 2048 spans, delay 5000 ms, batch 512 spans);
  ``triton,log-frequency=N`` sets ``log_frequency``. pdserve's own:
  ``opentelemetry,export_timeout=MS`` (one export's time limit, default 10000).
  pdserve exports OpenTelemetry only: ``mode`` defaults to ``opentelemetry`` and
  ``mode=triton`` / ``triton,file=...`` (Triton's JSON trace file) are start errors.
- The trace extension: ``GET/POST /v2/trace/setting`` and
  ``/v2/models/{m}/trace/setting`` (HTTP) and ``TraceSetting`` (gRPC), with Triton's
  shapes (every value a string, ``trace_level`` a list of strings), its errors and its
  update rules (:meth:`TraceManager.update_setting`): a model's setting overrides the
  global one field by field, a ``null`` value (gRPC: an empty value list) clears a field
  so that it follows the global setting again (the startup value, for a global field),
  and each update restarts that setting's sampling counter.
- Sampling (Triton's ``TraceSetting::SampleTrace``): the setting of the requested
  model decides; a request whose client sent a valid W3C ``traceparent`` is always
  traced while the level is not OFF (with ``rate=0`` only those are), and its spans
  join the client's trace. A malformed ``traceparent`` is ignored (W3C): the request is
  sampled as one without.

The spans of a traced request (a :class:`~pdserve.core.tracing.Trace` filled by the
server, the schedulers and the backends) are handed to :class:`SpanExport` when the
request ends: a bounded queue and one export thread that converts them to
OTLP protobuf (opentelemetry-proto) and posts them over OTLP/HTTP
(:mod:`pdserve.observability.otlp`). The request never waits for the export; a full
queue or a failed export drops spans, and the drops are counted (:attr:`SpanExport.counts`,
logged at most every 10 s and at shutdown, and exposed as Prometheus counters by
:meth:`TraceManager.samples`).

OpenTelemetry is the optional extra ``pdserve[tracing]``: it is imported only when a
setting turns tracing on (at start, or by a trace-setting update); without it that
start fails naming ``--trace-config``, and that update fails with UNAVAILABLE.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.core import context
from pdserve.core import tracing as core_tracing
from pdserve.core.errors import ErrorCode, InferError, unavailable
from pdserve.core.tracing import Trace, TraceRef, new_span_id, parse_traceparent

if TYPE_CHECKING:
    from pdserve.core.types import InferRequest

log = logging.getLogger("pdserve.tracing")

#: Trace levels (Triton's names). OFF must stand alone.
LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
#: The fields of a trace setting the extension reads and updates.
FIELDS = ("trace_level", "trace_rate", "trace_count", "log_frequency")
#: Triton's smallest trace_count (-1: no limit).
MIN_TRACE_COUNT = -1
_U32 = 2**32 - 1
_I32 = 2**31 - 1

DEFAULT_URL = "http://localhost:4318/v1/traces"
DEFAULT_RESOURCE = ("service.name=pdserve",)

#: Name of the root span of every trace (Triton's).
ROOT_SPAN = "InferRequest"


class TraceConfigError(ValueError):
    """A bad ``--trace-config`` option (the message is Triton's where it has one)."""


# --------------------------------------------------------------------------- flags


@dataclass(frozen=True)
class TraceConfig:
    """The ``--trace-config`` options, parsed.

    Attributes:
        level: trace levels (``("OFF",)`` or a subset of TIMESTAMPS / TENSORS).
        rate: every ``rate``-th request is traced (0: only requests with a
            ``traceparent``).
        count: traces left to take (-1: no limit).
        log_frequency: Triton's ``log_frequency`` (kept and reported; pdserve writes
            no trace file, so it changes nothing).
        url: the OTLP/HTTP traces endpoint.
        resource: resource attributes ``key=value``.
        bsp_max_queue_size / bsp_schedule_delay_ms / bsp_max_export_batch_size: the
            export queue bound (spans), the delay between exports (ms), spans per export.
        export_timeout_ms: the time limit of one export (retries included).
    """

    level: tuple[str, ...] = ("OFF",)
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    url: str = DEFAULT_URL
    resource: tuple[str, ...] = DEFAULT_RESOURCE
    bsp_max_queue_size: int = 2048
    bsp_schedule_delay_ms: int = 5000
    bsp_max_export_batch_size: int = 512
    export_timeout_ms: int = 10000

    @property
    def enabled(self) -> bool:
        """True when the startup level traces requests (not OFF)."""
        return self.level != ("OFF",)

    def resource_attributes(self) -> dict[str, str]:
        """``resource`` as a dict (a later key wins)."""
        out: dict[str, str] = {}
        for item in self.resource:
            key, _, value = item.partition("=")
            out[key] = value
        return out


def _int_option(setting: str, value: str, low: int, high: int) -> int:
    try:
        n = int(value, 10)
    except ValueError:
        raise TraceConfigError(f"'{setting}' must be an integer, got '{value}'") from None
    if not low <= n <= high:
        raise TraceConfigError(f"'{setting}' must be in [{low}, {high}], got '{value}'")
    return n


def _parse_level(value: str) -> str:
    """Triton's ``ParseTraceLevelOption``: case-insensitive, with its synonyms."""
    v = value.lower()
    if v in ("false", "off"):
        return "OFF"
    if v in ("true", "on", "min", "max", "timestamps"):
        return "TIMESTAMPS"
    if v == "tensors":
        return "TENSORS"
    raise TraceConfigError(f"invalid value for trace level option: {value}")


def parse_trace_config(options: Iterable[str]) -> TraceConfig:
    """Parse ``--trace-config`` options (Triton's ``<mode>,<setting>=<value>`` or
    ``<setting>=<value>``), later options winning.

    Raises:
        TraceConfigError: a malformed option, an unknown mode or setting, a bad value,
            or a Triton file-trace option pdserve does not support.
    """
    level: set[str] = set()
    explicit_off = False
    values: dict[str, Any] = {}
    resource: list[str] = []
    for option in options:
        mode, sep, rest = option.partition(",")
        if not sep or "=" in mode:
            mode, rest = "", option
        elif not mode:
            raise TraceConfigError(
                "No trace mode specified. --trace-config option format is "
                f"<trace mode>,<setting>=<value> or <setting>=<value>. Got {option}"
            )
        setting, eq, value = rest.partition("=")
        if not eq or not setting or not value:
            raise TraceConfigError(
                f"--trace-config option format is '<trace mode>,<setting>=<value>'. Got {option}"
            )
        mode = mode.lower()
        if mode == "":
            if setting == "rate":
                values["rate"] = _int_option("rate", value, 0, _U32)
            elif setting == "level":
                lv = _parse_level(value)
                if lv == "OFF":
                    explicit_off = True
                else:
                    level.add(lv)
            elif setting == "count":
                values["count"] = _int_option("count", value, MIN_TRACE_COUNT, _I32)
            elif setting == "mode":
                m = value.lower()
                if m == "triton":
                    raise TraceConfigError(
                        "mode=triton (Triton's JSON trace file) is not supported: pdserve "
                        "exports OpenTelemetry traces (mode=opentelemetry, the default)"
                    )
                if m != "opentelemetry":
                    raise TraceConfigError(
                        f"invalid value for trace mode option: {value}. Available options "
                        'are "triton" and "opentelemetry"'
                    )
            else:
                raise TraceConfigError(
                    f"unknown global trace setting '{setting}' (known: rate, level, count, mode)"
                )
        elif mode == "triton":
            if setting == "log-frequency":
                values["log_frequency"] = _int_option("log-frequency", value, 0, _U32)
            elif setting == "file":
                raise TraceConfigError(
                    "triton,file: Triton's JSON trace file is not supported: pdserve exports "
                    "OpenTelemetry traces (opentelemetry,url=<OTLP/HTTP endpoint>)"
                )
            else:
                raise TraceConfigError(
                    f"unknown triton trace setting '{setting}' (known: log-frequency)"
                )
        elif mode == "opentelemetry":
            if setting == "url":
                values["url"] = value
            elif setting == "resource":
                if "=" not in value or value.startswith("="):
                    raise TraceConfigError(
                        f"opentelemetry,resource must be <key>=<value>, got '{value}'"
                    )
                resource.append(value)
            elif setting == "bsp_max_queue_size":
                values["bsp_max_queue_size"] = _int_option(setting, value, 1, _U32)
            elif setting == "bsp_schedule_delay":
                values["bsp_schedule_delay_ms"] = _int_option(setting, value, 0, _U32)
            elif setting == "bsp_max_export_batch_size":
                values["bsp_max_export_batch_size"] = _int_option(setting, value, 1, _U32)
            elif setting == "export_timeout":
                values["export_timeout_ms"] = _int_option(setting, value, 1, _U32)
            else:
                raise TraceConfigError(
                    f"unknown opentelemetry trace setting '{setting}' (known: url, resource, "
                    "bsp_max_queue_size, bsp_schedule_delay, bsp_max_export_batch_size, "
                    "export_timeout)"
                )
        else:
            raise TraceConfigError(
                f"invalid value for trace mode option: {mode}. Available options are "
                '"triton" and "opentelemetry"'
            )
    if level:
        values["level"] = tuple(lv for lv in LEVELS if lv in level)
    elif explicit_off:
        values["level"] = ("OFF",)
    if resource:
        values["resource"] = DEFAULT_RESOURCE + tuple(resource)
    config = TraceConfig(**values)
    if config.bsp_max_export_batch_size > config.bsp_max_queue_size:
        raise TraceConfigError(
            "opentelemetry,bsp_max_export_batch_size must be <= bsp_max_queue_size, got "
            f"{config.bsp_max_export_batch_size} > {config.bsp_max_queue_size}"
        )
    return config


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


def parse_setting_update(changes: Mapping[str, Any]) -> dict[str, Any]:
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
    out: dict[str, Any] = {}
    for name, raw in changes.items():
        if name not in FIELDS:
            raise InferError(
                f"unknown trace setting '{name}' (settings that can be updated: "
                f"{', '.join(FIELDS)})"
            )
        if raw is None or (isinstance(raw, list) and not raw):
            out[name] = None
            continue
        values = raw if isinstance(raw, list) else [raw]
        for v in values:
            if not isinstance(v, str):
                raise InferError(
                    f"trace setting '{name}' must be a string or a list of strings "
                    f"(or null to clear it), got {v!r}"
                )
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
        low, high = (MIN_TRACE_COUNT, _I32) if name == "trace_count" else (0, _U32)
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

    def __init__(self, config: TraceConfig, export: Any = None) -> None:
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

    def update_setting(self, model: str, changes: Mapping[str, Any]) -> dict[str, str | list[str]]:
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
        self, current: TraceSetting | None, fallback: TraceSetting, new: Mapping[str, Any]
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
        attributes: dict[str, Any] = {"triton.model_name": request.model_name}
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
    def export(self) -> Any:
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


# --------------------------------------------------------------------------- export


def _import_otel() -> Any:
    """Import the OTLP export (:mod:`pdserve.observability.otlp`, the ``tracing`` extra).

    Raises:
        InferError(UNAVAILABLE): not installed.
    """
    try:
        from pdserve.observability import otlp
    except ImportError as e:
        raise unavailable(
            "tracing needs the 'tracing' extra (opentelemetry-proto, opentelemetry-api, "
            f"requests), which cannot be imported ({e}): install it with pip install "
            "'pdserve[tracing]', or leave --trace-config level at OFF"
        ) from None
    return otlp


@dataclass
class ExportCounts:
    """What the export did since it started (spans).

    Attributes:
        exported: spans the endpoint accepted.
        dropped_queue_full: spans dropped because the export queue was full (the
            endpoint is down or slower than the traffic), or still queued when the
            export stopped.
        dropped_failed: spans of exports that failed (refused, timed out, an error status).
        exports: posts made (successful or not).
        failures: why the last (at most 10) failed posts failed.
    """

    exported: int = 0
    dropped_queue_full: int = 0
    dropped_failed: int = 0
    exports: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def dropped(self) -> int:
        """Every span dropped."""
        return self.dropped_queue_full + self.dropped_failed


class SpanExport:
    """A bounded span queue and one daemon thread exporting it over OTLP/HTTP.

    :meth:`submit` (event loop) appends a finished trace's spans and returns at once.
    The thread wakes every ``bsp_schedule_delay`` ms, or as soon as
    ``bsp_max_export_batch_size`` spans wait, encodes up to that many as one OTLP
    ``ExportTraceServiceRequest`` and posts it (one post, no retry; ``export_timeout``
    ms to connect and to each read). Spans beyond ``bsp_max_queue_size`` are dropped, as
    are those of a failed export; both are counted in :attr:`counts`.

    Args:
        config: the trace configuration (endpoint, resource, batch settings).
        sender: what posts the serialized requests
            (:class:`~pdserve.observability.otlp.OtlpHttpSender`: ``post(bytes) -> str``,
            "" on success, and ``close()``); None: one to ``config.url``.

    Raises:
        InferError(UNAVAILABLE): OpenTelemetry (``pdserve[tracing]``) is not installed,
            or an ``OTEL_EXPORTER_OTLP_*`` setting is invalid.
    """

    def __init__(self, config: TraceConfig, sender: Any = None) -> None:
        self._otlp = _import_otel()
        self.config = config
        self._converter = self._otlp.SpanConverter(config.resource_attributes())
        if sender is None:
            try:
                sender = self._otlp.OtlpHttpSender(config.url, config.export_timeout_ms / 1000)
            except ValueError as e:
                raise unavailable(f"tracing: {e}") from None
        self._sender = sender
        self.counts = ExportCounts()
        self._queue: deque[tuple[Trace, int]] = deque()
        self._queued = 0  # spans in _queue (under _lock: the loop adds, the thread takes)
        self._lock = threading.Lock()
        self._max_queue = config.bsp_max_queue_size
        self._batch = config.bsp_max_export_batch_size
        self._delay = config.bsp_schedule_delay_ms / 1000
        self._wake = threading.Event()
        self._stopping = False
        self._flushing = False  # flush(): export what is queued, full batch or not
        self._busy = False  # the thread holds taken spans not yet counted
        self._last_drop_log = 0.0
        self._logged_dropped = 0
        self._thread = threading.Thread(target=self._run, name="pdserve-trace-export", daemon=True)
        self._thread.start()
        log.info(
            "tracing: exporting OpenTelemetry spans to %s (queue %d spans, every %d ms)",
            config.url,
            config.bsp_max_queue_size,
            config.bsp_schedule_delay_ms,
        )

    def submit(self, trace: Trace) -> None:
        """Queue a finished trace's spans (all of them, or none when they do not fit)."""
        n = len(trace.spans)
        with self._lock:
            full = self._stopping or self._queued + n > self._max_queue
            if not full:
                self._queue.append((trace, time.time_ns() - time.monotonic_ns()))
                self._queued += n
                wake = self._queued >= self._batch
        if full:
            self.counts.dropped_queue_full += n
            self._note_drops()
        elif wake:
            self._wake.set()

    def _note_drops(self) -> None:
        now = time.monotonic()
        if now - self._last_drop_log >= 10.0:
            self._last_drop_log = now
            new = self.counts.dropped - self._logged_dropped
            self._logged_dropped = self.counts.dropped
            failures = self.counts.failures
            log.warning(
                "tracing: %d spans dropped so far (%d queue full, %d failed exports; +%d "
                "since the last report)%s",
                self.counts.dropped,
                self.counts.dropped_queue_full,
                self.counts.dropped_failed,
                new,
                f"; an export failed: {failures[-1]}" if failures else "",
            )

    def _take(self) -> list[tuple[Trace, int]]:
        """Up to one batch of traces (whole traces: a batch may run over)."""
        taken: list[tuple[Trace, int]] = []
        count = 0
        with self._lock:
            while self._queue and count < self._batch:
                item = self._queue.popleft()
                taken.append(item)
                count += len(item[0].spans)
            self._queued -= count
            self._busy = bool(taken)
        return taken

    def _export_some(self, full_batches_only: bool = False) -> None:
        """Export the queue (with ``full_batches_only``: while a whole batch waits)."""
        while self._queue and (not full_batches_only or self._queued >= self._batch):
            taken = self._take()
            if taken:
                self._post(taken)
            self._busy = False

    def _post(self, taken: list[tuple[Trace, int]]) -> None:
        """Encode ``taken`` as one export request, post it, count the outcome."""
        n = 0
        try:
            message, n = self._converter.request(taken)
            if not n:
                return
            reason = self._sender.post(message.SerializeToString())
        except Exception as e:  # noqa: BLE001 - the export thread must live on
            reason = f"{type(e).__name__}: {e}"
            n = n or sum(len(trace.spans) for trace, _ in taken)
        self.counts.exports += 1
        if not reason:
            self.counts.exported += n
        else:
            self.counts.dropped_failed += n
            failures = self.counts.failures
            failures.append(reason)
            del failures[:-10]  # the last 10
            self._note_drops()

    def _run(self) -> None:
        # As the batch span processor: woken by a full batch, export full batches;
        # when the delay has passed, export everything queued.
        while not self._stopping:
            woken = self._wake.wait(self._delay)
            self._wake.clear()
            flushing, self._flushing = self._flushing, False
            self._export_some(full_batches_only=woken and not self._stopping and not flushing)
        self._export_some()

    def flush(self, timeout: float = 5.0) -> None:
        """Export what is queued now, and wait (at most ``timeout`` s) until it was
        posted (or dropped)."""
        self._flushing = True
        self._wake.set()
        deadline = time.monotonic() + timeout
        while (self._queue or self._busy or self._flushing) and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self, timeout: float = 5.0) -> None:
        """Export what is queued (at most ``timeout`` s), stop the thread, log the counts."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        with self._lock:  # what the thread could not export in time is lost
            self.counts.dropped_queue_full += self._queued
            self._queue.clear()
            self._queued = 0
        c = self.counts
        log.info(
            "tracing: %d spans exported in %d exports, %d dropped (%d queue full, %d failed "
            "exports)",
            c.exported,
            c.exports,
            c.dropped,
            c.dropped_queue_full,
            c.dropped_failed,
        )
        try:
            self._sender.close()
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.debug("OTLP sender close failed", exc_info=True)
