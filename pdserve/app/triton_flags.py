"""tritonserver's command line as ``pdserve serve`` and ``tritonserver`` take it.

:data:`TRITONSERVER_FLAGS` is every flag of tritonserver's ``--help`` (2.50 to 2.7x,
from its ``src/command_line_parser.cc``). Most are :class:`~pdserve.app.serve_flags.
ServeFlags` fields; the deprecated ``--trace-*`` flags become ``--trace-config``
settings (:class:`TraceFlagAction`); the rest (:data:`IGNORED`) are accepted, their
values checked as tritonserver checks them, and logged once at start-up as ignored,
with why (:func:`log_ignored`). :func:`flag_rows` / :func:`markdown_table` describe
each flag from the parser itself, for the docs.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from .flag_syntax import FlagAction, TritonBoolAction, parse_bool

_N = TypeVar("_N", int, float)

#: Every flag of ``tritonserver --help``, in its order (2.71; 2.50 lacks
#: --grpc-infer-thread-count, --grpc-max-response-pool-size, --http-max-input-size
#: and --allow-client-shm).
TRITONSERVER_FLAGS = (
    "--help", "--id", "--exit-timeout-secs",
    "--log-verbose", "--log-info", "--log-warning", "--log-error", "--log-format", "--log-file",
    "--model-store", "--model-repository", "--exit-on-error", "--disable-auto-complete-config",
    "--strict-readiness", "--model-control-mode", "--repository-poll-secs", "--load-model",
    "--model-config-name", "--model-load-thread-count", "--model-load-retry-count",
    "--model-namespacing", "--enable-peer-access",
    "--allow-http", "--http-address", "--http-port", "--reuse-http-port",
    "--http-header-forward-pattern", "--http-thread-count", "--http-max-input-size",
    "--http-restricted-api",
    "--allow-grpc", "--grpc-address", "--grpc-port", "--reuse-grpc-port",
    "--grpc-header-forward-pattern", "--grpc-infer-thread-count",
    "--grpc-infer-allocation-pool-size", "--grpc-max-response-pool-size", "--grpc-use-ssl",
    "--grpc-use-ssl-mutual", "--grpc-server-cert", "--grpc-server-key", "--grpc-root-cert",
    "--grpc-infer-response-compression-level", "--grpc-keepalive-time",
    "--grpc-keepalive-timeout", "--grpc-keepalive-permit-without-calls",
    "--grpc-http2-max-pings-without-data", "--grpc-http2-min-recv-ping-interval-without-data",
    "--grpc-http2-max-ping-strikes", "--grpc-max-connection-age",
    "--grpc-max-connection-age-grace", "--grpc-restricted-protocol",
    "--allow-sagemaker", "--sagemaker-port", "--sagemaker-safe-port-range",
    "--sagemaker-thread-count",
    "--allow-vertex-ai", "--vertex-ai-port", "--vertex-ai-thread-count",
    "--vertex-ai-default-model",
    "--allow-metrics", "--allow-gpu-metrics", "--allow-cpu-metrics", "--metrics-address",
    "--metrics-port", "--metrics-interval-ms", "--metrics-config",
    "--trace-config",
    "--backend-directory", "--backend-config",
    "--repoagent-directory",
    "--cache-config", "--cache-directory",
    "--rate-limit", "--rate-limit-resource",
    "--pinned-memory-pool-byte-size", "--cuda-memory-pool-byte-size",
    "--cuda-virtual-address-size", "--min-supported-compute-capability",
    "--buffer-manager-thread-count", "--host-policy", "--model-load-gpu-limit",
    "--allow-client-shm",
    "--strict-model-config", "--response-cache-byte-size", "--trace-file", "--trace-level",
    "--trace-rate", "--trace-count", "--trace-log-frequency",
)  # fmt: skip

#: tritonserver flags that another pdserve flag does (the docs' notes).
MAPPED = {
    "--model-store": "another name of --model-repository",
    "--http-max-input-size": "another name of --max-request-bytes (same meaning, 64 MiB default)",
    "--strict-model-config": "=true is --disable-auto-complete-config (deprecated in Triton too)",
    "--trace-file": "--trace-config triton,file=PATH (refused: pdserve exports OpenTelemetry)",
    "--trace-level": "--trace-config level=LEVEL",
    "--trace-rate": "--trace-config rate=N",
    "--trace-count": "--trace-config count=N",
    "--trace-log-frequency": "--trace-config triton,log-frequency=N",
}

#: Notes on implemented tritonserver flags, where pdserve's differs or adds.
NOTES = {
    "--help": "also -h",
    "--id": "the server metadata's name (default: pdserve; tritonserver: triton)",
    "--log-verbose": "an integer, or true / false",
    "--log-format": "default or ISO8601, and pdserve's json",
    "--model-repository": "one repository (a second, different one is refused); also a URL",
    "--exit-on-error": "default: false for pdserve serve, true for tritonserver",
    "--strict-readiness": "default: false for pdserve serve, true for tritonserver",
    "--disable-auto-complete-config": "config.pbtxt required and complete (inputs, outputs, "
    "max_batch_size, dynamic_batching are not filled in)",
    "--model-control-mode": "none, poll, explicit in any case, and pdserve's on_demand",
    "--load-model": "repeatable; with --model-control-mode=explicit (or on_demand)",
    "--backend-config": "default-max-batch-size (for every backend or onnxruntime's) is "
    "ONNX auto-complete's max_batch_size; other settings: logged as ignored",
    "--http-address": "default: --host (127.0.0.1 for pdserve serve, 0.0.0.0 for tritonserver)",
    "--grpc-address": "default: --host",
    "--metrics-address": "default: the HTTP address",
    "--log-file": "appended to; stderr without it",
}


def _number(kind: Callable[[str], _N]) -> Callable[[str], _N]:
    """A number value read by ``kind`` (``int``, ``float``), refused as tritonserver does."""

    def parse(text: str) -> _N:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"Invalid option value. Got {text}") from None

    return parse


_int = _number(int)
_float = _number(float)


def _bool(text: str) -> bool:
    return parse_bool(text)


def _text(text: str) -> str:
    return text


def _pair(first: Callable[[str], object], sep: str, second: Callable[[str], object]) -> Any:
    """A ``<first><sep><second>`` value (tritonserver's ``ParsePairOption``)."""

    def parse(text: str) -> tuple[object, object]:
        a, found, b = text.partition(sep)
        if not found:
            raise argparse.ArgumentTypeError(f"expected <first>{sep}<second>, got {text!r}")
        return first(a), second(b)

    return parse


def _ranged(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = _int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in the range {low} to {high}, got {value}")
        return value

    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text.lower()

    return parse


def _setting(text: str) -> tuple[str, str]:
    """``<setting>=<value>`` (``--metrics-config``)."""
    setting, found, value = text.partition("=")
    if not found or not setting or not value or "," in setting:
        raise argparse.ArgumentTypeError(f"format is <setting>=<value>, got {text!r}")
    return setting, value


def backend_setting(text: str) -> tuple[str, str, str]:
    """``--backend-config``'s value: ``<backend>,<setting>=<value>``, or
    ``<setting>=<value>`` for every backend (tritonserver's ``ParseBackendConfigOption``).

    Returns:
        (backend or "", setting, value).

    Raises:
        argparse.ArgumentTypeError: no ``=``, or an empty setting.
    """
    head, found, value = text.partition("=")
    backend, comma, setting = head.rpartition(",")
    if not found or not setting:
        raise argparse.ArgumentTypeError(
            f"format is <backend_name>,<setting>=<value> or <setting>=<value>, got {text!r}"
        )
    return (backend if comma else ""), setting, value


@dataclass(frozen=True)
class IgnoredFlag:
    """A tritonserver flag pdserve accepts and does not act on.

    Attributes:
        parse: checks the value as tritonserver does (a bad one exits 2).
        reason: why it is ignored (the start-up log line and the docs say it).
        harmless: for a flag whose feature pdserve lacks, the value that asks for
            nothing (None: any value is harmless); another value is logged as a
            WARNING, not INFO.
        repeatable: tritonserver takes it more than once.
    """

    parse: Callable[[str], object]
    reason: str
    harmless: object = None
    repeatable: bool = False
    metavar: str = ""

    def warns(self, text: str) -> bool:
        """Whether the value ``text`` asks for what pdserve lacks (a WARNING)."""
        return self.harmless is not None and self.parse(text) != self.harmless

    def warning_note(self) -> str:
        """When a value is logged as a WARNING, for the docs ('' when never)."""
        if self.harmless is None:
            return ""
        if self.harmless is NEVER_HARMLESS:
            return "any value: WARNING"
        return f"a value other than {str(self.harmless).lower() or 'empty'}: WARNING"


#: :attr:`IgnoredFlag.harmless` of a flag whose every value asks for a missing feature.
NEVER_HARMLESS = object()


_NO_GPU_POOLS = "pdserve's backends allocate their own device memory (no server-side pools)"
_EVENT_LOOP = "pdserve serves HTTP and gRPC on an event loop, not a thread pool"
_NO_SAGEMAKER = "pdserve has no SageMaker front end"
_NO_VERTEX = "pdserve has no Vertex AI front end"

#: The tritonserver flags pdserve accepts and ignores, with why.
IGNORED: dict[str, IgnoredFlag] = {
    "--model-config-name": IgnoredFlag(
        _text, "custom configuration names (configs/<name>.pbtxt) are not supported", ""
    ),
    "--model-load-thread-count": IgnoredFlag(
        _int, "pdserve loads models concurrently on its event loop and worker threads"
    ),
    "--model-load-retry-count": IgnoredFlag(
        _int, "a failed load is not retried (load it again through the repository API)", 0
    ),
    "--model-namespacing": IgnoredFlag(
        _bool, "model namespacing is not supported: model names are unique", False
    ),
    "--enable-peer-access": IgnoredFlag(_bool, "CUDA peer access is the backends' own"),
    "--reuse-http-port": IgnoredFlag(
        _bool, "SO_REUSEPORT is used only among pdserve's own --http-workers", False
    ),
    "--http-header-forward-pattern": IgnoredFlag(
        _text, "HTTP headers are not forwarded as request parameters", ""
    ),
    "--http-thread-count": IgnoredFlag(_int, _EVENT_LOOP + " (--http-workers: processes)"),
    "--reuse-grpc-port": IgnoredFlag(_bool, "gRPC listens without SO_REUSEPORT", False),
    "--grpc-header-forward-pattern": IgnoredFlag(
        _text, "gRPC metadata is not forwarded as request parameters", ""
    ),
    "--grpc-infer-thread-count": IgnoredFlag(_ranged(2, 128), _EVENT_LOOP, metavar="<integer>"),
    "--grpc-infer-allocation-pool-size": IgnoredFlag(
        _int, "pdserve keeps no pool of request/response states"
    ),
    "--grpc-max-response-pool-size": IgnoredFlag(
        _ranged(1, 2**31 - 1), "pdserve keeps no pool of response objects", metavar="<integer>"
    ),
    "--grpc-infer-response-compression-level": IgnoredFlag(
        _choice("none", "low", "medium", "high"),
        "gRPC responses are sent uncompressed",
        "none",
        metavar="none|low|medium|high",
    ),
    "--grpc-max-connection-age": IgnoredFlag(
        _int,
        "gRPC connections have no maximum age (GRPC_ARG_MAX_CONNECTION_AGE_MS)",
        NEVER_HARMLESS,
    ),
    "--grpc-max-connection-age-grace": IgnoredFlag(
        _int, "gRPC connections have no maximum age, so no grace either"
    ),
    "--allow-sagemaker": IgnoredFlag(_bool, _NO_SAGEMAKER, False),
    "--sagemaker-port": IgnoredFlag(_int, _NO_SAGEMAKER),
    "--sagemaker-safe-port-range": IgnoredFlag(
        _pair(_int, "-", _int), _NO_SAGEMAKER, metavar="<integer>-<integer>"
    ),
    "--sagemaker-thread-count": IgnoredFlag(_int, _NO_SAGEMAKER),
    "--allow-vertex-ai": IgnoredFlag(_bool, _NO_VERTEX, False),
    "--vertex-ai-port": IgnoredFlag(_int, _NO_VERTEX),
    "--vertex-ai-thread-count": IgnoredFlag(_int, _NO_VERTEX),
    "--vertex-ai-default-model": IgnoredFlag(_text, _NO_VERTEX),
    "--metrics-interval-ms": IgnoredFlag(
        _float, "pdserve computes every metric when /metrics is scraped: always current"
    ),
    "--metrics-config": IgnoredFlag(
        _setting,
        "metric settings (summary_latencies, summary_quantiles...) are not supported",
        repeatable=True,
        metavar="<string>=<string>",
    ),
    "--backend-directory": IgnoredFlag(_text, "pdserve's backends are built in (no .so files)"),
    "--repoagent-directory": IgnoredFlag(_text, "pdserve loads no repository agents"),
    "--cache-directory": IgnoredFlag(_text, "pdserve's caches are built in (no .so files)"),
    "--pinned-memory-pool-byte-size": IgnoredFlag(_int, _NO_GPU_POOLS),
    "--cuda-memory-pool-byte-size": IgnoredFlag(
        _pair(_int, ":", _int), _NO_GPU_POOLS, repeatable=True, metavar="<integer>:<integer>"
    ),
    "--cuda-virtual-address-size": IgnoredFlag(
        _pair(_int, ":", _int),
        "implicit state lives in host memory",
        repeatable=True,
        metavar="<integer>:<integer>",
    ),
    "--min-supported-compute-capability": IgnoredFlag(
        _float, "the backends (ONNX Runtime, PyTorch) pick the GPUs they can use"
    ),
    "--buffer-manager-thread-count": IgnoredFlag(
        _int, "tensors are copied by the thread that handles them"
    ),
    "--model-load-gpu-limit": IgnoredFlag(
        _pair(_int, ":", _float),
        "GPU memory is not checked before a load (--model-memory-budget bounds host memory)",
        repeatable=True,
        metavar="<device_id>:<fraction>",
    ),
}


class IgnoredFlagAction(FlagAction):
    """A flag of :data:`IGNORED`: check its value, then note ``(flag, value)`` in
    the namespace's ``ignored_flags`` list for :func:`log_ignored`."""

    def take(self, namespace: argparse.Namespace, values: Any, option_string: str | None) -> None:
        name = self.option_strings[0]
        IGNORED[name].parse(str(values))
        noted = list(getattr(namespace, "ignored_flags", None) or [])
        if not IGNORED[name].repeatable:
            noted = [(f, v) for f, v in noted if f != name]  # the last one wins
        noted.append((name, str(values)))
        namespace.ignored_flags = noted


class TraceFlagAction(FlagAction):
    """tritonserver's deprecated ``--trace-file/-level/-rate/-count/-log-frequency``:
    appended to ``--trace-config`` as the setting Triton's deprecation message names."""

    SETTINGS = {
        "--trace-file": "triton,file=",
        "--trace-level": "level=",
        "--trace-rate": "rate=",
        "--trace-count": "count=",
        "--trace-log-frequency": "triton,log-frequency=",
    }

    def take(self, namespace: argparse.Namespace, values: Any, option_string: str | None) -> None:
        options = list(getattr(namespace, "trace_config", None) or [])
        options.append(self.SETTINGS[self.option_strings[0]] + str(values))
        namespace.trace_config = options


#: tritonserver's help words for the values of the plain kinds.
_METAVARS: dict[Callable[[str], object], str] = {
    _int: "<integer>",
    _float: "<float>",
    _bool: "<boolean>",
    _text: "<string>",
}


def add_compat_flags(group: argparse._ArgumentGroup) -> None:
    """Declare the flags of :data:`IGNORED` and the deprecated ``--trace-*`` flags."""
    for name, spec in IGNORED.items():
        group.add_argument(
            name,
            action=IgnoredFlagAction,
            dest="ignored_flags",
            default=argparse.SUPPRESS,
            metavar=spec.metavar or _METAVARS[spec.parse],
            help=f"accepted and ignored: {spec.reason}",
        )
    for name, setting in TraceFlagAction.SETTINGS.items():
        group.add_argument(
            name,
            action=TraceFlagAction,
            dest="trace_config",
            default=argparse.SUPPRESS,
            metavar="<string>" if name in ("--trace-file", "--trace-level") else "<integer>",
            help=f"deprecated in tritonserver: --trace-config {setting}VALUE",
        )


#: Why a ``--backend-config`` setting pdserve does not know is ignored.
BACKEND_SETTING_IGNORED = (
    "pdserve's backends take their settings from each model's config.pbtxt parameters"
)


def log_ignored(flags: Iterable[tuple[str, str]], log: logging.Logger) -> None:
    """One line per ignored flag given: INFO, or WARNING when its value asks for a
    feature pdserve lacks (``--allow-sagemaker=true``); each ``--backend-config``
    setting on its own line."""
    for name, value in flags:
        log.log(
            logging.WARNING if IGNORED[name].warns(value) else logging.INFO,
            "%s=%s ignored: %s",
            name,
            value,
            IGNORED[name].reason,
        )


@dataclass(frozen=True)
class FlagRow:
    """One tritonserver flag as pdserve takes it: ``status`` is ``implemented``,
    ``mapped`` (another pdserve flag does it), ``ignored``, or ``missing`` (the
    parser lacks it); ``note`` says how or why."""

    flag: str
    status: str
    note: str


def flag_rows(parser: argparse.ArgumentParser) -> list[FlagRow]:
    """Every flag of :data:`TRITONSERVER_FLAGS` as ``parser`` (``pdserve serve``'s or
    ``tritonserver``'s) takes it, in tritonserver's order."""
    actions = {o: a for a in parser._actions for o in a.option_strings}
    rows = []
    for name in TRITONSERVER_FLAGS:
        action = actions.get(name)
        if action is None:
            rows.append(FlagRow(name, "missing", "not accepted"))
        elif isinstance(action, IgnoredFlagAction):
            spec = IGNORED[name]
            warning = spec.warning_note()
            rows.append(
                FlagRow(name, "ignored", spec.reason + (f" ({warning})" if warning else ""))
            )
        elif name in MAPPED:
            rows.append(FlagRow(name, "mapped", MAPPED[name]))
        elif action.option_strings[0] != name and name != "--help":
            rows.append(FlagRow(name, "mapped", f"another name of {action.option_strings[0]}"))
        else:
            note = NOTES.get(name, "")
            if isinstance(action, TritonBoolAction):
                note = "; ".join(n for n in (note, "also bare (true)") if n)
            rows.append(FlagRow(name, "implemented", note))
    return rows


def markdown_table(parser: argparse.ArgumentParser) -> str:
    """:func:`flag_rows` as a Markdown table (flag, status, note)."""
    lines = ["| tritonserver flag | pdserve | note |", "| --- | --- | --- |"]
    for r in flag_rows(parser):
        note = r.note.replace("|", "\\|")
        lines.append(f"| `{r.flag}` | {r.status} | {note} |")
    return "\n".join(lines) + "\n"
