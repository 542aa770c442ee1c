"""Issue 12 benchmarks: canary share, fault-to-rollback time, shadow cost.

1. **Canary share**: ``tiny_all_versions`` (ONNX) with ``traffic.yaml`` weights
   ``{1: 90, 2: 10}``; 10,000 unversioned requests (no route key) from client threads
   over keep-alive HTTP; the share version 2 served (from each response's
   ``model_version``). The same 10,000 on a copy without a traffic file: the
   throughput ratio is the cost of the split.
2. **Fault to rollback** under continuous load: ``tests/data/python_models/faulty``
   (versions 1 and 2), a rollout holding the canary at 10 % (``step_secs`` 3600)
   with ``window_secs`` 10, ``min_requests`` 20, ``max_error_rate`` 0.05,
   ``max_p99_ms`` 5x the baseline's client-side p99 (measured first), evaluated every
   0.1 s (if noise on a loaded machine trips it before the fault, the rollout is
   started again, counted in ``rollbacks_before_the_fault``). After 4 s of load a fault is injected in version 2 (its ``fault.2`` file):
   ``error`` (every request fails) or ``slow`` (sleeps 10x the measured p99). Reported:
   seconds from the fault to the ``rolled_back`` state (``GET
   /v2/models/{m}/rollout`` polled every 20 ms), requests failed before and after it.
3. **Shadow at 100 % on the image pipeline**: ``image_classifier`` (the ensemble;
   preprocess -> efficientnet_lite0 -> postprocess) with versions 1 and 2, raw JPEG in;
   closed loop, 1 and 4 client threads, alternating rounds with the shadow off (weights
   only) and on (``shadow: {version: 2, percent: 100}``), set through ``POST
   /v2/models/{m}/traffic``; caller p50/p99 and throughput, and the shadow's results
   (compared / shed). The shadow runs on the same step models and cores, so it costs
   the callers CPU, not waiting.

Usage::

    .venv/bin/python benchmarks/bench_rollout.py [--requests 10000] [--shadow-secs 8]

Prints Markdown and writes the raw figures to ``benchmarks/out/rollout.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any

import numpy as np
from common import GOLDENS, REPO, ROOT, cli_parser, start_server, stop_process

FAULTY = ROOT / "tests" / "data" / "python_models" / "faulty"
OUT = ROOT / "benchmarks" / "out"


def call(port: int, method: str, path: str, body: Any = None) -> Any:
    """One JSON admin call; the decoded answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{method} {path}: {e.code} {e.read()[:300]!r}") from None
    return json.loads(raw) if raw.strip() else None


class Load:
    """Closed-loop client threads on keep-alive connections; records
    ``(monotonic end, latency s, status, version)`` per request."""

    def __init__(
        self,
        port: int,
        path: str,
        body: bytes,
        headers: dict[str, str],
        threads: int,
        limit: int = 0,
    ) -> None:
        self.port, self.path, self.body, self.headers = port, path, body, headers
        self.limit = limit
        self.results: list[tuple[float, float, int, str]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sent = 0
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def wait(self) -> None:
        for t in self._threads:
            t.join()

    def _take(self) -> bool:
        if self._stop.is_set():
            return False
        if not self.limit:
            return True
        with self._lock:
            if self._sent >= self.limit:
                return False
            self._sent += 1
            return True

    def _run(self) -> None:
        conn = HTTPConnection("127.0.0.1", self.port, timeout=120)
        while self._take():
            t0 = time.monotonic()
            try:
                conn.request("POST", self.path, self.body, self.headers)
                r = conn.getresponse()
                raw = r.read()
                version = ""
                if r.status == 200:
                    hl = r.getheader("Inference-Header-Content-Length")
                    head = raw[: int(hl)] if hl else raw
                    version = json.loads(head).get("model_version", "")
                status = r.status
            except (OSError, HTTPException):
                status, version = 0, ""
                conn.close()
                conn = HTTPConnection("127.0.0.1", self.port, timeout=120)
            t1 = time.monotonic()
            self.results.append((t1, t1 - t0, status, version))
        conn.close()


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0-1) of ``values``, nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * len(s))) - 1))] if s else float("nan")


def json_body(name: str, arr: np.ndarray) -> bytes:
    return json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "datatype": "FP32",
                    "shape": list(arr.shape),
                    "data": arr.ravel().tolist(),
                }
            ]
        }
    ).encode()


