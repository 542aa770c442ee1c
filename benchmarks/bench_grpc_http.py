"""Issue 5 benchmark: V2 gRPC vs V2 HTTP, requests/s and latency.

pdserve serves the example repository pinned to one core (``taskset -c 0``); the
load client runs in its own process on the other core. Closed loop: C
connections (HTTP) or C concurrent calls over 4 channels (gRPC), each sending the
next request when the previous answer arrived; bounded in time.

- HTTP: ``benchmarks/loadgen.py`` (raw keep-alive HTTP/1.1 on uvloop +
  httptools), with the binary tensor extension (what ``tritonclient.http`` sends
  with ``binary_data=True``) and, for tiny, plain JSON.
- gRPC: :func:`grpc_load` below, a ``grpc.aio`` client sending one pre-serialised
  ``ModelInferRequest`` with ``raw_input_contents`` (what ``tritonclient.grpc``
  sends) and checking each answer's size, so client-side protobuf work stays out of
  the measurement as far as it can.

Each point runs twice, protocols in ABBA order, and the better run is reported (the
machine is shared; both runs are in the JSON).

Usage::

    .venv/bin/python benchmarks/bench_grpc_http.py [--duration 5] [--out benchmarks/out/grpc_http.json]

Prints a Markdown table and writes the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import GOLDENS, LOADGEN, REPO, ROOT, cli_parser, header_args, run_client, start_server

METHOD = "/inference.GRPCInferenceService/ModelInfer"


# --------------------------------------------------------------------------- bodies


def tiny_input() -> np.ndarray:
    return np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)


def efficientnet_input() -> np.ndarray:
    return np.load(GOLDENS / "efficientnet_lite0.npz")["inputs"][:1].astype(np.float32)


def http_binary_body(name: str, out: str, x: np.ndarray) -> tuple[bytes, str]:
    """A binary-extension request and its ``Inference-Header-Content-Length`` header."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": out, "parameters": {"binary_data": True}}],
        }
    ).encode()
    return header + x.tobytes(), f"Inference-Header-Content-Length: {len(header)}"


def http_json_body(name: str, x: np.ndarray) -> bytes:
    return json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        }
    ).encode()


def grpc_body(model: str, name: str, x: np.ndarray) -> bytes:
    """A serialised ``ModelInferRequest`` with the input in ``raw_input_contents``."""
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=model, raw_input_contents=[x.tobytes()])
    req.inputs.add(name=name, datatype="FP32", shape=list(x.shape))
    return req.SerializeToString()


# --------------------------------------------------------------------------- clients


def http_load(url: str, body: bytes, headers: list[str], concurrency: int, duration: float) -> Any:
    """One HTTP load point with benchmarks/loadgen.py pinned to core 1."""
    return run_client(
        str(LOADGEN),
        "--url",
        url,
        body,
        concurrency,
        duration,
        extra=header_args(headers),
        timeout=duration + 90,
    )


async def _grpc_load(
    target: str, body: bytes, concurrency: int, duration: float, warmup: float
) -> dict[str, Any]:
    import grpc

    opts = [
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 256 << 20),
    ]
    # distinct channel args -> distinct TCP connections (like several clients)
    channels = [
        grpc.aio.insecure_channel(target, options=[*opts, ("pdserve.bench.channel", i)])
        for i in range(min(4, concurrency))
    ]
    calls = [
        ch.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        for ch in channels
    ]
    lat: list[float] = []
    errors = 0
    first_error: list[str] = []
    warm_end = time.perf_counter() + warmup
    end = warm_end + duration

    async def worker(i: int) -> None:
        nonlocal errors
        call = calls[i % len(calls)]
        while True:
            t0 = time.perf_counter()
            if t0 >= end:
                return
            try:
                resp = await call(body, timeout=60)
                ok = len(resp) > 0
            except grpc.aio.AioRpcError as e:
                ok = False
                if not first_error:
                    first_error.append(f"{e.code()}: {e.details()}")
            t1 = time.perf_counter()
            if t0 >= warm_end and t1 <= end:
                if ok:
                    lat.append(t1 - t0)
                else:
                    errors += 1

    t_start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    for ch in channels:
        await ch.close()
    seconds = min(time.perf_counter(), end) - max(t_start, warm_end)
    arr = np.asarray(lat) * 1000 if lat else np.zeros(1)
    return {
        "requests": len(lat),
        "errors": errors,
        "seconds": round(seconds, 3),
        "rps": round(len(lat) / seconds, 1),
        "p50_ms": round(float(np.percentile(arr, 50)), 3),
        "p90_ms": round(float(np.percentile(arr, 90)), 3),
        "p99_ms": round(float(np.percentile(arr, 99)), 3),
        "max_ms": round(float(arr.max()), 3),
        "first_error": first_error[0] if first_error else None,
        "concurrency": concurrency,
    }


