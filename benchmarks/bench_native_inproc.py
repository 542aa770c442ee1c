"""Issue 11: the native HTTP transport's per-request CPU inside one process, without
sockets (the steady figure to compare two checkouts on a loaded machine).

``bench_frontend.py`` measures whole servers with ``wrk``; on a shared machine its
CPU-µs/request moves by 10-20 % between runs, more than most single changes on the
hot path. This drives the same code with no kernel in the way: ``-c`` connections
(:class:`~pdserve.frontends.http.native.HttpConnection` objects of a started
:class:`~pdserve.frontends.http.native.NativeHttpServer`) on a fake transport; each
response written makes that connection's next request arrive on the next loop
iteration, as a closed-loop client does. What runs per request is everything the
real server runs (httptools parse, dispatch, decode, checks, dynamic batcher, ONNX
Runtime, statistics, encode, response bytes) except the ``recv``/``send`` system calls
and the event loop's polling. Reported: process CPU-µs per request per round; take
the minimum (a round that shared its core with another process is only slower).

The model and body are ``bench_frontend.py``'s (``tiny``, one row of 64 FP32 as V2
JSON; made on first use). Run from the checkout to measure (``PYTHONPATH=.``), on one
core::

    PYTHONPATH=. taskset -c 0 .venv/bin/python benchmarks/bench_native_inproc.py \\
        -c 32 -n 20000 --rounds 5 [--profile] [--server-timing --ask-timing]
        [--model-param prediction_metrics=bins=0:10:40,range=0:5]

``--via-hub`` measures what an ``--http-workers`` front end adds (issue 11 point 4):
the same connections and app run over a :class:`~pdserve.frontends.workers.proxy.ProxyCore`
(what a front-end worker runs), whose channel (a real ``AF_UNIX`` socketpair) leads
to a :class:`~pdserve.frontends.workers.hub.FrontendHub` in a second process that
runs the server (what the main process runs). Each round reports the CPU of both
processes per request (``/proc/<pid>/task/*/schedstat``, nanoseconds, every thread);
the difference from a run without ``--via-hub`` is the channel's cost, free of wrk,
of the HTTP sockets and of processes competing for cores. ``--hub-cpu`` pins the
hub process (default: the driver's cores)::

    PYTHONPATH=. taskset -c 0 .venv/bin/python benchmarks/bench_native_inproc.py \\
        -c 32 -n 20000 --rounds 5 --via-hub [--hub-cpu 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import pstats
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
from bench_frontend import build_repo, write_body
from common import cli_parser

from pdserve.core.procmem import settle_gc
from pdserve.frontends.http.app import create_http_app
from pdserve.frontends.http.native import HttpConnection, NativeHttpServer
from pdserve.server import InferenceServer


def cpu_ns(pid: int) -> int:
    """Nanoseconds on CPU of every thread of process ``pid`` so far (the first field of
    ``/proc/<pid>/task/<tid>/schedstat``; threads that already exited are not counted)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


async def hub_main(fd: int, repo: str) -> None:
    """The ``--via-hub`` second process: the server and the hub on channel ``fd``,
    until the driver closes it (what the main process of ``--http-workers`` runs)."""
    from pdserve.frontends.shared_memory import SharedMemoryRegistry
    from pdserve.frontends.workers.hub import FrontendHub

    server = InferenceServer(repo)
    await server.start()
    done = asyncio.get_running_loop().create_future()
    hub = FrontendHub(server, SharedMemoryRegistry(enabled=False))
    hub.attach(socket.socket(fileno=fd), 0, lambda: done.done() or done.set_result(None))
    settle_gc()
    await done
    await server.stop()


