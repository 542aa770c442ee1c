"""Response cache against a real pdserve (issue 4).

The server gets a small cache (Triton's ``--cache-config local,size=N``) so that
eviction is observable: each entry of the row-wise model is one FP32[1,16] output
(64 bytes) plus its 16-byte key, so 200 bytes hold two entries.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.batching_models import rowwise_expected, rowwise_io, write_model
from tests.conftest import ServerProcess, start_server

CONFIG = "max_batch_size: 8\ndynamic_batching { }\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("cache") / "repo"
    write_model(
        repo, "cached", CONFIG + "response_cache { enable: true }\n" + rowwise_io(16), "rowwise"
    )
    write_model(repo, "uncached", CONFIG + rowwise_io(16), "rowwise")
    srv = start_server(repo, repo.parent / "pdserve.log", "--cache-config", "local,size=200")
    yield srv
    srv.stop()


def infer(c: httpclient.InferenceServerClient, model: str, x: np.ndarray, **kw) -> np.ndarray:
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return c.infer(model, [inp], **kw).as_numpy("OUTPUT0")


def cache_stats(c: httpclient.InferenceServerClient, model: str) -> tuple[int, int, int]:
    s = c.get_inference_statistics(model)["model_stats"][0]
    inf = s["inference_stats"]
    return inf["cache_hit"]["count"], inf["cache_miss"]["count"], s["execution_count"]


def metric(server: ServerProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_hits_skip_the_model_and_return_the_same_outputs(server: ServerProcess) -> None:
    c = httpclient.InferenceServerClient(server.http_url)
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    b = a + 1
    first = infer(c, "cached", a)
    np.testing.assert_allclose(first, rowwise_expected(a), atol=1e-5)
    np.testing.assert_array_equal(infer(c, "cached", a), first)  # hit
    np.testing.assert_allclose(infer(c, "cached", b), rowwise_expected(b), atol=1e-5)  # miss
    np.testing.assert_array_equal(infer(c, "cached", a), first)  # hit
    assert cache_stats(c, "cached") == (2, 2, 2)
    stats = c.get_inference_statistics("cached")["model_stats"][0]
    # Triton's statistics extension: hits count in success (and queue), not in
    # inference_count or execution_count
    assert stats["inference_stats"]["success"]["count"] == 4
    assert stats["inference_stats"]["queue"]["count"] == 4
    assert stats["inference_count"] == 2
    # A different dtype/shape/value is a different key; so is another model.
    a2 = a.copy()
    a2[0, 0] = np.nextafter(np.float32(0), np.float32(1))
    infer(c, "cached", a2)
    assert cache_stats(c, "cached") == (2, 3, 3)
    # A model without response_cache never touches the cache.
    infer(c, "uncached", a)
    infer(c, "uncached", a)
    assert cache_stats(c, "uncached") == (0, 0, 2)
    label = '{model="cached",version="1"}'
    assert metric(server, f"nv_cache_num_hits_per_model{label}") == 2
    assert metric(server, f"nv_cache_num_misses_per_model{label}") == 3
    assert metric(server, "nv_cache_num_hits") == 2
    assert metric(server, "nv_cache_num_lookups") == 5


def test_least_recently_used_entry_is_evicted_by_size(server: ServerProcess) -> None:
    c = httpclient.InferenceServerClient(server.http_url)
    xs = [np.full((1, 16), 100 + i, dtype=np.float32) for i in range(3)]
    h0, m0, e0 = cache_stats(c, "cached")
    ev0 = metric(server, "nv_cache_num_evictions")
    infer(c, "cached", xs[0])  # miss
    infer(c, "cached", xs[1])  # miss
    infer(c, "cached", xs[0])  # hit: xs[0] is now the most recently used
    infer(c, "cached", xs[2])  # miss: evicts xs[1], the least recently used
    infer(c, "cached", xs[0])  # hit
    out = infer(c, "cached", xs[1])  # miss again: it was evicted
    np.testing.assert_allclose(out, rowwise_expected(xs[1]), atol=1e-4)
    h1, m1, e1 = cache_stats(c, "cached")
    assert (h1 - h0, m1 - m0, e1 - e0) == (2, 4, 4)
    assert metric(server, "nv_cache_num_evictions") - ev0 >= 2
    assert metric(server, "nv_cache_num_entries") == 2
    assert 0 < metric(server, "nv_cache_util") <= 1


def test_classification_applies_to_cached_outputs(server: ServerProcess) -> None:
    c = httpclient.InferenceServerClient(server.http_url)
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    out = [httpclient.InferRequestedOutput("OUTPUT0", class_count=2)]
    first = c.infer("cached", [inp], outputs=out).as_numpy("OUTPUT0")
    second = c.infer("cached", [inp], outputs=out).as_numpy("OUTPUT0")
    assert first.shape == (1, 2)
    np.testing.assert_array_equal(first, second)
    assert first[0, 0].decode().endswith(":15")  # the largest of the 16 outputs
