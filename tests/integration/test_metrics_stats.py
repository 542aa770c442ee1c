"""Statistics extension and Prometheus metrics against a real pdserve (issue 4).

Every count is checked against the requests this test actually sent: successes,
failures by reason, inferences (rows), executions (batches), histogram counts.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.batching_models import rowwise_expected, rowwise_io, write_model
from tests.conftest import ServerProcess, start_server

CONFIG = (
    "max_batch_size: 8\n"
    'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n'
    "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("metrics") / "repo"
    write_model(
        repo,
        "counted",
        CONFIG + "dynamic_batching { max_queue_delay_microseconds: 2000 }\n" + rowwise_io(16),
        "rowwise",
    )
    write_model(repo, "idle", CONFIG + rowwise_io(16), "rowwise")
    srv = start_server(repo, repo.parent / "pdserve.log")
    yield srv
    srv.stop()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as ``{(name, sorted labels): value}``.

    Sample names are read as written (Triton's counters have no ``_total``); the
    text is also run through prometheus_client's parser to check it is valid.
    """
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    assert list(text_string_to_metric_families(text))
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, f"bad sample line: {line!r}"
        name, labels, val = match.groups()
        pairs = tuple(sorted(_LABEL.findall(labels or "")))
        samples[(name, pairs)] = float(val)
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_counts_match_the_requests_sent(server: ServerProcess) -> None:
    c = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((1 + i % 4, 16)).astype(np.float32) for i in range(60)]
    pending = []
    for x in inputs:
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        pending.append(c.async_infer("counted", [inp]))
    for x, p in zip(inputs, pending, strict=True):
        out = p.get_result().as_numpy("OUTPUT0")
        np.testing.assert_allclose(out, rowwise_expected(x), rtol=1e-5, atol=1e-5)
    # Three requests the server refuses (wrong shape): as in Triton, a request that fails
    # its checks before it is queued is no failure of the model, in statistics or metrics.
    for _ in range(3):
        bad = httpclient.InferInput("INPUT0", [1, 15], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 15), np.float32))
        with pytest.raises(InferenceServerException):
            c.infer("counted", [bad])

    rows = sum(x.shape[0] for x in inputs)
    stats = c.get_inference_statistics("counted")["model_stats"][0]
    assert stats["name"] == "counted" and stats["version"] == "1"
    assert stats["inference_count"] == rows
    inf = stats["inference_stats"]
    assert inf["success"]["count"] == len(inputs)
    assert inf["fail"]["count"] == 0
    assert inf["queue"]["count"] == len(inputs)
    assert inf["compute_infer"]["count"] == len(inputs)
    assert inf["success"]["ns"] > 0 and inf["compute_infer"]["ns"] > 0
    assert stats["last_inference"] > 0
    batch_rows = sum(b["batch_size"] * b["compute_infer"]["count"] for b in stats["batch_stats"])
    executions = sum(b["compute_infer"]["count"] for b in stats["batch_stats"])
    assert batch_rows == rows
    assert executions == stats["execution_count"]

    m = scrape(server)
    labels = {"model": "counted", "version": "1"}
    assert value(m, "nv_inference_request_success", **labels) == len(inputs)
    assert value(m, "nv_inference_request_failure", reason="REJECTED", **labels) == 0
    assert value(m, "nv_inference_request_failure", reason="BACKEND", **labels) == 0
    assert value(m, "nv_inference_count", **labels) == rows
    assert value(m, "nv_inference_exec_count", **labels) == stats["execution_count"]
    assert value(m, "nv_inference_pending_request_count", **labels) == 0
    assert value(m, "nv_inference_request_duration_us", **labels) == inf["success"]["ns"] // 1000
    assert value(m, "nv_inference_queue_duration_us", **labels) == inf["queue"]["ns"] // 1000
    assert (
        value(m, "nv_inference_compute_infer_duration_us", **labels)
        == inf["compute_infer"]["ns"] // 1000
    )
    assert value(m, "nv_inference_compute_input_duration_us", **labels) >= 0
    assert value(m, "nv_inference_compute_output_duration_us", **labels) >= 0
    # Histograms: one observation per successful request / executed batch.
    assert value(m, "pdserve_request_duration_seconds_count", **labels) == len(inputs)
    assert value(m, "pdserve_request_duration_seconds_bucket", le="+Inf", **labels) == len(inputs)
    assert value(m, "pdserve_queue_duration_seconds_count", **labels) == len(inputs)
    assert value(m, "pdserve_compute_duration_seconds_count", **labels) == len(inputs)
    assert value(m, "pdserve_batch_size_count", **labels) == stats["execution_count"]
    assert value(m, "pdserve_batch_size_sum", **labels) == rows
    assert value(m, "pdserve_request_duration_seconds_sum", **labels) == pytest.approx(
        inf["success"]["ns"] / 1e9, rel=1e-6
    )
    buckets = [
        v
        for (name, lbl), v in m.items()
        if name == "pdserve_request_duration_seconds_bucket" and ("model", "counted") in lbl
    ]
    assert buckets == sorted(buckets)  # cumulative
    # The model nobody called reports zeros, not missing series.
    idle = {"model": "idle", "version": "1"}
    assert value(m, "nv_inference_request_success", **idle) == 0
    assert value(m, "nv_inference_exec_count", **idle) == 0


def test_server_and_process_metrics(server: ServerProcess) -> None:
    m = scrape(server)
    names = {name for name, _ in m}
    assert 0.0 <= value(m, "nv_cpu_utilization") <= 1.0
    assert value(m, "nv_cpu_memory_total_bytes") >= value(m, "nv_cpu_memory_used_bytes") > 0
    assert value(m, "process_resident_memory_bytes") > 0
    assert "process_cpu_seconds_total" in names
    try:
        import pynvml  # noqa: F401

        has_nvml = True
    except ImportError:
        has_nvml = False
    if not has_nvml:  # no GPU library here: no GPU series at all, and no error
        assert not any(n.startswith("nv_gpu_") for n in names)
    # No response cache configured: no cache series.
    assert "nv_cache_num_entries" not in names


def test_metrics_listener_paths(server: ServerProcess) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/other", timeout=10)
    assert e.value.code == 404
    req = urllib.request.Request(f"http://127.0.0.1:{server.metrics_port}/metrics", method="HEAD")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        assert r.read() == b""


def test_statistics_endpoint_scopes(server: ServerProcess) -> None:
    c = httpclient.InferenceServerClient(server.http_url)
    everything = c.get_inference_statistics()["model_stats"]
    assert {(s["name"], s["version"]) for s in everything} == {("counted", "1"), ("idle", "1")}
    one = c.get_inference_statistics("idle", "1")["model_stats"]
    assert len(one) == 1 and one[0]["inference_count"] == 0 and one[0]["batch_stats"] == []
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
                "cache_hit", "cache_miss"):  # fmt: skip
        assert one[0]["inference_stats"][key] == {"count": 0, "ns": 0}
    for args in (("missing",), ("idle", "9"), ("idle", "x")):
        with pytest.raises(InferenceServerException) as e:
            c.get_inference_statistics(*args)
        assert e.value.status() == "400" and args[0] in str(e.value)  # Triton: INVALID_ARG
