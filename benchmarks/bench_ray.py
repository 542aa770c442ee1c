"""Ray Serve (issue 14 item 2): the V2 API through Serve vs pdserve alone, and an
autoscaling trace.

Both servers get the same core (``taskset -c 0``: pdserve with its children; every Ray
process of a one-node cluster: GCS, raylet, Serve controller, proxy, ingress and model
replicas); wrk runs on core 1. Same model (the example ``tiny``: 64->64 MatMul+Relu,
ONNX Runtime, no dynamic batching), same V2 JSON body of one row, ``-d`` seconds per
point, after a 2 s warm-up. Serve's ``max_ongoing_requests`` is 64 for the ingress and
the model so that its back-pressure does not cap concurrency 32.

Ray runs twice: Serve's defaults, then ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` (Serve's
documented throughput mode: user code and router on the replica's own loop, buffered
access logs). Then a load step on ``sleepy`` (python model, 0.5 s per request, 2 instances per
replica) with ``autoscaling_config`` (min 1, max 4, target 2 ongoing requests): 8
client threads for ``--step-seconds``, then none; replicas (RUNNING) sampled every
0.5 s until the deployment is back to 1 replica (at most 60 s).

Ray's ports bind every interface, so the script runs itself inside a network namespace
(``unshare -n``, root): pdserve on 127.0.0.1, the Ray head on 127.0.0.2. Every process is
stopped by its process id (never ``ray stop``).

Usage::

    .venv/bin/python benchmarks/bench_ray.py [-d 8] [--step-seconds 20] [--cores 0|all]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from common import REPO, cli_parser, start_server, stop_process  # noqa: E402

from tests.integration.ray_cluster import (  # noqa: E402
    APP,
    HEAD_IP,
    infer_body,
    run_load,
    running,
    setup_namespace,
    start_cluster,
    wait_for,
)

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def in_namespace() -> bool:
    """True when only a loopback device is visible (a fresh ``unshare -n``)."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip() for line in out.splitlines()] == ["lo"]


#: ``--cores``: "0" pins the servers to core 0 and wrk to core 1; "all" pins nothing.
CORES = {"server": "0", "client": "1"}


