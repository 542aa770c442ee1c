"""Build the parts of a serving process from :class:`~pdserve.app.settings.Settings`
before anything listens: the core (:class:`~pdserve.server.InferenceServer`), the
traffic gate, the tracer, the optional features' modules and the local mirror of a
repository on object storage. A part that cannot be built raises :class:`StartError`
(or :class:`~pdserve.backends.host_policy.HostPolicyError`), naming the flag at fault.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from types import ModuleType
from typing import TYPE_CHECKING

from pdserve import config as cfgmod
from pdserve.app.settings import Settings
from pdserve.app.triton_flags import BACKEND_SETTING_IGNORED, log_ignored
from pdserve.backends.host_policy import format_cpu_list
from pdserve.backends.onnxruntime.autocomplete import set_default_max_batch_size
from pdserve.cache import AnyResponseCache, RedisResponseCache, ResponseCache
from pdserve.core import timing
from pdserve.core.errors import InferError
from pdserve.frontends.traffic.gate import TrafficGate
from pdserve.observability.monitoring.monitor import Monitor
from pdserve.observability.tracing import TraceManager
from pdserve.repository.breaker import BreakerBoard, BreakerPolicy
from pdserve.repository.layout import set_ready_marker
from pdserve.repository.prepare import set_auto_complete
from pdserve.scheduling import rate_limiter
from pdserve.server import InferenceServer

if TYPE_CHECKING:
    from pdserve.repository.remote_store import RemoteRepository

log = logging.getLogger("pdserve")


class StartError(RuntimeError):
    """A part could not start (its reason is the message); the process exits 1."""


def import_feature(module: str, feature: str, off_flag: str) -> ModuleType:
    """Import the module of an optional feature the settings ask for.

    Raises:
        StartError: the import failed; the message names the feature, the error and
            the flag that turns the feature off.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise StartError(
            f"{feature} is asked for but cannot be imported ({module}: {e}); "
            f"fix the installation or start with {off_flag}"
        ) from e


async def sync_remote_repository(settings: Settings) -> RemoteRepository | None:
    """Step 0 (``--model-repository URL``): mirror the store into the local cache.

    Returns:
        the :class:`~pdserve.repository.remote_store.RemoteRepository` (None for a
        local folder).

    Raises:
        StartError: fsspec / the store's package is missing, or the store is
            unreachable and there is no cache to serve.
    """
    url = settings.remote_repository_url
    if url is None:
        return None
    from pdserve.repository.remote_store import RemoteRepository, StoreUnavailable

    try:
        remote = RemoteRepository(
            url,
            settings.remote_repository_cache,
            ready_marker=settings.version_ready_marker or None,
        )
    except (ImportError, ValueError) as e:
        raise StartError(f"--model-repository {url}: {e}") from e
    try:
        report = await asyncio.to_thread(remote.sync)
    except StoreUnavailable as e:
        if not remote.has_cache:
            raise StartError(f"model repository {url} is unreachable and not cached: {e}") from e
        return remote
    log.info(
        "model repository %s: synced into %s in %.2fs (%d files, %d fetched, %d bytes)",
        url,
        remote.local_path,
        report.seconds,
        report.files,
        report.downloaded,
        report.bytes,
    )
    return remote


def log_compat_flags(settings: Settings) -> None:
    """Say, once at start, which tritonserver flags given are ignored and why
    (:func:`pdserve.app.triton_flags.log_ignored`), and when auto-complete is off."""
    log_ignored(settings.ignored_flags, log)
    for option, (backend, setting, _) in zip(
        settings.backend_config, settings.backend_settings(), strict=True
    ):
        if setting != "default-max-batch-size" or backend not in ("", "onnxruntime"):
            log.info("--backend-config=%s ignored: %s", option, BACKEND_SETTING_IGNORED)
    if settings.strict_model_config is not None:
        log.warning(
            "'--strict-model-config' has been deprecated! Please use "
            "'--disable-auto-complete-config' instead."
        )
    if not settings.auto_complete:
        log.info("auto-complete off: every model needs a complete config.pbtxt")


