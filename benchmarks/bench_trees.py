"""Tree models (backend "fil"): pdserve's compute time against each framework's own
predict, and the XGBoost classifier over V2 HTTP against MLServer's and KServe's
XGBoost servers.

Models: ``examples/tree_repository`` (``examples/build_trees.py``; built if missing).

``compute``
    Per model (XGBoost classifier, LightGBM regressor, scikit-learn random forest) and
    batch size (1, 8, 64): pdserve's server-side compute time per execution (the
    statistics extension's ``compute_infer``, one request at a time so each request is
    one execution) against the framework's own in-process call on the same model and
    rows, one thread, pinned to the server's core: XGBoost ``Booster.inplace_predict``,
    LightGBM ``Booster.predict``, scikit-learn ``predict_proba`` (the forest is trained
    again with the example's seed: the same trees). Goal: pdserve within 10%.
``predictors``
    The CPU predictors pdserve can run a FIL model on (TL2cgen-compiled, the framework's
    own, Treelite's GTIL), in process on one thread, on the same models and batch sizes
    (two rounds): what the ``auto`` choice is based on.
``http``
    ``xgboost_breast_cancer`` (its ``xgboost.json``), one row of 30 FP32 per V2 JSON
    request, ``wrk -t1 -c32`` pinned to the client core, each server pinned to the
    server core: pdserve (one instance, ``dynamic_batching {}``), MLServer 1.7.1 with
    mlserver-xgboost 1.7.1 (its XGBoost runtime, defaults: no adaptive batching, one
    parallel worker; ``OMP_NUM_THREADS=1`` as for KServe), and KServe 0.21 with ``peers/kserve_xgb_server.py`` (KServe's
    xgbserver model class on ``kserve.ModelServer``: xgbserver is not on PyPI). Peers
    run from their own venvs under ``benchmarks/.venvs/`` (``--install`` makes them).
    Goal: pdserve >= 5x each.

Rounds alternate the contenders (``--rounds``, default 4) so drift on a busy machine
hits all of them; medians are reported. The default run takes under 4 minutes.

Usage::

    .venv/bin/python benchmarks/bench_trees.py [--only compute,http] [--rounds 4]
        [--duration 4] [--install]

Writes ``benchmarks/out/bench_trees.json`` and prints Markdown tables.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from common import ROOT, cli_parser, free_port, pdserve_command, taskset, write_post_lua

BENCH = ROOT / "benchmarks"
OUT = BENCH / "out"
VENVS = BENCH / ".venvs"
PEERS = BENCH / "peers"
XGB_MODEL = "xgboost_breast_cancer"
COMPUTE_MODELS = (XGB_MODEL, "lightgbm_diabetes", "sklearn_forest_iris")
BATCHES = (1, 8, 64)
#: The peers' XGBoost runs with one OpenMP thread, as pdserve's predictor does: their
#: default (every CPU) on one pinned core only adds threads waiting on each other.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
PEER_REQUIREMENTS: dict[str, list[str]] = {
    "mlserver_xgboost": [
        "mlserver==1.7.1",
        "mlserver-xgboost==1.7.1",
        "uvloop<0.22",
        "xgboost==3.2.0",
    ],
    "kserve_xgboost": ["kserve==0.21.*", "xgboost==3.2.0", "numpy"],
}


def tree_repo() -> Path:
    """``examples/tree_repository``, built when missing or stale."""
    sys.path.insert(0, str(ROOT))
    from examples import build_trees

    return build_trees.ensure_built()


class Server:
    """A server process group on 127.0.0.1, stopped with SIGTERM then SIGKILL."""

    def __init__(
        self, name: str, cmd: list[str], base: str, cwd: Path | None = None, env: dict | None = None
    ) -> None:
        self.name, self.base = name, base
        OUT.mkdir(parents=True, exist_ok=True)
        self.log = open(OUT / f"trees_{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd or ROOT,
            env={**os.environ, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, path: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.base + path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"{self.name} not ready after {timeout}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        self.log.close()


def start_pdserve(repo: Path, core: str) -> Server:
    port = free_port()
    s = Server("pdserve", pdserve_command(repo, port, free_port(), free_port(), core=core),
               f"http://127.0.0.1:{port}")  # fmt: skip
    s.wait("/v2/health/ready")
    return s


# -- compute: server-side compute time vs the framework's own call ------------------


def framework_calls(repo: Path) -> dict[str, Any]:
    """model -> the framework's own one-thread predict on that model's file."""
    import lightgbm
    import xgboost
    from sklearn.datasets import load_iris
    from sklearn.ensemble import RandomForestClassifier

    booster = xgboost.Booster(model_file=str(repo / XGB_MODEL / "1" / "xgboost.json"))
    booster.set_param({"nthread": 1})
    lgb = lightgbm.Booster(model_file=str(repo / "lightgbm_diabetes" / "1" / "model.txt"))
    x, y = load_iris(return_X_y=True)
    rf = RandomForestClassifier(n_estimators=30, max_depth=6, random_state=0, n_jobs=1)
    rf.fit(x.astype(np.float32), y)
    return {
        XGB_MODEL: booster.inplace_predict,
        "lightgbm_diabetes": lambda a: lgb.predict(a, num_threads=1),
        "sklearn_forest_iris": rf.predict_proba,
    }


def rows(repo: Path, model: str, n: int) -> np.ndarray:
    with np.load(repo / model / "1" / "golden.npz") as g:
        x = g["input_0"]
    return np.ascontiguousarray(np.resize(x, (n, x.shape[1])), dtype=np.float32)


#: A compute or predictor point stops after ``--calls`` calls or this many seconds, whichever is first.
POINT_S = 0.5


def time_call(fn: Any, x: np.ndarray, calls: int) -> float:
    """Mean µs of ``fn(x)`` over up to ``calls`` calls (at least 10, at most
    :data:`POINT_S` s after that), after 5 warm-up calls: a mean, as the statistics
    extension's compute time is, so preemption on a busy machine counts in both."""
    for _ in range(5):
        fn(x)
    n, t0 = 0, time.perf_counter_ns()
    deadline = time.monotonic() + POINT_S
    while n < calls and (n < 10 or time.monotonic() < deadline):
        fn(x)
        n += 1
    return (time.perf_counter_ns() - t0) / n / 1e3


