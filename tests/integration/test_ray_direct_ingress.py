"""``pdserve ray`` under Serve's direct ingress, on a real Ray head started with
``RAY_SERVE_ENABLE_DIRECT_INGRESS=1`` in a network namespace
(``ray_direct_ingress.py``): the one-hop replica answers tritonclient.http and
tritonclient.grpc on the ports ``pdserve ray status`` reports, past Serve's proxy.
Marked ``slow`` (a Ray head and a deployment, ~1 min here)."""

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

from tests.conftest import ROOT, copy_models
from tests.goldens import tiny_reference

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("ray_direct_ingress.py")


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1): the Ray head runs in a network namespace")
    repo = tmp_path_factory.mktemp("ray_direct_repo")
    copy_models(repo, "tiny")
    temp = Path("/tmp") / f"pdray-di-{os.getpid()}"  # short: Ray's socket paths are limited
    shutil.rmtree(temp, ignore_errors=True)
    try:
        cmd = [sys.executable, str(DRIVER), "--repo", str(repo), "--temp-dir", str(temp)]
        proc = subprocess.run(
            ["unshare", "-n", *cmd], capture_output=True, text=True, timeout=300, cwd=ROOT
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-5000:])
        doc: dict[str, Any] = json.loads(lines[-1])
        assert "error" not in doc, (doc.get("traceback"), proc.stderr[-5000:])
        return doc
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_status_reports_the_replicas_own_ports(seen: dict[str, Any]) -> None:
    assert seen["deploy"][0] == 0, seen["deploy"]
    app = seen["status"]["applications"]["pdserve"]
    assert app["status"] == "RUNNING"
    endpoints = app["endpoints"]
    # Serve allocates direct-ingress ports from 30000 (HTTP) and 40000 (gRPC) up
    (http,) = endpoints["http"]
    (grpc,) = endpoints["grpc"]
    assert 30000 <= int(http.rsplit(":", 1)[1]) < 31000, endpoints
    assert 40000 <= int(grpc.rsplit(":", 1)[1]) < 41000, endpoints


def test_tritonclient_http_and_grpc_reach_the_replica(seen: dict[str, Any]) -> None:
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    expected = tiny_reference(x).ravel()
    np.testing.assert_allclose(seen["http_tiny"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(seen["grpc_tiny"], expected, rtol=1e-5, atol=1e-6)
    assert seen["http_ready"] and seen["grpc_ready"]
    assert seen["grpc_bad"][0] == "StatusCode.INVALID_ARGUMENT", seen["grpc_bad"]
    assert "unexpected inference input 'WRONG'" in seen["grpc_bad"][1]
    assert seen["teardown"] == [0, "deleted application 'pdserve'\n"]


def test_a_second_application_needs_its_own_route_prefix(seen: dict[str, Any]) -> None:
    code, printed, errors = seen["clash"]
    assert code == 1 and "Traceback" not in printed + errors, seen["clash"]
    assert "Serve refused application 'c' at route prefix '/'" in printed, printed
    assert seen["deploy_b"][0] == 0, seen["deploy_b"]
    assert seen["apps"] == ["b", "pdserve"]
    (url,) = seen["b_http"]
    assert url.endswith("/b") and 30000 <= int(url.split(":")[1].split("/")[0]) < 31000, url
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    np.testing.assert_allclose(seen["b_tiny"], tiny_reference(x).ravel(), rtol=1e-5, atol=1e-6)
