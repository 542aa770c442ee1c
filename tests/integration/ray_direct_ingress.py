"""Serve's direct ingress on a real Ray cluster, run under ``unshare -n`` by
``test_ray_direct_ingress.py``: a Ray head started with
``RAY_SERVE_ENABLE_DIRECT_INGRESS=1`` (past Serve's proxy, each ingress replica
answers HTTP and gRPC on ports of its own), ``pdserve ray deploy`` of ``tiny``, the
endpoints ``pdserve ray status`` reports, tritonclient.http and tritonclient.grpc
against them, ``teardown``. Prints what it saw as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.integration.ray_cluster import (  # noqa: E402
    pdserve_ray,
    run_and_report,
    setup_namespace,
    start_cluster,
    wait_for,
)

#: Serve's feature flag, read by its controller and replicas when they start.
DIRECT_INGRESS = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}


def listening(client: Any, timeout: float = 30.0) -> float:
    """Seconds until the replica's own HTTP server answers (Serve gives the replica its
    port, then starts the server).

    Raises:
        TimeoutError: no answer within ``timeout`` s.
    """

    def live() -> bool:
        try:
            return bool(client.is_server_live())
        except ConnectionError:
            return False

    return round(wait_for(live, timeout, "the replica's HTTP server"), 1)


def scenario(repo: Path, out: dict[str, Any]) -> None:
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp

    out["repo"] = str(repo)
    done = pdserve_ray("deploy", str(repo), "--models", "tiny", "--num-cpus", "1")
    out["deploy"] = [done.returncode, done.stdout[-1500:], done.stderr[-1500:]]
    if done.returncode != 0:
        return
    status = pdserve_ray("status")
    out["status"] = json.loads(status.stdout)
    endpoints = out["status"]["applications"]["pdserve"]["endpoints"]
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    http = thttp.InferenceServerClient(endpoints["http"][0])
    out["listening_s"] = listening(http)
    inp = thttp.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    out["http_tiny"] = http.infer("tiny", [inp]).as_numpy("OUTPUT0").ravel().tolist()
    out["http_ready"] = http.is_server_ready() and http.is_model_ready("tiny")
    grpc = tgrpc.InferenceServerClient(endpoints["grpc"][0])
    ginp = tgrpc.InferInput("INPUT0", [1, 64], "FP32")
    ginp.set_data_from_numpy(x)
    out["grpc_tiny"] = grpc.infer("tiny", [ginp]).as_numpy("OUTPUT0").ravel().tolist()
    out["grpc_ready"] = grpc.is_model_ready("tiny")
    bad = tgrpc.InferInput("WRONG", [1, 64], "FP32")
    bad.set_data_from_numpy(x)
    try:
        grpc.infer("tiny", [bad])
    except Exception as e:  # noqa: BLE001 - the status is the answer
        out["grpc_bad"] = [str(getattr(e, "status", lambda: "")()), str(e)]
    second_app(x, out)
    gone = pdserve_ray("teardown")
    out["teardown"] = [gone.returncode, gone.stdout]


def second_app(x: np.ndarray, out: dict[str, Any]) -> None:
    """A second application: refused at the route prefix the first holds, then served
    under its own, whose HTTP endpoint carries the prefix."""
    import tritonclient.http as thttp

    repo = out["repo"]
    clash = pdserve_ray("deploy", repo, "--models", "tiny", "--num-cpus", "1", "--name", "c")
    out["clash"] = [clash.returncode, clash.stdout[-800:], clash.stderr[-800:]]
    done = pdserve_ray(
        "deploy", repo, "--models", "tiny", "--num-cpus", "1", "--name", "b",
        "--route-prefix", "/b",
    )  # fmt: skip
    out["deploy_b"] = [done.returncode, done.stdout[-800:]]
    every = json.loads(pdserve_ray("status", "--all").stdout)
    out["apps"] = sorted(every["applications"])
    (url,) = out["b_http"] = every["applications"]["b"]["endpoints"]["http"]
    client = thttp.InferenceServerClient(url)
    listening(client)
    inp = thttp.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    out["b_tiny"] = client.infer("tiny", [inp]).as_numpy("OUTPUT0").ravel().tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--temp-dir", required=True)
    args = parser.parse_args()
    setup_namespace()
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    cluster = start_cluster(
        Path(args.temp_dir), cpus=4, with_worker=False, extra_env=DIRECT_INGRESS
    )
    run_and_report(cluster, lambda: scenario(Path(args.repo), out), out, t0)


if __name__ == "__main__":
    main()
