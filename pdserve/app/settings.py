"""Every ``pdserve serve`` flag, its default and its check, in one place.

:class:`Settings` is the whole configuration of a serving process. Each field is
one flag: its default is the field's default, and the field's metadata gives the
flag's name, help and argparse options, so :func:`add_arguments` declares the
flags from the fields and :meth:`Settings.from_namespace` reads them back with no
second copy of any default (a flag not given is not in the namespace: each
flag's argparse default is ``argparse.SUPPRESS``). The defaults that are also a
frontend's own (``DEFAULT_MAX_REQUEST_BYTES``...) are that frontend's constants.

Flag names follow ``tritonserver``'s where they exist (``--model-repository``,
``--http-port``, ``--grpc-port``, ``--metrics-port``, ``--strict-readiness``,
``--exit-timeout-secs``, ``--log-verbose``, ``--log-info``, ``--log-warning``,
``--log-error``, ``--log-format`` (``json`` is pdserve's own format), ``--model-control-mode``,
``--load-model``, ``--repository-poll-secs``, ``--host-policy``,
``--allow-grpc``, ``--allow-metrics``, ``--allow-gpu-metrics``,
``--allow-cpu-metrics``, ``--allow-client-shm``, ``--response-cache-byte-size``, ``--cache-config``), with
``--host`` defaulting to 127.0.0.1 (Triton binds 0.0.0.0; pdserve listens on
loopback unless told).

:meth:`Settings.validate` checks every value, and the combinations, before
anything starts; a bad one raises :class:`SettingsError` naming the flag, which
the CLI turns into an argparse error (exit code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.backends.host_policy import HostPolicyError, parse_option, resolve_policy
from pdserve.cache import RedisCacheOptions, parse_cache_config, parse_redis_cache_config
from pdserve.config import DEFAULT_MAX_INSTANCE_COUNT
from pdserve.core.procmem import parse_size
from pdserve.frontends.grpc.codec import DEFAULT_MAX_MESSAGE_BYTES
from pdserve.frontends.grpc.engine import GRPC_SERVERS, GrpcKeepalive, default_grpc_server
from pdserve.frontends.http.app import (
    DEFAULT_BODY_TIMEOUT_SECS,
    DEFAULT_MAX_JSON_BYTES,
    DEFAULT_MAX_REQUEST_BYTES,
)
from pdserve.frontends.http.server import (
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_HEADER_TIMEOUT_SECS,
    DEFAULT_IDLE_TIMEOUT_SECS,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADER_COUNT,
    DEFAULT_WRITE_TIMEOUT_SECS,
    HttpLimits,
)
from pdserve.frontends.traffic.apis import RestrictedApiError, parse_restricted
from pdserve.observability.logs import FORMATS as LOG_FORMATS
from pdserve.observability.trace_config import TraceConfig, TraceConfigError, parse_trace_config
from pdserve.repository.control import EXPLICIT_MODES, MODES
from pdserve.repository.remote_store import default_cache_dir, is_remote_url

#: The example repository that ``examples/build.py`` builds (``--model-repository``'s default).
EXAMPLE_REPOSITORY = Path(__file__).resolve().parents[2] / "examples" / "model_repository"

#: The largest gRPC message size grpc accepts (a signed 32-bit int; Triton's maximum).
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1

#: ``--http-server`` choices: pdserve's native HTTP/1.1 transport, or the ASGI app on uvicorn.
HTTP_SERVERS = ("native", "asgi")


def default_http_server() -> str:
    """``--http-server``'s default: ``$PDSERVE_HTTP_SERVER`` when set (so a whole test
    suite can run on either transport), else ``native``."""
    return os.environ.get("PDSERVE_HTTP_SERVER", "").strip() or "native"


#: Help sections of ``pdserve serve --help``, in order.
GROUPS = (
    "server",
    "logging",
    "HTTP",
    "gRPC",
    "metrics",
    "model control",
    "response cache",
    "traffic control",
    "tracing",
)


class SettingsError(ValueError):
    """A serve flag has a bad value, or flags do not go together.

    Attributes:
        flag: the flag at fault, e.g. ``--http-port``.
        message: what is wrong with it.

    ``str()`` is argparse's form: ``argument --http-port: <message>``.
    """

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag
        self.message = message


class HostPolicyAction(argparse.Action):
    """``--host-policy NAME,SETTING=VALUE`` (repeatable): collect and check host policies.

    The namespace attribute holds ``policy name -> {setting: value}``; options with
    the same name merge (a later value of a setting wins), as in Triton. Each
    option is checked as soon as it is read (its syntax, the setting, and the cores
    of the merged policy: see :func:`pdserve.backends.host_policy.resolve_policy`), so a bad
    one is an argparse error (exit code 2) naming the option.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        policies: dict[str, dict[str, str]] = dict(getattr(namespace, self.dest, None) or {})
        try:
            name, setting, value = parse_option(str(values))
            settings = {**policies.get(name, {}), setting: value}
            resolve_policy(name, settings)
        except HostPolicyError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        policies[name] = settings
        setattr(namespace, self.dest, policies)


