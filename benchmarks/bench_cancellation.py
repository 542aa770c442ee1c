"""Cancellation under load: clients that disconnect at random (issue 15 item 2).

A python model (``tests/data/python_models/cancel_loop``, its queue raised to 256 and
``max_batch_size`` 8; each request works 20 ms, checking ``request.is_cancelled()``)
gets requests of 256 KiB (binary tensor extension) from N client threads on raw
sockets, faster than it can serve them. Each client closes its socket without
reading the answer with probability ``--drop`` (after 0-200 ms), else reads it.
Every 0.5 s the script samples the model's queue (``nv_inference_pending_request_count``)
and the RSS of the server and its worker. Bounded means: the queue never exceeds
``max_queue_size`` and ends empty, abandoned requests leave it (the ``cancel``
statistics count them), and RSS stops growing (its slope over the second half).

Usage::

    .venv/bin/python benchmarks/bench_cancellation.py [--duration 30] [--clients 48] [--drop 0.5]

Prints JSON.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from common import ROOT, cli_parser, slope, start_server, stop_process, tree_stats

MODEL = ROOT / "tests" / "data" / "python_models" / "cancel_loop"
CONFIG = """name: "cancel_loop"
backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
dynamic_batching { default_queue_policy { max_queue_size: 256 } }
"""


def make_body(floats: int, seconds: float) -> tuple[bytes, bytes]:
    """(HTTP head, body) of one request: the binary tensor extension."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "X",
                    "datatype": "FP32",
                    "shape": [1, floats],
                    "parameters": {"binary_data_size": 4 * floats},
                }
            ],
            "outputs": [{"name": "Y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    data = struct.pack("<f", seconds) + bytes(4 * (floats - 1))
    body = header + data
    head = (
        "POST /v2/models/cancel_loop/infer HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head, body


def read_status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0
        data += chunk
    status = int(data.split(b" ", 2)[1])
    # drain the rest (a closed connection after the answer is fine)
    sock.settimeout(30)
    while True:
        chunk = sock.recv(1 << 20)
        if not chunk or len(data) > (1 << 22):
            break
        data += chunk
        if b"\r\n\r\n" in data:
            head, rest = data.split(b"\r\n\r\n", 1)
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            if len(rest) >= length:
                break
    return status


def client(
    port: int, head: bytes, body: bytes, drop: float, until: float, counts: dict[str, int]
) -> None:
    rng = random.Random()
    lock = threading.Lock()
    while time.monotonic() < until:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            sock.sendall(head + body)
            if rng.random() < drop:
                time.sleep(rng.uniform(0, 0.2))
                sock.close()
                key = "disconnected"
            else:
                status = read_status(sock)
                sock.close()
                key = str(status)
        except OSError:
            key = "error"
        with lock:
            counts[key] = counts.get(key, 0) + 1


def metric(metrics_port: int, name: str) -> float:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f'{name}{{model="cancel_loop"'):
                return float(line.rsplit(" ", 1)[1])
    return -1.0


def main() -> None:
    ap = cli_parser(__doc__, __file__)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--drop", type=float, default=0.5, help="share of clients that disconnect")
    ap.add_argument("--floats", type=int, default=65536, help="FP32 values per request")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-cancel-"))
    repo = tmp / "models"
    shutil.copytree(MODEL, repo / "cancel_loop")
    (repo / "cancel_loop" / "config.pbtxt").write_text(CONFIG)
    proc, http_port, _, _ = start_server(repo, core=None)  # type: ignore[arg-type]
    try:
        # the metrics port: the server's command line carries it
        cmd = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        metrics_port = int(cmd[cmd.index(b"--metrics-port") + 1])
        head, body = make_body(args.floats, 0.02)
        counts: dict[str, int] = {}
        start = time.monotonic()
        until = start + args.duration
        threads = [
            threading.Thread(
                target=client,
                args=(http_port, head, body, args.drop, until, counts),
                daemon=True,
            )
            for _ in range(args.clients)
        ]
        for t in threads:
            t.start()
        samples: list[tuple[float, float, float]] = []  # t, pending, rss MiB
        while time.monotonic() < until:
            t = time.monotonic() - start
            pending = metric(metrics_port, "nv_inference_pending_request_count")
            rss = tree_stats(proc.pid)["rss_mib"]
            samples.append((round(t, 2), pending, rss))
            time.sleep(0.5)
        for t in threads:
            t.join(90)
        time.sleep(1.0)
        end_pending = metric(metrics_port, "nv_inference_pending_request_count")
        with urllib.request.urlopen(
            f"http://127.0.0.1:{http_port}/v2/models/cancel_loop/stats", timeout=10
        ) as r:
            inference = json.loads(r.read())["model_stats"][0]["inference_stats"]
        half = [s for s in samples if s[0] >= args.duration / 2]
        result = {
            "duration_s": args.duration,
            "clients": args.clients,
            "drop": args.drop,
            "request_kib": round(len(body) / 1024, 1),
            "outcomes": dict(sorted(counts.items())),
            "stats": {k: inference.get(k, {}).get("count") for k in ("success", "fail", "cancel")},
            "pending_max": max(s[1] for s in samples),
            "pending_mean": round(sum(s[1] for s in samples) / len(samples), 1),
            "pending_end": end_pending,
            "rss_mib_first": samples[0][2],
            "rss_mib_max": max(s[2] for s in samples),
            "rss_mib_last": samples[-1][2],
            "rss_slope_mib_per_s_second_half": round(
                slope([s[0] for s in half], [s[2] for s in half]), 3
            ),
            "loadavg": os.getloadavg(),
        }
        print(json.dumps(result, indent=1))
    finally:
        stop_process(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