def run_predictors(args: Any, repo: Path) -> dict[str, Any]:
    """µs per call of each CPU predictor of the fil backend, pinned to the server core."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from pdserve.backends.fil.backend import InstancePlan, build_predictors, read_forest

    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(args.server_cpu)})
    runs: dict[str, list[float]] = {}
    try:
        for _ in range(min(args.rounds, 2)):
            for model in COMPUTE_MODELS:
                cfg = text_format.Parse(
                    (repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
                )
                for name in ("tl2cgen", "native", "gtil"):
                    if name == "native" and model == "sklearn_forest_iris":
                        continue  # a Treelite checkpoint has no framework predictor
                    cfg.parameters["predictor"].string_value = name
                    forest = read_forest(cfg, repo / model / "1", model)
                    pred = build_predictors(forest, [InstancePlan("KIND_CPU", 0, None)])[0]
                    for b in BATCHES:
                        us = time_call(pred.predict, rows(repo, model, b), args.calls)
                        runs.setdefault(f"{model}@{b}@{name}", []).append(us)
    finally:
        os.sched_setaffinity(0, own)
    return {k: round(statistics.median(v), 1) for k, v in runs.items()}


def compute_stats(base: str, model: str) -> tuple[int, int]:
    with urllib.request.urlopen(f"{base}/v2/models/{model}/stats") as r:
        s = json.loads(r.read())["model_stats"][0]["inference_stats"]["compute_infer"]
    return int(s["count"]), int(s["ns"])


def pdserve_compute(base: str, model: str, x: np.ndarray, calls: int) -> float:
    """Mean server-side compute µs per request (= per execution: one at a time)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(base.removeprefix("http://"))
    tensor = httpclient.InferInput("input__0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    for _ in range(5):
        client.infer(model, [tensor])
    n0, ns0 = compute_stats(base, model)
    n, deadline = 0, time.monotonic() + POINT_S
    while n < calls and (n < 10 or time.monotonic() < deadline):
        client.infer(model, [tensor])
        n += 1
    n1, ns1 = compute_stats(base, model)
    client.close()
    return (ns1 - ns0) / max(1, n1 - n0) / 1e3


def run_compute(args: Any, repo: Path) -> dict[str, Any]:
    calls = framework_calls(repo)
    server = start_pdserve(repo, args.server_cpu)
    own = os.sched_getaffinity(0)
    runs: dict[str, dict[int, dict[str, list[float]]]] = {
        m: {b: {"framework": [], "pdserve": []} for b in BATCHES} for m in COMPUTE_MODELS
    }
    try:
        for rnd in range(args.rounds):
            for model in COMPUTE_MODELS:
                for b in BATCHES:
                    x = rows(repo, model, b)
                    os.sched_setaffinity(0, {int(args.server_cpu)})  # the server's core
                    fw = time_call(calls[model], x, args.calls)
                    os.sched_setaffinity(0, {int(args.client_cpu)})
                    pd = pdserve_compute(server.base, model, x, args.calls)
                    runs[model][b]["framework"].append(fw)
                    runs[model][b]["pdserve"].append(pd)
            print(f"  compute round {rnd + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        os.sched_setaffinity(0, own)
        server.stop()
    table = {}
    for model in COMPUTE_MODELS:
        for b in BATCHES:
            fw = statistics.median(runs[model][b]["framework"])
            pd = statistics.median(runs[model][b]["pdserve"])
            table[f"{model}@{b}"] = {
                "framework_us": round(fw, 1),
                "pdserve_compute_us": round(pd, 1),
                "ratio": round(pd / fw, 3),
                "rounds": runs[model][b],
            }
    return table


# -- http: pdserve vs MLServer and KServe XGBoost servers ---------------------------


def ensure_venv(name: str, install: bool) -> Path | None:
    py = VENVS / name / "bin" / "python"
    if py.exists():
        return py
    if not install:
        return None
    VENVS.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENVS / name)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *PEER_REQUIREMENTS[name]], check=True)
    return py