def make_repo(work: Path) -> Path:
    """The benchmark's model repository (see the module docstring)."""
    repo = work / "repo"
    repo.mkdir(parents=True)
    for name, traffic in (("split", "weights: {1: 90, 2: 10}\n"), ("nosplit", None)):
        dst = repo / name
        shutil.copytree(REPO / "tiny_all_versions", dst)
        cfg = (dst / "config.pbtxt").read_text().replace("tiny_all_versions", name)
        (dst / "config.pbtxt").write_text(cfg)
        if traffic:
            (dst / "traffic.yaml").write_text(traffic)
    for name in ("fault_error", "fault_slow"):
        dst = repo / name
        shutil.copytree(FAULTY, dst)
        cfg = (dst / "config.pbtxt").read_text().replace('name: "faulty"', f'name: "{name}"')
        (dst / "config.pbtxt").write_text(cfg.replace("count: 1,", "count: 2,"))
        shutil.copytree(dst / "1", dst / "2")
    for name in ("preprocess", "efficientnet_lite0", "postprocess", "image_classifier"):
        shutil.copytree(REPO / name, repo / name, symlinks=True)
    ens = repo / "image_classifier"
    (ens / "2").mkdir(exist_ok=True)
    cfg = (ens / "config.pbtxt").read_text()
    cfg = cfg.replace('platform: "ensemble"', 'platform: "ensemble"\nversion_policy: { all: {} }')
    (ens / "config.pbtxt").write_text(cfg)
    (ens / "traffic.yaml").write_text("weights: {1: 100}\n")
    return repo


def canary_share(port: int, n: int, threads: int) -> dict[str, Any]:
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    body = json_body("INPUT0", x)
    hdrs = {"Content-Type": "application/json"}
    out: dict[str, Any] = {}
    for model in ("split", "nosplit", "split", "nosplit"):
        load = Load(port, f"/v2/models/{model}/infer", body, hdrs, threads, limit=n)
        t0 = time.monotonic()
        load.start().wait()
        secs = time.monotonic() - t0
        versions = Counter(v for *_, s, v in load.results if s == 200)
        ok = sum(versions.values())
        row = out.setdefault(model, {"runs": []})
        row["runs"].append(
            {
                "requests": len(load.results),
                "ok": ok,
                "versions": dict(versions),
                "share_v2_percent": 100.0 * versions.get("2", 0) / ok if ok else None,
                "req_per_s": len(load.results) / secs,
                "p99_ms": pct([lat for _, lat, _, _ in load.results], 0.99) * 1000,
            }
        )
    return out


def fault_run(port: int, repo: Path, kind: str, threads: int) -> dict[str, Any]:
    model = f"fault_{kind}"
    body = json_body("X", np.array([[1, 2, 3, 4]], np.float32))
    hdrs = {"Content-Type": "application/json"}
    path = f"/v2/models/{model}/infer"
    # the baseline's client-side p99 (every request to version 1)
    warm = Load(port, path, body, hdrs, threads).start()
    time.sleep(3.0)
    warm.stop()
    p99 = pct([lat for _, lat, s, _ in warm.results if s == 200], 0.99)
    policy = {
        "canary": 2,
        "baseline": 1,
        "steps": [10, 100],
        "step_secs": 3600,
        "window_secs": 10,
        "min_requests": 20,
        "max_error_rate": 0.05,
        "max_p99_ms": round(5 * p99 * 1000, 2),
        "interval_secs": 0.1,
    }
    load = Load(port, path, body, hdrs, threads).start()
    premature = 0
    for _ in range(5):  # a loaded machine's noise may trip the p99 bound before the fault
        call(
            port, "POST", f"/v2/models/{model}/traffic", {"weights": {"1": 100}, "rollout": policy}
        )
        time.sleep(4.0)
        if call(port, "GET", f"/v2/models/{model}/rollout")["state"] == "running":
            break
        premature += 1
    fault = repo / model / "fault.2"
    slow_s = 10 * p99
    t_fault = time.monotonic()
    fault.write_text("error" if kind == "error" else f"slow:{slow_s:.4f}")
    t_back = None
    while time.monotonic() - t_fault < 60:
        doc = call(port, "GET", f"/v2/models/{model}/rollout")
        if doc["state"] == "rolled_back":
            t_back = time.monotonic()
            break
        time.sleep(0.02)
    time.sleep(3.0)
    load.stop()
    fault.unlink()
    res = load.results
    res = [r for r in res if r[0] >= t_fault - 4.0]  # the last attempt's load
    failed = [t for t, _, s, _ in res if s != 200]
    canary_after = [t for t, _, s, v in res if v == "2" and t_back is not None and t > t_back + 0.5]
    return {
        "fault": kind,
        "baseline_p99_ms": p99 * 1000,
        "slow_sleep_ms": slow_s * 1000 if kind == "slow" else None,
        "policy": policy,
        "requests": len(res),
        "req_per_s": len(res) / (res[-1][0] - res[0][0]) if res else 0,
        "seconds_to_rollback": None if t_back is None else t_back - t_fault,
        "failed_total": len(failed),
        "failed_before_fault": sum(1 for t in failed if t < t_fault),
        "failed_after_rollback": sum(1 for t in failed if t_back is not None and t > t_back),
        "canary_answers_after_rollback": len(canary_after),
        "rollbacks_before_the_fault": premature,
        "decision": doc["decisions"][-1] if doc["decisions"] else None,
    }


