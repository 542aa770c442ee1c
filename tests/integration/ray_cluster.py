"""A two-node Ray cluster on one machine, and the Ray Serve scenario of test_ray.py.

Run inside a network namespace of its own (``unshare -n python ray_cluster.py ...``):
Ray's GCS, raylets and workers bind every interface, so the head (127.0.0.2) and the
worker node (127.0.0.3) live on the namespace's loopback only, and nothing they open
is reachable from outside it. Every Ray process is stopped by its process id (never
``ray stop``, which would stop every Ray process of the machine).

``main`` deploys a repository with :func:`pdserve.ray.application`, drives load with a
real HTTP client, kills a replica and then the worker node under load, runs an
autoscaling step, and prints one JSON document (the last line of stdout).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's pdserve, in the driver and (PYTHONPATH) in Ray
HEAD_IP = "127.0.0.2"
WORKER_IP = "127.0.0.3"
GCS_PORT = 6380
GRPC_PORT = 9000
APP = "pdserve"  #: the one-hop application (pdserve ray deploy's default name)
SERVER = "pdserve"  #: its deployment
SPLIT = "split"  #: the application of a deployment per model


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def setup_namespace() -> None:
    """Bring the namespace's loopback up (``unshare -n`` leaves it down).

    Raises:
        RuntimeError: this process is not in a namespace of its own (127.0.0.2 would
            be the machine's loopback).
    """
    links = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True)
    if [line.split(":")[1].strip() for line in links.stdout.splitlines()] != ["lo"]:
        raise RuntimeError("run this script inside `unshare -n`: it starts Ray nodes")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def _children(pid: int) -> list[int]:
    """Every descendant process id of ``pid`` (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out.extend(kids)
        todo.extend(kids)
    return out


def cmdline(pid: int) -> str:
    """The command line of process ``pid`` ('' when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Cluster:
    """The ``ray start --block`` processes of the head and the worker node."""

    head: subprocess.Popen[bytes]
    worker: subprocess.Popen[bytes]
    temp_dir: Path
    known: set[int] = field(default_factory=set)

    def remember(self) -> None:
        """Record every Ray process started so far (stop kills them by id)."""
        for p in (self.head, self.worker):
            self.known.add(p.pid)
            self.known.update(_children(p.pid))

    def worker_raylet(self) -> int:
        """The worker node's raylet process id.

        Raises:
            RuntimeError: none found.
        """
        for pid in _children(self.worker.pid):
            if "/raylet " in cmdline(pid) or cmdline(pid).startswith("raylet"):
                return pid
        for pid in _children(self.worker.pid):
            if "raylet" in cmdline(pid).split(" ")[0]:
                return pid
        raise RuntimeError("no raylet under the worker node's ray start")

    def stop(self) -> None:
        """Kill every Ray process this cluster started, by id (SIGTERM, then SIGKILL)."""
        self.remember()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in sorted(self.known):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if sig == signal.SIGTERM:
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and any(_alive(p) for p in self.known):
                    time.sleep(0.2)
        for p in (self.head, self.worker):
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_cluster(
    temp_dir: Path,
    cpus: int = 16,
    timeout: float = 90.0,
    with_worker: bool = True,
    cores: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> Cluster:
    """Start the head on 127.0.0.2 and (``with_worker``) a worker node on 127.0.0.3,
    and connect this process as the driver.

    Args:
        cpus: logical CPUs each node offers (Ray's scheduling, not a limit).
        cores: pin every Ray process to these cores (``taskset -c``), e.g. ``"0"``.
        extra_env: environment of the Ray processes (not this driver's), e.g. Serve's
            ``RAY_SERVE_*`` knobs.

    Raises:
        RuntimeError: the cluster did not have its nodes within ``timeout`` s.
    """
    import ray

    pin = ["taskset", "-c", cores] if cores else []
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", **(extra_env or {}))
    temp_dir.mkdir(parents=True, exist_ok=True)
    common = ["--block", "--disable-usage-stats", f"--num-cpus={cpus}", f"--temp-dir={temp_dir}"]
    head_log = open(temp_dir / "head.log", "wb")  # noqa: SIM115 - the process holds it
    head = subprocess.Popen(
        [
            *pin,
            ray_bin,
            "start",
            "--head",
            f"--node-ip-address={HEAD_IP}",
            f"--port={GCS_PORT}",
            "--include-dashboard=false",
            '--resources={"head": 1}',
            "--dashboard-agent-listen-port=52365",
            "--metrics-export-port=58080",
            "--runtime-env-agent-port=58090",
            *common,
        ],
        env=env,
        stdout=head_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    worker: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(1)
            if head.poll() is not None:
                raise RuntimeError(f"ray head exited: {(temp_dir / 'head.log').read_text()}")
            if (temp_dir / "session_latest").exists() and _gcs_up():
                break
        if not with_worker:
            cluster = Cluster(head, head, temp_dir)
            ray.init(
                address=f"{HEAD_IP}:{GCS_PORT}",
                _node_ip_address=HEAD_IP,
                logging_level="WARNING",
                log_to_driver=False,
            )
            cluster.remember()
            return cluster
        worker_log = open(temp_dir / "worker.log", "wb")  # noqa: SIM115
        worker = subprocess.Popen(
            [
                *pin,
                ray_bin,
                "start",
                f"--address={HEAD_IP}:{GCS_PORT}",
                f"--node-ip-address={WORKER_IP}",
                "--dashboard-agent-listen-port=52366",
                "--metrics-export-port=58081",
                "--runtime-env-agent-port=58091",
                *common,
            ],
            env=env,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        cluster = Cluster(head, worker, temp_dir)
        os.environ["PYTHONPATH"] = str(ROOT)
        ray.init(
            address=f"{HEAD_IP}:{GCS_PORT}",
            _node_ip_address=HEAD_IP,
            logging_level="WARNING",
            log_to_driver=False,
        )
        while time.monotonic() < deadline:
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) >= 2:
                cluster.remember()
                return cluster
            if worker.poll() is not None:
                raise RuntimeError(f"ray worker exited: {(temp_dir / 'worker.log').read_text()}")
            time.sleep(1)
        raise RuntimeError("the worker node did not join within the timeout")
    except BaseException:
        c = Cluster(head, worker or head, temp_dir)
        c.stop()
        raise


def _gcs_up() -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HEAD_IP, GCS_PORT)) == 0


# --------------------------------------------------------------------------- client


def infer_body(model: str, name: str, x: np.ndarray, datatype: str = "FP32") -> bytes:
    """A V2 JSON inference request body for one input."""
    doc = {
        "inputs": [
            {"name": name, "shape": list(x.shape), "datatype": datatype, "data": x.ravel().tolist()}
        ]
    }
    return json.dumps(doc).encode()


class Client:
    """One keep-alive HTTP/1.1 connection to the Serve proxy."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(HEAD_IP, self.port, timeout=timeout)
        try:
            self.conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            return resp.status, resp.read()
        except Exception:
            self.conn.close()
            self.conn = None
            raise

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(HEAD_IP, self.port, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


@dataclass
class LoadResult:
    ok: int = 0
    failed: int = 0  #: requests that failed after every retry
    retried_errors: int = 0  #: attempts that failed and were retried
    wrong: int = 0  #: 200 answers whose outputs were wrong
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


def run_load(
    port: int,
    path: str,
    body: bytes,
    check: Callable[[bytes], bool],
    threads: int,
    seconds: float,
    retries: int = 20,
    during: Callable[[], None] | None = None,
) -> LoadResult:
    """``threads`` closed-loop clients for ``seconds`` (bounded); failed attempts
    (non-200 or connection errors) are retried up to ``retries`` times, 0.25 s apart.
    ``during`` runs in this thread once the load has run a third of the time."""
    result = LoadResult()
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def loop() -> None:
        client = Client(port)
        while time.monotonic() < stop_at:
            t0 = time.monotonic()
            for attempt in range(retries + 1):
                try:
                    status, data = client.post(path, body)
                except Exception as e:  # noqa: BLE001 - counted
                    status, data = -1, repr(e).encode()
                if status == 200:
                    good = check(data)
                    with lock:
                        result.ok += 1
                        result.wrong += not good
                        result.latencies.append(time.monotonic() - t0)
                    break
                with lock:
                    result.retried_errors += 1
                    if len(result.errors) < 10:
                        result.errors.append(f"{status}: {data[:200]!r}")
                if attempt == retries:
                    with lock:
                        result.failed += 1
                else:
                    time.sleep(0.25)

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    if during is not None:
        time.sleep(seconds / 3)
        during()
    for w in workers:
        w.join(seconds + retries * 1.0 + 60)
    return result


# --------------------------------------------------------------------------- scenario


def replica_states(deployment: str, app_name: str = APP) -> dict[str, int]:
    """Serve's replica counts by state for ``deployment`` of the application."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or deployment not in app.deployments:
        return {}
    return {str(k): v for k, v in app.deployments[deployment].replica_states.items()}


def running(deployment: str) -> int:
    return replica_states(deployment).get("RUNNING", 0)


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``cond`` every 0.3 s; return the seconds it took.

    Raises:
        TimeoutError: not true within ``timeout`` s.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.3)
    raise TimeoutError(f"{what}: not within {timeout} s")


def replicas_where(deployment: str, expect: int, tries: int = 60, app: str = APP) -> dict[int, str]:
    """pid -> node IP of the replicas of ``deployment`` (asked through its handle
    until ``expect`` distinct replicas answered, or ``tries`` calls)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app)
    seen: dict[int, str] = {}
    for _ in range(tries):
        w = handle.where.remote().result(timeout_s=30)
        seen[w["pid"]] = w["node_ip"]
        if len(seen) >= expect:
            break
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--temp-dir", required=True)
    parser.add_argument("--load-seconds", type=float, default=8.0)
    parser.add_argument(
        "--deadline", type=float, default=0.0, help="stop everything after this many s"
    )
    args = parser.parse_args()
    setup_namespace()
    out: dict[str, Any] = {"phases": {}}
    t_start = time.monotonic()
    deadline = time.monotonic() + args.deadline
    cluster = start_cluster(Path(args.temp_dir))
    if args.deadline:
        # past the deadline: stop every Ray process and report what was measured
        def expire() -> None:
            out["error"] = f"deadline: not done within {args.deadline} s"
            cluster.stop()
            print(json.dumps(out, default=str), flush=True)
            os._exit(1)

        watchdog = threading.Timer(max(1.0, deadline - time.monotonic()), expire)
        watchdog.daemon = True
        watchdog.start()
    out["cluster_start_s"] = round(time.monotonic() - t_start, 1)
    log(f"cluster up in {out['cluster_start_s']} s")
    run_and_report(
        cluster, lambda: scenario(cluster, Path(args.repo), args.load_seconds, out), out, t_start
    )


def run_and_report(
    cluster: Cluster, work: Callable[[], None], out: dict[str, Any], t_start: float
) -> None:
    """Run ``work``; an exception goes into ``out`` (``error``, ``traceback``). Then shut
    Serve and this driver down, stop every process of ``cluster`` and print ``out`` as
    one JSON line (with ``total_s`` since ``t_start``)."""
    try:
        work()
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        import traceback

        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    finally:
        try:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
        except Exception:  # noqa: BLE001
            pass
        cluster.stop()
        out["total_s"] = round(time.monotonic() - t_start, 1)
        print(json.dumps(out), flush=True)


def scenario(cluster: Cluster, repo: Path, load_s: float, out: dict[str, Any]) -> None:
    from pdserve.ray import control

    http_port = 8000
    control.start_proxies(control.Proxies(HEAD_IP, http_port, GRPC_PORT))
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    tiny_out = split_phase(repo, http_port, x, out)
    cli_phase(repo, x, tiny_out, out)
    cluster.remember()
    client = Client(http_port)
    tiny_path = "/v2/models/tiny/infer"
    tiny_body = infer_body("tiny", "INPUT0", x)

    def tiny_ok(data: bytes) -> bool:
        got = np.array(json.loads(data)["outputs"][0]["data"], dtype=np.float32)
        return bool(np.array_equal(got, tiny_out))

    out["server_nodes"] = sorted(set(replicas_where(SERVER, 2).values()))
    fault_phases(cluster, client, load_s, tiny_path, tiny_body, tiny_ok, out)
    out["cli_teardown"] = list(pdserve_ray_here("teardown"))


def split_phase(repo: Path, http_port: int, x: np.ndarray, out: dict[str, Any]) -> np.ndarray:
    """A deployment per model behind the ingress (tiny on both nodes; the ensemble's
    steps are other deployments); deleted at the end. Returns tiny's output for ``x``."""
    from ray import serve

    from pdserve.ray import application, control

    head_only = {"resources": {"head": 0.001}}
    options: dict[str, dict[str, Any]] = {
        "tiny": {"num_replicas": 2, "max_replicas_per_node": 1},
        "pre": {"num_replicas": 1},
        "pipe": {"num_replicas": 1, "ray_actor_options": head_only},
    }
    app = application(
        repo,
        models=["tiny", "pipe"],
        options=options,
        ingress={"ray_actor_options": {"num_cpus": 0.5, **head_only}},
    )
    t0 = time.monotonic()
    control.deploy(app, SPLIT, options, timeout_s=150)
    out["split_deploy_s"] = round(time.monotonic() - t0, 1)
    log(f"split deployed in {out['split_deploy_s']} s")
    out["tiny_nodes"] = sorted(set(replicas_where("tiny", 2, app=SPLIT).values()))
    client = Client(http_port)
    st, body = client.post("/v2/models/tiny/infer", infer_body("tiny", "INPUT0", x))
    assert st == 200, body
    tiny_out = np.array(json.loads(body)["outputs"][0]["data"], dtype=np.float32)
    st, body = client.post("/v2/models/pipe/infer", infer_body("pipe", "INPUT0", x))
    out["pipe_status"] = st
    out["pipe"] = json.loads(body)
    out["tiny_out"] = tiny_out.tolist()
    st, body = client.post("/v2/models/tiny/infer", infer_body("tiny", "INPUT0", tiny_out[None]))
    out["tiny_of_tiny"] = json.loads(body)["outputs"][0]["data"]
    st, body = client.post("/v2/models/tiny/infer", infer_body("tiny", "WRONG", x))
    out["bad_input"] = [st, json.loads(body)]
    st, body = client.post("/v2/models/nope/infer", infer_body("nope", "INPUT0", x))
    out["unknown_model"] = [st, json.loads(body)]
    out["metadata"] = json.loads(client.get("/v2/models/tiny")[1])
    out["ready"] = client.get("/v2/health/ready")[0]
    out["load_refused"] = client.post("/v2/repository/models/tiny/load", b"{}")[0]
    serve.delete(SPLIT)
    return tiny_out


def pdserve_ray(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m pdserve ray ARGS`` against this cluster."""
    cmd = [sys.executable, "-m", "pdserve", "ray", *args]
    cmd += [f"--address={HEAD_IP}:{GCS_PORT}", f"--node-ip-address={HEAD_IP}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=ROOT)


def pdserve_ray_here(*args: str) -> tuple[int, str]:
    """``pdserve ray ARGS`` in this process (already connected to the cluster): the exit
    code and what it printed."""
    import contextlib
    import io

    from pdserve.app.cli import main as cli_main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli_main(["ray", *args])
    return code, printed.getvalue()


def cli_phase(repo: Path, x: np.ndarray, tiny_out: np.ndarray, out: dict[str, Any]) -> None:
    """``pdserve ray deploy`` (one hop), tritonclient over HTTP and gRPC through Serve's
    proxies, ``status``, a deployment that cannot be placed."""
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp
    from ray import serve

    # the application of the fault phases too: 2 replicas (one per node), autoscaling to
    # 3 when each has more than 3 requests (the kills' 4 clients keep it at 2), fast
    # (Serve's delays are 30 s and 600 s)
    delays = {"upscale_delay_s": 1, "downscale_delay_s": 4}
    delays.update({"metrics_interval_s": 0.5, "look_back_period_s": 2})
    t0 = time.monotonic()
    done = pdserve_ray(
        "deploy", str(repo), "--models", "tiny,pipe,sleepy", "--autoscale", "2:3:3",
        "--num-cpus", "1", "--max-ongoing-requests", "8", "--max-replicas-per-node", "3",
        "--serve-options", json.dumps({"autoscaling_config": delays}),
    )  # fmt: skip
    out["cli_deploy"] = [done.returncode, done.stdout[-1500:], done.stderr[-1500:]]
    out["cli_deploy_s"] = round(time.monotonic() - t0, 1)
    assert done.returncode == 0, out["cli_deploy"]
    got: dict[str, Any] = {}
    http = thttp.InferenceServerClient(f"{HEAD_IP}:8000")
    inp = thttp.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    got["http_tiny"] = http.infer("tiny", [inp]).as_numpy("OUTPUT0").ravel().tolist()
    got["http_pipe"] = http.infer("pipe", [inp]).as_numpy("OUTPUT0").ravel().tolist()
    got["http_ready"] = http.is_server_ready() and http.is_model_ready("pipe")
    grpc = tgrpc.InferenceServerClient(f"{HEAD_IP}:{GRPC_PORT}")
    ginp = tgrpc.InferInput("INPUT0", [1, 64], "FP32")
    ginp.set_data_from_numpy(x)
    # the `application` metadata picks the Serve application when there are several
    headers = {"application": APP}
    got["grpc_tiny"] = (
        grpc.infer("tiny", [ginp], headers=headers).as_numpy("OUTPUT0").ravel().tolist()
    )
    got["grpc_pipe"] = (
        grpc.infer("pipe", [ginp], headers=headers).as_numpy("OUTPUT0").ravel().tolist()
    )
    got["grpc_ready"] = grpc.is_server_ready(headers=headers) and grpc.is_model_ready(
        "tiny", headers=headers
    )
    got["grpc_versions"] = list(grpc.get_model_metadata("tiny", headers=headers).versions)
    bad = tgrpc.InferInput("WRONG", [1, 64], "FP32")
    bad.set_data_from_numpy(x)
    try:
        grpc.infer("tiny", [bad], headers=headers)
    except Exception as e:  # noqa: BLE001 - the status is the answer
        got["grpc_bad"] = [str(getattr(e, "status", lambda: "")()), str(e)]
    answers: list[Any] = []
    grpc.start_stream(
        callback=lambda result, error: answers.append((result, error)), headers=headers
    )
    grpc.async_stream_infer("tiny", [ginp])
    grpc.stop_stream()  # waits for the stream's responses
    got["grpc_stream"] = [
        r.as_numpy("OUTPUT0").ravel().tolist() if r is not None else str(e) for r, e in answers
    ]
    got["tiny_expected"] = tiny_out.tolist()
    out["through_serve"] = got
    # the other actions in this process: a `pdserve ray` process takes seconds to connect
    out["cli_status"] = list(pdserve_ray_here("status"))
    t0 = time.monotonic()
    big = pdserve_ray_here("deploy", str(repo), "--name", "toobig", "--num-cpus", "64")
    out["cli_unplaceable"] = [*big, round(time.monotonic() - t0, 1)]
    out["apps_after_unplaceable"] = sorted(serve.status().applications)


def fault_phases(
    cluster: Cluster,
    client: Client,
    load_s: float,
    tiny_path: str,
    tiny_body: bytes,
    tiny_ok: Callable[[bytes], bool],
    out: dict[str, Any],
) -> None:
    """A replica and then the worker node killed under load, autoscaling under a load
    step (on the head: the downscale chooses which replica stops)."""
    # -- kill the worker node's replica under load (sleepy holds each request 0.2 s, so
    # requests are in flight on it)
    where = replicas_where(SERVER, 2)
    victim = next((p for p, ip in where.items() if ip == WORKER_IP), None)

    def kill_replica() -> None:
        if victim is not None:
            os.kill(victim, signal.SIGKILL)

    res = run_load(
        8000,
        "/v2/models/sleepy/infer",
        infer_body("sleepy", "X", np.array([0.2], dtype=np.float32)),
        lambda d: bool(np.isclose(json.loads(d)["outputs"][0]["data"], 0.2).all()),
        threads=4,
        seconds=load_s,
        during=kill_replica,
    )
    out["phases"]["kill_replica"] = {
        "victim_pid": victim,
        "ok": res.ok,
        "failed": res.failed,
        "retried": res.retried_errors,
        "wrong": res.wrong,
        "errors": res.errors,
    }
    log(f"kill replica: {out['phases']['kill_replica']}")
    phase = out["phases"]["kill_replica"]
    phase["victim_alive_after"] = victim is not None and _alive(victim)
    t_kill = time.monotonic()
    try:
        # Serve starts a replica in place of the lost one, on the worker node (it spreads
        # a deployment's replicas over the nodes)
        def replaced() -> bool:
            now = replicas_where(SERVER, 2, tries=10)
            return victim not in now and set(now.values()) == {HEAD_IP, WORKER_IP}

        wait_for(replaced, 60, "the lost replica replaced on the worker node")
        phase["replaced_s"] = round(time.monotonic() - t_kill, 1)
    except TimeoutError as e:
        phase["replace_error"] = str(e)
    cluster.remember()

    # -- kill the worker node (its raylet) under load
    raylet = cluster.worker_raylet()
    out["phases"]["worker_replicas_before_node_kill"] = sum(
        ip == WORKER_IP for ip in replicas_where(SERVER, running(SERVER), tries=20).values()
    )

    def kill_node() -> None:
        os.kill(raylet, signal.SIGKILL)

    res = run_load(8000, tiny_path, tiny_body, tiny_ok, threads=4, seconds=load_s, during=kill_node)
    out["phases"]["kill_node"] = {
        "raylet_pid": raylet,
        "ok": res.ok,
        "failed": res.failed,
        "retried": res.retried_errors,
        "wrong": res.wrong,
        "errors": res.errors,
    }
    log(f"kill node: {out['phases']['kill_node']}")
    import ray

    phase = out["phases"]["kill_node"]
    phase["raylet_alive_after"] = _alive(raylet)
    try:
        wait_for(lambda: sum(n["Alive"] for n in ray.nodes()) == 1, 30, "node marked dead")
    except TimeoutError as e:
        phase["node_error"] = str(e)
    phase["alive_nodes_after"] = sum(n["Alive"] for n in ray.nodes())
    phase["tiny_nodes_after"] = sorted(set(replicas_where(SERVER, 1, tries=5).values()))
    # after the node loss the head still answers
    st, _ = client.post(tiny_path, tiny_body)
    out["after_node_loss_status"] = st

    # -- autoscaling (on the head alone): a load step on sleepy, 2 -> 3 -> 2
    try:  # Serve replaced the lost node's replica on the head
        out["phases"]["replaced_on_head_s"] = round(
            wait_for(lambda: running(SERVER) == 2, 60, "2 replicas on the head"), 1
        )
    except TimeoutError as e:
        out["phases"]["autoscale_error"] = str(e)
    trace: list[tuple[float, int]] = []
    t_auto = time.monotonic()
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            trace.append((round(time.monotonic() - t_auto, 1), running(SERVER)))
            sampling.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    sleepy_body = infer_body("sleepy", "X", np.array([0.3], dtype=np.float32))
    auto = run_load(
        8000,
        "/v2/models/sleepy/infer",
        sleepy_body,
        lambda d: bool(np.isclose(json.loads(d)["outputs"][0]["data"], 0.3).all()),
        threads=12,
        seconds=max(12.0, load_s * 1.5),
    )
    load_end = round(time.monotonic() - t_auto, 1)
    try:
        wait_for(lambda: running(SERVER) == 2, 40, "downscale to 2")
    except TimeoutError as e:
        out["phases"]["autoscale_error"] = str(e)
    sampling.set()
    sampler.join(5)
    # the last word after the wait (the sampler may have stopped between two samples)
    trace.append((round(time.monotonic() - t_auto, 1), running(SERVER)))
    out["phases"]["autoscale"] = {
        "trace": trace,
        "load_end_s": load_end,
        "ok": auto.ok,
        "failed": auto.failed,
        "retried": auto.retried_errors,
        "wrong": auto.wrong,
        "max_replicas": max((n for _, n in trace), default=0),
        "final_replicas": trace[-1][1] if trace else 0,
        "errors": auto.errors,
    }
    log(f"autoscale: {out['phases']['autoscale']}")


if __name__ == "__main__":
    main()
