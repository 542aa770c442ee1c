"""Issue 10 churn: load and unload a python model and an ONNX model many times under traffic.

pdserve serves the example repository (``examples/model_repository``) in explicit
model control mode with only ``tiny`` loaded. A thread sends light traffic to
``tiny`` (one V2 JSON request every ``--traffic-interval`` s on a keep-alive
connection, each answer checked against the golden output). The main loop then runs
``--cycles`` (default 1,000) cycles of, over HTTP (the repository extension):

1. load ``pool`` (python backend: one worker process) and ``digits`` (ONNX Runtime),
2. one inference on each, checked (``pool``: a masked mean, unit length, equal to
   numpy's; ``digits``: the golden label of a test digit),
3. unload both.

Every ``--sample-every`` cycles (default 10), once the repository index shows
neither model ``LOADING`` or ``UNLOADING`` (unloads finish in the background, as in
Triton; 10 s at most), the server's RSS, open fds and threads and the number of
processes below it (fork server, resource tracker, workers), plus RSS/PSS/fds of the
whole tree, are sampled.
The report gives first/last values and least-squares slopes per 100 cycles from the
first sample after ``--sample-every`` cycles on (the sample taken before the first
cycle, before any python model has started the fork server, is kept apart); every
failed load, unload or request is counted (there should be none).

Usage::

    .venv/bin/python benchmarks/churn.py [--cycles 1000] [--sample-every 10]
        [--traffic-interval 0.05] [--max-minutes 60] [--out benchmarks/out/churn.json]

Writes the figures as JSON to ``--out`` (server log next to it) and prints a Markdown
summary. Bounded: ``--cycles`` cycles and ``--max-minutes`` at most, every HTTP call
has a 60 s timeout. The server listens on 127.0.0.1 and is stopped by pid at the end,
on Ctrl-C, SIGTERM and errors. Exit status 0 when nothing failed, else 1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    GOLDENS,
    REPO,
    ROOT,
    cli_parser,
    free_port,
    interrupt_on_sigterm,
    pdserve_command,
    slope,
    stop_process,
    tree_stats,
    wait_ready,
)

PYTHON_MODEL, ONNX_MODEL, TRAFFIC_MODEL = "pool", "digits", "tiny"


class Http:
    """A keep-alive HTTP/1.1 connection to the server that reconnects when closed."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, path: str, body: Any = None) -> tuple[int, Any]:
        """POST ``body`` as JSON (empty body for None); returns (status, decoded JSON or text).

        Raises:
            OSError, http.client.HTTPException: no answer (the connection is reset first).
        """
        data = b"" if body is None else json.dumps(body).encode()
        try:
            self.conn.request("POST", path, data, {"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            raise
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, raw.decode(errors="replace")


def infer_body(inputs: list[tuple[str, str, np.ndarray]]) -> dict[str, Any]:
    """A V2 JSON request of ``(name, datatype, array)`` inputs."""
    return {
        "inputs": [
            {"name": n, "datatype": dt, "shape": list(a.shape), "data": a.ravel().tolist()}
            for n, dt, a in inputs
        ]
    }


def output(answer: Any, name: str) -> np.ndarray:
    """Output ``name`` of a V2 JSON response as an array of its shape."""
    for o in answer["outputs"]:
        if o["name"] == name:
            return np.asarray(o["data"]).reshape(o["shape"])
    raise KeyError(name)


# --------------------------------------------------------------------------- traffic


@dataclass
class Traffic:
    """Light traffic on the model that stays loaded, in its own thread."""

    port: int
    interval: float
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        data = np.load(GOLDENS / "tiny.npz")
        x, want = data["inputs"][:1], data["tiny__v2"][:1]
        body = infer_body([("INPUT0", "FP32", x)])
        client = Http(self.port)
        while not self.stop.is_set():
            try:
                status, answer = client.post(f"/v2/models/{TRAFFIC_MODEL}/infer", body)
                good = status == 200 and np.allclose(output(answer, "OUTPUT0"), want, atol=1e-4)
                detail = f"HTTP {status}: {str(answer)[:200]}"
            except (OSError, http.client.HTTPException, KeyError, ValueError) as e:
                good, detail = False, repr(e)
            if good:
                self.ok += 1
            else:
                self.failed += 1
                if len(self.errors) < 20:
                    self.errors.append(detail)
            self.stop.wait(self.interval)


# --------------------------------------------------------------------------- the cycles


@dataclass
class Churn:
    """Counters and samples of the run."""

    cycles: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    cycle_seconds: list[float] = field(default_factory=list)

    def fail(self, what: str, detail: str) -> None:
        self.failures[what] = self.failures.get(what, 0) + 1
        if len(self.errors) < 50:
            self.errors.append(f"cycle {self.cycles}: {what}: {detail[:300]}")


def check(churn: Churn, what: str, client: Http, path: str, body: Any = None) -> Any:
    """POST ``body`` to ``path``; count a failure named ``what`` unless it answers 200.

    Returns:
        the decoded answer, or None after a failure.
    """
    try:
        status, answer = client.post(path, body)
    except (OSError, http.client.HTTPException) as e:
        churn.fail(what, repr(e))
        return None
    if status != 200:
        churn.fail(what, f"HTTP {status}: {answer}")
        return None
    return answer


def settle(client: Http, models: tuple[str, ...], timeout: float = 10.0) -> bool:
    """Wait until none of ``models`` is ``UNLOADING`` or ``LOADING`` in the repository
    index; False after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, index = client.post("/v2/repository/index")
        busy = [
            m
            for m in (index if status == 200 else [])
            if m.get("name") in models and m.get("state") in ("UNLOADING", "LOADING")
        ]
        if status == 200 and not busy:
            return True
        time.sleep(0.05)
    return False


def run_cycles(args: argparse.Namespace, port: int, server_pid: int) -> Churn:
    """The load/infer/unload cycles, with a sample every ``args.sample_every`` cycles."""
    churn = Churn()
    client = Http(port)
    digits = np.load(GOLDENS / "digits.npz")
    rng = np.random.default_rng(0)
    tokens = rng.standard_normal((1, 7, 384)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 0, 0]], np.int64)
    mean = tokens[0, :5].mean(axis=0)
    want_embedding = mean / np.linalg.norm(mean)
    pool_body = infer_body(
        [("token_embeddings", "FP32", tokens), ("attention_mask", "INT64", mask)]
    )
    models = (PYTHON_MODEL, ONNX_MODEL)
    deadline = time.monotonic() + args.max_minutes * 60

    def sample() -> None:
        if not settle(client, models):
            churn.fail("settle", "a model was still (un)loading after 10 s")
        s = tree_stats(server_pid)
        s["cycle"] = churn.cycles
        s["t"] = round(time.monotonic() - t0, 2)
        s["loadavg_1m"] = os.getloadavg()[0]
        churn.samples.append(s)

    t0 = time.monotonic()
    sample()
    for cycle in range(args.cycles):
        if time.monotonic() > deadline:
            break
        start = time.monotonic()
        for m in models:
            check(churn, f"load {m}", client, f"/v2/repository/models/{m}/load")
        answer = check(
            churn, f"infer {PYTHON_MODEL}", client, f"/v2/models/{PYTHON_MODEL}/infer", pool_body
        )
        if answer is not None and not np.allclose(
            output(answer, "embedding")[0], want_embedding, atol=1e-5
        ):
            churn.fail(f"infer {PYTHON_MODEL}", "wrong embedding")
        row = cycle % len(digits["X_test"])
        digit_body = infer_body([("input", "FP32", digits["X_test"][row : row + 1])])
        answer = check(
            churn, f"infer {ONNX_MODEL}", client, f"/v2/models/{ONNX_MODEL}/infer", digit_body
        )
        if answer is not None and int(output(answer, "label").ravel()[0]) != int(
            digits["predicted"][row]
        ):
            churn.fail(f"infer {ONNX_MODEL}", "wrong label")
        for m in models:
            check(churn, f"unload {m}", client, f"/v2/repository/models/{m}/unload")
        churn.cycle_seconds.append(time.monotonic() - start)
        churn.cycles = cycle + 1
        if churn.cycles % args.sample_every == 0:
            sample()
            if churn.cycles % (args.sample_every * 10) == 0:
                s = churn.samples[-1]
                print(
                    f"cycle {churn.cycles}: server RSS {s['server']['rss_kib'] / 1024:.1f} MiB, "
                    f"fds {s['server']['fds']}, threads {s['server']['threads']}, "
                    f"processes {s['processes']}, failures {sum(churn.failures.values())}",
                    flush=True,
                )
    if churn.samples[-1]["cycle"] != churn.cycles:
        sample()
    return churn


# --------------------------------------------------------------------------- the report


def summarize(churn: Churn, traffic: Traffic, args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of the run as one JSON-able object."""
    before, samples = churn.samples[0], churn.samples[1:]  # before: no python model yet
    cycles = [s["cycle"] for s in samples]

    def trend(ys: list[float]) -> dict[str, float]:
        return {
            "first": ys[0],
            "last": ys[-1],
            "min": min(ys),
            "max": max(ys),
            "slope_per_100_cycles": round(100 * slope(cycles, ys), 3),
        }

    def server(key: str, scale: float = 1.0) -> list[float]:
        return [s["server"][key] / scale for s in samples]

    secs = np.asarray(churn.cycle_seconds or [0.0]) * 1000
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start_end": [samples[0]["loadavg_1m"], samples[-1]["loadavg_1m"]],
            "loadavg_1m_median": float(np.median([s["loadavg_1m"] for s in samples])),
        },
        "args": vars(args),
        "cycles": churn.cycles,
        "seconds": samples[-1]["t"],
        "cycle_ms": {
            "p50": round(float(np.percentile(secs, 50)), 1),
            "p99": round(float(np.percentile(secs, 99)), 1),
            "max": round(float(secs.max()), 1),
        },
        "failures": churn.failures,
        "errors": churn.errors,
        "traffic": {"ok": traffic.ok, "failed": traffic.failed, "errors": traffic.errors},
        "before_first_cycle": before,
        "resources": {
            "server_rss_mib": trend(server("rss_kib", 1024)),
            "server_fds": trend(server("fds")),
            "server_threads": trend(server("threads")),
            "processes_below_server": trend([s["processes"] for s in samples]),
            "tree_rss_mib": trend([s["rss_mib"] for s in samples]),
            "tree_pss_mib": trend([s["pss_mib"] for s in samples]),
            "tree_fds": trend([s["fds"] for s in samples]),
        },
        "samples": samples,
    }