async def start_hub(repo: str, hub_cpu: str | None) -> tuple[Any, subprocess.Popen[bytes]]:
    """Start :func:`hub_main` in a child process; returns (a ready ProxyCore on its
    channel, the child)."""
    from pdserve.frontends.workers import channel as ch
    from pdserve.frontends.workers.proxy import ProxyCore, WorkerClient

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pin = ["taskset", "-c", hub_cpu] if hub_cpu else []
    child = subprocess.Popen(
        [*pin, sys.executable, __file__, "--hub-fd", str(theirs.fileno()), "--repo", repo],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    client = WorkerClient()
    client.connect(lambda on_frame, on_close: ch.Channel(mine, "bench", on_frame, on_close))
    core = ProxyCore(client)
    for _ in range(600):
        with contextlib.suppress(Exception):
            if await core.ready():
                return core, child
        await asyncio.sleep(0.1)
    child.kill()
    raise RuntimeError("the hub process did not become ready in 60 s")


class _Transport(asyncio.Transport):
    """Takes the responses; each one lets its connection send the next request."""

    def __init__(self, conn: HttpConnection, state: dict[str, Any], request: bytes) -> None:
        super().__init__()
        self.conn = conn
        self.state = state
        self.request = request
        self.closing = False

    def write(self, data: Any) -> None:
        st = self.state
        st["answered"] += 1
        if not bytes(data[:16]).startswith(b"HTTP/1.1 200 OK"):
            st["errors"] += 1
            if st["errors"] == 1:
                print("unexpected response:", bytes(data[:300]), file=sys.stderr)
        if st["sent"] < st["total"]:
            st["sent"] += 1
            st["loop"].call_soon(self.conn.data_received, self.request)
        elif st["answered"] >= st["total"] and not st["done"].done():
            st["done"].set_result(None)

    def writelines(self, parts: Any) -> None:
        self.write(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def run(args: argparse.Namespace) -> list[float]:
    repo = build_repo()
    if args.model_param:  # tiny's parameters (monitoring: payload_log, prediction_metrics...)
        config = repo / "tiny" / "config.pbtxt"
        for item in args.model_param:
            key, _, value = item.partition("=")
            config.write_text(
                config.read_text()
                + f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'
            )
    body = write_body()[0].read_bytes()
    ask = b"x-pdserve-server-timing: 1\r\n" if args.ask_timing else b""
    request = (
        b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Content-Type: application/json\r\n%sContent-Length: %d\r\n\r\n" % (ask, len(body))
    ) + body
    if args.server_timing:
        from pdserve.core import timing

        timing.state.enabled = True
    loop = asyncio.get_running_loop()
    child: subprocess.Popen[bytes] | None = None
    if args.via_hub:
        core, child = await start_hub(str(repo), args.hub_cpu)
        server: Any = None
    else:
        core = server = InferenceServer(str(repo))
        if args.model_param:
            from pdserve.observability.monitoring.monitor import Monitor

            server.monitor = Monitor()
        await server.start()
    http = NativeHttpServer(create_http_app(core), "127.0.0.1", 0)
    await http.start()
    settle_gc()  # as the server does once it serves (a front-end worker too)
    figures = []
    try:
        for rnd in range(args.rounds):
            st: dict[str, Any] = {
                "answered": 0,
                "sent": 0,
                "errors": 0,
                "total": args.requests,
                "loop": loop,
                "done": loop.create_future(),
            }
            conns = []
            for _ in range(args.concurrency):
                conn = HttpConnection(http)
                conn.connection_made(_Transport(conn, st, request))
                conns.append(conn)
            profile = cProfile.Profile() if args.profile and rnd == args.rounds - 1 else None
            t0 = time.process_time()
            hub0 = 0 if child is None else cpu_ns(child.pid)
            if profile is not None:
                profile.enable()
            for conn in conns:
                st["sent"] += 1
                conn.data_received(request)
            await st["done"]
            if profile is not None:
                profile.disable()
            cpu = time.process_time() - t0
            hub = 0.0 if child is None else (cpu_ns(child.pid) - hub0) / 1e9
            us = 1e6 * (cpu + hub) / st["answered"]
            figures.append(us)
            parts = (
                ""
                if child is None
                else f" (front end {1e6 * cpu / st['answered']:.2f} + hub "
                f"{1e6 * hub / st['answered']:.2f})"
            )
            print(
                f"round {rnd}: {st['answered']} responses ({st['errors']} not 200), "
                f"{us:.2f} CPU-us/request{parts}{' (profiled)' if profile else ''}",
                flush=True,
            )
            for conn in conns:
                conn.connection_lost(None)
            if profile is not None:
                pstats.Stats(profile).sort_stats("tottime").print_stats(40)
    finally:
        await http.shutdown(0.1)
        if server is not None:
            await server.stop()
        if child is not None:
            core.client.channel.close()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
    return figures


def main(argv: list[str] | None = None) -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument(
        "-c", "--concurrency", type=int, default=32, help="connections in flight (default 32)"
    )
    p.add_argument(
        "-n", "--requests", type=int, default=20000, help="requests per round (default 20000)"
    )
    p.add_argument("--rounds", type=int, default=5, help="rounds; take the minimum (default 5)")
    p.add_argument("--profile", action="store_true", help="cProfile the last round")
    p.add_argument("--server-timing", action="store_true", help="as serve --server-timing")
    p.add_argument(
        "--model-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter of tiny's config (repeatable), with monitoring on as serve has it",
    )
    p.add_argument(
        "--ask-timing",
        action="store_true",
        help="every request asks for its Server-Timing (the x-pdserve-server-timing header)",
    )
    p.add_argument(
        "--via-hub",
        action="store_true",
        help="run the app over a ProxyCore whose hub and server are in a second process",
    )
    p.add_argument(
        "--hub-cpu",
        help="taskset cores of the hub process (--via-hub; default: the driver's own cores)",
    )
    p.add_argument("--hub-fd", type=int, help=argparse.SUPPRESS)  # the hub process itself
    p.add_argument("--repo", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hub_fd is not None:
        uvloop.run(hub_main(args.hub_fd, args.repo))
        return 0
    figures = uvloop.run(run(args))
    clean = figures[:-1] if args.profile and len(figures) > 1 else figures
    print(f"min {min(clean):.2f} CPU-us/request over {len(clean)} round(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
