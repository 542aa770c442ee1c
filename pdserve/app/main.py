"""The composition root: build every part of a serving process from :class:`Settings`,
start them in one explicit order and stop them in the reverse order.

Nothing below :mod:`pdserve.app` knows about flags or about the other parts: this
module is the only place that wires them together.

Start (:func:`serve`), each step only once the one before it succeeded:

0. **Features**: import the optional parts the settings ask for (gRPC frontend,
   metrics). An import that fails is an error (exit 1) naming the flag that
   turns the feature off; nothing has started yet.
1. **Core**: the :class:`~pdserve.server.InferenceServer`, given at construction
   its model control mode, the models to load at start, the response cache
   (:class:`~pdserve.cache.ResponseCache`, when it has a size) and the host
   policies. It loads nothing yet.
2. **Metrics hooks**: histogram hooks on every ``ModelStats`` created from now on
   (before any model loads, so each version's statistics feed them).
3. **HTTP** listener (KServe V2 REST): the process is live, not ready.
4. **gRPC** listener (KServe V2 gRPC), unless ``--no-allow-grpc``.
5. **Metrics** listener (``/metrics``), unless ``--no-allow-metrics``; a port that
   cannot be bound is logged and serving goes on without metrics.
6. **Repository poller** (``--model-control-mode=poll``): records what is on disk
   now, then scans every ``--repository-poll-secs`` once the initial load is done.
7. **Models**: the initial load; then the server is ready.

Stop, on SIGTERM/SIGINT (or when the HTTP listener dies), in reverse. From the
signal on, every HTTP response says ``Connection: close`` and every request that
reaches a listener gets an answer (503 / ``UNAVAILABLE`` for new work) until that
listener closes:

7. models: readiness goes false, new requests get 503, in-flight requests finish
   (at most ``--exit-timeout-secs``; 0 when HTTP died), loads in progress are
   abandoned, models unload (workers stop). A signal while a load is still
   running (the initial load, one asked for through the repository API, a poll)
   abandons it at once: workers still in ``initialize`` (or
   ``auto_complete_config``) are killed, initialized ones get
   :data:`~pdserve.backends.python.backend.CANCEL_GRACE_S` for ``finalize``;
6. the poller ends; 5. the metrics listener closes; 4. gRPC stops: its listener
   refuses new connections, the ones the kernel queued are taken, its connections
   end (calls on them fail ``UNAVAILABLE``), then the server stops; 3. HTTP stops:
   likewise, and each open connection answers what it received before it closes
   (:mod:`pdserve.app.listeners` says why each step is needed).

The whole shutdown is bounded: when the process runs from the CLI (:func:`run`)
and has not exited :data:`EXIT_MARGIN_SECS` after ``--exit-timeout-secs`` (counted
from the signal), or on a second SIGTERM/SIGINT, it logs so and exits at once with
code 1 (Triton too exits once its exit timeout has passed). No worker process
outlives the server, even a SIGKILLed one (:mod:`pdserve.backends.python.lifetime`).

A step that fails to start (a port in use) stops the steps already started, in
reverse, and :func:`serve` returns 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from pdserve import config as cfgmod
from pdserve.app import listeners
from pdserve.app.settings import Settings
from pdserve.backends.host_policy import HostPolicyError, format_cpu_list
from pdserve.cache import AnyResponseCache, RedisResponseCache, ResponseCache
from pdserve.core.api import InferenceCore
from pdserve.core.errors import InferError
from pdserve.core.procmem import settle_gc
from pdserve.frontends.http.app import HttpApp, create_http_app
from pdserve.frontends.http.native import NativeHttpServer
from pdserve.frontends.http.server import serve_http
from pdserve.frontends.shared_memory import SharedMemoryRegistry
from pdserve.frontends.traffic.gate import TrafficGate
from pdserve.observability.tracing import TraceManager
from pdserve.repository.breaker import BreakerBoard, BreakerPolicy
from pdserve.repository.control import RepositoryPoller
from pdserve.repository.layout import set_ready_marker
from pdserve.server import InferenceServer

if TYPE_CHECKING:
    from pdserve.repository.remote_store import RemoteRepository

log = logging.getLogger("pdserve")

#: Seconds HTTP connections and gRPC calls still open after the models stopped get.
LISTENER_GRACE_SECS = 5.0
#: Seconds a closing listener waits for the connections the kernel already queued.
ACCEPT_WAIT_SECS = 1.0
#: Seconds a closed HTTP listener's connections get to finish receiving and
#: answering the requests that reached them, before the idle ones are closed.
SETTLE_SECS = 2.0
#: Seconds a shutdown may last beyond ``--exit-timeout-secs`` (closing listeners,
#: stopping workers, leaving the interpreter) before the process exits anyway.
EXIT_MARGIN_SECS = 5.0
#: Seconds the span export gets at shutdown to send what is queued (the rest is
#: counted as dropped); within EXIT_MARGIN_SECS.
TRACE_FLUSH_SECS = 2.0
#: Seconds an abandoned initial load has to stop its workers.
ABANDON_WAIT_SECS = 10.0

Stop = Callable[[], Awaitable[None]]


class StartError(RuntimeError):
    """A part could not start (its reason is the message); the process exits 1."""


class ExitDeadline:
    """Ends the process if its shutdown outlasts ``budget`` seconds from the signal.

    A daemon thread (it runs even when the event loop is stuck), started by
    :meth:`start` at the first SIGTERM/SIGINT: when ``budget`` s have passed, or at
    once after :meth:`force` (a second signal), it logs why and calls
    ``os._exit(1)``; the workers then die with the server
    (:mod:`pdserve.backends.python.lifetime`). It is never disarmed: a process that
    returns from :func:`serve` exits well within the budget, and a process stuck
    after that (an exit handler waiting on something) is ended too.
    """

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self._wake = threading.Event()
        self._forced = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start counting (once)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="pdserve-exit-deadline", daemon=True
            )
            self._thread.start()

    def force(self) -> None:
        """Exit now."""
        self._forced = True
        self._wake.set()
        self.start()

    def _run(self) -> None:
        self._wake.wait(min(self.budget, threading.TIMEOUT_MAX))
        if self._forced:
            log.error("second signal: exiting now")
        else:
            log.error("shutdown did not finish within %.0f s: exiting now", self.budget)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(1)


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


def build_server(settings: Settings) -> InferenceServer:
    """Step 1: the core, configured at construction (it loads nothing yet).

    Raises:
        pdserve.backends.host_policy.HostPolicyError: a host policy names cores this
            process can no longer use.
    """
    set_ready_marker(settings.version_ready_marker or None)
    if settings.version_ready_marker:
        log.info(
            "publish-by-marker: a version folder is served once it holds %s",
            settings.version_ready_marker,
        )
    cfgmod.set_max_instance_count(settings.max_instance_count)
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
    )
    server.tracer = build_tracer(settings)
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


def _log_listening(settings: Settings, sock: socket.socket | None, transport: str) -> None:
    """Say that HTTP listens; a front-end worker (``sock`` given) says it at DEBUG, as
    the main process says it once, with its worker count (:func:`start_http_workers`)."""
    log.log(
        logging.INFO if sock is None else logging.DEBUG,
        "HTTP (KServe V2) listening on http://%s:%d (%s transport)",
        settings.host,
        settings.http_port,
        transport,
    )


async def start_http(
    settings: Settings,
    server: InferenceCore,
    draining: Callable[[], bool] = lambda: False,
    gate: TrafficGate | None = None,
    shm: SharedMemoryRegistry | None = None,
    sock: socket.socket | None = None,
) -> tuple[asyncio.Task[Any], Stop]:
    """Step 3: the HTTP listener; returns once it listens.

    Args:
        server: the core; an ``--http-workers`` worker passes its proxy
            (:class:`pdserve.frontends.workers.proxy.ProxyCore`).
        draining: true from the shutdown signal on: responses then say
            ``Connection: close``.
        sock: a bound, listening socket to serve (a front-end worker's
            ``SO_REUSEPORT`` socket); None: bind ``--host``:``--http-port``.

    Returns:
        the task serving HTTP (it ends if the listener dies) and the stopper: it
        closes the listener without failing a request that reached it
        (:mod:`pdserve.app.listeners`), then the connections.

    Raises:
        StartError: the address cannot be bound.
    """
    http_app = create_http_app(
        server,
        max_request_bytes=settings.max_request_bytes,
        body_timeout=settings.http_body_timeout_secs,
        max_json_bytes=settings.http_max_json_bytes,
        gate=gate,
        shared_memory=shm,
    )
    if settings.http_server == "native":
        return await start_native_http(settings, http_app, draining, sock)
    app = listeners.close_connections_while(draining, http_app)
    http = serve_http(
        app,
        settings.host,
        settings.http_port,
        limits=settings.http_limits,
        body_timeout=settings.http_body_timeout_secs,
        max_body=settings.max_request_bytes,
    )

    async def run() -> None:
        try:
            await http.serve(sockets=None if sock is None else [sock])
        except SystemExit:  # uvicorn exits when it cannot bind (it logged why)
            raise StartError(
                f"could not listen for HTTP on {settings.host}:{settings.http_port}"
            ) from None

    task = asyncio.create_task(run(), name="pdserve-http")
    while not http.started and not task.done():
        await asyncio.sleep(0.005)
    if task.done():
        task.result()  # raises the StartError
        raise StartError("the HTTP listener stopped while starting")
    _log_listening(settings, sock, "asgi")

    async def stop() -> None:
        if not task.done():
            servers = list(getattr(http, "servers", None) or [])
            await listeners.drain_accept_queues(
                [sock for srv in servers for sock in srv.sockets], ACCEPT_WAIT_SECS
            )
            for srv in servers:
                srv.close()
            await listeners.wait_http_settled(http, SETTLE_SECS)
        http.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, LISTENER_GRACE_SECS)

    return task, stop


async def start_native_http(
    settings: Settings,
    app: HttpApp,
    draining: Callable[[], bool],
    sock: socket.socket | None = None,
) -> tuple[asyncio.Task[Any], Stop]:
    """Step 3 with ``--http-server native``: :class:`NativeHttpServer` serving ``app``.

    The stopper refuses new connections and lets the accept queue drain
    (:func:`listeners.drain_accept_queues`), closes the listener, waits (at most
    ``SETTLE_SECS``) for the requests already received, then shuts the transport
    down: a new request on an open connection gets 503 and ``Connection: close``,
    idle connections close, in-flight requests have ``LISTENER_GRACE_SECS`` to finish.

    Raises:
        StartError: the address cannot be bound.
    """
    http = NativeHttpServer(
        app,
        settings.host,
        settings.http_port,
        limits=settings.http_limits,
        draining=draining,
        sock=sock,  # a front-end worker's SO_REUSEPORT listener (--http-workers)
    )
    try:
        await http.start()
    except OSError as e:
        raise StartError(
            f"could not listen for HTTP on {settings.host}:{settings.http_port}: {e.strerror or e}"
        ) from None
    task = asyncio.create_task(http.wait_stopped(), name="pdserve-http")
    _log_listening(settings, sock, "native")

    async def stop() -> None:
        if not task.done():
            await listeners.drain_accept_queues(http.sockets, ACCEPT_WAIT_SECS)
            http.close_listeners()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + SETTLE_SECS
            while not http.settled() and loop.time() < deadline:
                await asyncio.sleep(0.005)
            await http.shutdown(LISTENER_GRACE_SECS)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, LISTENER_GRACE_SECS)

    return task, stop


async def start_http_workers(
    settings: Settings,
    server: InferenceServer,
    draining: Callable[[], bool] = lambda: False,
    gate: TrafficGate | None = None,
    shm: SharedMemoryRegistry | None = None,
) -> tuple[asyncio.Task[Any], Stop]:
    """Step 3 with ``--http-workers N`` (N > 1): N front-end worker processes on the
    HTTP port (:mod:`pdserve.app.http_workers`); returns once each listens.

    Returns:
        a task that ends only if the workers' supervision fails, and the stopper (each
        worker closes its listener as :func:`start_http`'s does, then exits).

    Raises:
        StartError: the port is taken or a worker did not start.
    """
    from pdserve.app.http_workers import HttpWorkers

    workers = HttpWorkers(
        settings, server, shm if shm is not None else SharedMemoryRegistry(), gate, draining
    )
    try:
        await workers.start()
    except OSError as e:
        raise StartError(
            f"could not listen for HTTP on {settings.host}:{settings.http_port}: {e}"
        ) from None
    except RuntimeError as e:
        raise StartError(str(e)) from None
    log.info(
        "HTTP (KServe V2) listening on http://%s:%d (%d worker processes)",
        settings.host,
        workers.port,
        workers.count,
    )

    async def supervise() -> None:
        await workers.failed

    task = asyncio.create_task(supervise(), name="pdserve-http-workers")

    async def stop() -> None:
        await workers.stop()
        task.cancel()

    return task, stop


async def start_grpc(
    settings: Settings,
    server: InferenceServer,
    grpc_server: ModuleType,
    gate: TrafficGate | None = None,
    shm: SharedMemoryRegistry | None = None,
) -> Stop:
    """Step 4: the gRPC listener (``grpc_server`` is :mod:`pdserve.frontends.grpc.server`).

    Raises:
        StartError: the address cannot be bound.
    """
    try:
        srv = await grpc_server.serve_grpc(
            server,
            settings.host,
            settings.grpc_port,
            max_message_bytes=settings.grpc_max_message_bytes,
            gate=gate,
            shared_memory=shm,
            kind=settings.grpc_server,
            max_connections=settings.http_max_connections,
            keepalive=settings.grpc_keepalive,
        )
    except RuntimeError as e:
        raise StartError(str(e)) from None
    log.info("gRPC (KServe V2) listening on %s:%d", settings.host, settings.grpc_port)

    async def stop() -> None:
        # the native transport ends its connections itself (GOAWAY, calls in flight finish)
        if settings.grpc_port and settings.grpc_server != "native":
            try:
                await listeners.end_tcp_connections(settings.grpc_port, ACCEPT_WAIT_SECS)
            except Exception:  # noqa: BLE001 - the server's own stop still runs
                log.exception("ending the gRPC connections failed")
        await srv.stop(LISTENER_GRACE_SECS)

    return stop


async def start_metrics(
    settings: Settings,
    server: InferenceServer,
    metrics: ModuleType,
    metrics_http: ModuleType,
    gate: TrafficGate | None = None,
) -> Stop | None:
    """Step 5: the ``/metrics`` listener; None (logged) when its port cannot be bound.

    ``metrics`` is :mod:`pdserve.observability.metrics`, ``metrics_http``
    :mod:`pdserve.frontends.metrics_http`.
    """
    exporter = metrics.MetricsExporter(
        server, cpu=settings.allow_cpu_metrics, gpu=settings.allow_gpu_metrics
    )
    exporter.sources.append(server.breakers.samples)
    if isinstance(server.tracer, TraceManager):
        exporter.sources.append(server.tracer.samples)
    if gate is not None:
        exporter.sources.append(gate.samples)
    host, port = settings.host, settings.metrics_port
    try:
        listener = await metrics_http.serve_metrics(
            exporter.render, host, port, content_type=metrics.CONTENT_TYPE
        )
    except OSError as e:
        log.error("metrics not served: cannot listen on %s:%d (%s)", host, port, e)
        return None
    log.info("metrics (Prometheus) at http://%s:%d/metrics", host, port)

    async def stop() -> None:
        listener.close()
        await listener.wait_closed()

    return stop


def start_poller(
    settings: Settings, server: InferenceServer, sync: Callable[[], object] | None = None
) -> Stop:
    """Step 6 (poll mode): record the repository as it is now and start polling it;
    the poller waits for the initial load before its first scan. ``sync`` (a
    repository on object storage) re-syncs the local cache before each scan."""
    poller = RepositoryPoller(server, settings.repository_poll_secs, sync)
    poller.baseline()
    task = asyncio.get_running_loop().create_task(poller.run(), name="pdserve-repository-poll")
    log.info(
        "model control mode poll: scanning the repository every %gs",
        settings.repository_poll_secs,
    )

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    return stop


async def load_models(settings: Settings, server: InferenceServer) -> None:
    """Step 7: the initial load (a model that fails is logged, never fatal)."""
    await server.start()
    rows = server.repository_index()
    ready = [r for r in rows if r.get("state") == "READY"]
    failed = [r for r in rows if r.get("state") not in (None, "READY")]
    not_loaded = sorted({r["name"] for r in rows if r.get("state") is None})
    log.info(
        "model repository %s: %d version%s ready, %d failed%s",
        settings.repository,
        len(ready),
        "" if len(ready) == 1 else "s",
        len(failed),
        f", {len(not_loaded)} model(s) not loaded (explicit mode)" if not_loaded else "",
    )
    for r in failed:
        log.warning(
            "  %s version %s %s: %s",
            r["name"],
            r.get("version", "-"),
            r.get("state"),
            r.get("reason", ""),
        )


async def serve(settings: Settings, exit_deadline: ExitDeadline | None = None) -> int:
    """Run the server until SIGTERM/SIGINT; return the process exit code.

    See the module docstring for the order in which parts start and stop.

    Args:
        exit_deadline: started at the first signal and forced at the second (the
            process exits when the shutdown takes too long); None (a library
            caller): a second signal is only logged.

    Returns:
        0 after a signal-driven shutdown; 1 when a part could not start or the
        HTTP listener died; 2 when a host policy became unusable since the flags
        were checked.

    Raises:
        SettingsError: ``settings`` are not valid (checked again here for library
            callers; the CLI checked them while parsing).
    """
    settings.validate()
    metrics: ModuleType | None
    metrics_http: ModuleType | None
    try:
        grpc_server = (
            import_feature("pdserve.frontends.grpc.server", "gRPC", "--no-allow-grpc")
            if settings.allow_grpc
            else None
        )
        if settings.allow_metrics:
            metrics = import_feature(
                "pdserve.observability.metrics", "metrics", "--no-allow-metrics"
            )
            metrics_http = import_feature(
                "pdserve.frontends.metrics_http", "metrics", "--no-allow-metrics"
            )
        else:
            metrics = metrics_http = None
    except StartError as e:
        log.error("%s", e)
        return 1
    try:
        remote = await sync_remote_repository(settings)
    except StartError as e:
        log.error("%s", e)
        return 1
    try:
        server = build_server(settings)
    except HostPolicyError as e:
        log.error("--host-policy: %s", e)
        return 2
    try:
        gate = build_gate(settings)
    except StartError as e:
        log.error("%s", e)
        return 1

    stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop_event.is_set():
            if exit_deadline is not None:
                exit_deadline.force()
            else:
                log.warning("%s received again: already shutting down", sig.name)
            return
        log.info("%s received", sig.name)
        stop_event.set()
        if exit_deadline is not None:
            exit_deadline.start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    watcher: asyncio.Task[None] | None = None
    if gate is not None and gate.config is not None:
        loop.add_signal_handler(signal.SIGHUP, gate.reload, "SIGHUP")
        watcher = asyncio.create_task(gate.watch(), name="pdserve-auth-reload")

    stops: list[tuple[str, Stop]] = []  # started parts, in start order
    drain_secs = settings.exit_timeout_secs
    code = 0
    try:
        if metrics is not None:
            metrics.install_hooks()
        tracer = server.tracer
        if isinstance(tracer, TraceManager):  # stops last: the last requests' traces go out

            async def stop_tracing() -> None:
                if tracer.export is not None:  # spans to flush (a thread: it may wait)
                    await asyncio.to_thread(tracer.stop, TRACE_FLUSH_SECS)

            stops.append(("tracing", stop_tracing))
        shm = SharedMemoryRegistry(enabled=settings.allow_client_shm)  # --allow-client-shm
        if settings.http_workers > 1:  # --http-workers: front ends in their own processes
            http_task, stop_http = await start_http_workers(
                settings, server, stop_event.is_set, gate, shm
            )
        else:
            http_task, stop_http = await start_http(settings, server, stop_event.is_set, gate, shm)
        stops.append(("HTTP", stop_http))
        if grpc_server is not None:
            stops.append(("gRPC", await start_grpc(settings, server, grpc_server, gate, shm)))
        settle_gc()  # also in a hub process (--http-workers) and with gRPC alone
        if metrics is not None and metrics_http is not None:
            stop_metrics = await start_metrics(settings, server, metrics, metrics_http, gate)
            if stop_metrics is not None:
                stops.append(("metrics", stop_metrics))
        if settings.model_control_mode == "poll":
            sync = remote.sync if remote is not None else None
            stops.append(("repository poller", start_poller(settings, server, sync)))

        async def stop_models() -> None:
            await server.stop(drain_secs)
            shm.close()  # the shared-memory regions' descriptors

        stops.append(("models", stop_models))
        # The initial load runs as a task: a signal (or HTTP dying) is acted on at
        # once, even while a model's initialize() blocks.
        loading = asyncio.create_task(load_models(settings, server), name="pdserve-load")
        waiter = asyncio.create_task(stop_event.wait())
        try:
            await asyncio.wait([waiter, http_task, loading], return_when=asyncio.FIRST_COMPLETED)
            if loading.done():
                loading.result()  # an error of the load itself (not of a model) is raised
                await asyncio.wait([waiter, http_task], return_when=asyncio.FIRST_COMPLETED)
            else:
                log.info("shutting down while models load: abandoning the loads in progress")
                loading.cancel()
                await asyncio.wait([loading], timeout=ABANDON_WAIT_SECS)
        finally:
            waiter.cancel()
            loading.cancel()
        if http_task.done() and not stop_event.is_set():
            exc = http_task.exception() if not http_task.cancelled() else None
            log.error("HTTP server stopped: %s", exc)
            drain_secs = 0
            code = 1
        else:
            log.info("shutting down: finishing in-flight requests (timeout %.0fs)", drain_secs)
    except StartError as e:
        log.error("%s", e)
        code = 1
    finally:
        stop_event.set()  # from here on HTTP responses say Connection: close
        for name, stop in reversed(stops):
            began = loop.time()
            try:
                await stop()
            except Exception:  # noqa: BLE001 - stop the other parts regardless
                log.exception("stopping %s failed", name)
            log.debug("%s stopped in %.0f ms", name, (loop.time() - began) * 1000)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if watcher is not None:
            watcher.cancel()
            loop.remove_signal_handler(signal.SIGHUP)
    log.info("pdserve stopped")
    return code


def run(settings: Settings) -> int:
    """Run :func:`serve` on a new uvloop event loop (asyncio's without uvloop), the
    process's shutdown bounded by an :class:`ExitDeadline` of ``--exit-timeout-secs``
    + :data:`EXIT_MARGIN_SECS`."""
    deadline = ExitDeadline(settings.exit_timeout_secs + EXIT_MARGIN_SECS)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(serve(settings, deadline))
    return uvloop.run(serve(settings, deadline))
