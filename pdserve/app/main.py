"""The composition root: build every part of a serving process from :class:`Settings`,
start the parts in one explicit order and stop them in the reverse order.

Start (:func:`serve`), each step once the one before it succeeded: 0 the optional
features' imports, 1 the core (:mod:`pdserve.app.build`), 2 metrics hooks, 3 the HTTP
listener (live, not ready), 4 gRPC, 5 the metrics listener, 6 the repository poller,
7 the initial model load (ready). A step that fails stops those already started and
:func:`serve` returns 1.

Stop, on SIGTERM/SIGINT (or when the HTTP listener dies), in reverse: the models drain
(``--exit-timeout-secs``) and unload, the poller, metrics, gRPC and HTTP close without
failing a request that reached them (:mod:`pdserve.app.listeners`), payload logs and
traces flush; HTTP responses say ``Connection: close`` from the signal on. An
:class:`ExitDeadline` bounds the whole shutdown; no worker process outlives the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from types import ModuleType
from typing import NamedTuple

from pdserve.app.build import (
    StartError,
    build_gate,
    build_server,
    import_feature,
    log_compat_flags,
    sync_remote_repository,
)
from pdserve.app.http_workers import start_http_workers
from pdserve.app.settings import Settings
from pdserve.app.start import (
    Stop,
    load_models,
    start_grpc,
    start_http,
    start_metrics,
    start_poller,
)
from pdserve.backends.host_policy import HostPolicyError
from pdserve.core.procmem import settle_gc
from pdserve.frontends.shared_memory import SharedMemoryRegistry
from pdserve.frontends.tls import reload_all as reload_tls
from pdserve.frontends.traffic.gate import TrafficGate
from pdserve.observability.monitoring.monitor import Monitor
from pdserve.observability.tracing import TraceManager
from pdserve.repository.remote_store import RemoteRepository
from pdserve.server import InferenceServer

log = logging.getLogger("pdserve")

#: Seconds a shutdown may last beyond ``--exit-timeout-secs`` (closing listeners,
#: stopping workers, leaving the interpreter) before the process exits anyway.
EXIT_MARGIN_SECS = 5.0
#: Seconds the span export gets at shutdown to send what is queued (the rest is
#: counted as dropped); within EXIT_MARGIN_SECS.
TRACE_FLUSH_SECS = 2.0
#: Seconds the payload loggers get at shutdown to write what they hold.
PAYLOAD_FLUSH_SECS = 10.0
#: Seconds an abandoned initial load has to stop its workers.
ABANDON_WAIT_SECS = 10.0


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


class Features(NamedTuple):
    """The optional parts' modules (None: turned off by their flag)."""

    grpc_server: ModuleType | None
    metrics: ModuleType | None
    metrics_http: ModuleType | None


def import_features(settings: Settings) -> Features:
    """Step 0: import the optional parts the settings ask for (gRPC, metrics).

    Raises:
        StartError: an import failed (the message names the flag turning it off).
    """
    grpc_server = None
    if settings.allow_grpc:
        grpc_server = import_feature("pdserve.frontends.grpc.server", "gRPC", "--no-allow-grpc")
    if not settings.allow_metrics:
        return Features(grpc_server, None, None)
    metrics = import_feature("pdserve.observability.metrics", "metrics", "--no-allow-metrics")
    metrics_http = import_feature("pdserve.frontends.metrics_http", "metrics", "--no-allow-metrics")
    return Features(grpc_server, metrics, metrics_http)


