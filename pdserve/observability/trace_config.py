"""``--trace-config``: Triton's trace options, parsed into a :class:`TraceConfig`.

Global ``rate=N`` (every N-th request, default 1000), ``level=OFF|TIMESTAMPS|TENSORS``
(default OFF), ``count=N`` (-1: no limit), ``mode=opentelemetry``;
``opentelemetry,url=...`` (default ``http://localhost:4318/v1/traces``),
``opentelemetry,resource=k=v`` (repeatable), ``opentelemetry,bsp_max_queue_size |
bsp_schedule_delay | bsp_max_export_batch_size=N``, pdserve's own
``opentelemetry,export_timeout=MS``; ``triton,log-frequency=N``. pdserve exports
OpenTelemetry only: ``mode=triton`` and ``triton,file=...`` are start errors. The
semantics follow Triton's ``src/command_line_parser.cc``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: Trace levels (Triton's names). OFF must stand alone.
LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
#: Triton's smallest trace_count (-1: no limit).
MIN_TRACE_COUNT = -1
#: Bounds of Triton's unsigned and signed 32-bit settings.
U32_MAX = 2**32 - 1
I32_MAX = 2**31 - 1

#: The OTLP/HTTP traces endpoint and resource attributes when none is given.
DEFAULT_URL = "http://localhost:4318/v1/traces"
DEFAULT_RESOURCE = ("service.name=pdserve",)


class TraceConfigError(ValueError):
    """A bad ``--trace-config`` option (the message is Triton's where it has one)."""


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
    levels: list[str] = []
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
            _global_option(setting, value, values, levels)
        elif mode == "triton":
            _triton_option(setting, value, values)
        elif mode == "opentelemetry":
            _opentelemetry_option(setting, value, values, resource)
        else:
            raise TraceConfigError(
                f"invalid value for trace mode option: {mode}. Available options are "
                '"triton" and "opentelemetry"'
            )
    if any(lv != "OFF" for lv in levels):
        values["level"] = tuple(lv for lv in LEVELS if lv != "OFF" and lv in levels)
    elif levels:
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


def _global_option(setting: str, value: str, values: dict[str, Any], levels: list[str]) -> None:
    """A ``<setting>=<value>`` option: rate, level (appended to ``levels``), count, mode."""
    if setting == "rate":
        values["rate"] = _int_option("rate", value, 0, U32_MAX)
    elif setting == "level":
        levels.append(_parse_level(value))
    elif setting == "count":
        values["count"] = _int_option("count", value, MIN_TRACE_COUNT, I32_MAX)
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


def _triton_option(setting: str, value: str, values: dict[str, Any]) -> None:
    """A ``triton,<setting>=<value>`` option: log-frequency (the trace file is refused)."""
    if setting == "log-frequency":
        values["log_frequency"] = _int_option("log-frequency", value, 0, U32_MAX)
    elif setting == "file":
        raise TraceConfigError(
            "triton,file: Triton's JSON trace file is not supported: pdserve exports "
            "OpenTelemetry traces (opentelemetry,url=<OTLP/HTTP endpoint>)"
        )
    else:
        raise TraceConfigError(f"unknown triton trace setting '{setting}' (known: log-frequency)")


#: ``opentelemetry,<setting>`` -> (TraceConfig field, smallest value) of the integer ones.
_OTEL_INTS = {
    "bsp_max_queue_size": ("bsp_max_queue_size", 1),
    "bsp_schedule_delay": ("bsp_schedule_delay_ms", 0),
    "bsp_max_export_batch_size": ("bsp_max_export_batch_size", 1),
    "export_timeout": ("export_timeout_ms", 1),
}


def _opentelemetry_option(
    setting: str, value: str, values: dict[str, Any], resource: list[str]
) -> None:
    """An ``opentelemetry,<setting>=<value>`` option: url, resource (appended to
    ``resource``), the batch export's sizes and delays, export_timeout."""
    if setting == "url":
        values["url"] = value
    elif setting == "resource":
        if "=" not in value or value.startswith("="):
            raise TraceConfigError(f"opentelemetry,resource must be <key>=<value>, got '{value}'")
        resource.append(value)
    elif setting in _OTEL_INTS:
        name, low = _OTEL_INTS[setting]
        values[name] = _int_option(setting, value, low, U32_MAX)
    else:
        raise TraceConfigError(
            f"unknown opentelemetry trace setting '{setting}' (known: url, resource, "
            "bsp_max_queue_size, bsp_schedule_delay, bsp_max_export_batch_size, "
            "export_timeout)"
        )