def shadow_rounds(port: int, secs: float, threads: int, rounds: int) -> dict[str, Any]:
    """Alternating shadow off / on rounds at ``threads`` closed-loop clients."""
    jpeg = np.load(GOLDENS / "image_classifier.npz")["image_bytes_flower"].tobytes()
    element = struct.pack("<I", len(jpeg)) + jpeg
    header = {
        "inputs": [
            {
                "name": "input_image_bytes",
                "datatype": "BYTES",
                "shape": [1, 1],
                "parameters": {"binary_data_size": len(element)},
            }
        ],
        "outputs": [
            {"name": "top5_labels", "parameters": {"binary_data": True}},
            {"name": "top5_confidences", "parameters": {"binary_data": True}},
        ],
    }
    head = json.dumps(header).encode()
    body = head + element
    hdrs = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(head)),
    }
    shadow = {
        "version": 2,
        "percent": 100,
        "queue_size": 64,
        "compare": {"top5_labels": {"exact": True}, "top5_confidences": {"atol": 1e-4}},
    }
    path = "/v2/models/image_classifier/infer"
    warm = Load(port, path, body, hdrs, threads).start()
    time.sleep(3.0)
    warm.stop()
    out: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode in ("off", "on"):
            traffic: dict[str, Any] = {"weights": {"1": 100}}
            if mode == "on":
                traffic["shadow"] = shadow
            call(port, "POST", "/v2/models/image_classifier/traffic", traffic)
            before = call(port, "GET", "/v2/models/image_classifier/traffic")
            load = Load(port, path, body, hdrs, threads).start()
            time.sleep(secs)
            load.stop()
            time.sleep(1.0)  # let the shadow queue drain before reading its counters
            after = call(port, "GET", "/v2/models/image_classifier/traffic")
            lats = [lat for _, lat, s, _ in load.results if s == 200]
            row: dict[str, Any] = {
                "requests": len(load.results),
                "failed": sum(1 for *_, s, _ in load.results if s != 200),
                "req_per_s": len(load.results) / secs,
                "p50_ms": pct(lats, 0.5) * 1000,
                "p99_ms": pct(lats, 0.99) * 1000,
            }
            if mode == "on":
                b = (before.get("shadow") or {}).get("results", {}).get("2", {})
                a = after["shadow"]["results"].get("2", {})
                row["shadow"] = {k: a.get(k, 0) - b.get(k, 0) for k in a}
                row["divergence"] = after["shadow"]["divergence"]
            out[mode].append(row)
    return out


def main() -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--shadow-secs", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-rollout-"))
    repo = make_repo(work)
    proc, port, _, ready = start_server(repo, core="0-1")
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "loadavg_start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "server_ready_s": ready,
    }
    try:
        result["canary"] = canary_share(port, args.requests, args.threads)
        result["faults"] = [fault_run(port, repo, k, args.threads) for k in ("error", "slow")]
        result["shadow"] = {
            str(c): shadow_rounds(port, args.shadow_secs, c, args.rounds) for c in (1, args.threads)
        }
    finally:
        stop_process(proc)
        shutil.rmtree(work, ignore_errors=True)
    result["loadavg_end"] = os.getloadavg()
    OUT.mkdir(exist_ok=True)
    (OUT / "rollout.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    for c, by_mode in result["shadow"].items():
        for mode in ("off", "on"):
            rows = by_mode[mode]
            print(
                f"c={c} shadow {mode}: p99 {statistics.median(r['p99_ms'] for r in rows):.1f} ms, "
                f"{statistics.median(r['req_per_s'] for r in rows):.1f} req/s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