def start_mlserver(py: Path, model_file: Path, core: str) -> Server:
    d = OUT / "trees_mlserver"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    port = free_port()
    settings = {"host": "127.0.0.1", "http_port": port, "grpc_port": free_port(),
                "metrics_port": free_port()}  # fmt: skip
    (d / "settings.json").write_text(json.dumps(settings))
    (d / "model-settings.json").write_text(
        json.dumps(
            {
                "name": XGB_MODEL,
                "implementation": "mlserver_xgboost.XGBoostModel",
                "parameters": {"uri": str(model_file)},
            }
        )
    )
    s = Server("mlserver", [*taskset(core), str(py.parent / "mlserver"), "start", str(d)],
               f"http://127.0.0.1:{port}", cwd=d, env=ONE_THREAD)  # fmt: skip
    s.wait(f"/v2/models/{XGB_MODEL}/ready")
    return s


def start_kserve(py: Path, model_file: Path, core: str) -> Server:
    port = free_port()
    cmd = [*taskset(core), str(py), str(PEERS / "kserve_xgb_server.py"), str(model_file),
           XGB_MODEL, str(port)]  # fmt: skip
    s = Server("kserve", cmd, f"http://127.0.0.1:{port}", env=ONE_THREAD)
    s.wait(f"/v2/models/{XGB_MODEL}/ready")
    return s


def check_answer(server: Server, body: Path) -> list[int]:
    """POST the body once: the server answers 200 with an output; its shape."""
    req = urllib.request.Request(
        f"{server.base}/v2/models/{XGB_MODEL}/infer",
        data=body.read_bytes(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return list(json.loads(r.read())["outputs"][0]["shape"])


def wrk(base: str, lua: Path, seconds: float, c: int, core: str) -> dict[str, Any]:
    cmd = [*taskset(core), "wrk", "-t1", f"-c{c}", f"-d{seconds:g}s", "--latency", "-s",
           str(lua), f"{base}/v2/models/{XGB_MODEL}/infer"]  # fmt: skip
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout

    def ms(label: str) -> float | None:
        m = re.search(rf"^\s+{label}\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        return (
            round(float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)], 3)
            if m
            else None
        )

    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    return {
        "rps": float(rps.group(1)) if rps else 0.0,
        "p50_ms": ms("50%"),
        "p99_ms": ms("99%"),
        "errors": int(non2xx.group(1)) if non2xx else 0,
    }


