"""Traffic split between versions of one model (issue 12, item 4): weighted canary,
sticky routing by key, version pinning by header or metadata, the traffic file and
its admin endpoint, and the bad-input cases (weights that do not sum, versions that
are not served)."""

from __future__ import annotations

import collections
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import EXAMPLE_REPO, ServerProcess, require_examples, start_server
from tests.traffic_helpers import (
    X,
    base_output,
    http,
    infer_tiny,
    metric_value,
    offset_of,
    scrape,
    wait_for,
)

MODEL = "canary"


def _repo(tmp: Path) -> Path:
    require_examples()
    repo = tmp / "repo"
    repo.mkdir()
    shutil.copytree(EXAMPLE_REPO / "tiny_all_versions", repo / MODEL)
    cfg = (repo / MODEL / "config.pbtxt").read_text().replace("tiny_all_versions", MODEL)
    (repo / MODEL / "config.pbtxt").write_text(cfg)
    (repo / MODEL / "traffic.yaml").write_text("weights: {1: 70, 3: 30}\n")
    # weights that sum to 90: a clear load error for this model only
    shutil.copytree(repo / MODEL, repo / "badsum")
    (repo / "badsum" / "config.pbtxt").write_text(cfg.replace(MODEL, "badsum"))
    (repo / "badsum" / "traffic.yaml").write_text("weights: {1: 60, 2: 30}\n")
    # a version the policy does not load gets its share redistributed
    shutil.copytree(repo / MODEL, repo / "ghost")
    (repo / "ghost" / "config.pbtxt").write_text(cfg.replace(MODEL, "ghost"))
    (repo / "ghost" / "traffic.yaml").write_text("weights: {2: 50, 9: 50}\n")
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("split")
    srv = start_server(
        _repo(tmp),
        tmp / "pdserve.log",
        "--model-control-mode=poll",
        "--repository-poll-secs=0.3",
    )
    yield srv
    srv.stop()


def _versions(
    server: ServerProcess, n: int, headers: dict[str, str] | None = None
) -> collections.Counter[str]:
    seen: collections.Counter[str] = collections.Counter()
    for _ in range(n):
        status, doc = infer_tiny(server, MODEL, headers)
        assert status == 200, doc
        # the version reported is the version that computed the answer
        assert offset_of(doc) == float(doc["model_version"])
        seen[doc["model_version"]] += 1
    return seen


def test_weighted_split_and_reported_version(server: ServerProcess) -> None:
    seen = _versions(server, 400)
    assert set(seen) == {"1", "3"}
    # 30 % canary; 400 draws: sd 2.3 points, the bound is 4 sd
    assert 0.20 <= seen["3"] / 400 <= 0.40, seen
    status, doc, _ = http(server, "GET", f"/v2/models/{MODEL}/traffic")
    assert status == 200
    assert doc["source"] == "file"
    assert doc["weights"] == {"1": 70.0, "3": 30.0}
    assert doc["routed"]["3"]["split"] >= seen["3"]
    text = scrape(server)
    assert metric_value(
        text, "pdserve_traffic_requests_total", model=MODEL, version="3", route="split"
    )
    assert metric_value(text, "pdserve_traffic_weight", model=MODEL, version="3") == 30.0


def test_sticky_key_sees_one_version(server: ServerProcess) -> None:
    per_key = {}
    for i in range(60):
        key = f"user-{i}"
        seen = _versions(server, 4, {"x-pdserve-route-key": key})
        assert len(seen) == 1, (key, seen)
        per_key[key] = next(iter(seen))
    share = sum(v == "3" for v in per_key.values()) / len(per_key)
    assert 0.1 <= share <= 0.55, per_key  # keys spread over both versions
    # gRPC metadata: the same key, the same version
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(X)
    for key in list(per_key)[:10]:
        r = client.infer(MODEL, [inp], headers={"x-pdserve-route-key": key})
        assert r.get_response().model_version == per_key[key]


