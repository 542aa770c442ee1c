"""``pdserve top`` and the ``pdserve_recent`` stats extra against a real pdserve (issue 17).

Load: ``error_codes`` (a python model) answering OUT for "" and failing for
"respond:INTERNAL", one request in four failing; the view's row for it must show
that QPS, about 25% errors and a p99; the stats endpoint's ``pdserve_recent`` the same
counts; tritonclient (HTTP and gRPC) still parses the statistics.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, ServerProcess, free_port, start_server

MODELS = ROOT / "tests" / "data" / "python_models"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("top") / "repo"
    shutil.copytree(MODELS / "error_codes", repo / "error_codes")
    srv = start_server(repo, repo.parent / "pdserve.log")
    yield srv
    srv.stop()


def _request(client: httpclient.InferenceServerClient, mode: str) -> bool:
    tensor = httpclient.InferInput("MODE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([mode.encode()], dtype=object))
    try:
        client.infer("error_codes", [tensor])
        return True
    except InferenceServerException:
        return False


def _load(server: ServerProcess, stop: threading.Event, counts: list[int]) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    i = 0
    while not stop.is_set():
        ok = _request(client, "respond:INTERNAL" if i % 4 == 3 else "")
        counts[0 if ok else 1] += 1
        i += 1


def _top(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "top", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def test_top_once_shows_qps_errors_and_p99(server: ServerProcess) -> None:
    stop = threading.Event()
    counts = [0, 0]
    loader = threading.Thread(target=_load, args=(server, stop, counts))
    loader.start()
    try:
        time.sleep(0.5)
        r = _top("--once", "--interval", "2", "--url", f"127.0.0.1:{server.metrics_port}")
    finally:
        stop.set()
        loader.join()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("pdserve top -- http://127.0.0.1:")
    assert lines[1].split() == [
        "MODEL",
        "QPS",
        "ERR/S",
        "ERR%",
        "P50ms",
        "P99ms",
        "QUEUE",
        "QP99ms",
    ]
    row = next(line.split() for line in lines[2:] if line.startswith("error_codes"))
    qps, err_s, err_pct, p50, p99 = (float(x) for x in row[1:6])
    assert qps > 5 and 0 < err_s < qps
    assert 15 <= err_pct <= 35  # one request in four fails
    assert 0 < p50 <= p99 < 2000
    assert "\x1b[" not in r.stdout  # not a terminal: plain lines


def test_stats_extra_counts_the_load_and_clients_still_parse(server: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    before = client.get_inference_statistics("error_codes")["model_stats"][0]["pdserve_recent"]
    for i in range(20):
        _request(client, "respond:INTERNAL" if i < 5 else "")
    stats = client.get_inference_statistics("error_codes")["model_stats"][0]
    recent = stats["pdserve_recent"]
    assert recent["success"] - before["success"] == 15
    assert recent["failure"] - before["failure"] == 5
    assert 0 < recent["error_rate"] < 1 and recent["window_s"] == 60
    lat = recent["latency_us"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"]
    assert stats["inference_stats"]["success"]["count"] >= 15  # Triton's fields unchanged
    g = grpcclient.InferenceServerClient(server.grpc_url)
    gstats = g.get_inference_statistics("error_codes", as_json=True)["model_stats"][0]
    assert (
        int(gstats["inference_stats"]["success"]["count"])
        == stats["inference_stats"]["success"]["count"]
    )
    assert "pdserve_recent" not in gstats  # gRPC's message has no place for it


def test_top_when_the_server_is_down() -> None:
    port = free_port()
    r = _top("--once", "--url", f"127.0.0.1:{port}")
    assert r.returncode == 1
    assert f"cannot reach http://127.0.0.1:{port}/metrics" in r.stderr
    assert "--metrics-port" in r.stderr
    live = _top("--count", "2", "--interval", "0.2", "--url", f"127.0.0.1:{port}")
    assert live.returncode == 0
    assert live.stdout.count("(retrying)") == 2


@pytest.mark.parametrize("args", [["--interval", "0"], ["--interval", "nan"], ["--count", "-1"]])
def test_bad_arguments(args: list[str]) -> None:
    r = _top("--once", *args, "--url", "127.0.0.1:1")
    assert r.returncode == 2 and "pdserve top:" in r.stderr