class _Signals:
    """SIGTERM/SIGINT begin the shutdown (``stop_event``); a second one forces the
    exit through ``exit_deadline`` (only logged without one). SIGHUP reloads the auth
    config, which is also watched for changes, and the listeners' TLS files
    (:func:`pdserve.frontends.tls.reload_all`); with neither, SIGHUP keeps its default."""

    def __init__(
        self,
        stop_event: asyncio.Event,
        exit_deadline: ExitDeadline | None,
        gate: TrafficGate | None,
        tls: bool = False,
    ) -> None:
        self.stop_event = stop_event
        self.exit_deadline = exit_deadline
        self.loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._on_signal, sig)
        self.watcher: asyncio.Task[None] | None = None
        self.gate = gate if gate is not None and gate.config is not None else None
        self.hup = self.gate is not None or tls
        if self.hup:
            self.loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        if self.gate is not None:
            self.watcher = asyncio.create_task(self.gate.watch(), name="pdserve-auth-reload")

    def _on_hup(self) -> None:
        if self.gate is not None:
            self.gate.reload("SIGHUP")
        reload_tls("SIGHUP")

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop_event.is_set():
            if self.exit_deadline is not None:
                self.exit_deadline.force()
            else:
                log.warning("%s received again: already shutting down", sig.name)
            return
        log.info("%s received", sig.name)
        self.stop_event.set()
        if self.exit_deadline is not None:
            self.exit_deadline.start()

    def remove(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.remove_signal_handler(sig)
        if self.watcher is not None:
            self.watcher.cancel()
        if self.hup:
            self.loop.remove_signal_handler(signal.SIGHUP)


class _Serving:
    """The started parts of one :func:`serve`, stopped in reverse order."""

    def __init__(
        self,
        settings: Settings,
        server: InferenceServer,
        gate: TrafficGate | None,
        stop_event: asyncio.Event,
    ) -> None:
        self.settings = settings
        self.server = server
        self.gate = gate
        self.stop_event = stop_event
        self.stops: list[tuple[str, Stop]] = []  # started parts, in start order
        self.drain_secs = settings.exit_timeout_secs

    async def start(
        self, features: Features, remote: RemoteRepository | None
    ) -> asyncio.Task[None]:
        """Steps 2-6; the task serving HTTP (it ends if the listener dies).

        Raises:
            StartError: a part could not start.
        """
        settings, server, gate = self.settings, self.server, self.gate
        if features.metrics is not None:
            features.metrics.install_hooks()
        tracer = server.tracer
        if isinstance(tracer, TraceManager):  # stops last: the last requests' traces go out

            async def stop_tracing() -> None:
                if tracer.export is not None:  # spans to flush (a thread: it may wait)
                    await asyncio.to_thread(tracer.stop, TRACE_FLUSH_SECS)

            self.stops.append(("tracing", stop_tracing))
        monitor = server.monitor
        if isinstance(monitor, Monitor):  # after the models: the last requests are logged

            async def stop_monitoring() -> None:
                await asyncio.to_thread(monitor.close, PAYLOAD_FLUSH_SECS)

            self.stops.append(("monitoring", stop_monitoring))
        shm = SharedMemoryRegistry(enabled=settings.allow_client_shm)  # --allow-client-shm
        draining = self.stop_event.is_set
        if not settings.allow_http:  # --allow-http=false: a task that ends with the server
            http_task = asyncio.create_task(self._wait_stop(), name="pdserve-no-http")
        elif settings.http_workers > 1:  # --http-workers: front ends in their own processes
            http_task, stop_http = await start_http_workers(settings, server, draining, gate, shm)
            self.stops.append(("HTTP", stop_http))
        else:
            http_task, stop_http = await start_http(settings, server, draining, gate, shm)
            self.stops.append(("HTTP", stop_http))
        if features.grpc_server is not None:
            stop_grpc = await start_grpc(settings, server, features.grpc_server, gate, shm)
            self.stops.append(("gRPC", stop_grpc))
        settle_gc()  # also in a hub process (--http-workers) and with gRPC alone
        if features.metrics is not None and features.metrics_http is not None:
            stop_metrics = await start_metrics(
                settings, server, features.metrics, features.metrics_http, gate
            )
            if stop_metrics is not None:
                self.stops.append(("metrics", stop_metrics))
        if settings.model_control_mode == "poll":
            sync = remote.sync if remote is not None else None
            self.stops.append(("repository poller", start_poller(settings, server, sync)))

        async def stop_models() -> None:
            await server.stop(self.drain_secs)
            shm.close()  # the shared-memory regions' descriptors

        self.stops.append(("models", stop_models))
        return http_task

    async def _wait_stop(self) -> None:
        await self.stop_event.wait()

    async def run(self, http_task: asyncio.Task[None]) -> int:
        """Step 7, then serve until a signal or until HTTP dies; the exit code (1
        also when a model failed to load at start with ``--exit-on-error``)."""
        # The initial load runs as a task: a signal (or HTTP dying) is acted on at
        # once, even while a model's initialize() blocks.
        loading = asyncio.create_task(load_models(self.settings, self.server), name="pdserve-load")
        waiter = asyncio.create_task(self.stop_event.wait())
        try:
            await asyncio.wait([waiter, http_task, loading], return_when=asyncio.FIRST_COMPLETED)
            if loading.done():
                failed = loading.result()  # an error of the load itself is raised
                if failed and self.settings.exit_on_error:
                    # tritonserver's words (it exits 1 too)
                    log.error(
                        "failed to load all models (%d failed) and --exit-on-error is on: exiting",
                        failed,
                    )
                    self.drain_secs = 0
                    return 1
                await asyncio.wait([waiter, http_task], return_when=asyncio.FIRST_COMPLETED)
            else:
                log.info("shutting down while models load: abandoning the loads in progress")
                loading.cancel()
                await asyncio.wait([loading], timeout=ABANDON_WAIT_SECS)
        finally:
            waiter.cancel()
            loading.cancel()
        if http_task.done() and not self.stop_event.is_set():
            exc = http_task.exception() if not http_task.cancelled() else None
            log.error("HTTP server stopped: %s", exc)
            self.drain_secs = 0
            return 1
        log.info("shutting down: finishing in-flight requests (timeout %.0fs)", self.drain_secs)
        return 0

    async def stop(self) -> None:
        """Stop every started part, the last started first."""
        self.stop_event.set()  # from here on HTTP responses say Connection: close
        loop = asyncio.get_running_loop()
        for name, stop in reversed(self.stops):
            began = loop.time()
            try:
                await stop()
            except Exception:  # noqa: BLE001 - stop the other parts regardless
                log.exception("stopping %s failed", name)
            log.debug("%s stopped in %.0f ms", name, (loop.time() - began) * 1000)


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
    log_compat_flags(settings)
    try:
        features = import_features(settings)
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
    tls = settings.grpc_tls or settings.http_tls or settings.metrics_tls
    signals = _Signals(stop_event, exit_deadline, gate, tls is not None)
    serving = _Serving(settings, server, gate, stop_event)
    try:
        code = await serving.run(await serving.start(features, remote))
    except StartError as e:
        log.error("%s", e)
        code = 1
    finally:
        await serving.stop()
        signals.remove()
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
