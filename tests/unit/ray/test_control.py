"""pdserve.ray.control without a cluster: what a replica reserves and how it is told.
(Deploying, the bounded wait, status and teardown run on a real cluster in
tests/integration/test_ray.py.)"""

from __future__ import annotations

import socket
import time

import pytest

from pdserve.ray.control import (
    PROBE_S,
    Proxies,
    _fmt,
    _host_port,
    _probe,
    _state,
    replica_resources,
)


def test_replica_resources_in_ray_names() -> None:
    need = replica_resources(
        {"num_cpus": 2, "num_gpus": 1, "resources": {"head": 0.001}, "runtime_env": {}}
    )
    assert need == {"CPU": 2.0, "GPU": 1.0, "head": 0.001}
    assert replica_resources({"num_cpus": 0}) == {}


def test_resources_read_as_text() -> None:
    text = _fmt({"CPU": 16.0, "GPU": 1.0, "memory": 1e10, "node:127.0.0.2": 1.0})
    assert text == "CPU 16, GPU 1"
    assert _fmt({}) == "nothing"
    assert _state("RUNNING") == "RUNNING"


def test_proxies_default_to_the_loopback() -> None:
    p = Proxies()
    assert (p.host, p.http_port, p.grpc_port, p.location) == ("127.0.0.1", 8000, 9000, "HeadOnly")


def test_host_port_brackets_an_ipv6_host() -> None:
    assert _host_port("127.0.0.2", 30000) == "127.0.0.2:30000"
    assert _host_port("::1", 30000) == "[::1]:30000"
    assert _host_port("[::1]", 30000) == "[::1]:30000"
    assert _host_port("fe80::1", 8000) == "[fe80::1]:8000"


def test_probe_refuses_an_address_where_nothing_listens() -> None:
    with socket.socket() as s:  # a port that was free a moment ago and is closed now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"nothing accepts a connection at 127.0.0.1:{port}"):
        _probe(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < PROBE_S
    with pytest.raises(ConnectionError):
        _probe("127.0.0.1:not-a-port")


def test_probe_passes_a_listening_address_and_other_forms() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        _probe(f"127.0.0.1:{s.getsockname()[1]}")
    for address in (None, "", "auto", "ray://127.0.0.1:1"):
        _probe(address)