def grpc_load(target: str, body: bytes, concurrency: int, duration: float) -> Any:
    """One gRPC load point in a client process pinned to core 1."""
    return run_client(
        __file__,
        "--client",
        target,
        body,
        concurrency,
        duration,
        timeout=duration + 90,
        suffix=".pb",
    )


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "grpc_http.json")
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: run the gRPC client
    p.add_argument("--body-file", help=argparse.SUPPRESS)
    p.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        body = Path(args.body_file).read_bytes()
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        result = runner(_grpc_load(args.client, body, args.concurrency, args.duration, 1.0))
        print(json.dumps(result))
        return 0

    proc, http_port, grpc_port, _ = start_server(REPO)
    rows: list[dict[str, Any]] = []
    try:
        base = f"http://127.0.0.1:{http_port}/v2/models"
        target = f"127.0.0.1:{grpc_port}"
        tiny, eff = tiny_input(), efficientnet_input()
        tiny_bin, tiny_hdr = http_binary_body("INPUT0", "OUTPUT0", tiny)
        eff_bin, eff_hdr = http_binary_body("input", "logits", eff)
        points = {
            ("tiny", "HTTP JSON"): lambda c: http_load(f"{base}/tiny/infer", http_json_body("INPUT0", tiny), [], c, args.duration),
            ("tiny", "HTTP binary"): lambda c: http_load(f"{base}/tiny/infer", tiny_bin, [tiny_hdr], c, args.duration),
            ("tiny", "gRPC raw"): lambda c: grpc_load(target, grpc_body("tiny", "INPUT0", tiny), c, args.duration),
            ("efficientnet_lite0", "HTTP binary"): lambda c: http_load(f"{base}/efficientnet_lite0/infer", eff_bin, [eff_hdr], c, args.duration),
            ("efficientnet_lite0", "gRPC raw"): lambda c: grpc_load(target, grpc_body("efficientnet_lite0", "input", eff), c, args.duration),
        }  # fmt: skip
        for model in ("tiny", "efficientnet_lite0"):
            protos = [p for m, p in points if m == model]
            for c in (1, 32):
                # ABBA order, best of two runs per point: this machine is shared and
                # noisy, and the first run after another point is often slower.
                order = protos + protos[::-1]
                runs: dict[str, list[dict[str, Any]]] = {p: [] for p in protos}
                for proto in order:
                    runs[proto].append(points[(model, proto)](c))
                for proto in protos:
                    r = dict(max(runs[proto], key=lambda r: r["rps"]))
                    r.update(model=model, protocol=proto, concurrency=c)
                    r["rps_runs"] = [x["rps"] for x in runs[proto]]
                    rows.append(r)
                    print(
                        f"{model:<20} {proto:<12} c={c:<3} {r['rps']:>9.1f} req/s  "
                        f"p50 {r['p50_ms']:>8.2f} ms  p99 {r['p99_ms']:>8.2f} ms  "
                        f"errors {r['errors']}  runs {r['rps_runs']}",
                        flush=True,
                    )
    finally:
        proc.terminate()
        proc.wait(60)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"cpu_count": os.cpu_count(), "loadavg_after": os.getloadavg(), "rows": rows}, indent=1
        )
    )
    print("\n| model | protocol | c | req/s | p50 ms | p99 ms |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['protocol']} | {r['concurrency']} | {r['rps']:,.0f} | "
            f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
