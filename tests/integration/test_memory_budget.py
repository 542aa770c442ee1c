"""Memory per model, the model memory budget and on-demand loads (issue 16, item 4).

A real pdserve (``--model-control-mode on_demand``) on examples' models and python
test models; clients are urllib and tritonclient.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import EXAMPLE_REPO, ROOT, ServerProcess, copy_models, start_server

PY_MODELS = ROOT / "tests" / "data" / "python_models"
MIB = 1024**2


def http(server: ServerProcess, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One HTTP call; returns (status, parsed JSON body or None)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, (json.loads(raw) if raw.strip() else None)


def index(server: ServerProcess) -> dict[str, list[dict[str, Any]]]:
    """Repository index rows by model name."""
    status, rows = http(server, "POST", "/v2/repository/index", {})
    assert status == 200
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["name"], []).append(r)
    return out


def loaded(server: ServerProcess) -> set[str]:
    """Names of the models with a READY version."""
    return {n for n, rows in index(server).items() if any(r.get("state") == "READY" for r in rows)}


def metric(server: ServerProcess, name: str, model: str) -> float:
    """The value of ``name{model="..."...}`` in /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        text = r.read().decode()
    m = re.search(rf'^{name}\{{model="{re.escape(model)}"[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def infer_identity(server: ServerProcess, model: str) -> tuple[int, Any]:
    """One request to a copy of the ``identity`` python test model."""
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    return http(server, "POST", f"/v2/models/{model}/infer", body)


def infer_slow(server: ServerProcess, model: str, secs: float) -> tuple[int, Any]:
    """One request to the ``sleepy`` python test model: it sleeps ``secs``."""
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [secs]}]}
    return http(server, "POST", f"/v2/models/{model}/infer", body)


def infer_digits(server: ServerProcess, **params: Any) -> tuple[int, Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]
    }
    if params:
        body["parameters"] = params
    return http(server, "POST", "/v2/models/digits/infer", body)


def add_python_model(repo: Path, src: str, name: str, instances: int = 1) -> None:
    """Copy test model ``src`` into ``repo`` as ``name`` with ``instances`` instances."""
    dst = repo / name
    shutil.copytree(PY_MODELS / src, dst)
    cfg = (dst / "config.pbtxt").read_text()
    cfg = re.sub(r'^name: "[^"]*"', f'name: "{name}"', cfg, flags=re.M)
    cfg = re.sub(r"count: \d+", f"count: {instances}", cfg)
    (dst / "config.pbtxt").write_text(cfg)


# -- memory per model ------------------------------------------------------------------


def test_memory_in_index_stats_and_metrics(tmp_path: Path) -> None:
    server = start_server(
        EXAMPLE_REPO,
        tmp_path / "log",
        "--model-control-mode=explicit",
        *("--load-model", "tiny", "--load-model", "efficientnet_lite0"),
        *("--load-model", "preprocess", "--load-model", "image_classifier"),
        *("--load-model", "postprocess"),
    )
    try:
        rows = index(server)
        eff = rows["efficientnet_lite0"][0]
        # 19 MB of weights: ORT's session holds at least that much
        assert eff["memory_source"] == "rss_delta"
        assert eff["memory_bytes"] > 10 * MIB
        pre = rows["preprocess"][0]
        assert pre["memory_source"] == "worker_rss"
        assert pre["memory_bytes"] > 10 * MIB  # one worker process with numpy
        assert rows["image_classifier"][0]["memory_bytes"] == 0
        assert rows["image_classifier"][0]["memory_source"] == "ensemble"
        assert rows["tiny"][0]["memory_source"] == "rss_delta"
        assert "memory_bytes" not in rows["digits"][0]  # never loaded

        status, stats = http(server, "GET", "/v2/models/efficientnet_lite0/stats")
        assert status == 200
        entry = stats["model_stats"][0]
        assert entry["memory_bytes"] == eff["memory_bytes"]
        assert entry["memory_usage"] == [{"type": "CPU", "id": 0, "byte_size": eff["memory_bytes"]}]
        # gRPC carries Triton's memory_usage message
        g = grpcclient.InferenceServerClient(server.grpc_url)
        gstats = g.get_inference_statistics("preprocess", as_json=True)
        usage = gstats["model_stats"][0]["memory_usage"][0]
        assert usage["type"] == "CPU" and int(usage["byte_size"]) == pre["memory_bytes"]

        assert metric(server, "pdserve_model_memory_bytes", "preprocess") == pre["memory_bytes"]
        assert metric(server, "pdserve_model_loads_total", "efficientnet_lite0") == 1
        assert metric(server, "pdserve_model_evictions_total", "efficientnet_lite0") == 0
        # explicit mode: a request for a model not loaded does not load it
        status, body = infer_digits(server)
        assert status in (400, 404, 503)
        assert "digits" not in loaded(server)
    finally:
        server.stop()


