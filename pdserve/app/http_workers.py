"""``--http-workers N``: N HTTP front-end processes on one port.

With N > 1 the main process (models, dynamic batching, statistics, the metrics
listener, gRPC) does not serve HTTP itself: :class:`HttpWorkers` starts N worker
processes (``python -m pdserve.app.http_workers``), each of which binds
``--host``:``--http-port`` with ``SO_REUSEPORT`` (the kernel spreads new connections
over them) and runs the same HTTP front end as a single process
(:func:`pdserve.app.start.start_http`: the same transport, limits and app) over a
proxy of the core (:mod:`pdserve.frontends.workers.proxy`). Each worker decodes and
encodes HTTP on its own core and hands tensors to the main process through the
python backend's shared-memory channel (:mod:`pdserve.frontends.workers.channel`).

The main process (core, batcher, gRPC, metrics) is not one of the N: a front end that
crashes never takes a model down. Port, crash, hang and shutdown: :class:`HttpWorkers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pdserve
from pdserve.app.build import StartError
from pdserve.app.logging_setup import setup_serve_logging
from pdserve.app.settings import Settings
from pdserve.app.start import Stop, http_listen_error, start_http
from pdserve.core.api import InferenceCore
from pdserve.frontends.shared_memory import SharedMemoryRegistry
from pdserve.frontends.tls import reload_all as reload_tls
from pdserve.frontends.traffic.gate import TrafficGate
from pdserve.frontends.workers import channel as ch
from pdserve.frontends.workers.hub import FrontendHub, WorkerLink

if TYPE_CHECKING:
    from pdserve.server import InferenceServer

log = logging.getLogger("pdserve.workers")

#: Seconds a worker has to start listening.
START_TIMEOUT_SECS = 60.0
#: First wait before restarting a worker that died.
RESTART_DELAY_SECS = 0.2
#: Longest wait between restarts of a worker that keeps dying.
MAX_RESTART_DELAY_SECS = 10.0
#: A worker that lived this long before dying is restarted after the first delay again.
STABLE_SECS = 30.0
#: Seconds a worker has to finish after SIGTERM (its listener's accept wait, settle
#: and grace: see :func:`pdserve.app.start.start_http`) before it is killed.
STOP_TIMEOUT_SECS = 15.0
#: How often the main process pings each worker (the liveness check).
PING_INTERVAL_SECS = 1.0
#: Seconds without a ``PONG`` after which a worker is taken as hung: SIGKILLed and
#: restarted. Generous: a worker's event loop on a loaded machine may be late by a
#: second or two, never by this much while it still serves.
LIVENESS_TIMEOUT_SECS = 5.0
#: How often the main process looks whether the shutdown began (to tell the workers).
_DRAIN_POLL_SECS = 0.05


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def reserve_port(host: str, port: int) -> socket.socket:
    """Check that ``host``:``port`` is free and hold it for the workers: a bound, not
    listening ``SO_REUSEPORT`` socket (port 0: a free port; read it back with
    ``getsockname``).

    Raises:
        OSError: the port is in use (``EADDRINUSE``) or the address cannot be bound.
    """
    family = _family(host)
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # no SO_REUSEPORT: any holder
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def reuseport_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening ``SO_REUSEPORT`` socket on ``host``:``port`` (a worker's).

    Raises:
        OSError: it cannot be bound.
    """
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def gate_header_names(gate: TrafficGate) -> list[str]:
    """The request headers the gate may read: the credentials' and each restricted
    API's (a worker sends them along with its check)."""
    names = ["authorization", "triton-access-token"]
    names += [r.key for r in gate.http_restricted.values() if r.key not in names]
    return names


@dataclasses.dataclass
class _Worker:
    index: int
    proc: asyncio.subprocess.Process
    link: WorkerLink
    started: float


