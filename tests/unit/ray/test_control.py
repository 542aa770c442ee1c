"""pdserve.ray.control without a cluster: what a replica reserves and how it is told.
(Deploying, the bounded wait, status and teardown run on a real cluster in
tests/integration/test_ray.py.)"""

from __future__ import annotations

from pdserve.ray.control import Proxies, _fmt, _host_port, _state, replica_resources


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
