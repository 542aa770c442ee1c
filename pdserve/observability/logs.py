"""Log lines and Triton's logging extension.

One process-wide :class:`LogState` decides which lines are written (``log_info``,
``log_warning``, ``log_error``, ``log_verbose_level``) and how (``log_format``:
Triton's ``default`` and ``ISO8601``, or pdserve's ``json``, one object a line). Every
line written while a request is handled carries its request id and trace id
(:mod:`pdserve.core.context`; the frontends set them:
:func:`pdserve.frontends.admission.begin_request`).

Triton's logging extension (``/v2/logging``, gRPC ``LogSettings``) reads and changes
the same settings (:func:`settings_dict`, :func:`update_settings`) with Triton's names,
types and semantics (``log_file``: the ``--log-file`` lines are appended to, ``""`` for
stderr; fixed at start), and an unknown name is refused so a typo is not lost. :class:`RedactFilter` masks
``Authorization``/``Bearer`` credentials a message might carry.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TextIO

from pdserve.core import context
from pdserve.core.errors import InferError

#: The values ``log_format`` / ``--log-format`` take: Triton's two, and ``json``.
FORMATS = ("default", "ISO8601", "json")

#: Settings names of the logging extension (Triton's), in the order answers list them.
SETTING_NAMES = (
    "log_file",
    "log_info",
    "log_warning",
    "log_error",
    "log_verbose_level",
    "log_format",
)

_UINT32_MAX = 2**32 - 1

#: The file the log is appended to (``--log-file`` or the logging extension); "": stderr.
_LOG_FILE = ""

_SECRET = re.compile(
    r"(?i)\b(authorization\s*[:=]\s*(?:(?:bearer|basic|digest)\s+)?|bearer\s+"
    r"|(?:token|api[-_]?key|password|secret)\s*[:=]\s*)([^\s,;\"']+)"
)


@dataclass
class LogState:
    """The logging extension's settings (Triton's names and types)."""

    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"


#: The settings in force in this process.
STATE = LogState()


# -- formatting ----------------------------------------------------------------------


class ContextFilter(logging.Filter):
    """Adds ``request_id`` and ``trace_id`` (or None) to every record, from the context."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Annotate ``record``; never drops it."""
        if not hasattr(record, "request_id"):
            record.request_id = context.request_id.get()
        if not hasattr(record, "trace_id"):
            record.trace_id = context.trace_id.get()
        return True


class LevelFilter(logging.Filter):
    """Drops the records the current :data:`STATE` turns off (by level)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """True when ``record``'s level is switched on."""
        level = record.levelno
        s = STATE
        if level >= logging.ERROR:
            return s.log_error
        if level >= logging.WARNING:
            return s.log_warning
        if level >= logging.INFO:
            return s.log_info
        return s.log_verbose_level > 0


class RedactFilter(logging.Filter):
    """Masks credentials (``Authorization: ...``, ``Bearer ...``, ``token=...``) in the
    message: a defence in depth; pdserve itself never logs headers or payloads."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite ``record.msg`` when the rendered message holds a credential."""
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is logging's problem
            return True
        if _SECRET.search(message):
            record.msg = _SECRET.sub(lambda m: f"{m.group(1)}<redacted>", message)
            record.args = None
        return True


def _suffix(record: logging.LogRecord) -> str:
    rid = getattr(record, "request_id", None)
    tid = getattr(record, "trace_id", None)
    if rid is None and tid is None:
        return ""
    parts = []
    if rid is not None:
        parts.append(f"request_id={rid}")
    if tid is not None:
        parts.append(f"trace_id={tid}")
    return " [" + " ".join(parts) + "]"


class TextFormatter(logging.Formatter):
    """``default`` and ``ISO8601`` lines, with the request/trace id suffix."""

    def __init__(self, iso8601: bool) -> None:
        super().__init__("%(asctime)s %(levelname).1s %(name)s: %(message)s")
        self.iso8601 = iso8601

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        """ISO 8601 UTC with milliseconds, or logging's default local time."""
        if not self.iso8601:
            return super().formatTime(record, datefmt)
        t = time.gmtime(record.created)
        return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        """The line (exception text on the lines after it), then the id suffix."""
        text = super().format(record)
        suffix = _suffix(record)
        if not suffix:
            return text
        first, nl, rest = text.partition("\n")
        return first + suffix + nl + rest


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (ISO 8601 UTC), ``level``, ``logger``, ``pid``,
    ``message``, and ``request_id`` / ``trace_id`` / ``exception`` when present."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        t = time.gmtime(record.created)
        doc: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            doc["request_id"] = rid
        tid = getattr(record, "trace_id", None)
        if tid is not None:
            doc["trace_id"] = tid
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exception"] = record.exc_text
        return json.dumps(doc, ensure_ascii=False, default=str)


def _formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    return TextFormatter(iso8601=fmt == "ISO8601")