def run_http(args: Any, repo: Path) -> dict[str, Any]:
    model_file = repo / XGB_MODEL / "1" / "xgboost.json"
    x = rows(repo, XGB_MODEL, 1)
    body = {"inputs": [{"name": "input__0", "shape": [1, x.shape[1]], "datatype": "FP32",
                        "data": [float(v) for v in x[0]]}]}  # fmt: skip
    tmp = OUT / "trees_wrk"
    tmp.mkdir(parents=True, exist_ok=True)
    lua = write_post_lua(tmp, body)
    servers: dict[str, Server] = {}
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        servers["pdserve"] = start_pdserve(repo, args.server_cpu)
        for name, start in (("mlserver", start_mlserver), ("kserve", start_kserve)):
            if name not in args.servers:
                continue
            py = ensure_venv(f"{name}_xgboost", args.install)
            if py is None:
                print(f"  {name}: no venv under {VENVS} (run with --install)", file=sys.stderr)
                continue
            servers[name] = start(py, model_file, args.server_cpu)
        shapes = {n: check_answer(s, tmp / "body.json") for n, s in servers.items()}
        print(f"  output shapes: {shapes}", file=sys.stderr)
        for s in servers.values():  # warm-up
            wrk(s.base, lua, 1, args.concurrency, args.client_cpu)
        for rnd in range(args.rounds):
            for name, s in servers.items():
                results.setdefault(name, []).append(
                    wrk(s.base, lua, args.duration, args.concurrency, args.client_cpu)
                )
            line = ", ".join(f"{n} {r[-1]['rps']:,.0f}" for n, r in results.items())
            print(f"  http round {rnd + 1}/{args.rounds}: {line} req/s", file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()
    summary: dict[str, Any] = {"shapes": shapes}
    for name, rs in results.items():
        summary[name] = {
            "rps": round(statistics.median(r["rps"] for r in rs), 1),
            "p50_ms": round(statistics.median(r["p50_ms"] or 0 for r in rs), 2),
            "p99_ms": round(statistics.median(r["p99_ms"] or 0 for r in rs), 2),
            "errors": sum(r["errors"] for r in rs),
            "rounds_rps": [r["rps"] for r in rs],
        }
    for name in ("mlserver", "kserve"):
        if name in summary and summary[name]["rps"]:
            per_round = [
                round(a["rps"] / b["rps"], 2)
                for a, b in zip(results["pdserve"], results[name], strict=True)
                if b["rps"]
            ]
            summary[f"pdserve_over_{name}"] = {
                "median": round(summary["pdserve"]["rps"] / summary[name]["rps"], 2),
                "per_round": per_round,
            }
    return summary


def markdown(res: dict[str, Any]) -> str:
    out = []
    if "predictors" in res:
        out.append("| model | batch | tl2cgen µs | native µs | gtil µs |")
        out.append("|---|---|---|---|---|")
        p = res["predictors"]
        for model in COMPUTE_MODELS:
            for b in BATCHES:
                cells = [p.get(f"{model}@{b}@{n}") for n in ("tl2cgen", "native", "gtil")]
                shown = " | ".join("-" if c is None else f"{c:,.1f}" for c in cells)
                out.append(f"| {model} | {b} | {shown} |")
        out.append("")
    if "compute" in res:
        out.append("| model | batch | framework µs | pdserve compute µs | ratio |")
        out.append("|---|---|---|---|---|")
        for key, r in res["compute"].items():
            model, b = key.split("@")
            out.append(f"| {model} | {b} | {r['framework_us']:,.1f} | "
                       f"{r['pdserve_compute_us']:,.1f} | {r['ratio']:.2f} |")  # fmt: skip
    if "http" in res:
        h = res["http"]
        out.append("")
        out.append("| server | req/s (median) | p50 ms | p99 ms | errors | per round |")
        out.append("|---|---|---|---|---|---|")
        for name in ("pdserve", "mlserver", "kserve"):
            if name in h:
                r = h[name]
                rounds = ", ".join(f"{v:,.0f}" for v in r["rounds_rps"])
                out.append(f"| {name} | {r['rps']:,.0f} | {r['p50_ms']} | {r['p99_ms']} | "
                           f"{r['errors']} | {rounds} |")  # fmt: skip
        for name in ("mlserver", "kserve"):
            if f"pdserve_over_{name}" in h:
                ratio = h[f"pdserve_over_{name}"]
                out.append(
                    f"\npdserve / {name}: {ratio['median']}x (per round {ratio['per_round']})"
                )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument(
        "--only", default="predictors,compute,http", help="sections: predictors,compute,http"
    )
    p.add_argument("--servers", default="pdserve,mlserver,kserve", help="http contenders")
    p.add_argument("--rounds", type=int, default=4, help="alternated rounds (default 4)")
    p.add_argument("--duration", type=float, default=4, help="seconds per wrk run (default 4)")
    p.add_argument("--concurrency", type=int, default=32, help="wrk connections (default 32)")
    p.add_argument("--calls", type=int, default=200, help="calls per compute point (default 200)")
    p.add_argument("--server-cpu", default="0", help="the servers' core (default 0)")
    p.add_argument("--client-cpu", default="1", help="wrk's / the client's core (default 1)")
    p.add_argument("--install", action="store_true", help="create missing peer venvs")
    p.add_argument("--out", type=Path, default=OUT / "bench_trees.json")
    args = p.parse_args(argv)
    sections = set(args.only.split(","))
    repo = tree_repo()
    t0 = time.monotonic()
    res: dict[str, Any] = {"machine": os.uname().nodename, "cpus": os.cpu_count()}
    if "predictors" in sections:
        sys.path.insert(0, str(ROOT))
        res["predictors"] = run_predictors(args, repo)
    if "compute" in sections:
        res["compute"] = run_compute(args, repo)
    if "http" in sections:
        res["http"] = run_http(args, repo)
    res["seconds"] = round(time.monotonic() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(markdown(res))
    print(f"\n({res['seconds']} s; {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