def wrk(url: str, body: bytes, conns: int, seconds: int, lua_dir: Path) -> dict[str, Any]:
    """One wrk point (on the client core): req/s, p50/p99 in ms, non-2xx count."""
    lua = lua_dir / "post.lua"
    lua.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [[{body.decode()}]]\n"
    )
    pin = ["taskset", "-c", CORES["client"]] if CORES["client"] else []
    cmd = [*pin, "wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--latency"]
    out = subprocess.run(
        [*cmd, "-s", str(lua), url], capture_output=True, text=True, timeout=seconds + 60
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]

    def pct(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        return round(float(m.group(1)) * _UNITS[m.group(2)], 2) if m else float("nan")

    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return {
        "conns": conns,
        "rps": round(rps, 1),
        "p50_ms": pct("50"),
        "p99_ms": pct("99"),
        "non_2xx": int(bad.group(1)) if bad else 0,
    }


def measure(url: str, body: bytes, seconds: int, tmp: Path) -> list[dict[str, Any]]:
    wrk(url, body, 8, 2, tmp)  # warm-up
    return [wrk(url, body, c, seconds, tmp) for c in (8, 32)]


def make_repo(dst: Path) -> Path:
    shutil.copytree(REPO / "tiny", dst / "tiny")
    shutil.copytree(ROOT / "tests" / "data" / "python_models" / "sleepy", dst / "sleepy")
    return dst


def main() -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument("-d", "--seconds", type=int, default=8, help="seconds per wrk point")
    p.add_argument("--step-seconds", type=float, default=20.0, help="autoscaling load step")
    p.add_argument(
        "--cores", choices=("0", "all"), default="0", help="0: servers on core 0, wrk on core 1"
    )
    p.add_argument("--out", default="", help="JSON file (default benchmarks/out/ray-CORES.json)")
    args = p.parse_args()
    if args.cores == "all":
        CORES.update(server="", client="")
    out = Path(args.out or HERE / "out" / f"ray-{args.cores}.json")
    if not in_namespace():
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            print("bench_ray.py needs root and unshare(1) (Ray binds every interface)")
            return 2
        cmd = ["unshare", "-n", sys.executable, __file__, *sys.argv[1:]]
        return subprocess.run(cmd, check=False).returncode
    setup_namespace()
    if CORES["client"]:
        os.sched_setaffinity(0, {1})  # this driver (and the autoscaling clients) on core 1
    tmp = Path(tempfile.mkdtemp(prefix="pdray-bench-"))
    repo = make_repo(tmp / "repo")
    body = infer_body("tiny", "INPUT0", np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64))
    res: dict[str, Any] = {
        "cores": args.cores,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_start": os.getloadavg(),
        "seconds_per_point": args.seconds,
    }

    # -- pdserve alone on core 0
    proc, http_port, _, _ = start_server(
        repo, "--load-model", "tiny", "--model-control-mode", "explicit", core="0"
    )
    try:
        res["pdserve"] = measure(
            f"http://127.0.0.1:{http_port}/v2/models/tiny/infer", body, args.seconds, tmp
        )
    finally:
        stop_process(proc)
    print("pdserve alone:", res["pdserve"], flush=True)

    # -- the same through Ray Serve, every Ray process on core 0: Serve's defaults (with
    # the autoscaling step), then its documented throughput mode
    ray_round(res, "ray", tmp, repo, body, args, autoscale=True)
    ray_round(res, "ray_throughput", tmp, repo, body, args, autoscale=False)
    shutil.rmtree(tmp, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    report(res)
    return 0


def ray_round(
    res: dict[str, Any],
    name: str,
    tmp: Path,
    repo: Path,
    body: bytes,
    args: argparse.Namespace,
    autoscale: bool,
) -> None:
    """One Ray cluster (head only, core 0): wrk points on tiny, then (``autoscale``)
    the load step on sleepy. ``ray_throughput``: ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``."""
    from ray import serve

    from pdserve.ray import application

    env = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"} if name == "ray_throughput" else None
    cluster = start_cluster(
        tmp / name, cpus=8, with_worker=False, cores=CORES["server"] or None, extra_env=env
    )
    try:
        serve.start(http_options={"host": HEAD_IP, "port": 8000}, proxy_location="HeadOnly")
        app = application(
            repo,
            options={
                "tiny": {"num_replicas": 1, "max_ongoing_requests": 64},
                "sleepy": {
                    "autoscaling_config": {
                        "min_replicas": 1,
                        "max_replicas": 4,
                        "target_ongoing_requests": 2,
                        "upscale_delay_s": 2,
                        "downscale_delay_s": 5,
                        "metrics_interval_s": 0.5,
                        "look_back_period_s": 2,
                    },
                    "max_ongoing_requests": 4,
                    "ray_actor_options": {"num_cpus": 1},
                },
            },
            ingress={"max_ongoing_requests": 64},
        )
        t0 = time.monotonic()
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        wait_for(lambda: serve.status().applications[APP].status == "RUNNING", 180, "deploy")
        res[f"{name}_deploy_s"] = round(time.monotonic() - t0, 1)
        cluster.remember()
        res[name] = measure(f"http://{HEAD_IP}:8000/v2/models/tiny/infer", body, args.seconds, tmp)
        print(f"through Ray Serve ({name}):", res[name], flush=True)
        if autoscale:
            res["autoscale"] = autoscale_step(args.step_seconds, res)
    finally:
        try:
            serve.shutdown()
            import ray

            ray.shutdown()
        except Exception:  # noqa: BLE001
            pass
        cluster.stop()


def autoscale_step(seconds: float, res: dict[str, Any]) -> dict[str, Any]:
    """8 clients on sleepy (0.5 s a request) for ``seconds``, then none; the replicas
    (RUNNING) every 0.5 s until back to 1 (at most 60 s)."""
    trace: list[tuple[float, int]] = []
    stop = threading.Event()
    t_auto = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            trace.append((round(time.monotonic() - t_auto, 1), running("sleepy")))
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    load = run_load(
        8000,
        "/v2/models/sleepy/infer",
        infer_body("sleepy", "X", np.array([0.5], dtype=np.float32)),
        lambda d: bool(np.isclose(json.loads(d)["outputs"][0]["data"], 0.5).all()),
        threads=8,
        seconds=seconds,
    )
    res["step_end_s"] = round(time.monotonic() - t_auto, 1)
    try:
        wait_for(lambda: running("sleepy") == 1, 60, "back to 1 replica")
    except TimeoutError as e:
        res["autoscale_error"] = str(e)
    time.sleep(1)
    stop.set()
    sampler.join(5)
    return {
        "trace": trace,
        "ok": load.ok,
        "failed": load.failed,
        "retried": load.retried_errors,
        "wrong": load.wrong,
        "rps": round(load.ok / seconds, 1),
    }


def report(res: dict[str, Any]) -> None:
    print("\n| path | conns | req/s | p50 ms | p99 ms | non-2xx |")
    print("|---|---|---|---|---|---|")
    for name in ("pdserve", "ray", "ray_throughput"):
        for row in res[name]:
            print(
                f"| {name} | {row['conns']} | {row['rps']:,.0f} | {row['p50_ms']} | {row['p99_ms']} "
                f"| {row['non_2xx']} |"
            )
    for a, b, c in zip(res["pdserve"], res["ray"], res["ray_throughput"], strict=True):
        print(
            f"c={a['conns']}: Serve / pdserve = {b['rps'] / a['rps']:.3f} "
            f"(throughput mode {c['rps'] / a['rps']:.3f})"
        )
    # replicas over time: one row per change
    rows, last = [], None
    for t, n in res["autoscale"]["trace"]:
        if n != last:
            rows.append((t, n))
            last = n
    print(f"\nautoscaling (load step 0 -> {res['step_end_s']} s):", rows)
    print({k: v for k, v in res["autoscale"].items() if k != "trace"})


if __name__ == "__main__":
    raise SystemExit(main())
