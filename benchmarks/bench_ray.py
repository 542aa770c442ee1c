"""Ray Serve: pdserve on Ray in one hop against a plain Ray Serve deployment and pdserve alone.

Same model (the example ``tiny``: 64->64 MatMul+Relu, ONNX Runtime), one row per
request, both cores (nothing pinned), one Ray cluster (head only, 16 logical CPUs) for
the whole run, every target up at once and measured in alternated rounds (the order
rotates each round), each point bounded in time:

1. **HTTP**, wrk, c=8 and c=32: (a) ``pdserve serve`` alone; (b) a plain Ray Serve
   deployment (``benchmarks/peers/ray_serve_tiny.py``: ORT in a ``@serve.deployment``
   with ``@serve.batch``, route ``/plain``); (c) pdserve on Ray in one hop
   (``pdserve.ray.server_application``: Serve's proxy -> a replica that is a whole
   pdserve server; its tiny batches as (b)'s ``@serve.batch`` does: a dynamic batcher
   of at most 32 rows, 1 ms queue delay). One replica each, ``max_ongoing_requests``
   64. Each point also reports the CPU microseconds per answered request of each
   process (Serve's proxy, each replica, the rest of Ray), from ``/proc``.
2. **gRPC**, ``pdserve perf -i grpc`` at concurrency 8 and 32: (a) against (c) through
   Serve's gRPC proxy (the plain deployment is deleted first: with one application
   left, the proxy needs no ``application`` metadata).
3. **The image pipeline** (``image_classifier``: JPEG in, top-5 out), loadgen.py at
   concurrency 8: one-hop (every step in one replica, route ``/one``) against a
   deployment per step behind an ingress (``/split``), images/s.

``--direct-ingress`` starts the Ray head with ``RAY_SERVE_ENABLE_DIRECT_INGRESS=1`` (Serve's
feature flag: each ingress replica answers HTTP and gRPC on ports of its own, past the proxy,
read from :func:`pdserve.ray.control.endpoints`); the http, side and grpc parts then go to
the replicas' ports.

Ray binds every interface, so the script runs itself inside a network namespace
(``unshare -n``, root): pdserve on 127.0.0.1, the Ray head on 127.0.0.2. Every process
is stopped by its process id (never ``ray stop``).

Usage::

    .venv/bin/python benchmarks/bench_ray.py [-d 3] [--rounds 4] [--parts http,grpc,images]
    .venv/bin/python benchmarks/bench_ray.py --parts side --rounds 6 -d 4   # both paths at once
    .venv/bin/python benchmarks/bench_ray.py --direct-ingress --parts http,side,grpc --rounds 4 -d 4
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE / "peers"))

from bench_pipeline import binary_body, bytes_element  # noqa: E402
from common import (  # noqa: E402
    REPO,
    cli_parser,
    descendants,
    proc_cpu_seconds,
    start_server,
    stop_process,
    write_post_lua,
    wrk_latency_ms,
)

from tests.integration.ray_cluster import (  # noqa: E402
    HEAD_IP,
    cmdline,
    infer_body,
    setup_namespace,
    start_cluster,
)

GOLDENS = ROOT / "examples" / "goldens"
PY = sys.executable


def in_namespace() -> bool:
    """True when only a loopback device is visible (a fresh ``unshare -n``)."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip() for line in out.splitlines()] == ["lo"]


def make_repo(dst: Path) -> Path:
    for name in ("tiny", "image_classifier", "preprocess", "efficientnet_lite0", "postprocess"):
        shutil.copytree(REPO / name, dst / name, symlinks=False)
    return dst


