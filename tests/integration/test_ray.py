"""Ray Serve deployment of a model repository on a real two-node Ray cluster.

The test runs :mod:`tests.integration.ray_cluster` under ``unshare -n``: inside that
network namespace the script starts a Ray head on 127.0.0.2 and a worker node on
127.0.0.3 (``ray start --block``; Ray binds every interface, the namespace keeps it
off the machine's). It deploys a deployment per model (:func:`pdserve.ray.application`:
tiny on both nodes, an ensemble whose steps are other deployments), then the one-hop
application with ``pdserve ray deploy`` (tritonclient.http and tritonclient.grpc through
Serve's proxies, ``status``, a deployment that cannot be placed, ``teardown``), then a
one-hop application that autoscales under a load step and loses a replica and the
worker node's raylet under load; it prints its measurements as JSON. Every Ray process
is stopped by its process id. One cluster serves every assertion (starting one takes
~25 s here), so the test is one function; it is marked ``slow`` (CI runs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import EXAMPLE_REPO, ROOT, copy_models

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("ray_cluster.py")
THREADS = 4  # the driver's client threads during the kills: at most one request each in flight


def make_repository(dst: Path) -> Path:
    """tiny, pre (tiny under another name), pipe (pre -> tiny), sleepy (a python model
    that sleeps its input's seconds)."""
    copy_models(dst, "tiny")
    shutil.copytree(EXAMPLE_REPO / "tiny", dst / "pre")
    cfg = dst / "pre" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('name: "tiny"', 'name: "pre"'))
    (dst / "pipe" / "1").mkdir(parents=True)
    shutil.copy(
        ROOT / "tests" / "data" / "ray" / "pipe_config.pbtxt", dst / "pipe" / "config.pbtxt"
    )
    shutil.copytree(ROOT / "tests" / "data" / "python_models" / "sleepy", dst / "sleepy")
    return dst


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1): the Ray nodes run in a network namespace")
    repo = make_repository(tmp_path_factory.mktemp("ray_repo"))
    temp = Path("/tmp") / f"pdray-{os.getpid()}"  # short: Ray's socket paths are limited
    shutil.rmtree(temp, ignore_errors=True)
    try:
        proc = subprocess.run(
            [
                "unshare",
                "-n",
                sys.executable,
                str(DRIVER),
                "--repo",
                str(repo),
                "--temp-dir",
                str(temp),
                "--load-seconds",
                "6",
                "--deadline",
                "300",
            ],
            capture_output=True,
            text=True,
            timeout=330,
            cwd=ROOT,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        assert proc.returncode == 0 and lines, (
            proc.returncode,
            proc.stdout[-3000:],
            proc.stderr[-5000:],
        )
        doc: dict[str, Any] = json.loads(lines[-1])
        assert "error" not in doc, (doc.get("traceback"), proc.stderr[-5000:])
        print(
            json.dumps(
                {
                    k: v
                    for k, v in doc.items()
                    if k not in ("pipe", "tiny_out", "tiny_of_tiny", "through_serve")
                }
            )
        )
        return doc
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_serve_two_nodes(scenario: dict[str, Any]) -> None:
    doc = scenario
    # a deployment per model: replicas of tiny on both nodes, through Serve's proxy
    assert doc["tiny_nodes"] == ["127.0.0.2", "127.0.0.3"]
    assert doc["ready"] == 200
    assert doc["metadata"]["name"] == "tiny" and doc["metadata"]["versions"] == ["2"]
    assert doc["metadata"]["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 64]}]
    tiny_out = np.array(doc["tiny_out"], dtype=np.float32)
    assert tiny_out.shape == (64,) and (tiny_out >= 0).all() and tiny_out.any()  # ReLU output
    # the ensemble ran pre then tiny, each on its own deployment
    assert doc["pipe_status"] == 200
    pipe = doc["pipe"]["outputs"][0]
    assert pipe["shape"] == [1, 64]
    np.testing.assert_allclose(pipe["data"], doc["tiny_of_tiny"], rtol=1e-5, atol=1e-6)
    # errors keep pdserve's status and message across the deployment boundary
    assert (
        doc["bad_input"][0] == 400
        and "unexpected inference input 'WRONG'" in doc["bad_input"][1]["error"]
    )
    assert doc["unknown_model"][0] == 404
    assert doc["load_refused"] == 503


def test_pdserve_ray_deploys_one_hop_for_http_and_grpc_clients(scenario: dict[str, Any]) -> None:
    doc = scenario
    assert doc["cli_deploy"][0] == 0, doc["cli_deploy"]
    assert "application 'pdserve' RUNNING" in doc["cli_deploy"][1]
    got = doc["through_serve"]
    expected = np.array(got["tiny_expected"], dtype=np.float32)
    for key in ("http_tiny", "grpc_tiny"):
        np.testing.assert_array_equal(np.array(got[key], dtype=np.float32), expected)
    # the ensemble's steps ran inside the replica: tiny of pre (tiny) of x
    for key in ("http_pipe", "grpc_pipe"):
        np.testing.assert_allclose(got[key], doc["tiny_of_tiny"], rtol=1e-5, atol=1e-6)
    assert got["http_ready"] and got["grpc_ready"] and got["grpc_versions"] == ["2"]
    assert got["grpc_bad"][0] == "StatusCode.INVALID_ARGUMENT", got["grpc_bad"]
    assert "unexpected inference input 'WRONG'" in got["grpc_bad"][1]
    (stream,) = got["grpc_stream"]
    np.testing.assert_array_equal(np.array(stream, dtype=np.float32), expected)
    status = json.loads(doc["cli_status"][1])
    app = status["applications"]["pdserve"]
    assert app["status"] == "RUNNING"
    assert app["deployments"]["pdserve"] == {"status": "HEALTHY", "replicas": {"RUNNING": 2}}
    # through Serve's proxies (on the head, where the scenario started them)
    assert "127.0.0.2:8000" in app["endpoints"]["http"], app["endpoints"]
    assert "127.0.0.2:9000" in app["endpoints"]["grpc"], app["endpoints"]
    code, text, seconds = doc["cli_unplaceable"]
    assert code == 1 and seconds < 30, doc["cli_unplaceable"]
    assert "deployment 'pdserve' cannot be placed: one replica asks for CPU 64" in text
    assert "127.0.0.2: CPU 16" in text and "127.0.0.3: CPU 16" in text
    assert doc["apps_after_unplaceable"] == ["pdserve"]  # nothing left pending
    assert doc["cli_teardown"] == [0, "deleted application 'pdserve'\n"]


def test_one_hop_autoscales_and_survives_replica_and_node_loss(
    scenario: dict[str, Any],
) -> None:
    doc = scenario
    auto = doc["phases"]["autoscale"]
    assert auto["failed"] == 0 and auto["wrong"] == 0 and auto["ok"] > 20, auto
    assert auto["trace"][0][1] == 2, auto["trace"]
    assert auto["max_replicas"] >= 3, auto["trace"]
    assert auto["final_replicas"] == 2, auto["trace"]

    assert doc["server_nodes"] == ["127.0.0.2", "127.0.0.3"]
    kill = doc["phases"]["kill_replica"]
    assert kill["victim_pid"] and not kill["victim_alive_after"], kill
    assert kill["failed"] == 0 and kill["wrong"] == 0 and kill["ok"] > 20, kill
    # only requests in flight on the killed replica fail, and the client retried them
    assert kill["retried"] <= 2 * THREADS, kill
    assert "replaced_s" in kill, kill

    node = doc["phases"]["kill_node"]
    assert not node["raylet_alive_after"], node
    assert node["failed"] == 0 and node["wrong"] == 0 and node["ok"] > 20, node
    assert node["retried"] <= 2 * THREADS, node
    # the node took a replica with it
    assert doc["phases"]["worker_replicas_before_node_kill"] == 1, doc["phases"]
    assert node["alive_nodes_after"] == 1 and node["tiny_nodes_after"] == ["127.0.0.2"], node
    assert doc["after_node_loss_status"] == 200