# -- on-demand loads -------------------------------------------------------------------


def test_concurrent_requests_for_an_unloaded_model_share_one_load(tmp_path: Path) -> None:
    server = start_server(
        EXAMPLE_REPO, tmp_path / "log", "--model-control-mode=on_demand", "--pin-model", "tiny"
    )
    try:
        assert loaded(server) == {"tiny"}
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: infer_digits(server), range(8)))
        for status, body in results:
            assert status == 200, body
            assert body["model_name"] == "digits"
            assert body["outputs"][0]["name"] == "label"
        assert "digits" in loaded(server)
        assert metric(server, "pdserve_model_loads_total", "digits") == 1
        assert 1 <= metric(server, "pdserve_model_load_misses_total", "digits") <= 8
        assert server.log().count("model digits: not loaded; loading it on demand") == 1
        # served from memory now: no more misses
        misses = metric(server, "pdserve_model_load_misses_total", "digits")
        assert infer_digits(server)[0] == 200
        assert metric(server, "pdserve_model_load_misses_total", "digits") == misses
        # an unknown model is still 404, and loads nothing
        status, body = http(server, "POST", "/v2/models/nope/infer", {"inputs": []})
        assert status in (400, 404)
        assert "nope" not in index(server)
    finally:
        server.stop()


def test_on_demand_wait_is_bounded_by_the_timeout_parameter(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    add_python_model(repo, "identity", "ident")
    server = start_server(repo, tmp_path / "log", "--model-control-mode=on_demand")
    try:
        # 1 µs: far shorter than starting a worker process
        body = {
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}],
            "parameters": {"timeout": 1},
        }
        status, err = http(server, "POST", "/v2/models/ident/infer", body)
        assert status == 503
        assert "being loaded on demand and was not ready within" in err["error"]
        # the load went on for the others
        deadline = time.monotonic() + 60
        while "ident" not in loaded(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert infer_identity(server, "ident")[0] == 200
        assert metric(server, "pdserve_model_loads_total", "ident") == 1
    finally:
        server.stop()


# -- the budget ------------------------------------------------------------------------


def test_budget_smaller_than_any_model(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "repo", "efficientnet_lite0")
    add_python_model(repo, "identity", "ident")
    server = start_server(
        repo, tmp_path / "log", "--model-control-mode=on_demand", "--model-memory-budget=1MiB"
    )
    try:
        for model, infer in (
            ("ident", lambda: infer_identity(server, "ident")),
            (
                "efficientnet_lite0",
                lambda: http(
                    server,
                    "POST",
                    "/v2/models/efficientnet_lite0/infer",
                    {
                        "inputs": [
                            {
                                "name": "input",
                                "datatype": "FP32",
                                "shape": [1, 3, 224, 224],
                                "data": [0.0] * (3 * 224 * 224),
                            }
                        ]
                    },
                ),
            ),
        ):
            status, err = infer()
            assert status == 400, err
            assert f"model '{model}' needs" in err["error"]
            assert "more than the whole --model-memory-budget of 1.0 MiB" in err["error"]
            assert model not in loaded(server)
            reason = index(server)[model][0]["reason"]
            assert "--model-memory-budget" in reason
            # the size is known now: refused again without a second load
            status, err = infer()
            assert status == 400
            assert metric(server, "pdserve_model_loads_total", model) == 1
            # and through the repository API
            status, err = http(server, "POST", f"/v2/repository/models/{model}/load")
            assert status == 400
            assert "more than the whole --model-memory-budget" in err["error"]
        assert http(server, "GET", "/v2/health/ready")[0] == 200
    finally:
        server.stop()


@pytest.fixture(scope="module")
def worker_size(tmp_path_factory: pytest.TempPathFactory) -> int:
    """Bytes one identity worker takes here (an unbudgeted server's index)."""
    tmp = tmp_path_factory.mktemp("probe")
    repo = tmp / "repo"
    repo.mkdir()
    add_python_model(repo, "identity", "ident")
    server = start_server(repo, tmp / "probe.log", "--model-control-mode=on_demand")
    try:
        assert infer_identity(server, "ident")[0] == 200
        return int(index(server)["ident"][0]["memory_bytes"])
    finally:
        server.stop()


def test_no_room_beside_pinned_models_is_503(tmp_path: Path, worker_size: int) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("ident_a", "ident_b", "ident_c"):
        add_python_model(repo, "identity", name)
    server = start_server(
        repo,
        tmp_path / "log",
        "--model-control-mode=on_demand",
        f"--model-memory-budget={int(worker_size * 2.6)}",
        *("--pin-model", "ident_a", "--pin-model", "ident_b"),
    )
    try:
        assert loaded(server) == {"ident_a", "ident_b"}
        assert all(r["pinned"] for n in ("ident_a", "ident_b") for r in index(server)[n])
        for _ in range(2):  # measured, refused; then refused from the known size
            status, err = infer_identity(server, "ident_c")
            assert status == 503, err
            assert "held by pinned models or models serving requests" in err["error"]
            assert "retry later" in err["error"]
        assert loaded(server) == {"ident_a", "ident_b"}
        assert metric(server, "pdserve_model_loads_total", "ident_c") == 1
        assert metric(server, "pdserve_model_evictions_total", "ident_a") == 0
        assert infer_identity(server, "ident_a")[0] == 200
        # explicit unload of a pinned model makes room
        assert http(server, "POST", "/v2/repository/models/ident_b/unload")[0] == 200
        deadline = time.monotonic() + 30
        while "ident_b" in loaded(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert infer_identity(server, "ident_c")[0] == 200
    finally:
        server.stop()


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory: pytest.TempPathFactory, worker_size: int) -> Iterator[ServerProcess]:
    """on_demand with a budget for about two one-worker python models: ``slow``
    (sleepy, one instance), ``ident_a``, ``ident_b``, ``ident_c`` (identity)."""
    tmp = tmp_path_factory.mktemp("budget")
    size = worker_size
    repo = tmp / "repo"
    repo.mkdir()
    add_python_model(repo, "sleepy", "slow")
    for name in ("ident_a", "ident_b", "ident_c"):
        add_python_model(repo, "identity", name)
    budget = int(size * 2.6)
    server = start_server(
        repo,
        tmp / "log",
        "--model-control-mode=on_demand",
        f"--model-memory-budget={budget}",
    )
    yield server
    server.stop()


def test_least_recently_used_idle_model_is_evicted(budgeted: ServerProcess) -> None:
    s = budgeted
    assert infer_identity(s, "ident_a")[0] == 200
    assert infer_identity(s, "ident_b")[0] == 200
    assert loaded(s) >= {"ident_a", "ident_b"}
    assert infer_identity(s, "ident_a")[0] == 200  # ident_b is now the least recently used
    assert infer_identity(s, "ident_c")[0] == 200
    now = loaded(s)
    assert "ident_c" in now and "ident_a" in now and "ident_b" not in now
    assert index(s)["ident_b"][0]["reason"] == "evicted to stay within the model memory budget"
    assert metric(s, "pdserve_model_evictions_total", "ident_b") == 1
    assert metric(s, "pdserve_model_evictions_total", "ident_a") == 0
    # back on demand; the least recently used (ident_a) makes room
    assert infer_identity(s, "ident_b")[0] == 200
    assert "ident_b" in loaded(s) and "ident_a" not in loaded(s)
    assert metric(s, "pdserve_model_loads_total", "ident_b") == 2


def test_model_with_queued_requests_is_never_evicted(budgeted: ServerProcess) -> None:
    s = budgeted
    assert infer_slow(s, "slow", 0.0)[0] == 200  # loaded, possibly evicting others
    assert infer_identity(s, "ident_a")[0] == 200
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(infer_slow, s, "slow", 3.0)
        time.sleep(0.5)
        queued = pool.submit(infer_slow, s, "slow", 0.5)  # one instance: it queues
        time.sleep(0.3)
        # slow is the least recently used now, but busy: ident_a must make room
        assert infer_identity(s, "ident_a")[0] == 200
        assert infer_identity(s, "ident_c")[0] == 200
        assert "slow" in loaded(s)
        assert running.result()[0] == 200
        status, body = queued.result()
        assert status == 200, body
        assert body["outputs"][0]["data"] == [0.5]
    assert metric(s, "pdserve_model_evictions_total", "slow") == 0
    assert "slow" in loaded(s) and "ident_c" in loaded(s) and "ident_a" not in loaded(s)