def batched_tiny_repo(
    dst: Path, max_batch: int, wait_s: float, parameters: dict[str, str] | None = None
) -> Path:
    """A repository of ``tiny`` whose dynamic batcher batches as the plain deployment's
    ``@serve.batch`` does: at most ``max_batch`` requests (rows) per batch, sent once
    full or ``wait_s`` after its first request arrived; ``parameters`` added to its
    config (``--tiny-param``)."""
    shutil.copytree(REPO / "tiny", dst / "tiny", symlinks=False)
    cfg = dst / "tiny" / "config.pbtxt"
    params = "".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
        for k, v in (parameters or {}).items()
    )
    cfg.write_text(
        cfg.read_text()
        + "dynamic_batching {\n"
        + f"  preferred_batch_size: [ {max_batch} ]\n"
        + f"  max_queue_delay_microseconds: {round(wait_s * 1e6)}\n"
        + "}\n"
        + params
    )
    return dst


#: Process roles whose CPU time each wrk point reports, by a piece of the process's
#: command line (Ray names its actor processes ``ray::<class>``).
ROLES = (
    ("proxy", "ProxyActor"),
    ("replica_pdserve", "ServeReplica:pdserve:"),
    ("replica_plain", "ServeReplica:plain:"),
    ("raylet", "raylet"),
    ("gcs", "gcs_server"),
    ("controller", "ServeController"),
)

#: The process ids whose CPU time is reported, by role (:func:`watch_processes`).
WATCHED: dict[str, list[int]] = {}


def watch_processes(roots: dict[str, int]) -> None:
    """Fill :data:`WATCHED`: each of ``roots`` (role -> pid) as is, and the processes
    below the Ray head by :data:`ROLES` (anything else under it: ``ray_other``)."""
    WATCHED.clear()
    for role, pid in roots.items():
        WATCHED[role] = [pid]
    for pid in descendants(roots["ray_head"]):
        line = cmdline(pid)
        role = next((r for r, piece in ROLES if piece in line), "ray_other")
        WATCHED.setdefault(role, []).append(pid)


def cpu_snapshot() -> dict[str, float]:
    """CPU seconds (user + system) so far of each watched role."""
    return {role: sum(proc_cpu_seconds(p) for p in pids) for role, pids in WATCHED.items()}


def wrk_point(url: str, tmp: Path, body: bytes, conns: int, seconds: int) -> dict[str, Any]:
    """One wrk point (2 threads, POST ``body``): req/s, p50/p99 in ms, and the CPU
    microseconds per answered request of each watched process role (``cpu_us``).

    Raises:
        RuntimeError: a non-2xx answer or a socket error (the figures would lie).
    """
    lua = write_post_lua(tmp, json.loads(body))
    cmd = ["wrk", "-t2", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(lua), url]
    before = cpu_snapshot()
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    after = cpu_snapshot()
    out = parse_wrk(url, text, conns)
    count = max(out.pop("requests"), 1)
    out["cpu_us"] = {k: round((after[k] - before.get(k, 0.0)) * 1e6 / count) for k in after}
    return out


def parse_wrk(url: str, text: str, conns: int) -> dict[str, Any]:
    """wrk's output as conns, req/s, p50/p99 ms and the requests answered.

    Raises:
        RuntimeError: a non-2xx answer or a socket error (the figures would lie).
    """
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    bad = re.search(r"(Non-2xx or 3xx responses|Socket errors):.*", text)
    if bad or not rps:
        raise RuntimeError(f"wrk {url}: {bad.group(0) if bad else text[-500:]}")
    n = re.search(r"(\d+) requests in", text)
    return {
        "conns": conns,
        "rps": float(rps.group(1)),
        "p50_ms": wrk_latency_ms(text, "50%"),
        "p99_ms": wrk_latency_ms(text, "99%"),
        "requests": int(n.group(1)) if n else 0,
    }


def side_by_side_point(
    urls: dict[str, str], tmp: Path, body: bytes, conns: int, seconds: int
) -> dict[str, dict[str, Any]]:
    """Both paths loaded at the same time (one ``wrk -t1 -c<conns>`` each), so a noisy
    moment hits both: per path conns, req/s, p50/p99 ms."""
    lua = write_post_lua(tmp, json.loads(body))
    runs = {
        name: subprocess.Popen(
            ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(lua), url],
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, url in urls.items()
    }
    return {name: parse_wrk(urls[name], run.communicate()[0], conns) for name, run in runs.items()}


