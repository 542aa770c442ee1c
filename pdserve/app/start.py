"""Start each part of a serving process (steps 3-7 of :mod:`pdserve.app.main`) and hand
back its stopper: the HTTP listener (native or ASGI transport), gRPC, the metrics
listener, the repository poller, and the initial model load. Each stopper closes its
listener without failing a request that reached it (:mod:`pdserve.app.listeners`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from types import ModuleType

from pdserve.app import listeners
from pdserve.app.build import StartError
from pdserve.app.settings import Settings
from pdserve.core.api import InferenceCore
from pdserve.frontends.http.app import HttpApp, create_http_app
from pdserve.frontends.http.native import NativeHttpServer
from pdserve.frontends.http.server import serve_http
from pdserve.frontends.shared_memory import SharedMemoryRegistry
from pdserve.frontends.tls import ALPN_GRPC, ALPN_HTTP, ServerTls, TlsError, TlsFiles
from pdserve.frontends.traffic.gate import TrafficGate
from pdserve.observability.monitoring.monitor import Monitor
from pdserve.observability.tracing import TraceManager
from pdserve.repository.control import RepositoryPoller
from pdserve.server import InferenceServer

log = logging.getLogger("pdserve")

#: Seconds HTTP connections and gRPC calls still open after the models stopped get.
LISTENER_GRACE_SECS = 5.0
#: Seconds a closing listener waits for the connections the kernel already queued.
ACCEPT_WAIT_SECS = 1.0
#: Seconds a closed HTTP listener's connections get to finish receiving and
#: answering the requests that reached them, before the idle ones are closed.
SETTLE_SECS = 2.0

#: Stops one started part.
Stop = Callable[[], Awaitable[None]]


def http_listen_error(settings: Settings, reason: object = None) -> StartError:
    """The error of an HTTP address that cannot be bound, with ``reason`` when known."""
    where = f"could not listen for HTTP on {settings.http_host}:{settings.http_port}"
    return StartError(where if reason is None else f"{where}: {reason}")


def listener_tls(files: TlsFiles | None, alpn: tuple[str, ...], name: str) -> ServerTls | None:
    """The TLS of a listener whose files are ``files`` (None: plaintext, None back).

    Raises:
        StartError: the files cannot be used (changed since the flags were checked).
    """
    if files is None:
        return None
    try:
        return ServerTls(files, alpn, name)
    except TlsError as e:
        raise StartError(f"{name} TLS: {e}") from None


def _log_listening(settings: Settings, sock: socket.socket | None, transport: str) -> None:
    """Say that HTTP listens; a front-end worker (``sock`` given) says it at DEBUG, as
    the main process says it once, with its worker count
    (:func:`pdserve.app.http_workers.start_http_workers`)."""
    log.log(
        logging.INFO if sock is None else logging.DEBUG,
        "HTTP (KServe V2) listening on %s://%s:%d (%s transport)",
        "https" if settings.http_use_ssl else "http",
        settings.http_host,
        settings.http_port,
        transport,
    )


def _listener_stopper(task: asyncio.Task[None], close: Stop) -> Stop:
    """The stopper of an HTTP listener served by ``task``: ``close`` it while it still
    serves, then give the task at most ``LISTENER_GRACE_SECS`` to end."""

    async def stop() -> None:
        if not task.done():
            await close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, LISTENER_GRACE_SECS)

    return stop


async def start_http(
    settings: Settings,
    server: InferenceCore,
    draining: Callable[[], bool] = lambda: False,
    gate: TrafficGate | None = None,
    shm: SharedMemoryRegistry | None = None,
    sock: socket.socket | None = None,
) -> tuple[asyncio.Task[None], Stop]:
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
    tls = listener_tls(settings.http_tls, ALPN_HTTP, "HTTP")
    if settings.http_server == "native":
        return await start_native_http(settings, http_app, draining, sock, tls)
    app = listeners.close_connections_while(draining, http_app)
    http = serve_http(
        app,
        settings.http_host,
        settings.http_port,
        limits=settings.http_limits,
        body_timeout=settings.http_body_timeout_secs,
        max_body=settings.max_request_bytes,
        ssl=None if tls is None else tls.context,
    )

    async def run() -> None:
        try:
            await http.serve(sockets=None if sock is None else [sock])
        except SystemExit:  # uvicorn exits when it cannot bind (it logged why)
            raise http_listen_error(settings) from None

    task = asyncio.create_task(run(), name="pdserve-http")
    while not http.started and not task.done():
        await asyncio.sleep(0.005)
    if task.done():
        task.result()  # raises the StartError
        raise StartError("the HTTP listener stopped while starting")
    _log_listening(settings, sock, "asgi")

    async def close() -> None:
        servers = list(getattr(http, "servers", None) or [])
        await listeners.drain_accept_queues(
            [sock for srv in servers for sock in srv.sockets], ACCEPT_WAIT_SECS
        )
        for srv in servers:
            srv.close()
        await listeners.wait_http_settled(http, SETTLE_SECS)
        http.should_exit = True

    return task, _listener_stopper(task, close)


async def start_native_http(
    settings: Settings,
    app: HttpApp,
    draining: Callable[[], bool],
    sock: socket.socket | None = None,
    tls: ServerTls | None = None,
) -> tuple[asyncio.Task[None], Stop]:
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
        settings.http_host,
        settings.http_port,
        limits=settings.http_limits,
        draining=draining,
        sock=sock,  # a front-end worker's SO_REUSEPORT listener (--http-workers)
        ssl=None if tls is None else tls.context,
    )
    try:
        await http.start()
    except OSError as e:
        raise http_listen_error(settings, e.strerror or e) from None
    task = asyncio.create_task(http.wait_stopped(), name="pdserve-http")
    _log_listening(settings, sock, "native")

    async def close() -> None:
        await listeners.drain_accept_queues(http.sockets, ACCEPT_WAIT_SECS)
        http.close_listeners()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_SECS
        while not http.settled() and loop.time() < deadline:
            await asyncio.sleep(0.005)
        await http.shutdown(LISTENER_GRACE_SECS)

    return task, _listener_stopper(task, close)


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
    tls = listener_tls(settings.grpc_tls, ALPN_GRPC, "gRPC")
    try:
        srv = await grpc_server.serve_grpc(
            server,
            settings.grpc_host,
            settings.grpc_port,
            max_message_bytes=settings.grpc_max_message_bytes,
            gate=gate,
            shared_memory=shm,
            kind=settings.grpc_server,
            max_connections=settings.http_max_connections,
            keepalive=settings.grpc_keepalive,
            tls=tls,
        )
    except RuntimeError as e:
        raise StartError(str(e)) from None
    log.info(
        "gRPC (KServe V2) listening on %s:%d%s",
        settings.grpc_host,
        settings.grpc_port,
        "" if tls is None else " (TLS, mutual)" if tls.files.mutual else " (TLS)",
    )

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
    exporter.sources.append(server.health.samples)
    if isinstance(server.tracer, TraceManager):
        exporter.sources.append(server.tracer.samples)
    if gate is not None:
        exporter.sources.append(gate.samples)
    if isinstance(server.monitor, Monitor):
        exporter.sources.append(server.monitor.samples)
    host, port = settings.metrics_host, settings.metrics_port
    tls = listener_tls(settings.metrics_tls, ALPN_HTTP, "metrics")
    try:
        listener = await metrics_http.serve_metrics(
            exporter.render,
            host,
            port,
            content_type=metrics.CONTENT_TYPE,
            ssl=None if tls is None else tls.context,
        )
    except OSError as e:
        log.error("metrics not served: cannot listen on %s:%d (%s)", host, port, e)
        return None
    scheme = "http" if tls is None else "https"
    log.info("metrics (Prometheus) at %s://%s:%d/metrics", scheme, host, port)

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


async def load_models(settings: Settings, server: InferenceServer) -> int:
    """Step 7: the initial load; returns how many model versions failed to load (each
    is logged; fatal only with ``--exit-on-error``, which the caller acts on)."""
    await server.start()
    rows = server.repository_index()
    ready = [r for r in rows if r.get("state") == "READY"]
    failed = [r for r in rows if r.get("state") not in (None, "READY")]
    not_loaded = sorted({r["name"] for r in rows if r.get("state") is None})
    unknown = [n for n in server.load_models or () if n not in {r["name"] for r in rows}]
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
    for name in unknown:
        log.warning("  %s: --load-model names no model of the repository", name)
    return len(failed) + len(unknown)
