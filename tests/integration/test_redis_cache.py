"""The response cache in Redis, shared by two pdserve replicas (issue 14 item 5).

One Debian ``redis-server`` (``make sysdeps``) on a free loopback port; two pdserve
processes with ``--cache-config redis,host=127.0.0.1 --cache-config redis,port=P``
(Triton's redis cache flags) and the same repository.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.batching_models import rowwise_expected, rowwise_io, write_model
from tests.conftest import ServerProcess, free_port, start_server
from tests.integration.test_rate_limit import Redis as RedisServer

CONFIG = "max_batch_size: 8\ndynamic_batching { }\nresponse_cache { enable: true }\n"


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RedisServer, ServerProcess, ServerProcess]]:
    redis_server = RedisServer(free_port())
    redis_server.start()
    tmp = tmp_path_factory.mktemp("redis-cache")
    repo = tmp / "repo"
    write_model(repo, "cached", CONFIG + rowwise_io(16), "rowwise")
    flags = ("--cache-config", "redis,host=127.0.0.1", "--cache-config")
    servers: list[ServerProcess] = []
    try:
        for name in ("a", "b"):
            servers.append(
                start_server(repo, tmp / f"{name}.log", *flags, f"redis,port={redis_server.port}")
            )
        yield redis_server, servers[0], servers[1]
    finally:
        for s in servers:
            s.stop()
        redis_server.kill()


def infer(server: ServerProcess, x: np.ndarray) -> np.ndarray:
    c = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return c.infer("cached", [inp]).as_numpy("OUTPUT0")


def stats(server: ServerProcess) -> tuple[int, int, int]:
    c = httpclient.InferenceServerClient(server.http_url)
    s = c.get_inference_statistics("cached")["model_stats"][0]
    inf = s["inference_stats"]
    return inf["cache_hit"]["count"], inf["cache_miss"]["count"], s["execution_count"]


def metric(server: ServerProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        m = re.search(rf"^{re.escape(name)} (\S+)$", r.read().decode(), re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_a_response_computed_on_a_is_a_hit_on_b(
    replicas: tuple[RedisServer, ServerProcess, ServerProcess],
) -> None:
    _, a, b = replicas
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    first = infer(a, x)
    np.testing.assert_allclose(first, rowwise_expected(x), atol=1e-5)
    np.testing.assert_array_equal(infer(b, x), first)
    assert stats(a) == (0, 1, 1)
    assert stats(b) == (1, 0, 0)  # B never ran the model
    assert metric(b, "nv_cache_num_hits") == 1
    assert metric(b, "pdserve_cache_errors_total") == 0


def test_concurrent_writers_of_the_same_requests(
    replicas: tuple[RedisServer, ServerProcess, ServerProcess],
) -> None:
    _, a, b = replicas
    xs = [np.full((1, 16), 10 + i, dtype=np.float32) for i in range(8)]
    errors: list[str] = []

    def worker(server: ServerProcess) -> None:
        for x in xs * 3:
            try:
                np.testing.assert_allclose(infer(server, x), rowwise_expected(x), atol=1e-4)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    # Each distinct request ran at least once, and at most once per thread (no
    # single-flight: concurrent misses of one key each run the model, as in Triton).
    ran = stats(a)[2] + stats(b)[2] - 1  # minus the first test's run
    assert 8 <= ran <= 32


def test_redis_down_serves_uncached_and_logs_once(
    replicas: tuple[RedisServer, ServerProcess, ServerProcess],
) -> None:
    redis_server, a, _ = replicas
    x = np.full((1, 16), -3, dtype=np.float32)
    redis_server.kill()
    try:
        for _ in range(10):
            np.testing.assert_allclose(infer(a, x), rowwise_expected(x), atol=1e-4)
        log = a.log()
        assert log.count("redis response cache") == 1 and "serving uncached" in log
        assert metric(a, "pdserve_cache_errors_total") >= 1
    finally:
        redis_server.start()
    # Back: after the retry pause the cache is used again (a new, empty Redis).
    deadline = time.monotonic() + 30
    while "reachable again" not in a.log():
        assert time.monotonic() < deadline, "no recovery line"
        infer(a, x)
        time.sleep(0.2)
    hits = stats(a)[0]
    infer(a, x)
    assert stats(a)[0] == hits + 1
    assert a.log().count("redis response cache") == 2
