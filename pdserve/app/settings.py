"""The configuration of a serving process: :class:`Settings`, the ``pdserve serve``
flags (:class:`~pdserve.app.serve_flags.ServeFlags`) with what their values mean
(:attr:`Settings.http_limits`, :attr:`Settings.repository`...) and their checks.

:meth:`Settings.validate` checks every value, and the combinations, before anything
starts; a bad one raises :class:`SettingsError` naming the flag, which the CLI turns
into an argparse error (exit code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.backends.host_policy import HostPolicyError, resolve_policy
from pdserve.backends.onnxruntime.autocomplete import DEFAULT_MAX_BATCH_SIZE
from pdserve.cache import RedisCacheOptions, parse_cache_config, parse_redis_cache_config
from pdserve.frontends.grpc.engine import GRPC_SERVERS, GrpcKeepalive
from pdserve.frontends.http.server import HttpLimits
from pdserve.frontends.tls import ALPN_GRPC, ALPN_HTTP, TlsError, TlsFiles, load_context
from pdserve.frontends.traffic.apis import RestrictedApiError, parse_restricted
from pdserve.observability.trace_config import TraceConfig, TraceConfigError, parse_trace_config
from pdserve.repository.control import EXPLICIT_MODES, MODES
from pdserve.repository.remote_store import default_cache_dir
from pdserve.scheduling.rate_limiter import MODES as RATE_LIMIT_MODES

from .flag_syntax import add_flags
from .serve_flags import HTTP_SERVERS, ServeFlags
from .triton_flags import add_compat_flags, backend_setting

#: The example repository that ``examples/build.py`` builds (``--model-repository``'s default).
EXAMPLE_REPOSITORY = Path(__file__).resolve().parents[2] / "examples" / "model_repository"

#: The largest gRPC message size grpc accepts (a signed 32-bit int; Triton's maximum).
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1
#: Largest value of a flag tritonserver reads as a C ``int`` (the gRPC channel arguments).
INT_MAX = 2**31 - 1
#: Most ``--http-workers`` processes.
MAX_HTTP_WORKERS = 256


#: Where the ``tritonserver`` program's defaults differ from ``pdserve serve``'s (field
#: name -> default): tritonserver binds every address, answers not-ready until every
#: model is ready, exits when a model fails to load at start, names itself "triton"
#: in the server metadata and takes gRPC messages up to 2 GiB.
TRITONSERVER_DEFAULTS: dict[str, object] = {
    "host": "0.0.0.0",
    "strict_readiness": True,
    "exit_on_error": True,
    "server_id": "triton",
    "grpc_max_message_bytes": 2**31 - 1,
}


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


@dataclass(frozen=True)
class Settings(ServeFlags):
    """The configuration of ``pdserve serve``: the flags' values (the fields of
    :class:`ServeFlags`), their meaning and their checks.

    Build it from parsed arguments with :meth:`from_namespace` (which validates), or
    directly (library use; call :meth:`validate` before serving).
    """

    # -- construction and checks --------------------------------------------------------

    @classmethod
    def from_namespace(
        cls, args: argparse.Namespace, defaults: Mapping[str, object] | None = None
    ) -> Settings:
        """The settings of a namespace parsed by a parser :func:`add_arguments` built,
        validated.

        A flag absent from ``args`` keeps its field's default, or its default in
        ``defaults`` (field name -> value: ``tritonserver``'s); lists (repeatable
        flags) become tuples; other attributes (``command``, ``run``) are ignored.

        Raises:
            SettingsError: a bad value or combination (see :meth:`validate`).
        """
        given = {**(defaults or {}), **vars(args)}
        values: dict[str, Any] = {}  # argparse values, checked by validate()
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
        if self.rate_limit not in RATE_LIMIT_MODES:
            raise SettingsError(
                "--rate-limit",
                f"must be one of {', '.join(RATE_LIMIT_MODES)}, got {self.rate_limit!r}",
            )
        self._validate_http()
        self._validate_grpc()
        self._validate_cache()
        self._validate_model_control()
        self.default_max_batch_size  # noqa: B018 - validates --backend-config
        try:
            self.host_policies()
        except HostPolicyError as e:
            raise SettingsError("--host-policy", str(e)) from None
        self.validate_traffic()
        self._validate_tls()
        self.tracing()
        self._validate_repository()

    def _validate_http(self) -> None:
        """The listeners' ports (one each), the exit timeout and the HTTP limits."""
        if self.http_server not in HTTP_SERVERS:
            raise SettingsError(
                "--http-server",
                f"must be one of {', '.join(HTTP_SERVERS)} (also in PDSERVE_HTTP_SERVER), "
                f"got {self.http_server!r}",
            )
        listeners = [
            ("--http-port", "HTTP", self.http_host, self.http_port, self.allow_http),
            ("--grpc-port", "gRPC", self.grpc_host, self.grpc_port, self.allow_grpc),
            ("--metrics-port", "metrics", self.metrics_host, self.metrics_port, self.allow_metrics),
        ]
        used: dict[tuple[str, int], tuple[str, str]] = {}
        for flag, what, host, port, enabled in listeners:
            if not 0 <= port <= 65535:
                raise SettingsError(flag, f"must be a port number 0-65535, got {port}")
            if not enabled or port == 0:
                continue
            if (host, port) in used:  # tritonserver's CheckPortCollision: same address and port
                other_flag, other = used[host, port]
                raise SettingsError(
                    flag,
                    f"the server cannot listen to {other} requests and {what} requests at "
                    f"the same port {port} ({other_flag})",
                )
            used[host, port] = (flag, what)
        for flag, secs in (
            ("--exit-timeout-secs", self.exit_timeout_secs),
            ("--http-body-timeout-secs", self.http_body_timeout_secs),
            ("--http-header-timeout-secs", self.http_header_timeout_secs),
            ("--http-idle-timeout-secs", self.http_idle_timeout_secs),
            ("--http-write-timeout-secs", self.http_write_timeout_secs),
            ("--instance-hang-timeout", self.instance_hang_timeout),
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
        if self.http_workers > MAX_HTTP_WORKERS:  # each is a process, started at once
            raise SettingsError(
                "--http-workers", f"must be 1-{MAX_HTTP_WORKERS}, got {self.http_workers}"
            )

    def _validate_grpc(self) -> None:
        """The gRPC message size, keepalive and server flags."""
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
            if count > INT_MAX:  # grpc core's channel arguments are C ints
                raise SettingsError(flag, f"must be 1-{INT_MAX} milliseconds, got {count}")
        for flag, count in (
            ("--grpc-http2-max-pings-without-data", self.grpc_http2_max_pings_without_data),
            ("--grpc-http2-max-ping-strikes", self.grpc_http2_max_ping_strikes),
        ):
            if count < 0:
                raise SettingsError(flag, f"must be >= 0, got {count}")
            if count > INT_MAX:
                raise SettingsError(flag, f"must be 0-{INT_MAX}, got {count}")
        if self.grpc_server not in GRPC_SERVERS:
            raise SettingsError(
                "--grpc-server",
                f"must be one of {', '.join(GRPC_SERVERS)} (default from $PDSERVE_GRPC_SERVER), "
                f"got {self.grpc_server!r}",
            )

    def _validate_cache(self) -> None:
        """The response cache flags."""
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

    def _validate_model_control(self) -> None:
        """The model control mode and the flags that need one."""
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
        if self.load_models and "*" in self.load_models and len(set(self.load_models)) > 1:
            raise SettingsError(
                "--load-model",
                # Triton's rule: '*' is all models, and only alone
                "'*' loads every model and must be the only --load-model",
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

    def _validate_repository(self) -> None:
        """The model repository: a folder, or a URL with its extra installed."""
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
        if self.payload_log is not None:
            from pdserve.observability.monitoring.spec import LogSpec, SpecError

            try:
                LogSpec.parse(self.payload_log, "--payload-log")
            except SpecError as e:
                raise SettingsError(
                    "--payload-log", str(e).removeprefix("--payload-log: ")
                ) from None
        if self.auth_config is not None and not self.auth_config.is_file():
            raise SettingsError(
                "--auth-config", f"auth config file {self.auth_config} does not exist"
            )

    def _validate_tls(self) -> None:
        """Each TLS listener's files: given, readable PEM, a key that matches its
        certificate, root certificates for mutual TLS (loaded once here, as at start)."""
        for flag, files, alpn in (
            ("--grpc-use-ssl", self.grpc_tls, ALPN_GRPC),
            ("--http-use-ssl", self.http_tls, ALPN_HTTP),
            ("--metrics-use-ssl", self.metrics_tls, ALPN_HTTP),
        ):
            if files is None:
                continue
            try:
                load_context(files, alpn)
            except TlsError as e:
                raise SettingsError(flag, str(e)) from None

    def _tls_files(self, prefix: str, mutual: bool, trigger: str) -> TlsFiles:
        """The files of the ``prefix`` (``grpc`` / ``http``) TLS flags.

        Raises:
            SettingsError: the certificate or key is not given, or mutual TLS has no
                root certificate.
        """
        cert = getattr(self, f"{prefix}_server_cert")
        key = getattr(self, f"{prefix}_server_key")
        root = getattr(self, f"{prefix}_root_cert")
        for name, path in (("cert", cert), ("key", key)):
            if path is None:
                raise SettingsError(trigger, f"needs --{prefix}-server-{name} (a PEM file)")
        if mutual and root is None:
            raise SettingsError(
                f"--{prefix}-use-ssl-mutual",
                f"needs --{prefix}-root-cert (the CA certificate that signs client certificates)",
            )
        return TlsFiles(Path(cert), Path(key), root and Path(root), mutual, f"--{prefix}")

    # -- what the flags mean --------------------------------------------------------------

    @property
    def grpc_tls(self) -> TlsFiles | None:
        """gRPC's TLS files (``--grpc-use-ssl`` family), None: plain gRPC (also when
        gRPC is off).

        Raises:
            SettingsError: a file flag is missing (see :meth:`_tls_files`).
        """
        if not (self.allow_grpc and self.grpc_use_ssl):
            return None
        return self._tls_files("grpc", self.grpc_use_ssl_mutual, "--grpc-use-ssl")

    @property
    def http_tls(self) -> TlsFiles | None:
        """HTTP's TLS files (``--http-use-ssl`` family), None: plain HTTP.

        Raises:
            SettingsError: a file flag is missing (see :meth:`_tls_files`).
        """
        if not self.http_use_ssl:
            return None
        return self._tls_files("http", self.http_use_ssl_mutual, "--http-use-ssl")

    @property
    def metrics_tls(self) -> TlsFiles | None:
        """The metrics listener's TLS files (``--metrics-use-ssl``: HTTP's files), None:
        plain HTTP (also when metrics are off).

        Raises:
            SettingsError: a file flag is missing (see :meth:`_tls_files`).
        """
        if not (self.allow_metrics and self.metrics_use_ssl):
            return None
        return self._tls_files("http", self.http_use_ssl_mutual, "--metrics-use-ssl")

    @property
    def http_host(self) -> str:
        """The address HTTP binds: ``--http-address``, else ``--host``."""
        return self.http_address if self.http_address is not None else self.host

    @property
    def grpc_host(self) -> str:
        """The address gRPC binds: ``--grpc-address``, else ``--host``."""
        return self.grpc_address if self.grpc_address is not None else self.host

    @property
    def metrics_host(self) -> str:
        """The address the metrics listener binds: ``--metrics-address``, else the
        HTTP address (tritonserver's default)."""
        return self.metrics_address if self.metrics_address is not None else self.http_host

    def backend_settings(self) -> list[tuple[str, str, str]]:
        """The ``--backend-config`` options as (backend or "" for all, setting, value).

        Raises:
            SettingsError: an option without ``SETTING=VALUE``.
        """
        try:
            return [backend_setting(o) for o in self.backend_config]
        except argparse.ArgumentTypeError as e:
            raise SettingsError("--backend-config", str(e)) from None

    @property
    def default_max_batch_size(self) -> int:
        """``--backend-config [onnxruntime,]default-max-batch-size=N``: the
        ``max_batch_size`` ONNX auto-complete gives a model that can batch (4 when not
        given; onnxruntime's own setting wins over the global one, as in Triton).

        Raises:
            SettingsError: a malformed option, or a value that is not an integer >= 0.
        """
        found: dict[str, str] = {}
        for backend, setting, value in self.backend_settings():
            if setting == "default-max-batch-size" and backend in ("", "onnxruntime"):
                found[backend] = value
        text = found.get("onnxruntime", found.get(""))
        if text is None:
            return DEFAULT_MAX_BATCH_SIZE
        if not text.strip().isdigit():
            raise SettingsError(
                "--backend-config", f"default-max-batch-size must be an integer >= 0, got {text!r}"
            )
        return int(text)

    @property
    def auto_complete(self) -> bool:
        """Whether backends auto-complete model configurations: off with
        ``--disable-auto-complete-config`` or ``--strict-model-config=true``."""
        return not (self.disable_auto_complete_config or self.strict_model_config is True)

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


def add_arguments(
    parser: argparse.ArgumentParser, defaults: Mapping[str, object] | None = None
) -> None:
    """Declare every :class:`Settings` field as a flag of ``parser`` (``pdserve serve``,
    or ``tritonserver`` with its ``defaults``: field name -> default, shown in the
    help), and tritonserver's flags pdserve ignores (:mod:`pdserve.app.triton_flags`);
    a flag not given leaves no attribute, and :meth:`Settings.from_namespace` keeps the
    field's default (or the one in ``defaults``)."""
    groups = add_flags(parser, dataclasses.fields(Settings), defaults)
    add_compat_flags(groups["tritonserver compatibility"])
