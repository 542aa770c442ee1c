"""Rerun the main benchmarks of this folder, one after another (``make bench``): server,
peers, pipeline, grpc_http, swap, memory, remote and ray (``--only`` picks a subset).

Each script prints its own table and writes its raw figures under
``benchmarks/out/``; copy the tables into ``benchmarks/RESULTS.md`` with the
date and the machine. Run it on a quiet machine: the scripts pin the server to
core 0 and the load client to core 1.

Usage::

    .venv/bin/python benchmarks/run_all.py [--only server,peers,pipeline,grpc_http,swap,memory,remote,ray]
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from common import cli_parser

HERE = Path(__file__).resolve().parent

#: name -> script; issue 2, 4, 3, 5 in that order, then issue 16 (memory), issue 14 (remote, ray).
SCRIPTS = {
    "server": "bench_server.py",
    "peers": "bench_peers.py",
    "pipeline": "bench_pipeline.py",
    "grpc_http": "bench_grpc_http.py",
    "swap": "bench_swap.py",
    "memory": "bench_memory.py",
    "remote": "bench_remote.py",
    "ray": "bench_ray.py",
}


def main() -> int:
    """Run the selected scripts; return non-zero if any failed."""
    p = cli_parser(__doc__, __file__)
    p.add_argument("--only", default=",".join(SCRIPTS), help="comma-separated subset")
    args = p.parse_args()
    failed = []
    for name in args.only.split(","):
        script = HERE / SCRIPTS[name]
        print(f"\n=== {name}: {script.name}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run([sys.executable, str(script)], check=False).returncode
        print(f"=== {name}: exit {rc} in {time.monotonic() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
