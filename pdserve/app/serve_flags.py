"""Every ``pdserve serve`` flag, its default and its help, in one place: one field of
:class:`ServeFlags` per flag (:func:`~pdserve.app.flag_syntax.flag`). The defaults
that are also a frontend's own (``DEFAULT_MAX_REQUEST_BYTES``...) are that frontend's
constants.

Flag names follow ``tritonserver``'s where Triton has the flag (``--model-repository``,
``--http-port``, ``--log-verbose``, ``--model-control-mode``, ``--allow-grpc``,
``--cache-config``...), with ``--host`` defaulting to 127.0.0.1 (Triton binds 0.0.0.0;
pdserve listens on loopback unless told). What the values mean and whether they are
valid is :class:`pdserve.app.settings.Settings`'s job.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import DEFAULT_MAX_INSTANCE_COUNT
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
)
from pdserve.observability.logs import FORMATS as LOG_FORMATS
from pdserve.repository.control import MODES
from pdserve.repository.remote_store import is_remote_url
from pdserve.scheduling.rate_limiter import MODES as RATE_LIMIT_MODES
from pdserve.scheduling.rate_limiter import ResourceGrant, parse_resource

from .flag_syntax import (
    HostPolicyAction,
    RepositoryAction,
    TritonBoolAction,
    flag,
    int_bool,
    lower,
    parse_bool,
    path_arg,
    size_arg,
    switch,
)
from .health_flags import HealthFlags

#: ``--http-server`` choices: pdserve's native HTTP/1.1 transport, or the ASGI app on uvicorn.
HTTP_SERVERS = ("native", "asgi")


def default_http_server() -> str:
    """``--http-server``'s default: ``$PDSERVE_HTTP_SERVER`` when set (so a whole test
    suite can run on either transport), else ``native``."""
    return os.environ.get("PDSERVE_HTTP_SERVER", "").strip() or "native"


def rate_limit_resource_arg(text: str) -> ResourceGrant:
    """``--rate-limit-resource NAME:COUNT[:DEVICE]`` (argparse type: a bad one exits 2)."""
    try:
        return parse_resource(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def repository_arg(text: str) -> Path | str:
    """``--model-repository``: a URL (``scheme://...``) stays a string, else a Path.

    Raises:
        argparse.ArgumentTypeError: an empty value (``Path("")`` is the working folder).
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a folder or a URL, got {text!r}")
    return text if is_remote_url(text) else Path(text)


@dataclass(frozen=True)
class ServeFlags(HealthFlags):
    """One field per ``pdserve serve`` flag, defaults declared here only. Sizes are
    bytes, durations seconds."""

    # -- server ------------------------------------------------------------------------
    model_repository: Path | str | None = flag(
        "--model-repository",
        None,
        "server",
        "model repository folder, or an fsspec URL (s3://bucket/prefix, gs://..., "
        "file://...) served from a local cache (see --model-repository-cache); "
        "--model-store is tritonserver's other name for it (pdserve serve's default: the "
        "example repository built by examples/build.py; tritonserver requires it)",
        type=repository_arg,
        aliases=("--model-store",),
        action=RepositoryAction,
    )
    model_repository_cache: Path | None = flag(
        "--model-repository-cache",
        None,
        "server",
        "local cache folder of a --model-repository URL (default: "
        "$XDG_CACHE_HOME/pdserve/repositories/<hash of the URL>, ~/.cache when unset)",
        type=path_arg,
    )
    host: str = flag("--host", "127.0.0.1", "server", "address to listen on (default {default})")
    log_verbose: int = flag(
        "--log-verbose",
        0,
        "logging",
        "verbose logging level: 0 (info) or 1+ (debug); true/false as tritonserver "
        "(default {default})",
        type=int_bool,
    )
    exit_timeout_secs: float = flag(
        "--exit-timeout-secs",
        30.0,
        "server",
        "on SIGTERM/SIGINT, seconds to wait for in-flight requests (default {default})",
        type=float,
    )
    strict_readiness: bool = switch(
        "--strict-readiness",
        False,
        "server",
        "report not-ready while any model meant to be loaded is not ready (default {default})",
    )
    max_instance_count: int = flag(
        "--max-instance-count",
        DEFAULT_MAX_INSTANCE_COUNT,
        "server",
        "most model instances one model may ask for in its instance_group (all groups; "
        "a KIND_GPU group counts count x GPUs); more fails the load (default {default}; "
        "Triton has no limit)",
        type=int,
    )
    host_policy: Mapping[str, Mapping[str, str]] = flag(
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
    log_info: bool = flag(
        "--log-info",
        True,
        "logging",
        "write INFO lines (default {default})",
        type=parse_bool,
        metavar="BOOL",
    )
    log_warning: bool = flag(
        "--log-warning",
        True,
        "logging",
        "write WARNING lines (default {default})",
        type=parse_bool,
        metavar="BOOL",
    )
    log_error: bool = flag(
        "--log-error",
        True,
        "logging",
        "write ERROR lines (default {default})",
        type=parse_bool,
        metavar="BOOL",
    )
    log_format: str = flag(
        "--log-format",
        "default",
        "logging",
        "log line format: default, ISO8601 (Triton's) or json (one JSON object a line, "
        "with request_id and trace_id) (default '{default}')",
        choices=LOG_FORMATS,
    )

    # -- HTTP ---------------------------------------------------------------------------
    http_port: int = flag("--http-port", 8000, "HTTP", "V2 HTTP port (default {default})", type=int)
    http_server: str = flag(
        "--http-server",
        default_http_server(),
        "HTTP",
        "HTTP transport: native (pdserve's own HTTP/1.1 server on uvloop + httptools, "
        "calling the handlers directly: the fastest) or asgi (the V2 ASGI app on "
        "uvicorn); the environment variable PDSERVE_HTTP_SERVER, when set, is the "
        "default (default {default})",
        choices=HTTP_SERVERS,
    )
    max_request_bytes: int = flag(
        "--max-request-bytes",
        DEFAULT_MAX_REQUEST_BYTES,
        "HTTP",
        "largest HTTP request body accepted, after decompression (default {default}); "
        "--http-max-input-size is tritonserver's name for it",
        type=int,
        aliases=("--http-max-input-size",),
    )
    http_body_timeout_secs: float = flag(
        "--http-body-timeout-secs",
        DEFAULT_BODY_TIMEOUT_SECS,
        "HTTP",
        "longest wait for the next piece of an HTTP request body before answering 408 "
        "and closing the connection; 0 waits forever (default {default})",
        type=float,
    )
    http_body_min_bytes_per_sec: float = flag(
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
    http_max_json_bytes: int = flag(
        "--http-max-json-bytes",
        DEFAULT_MAX_JSON_BYTES,
        "HTTP",
        "largest JSON part of an HTTP inference request, in bytes (the whole body when "
        "it has no binary tensor data); larger ones get 413. Parsing JSON tensor data "
        "takes 5-20x its size in memory, binary data none (default {default})",
        type=int,
    )
    http_max_header_bytes: int = flag(
        "--http-max-header-bytes",
        DEFAULT_MAX_HEADER_BYTES,
        "HTTP",
        "largest request line + headers of an HTTP request, in bytes; larger ones get "
        "431 and the connection is closed (default {default})",
        type=int,
    )
    http_max_header_count: int = flag(
        "--http-max-header-count",
        DEFAULT_MAX_HEADER_COUNT,
        "HTTP",
        "most header fields in an HTTP request; more get 431 and the connection is "
        "closed (default {default})",
        type=int,
    )
    http_header_timeout_secs: float = flag(
        "--http-header-timeout-secs",
        DEFAULT_HEADER_TIMEOUT_SECS,
        "HTTP",
        "longest time from an HTTP request's first byte to the end of its headers before "
        "answering 408 and closing the connection; 0 waits forever (default {default})",
        type=float,
    )
    http_idle_timeout_secs: float = flag(
        "--http-idle-timeout-secs",
        DEFAULT_IDLE_TIMEOUT_SECS,
        "HTTP",
        "close an HTTP connection that has had no request in progress for this many "
        "seconds (new or kept alive); 0 keeps it open (default {default})",
        type=float,
    )
    http_write_timeout_secs: float = flag(
        "--http-write-timeout-secs",
        DEFAULT_WRITE_TIMEOUT_SECS,
        "HTTP",
        "native transport: abort an HTTP connection whose client has read none of its "
        "buffered responses for this many seconds while the server waits to write "
        "(nginx's send_timeout); 0 waits forever (default {default})",
        type=float,
    )
    http_max_connections: int = flag(
        "--http-max-connections",
        0,
        "HTTP",
        "most HTTP connections open at once; a new one over the limit gets 503 and is "
        "closed at once. 0: half the open-file limit (ulimit -n) (default {default})",
        type=int,
    )
    http_workers: int = flag(
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
    allow_grpc: bool = switch(
        "--allow-grpc",
        True,
        "gRPC",
        "serve the V2 gRPC protocol on --grpc-port (default {default})",
    )
    grpc_port: int = flag("--grpc-port", 8001, "gRPC", "V2 gRPC port (default {default})", type=int)
    allow_client_shm: bool = flag(
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
    grpc_server: str = flag(
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
    grpc_max_message_bytes: int = flag(
        "--grpc-max-message-bytes",
        DEFAULT_MAX_MESSAGE_BYTES,
        "gRPC",
        "largest gRPC message received or sent, in bytes (default {default}; "
        "Triton uses 2147483647)",
        type=int,
    )

    grpc_keepalive_time: int = flag(
        "--grpc-keepalive-time",
        GrpcKeepalive.time_ms,
        "gRPC",
        "milliseconds with nothing received after which the server sends a keepalive PING "
        "on a gRPC connection (Triton's flag, grpc core's GRPC_ARG_KEEPALIVE_TIME_MS; "
        "default {default}: 2 hours)",
        type=int,
    )
    grpc_keepalive_timeout: int = flag(
        "--grpc-keepalive-timeout",
        GrpcKeepalive.timeout_ms,
        "gRPC",
        "milliseconds the server waits for a keepalive PING's acknowledgement before it "
        "closes the connection (GRPC_ARG_KEEPALIVE_TIMEOUT_MS; default {default})",
        type=int,
    )
    grpc_keepalive_permit_without_calls: bool = flag(
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
    grpc_http2_max_pings_without_data: int = flag(
        "--grpc-http2-max-pings-without-data",
        GrpcKeepalive.max_pings_without_data,
        "gRPC",
        "most keepalive PINGs the server sends while it sends no data or headers; 0: no "
        "limit (GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA; default {default})",
        type=int,
    )
    grpc_http2_min_recv_ping_interval_without_data: int = flag(
        "--grpc-http2-min-recv-ping-interval-without-data",
        GrpcKeepalive.min_recv_ping_interval_ms,
        "gRPC",
        "least milliseconds between a client's PINGs with no data or headers received "
        "between them; a sooner PING is a ping strike "
        "(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; default {default}: 5 minutes)",
        type=int,
    )
    grpc_http2_max_ping_strikes: int = flag(
        "--grpc-http2-max-ping-strikes",
        GrpcKeepalive.max_ping_strikes,
        "gRPC",
        "ping strikes tolerated; one more and the connection gets GOAWAY ENHANCE_YOUR_CALM "
        "('too_many_pings') and is closed; 0: any number "
        "(GRPC_ARG_HTTP2_MAX_PING_STRIKES; default {default})",
        type=int,
    )

    # -- metrics ------------------------------------------------------------------------
    allow_metrics: bool = switch(
        "--allow-metrics",
        True,
        "metrics",
        "serve Prometheus metrics on --metrics-port (default {default})",
    )
    metrics_port: int = flag(
        "--metrics-port", 8002, "metrics", "Prometheus metrics port (default {default})", type=int
    )
    allow_gpu_metrics: bool = switch(
        "--allow-gpu-metrics",
        True,
        "metrics",
        "GPU metrics through NVML when a GPU is present (default {default})",
    )
    allow_cpu_metrics: bool = switch(
        "--allow-cpu-metrics",
        True,
        "metrics",
        "CPU and memory metrics (default {default})",
    )

    # -- model control ------------------------------------------------------------------
    model_control_mode: str = flag(
        "--model-control-mode",
        "none",
        "model control",
        "none: load everything at start, ignore changes; poll: also pick up added, "
        "removed and changed models every --repository-poll-secs; explicit: load only "
        "--load-model models, then what the repository API asks; on_demand: explicit, "
        "and a request for a model not loaded loads it (default {default})",
        choices=MODES,
        type=lower,
    )
    load_models: tuple[str, ...] | None = flag(
        "--load-model",
        None,
        "model control",
        "explicit / on_demand mode: a model to load at start (repeatable; '*' loads all)",
        action="append",
        metavar="NAME",
    )
    model_memory_budget: int | None = flag(
        "--model-memory-budget",
        None,
        "model control",
        "explicit / on_demand mode: host memory the loaded models may take together, "
        "e.g. 2GiB or 512MiB; a load unloads the least recently used idle models to "
        "stay under it (default: no budget)",
        type=size_arg,
        metavar="SIZE",
    )
    pin_models: tuple[str, ...] = flag(
        "--pin-model",
        (),
        "model control",
        "explicit / on_demand mode: a model loaded at start that the memory budget "
        "never unloads (repeatable)",
        action="append",
        metavar="NAME",
    )
    model_load_wait_secs: float = flag(
        "--model-load-wait-secs",
        120.0,
        "model control",
        "on_demand mode: seconds a request waits for its model to load when it gives "
        "no timeout parameter (default {default})",
        type=float,
    )
    repository_poll_secs: float = flag(
        "--repository-poll-secs",
        15.0,
        "model control",
        "poll mode: seconds between repository scans (default {default})",
        type=float,
    )
    version_ready_marker: str = flag(
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
    response_cache_byte_size: int = flag(
        "--response-cache-byte-size",
        0,
        "response cache",
        "size in bytes of the response cache used by models with "
        "response_cache { enable: true } (default {default}: no cache)",
        type=int,
    )
    cache_config: tuple[str, ...] = flag(
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

    # -- traffic control ----------------------------------------------------------------
    auth_config: Path | None = flag(
        "--auth-config",
        None,
        "traffic control",
        "auth config file (YAML/JSON): API keys (sha256/scrypt hashes or env vars), JWT "
        "(JWKS file, audience, issuer, leeway), what each may use, rate limits; reloaded "
        "when it changes and on SIGHUP. See docs/user-guide/security.md",
        type=path_arg,
        metavar="FILE",
    )
    http_restricted_api: tuple[str, ...] = flag(
        "--http-restricted-api",
        (),
        "traffic control",
        "as in tritonserver (repeatable): requests to these APIs need the header KEY: VALUE "
        "(APIs: health, metadata, inference, shared-memory, model-config, model-repository, "
        "statistics, trace, logging)",
        action="append",
        metavar="API,...:KEY=VALUE",
    )
    grpc_restricted_protocol: tuple[str, ...] = flag(
        "--grpc-restricted-protocol",
        (),
        "traffic control",
        "as in tritonserver (repeatable): RPCs of these APIs need the metadata "
        "triton-grpc-protocol-KEY: VALUE",
        action="append",
        metavar="API,...:KEY=VALUE",
    )
    rate_limit_storage: str = flag(
        "--rate-limit-storage",
        "memory://",
        "traffic control",
        "where rate-limit counters live: memory:// (this process) or redis://HOST:PORT[/DB] "
        "(shared by every replica using it) (default {default})",
        metavar="URI",
    )
    rate_limit_strategy: str = flag(
        "--rate-limit-strategy",
        "auto",
        "traffic control",
        "rate-limit algorithm: auto (a token bucket in memory, the limits library's "
        "moving-window in Redis), token-bucket (memory only), or one of the limits "
        "library's moving-window, sliding-window-counter, fixed-window (default {default})",
        choices=("auto", "token-bucket", "moving-window", "sliding-window-counter", "fixed-window"),
    )
    rate_limit_fail_mode: str = flag(
        "--rate-limit-fail-mode",
        "open",
        "traffic control",
        "when the rate-limit storage (Redis) fails: open lets requests through, closed "
        "answers 503 (default {default})",
        choices=("open", "closed"),
    )
    circuit_breaker: str | None = flag(
        "--circuit-breaker",
        None,
        "traffic control",
        "a circuit breaker on every model version, e.g. on or consecutive_failures=5,"
        "failure_rate=0.5,window_secs=10,min_requests=20,open_secs=5,half_open_probes=1; "
        "a model's config.pbtxt parameter circuit_breaker overrides it (off: none) "
        "(default: only models with that parameter)",
        metavar="SPEC",
    )
    payload_log: str | None = flag(
        "--payload-log",
        None,
        "monitoring",
        "a payload log for every model, e.g. sink=jsonl:/var/log/pdserve,rate=0.01 (see the "
        "monitoring guide); a model's parameter payload_log overrides it (off: none)",
        metavar="SPEC",
    )

    # -- TLS (gRPC: tritonserver's flags; HTTP and metrics: pdserve's, of the same shape) --
    grpc_use_ssl: bool = switch(
        "--grpc-use-ssl",
        False,
        "TLS",
        "serve gRPC over TLS with --grpc-server-cert and --grpc-server-key (ALPN h2); the "
        "files are re-read on SIGHUP and when they change (default {default})",
    )
    grpc_use_ssl_mutual: bool = flag(
        "--grpc-use-ssl-mutual",
        False,
        "TLS",
        "mutual TLS for gRPC: a client must present a certificate signed by "
        "--grpc-root-cert. As in tritonserver, giving it (any value) also sets "
        "--grpc-use-ssl (default {default})",
        action=TritonBoolAction,
        implies="grpc_use_ssl",
    )
    grpc_server_cert: Path | None = flag(
        "--grpc-server-cert",
        None,
        "TLS",
        "PEM file of the gRPC server certificate (chain); ignored unless --grpc-use-ssl",
        type=path_arg,
        metavar="FILE",
    )
    grpc_server_key: Path | None = flag(
        "--grpc-server-key",
        None,
        "TLS",
        "PEM file of the gRPC server's private key; ignored unless --grpc-use-ssl",
        type=path_arg,
        metavar="FILE",
    )
    grpc_root_cert: Path | None = flag(
        "--grpc-root-cert",
        None,
        "TLS",
        "PEM file of the CA certificate(s) that sign client certificates; needed by "
        "--grpc-use-ssl-mutual",
        type=path_arg,
        metavar="FILE",
    )
    http_use_ssl: bool = switch(
        "--http-use-ssl",
        False,
        "TLS",
        "serve HTTP over TLS (HTTPS, ALPN http/1.1) with --http-server-cert and "
        "--http-server-key, on every HTTP transport and --http-workers process; the files "
        "are re-read on SIGHUP and when they change (default {default})",
    )
    http_use_ssl_mutual: bool = flag(
        "--http-use-ssl-mutual",
        False,
        "TLS",
        "mutual TLS for HTTP: a client must present a certificate signed by "
        "--http-root-cert; giving it (any value) also sets --http-use-ssl, as "
        "--grpc-use-ssl-mutual does (default {default})",
        action=TritonBoolAction,
        implies="http_use_ssl",
    )
    http_server_cert: Path | None = flag(
        "--http-server-cert",
        None,
        "TLS",
        "PEM file of the HTTP server certificate (chain); ignored unless --http-use-ssl "
        "or --metrics-use-ssl",
        type=path_arg,
        metavar="FILE",
    )
    http_server_key: Path | None = flag(
        "--http-server-key",
        None,
        "TLS",
        "PEM file of the HTTP server's private key; ignored unless --http-use-ssl or "
        "--metrics-use-ssl",
        type=path_arg,
        metavar="FILE",
    )
    http_root_cert: Path | None = flag(
        "--http-root-cert",
        None,
        "TLS",
        "PEM file of the CA certificate(s) that sign HTTP client certificates; needed by "
        "--http-use-ssl-mutual",
        type=path_arg,
        metavar="FILE",
    )
    metrics_use_ssl: bool = switch(
        "--metrics-use-ssl",
        False,
        "TLS",
        "serve /metrics over TLS with the HTTP listener's files (--http-server-cert, "
        "--http-server-key; client certificates as --http-use-ssl-mutual says), "
        "whether or not HTTP itself uses TLS (default {default}: plain HTTP, as Triton)",
    )

    # -- tracing ------------------------------------------------------------------------
    trace_config: tuple[str, ...] = flag(
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

    # -- rate limiter (tritonserver's) ---------------------------------------------------
    rate_limit: str = flag(
        "--rate-limit",
        "off",
        "rate limiter",
        "off: a model instance runs a batch as soon as it is free; execution_count: only "
        "when the resources its instance_group rate_limiter names are free, waiting "
        "instances served by execution count x priority (default {default})",
        type=str.lower,
        choices=RATE_LIMIT_MODES,
        metavar="MODE",
    )
    rate_limit_resource: tuple[ResourceGrant, ...] = flag(
        "--rate-limit-resource",
        (),
        "rate limiter",
        "copies of a rate limiter resource, repeatable: NAME:COUNT on every device, or "
        "NAME:COUNT:DEVICE (a global resource takes the largest count given for its name); "
        "once one is given, a resource not given has none and a model needing it fails to "
        "load (default: as many as the most any one loaded instance needs)",
        action="append",
        type=rate_limit_resource_arg,
        metavar="NAME:COUNT[:DEVICE]",
    )
    # -- tritonserver's flags (Triton's names; the settings pdserve has) ------------------
    server_id: str = flag(
        "--id",
        "pdserve",
        "server",
        "identifier of this server: the name in the server metadata (default {default})",
        metavar="ID",
    )
    backend_config: tuple[str, ...] = flag(
        "--backend-config",
        (),
        "server",
        "a backend setting, as tritonserver (repeatable): [BACKEND,]SETTING=VALUE. "
        "default-max-batch-size=N (for every backend, or onnxruntime,...) is the "
        "max_batch_size ONNX auto-complete gives a model that can batch (default 4); "
        "other settings are logged as ignored at start",
        action="append",
        metavar="<string>,<string>=<string>",
    )
    exit_on_error: bool = flag(
        "--exit-on-error",
        False,
        "server",
        "exit (status 1) when a model fails to load at start-up, as tritonserver does by "
        "default (default {default})",
        type=parse_bool,
        nargs="?",
        const=True,
        metavar="BOOL",
    )
    disable_auto_complete_config: bool = flag(
        "--disable-auto-complete-config",
        False,
        "model control",
        "no backend auto-complete: every model needs a config.pbtxt naming what it "
        "needs (inputs, outputs, max_batch_size) (default {default})",
        action="store_true",
    )
    strict_model_config: bool | None = flag(
        "--strict-model-config",
        None,
        "model control",
        "tritonserver's deprecated form: true is --disable-auto-complete-config",
        type=parse_bool,
        metavar="BOOL",
    )
    log_file: Path | None = flag(
        "--log-file",
        None,
        "logging",
        "write the log to this file (appended) instead of stderr",
        type=path_arg,
        metavar="FILE",
    )
    allow_http: bool = switch(
        "--allow-http",
        True,
        "HTTP",
        "serve the V2 HTTP protocol on --http-port (default {default})",
    )
    http_address: str | None = flag(
        "--http-address",
        None,
        "HTTP",
        "address the HTTP listener binds (default: --host)",
        metavar="ADDRESS",
    )
    grpc_address: str | None = flag(
        "--grpc-address",
        None,
        "gRPC",
        "address the gRPC listener binds (default: --host)",
        metavar="ADDRESS",
    )
    metrics_address: str | None = flag(
        "--metrics-address",
        None,
        "metrics",
        "address the metrics listener binds (default: the HTTP address)",
        metavar="ADDRESS",
    )

    #: tritonserver flags given that pdserve ignores, as (flag, value)
    #: (:mod:`pdserve.app.triton_flags`; no flag of its own).
    ignored_flags: tuple[tuple[str, str], ...] = ()