def build_server(settings: Settings) -> InferenceServer:
    """Step 1: the core, configured at construction (it loads nothing yet).

    Raises:
        pdserve.backends.host_policy.HostPolicyError: a host policy names cores this
            process can no longer use.
    """
    set_ready_marker(settings.version_ready_marker or None)
    set_auto_complete(settings.auto_complete)
    set_default_max_batch_size(settings.default_max_batch_size)  # --backend-config
    if settings.version_ready_marker:
        log.info(
            "publish-by-marker: a version folder is served once it holds %s",
            settings.version_ready_marker,
        )
    cfgmod.set_max_instance_count(settings.max_instance_count)
    rate_limiter.configure(settings.rate_limit, settings.rate_limit_resource)
    if settings.rate_limit != "off":
        grants = ", ".join(map(str, settings.rate_limit_resource))
        log.info(
            "rate limiter: execution_count, resources: %s",
            grants or "as many as the most one instance needs",
        )
    policies = settings.host_policies()
    for name, cores in sorted(policies.items()):
        log.info("host policy %s: cpu-cores %s", name, format_cpu_list(cores))
    cache_bytes = settings.response_cache_bytes
    redis_cache = settings.redis_cache_options
    cache: AnyResponseCache | None = ResponseCache(cache_bytes) if cache_bytes > 0 else None
    if redis_cache is not None:
        cache = RedisResponseCache(redis_cache)
        log.info(
            "response cache: redis at %s:%d db %d (key prefix %r)",
            redis_cache.host,
            redis_cache.port,
            redis_cache.db,
            redis_cache.prefix,
        )
    elif cache is not None:
        log.info("response cache: %d bytes", cache_bytes)
    breaker_policy = (
        BreakerPolicy.parse(settings.circuit_breaker) if settings.circuit_breaker else None
    )
    if breaker_policy is not None:
        log.info("circuit breaker on every model version: %s", breaker_policy)
    server = InferenceServer(
        settings.repository,
        strict_readiness=settings.strict_readiness,
        load_models=settings.startup_models,
        host_policies=policies,
        model_control_mode=settings.model_control_mode,
        response_cache=cache,
        memory_budget=settings.model_memory_budget,
        pinned_models=settings.pin_models,
        load_wait_s=settings.model_load_wait_secs,
        breakers=BreakerBoard(breaker_policy),
        instance_hang_timeout=settings.instance_hang_timeout,
    )
    server.server_id = settings.server_id  # --id: the server metadata's name
    timing.state.enabled = settings.server_timing  # --server-timing (pdserve.core.timing)
    server.tracer = build_tracer(settings)
    server.monitor = Monitor(settings.payload_log)  # --payload-log: checked by the settings
    if settings.model_control_mode in ("explicit", "on_demand"):
        log.info(
            "model control mode %s: loading %s at start",
            settings.model_control_mode,
            "every model" if server.load_models is None else (server.load_models or "no model"),
        )
    if settings.model_memory_budget is not None:
        log.info(
            "model memory budget: %d bytes; pinned models: %s",
            settings.model_memory_budget,
            ", ".join(settings.pin_models) or "none",
        )
    return server


def build_gate(settings: Settings) -> TrafficGate | None:
    """Step 1b: restricted APIs, the auth config and rate limits (None: none asked for).

    Raises:
        StartError: the auth config (or its JWKS file) is missing or malformed, or a
            library of the ``traffic`` extra is missing: the server does not start
            rather than serve without the protection it was asked for (fail closed).
    """
    from pdserve.frontends.traffic.apis import parse_restricted
    from pdserve.frontends.traffic.auth import AuthConfigError, load_auth_config
    from pdserve.frontends.traffic.ratelimit import RateLimitConfigError, RateLimiter

    http_restricted = parse_restricted(settings.http_restricted_api, "--http-restricted-api")
    grpc_restricted = parse_restricted(
        settings.grpc_restricted_protocol, "--grpc-restricted-protocol"
    )
    config = None
    limiter = None
    if settings.auth_config is not None:
        try:
            config = load_auth_config(settings.auth_config)
            # always made (cheap until a limit applies), so that a reload may add limits
            limiter = RateLimiter(
                config.rate_limits,
                settings.rate_limit_storage,
                settings.rate_limit_strategy,
                fail_open=settings.rate_limit_fail_mode == "open",
            )
        except (AuthConfigError, RateLimitConfigError, ImportError) as e:
            raise StartError(f"--auth-config: {e}") from None
        log.info(
            "auth config %s: %d API key(s), JWT %s, rate limits %s (storage %s)",
            config.path,
            len(config.keys),
            "on" if config.jwt is not None else "off",
            "on" if limiter.active or any(k.principal.rate_limit for k in config.keys) else "off",
            limiter.where(),
        )
    gate = TrafficGate(config, limiter, http_restricted, grpc_restricted)
    return gate if gate.active else None


def build_tracer(settings: Settings) -> TraceManager:
    """Step 1b: the trace settings and sampling (Triton's trace extension); the
    OpenTelemetry export starts here when ``--trace-config`` turns tracing on.

    Raises:
        StartError: tracing is asked for and the ``tracing`` extra is not installed.
    """
    config = settings.tracing()
    tracer = TraceManager(config)
    try:
        tracer.start()
    except InferError as e:
        raise StartError(f"--trace-config level={'|'.join(config.level)}: {e.message}") from None
    return tracer
