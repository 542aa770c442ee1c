"""Overhead of traffic control (issue 12): auth + rate limits + circuit breaker on vs off.

pdserve serves the example ``tiny`` model (64 FP32 in, 64 out) pinned to core 0
(``taskset -c 0``); ``wrk`` sends one-row V2 JSON requests from core 1 (``-t1 -cC``,
closed loop), always with the same ``Authorization: Bearer`` header so both runs send
the same bytes. Two configurations, run alternately ``--rounds`` times each:

- **off**: no traffic-control flag;
- **on**: ``--auth-config`` with a sha256 API key allowed on ``tiny`` (plus a second
  key), a rate limit on the key, on ``tiny`` and global (high enough never to refuse:
  only the bookkeeping is measured), in memory (``--rate-limit-strategy``), and
  ``--circuit-breaker on`` (every version has a breaker, fed every outcome).

Reported: requests/s, p50/p99 and the server's CPU time per request of each run, the
medians of each configuration and the ratios on/off (target: at least 0.90). The
server is pinned to one core, so its throughput is the inverse of its CPU time per
request; on a loaded machine (other processes share core 0) the CPU-time ratio is
the steadier of the two. Every answer must be 200: a run with non-2xx
answers (a 401 or 429 would be cheaper than an inference) fails the benchmark.

Usage::

    python benchmarks/bench_traffic_control.py [--seconds 10] [--connections 32] [--rounds 2]
"""

from __future__ import annotations

import hashlib
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
    proc_cpu_seconds,
    run_wrk,
    start_server,
    stop_process,
    tiny_repo,
    write_post_lua,
)

KEY = "bench-key-0f3a9c"


def write_auth(tmp: Path) -> Path:
    """The auth config of the 'on' runs."""
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    other = hashlib.sha256(b"other").hexdigest()
    path = tmp / "auth.yaml"
    path.write_text(
        "keys:\n"
        f"  - name: bench\n    hash: sha256:{digest}\n    models: [tiny]\n"
        "    rate_limit: 1000000/second\n"
        f"  - name: other\n    hash: sha256:{other}\n    models: ['*']\n"
        "rate_limits:\n  global: 1000000/second\n  models:\n    tiny: 1000000/second\n"
    )
    return path


def micro(auth: Path, n: int = 20000) -> dict[str, float]:
    """CPU µs per request of the added work alone, in this process (process time, so
    that other processes on a loaded machine do not count): the gate (classify the
    path, read the header, check the key, three token buckets) and a breaker's
    admit + record. The median of 5 passes of ``n``."""
    import asyncio

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pdserve.frontends.traffic.apis import classify_http
    from pdserve.frontends.traffic.auth import load_auth_config
    from pdserve.frontends.traffic.gate import TrafficGate, header_getter
    from pdserve.frontends.traffic.ratelimit import RateLimiter
    from pdserve.repository.breaker import BreakerPolicy, CircuitBreaker

    cfg = load_auth_config(auth)
    gate = TrafficGate(cfg, RateLimiter(cfg.rate_limits))
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"authorization", f"Bearer {KEY}".encode()),
        (b"content-length", b"300"),
    ]
    breaker = CircuitBreaker("tiny", "2", BreakerPolicy())

    async def gate_pass() -> float:
        t0 = time.process_time()
        for _ in range(n):
            category, model = classify_http("/v2/models/tiny/infer")
            await gate.check("http", category, model, header_getter(headers))
        return (time.process_time() - t0) / n * 1e6

    def breaker_pass() -> float:
        t0 = time.process_time()
        for _ in range(n):
            probe = breaker.admit()
            breaker.record(probe, failed=False)
        return (time.process_time() - t0) / n * 1e6

    gate_us = statistics.median(asyncio.run(gate_pass()) for _ in range(5))
    breaker_us = statistics.median(breaker_pass() for _ in range(5))
    return {"gate_us": round(gate_us, 2), "breaker_us": round(breaker_us, 2)}


def main() -> int:
    ap = cli_parser(__doc__, __file__)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--strategy", default="auto")
    ap.add_argument(
        "--parts",
        action="store_true",
        help="also run each part alone: auth (keys, no limits), limits, breaker",
    )
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is missing (apt-get install wrk)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-traffic-"))
    repo = tiny_repo(tmp)
    auth = write_auth(tmp)
    auth_only = tmp / "auth-only.yaml"
    auth_only.write_text(
        "\n".join(
            line
            for line in auth.read_text().splitlines()
            if "rate_limit" not in line
            and "global" not in line
            and "tiny: 1" not in line
            and line.strip() != "models:"
        )
        + "\n"
    )
    lua = write_post_lua(tmp, TINY_ROW_BODY, {"Authorization": f"Bearer {KEY}"})
    configs = {
        "off": (),
        "on": (
            "--auth-config", str(auth), "--rate-limit-strategy", args.strategy,
            "--circuit-breaker", "on",
        ),
    }  # fmt: skip
    if args.parts:
        configs["auth"] = ("--auth-config", str(auth_only))
        configs["breaker"] = ("--circuit-breaker", "on")
    runs: dict[str, list[dict[str, float | int | None]]] = {name: [] for name in configs}
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    added = micro(auth)
    print("added work per request (in-process, us):", added, flush=True)
    for _ in range(args.rounds):
        for name, flags in configs.items():
            proc, port, _, _ = start_server(repo, "--log-verbose", "0", *flags, core="0")
            try:
                run_wrk(port, lua, 2, args.connections)  # warm-up
                cpu0 = proc_cpu_seconds(proc.pid)
                result = run_wrk(port, lua, args.seconds, args.connections)
                cpu = proc_cpu_seconds(proc.pid) - cpu0
                n = int(result["requests"] or 0)
                result["cpu_us_per_request"] = round(cpu / n * 1e6, 1) if n else None
            finally:
                stop_process(proc)
            if result["non_2xx"]:
                print(f"{name}: {result['non_2xx']} non-2xx answers", file=sys.stderr)
                return 1
            runs[name].append(result)
            print(name, result, flush=True)
            time.sleep(1)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    med = {n: statistics.median(float(r["rps"] or 0) for r in rs) for n, rs in runs.items()}
    cpu_med = {
        n: statistics.median(float(r["cpu_us_per_request"] or 0) for r in rs)
        for n, rs in runs.items()
    }
    summary = {
        "runs": runs,
        "added_us_per_request": added,
        "median_rps": med,
        "median_cpu_us_per_request": cpu_med,
        # on a core of its own, throughput is 1 / CPU per request: the steadier figure
        # on a loaded machine
        "cpu_ratio_off_on": round(cpu_med["off"] / cpu_med["on"], 3) if cpu_med["on"] else None,
        "ratio_on_off": round(med["on"] / med["off"], 3) if med["off"] else None,
        "ratios": {n: round(v / med["off"], 3) for n, v in med.items()} if med["off"] else None,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "seconds": args.seconds,
        "connections": args.connections,
        "strategy": args.strategy,
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