def test_pin_header_and_explicit_version_are_never_split(server: ServerProcess) -> None:
    seen = _versions(server, 20, {"x-pdserve-model-version": "2"})
    assert seen == {"2": 20}
    for _ in range(20):
        status, doc = infer_tiny(server, MODEL, version="1")
        assert status == 200 and doc["model_version"] == "1"
    status, doc = infer_tiny(server, MODEL, {"x-pdserve-model-version": "8"})
    assert status == 404 and "version 8" in doc["error"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(X)
    r = client.infer(MODEL, [inp], headers={"x-pdserve-model-version": "2"})
    assert r.get_response().model_version == "2"
    assert np.allclose(r.as_numpy("OUTPUT0") - 2, base_output())


def test_weights_that_do_not_sum_are_a_clear_load_error(server: ServerProcess) -> None:
    status, rows, _ = http(server, "POST", "/v2/repository/index", {})
    row = next(r for r in rows if r["name"] == "badsum")
    assert row.get("state") == "UNAVAILABLE"
    assert "weights sum to 90" in row["reason"] and "traffic.yaml" in row["reason"]
    status, doc = infer_tiny(server, "badsum")
    assert status == 503
    assert infer_tiny(server, MODEL)[0] == 200  # the server and other models carry on


def test_unserved_version_share_goes_to_the_served_ones(server: ServerProcess) -> None:
    status, doc, _ = http(server, "GET", "/v2/models/ghost/traffic")
    assert status == 200
    for _ in range(20):
        status, body = infer_tiny(server, "ghost")
        assert status == 200 and body["model_version"] == "2"
    status, doc, _ = http(server, "GET", "/v2/models/ghost/traffic")
    assert doc["unserved"] == ["9"]


def test_admin_endpoint_changes_traffic_and_refuses_bad_weights(server: ServerProcess) -> None:
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {"weights": {"1": 50}})
    assert status == 400 and "sum to 50" in doc["error"]
    status, doc, _ = http(
        server, "POST", f"/v2/models/{MODEL}/traffic", {"weights": {"1": -5, "2": 105}}
    )
    assert status == 400
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {"bogus": 1})
    assert status == 400 and "unknown key" in doc["error"]
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {})
    assert status == 400 and "empty" in doc["error"]
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {"reset": "yes"})
    assert status == 400 and "'reset' must be true" in doc["error"]
    status, doc, _ = http(server, "GET", f"/v2/models/{MODEL}/traffic")
    assert doc["weights"] == {"1": 70.0, "3": 30.0}  # nothing changed
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {"weights": {"2": 100}})
    assert status == 200 and doc["source"] == "admin"
    assert _versions(server, 30) == {"2": 30}
    status, doc, _ = http(server, "DELETE", f"/v2/models/{MODEL}/traffic")
    assert status == 405
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {"reset": True})
    assert status == 200 and doc["source"] == "file"
    assert set(_versions(server, 60)) == {"1", "3"}


def test_traffic_file_change_is_picked_up_without_reloading_versions(
    server: ServerProcess,
) -> None:
    status, before, _ = http(server, "GET", f"/v2/models/{MODEL}/stats")
    args = list(map(str, server.proc.args))  # the command line start_server built
    repo = Path(args[args.index("--model-repository") + 1])
    (repo / MODEL / "traffic.yaml").write_text("weights: {3: 100}\n")

    def switched() -> bool:
        return http(server, "GET", f"/v2/models/{MODEL}/traffic")[1]["weights"] == {"3": 100.0}

    wait_for(switched, 30, "the new traffic file")
    assert _versions(server, 20) == {"3": 20}
    # a bad edit keeps the traffic that served
    (repo / MODEL / "traffic.yaml").write_text("weights: {3: 10}\n")
    time_limit = 30
    wait_for(
        lambda: any(
            "weights sum to 10" in r.get("reason", "")
            for r in http(server, "POST", "/v2/repository/index", {})[1]
            if r["name"] == MODEL
        ),
        time_limit,
        "the reload failure in the index",
    )
    assert _versions(server, 10) == {"3": 10}
    status, after, _ = http(server, "GET", f"/v2/models/{MODEL}/stats")
    # same version objects: their statistics kept counting (nothing was reloaded)
    succ = {s["version"]: s["inference_stats"]["success"]["count"] for s in after["model_stats"]}
    prev = {s["version"]: s["inference_stats"]["success"]["count"] for s in before["model_stats"]}
    assert succ["3"] >= prev["3"] + 30
    assert "Traceback" not in server.log()