class HttpWorkers:
    """The supervisor of the N front-end workers, in the main process.

    - **Port**: the main process checks that the port is free (a plain bind, so a port
      taken by anything fails the start as in one process), then keeps a bound,
      non-listening ``SO_REUSEPORT`` socket on it for its lifetime so that the port stays
      pdserve's while a worker restarts. Port 0 picks a free port for all workers.
    - **Crash**: a worker that dies (even SIGKILL) is restarted (after
      :data:`RESTART_DELAY_SECS`, doubling while it keeps dying within
      :data:`STABLE_SECS`, at most :data:`MAX_RESTART_DELAY_SECS`); only its own
      connections are lost (its requests in the main process are cancelled as if their
      clients had gone); the other workers keep serving.
    - **Hang**: a worker that stops answering (SIGSTOPped, or its event loop stuck)
      would keep the connections the kernel hands it waiting forever. The main process
      sends each worker a ``PING`` every :data:`PING_INTERVAL_SECS`; a worker whose event
      loop has not answered (``PONG``) for :data:`LIVENESS_TIMEOUT_SECS` is SIGKILLed and
      restarted as after a crash (its own connections are lost; the others are not).
    - **Shutdown**: the main process tells the workers when the shutdown begins (their
      responses then say ``Connection: close``); after the models stopped, each worker
      gets SIGTERM and closes its listener as one process does
      (:mod:`pdserve.app.listeners`: the accept queue is served, in-flight requests
      finish), then exits. Workers ignore SIGINT (a terminal's Ctrl-C reaches the whole
      process group; the main process leads the shutdown) and exit when the main process
      is gone (end of file on their channel).
    - **Health, statistics, metrics**: answered by the main process: counted once.

    Args:
        settings: the server's settings (each worker gets them, with the port
            resolved).
        server: the core the workers' requests run on.
        shared_memory: the system shared-memory registry (shared with gRPC).
        gate: the auth / rate-limit gate, or None.
        draining: true from the shutdown signal on.
    """

    def __init__(
        self,
        settings: Settings,
        server: InferenceCore,
        shared_memory: SharedMemoryRegistry,
        gate: TrafficGate | None,
        draining: Callable[[], bool],
    ) -> None:
        self.settings = settings
        self.count = settings.http_workers
        self.hub = FrontendHub(server, shared_memory, gate)
        self.gate_headers = None if gate is None else gate_header_names(gate)
        self.shm_enabled = shared_memory.enabled
        self.draining = draining
        self.workers: dict[int, _Worker] = {}
        self.restarts = 0
        self.stopping = False
        self.port = 0
        self._reserve: socket.socket | None = None
        self._watchers: set[asyncio.Task[None]] = set()
        self._drain_task: asyncio.Task[None] | None = None
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        """Hold the port, start every worker and wait until each listens.

        Raises:
            OSError: the port cannot be had.
            RuntimeError: a worker did not start.
        """
        self._reserve = reserve_port(self.settings.http_host, self.settings.http_port)
        self.port = self._reserve.getsockname()[1]
        self.settings = dataclasses.replace(self.settings, http_port=self.port, http_workers=1)
        try:
            await asyncio.gather(*(self._start_worker(i) for i in range(self.count)))
        except BaseException:
            await self.stop()
            raise
        self._drain_task = asyncio.get_running_loop().create_task(self._watch_drain())

    async def _start_worker(self, index: int) -> _Worker:
        loop = asyncio.get_running_loop()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        root = str(Path(pdserve.__file__).resolve().parents[1])  # this pdserve, not another
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "pdserve.app.http_workers",
                str(child.fileno()),
                str(index),
                pass_fds=(child.fileno(),),
                env=env,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        link = self.hub.attach(parent, index, lambda: None)
        link.channel.send(ch.INIT, (index, self.settings, self.gate_headers, self.shm_enabled))
        worker = _Worker(index, proc, link, time.monotonic())
        self.workers[index] = worker
        try:
            async with asyncio.timeout(START_TIMEOUT_SECS):
                await link.ready
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise RuntimeError(
                f"HTTP worker {index} did not start (exit code {proc.returncode}): {exc!r}"
            ) from None
        log.info("HTTP worker %d (pid %d) listening on port %d", index, proc.pid, self.port)
        task = loop.create_task(self._watch(worker), name=f"pdserve-http-worker{index}")
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        return worker

    async def _watch(self, worker: _Worker) -> None:
        """Restart ``worker`` whenever it dies (until the shutdown)."""
        delay = RESTART_DELAY_SECS
        while True:
            code = await self._wait_alive(worker)
            worker.link.channel.close()
            if self.stopping:
                return
            lived = time.monotonic() - worker.started
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            delay = RESTART_DELAY_SECS if lived >= STABLE_SECS else delay
            log.error(
                "HTTP worker %d (pid %d) %s; restarting it in %.1fs",
                worker.index,
                worker.proc.pid,
                how,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RESTART_DELAY_SECS)
            if self.stopping:
                return
            try:
                await self._start_worker(worker.index)
            except Exception as exc:  # noqa: BLE001 - keep trying; the others still serve
                log.error("restarting HTTP worker %d failed: %s", worker.index, exc)
                continue
            self.restarts += 1
            return  # the fresh worker has its own watcher

    async def _wait_alive(self, worker: _Worker) -> int:
        """Wait until ``worker`` exits, pinging it meanwhile; SIGKILL it once it has
        not answered for :data:`LIVENESS_TIMEOUT_SECS` (not during the shutdown, which
        has its own deadline). Returns its exit code."""
        exited = asyncio.ensure_future(worker.proc.wait())
        link = worker.link
        link.last_pong = time.monotonic()
        seq = 0
        while True:
            seq += 1
            link.channel.send(ch.PING, (seq,))
            done, _ = await asyncio.wait((exited,), timeout=PING_INTERVAL_SECS)
            if done:
                return exited.result()
            silent = time.monotonic() - link.last_pong
            if silent > LIVENESS_TIMEOUT_SECS and not self.stopping:
                log.error(
                    "HTTP worker %d (pid %d) has not answered for %.1fs: killing it",
                    worker.index,
                    worker.proc.pid,
                    silent,
                )
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
                return await exited

    async def _watch_drain(self) -> None:
        while not self.draining():
            await asyncio.sleep(_DRAIN_POLL_SECS)
        self.hub.broadcast(ch.DRAIN, ())

    def pids(self) -> list[int]:
        """The workers' process ids."""
        return [w.proc.pid for w in self.workers.values()]

    async def stop(self) -> None:
        """SIGTERM every worker (each finishes what reached it, then exits); kill
        those still running after :data:`STOP_TIMEOUT_SECS`; release the port."""
        self.stopping = True
        if self._drain_task is not None:
            self._drain_task.cancel()
        self.hub.broadcast(ch.DRAIN, ())
        workers = list(self.workers.values())
        for w in workers:
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)
        waits = [asyncio.ensure_future(w.proc.wait()) for w in workers]
        if waits:
            _, late = await asyncio.wait(waits, timeout=STOP_TIMEOUT_SECS)
            for w in workers:
                if w.proc.returncode is None:
                    log.warning("HTTP worker %d did not stop in time: killing it", w.index)
                    with contextlib.suppress(ProcessLookupError):
                        w.proc.kill()
            if late:
                await asyncio.wait(late, timeout=5.0)
        for w in workers:
            w.link.channel.close()
        for task in list(self._watchers):
            task.cancel()
        if self._reserve is not None:
            self._reserve.close()
            self._reserve = None


