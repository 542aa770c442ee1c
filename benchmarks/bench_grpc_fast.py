"""Issue 11 point 3 benchmark: gRPC vs HTTP requests/s and server CPU per request.

pdserve serves only the ``tiny`` model, pinned to core 0 (``taskset -c 0``);
perf_analyzer (Triton's C++ load generator, ``-i http`` / ``-i grpc``, one row
FP32[1,64], random data) runs on core 1. For each concurrency the protocols run in
ABBA order within one server run, and the server's CPU seconds (utime + stime of its
process tree, from /proc) and completed requests (statistics extension) are taken
around each client run, so the ratios gRPC/HTTP come from the same minutes of the
same (shared, noisy) machine.

Each ``--variant LABEL:K=V,...`` is a server run with those environment variables
(``PDSERVE_GRPC_SERVER=aio``, ``GRPC_EXPERIMENTS=``...). perf_analyzer: ``$PA_VENV`` or ``benchmarks/.venvs/perf_analyzer``
(``make bench-perf-tool``).

Usage::

    .venv/bin/python benchmarks/bench_grpc_fast.py [--seconds 4] [--concurrency 32 128]
        [--variant threads:PDSERVE_GRPC_SERVER=threads --variant aio:PDSERVE_GRPC_SERVER=aio]
        [--out benchmarks/out/grpc_fast.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    ROOT,
    cli_parser,
    parse_pa_csv,
    perf_analyzer_command,
    start_logged_server,
    success_count,
    taskset,
    tiny_repo,
    tree_cpu_seconds,
)

PA_VENV = Path(os.environ.get("PA_VENV", ROOT / "benchmarks" / ".venvs" / "perf_analyzer"))


def perf_analyzer(
    proto: str, port: int, c: int, seconds: float, tmp: Path
) -> tuple[list[str], dict[str, str]]:
    pa, env = perf_analyzer_command(PA_VENV, " or set PA_VENV")
    csv_path = tmp / f"pa-{proto}-{c}.csv"
    cmd = [
        *pa, "-m", "tiny", "-u", f"127.0.0.1:{port}", "-i", proto,
        "--concurrency-range", str(c), "--measurement-interval", str(int(seconds * 1000)),
        "-s", "50", "-r", "3", "-f", str(csv_path),
    ]  # fmt: skip
    return cmd, env


def point(
    proto: str, c: int, pid: int, http_port: int, grpc_port: int, seconds: float, tmp: Path
) -> dict[str, Any]:
    cmd, env = perf_analyzer(proto, grpc_port if proto == "grpc" else http_port, c, seconds, tmp)
    n0, cpu0, t0 = success_count(http_port), tree_cpu_seconds(pid), time.monotonic()
    out = subprocess.run(
        [*taskset("1"), *cmd], capture_output=True, text=True, timeout=600,
        env={**os.environ, **env},
    )  # fmt: skip
    wall = time.monotonic() - t0
    cpu = tree_cpu_seconds(pid) - cpu0
    n = success_count(http_port) - n0
    row: dict[str, Any] = {
        "protocol": proto,
        "concurrency": c,
        "rc": out.returncode,
        "requests": n,
        "wall_s": round(wall, 2),
        "server_rps": round(n / wall, 1),
        "server_cpu_s": round(cpu, 2),
        "cpu_us_per_request": round(cpu / n * 1e6, 1) if n else None,
        "server_cpu_util": round(cpu / wall, 2),
    }
    pa_row = parse_pa_csv(tmp / f"pa-{proto}-{c}.csv", rps_digits=None)
    row.update(pa_rps=pa_row.pop("rps"), **pa_row)
    if out.returncode:
        row["stderr"] = (out.stdout + out.stderr)[-1500:]
    return row


def main(argv: list[str] | None = None) -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument("--seconds", type=float, default=4.0, help="perf_analyzer window (s)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL[:K=V,K=V]",
        help="a server configuration (environment); repeatable; default: 'default'",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "grpc_fast.json")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="grpcfast-"))
    repo = tiny_repo(tmp)
    rows: list[dict[str, Any]] = []
    for spec in args.variant or ["default"]:
        label, _, envs = spec.partition(":")
        extra = dict(kv.split("=", 1) for kv in envs.split(",") if kv)
        rows += run_variant(label, extra, repo, args.concurrency, args.seconds, tmp)
    print("\n| variant | c | HTTP req/s | gRPC req/s | gRPC/HTTP req/s | HTTP CPU us/req "
          "| gRPC CPU us/req | gRPC/HTTP CPU |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for h, g in zip(rows[::2], rows[1::2], strict=True):
        print(
            f"| {h['variant']} | {h['concurrency']} | {h['server_rps']:,.0f} | "
            f"{g['server_rps']:,.0f} | {g['server_rps'] / h['server_rps']:.2f} | "
            f"{h['cpu_us_per_request']:.0f} | {g['cpu_us_per_request']:.0f} | "
            f"{g['cpu_us_per_request'] / h['cpu_us_per_request']:.2f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"loadavg_after": os.getloadavg(), "rows": rows}
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


def run_variant(
    label: str,
    extra_env: dict[str, str],
    repo: Path,
    concurrency: list[int],
    seconds: float,
    tmp: Path,
) -> list[dict[str, Any]]:
    """Start pdserve with ``extra_env``; per concurrency, HTTP and gRPC in ABBA order
    (best of two each); rows: HTTP then gRPC per concurrency."""
    proc, http_port, grpc_port = start_logged_server(
        repo, tmp / f"pdserve-{label}.log", core="0", env=extra_env
    )
    rows: list[dict[str, Any]] = []
    try:
        for c in concurrency:
            runs: dict[str, list[dict[str, Any]]] = {"http": [], "grpc": []}
            for proto in ("http", "grpc", "grpc", "http"):
                runs[proto].append(point(proto, c, proc.pid, http_port, grpc_port, seconds, tmp))
            for rs in runs.values():
                best = dict(max(rs, key=lambda r: r["server_rps"]))
                best["variant"] = label
                best["env"] = extra_env
                best["rps_runs"] = [r["server_rps"] for r in rs]
                best["cpu_us_runs"] = [r["cpu_us_per_request"] for r in rs]
                rows.append(best)
            h, g = rows[-2], rows[-1]
            print(
                f"[{label}] c={c}: HTTP {h['server_rps']:.0f} req/s "
                f"({h['cpu_us_per_request']} us CPU/req, runs {h['rps_runs']}), gRPC "
                f"{g['server_rps']:.0f} req/s ({g['cpu_us_per_request']} us CPU/req, runs "
                f"{g['rps_runs']}); gRPC/HTTP req/s {g['server_rps'] / h['server_rps']:.2f}",
                flush=True,
            )
            for r in runs["http"] + runs["grpc"]:
                if r["rc"]:
                    print(r.get("stderr"))
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