_HANDLER: logging.StreamHandler[TextIO] | None = None


def configure(
    state: LogState | None = None, stream: TextIO | None = None, log_file: str = ""
) -> logging.Handler:
    """Install pdserve's handler on the root logger (replacing logging's
    ``basicConfig`` one), writing to ``stream`` (default stderr; ``log_file``: the
    path ``stream`` was opened from, reported by the logging extension), with
    ``state``'s settings (default: :data:`STATE`).

    Returns:
        The handler (its filters: context, level, redaction).

    Raises:
        InferError(INVALID_ARG): a setting of ``state`` is not valid.
    """
    global _HANDLER, _LOG_FILE
    _LOG_FILE = log_file if stream is not None else ""
    if state is not None:
        update_settings(asdict(state))
    root = logging.getLogger()
    if _HANDLER is not None:
        root.removeHandler(_HANDLER)
    for h in list(root.handlers):
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (
            sys.stderr,
            sys.stdout,
        ):
            root.removeHandler(h)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(ContextFilter())
    handler.addFilter(LevelFilter())
    handler.addFilter(RedactFilter())
    handler.setFormatter(_formatter(STATE.log_format))
    root.addHandler(handler)
    _HANDLER = handler
    _apply()
    return handler


def _apply() -> None:
    """Make the root level and the handler's format follow :data:`STATE`."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if STATE.log_verbose_level > 0 else logging.INFO)
    if _HANDLER is not None:
        _HANDLER.setFormatter(_formatter(STATE.log_format))


# -- the logging extension -------------------------------------------------------------


def settings_dict() -> dict[str, object]:
    """The current settings, as the logging extension answers them (Triton's shape:
    ``{"log_file": str, "log_info": bool, "log_warning": bool, "log_error": bool,
    "log_verbose_level": int, "log_format": str}``; ``log_file`` ``""``: stderr)."""
    return {"log_file": _LOG_FILE, **asdict(STATE)}


def _check(name: str, value: object) -> bool | int | str:
    if name in ("log_info", "log_warning", "log_error"):
        if type(value) is not bool:
            raise InferError(f"log setting '{name}' must be a boolean, got {_kind(value)}")
        return value
    if name == "log_verbose_level":
        if type(value) is not int or not 0 <= value <= _UINT32_MAX:
            raise InferError(
                f"log setting '{name}' must be an unsigned integer (0-{_UINT32_MAX}), "
                f"got {_kind(value)}"
            )
        return value
    if name == "log_format":
        if type(value) is not str:
            raise InferError(f"log setting '{name}' must be a string, got {_kind(value)}")
        if value not in FORMATS:
            raise InferError(
                f"log setting '{name}' must be one of {', '.join(FORMATS)}, got {value!r}"
            )
        return value
    if name == "log_file":
        if type(value) is not str:
            raise InferError(f"log setting '{name}' must be a string, got {_kind(value)}")
        if value != _LOG_FILE:
            where = repr(_LOG_FILE) if _LOG_FILE else "stderr"
            raise InferError(
                f"log setting 'log_file' cannot be changed at run time: the log goes to "
                f"{where} (--log-file at start); a request may not make the server write "
                "a file of its choosing"
            )
        return value
    raise InferError(f"unknown log setting {name!r}; the settings are {', '.join(SETTING_NAMES)}")


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if type(value) is bool:
        return f"boolean {str(value).lower()}"
    if type(value) is int:
        return f"integer {value}"
    if type(value) is float:
        return f"number {value!r}"
    if type(value) is str:
        return f"string {value!r}"
    if type(value) is list:
        return "an array"
    if type(value) is dict:
        return "an object"
    return type(value).__name__


def update_settings(changes: Mapping[str, object]) -> dict[str, object]:
    """Apply ``changes`` (some of the settings, Triton's names and JSON types) and
    return all settings (:func:`settings_dict`).

    All or nothing: every value is checked before any is applied.

    Raises:
        InferError(INVALID_ARG): an unknown name, a value of the wrong type (a bool
            that is not ``true``/``false``, a ``log_verbose_level`` that is not an
            integer 0-4294967295, a ``log_format`` not in :data:`FORMATS`), or a
            ``log_file`` other than the current one (Triton moves the log; pdserve
            does not let a request choose a file the server writes). Nothing is changed
            then.
    """
    checked = {name: _check(name, value) for name, value in changes.items()}
    for name, value in checked.items():
        if name != "log_file":
            setattr(STATE, name, value)
    _apply()
    return settings_dict()


def state_from_flags(*, info: bool, warning: bool, error: bool, verbose: int, fmt: str) -> LogState:
    """A :class:`LogState` from the ``--log-*`` flags of ``pdserve serve``."""
    return LogState(
        log_info=info,
        log_warning=warning,
        log_error=error,
        log_verbose_level=verbose,
        log_format=fmt,
    )
