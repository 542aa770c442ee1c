"""The load pieces of a ``pdserve perf`` worker (:mod:`pdserve.app.perf.load`,
:mod:`pdserve.app.perf.worker`): the window record, failure kinds, request rotation,
the open loop's arrivals, and which load a spec gets."""

from __future__ import annotations

import asyncio
from array import array

import pytest

from pdserve.app.perf.grpc_load import GrpcioLoad, H2Load
from pdserve.app.perf.http_load import HttpLoad
from pdserve.app.perf.load import MAX_PENDING, Recorder, WorkerSpec, conn_error_key
from pdserve.app.perf.worker import make_load


def spec(protocol: str = "http", grpc_client: str = "raw", requests: int = 1) -> WorkerSpec:
    return WorkerSpec(
        index=0,
        protocol=protocol,
        host="127.0.0.1",
        port=9,
        requests=[b"r%d" % i for i in range(requests)],
        request_timeout_s=1.0,
        connect_timeout_s=1.0,
        grpc_client=grpc_client,
    )


def test_collect_takes_one_window_and_drops_what_is_before() -> None:
    rec = Recorder()
    for t, lat in ((10, 1), (20, 2), (30, 3), (40, 4)):
        rec.ends.append(t)
        rec.lats.append(lat)
        rec.sends.append(lat * 10)
        rec.recvs.append(lat * 100)
    rec.sent = 5
    rec.error("timeout", "x" * 1000)
    w = rec.collect(20, 40)
    assert list(array("q", w["lat"])) == [2, 3]
    assert (w["send_ns"], w["recv_ns"], w["sent"]) == (50, 500, 5)
    assert rec.ends == [40]  # everything before the window's end is gone
    # The error is stamped now (monotonic ns), after the window.
    assert w["errors"] == {}
    w = rec.collect(40, 2**62)
    assert list(array("q", w["lat"])) == [4]
    assert w["errors"] == {"timeout": 1} and len(w["examples"]["timeout"]) == 300
    assert w["sent"] == 0


def test_connection_failures_are_named() -> None:
    assert conn_error_key(ConnectionRefusedError()) == "connection refused"
    assert conn_error_key(TimeoutError()) == "connect timeout"
    assert conn_error_key(OSError(113, "No route to host")) == "no route to host"
    assert conn_error_key(ValueError()) == "ValueError"


@pytest.mark.parametrize(
    ("protocol", "client", "cls"),
    [("http", "raw", HttpLoad), ("grpc", "raw", H2Load), ("grpc", "grpcio", GrpcioLoad)],
)
def test_each_spec_gets_its_load(protocol: str, client: str, cls: type) -> None:
    async def main() -> None:
        load = make_load(spec(protocol, client, requests=3), asyncio.get_running_loop())
        try:
            assert isinstance(load, cls)
            sent = [load.next_request() for _ in range(4)]
            assert sent[0] != sent[1] and sent[0] == sent[3]  # round-robin
        finally:
            await load.aclose()

    asyncio.run(main())


def test_open_loop_arrivals_wait_then_drop() -> None:
    async def main() -> None:
        load = H2Load(spec("grpc"), asyncio.get_running_loop())
        try:
            load.mode, load.max_conns = "rate", 1
            load.arrival()
            load.arrival()
            assert load.pending == 2 and load.rec.delayed == 1  # only one may be in flight
            load.pending = MAX_PENDING
            load.arrival()
            assert load.rec.err_keys == ["dropped"]
        finally:
            load.mode = "idle"
            await load.aclose()

    asyncio.run(main())