def parse_bool(text: str) -> bool:
    """A boolean flag value as tritonserver reads one: true/false, 1/0, on/off, yes/no.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = text.strip().lower()
    if value in ("true", "1", "on", "yes"):
        return True
    if value in ("false", "0", "off", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class TritonBoolAction(argparse.BooleanOptionalAction):
    """An on/off flag that takes both spellings: pdserve's ``--allow-grpc`` /
    ``--no-allow-grpc`` and tritonserver's ``--allow-grpc=false`` (any value
    :func:`parse_bool` reads; a value may also follow as the next argument).

    Raises (through the parser, exit status 2): a value :func:`parse_bool` does not
    read, or a value after the ``--no-`` form.
    """

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("metavar", "BOOL")
        super().__init__(option_strings, dest, **kwargs)
        self.nargs = "?"  # the base class takes no value

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        negative = option_string is not None and option_string.startswith("--no-")
        if values is None:
            setattr(namespace, self.dest, not negative)
            return
        if negative:
            parser.error(f"argument {option_string}: takes no value (got {values!r})")
        try:
            setattr(namespace, self.dest, parse_bool(values))
        except argparse.ArgumentTypeError as e:
            parser.error(f"argument {option_string}: {e}")


class ServeHelpFormatter(argparse.HelpFormatter):
    """``pdserve serve --help``: a :class:`TritonBoolAction` flag is listed as
    ``--allow-grpc [BOOL], --no-allow-grpc`` (the negative form takes no value)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, TritonBoolAction):
            return ", ".join(
                o if o.startswith("--no-") else f"{o} [{action.metavar}]"
                for o in action.option_strings
            )
        return super()._format_action_invocation(action)


