"""What tracing costs: tiny-model requests/s with tracing off, at rate 1/1000, and on
for every request (issue 17; target: <= 3 % at 1/1000).

ANCHORS.md's method: the server pinned to core 0 (``taskset -c 0``, its export thread
included), ``wrk -t1 -cC -dDs --latency -s post.lua`` on core 1 with the V2 JSON body
of one row of 64 FP32 values. The spans go to an OTLP/HTTP receiver in this process
(pinned to core 1 with wrk) that decodes nothing and answers 200. The three settings
are interleaved, ``--repeats`` times each; the figures are medians, the ratios are to
tracing off in the same run.

    python benchmarks/bench_tracing.py [--duration 6] [--repeats 3] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench_perf_tool import json_body, parse_wrk
from common import REPO, cli_parser, start_server, stop_process

SETTINGS: dict[str, list[str]] = {
    "off": [],
    "rate 1/1000": ["--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1000"],
    "every request": ["--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1"],
}


class Sink:
    """An OTLP/HTTP endpoint that counts bytes and answers 200 (empty protobuf)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.posts = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("content-length", 0))
                self.rfile.read(n)
                sink.bytes += n
                sink.posts += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def one_run(
    repo: Path, flags: list[str], sink: Sink, tmp: Path, args: argparse.Namespace
) -> dict[str, Any]:
    extra = [*flags, "--trace-config", f"opentelemetry,url={sink.url}"] if flags else []
    proc, http_port, _, _ = start_server(
        repo, "--no-allow-grpc", "--no-allow-metrics", *extra, core="0"
    )
    try:
        url = f"http://127.0.0.1:{http_port}/v2/models/tiny/infer"
        lua = str(tmp / "post.lua")
        wrk = ["taskset", "-c", "1", "wrk", "-t1", f"-c{args.concurrency}", "--latency", "-s", lua]
        subprocess.run([*wrk, "-d1s", url], capture_output=True, check=True)  # warm-up
        posts = sink.posts
        out = subprocess.run(
            [*wrk, f"-d{args.duration:g}s", url], capture_output=True, text=True, check=True
        ).stdout
        res = parse_wrk(out)
        errors = "Non-2xx" in out or "Socket errors" in out
        res["errors"] = errors
        time.sleep(0.2)
        res["otlp_posts"] = sink.posts - posts
        return res
    finally:
        stop_process(proc)


def main() -> None:
    parser = cli_parser(__doc__, __file__)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is missing: apt-get install -y wrk")
    os.sched_setaffinity(0, {1})  # the receiver and wrk share core 1
    tmp = Path(tempfile.mkdtemp(prefix="bench_tracing_"))
    json_body(tmp)
    repo = tmp / "repo"
    repo.mkdir()
    shutil.copytree(REPO / "tiny", repo / "tiny", symlinks=True)
    sink = Sink()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    for rep in range(args.repeats):
        for name, flags in SETTINGS.items():
            r = one_run(repo, flags, sink, tmp, args)
            runs[name].append(r)
            print(f"rep {rep} {name:14s} {r['rps']:9.1f} req/s  p50 {r['p50_ms']} ms  "
                  f"p99 {r['p99_ms']} ms  otlp posts {r['otlp_posts']}", flush=True)  # fmt: skip
    summary: dict[str, Any] = {
        "load_average": os.getloadavg(),
        "concurrency": args.concurrency,
        "duration_s": args.duration,
    }
    base = statistics.median(r["rps"] for r in runs["off"])
    for name, rs in runs.items():
        rps = statistics.median(r["rps"] for r in rs)
        summary[name] = {
            "rps_median": round(rps, 1),
            "rps_runs": [r["rps"] for r in rs],
            "p50_ms_median": statistics.median(r["p50_ms"] for r in rs),
            "p99_ms_median": statistics.median(r["p99_ms"] for r in rs),
            "vs_off": round(rps / base, 3),
            "errors": any(r["errors"] for r in rs),
        }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
