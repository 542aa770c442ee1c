"""``pdserve.app.http_workers``: holding the HTTP port for the front-end workers, and
the headers a worker forwards to the main process's gate."""

from __future__ import annotations

import socket

import pytest

from pdserve.app.http_workers import gate_header_names, reserve_port, reuseport_listener
from pdserve.frontends.traffic.apis import parse_restricted
from pdserve.frontends.traffic.gate import TrafficGate


def test_a_taken_port_cannot_be_reserved() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError):
            reserve_port("127.0.0.1", port)


def test_the_reserved_port_takes_the_workers_listeners_and_nothing_else() -> None:
    reserve = reserve_port("127.0.0.1", 0)
    port = reserve.getsockname()[1]
    try:
        a = reuseport_listener("127.0.0.1", port)
        b = reuseport_listener("127.0.0.1", port)  # two workers on one port
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # a plain bind (another server) is refused
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # a listener accepts it
        a.close()
        b.close()
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # still held while no worker listens
    finally:
        reserve.close()


def test_gate_header_names_include_the_restricted_apis_headers() -> None:
    gate = TrafficGate(http_restricted=parse_restricted(["model-repository:admin-key=s3"], "x"))
    names = gate_header_names(gate)
    assert names[:2] == ["authorization", "triton-access-token"]
    assert "admin-key" in names