async def start_http_workers(
    settings: Settings,
    server: InferenceServer,
    draining: Callable[[], bool] = lambda: False,
    gate: TrafficGate | None = None,
    shm: SharedMemoryRegistry | None = None,
) -> tuple[asyncio.Task[None], Stop]:
    """Step 3 with ``--http-workers N`` (N > 1): N front-end worker processes on the
    HTTP port (:mod:`pdserve.app.http_workers`); returns once each listens.

    Returns:
        a task that ends only if the workers' supervision fails, and the stopper (each
        worker closes its listener as :func:`start_http`'s does, then exits).

    Raises:
        StartError: the port is taken or a worker did not start.
    """
    workers = HttpWorkers(
        settings, server, shm if shm is not None else SharedMemoryRegistry(), gate, draining
    )
    try:
        await workers.start()
    except OSError as e:
        raise http_listen_error(settings, e) from None
    except RuntimeError as e:
        raise StartError(str(e)) from None
    logging.getLogger("pdserve").info(
        "HTTP (KServe V2) listening on %s://%s:%d (%d worker processes)",
        "https" if settings.http_use_ssl else "http",
        settings.http_host,
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


# --------------------------------------------------------------------------- worker


async def _serve_worker(fd: int) -> int:
    """A worker's life: take the settings, listen, serve until SIGTERM or until the
    main process is gone."""
    from pdserve.frontends.workers.proxy import (
        ProxyCore,
        ProxyGate,
        ProxySharedMemory,
        WorkerClient,
    )

    loop = asyncio.get_running_loop()
    sock = socket.socket(fileno=fd)
    client = WorkerClient()
    channel = client.connect(
        lambda on_frame, on_close: ch.Channel(
            sock, f"http-worker.{os.getpid()}", on_frame, on_close
        )
    )
    assert client.init is not None and client.closed is not None
    try:
        index, settings, gate_headers, shm_enabled = await client.init
    except ConnectionError:
        return 1
    setup_serve_logging(settings)
    core = ProxyCore(client)
    gate: TrafficGate | None = None if gate_headers is None else ProxyGate(client, gate_headers)
    shm = ProxySharedMemory(client, core, shm_enabled)
    stop_event = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop_event.set)
    if settings.http_use_ssl:  # changed files are also re-read at the next handshake
        loop.add_signal_handler(signal.SIGHUP, reload_tls, "SIGHUP")
    listener = reuseport_listener(settings.http_host, settings.http_port)

    def draining() -> bool:
        return client.draining or stop_event.is_set()

    # ProxyCore answers health and metadata with coroutines; the HTTP app awaits any
    # awaitable a core returns, so it stands for the InferenceCore the app is typed with
    proxy = cast("InferenceCore", core)
    http_task, stop_http = await start_http(settings, proxy, draining, gate, shm, sock=listener)
    channel.send(ch.READY, (os.getpid(),))
    waits = [
        loop.create_task(stop_event.wait()),
        loop.create_task(client.closed.wait()),
        http_task,
    ]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if client.closed.is_set():  # the main process is gone: nothing can be served
        logging.getLogger("pdserve.workers").error(
            "HTTP worker %d: the server's main process is gone; exiting", index
        )
        os._exit(1)
    await stop_http()
    channel.close()
    return 0 if stop_event.is_set() else 1


def worker_main(argv: list[str]) -> int:
    """Entry point of a worker process: ``python -m pdserve.app.http_workers FD INDEX``
    (FD: its end of the socketpair; INDEX: for the process title and logs)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process leads the shutdown
    fd = int(argv[1])
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_serve_worker(fd))
    return uvloop.run(_serve_worker(fd))


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv))
