"""``--http-workers 1`` vs ``2`` (issue 11 point 4): requests/s and server CPU per request.

pdserve serves the example ``tiny`` model (64 FP32 in, 64 out) with the server's whole
process tree pinned to both cores (``taskset -c 0,1``); ``wrk`` (``-t1``, closed loop)
runs on the same machine, unpinned, so client and server share the two cores. Because
the client's load is on the same cores, each run reports the server's **CPU-seconds
per request** (user + system of the main process and every descendant: front-end
workers, ORT threads) next to requests/s and p50/p99.

Configurations alternate within one run (``--rounds`` times each, medians reported);
compare the ratios, not absolute figures (the machine is shared).

Usage::

    python benchmarks/bench_http_workers.py [--seconds 8] [--connections 32,128] [--rounds 1]
        [--servers native,asgi]
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import (
    TINY_ROW_BODY,
    cli_parser,
    run_wrk,
    start_server,
    stop_process,
    tiny_repo,
    tree_cpu_seconds,
    write_post_lua,
)


def main() -> int:
    ap = cli_parser(__doc__, __file__)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--connections", default="32,128")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--cores", default="0,1", help="taskset cores of the server")
    ap.add_argument("--servers", default="native", help="--http-server values to run")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is missing (apt-get install wrk)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    repo = tiny_repo(tmp)
    lua = write_post_lua(tmp, TINY_ROW_BODY)
    conns = [int(c) for c in args.connections.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    runs: dict[str, list[dict[str, object]]] = {}
    configs = [(srv, n) for srv in args.servers.split(",") for n in workers]
    for _ in range(args.rounds):
        for srv, n in configs:
            proc, port, _, _ = start_server(
                repo,
                "--log-verbose",
                "0",
                "--http-workers",
                str(n),
                "--http-server",
                srv,
                core=args.cores,
            )
            try:
                run_wrk(port, lua, 2, max(conns), core=None)  # warm-up (wrk unpinned)
                for c in conns:
                    cpu0 = tree_cpu_seconds(proc.pid)
                    result: dict[str, object] = dict(run_wrk(port, lua, args.seconds, c, core=None))
                    cpu = tree_cpu_seconds(proc.pid) - cpu0
                    count = int(result["requests"] or 0)  # type: ignore[call-overload]
                    result["cpu_us_per_request"] = round(cpu / count * 1e6, 1) if count else None
                    result["server_cpu_s"] = round(cpu, 2)
                    key = f"{srv} workers={n} c={c}"
                    runs.setdefault(key, []).append(result)
                    print(key, result, flush=True)
                    if result["non_2xx"]:
                        print(f"{key}: non-2xx answers", file=sys.stderr)
                        return 1
            finally:
                stop_process(proc)
            time.sleep(1)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]

    def med(key: str, field: str) -> float:
        return statistics.median(float(r[field] or 0) for r in runs[key])  # type: ignore[arg-type]

    ratios = {}
    for srv, c in [(srv, c) for srv in args.servers.split(",") for c in conns]:
        one, two = f"{srv} workers=1 c={c}", f"{srv} workers=2 c={c}"
        if one in runs and two in runs:
            ratios[f"{srv} c={c}"] = {
                "rps_2_over_1": round(med(two, "rps") / med(one, "rps"), 3),
                "cpu_per_request_2_over_1": round(
                    med(two, "cpu_us_per_request") / med(one, "cpu_us_per_request"), 3
                ),
            }
    summary = {
        "runs": runs,
        "ratios": ratios,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "seconds": args.seconds,
        "server_cores": args.cores,
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
