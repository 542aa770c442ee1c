"""A load-generating process of ``pdserve perf``.

Each worker is a separate process (``python -m pdserve.app.perf.worker FD``) with
one event loop, so the load is not capped by one interpreter; it imports little
(no numpy). The coordinator (:mod:`pdserve.app.perf.runner`) drives it over a pipe:

- ``("load", "concurrency", n)``: closed loop, ``n`` requests in flight;
- ``("load", "rate", rate, phase_s, max_conns, distribution)``: open loop
  (:meth:`~pdserve.app.perf.load.Load.set_rate`);
- ``("idle",)``: send nothing new (connections stay open);
- ``("collect", t0_ns, t1_ns)``: answer ``("window", record)`` with what completed in
  ``[t0, t1)`` (:meth:`~pdserve.app.perf.load.Recorder.collect`);
- ``("exit",)``: close everything and end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from pdserve.app.perf.load import Load, WorkerSpec

#: A command from the coordinator (see the module docstring).
Command = tuple[str | int | float, ...]


def make_load(spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> Load:
    """The load ``spec`` asks for (only its client's modules are imported)."""
    if spec.protocol != "grpc":
        from pdserve.app.perf.http_load import HttpLoad

        return HttpLoad(spec, loop)
    if spec.grpc_client == "grpcio":
        from pdserve.app.perf.grpc_load import GrpcioLoad

        return GrpcioLoad(spec, loop)
    from pdserve.app.perf.grpc_load import H2Load

    return H2Load(spec, loop)


class _Worker:
    """Reads the coordinator's commands from the pipe and applies them to the load."""

    def __init__(self, conn: Connection, spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> None:
        self.conn = conn
        self.loop = loop
        self.load = make_load(spec, loop)
        self.done: asyncio.Future[None] = loop.create_future()

    def on_command(self) -> None:
        try:
            while self.conn.poll():
                self.handle(self.conn.recv())
        except (EOFError, OSError):  # the coordinator is gone
            self.finish()
        except Exception:  # noqa: BLE001 - reported to the coordinator, then end
            with contextlib.suppress(OSError):
                self.conn.send(("fatal", traceback.format_exc()))
            self.finish()

    def handle(self, msg: Command) -> None:
        kind = msg[0]
        if kind == "load":
            if msg[1] == "concurrency":
                self.load.set_concurrency(int(msg[2]))
            else:
                self.load.set_rate(float(msg[2]), float(msg[3]), int(msg[4]), str(msg[5]))
        elif kind == "idle":
            self.load.set_idle()
        elif kind == "collect":
            window = self.load.rec.collect(int(msg[1]), int(msg[2]))
            window["outstanding"] = self.load.outstanding()
            self.conn.send(("window", window))
        elif kind == "exit":
            self.finish()

    def finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _serve(conn: Connection, spec: WorkerSpec) -> None:
    loop = asyncio.get_running_loop()
    worker = _Worker(conn, spec, loop)
    loop.add_reader(conn.fileno(), worker.on_command)
    conn.send(("ready", os.getpid()))
    try:
        await worker.done
    finally:
        loop.remove_reader(conn.fileno())
        await worker.load.aclose()


def main(conn: Connection, spec: WorkerSpec) -> None:
    """Serve the coordinator's commands on ``conn`` until ``exit`` or until the
    pipe closes. Ctrl-C is left to the coordinator (it stops the workers and keeps
    the results so far)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if spec.protocol == "http" or spec.grpc_client != "grpcio":
            try:
                import uvloop

                uvloop.run(_serve(conn, spec))
                return
            except ImportError:
                pass
        asyncio.run(_serve(conn, spec))
    except Exception:  # noqa: BLE001 - reported to the coordinator
        with contextlib.suppress(OSError):
            conn.send(("fatal", traceback.format_exc()))


if __name__ == "__main__":
    # ``python -m pdserve.app.perf.worker FD``: FD is this end of a socket pair; the
    # first message on it is the pickled WorkerSpec. Started this way (not through
    # multiprocessing) a worker imports only asyncio, uvloop/httptools or grpc.
    _conn = Connection(int(sys.argv[1]))
    main(_conn, pickle.loads(_conn.recv_bytes()))
