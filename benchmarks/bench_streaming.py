"""Issue 15 item 1: streaming from a decoupled model over gRPC and HTTP SSE.

The model is ``tests/data/python_models/decoupled_repeat``: one response (two INT32
[1] outputs) per element of ``IN``, sent from ``execute`` as fast as the worker can,
then the final flag alone. For each protocol, ``--requests`` requests of ``--responses``
responses each, one at a time, then the same at ``--concurrency`` clients:

- gRPC: ``ModelStreamInfer`` with tritonclient.grpc (``start_stream`` /
  ``async_stream_infer``, ``enable_empty_final_response``), one stream per client;
- SSE: ``POST /v2/models/decoupled_repeat/generate_stream`` read incrementally with
  ``http.client``, one keep-alive connection per client.

Reported per point: responses/s (every response counted when it reaches the client),
time to first response (from sending the request to its first response) p50/p99, and
the whole request's time p50. Every response's ``OUT`` is checked (the element sent).
As a reference, unary gRPC requests/s of the non-decoupled python model ``add_sub``
(one response per request, no batching) in the same run. Bounded: a few seconds a point. Usage::

    .venv/bin/python benchmarks/bench_streaming.py [--responses 100] [--requests 30] [--concurrency 4]

Prints a Markdown table and writes ``benchmarks/out/bench_streaming.json``.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from common import ROOT, cli_parser, start_server, stop_process

MODELS = ROOT / "tests" / "data" / "python_models"
MODEL = "decoupled_repeat"


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def grpc_client(url: str, n_requests: int, k: int, out: dict[str, list[float]]) -> None:
    """One stream: ``n_requests`` requests of ``k`` responses, one after the other."""
    got: queue.Queue[tuple[Any, Any, float]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(
        callback=lambda result, error: got.put((result, error, time.perf_counter()))
    )
    values = np.arange(k, dtype=np.int32)
    inp = grpcclient.InferInput("IN", [k], "INT32")
    inp.set_data_from_numpy(values)
    try:
        for _ in range(n_requests):
            t0 = time.perf_counter()
            client.async_stream_infer(MODEL, [inp], enable_empty_final_response=True)
            n = 0
            while True:
                result, error, t = got.get(timeout=60)
                if error is not None:
                    raise RuntimeError(str(error))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
                if int(result.as_numpy("OUT")[0]) != n:
                    raise RuntimeError("response out of order or wrong")
                if n == 0:
                    out["ttfr"].append(t - t0)
                n += 1
            if n != k:
                raise RuntimeError(f"{n} responses, expected {k}")
            out["total"].append(time.perf_counter() - t0)
            out["responses"].append(float(n))
    finally:
        client.stop_stream()
        client.close()


def sse_client(port: int, n_requests: int, k: int, out: dict[str, list[float]]) -> None:
    """One keep-alive connection: ``n_requests`` generate_stream requests of ``k``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"IN": list(range(k))})
    for _ in range(n_requests):
        t0 = time.perf_counter()
        conn.request(
            "POST",
            f"/v2/models/{MODEL}/generate_stream",
            body=body,
            headers={"content-type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        n = 0
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            doc = json.loads(line[6:])
            if doc.get("OUT") != n:
                raise RuntimeError(f"bad event {doc}")
            if n == 0:
                out["ttfr"].append(time.perf_counter() - t0)
            n += 1
        if n != k:
            raise RuntimeError(f"{n} events, expected {k}")
        out["total"].append(time.perf_counter() - t0)
        out["responses"].append(float(n))
    conn.close()


def unary_client(url: str, n_requests: int, out: dict[str, list[float]]) -> None:
    client = grpcclient.InferenceServerClient(url)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        inp = grpcclient.InferInput(name, [4], "FP32")
        inp.set_data_from_numpy(np.ones(4, np.float32))
        inputs.append(inp)
    for _ in range(n_requests):
        t0 = time.perf_counter()
        client.infer("add_sub", inputs)
        out["total"].append(time.perf_counter() - t0)
        out["ttfr"].append(time.perf_counter() - t0)
        out["responses"].append(1.0)
    client.close()


def run_point(target: Any, args: tuple[Any, ...], clients: int) -> dict[str, Any]:
    outs = [{"ttfr": [], "total": [], "responses": []} for _ in range(clients)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            target(*args, outs[i])
        except BaseException as e:  # noqa: BLE001 - reported
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"client failed: {errors[0]}")
    ttfr = [x for o in outs for x in o["ttfr"]]
    total = [x for o in outs for x in o["total"]]
    responses = sum(sum(o["responses"]) for o in outs)
    return {
        "clients": clients,
        "requests": len(total),
        "responses": int(responses),
        "seconds": round(elapsed, 3),
        "responses_per_s": round(responses / elapsed, 1),
        "requests_per_s": round(len(total) / elapsed, 1),
        "ttfr_p50_ms": round(_pct(ttfr, 50), 2),
        "ttfr_p99_ms": round(_pct(ttfr, 99), 2),
        "request_p50_ms": round(_pct(total, 50), 2),
    }


def main() -> int:
    parser = cli_parser(__doc__, __file__)
    parser.add_argument("--responses", type=int, default=100, help="responses per request")
    parser.add_argument("--requests", type=int, default=30, help="requests per client")
    parser.add_argument("--concurrency", type=int, default=4)
    opts = parser.parse_args()
    repo = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    for name in (MODEL, "add_sub"):
        shutil.copytree(MODELS / name, repo / name)
    proc, http_port, grpc_port, _ = start_server(repo)
    url = f"127.0.0.1:{grpc_port}"
    rows: list[dict[str, Any]] = []
    try:
        k, n = opts.responses, opts.requests
        grpc_client(url, 3, k, {"ttfr": [], "total": [], "responses": []})  # warm-up
        sse_client(http_port, 3, k, {"ttfr": [], "total": [], "responses": []})
        for clients in (1, opts.concurrency):
            rows.append({"protocol": "gRPC stream", **run_point(grpc_client, (url, n, k), clients)})
            rows.append(
                {"protocol": "HTTP SSE", **run_point(sse_client, (http_port, n, k), clients)}
            )
            rows.append(
                {
                    "protocol": "gRPC unary (add_sub, ref.)",
                    **run_point(unary_client, (url, n * 5), clients),
                }
            )
    finally:
        stop_process(proc)
        shutil.rmtree(repo, ignore_errors=True)
    load = os.getloadavg()
    print(
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {opts.responses} responses per request\n"
    )
    cols = [
        "protocol",
        "clients",
        "requests",
        "responses_per_s",
        "ttfr_p50_ms",
        "ttfr_p99_ms",
        "request_p50_ms",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    out = ROOT / "benchmarks" / "out"
    out.mkdir(exist_ok=True)
    (out / "bench_streaming.json").write_text(
        json.dumps({"options": vars(opts), "load": load, "rows": rows}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