def markdown(r: dict[str, Any]) -> str:
    """The Markdown summary of :func:`summarize`'s result."""
    m = r["machine"]
    lines = [
        f"{r['cycles']} cycles in {r['seconds']:.0f} s (cycle p50 {r['cycle_ms']['p50']} ms, "
        f"p99 {r['cycle_ms']['p99']} ms, max {r['cycle_ms']['max']} ms; load average "
        f"{m['loadavg_start_end'][0]:.2f} at start, {m['loadavg_start_end'][1]:.2f} at end, "
        f"median {m['loadavg_1m_median']:.2f} on {m['cpus']} CPUs)",
        "",
        f"- failed loads/unloads/requests: **{sum(r['failures'].values())}** {r['failures']}",
        f"- traffic on {TRAFFIC_MODEL}: {r['traffic']['ok']} answered correctly, "
        f"**{r['traffic']['failed']} failed**",
        "",
        "| resource | first | last | min | max | slope per 100 cycles |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in r["resources"].items():
        lines.append(
            f"| {name} | {s['first']:.1f} | {s['last']:.1f} | {s['min']:.1f} | {s['max']:.1f} | "
            f"{s['slope_per_100_cycles']} |"
        )
    lines += [
        "",
        f"Processes of the server's tree alive after it stopped: {r.get('orphans_after_stop')}",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run the churn and print its summary."""
    p = cli_parser(__doc__, __file__)
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--sample-every", type=int, default=10, help="cycles between two samples")
    p.add_argument(
        "--traffic-interval", type=float, default=0.05, help="seconds between two requests"
    )
    p.add_argument("--max-minutes", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "churn.json")
    args = p.parse_args(argv)
    interrupt_on_sigterm()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".server.log")
    port = free_port()
    cmd = pdserve_command(
        REPO,
        port,
        free_port(),
        free_port(),
        "--host",
        "127.0.0.1",
        "--model-control-mode",
        "explicit",
        "--load-model",
        TRAFFIC_MODEL,
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    traffic: Traffic | None = None
    thread: threading.Thread | None = None
    try:
        wait_ready(proc, port, log, "pdserve", interval=0.2, tail=3000)
        traffic = Traffic(port, args.traffic_interval)
        thread = threading.Thread(target=traffic.run, name="traffic", daemon=True)
        thread.start()
        churn = run_cycles(args, port, proc.pid)
    finally:  # also on Ctrl-C and errors
        if traffic is not None and thread is not None:
            traffic.stop.set()
            thread.join(70)
        orphans = stop_process(proc)
    result = summarize(churn, traffic, args)
    result["orphans_after_stop"] = orphans
    result["server_exit_code"] = proc.returncode
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(markdown(result))
    print(f"\nJSON: {args.out}; server log: {log}")
    failed = sum(churn.failures.values()) + traffic.failed
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