def _size(text: str) -> int:
    """argparse type of a size flag: ``2GiB``, ``512MiB``, ``1.5GB``, bytes."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _repository_arg(text: str) -> Path | str:
    """``--model-repository``: a URL (``scheme://...``) stays a string, else a Path."""
    return text if is_remote_url(text) else Path(text)


def _flag(
    name: str, default: Any, group: str, help: str, factory: Any = None, **argparse_options: Any
) -> Any:
    """A :class:`Settings` field that is the flag ``name``.

    ``help`` may say ``{default}``: it is replaced by the default, written for people
    (see :func:`show_default`). ``factory`` replaces ``default`` for mutable defaults.
    """
    assert group in GROUPS, group
    metadata = {"flag": name, "group": group, "help": help, "argparse": argparse_options}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Settings:
    """The configuration of ``pdserve serve``: one field per flag, defaults declared here only.

    Build it from parsed arguments with :meth:`from_namespace` (which validates), or
    directly (library use; call :meth:`validate` before serving). Sizes are bytes,
    durations seconds.
    """

    # -- server ------------------------------------------------------------------------
    model_repository: Path | str | None = _flag(
        "--model-repository",
        None,
        "server",
        "model repository folder, or an fsspec URL (s3://bucket/prefix, gs://..., "
        "file://...) served from a local cache (see --model-repository-cache) "
        "(default: the example repository built by examples/build.py)",
        type=_repository_arg,
    )
    model_repository_cache: Path | None = _flag(
        "--model-repository-cache",
        None,
        "server",
        "local cache folder of a --model-repository URL (default: "
        "$XDG_CACHE_HOME/pdserve/repositories/<hash of the URL>, ~/.cache when unset)",
        type=Path,
    )
    host: str = _flag("--host", "127.0.0.1", "server", "address to listen on (default {default})")
    log_verbose: int = _flag(
        "--log-verbose",
        0,
        "logging",
        "verbose logging level: 0 (info) or 1+ (debug) (default {default})",
        type=int,
    )
    exit_timeout_secs: float = _flag(
        "--exit-timeout-secs",
        30.0,
        "server",
        "on SIGTERM/SIGINT, seconds to wait for in-flight requests (default {default})",
        type=float,
    )
    strict_readiness: bool = _flag(
        "--strict-readiness",
        False,
        "server",
        "report not-ready while any model meant to be loaded is not ready (default {default})",
        action=TritonBoolAction,
    )
    max_instance_count: int = _flag(
        "--max-instance-count",
        DEFAULT_MAX_INSTANCE_COUNT,
        "server",
        "most model instances one model may ask for in its instance_group (all groups; "
        "a KIND_GPU group counts count x GPUs); more fails the load (default {default}; "
        "Triton has no limit)",
        type=int,
    )
    host_policy: Mapping[str, Mapping[str, str]] = _flag(
        "--host-policy",
        None,
        "server",
        "host policy, as in tritonserver (repeatable): SETTING is cpu-cores (e.g. "
        "cpu-cores=0-3,5) or numa-node (e.g. numa-node=0: that node's CPUs; memory is not "
        "bound to the node, Python cannot); both settings: their intersection. Instances "
        "of a group whose host_policy is NAME run pinned to those cores; a group without "
        "host_policy uses 'cpu' (KIND_CPU), 'gpu_<id>' (KIND_GPU) or 'model' (KIND_MODEL), "
        "so --host-policy cpu,cpu-cores=0 pins every CPU instance. A group naming a policy "
        "not given fails to load",
        factory=dict,
        action=HostPolicyAction,
        metavar="NAME,SETTING=VALUE",
    )

    # -- logging (Triton's flags; --log-format json is pdserve's) -------------------------
    log_info: bool = _flag(
        "--log-info",
        True,
        "logging",
        "write INFO lines (default {default})",
        type=parse_bool,
        metavar="BOOL",
    )
    log_warning: bool = _flag(
        "--log-warning",
        True,
        "logging",
        "write WARNING lines (default {default})",
        type=parse_bool,
        metavar="BOOL",
    )
    log_error: bool = _flag(
        "--log-error",
        True,
        "logging",
        "write ERROR lines (default {default})",
        type=parse_bool,
        metavar="BOOL",
    )
    log_format: str = _flag(
        "--log-format",
        "default",
        "logging",
        "log line format: default, ISO8601 (Triton's) or json (one JSON object a line, "
        "with request_id and trace_id) (default '{default}')",
        choices=LOG_FORMATS,
    )

    # -- HTTP ---------------------------------------------------------------------------
    http_port: int = _flag(
        "--http-port", 8000, "HTTP", "V2 HTTP port (default {default})", type=int
    )
    http_server: str = _flag(
        "--http-server",
        default_http_server(),
        "HTTP",
        "HTTP transport: native (pdserve's own HTTP/1.1 server on uvloop + httptools, "
        "calling the handlers directly: the fastest) or asgi (the V2 ASGI app on "
        "uvicorn); the environment variable PDSERVE_HTTP_SERVER, when set, is the "
        "default (default {default})",
        choices=HTTP_SERVERS,
    )
    max_request_bytes: int = _flag(
        "--max-request-bytes",
        DEFAULT_MAX_REQUEST_BYTES,
        "HTTP",
        "largest HTTP request body accepted, after decompression (default {default})",
        type=int,
    )
    http_body_timeout_secs: float = _flag(
        "--http-body-timeout-secs",
        DEFAULT_BODY_TIMEOUT_SECS,
        "HTTP",
        "longest wait for the next piece of an HTTP request body before answering 408 "
        "and closing the connection; 0 waits forever (default {default})",
        type=float,
    )
    http_body_min_bytes_per_sec: float = _flag(
        "--http-body-min-bytes-per-sec",
        DEFAULT_BODY_MIN_RATE,
        "HTTP",
        "least average rate of an HTTP request body: after --http-body-timeout-secs, a "
        "body must keep arriving at this many bytes per second on average since its "
        "headers, or it gets 408 and the connection closes (a body dripped just within "
        "the body timeout cannot hold a connection for long); 0: no minimum "
        "(default {default})",
        type=float,
    )
    http_max_json_bytes: int = _flag(
        "--http-max-json-bytes",
        DEFAULT_MAX_JSON_BYTES,
        "HTTP",
        "largest JSON part of an HTTP inference request, in bytes (the whole body when "
        "it has no binary tensor data); larger ones get 413. Parsing JSON tensor data "
        "takes 5-20x its size in memory, binary data none (default {default})",
        type=int,
    )
    http_max_header_bytes: int = _flag(
        "--http-max-header-bytes",
        DEFAULT_MAX_HEADER_BYTES,
        "HTTP",
        "largest request line + headers of an HTTP request, in bytes; larger ones get "
        "431 and the connection is closed (default {default})",
        type=int,
    )
    http_max_header_count: int = _flag(
        "--http-max-header-count",
        DEFAULT_MAX_HEADER_COUNT,
        "HTTP",
        "most header fields in an HTTP request; more get 431 and the connection is "
        "closed (default {default})",
        type=int,
    )
    http_header_timeout_secs: float = _flag(
        "--http-header-timeout-secs",
        DEFAULT_HEADER_TIMEOUT_SECS,
        "HTTP",
        "longest time from an HTTP request's first byte to the end of its headers before "
        "answering 408 and closing the connection; 0 waits forever (default {default})",
        type=float,
    )
    http_idle_timeout_secs: float = _flag(
        "--http-idle-timeout-secs",
        DEFAULT_IDLE_TIMEOUT_SECS,
        "HTTP",
        "close an HTTP connection that has had no request in progress for this many "
        "seconds (new or kept alive); 0 keeps it open (default {default})",
        type=float,
    )
    http_write_timeout_secs: float = _flag(
        "--http-write-timeout-secs",
        DEFAULT_WRITE_TIMEOUT_SECS,
        "HTTP",
        "native transport: abort an HTTP connection whose client has read none of its "
        "buffered responses for this many seconds while the server waits to write "
        "(nginx's send_timeout); 0 waits forever (default {default})",
        type=float,
    )
    http_max_connections: int = _flag(
        "--http-max-connections",
        0,
        "HTTP",
        "most HTTP connections open at once; a new one over the limit gets 503 and is "
        "closed at once. 0: half the open-file limit (ulimit -n) (default {default})",
        type=int,
    )
    http_workers: int = _flag(
        "--http-workers",
        1,
        "HTTP",
        "HTTP front-end processes on --http-port (SO_REUSEPORT). 1: the server process "
        "serves HTTP itself. N > 1: N worker processes decode requests and hand tensors "
        "to the server process through shared memory; models, batching, statistics and "
        "metrics stay in the server process, and a worker that dies is restarted "
        "(default {default})",
        type=int,
    )

    # -- gRPC ---------------------------------------------------------------------------
    allow_grpc: bool = _flag(
        "--allow-grpc",
        True,
        "gRPC",
        "serve the V2 gRPC protocol on --grpc-port (default {default})",
        action=TritonBoolAction,
    )
    grpc_port: int = _flag(
        "--grpc-port", 8001, "gRPC", "V2 gRPC port (default {default})", type=int
    )
    allow_client_shm: bool = _flag(
        "--allow-client-shm",
        False,
        "server",
        "let clients register system shared-memory regions (/dev/shm) and send inputs "
        "and receive outputs through them, over HTTP and gRPC; off by default, as in "
        "Triton since 26.04 (default {default}; --allow-client-shm=true as tritonserver)",
        type=parse_bool,
        nargs="?",
        const=True,
        metavar="BOOL",
    )
    grpc_server: str = _flag(
        "--grpc-server",
        default_grpc_server(),
        "gRPC",
        "gRPC server: 'native' (pdserve's own HTTP/2 transport on the event loop; least CPU "
        "per call), "
        "'threads' (grpcio's synchronous server, handlers run on the event loop) or "
        "'aio' (grpc.aio); same service either way "
        "(default {default}; $PDSERVE_GRPC_SERVER, when set, is the default)",
        choices=GRPC_SERVERS,
    )
    grpc_max_message_bytes: int = _flag(
        "--grpc-max-message-bytes",
        DEFAULT_MAX_MESSAGE_BYTES,
        "gRPC",
        "largest gRPC message received or sent, in bytes (default {default}; "
        "Triton uses 2147483647)",
        type=int,
    )

    grpc_keepalive_time: int = _flag(
        "--grpc-keepalive-time",
        GrpcKeepalive.time_ms,
        "gRPC",
        "milliseconds with nothing received after which the server sends a keepalive PING "
        "on a gRPC connection (Triton's flag, grpc core's GRPC_ARG_KEEPALIVE_TIME_MS; "
        "default {default}: 2 hours)",
        type=int,
    )
    grpc_keepalive_timeout: int = _flag(
        "--grpc-keepalive-timeout",
        GrpcKeepalive.timeout_ms,
        "gRPC",
        "milliseconds the server waits for a keepalive PING's acknowledgement before it "
        "closes the connection (GRPC_ARG_KEEPALIVE_TIMEOUT_MS; default {default})",
        type=int,
    )
    grpc_keepalive_permit_without_calls: bool = _flag(
        "--grpc-keepalive-permit-without-calls",
        GrpcKeepalive.permit_without_calls,
        "gRPC",
        "send keepalive PINGs, and allow the client's at --grpc-http2-min-recv-ping-"
        "interval-without-data, also on connections with no call open (otherwise a client "
        "may PING an idle connection every 2 hours at most) "
        "(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS; default {default})",
        type=parse_bool,
        nargs="?",
        const=True,
    )
    grpc_http2_max_pings_without_data: int = _flag(
        "--grpc-http2-max-pings-without-data",
        GrpcKeepalive.max_pings_without_data,
        "gRPC",
        "most keepalive PINGs the server sends while it sends no data or headers; 0: no "
        "limit (GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA; default {default})",
        type=int,
    )
    grpc_http2_min_recv_ping_interval_without_data: int = _flag(
        "--grpc-http2-min-recv-ping-interval-without-data",
        GrpcKeepalive.min_recv_ping_interval_ms,
        "gRPC",
        "least milliseconds between a client's PINGs with no data or headers received "
        "between them; a sooner PING is a ping strike "
        "(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; default {default}: 5 minutes)",
        type=int,
    )
    grpc_http2_max_ping_strikes: int = _flag(
        "--grpc-http2-max-ping-strikes",
        GrpcKeepalive.max_ping_strikes,
        "gRPC",
        "ping strikes tolerated; one more and the connection gets GOAWAY ENHANCE_YOUR_CALM "
        "('too_many_pings') and is closed; 0: any number "
        "(GRPC_ARG_HTTP2_MAX_PING_STRIKES; default {default})",
        type=int,
    )

    # -- metrics ------------------------------------------------------------------------
    allow_metrics: bool = _flag(
        "--allow-metrics",
        True,
        "metrics",
        "serve Prometheus metrics on --metrics-port (default {default})",
        action=TritonBoolAction,
    )
    metrics_port: int = _flag(
        "--metrics-port", 8002, "metrics", "Prometheus metrics port (default {default})", type=int
    )
    allow_gpu_metrics: bool = _flag(
        "--allow-gpu-metrics",
        True,
        "metrics",
        "GPU metrics through NVML when a GPU is present (default {default})",
        action=TritonBoolAction,
    )
    allow_cpu_metrics: bool = _flag(
        "--allow-cpu-metrics",
        True,
        "metrics",
        "CPU and memory metrics (default {default})",
        action=TritonBoolAction,
    )

    # -- model control ------------------------------------------------------------------
    model_control_mode: str = _flag(
        "--model-control-mode",
        "none",
        "model control",
        "none: load everything at start, ignore changes; poll: also pick up added, "
        "removed and changed models every --repository-poll-secs; explicit: load only "
        "--load-model models, then what the repository API asks; on_demand: explicit, "
        "and a request for a model not loaded loads it (default {default})",
        choices=MODES,
    )
    load_models: tuple[str, ...] | None = _flag(
        "--load-model",
        None,
        "model control",
        "explicit / on_demand mode: a model to load at start (repeatable; '*' loads all)",
        action="append",
        metavar="NAME",
    )
    model_memory_budget: int | None = _flag(
        "--model-memory-budget",
        None,
        "model control",
        "explicit / on_demand mode: host memory the loaded models may take together, "
        "e.g. 2GiB or 512MiB; a load unloads the least recently used idle models to "
        "stay under it (default: no budget)",
        type=_size,
        metavar="SIZE",
    )
    pin_models: tuple[str, ...] = _flag(
        "--pin-model",
        (),
        "model control",
        "explicit / on_demand mode: a model loaded at start that the memory budget "
        "never unloads (repeatable)",
        action="append",
        metavar="NAME",
    )
    model_load_wait_secs: float = _flag(
        "--model-load-wait-secs",
        120.0,
        "model control",
        "on_demand mode: seconds a request waits for its model to load when it gives "
        "no timeout parameter (default {default})",
        type=float,
    )
    repository_poll_secs: float = _flag(
        "--repository-poll-secs",
        15.0,
        "model control",
        "poll mode: seconds between repository scans (default {default})",
        type=float,
    )
    version_ready_marker: str = _flag(
        "--version-ready-marker",
        "",
        "model control",
        "publish-by-marker: a version folder is only a version once a file of this name "
        "(e.g. READY) exists in it; removing it from the serving version rolls back to "
        "the previous one on the next poll or load (default: off, every numeric folder "
        "is a version)",
        metavar="FILENAME",
    )

    # -- response cache -----------------------------------------------------------------
    response_cache_byte_size: int = _flag(
        "--response-cache-byte-size",
        0,
        "response cache",
        "size in bytes of the response cache used by models with "
        "response_cache { enable: true } (default {default}: no cache)",
        type=int,
    )
    cache_config: tuple[str, ...] = _flag(
        "--cache-config",
        (),
        "response cache",
        "Triton's form of the response cache: local,size=N (it wins over "
        "--response-cache-byte-size), or a Redis cache shared by replicas: "
        "redis,host=H,port=P[,user=,password=,db=,connect_timeout=MS,socket_timeout=MS,"
        "pool_size=,ttl=SECS,prefix=] (repeatable, as Triton's)",
        action="append",
        metavar="local,size=N|redis,KEY=VALUE",
    )

    # -- traffic control (issue 12) -------------------------------------------------------
    auth_config: Path | None = _flag(
        "--auth-config",
        None,
        "traffic control",
        "auth config file (YAML/JSON): API keys (sha256/scrypt hashes or env vars), JWT "
        "(JWKS file, audience, issuer, leeway), what each may use, rate limits; reloaded "
        "when it changes and on SIGHUP. See README 'Auth, rate limits, circuit breaker'",
        type=Path,
        metavar="FILE",
    )
    http_restricted_api: tuple[str, ...] = _flag(
        "--http-restricted-api",
        (),
        "traffic control",
        "as in tritonserver (repeatable): requests to these APIs need the header KEY: VALUE "
        "(APIs: health, metadata, inference, shared-memory, model-config, model-repository, "
        "statistics, trace, logging)",
        action="append",
        metavar="API,...:KEY=VALUE",
    )
    grpc_restricted_protocol: tuple[str, ...] = _flag(
        "--grpc-restricted-protocol",
        (),
        "traffic control",
        "as in tritonserver (repeatable): RPCs of these APIs need the metadata "
        "triton-grpc-protocol-KEY: VALUE",
        action="append",
        metavar="API,...:KEY=VALUE",
    )
    rate_limit_storage: str = _flag(
        "--rate-limit-storage",
        "memory://",
        "traffic control",
        "where rate-limit counters live: memory:// (this process) or redis://HOST:PORT[/DB] "
        "(shared by every replica using it) (default {default})",
        metavar="URI",
    )
    rate_limit_strategy: str = _flag(
        "--rate-limit-strategy",
        "auto",
        "traffic control",
        "rate-limit algorithm: auto (a token bucket in memory, the limits library's "
        "moving-window in Redis), token-bucket (memory only), or one of the limits "
        "library's moving-window, sliding-window-counter, fixed-window (default {default})",
        choices=("auto", "token-bucket", "moving-window", "sliding-window-counter", "fixed-window"),
    )
    rate_limit_fail_mode: str = _flag(
        "--rate-limit-fail-mode",
        "open",
        "traffic control",
        "when the rate-limit storage (Redis) fails: open lets requests through, closed "
        "answers 503 (default {default})",
        choices=("open", "closed"),
    )
    circuit_breaker: str | None = _flag(
        "--circuit-breaker",
        None,
        "traffic control",
        "a circuit breaker on every model version, e.g. on or consecutive_failures=5,"
        "failure_rate=0.5,window_secs=10,min_requests=20,open_secs=5,half_open_probes=1; "
        "a model's config.pbtxt parameter circuit_breaker overrides it (off: none) "
        "(default: only models with that parameter)",
        metavar="SPEC",
    )

    # -- tracing ------------------------------------------------------------------------
    trace_config: tuple[str, ...] = _flag(
        "--trace-config",
        (),
        "tracing",
        "Triton's trace setting, repeatable: rate=N, level=OFF|TIMESTAMPS, count=N, "
        "mode=opentelemetry, opentelemetry,url=<OTLP/HTTP endpoint>, "
        "opentelemetry,resource=<key>=<value>, opentelemetry,bsp_schedule_delay=<ms>... "
        "(default: level OFF, rate 1000; needs pip install 'pdserve[tracing]' to trace)",
        action="append",
        metavar="[MODE,]SETTING=VALUE",
    )

    # -- construction and checks --------------------------------------------------------

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> Settings:
        """The settings of a namespace parsed by a parser :func:`add_arguments` built,
        validated.

        A flag absent from ``args`` keeps its field's default; lists (repeatable
        flags) become tuples; other attributes (``command``, ``run``) are ignored.

        Raises:
            SettingsError: a bad value or combination (see :meth:`validate`).
        """
        given = vars(args)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in given:
                value = given[f.name]
                values[f.name] = tuple(value) if isinstance(value, list) else value
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Check every value and the combinations of flags.

        Raises:
            SettingsError: naming the first flag at fault: a port outside 0-65535,
                two enabled listeners on one port, a negative or non-finite timeout,
                a size out of range, an instance limit below 1, a bad ``--cache-config``, ``--load-model``
                without ``--model-control-mode=explicit``, a poll interval that is
                not positive in poll mode, a host policy naming cores this process
                cannot use, or a model repository that is not a folder.
        """
        if self.log_verbose < 0:
            raise SettingsError("--log-verbose", f"must be >= 0, got {self.log_verbose}")
        if self.max_instance_count < 1:
            raise SettingsError(
                "--max-instance-count", f"must be >= 1, got {self.max_instance_count}"
            )
        if self.http_server not in HTTP_SERVERS:
            raise SettingsError(
                "--http-server",
                f"must be one of {', '.join(HTTP_SERVERS)} (also in PDSERVE_HTTP_SERVER), "
                f"got {self.http_server!r}",
            )
        listeners = [("--http-port", "HTTP", self.http_port, True)]
        listeners.append(("--grpc-port", "gRPC", self.grpc_port, self.allow_grpc))
        listeners.append(("--metrics-port", "metrics", self.metrics_port, self.allow_metrics))
        used: dict[int, tuple[str, str]] = {}
        for flag, what, port, enabled in listeners:
            if not 0 <= port <= 65535:
                raise SettingsError(flag, f"must be a port number 0-65535, got {port}")
            if not enabled or port == 0:
                continue
            if port in used:
                other_flag, other = used[port]
                raise SettingsError(
                    flag,
                    f"the server cannot listen to {other} requests and {what} requests at "
                    f"the same port {port} ({other_flag})",
                )
            used[port] = (flag, what)
        for flag, secs in (
            ("--exit-timeout-secs", self.exit_timeout_secs),
            ("--http-body-timeout-secs", self.http_body_timeout_secs),
            ("--http-header-timeout-secs", self.http_header_timeout_secs),
            ("--http-idle-timeout-secs", self.http_idle_timeout_secs),
            ("--http-write-timeout-secs", self.http_write_timeout_secs),
        ):
            if not (math.isfinite(secs) and secs >= 0):
                raise SettingsError(flag, f"must be a number of seconds >= 0, got {secs}")
        rate = self.http_body_min_bytes_per_sec
        if not (math.isfinite(rate) and rate >= 0):
            raise SettingsError(
                "--http-body-min-bytes-per-sec", f"must be a number of bytes >= 0, got {rate}"
            )
        if self.max_request_bytes <= 0:
            raise SettingsError(
                "--max-request-bytes", f"must be > 0 bytes, got {self.max_request_bytes}"
            )
        for flag, count, least, unit in (
            ("--http-max-json-bytes", self.http_max_json_bytes, 1, " bytes"),
            ("--http-max-header-bytes", self.http_max_header_bytes, 256, " bytes"),
            ("--http-max-header-count", self.http_max_header_count, 1, ""),
            ("--http-max-connections", self.http_max_connections, 0, ""),
            ("--http-workers", self.http_workers, 1, ""),
        ):
            if count < least:
                raise SettingsError(flag, f"must be >= {least}{unit}, got {count}")
        if not 0 < self.grpc_max_message_bytes <= MAX_GRPC_MESSAGE_BYTES:
            raise SettingsError(
                "--grpc-max-message-bytes",
                f"must be 1-{MAX_GRPC_MESSAGE_BYTES} bytes, got {self.grpc_max_message_bytes}",
            )
        for flag, count in (
            ("--grpc-keepalive-time", self.grpc_keepalive_time),
            ("--grpc-keepalive-timeout", self.grpc_keepalive_timeout),
            (
                "--grpc-http2-min-recv-ping-interval-without-data",
                self.grpc_http2_min_recv_ping_interval_without_data,
            ),
        ):
            if count < 1:
                raise SettingsError(flag, f"must be >= 1 millisecond, got {count}")
        for flag, count in (
            ("--grpc-http2-max-pings-without-data", self.grpc_http2_max_pings_without_data),
            ("--grpc-http2-max-ping-strikes", self.grpc_http2_max_ping_strikes),
        ):
            if count < 0:
                raise SettingsError(flag, f"must be >= 0, got {count}")
        if self.grpc_server not in GRPC_SERVERS:
            raise SettingsError(
                "--grpc-server",
                f"must be one of {', '.join(GRPC_SERVERS)} (default from $PDSERVE_GRPC_SERVER), "
                f"got {self.grpc_server!r}",
            )
        if self.response_cache_byte_size < 0:
            raise SettingsError(
                "--response-cache-byte-size",
                f"must be >= 0 bytes, got {self.response_cache_byte_size}",
            )
        self.redis_cache_options  # noqa: B018 - validates the redis values
        if self.response_cache_bytes < 0:
            raise SettingsError(
                "--cache-config", f"size must be >= 0 bytes, got {self.response_cache_bytes}"
            )
        if self.model_control_mode not in MODES:
            raise SettingsError(
                "--model-control-mode",
                f"invalid choice: {self.model_control_mode!r} (choose from {', '.join(MODES)})",
            )
        if self.load_models and self.model_control_mode not in EXPLICIT_MODES:
            raise SettingsError(
                "--load-model",
                # Triton's words (on_demand accepts it too)
                "Use of '--load-model' requires setting '--model-control-mode=explicit' as well",
            )
        for flag, given in (
            ("--model-memory-budget", self.model_memory_budget is not None),
            ("--pin-model", bool(self.pin_models)),
        ):
            if given and self.model_control_mode not in EXPLICIT_MODES:
                raise SettingsError(
                    flag,
                    f"requires --model-control-mode=on_demand or explicit (models are "
                    f"unloaded to stay within the budget; mode "
                    f"'{self.model_control_mode}' loads every model)",
                )
        if self.model_memory_budget is not None and self.model_memory_budget <= 0:
            raise SettingsError(
                "--model-memory-budget", f"must be > 0 bytes, got {self.model_memory_budget}"
            )
        if not (math.isfinite(self.model_load_wait_secs) and self.model_load_wait_secs > 0):
            raise SettingsError(
                "--model-load-wait-secs",
                f"must be a number of seconds > 0, got {self.model_load_wait_secs}",
            )
        if self.model_control_mode == "poll" and not (
            math.isfinite(self.repository_poll_secs) and self.repository_poll_secs > 0
        ):
            raise SettingsError(
                "--repository-poll-secs",
                f"must be > 0 in poll mode, got {self.repository_poll_secs}",
            )
        marker = self.version_ready_marker
        if marker and (marker in (".", "..") or any(c in marker for c in "/\\\0")):
            raise SettingsError(
                "--version-ready-marker", f"must be a plain file name, got {marker!r}"
            )
        try:
            self.host_policies()
        except HostPolicyError as e:
            raise SettingsError("--host-policy", str(e)) from None
        self.validate_traffic()
        self.tracing()
        if self.remote_repository_url is not None:
            try:
                import fsspec  # noqa: F401 - the remote-repo extra
            except ImportError as e:
                raise SettingsError(
                    "--model-repository",
                    f"a repository URL needs fsspec (pip install 'pdserve[remote-repo]'): {e}",
                ) from None
        elif not self.repository.is_dir():
            hint = " (build it with `python examples/build.py`)"
            raise SettingsError(
                "--model-repository",
                f"model repository {self.repository} does not exist or is not a folder"
                + (hint if self.model_repository is None else ""),
            )

    def validate_traffic(self) -> None:
        """Check the traffic-control flags (the auth config file itself is read at start).

        Raises:
            SettingsError: a malformed restricted-API group, storage URI, breaker spec,
                or an auth config file that does not exist.
        """
        from pdserve.frontends.traffic.ratelimit import RateLimitConfigError, check_storage_uri
        from pdserve.repository.breaker import BreakerPolicy, BreakerSpecError

        for flag, options in (
            ("--http-restricted-api", self.http_restricted_api),
            ("--grpc-restricted-protocol", self.grpc_restricted_protocol),
        ):
            try:
                parse_restricted(options, flag)
            except RestrictedApiError as e:
                raise SettingsError(flag, str(e)) from None
        try:
            check_storage_uri(self.rate_limit_storage)
        except RateLimitConfigError as e:
            raise SettingsError("--rate-limit-storage", str(e)) from None
        if self.rate_limit_strategy == "token-bucket" and self.rate_limit_storage != "memory://":
            raise SettingsError(
                "--rate-limit-strategy",
                "token-bucket keeps its state in memory; with Redis use moving-window, "
                "sliding-window-counter or fixed-window",
            )
        if self.circuit_breaker is not None:
            try:
                BreakerPolicy.parse(self.circuit_breaker)
            except BreakerSpecError as e:
                raise SettingsError("--circuit-breaker", str(e)) from None
        if self.auth_config is not None and not self.auth_config.is_file():
            raise SettingsError(
                "--auth-config", f"auth config file {self.auth_config} does not exist"
            )

    # -- what the flags mean --------------------------------------------------------------

    @property
    def http_limits(self) -> HttpLimits:
        """The HTTP connection limits (``--http-max-header-bytes``,
        ``--http-max-header-count``, ``--http-header-timeout-secs``,
        ``--http-idle-timeout-secs``, ``--http-write-timeout-secs``,
        ``--http-max-connections``)."""
        return HttpLimits(
            max_header_bytes=self.http_max_header_bytes,
            max_header_count=self.http_max_header_count,
            header_timeout=self.http_header_timeout_secs,
            idle_timeout=self.http_idle_timeout_secs,
            max_connections=self.http_max_connections,
            body_min_rate=self.http_body_min_bytes_per_sec,
            write_timeout=self.http_write_timeout_secs,
        )

    @property
    def grpc_keepalive(self) -> GrpcKeepalive:
        """The gRPC keepalive settings (``--grpc-keepalive-*``, ``--grpc-http2-*``)."""
        return GrpcKeepalive(
            time_ms=self.grpc_keepalive_time,
            timeout_ms=self.grpc_keepalive_timeout,
            permit_without_calls=self.grpc_keepalive_permit_without_calls,
            max_pings_without_data=self.grpc_http2_max_pings_without_data,
            min_recv_ping_interval_ms=self.grpc_http2_min_recv_ping_interval_without_data,
            max_ping_strikes=self.grpc_http2_max_ping_strikes,
        )

    @property
    def repository(self) -> Path:
        """The model repository served: ``--model-repository`` or the example repository."""
        url = self.remote_repository_url
        if url is not None:
            return self.remote_repository_cache / "repository"
        if isinstance(self.model_repository, Path):
            return self.model_repository
        return EXAMPLE_REPOSITORY

    @property
    def remote_repository_url(self) -> str | None:
        """The ``--model-repository`` URL when it is one (served from a local cache)."""
        return self.model_repository if isinstance(self.model_repository, str) else None

    @property
    def remote_repository_cache(self) -> Path:
        """The cache folder of a repository URL (``--model-repository-cache`` or the
        default of :func:`pdserve.repository.remote_store.default_cache_dir`)."""
        if self.model_repository_cache is not None:
            return self.model_repository_cache
        return default_cache_dir(str(self.model_repository))

    @property
    def response_cache_bytes(self) -> int:
        """The response cache size in bytes (0: no cache): ``--cache-config``'s size when
        it gives one, else ``--response-cache-byte-size``.

        Raises:
            SettingsError: ``--cache-config`` is malformed.
        """
        try:
            size = parse_cache_config(list(self.cache_config)) if self.cache_config else 0
        except ValueError as e:
            message = str(e).removeprefix("--cache-config: ")
            raise SettingsError("--cache-config", message) from None
        return size or self.response_cache_byte_size

    @property
    def redis_cache_options(self) -> RedisCacheOptions | None:
        """The Redis response cache (``--cache-config redis,...``), or None.

        Raises:
            SettingsError: a malformed ``redis`` value, or a local size given too.
        """
        try:
            options = parse_redis_cache_config(list(self.cache_config))
        except ValueError as e:
            raise SettingsError("--cache-config", str(e).removeprefix("--cache-config: ")) from None
        if options is not None and self.response_cache_byte_size:
            raise SettingsError(
                "--cache-config",
                "a redis cache and --response-cache-byte-size (a local cache) exclude each other",
            )
        return options

    @property
    def startup_models(self) -> list[str] | None:
        """The models loaded at start: None (every model in the repository) except in
        explicit and on_demand mode, where it is the ``--load-model`` and
        ``--pin-model`` names (none given: no model; ``*``: every model)."""
        if self.model_control_mode not in EXPLICIT_MODES:
            return None
        names = (*(self.load_models or ()), *self.pin_models)
        if "*" in names:
            return None
        return list(dict.fromkeys(names))

    def tracing(self) -> TraceConfig:
        """The ``--trace-config`` options, parsed (Triton's ``--trace-config``).

        Raises:
            SettingsError: a malformed option, an unknown setting or a bad value.
        """
        try:
            return parse_trace_config(self.trace_config)
        except TraceConfigError as e:
            raise SettingsError("--trace-config", str(e)) from None

    def host_policies(self) -> dict[str, frozenset[int]]:
        """The ``--host-policy`` options as ``policy name -> CPU ids``.

        Raises:
            pdserve.backends.host_policy.HostPolicyError: a policy names cores this
                process cannot use (now; its affinity mask may have changed since
                the options were read).
        """
        return {name: resolve_policy(name, dict(s)) for name, s in self.host_policy.items()}


def show_default(value: Any) -> str:
    """A default as ``--help`` writes it: ``on`` / ``off``, ``30`` for 30.0, ``64 MiB``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every :class:`Settings` field as a flag of ``parser`` (``pdserve serve``),
    in help sections (:data:`GROUPS`).

    Every flag's argparse default is ``argparse.SUPPRESS``: a flag not given leaves no
    attribute, and :meth:`Settings.from_namespace` keeps the field's default.
    """
    groups = {name: parser.add_argument_group(f"{name} options") for name in GROUPS}
    for f in dataclasses.fields(Settings):
        meta = f.metadata
        default = None if f.default is dataclasses.MISSING else f.default
        help_text = meta["help"].replace("{default}", show_default(default))
        groups[meta["group"]].add_argument(
            meta["flag"],
            dest=f.name,
            default=argparse.SUPPRESS,
            help=help_text,
            **meta["argparse"],
        )