def perf_grpc(url: str, conc: int, tmp: Path) -> dict[str, Any]:
    """``pdserve perf -i grpc`` on tiny at concurrency ``conc`` (bounded: 2 trials of 1.5 s)."""
    out = tmp / f"perf-{conc}.json"
    subprocess.run(
        [PY, "-m", "pdserve", "perf", "-m", "tiny", "-i", "grpc", "-u", url]
        + ["--concurrency-range", str(conc), "-p", "1500", "-r", "2", "-s", "100"]
        + ["--no-server-stats", "-q", "--json", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
        cwd=ROOT,
    )
    (row,) = json.loads(out.read_text())["results"]
    if sum(row["errors"].values()):
        raise RuntimeError(f"pdserve perf {url} c={conc}: errors {row['errors']}")
    lat = row["latency_us"]
    return {
        "conns": conc,
        "throughput": round(row["infer_per_sec"], 1),
        "p50_ms": round(lat["p50"] / 1000, 2),
        "p99_ms": round(lat["p99"] / 1000, 2),
    }


def images_point(url: str, tmp: Path, conc: int, seconds: float) -> dict[str, Any]:
    """loadgen.py with one JPEG per request (binary tensor extension) at ``conc``."""
    jpeg = np.load(GOLDENS / "image_classifier.npz")["image_bytes_flower"].tobytes()
    body, head_len = binary_body(
        [("input_image_bytes", "BYTES", [1, 1], bytes_element(jpeg))],
        ["top5_labels", "top5_confidences"],
    )
    path = tmp / "image.bin"
    path.write_bytes(body)
    out = subprocess.run(
        [PY, str(HERE / "loadgen.py"), "--url", url, "--body-file", str(path)]
        + ["--header", f"Inference-Header-Content-Length: {head_len}"]
        + ["--header", "Content-Type: application/octet-stream"]
        + ["--concurrency", str(conc), "--duration", str(seconds), "--warmup", "1"],
        capture_output=True,
        check=True,
        timeout=seconds + 120,
    )
    doc = json.loads(out.stdout)
    if doc["errors"]:
        raise RuntimeError(f"{url} c={conc}: {doc['errors']} errors: {doc.get('first_error')}")
    return {"conns": conc, "images_s": doc["rps"], "p50_ms": doc["p50_ms"], "p99_ms": doc["p99_ms"]}


def rounds(
    targets: dict[str, Callable[[], list[dict[str, Any]]]], n: int
) -> dict[str, list[list[dict[str, Any]]]]:
    """``n`` rounds of every target's points, the order rotating each round."""
    names = list(targets)
    got: dict[str, list[list[dict[str, Any]]]] = {k: [] for k in names}
    for r in range(n):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            got[name].append(targets[name]())
            print(f"round {r + 1} {name}: {got[name][-1]}", flush=True)
    return got


def medians(runs: list[list[dict[str, Any]]], key: str) -> list[dict[str, Any]]:
    """Per point (conns), the median of ``key`` and of the latencies over the rounds."""
    out = []
    for i, first in enumerate(runs[0]):
        row: dict[str, Any] = {"conns": first["conns"]}
        for k in (key, "p50_ms", "p99_ms"):
            vals = [r[i][k] for r in runs if r[i].get(k) is not None]
            row[k] = round(statistics.median(vals), 2) if vals else None
        row[f"{key}_range"] = [min(r[i][key] for r in runs), max(r[i][key] for r in runs)]
        if "cpu_us" in first:
            row["cpu_us"] = {
                role: round(statistics.median(r[i]["cpu_us"].get(role, 0) for r in runs))
                for role in first["cpu_us"]
            }
        out.append(row)
    return out


def main() -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument("-d", "--seconds", type=int, default=3, help="seconds per load point")
    p.add_argument("--rounds", type=int, default=4, help="alternated rounds")
    p.add_argument("--out", default="", help="JSON file (default benchmarks/out/ray.json)")
    p.add_argument(
        "--parts",
        default="http,grpc,images",
        help="comma-separated: http, grpc, images, side (the two Serve paths loaded at once)",
    )
    p.add_argument(
        "--tiny-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config parameter of the one-hop replica's tiny (repeatable), e.g. "
        "intra_op_thread_count=1",
    )
    p.add_argument(
        "--direct-ingress",
        action="store_true",
        help="Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1, Ray's feature "
        "flag): each ingress replica answers HTTP and gRPC on ports of its own, which "
        "the load goes to, past Serve's proxy; the http, side and grpc parts",
    )
    args = p.parse_args()
    out = Path(args.out or HERE / "out" / "ray.json")
    if not in_namespace():
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            print("bench_ray.py needs root and unshare(1) (Ray binds every interface)")
            return 2
        cmd = ["unshare", "-n", sys.executable, __file__, *sys.argv[1:]]
        return subprocess.run(cmd, check=False).returncode
    setup_namespace()
    tmp = Path(tempfile.mkdtemp(prefix="pdray-bench-"))
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_start": os.getloadavg(),
        "seconds_per_point": args.seconds,
        "rounds": args.rounds,
    }
    t_start = time.monotonic()
    repo = make_repo(tmp / "repo")
    proc, http_port, grpc_port, _ = start_server(
        repo,
        "--load-model",
        "tiny",
        "--model-control-mode",
        "explicit",
        core=None,  # type: ignore[arg-type]
    )
    direct = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"} if args.direct_ingress else None
    res["direct_ingress"] = args.direct_ingress
    cluster = start_cluster(tmp / "ray", cpus=16, with_worker=False, extra_env=direct)
    try:
        roots = {"pdserve_alone": proc.pid, "ray_head": cluster.head.pid, "driver": os.getpid()}
        measure_all(res, repo, tmp, http_port, grpc_port, args, roots)
    finally:
        try:
            from ray import serve

            serve.shutdown()
            import ray

            ray.shutdown()
        except Exception:  # noqa: BLE001
            pass
        cluster.stop()
        stop_process(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    res["total_s"] = round(time.monotonic() - t_start, 1)
    res["loadavg_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    report(res)
    return 0


def replica_urls(apps: tuple[str, ...], timeout: float = 60.0) -> dict[str, str]:
    """Under direct ingress, each application's replica's HTTP base URL (its route prefix
    included), from ``pdserve ray status``'s endpoints
    (:func:`pdserve.ray.control.endpoints`).

    Raises:
        RuntimeError: an application had no replica endpoint within ``timeout`` s.
    """
    from pdserve.ray import control

    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(found) < len(apps) and time.monotonic() < deadline:
        for app in apps:
            http = control.endpoints(app).get("http", [])
            # a replica, not the proxy this script asked for (an entry ends with the route
            # prefix: "/plain" for the plain deployment)
            if http and ":8000" not in http[0]:
                found[app] = f"http://{http[0]}"
        if len(found) < len(apps):
            time.sleep(1)
    if missing := [a for a in apps if a not in found]:
        raise RuntimeError(f"direct ingress: no replica endpoint for {missing}")
    return found


def measure_all(
    res: dict[str, Any],
    repo: Path,
    tmp: Path,
    http_port: int,
    grpc_port: int,
    args: Any,
    roots: dict[str, int],
) -> None:
    import ray_serve_tiny
    from ray import cloudpickle, serve

    from pdserve.ray import application, control, server_application

    cloudpickle.register_pickle_by_value(ray_serve_tiny)  # the workers cannot import it
    control.start_proxies(control.Proxies(HEAD_IP, 8000, 9000))
    one = {"num_replicas": 1, "max_ongoing_requests": 64, "ray_actor_options": {"num_cpus": 1}}
    t0 = time.monotonic()
    # like with like: (c)'s tiny batches as (b)'s @serve.batch does
    batched = batched_tiny_repo(
        tmp / "repo_batched",
        ray_serve_tiny.MAX_BATCH_SIZE,
        ray_serve_tiny.BATCH_WAIT_S,
        dict(kv.split("=", 1) for kv in args.tiny_param),
    )
    res["tiny_params"] = args.tiny_param
    control.deploy(server_application(batched, ["tiny"], one), "pdserve", {"pdserve": one})
    plain = ray_serve_tiny.PlainTiny.bind(str(repo / "tiny" / "2" / "model.onnx"))
    control.deploy(plain, "plain", {}, route_prefix="/plain")
    res["deploy_s"] = round(time.monotonic() - t0, 1)
    watch_processes(roots)
    parts = set(args.parts.split(","))
    body = infer_body("tiny", "INPUT0", np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64))
    base = replica_urls(("plain", "pdserve")) if args.direct_ingress else {}
    urls = {
        "pdserve": f"http://127.0.0.1:{http_port}/v2/models/tiny/infer",
        "ray_plain": base.get("plain", f"http://{HEAD_IP}:8000/plain"),
        "pdserve_on_ray": base.get("pdserve", f"http://{HEAD_IP}:8000") + "/v2/models/tiny/infer",
    }
    res["urls"] = urls
    for url in urls.values():  # warm-up (a non-2xx answer fails the run)
        wrk_point(url, tmp, body, 8, 1)

    def http_target(url: str) -> Callable[[], list[dict[str, Any]]]:
        return lambda: [wrk_point(url, tmp, body, c, args.seconds) for c in (8, 32)]

    if "http" in parts:
        http = rounds({k: http_target(u) for k, u in urls.items()}, args.rounds)
        res["http"] = {k: medians(v, "rps") for k, v in http.items()}
        res["http_rounds"] = http
    if "side" in parts:  # one hop and plain Serve loaded together, through the same proxy
        pair = {k: urls[k] for k in ("ray_plain", "pdserve_on_ray")}
        side: dict[str, list[dict[str, Any]]] = {}
        for c in (8, 32):
            side[str(c)] = []
            for r in range(args.rounds):
                side[str(c)].append(side_by_side_point(pair, tmp, body, c, args.seconds))
                print(f"side by side c={c} round {r + 1}: {side[str(c)][-1]}", flush=True)
        res["side_by_side"] = side
    serve.delete("plain")
    ray_grpc = f"{HEAD_IP}:9000"
    if args.direct_ingress:  # the replica's own gRPC port
        ray_grpc = control.endpoints("pdserve")["grpc"][0]

    def grpc_target(url: str) -> Callable[[], list[dict[str, Any]]]:
        return lambda: [perf_grpc(url, c, tmp) for c in (8, 32)]

    if "grpc" in parts:
        grpc = rounds(
            {
                "pdserve": grpc_target(f"127.0.0.1:{grpc_port}"),
                "pdserve_on_ray": grpc_target(ray_grpc),
            },
            args.rounds,
        )
        res["grpc"] = {k: medians(v, "throughput") for k, v in grpc.items()}
    serve.delete("pdserve")
    if "images" not in parts or args.direct_ingress:
        return

    t0 = time.monotonic()
    img1 = {"num_replicas": 1, "max_ongoing_requests": 64, "ray_actor_options": {"num_cpus": 2}}
    control.deploy(
        server_application(repo, ["image_classifier"], img1),
        "one",
        {"pdserve": img1},
        route_prefix="/one",
    )
    steps = ("preprocess", "efficientnet_lite0", "postprocess", "image_classifier")
    split = application(
        repo,
        ["image_classifier"],
        {m: {"max_ongoing_requests": 64} for m in steps},
        {"max_ongoing_requests": 64},
    )
    control.deploy(split, "split", {}, route_prefix="/split")
    res["image_deploy_s"] = round(time.monotonic() - t0, 1)
    img_urls = {
        k: f"http://{HEAD_IP}:8000/{k}/v2/models/image_classifier/infer" for k in ("one", "split")
    }
    for url in img_urls.values():
        images_point(url, tmp, 2, 1)
    images = rounds(
        {k: (lambda u=u: [images_point(u, tmp, 8, args.seconds)]) for k, u in img_urls.items()},
        args.rounds,
    )
    res["images"] = {k: medians(v, "images_s") for k, v in images.items()}


def report_cpu(http: dict[str, list[dict[str, Any]]]) -> None:
    """The CPU microseconds per answered request of each process, per HTTP path
    (medians over the rounds): Serve's proxy, the path's replica, the rest of Ray
    (GCS, raylet, controller, the other path's idle replica, Ray's agents)."""
    replica = {"ray_plain": "replica_plain", "pdserve_on_ray": "replica_pdserve"}
    print("\n| path | conns | proxy us/req | replica us/req | rest of Ray us/req | total |")
    print("|---|---|---|---|---|---|")
    for name, own in replica.items():
        for row in http.get(name, []):
            cpu = row.get("cpu_us", {})
            mine = cpu.get(own, 0)
            rest = sum(
                v for k, v in cpu.items() if k not in ("proxy", own, "pdserve_alone", "driver")
            )
            total = cpu.get("proxy", 0) + mine + rest
            print(
                f"| {name} | {row['conns']} | {cpu.get('proxy', 0):,} | {mine:,} | {rest:,} | {total:,} |"
            )


def report(res: dict[str, Any]) -> None:
    print("\n| protocol | path | conns | req/s (median) | range | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for proto, key in (("http", "rps"), ("grpc", "throughput")):
        for name, rows in res.get(proto, {}).items():
            for row in rows:
                lo, hi = row[f"{key}_range"]
                print(
                    f"| {proto} | {name} | {row['conns']} | {row[key]:,.0f} | {lo:,.0f}-{hi:,.0f} "
                    f"| {row['p50_ms']} | {row['p99_ms']} |"
                )
    h = res.get("http", {})
    for i, row in enumerate(h.get("pdserve_on_ray", [])):
        c = row["conns"]
        print(
            f"HTTP c={c}: one hop / plain Serve = {row['rps'] / h['ray_plain'][i]['rps']:.2f}x "
            f"(p99 {row['p99_ms']} vs {h['ray_plain'][i]['p99_ms']} ms); "
            f"one hop / pdserve alone = {row['rps'] / h['pdserve'][i]['rps']:.3f}x"
        )
    report_cpu(h)
    for c, points in res.get("side_by_side", {}).items():
        ratios = [p["pdserve_on_ray"]["rps"] / p["ray_plain"]["rps"] for p in points]
        p99 = [p["pdserve_on_ray"]["p99_ms"] / p["ray_plain"]["p99_ms"] for p in points]
        print(
            f"side by side c={c}: one hop / plain Serve req/s {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f}), p99 {statistics.median(p99):.3f} "
            f"({min(p99):.3f}-{max(p99):.3f})"
        )
    g = res.get("grpc", {})
    for i, row in enumerate(g.get("pdserve_on_ray", [])):
        ratio = row["throughput"] / g["pdserve"][i]["throughput"]
        print(f"gRPC c={row['conns']}: one hop / pdserve alone = {ratio:.3f}x")
    im = res.get("images")
    if im:
        print(
            f"images/s at c=8: one replica {im['one'][0]['images_s']}, "
            f"a deployment per step {im['split'][0]['images_s']}"
        )
    print(f"total {res.get('total_s')} s")


if __name__ == "__main__":
    raise SystemExit(main())
