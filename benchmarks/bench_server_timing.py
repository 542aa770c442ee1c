"""Per-request Server-Timing and the wedge watchdog on the front-end hot path.

The set-up of ``bench_frontend.py`` (the example ``tiny`` ONNX model with its dynamic
batcher, one-row V2 JSON, each server pinned to core 0, ``wrk -t1`` on core 1), with
these servers, interleaved in every round (``--repeats``, at least 4 by default):

``before``
    the checkout ``--baseline`` names (default: ``git archive`` of ``--base-ref``, the
    merge base of HEAD and ``main``, into ``benchmarks/out/server_timing_base``).
``off``
    this checkout with defaults: no ``--server-timing`` (the watchdog runs with its
    default bound); wrk sends no timing header.
``on``
    ``--server-timing``, and every wrk request asks (``x-pdserve-server-timing: 1``):
    each response carries its ``Server-Timing`` header.
``nowatch``
    ``--instance-hang-timeout 0``: no watchdog at all.

Goals: ``off`` within noise of ``before``; ``on`` at most 5% fewer requests/s than
``off``. Medians over rounds, with each round's ``on/off`` and ``off/before`` ratios.

Usage::

    .venv/bin/python benchmarks/bench_server_timing.py            # 4 rounds x 4 servers, ~3.5 min
    .venv/bin/python benchmarks/bench_server_timing.py --repeats 6 --duration 8
    .venv/bin/python benchmarks/bench_server_timing.py --side-by-side --repeats 6 --duration 4

``--side-by-side`` measures pairs at the same time instead (``side_by_side.py``): ``on``
against ``off``, ``off`` against ``before`` and ``nowatch``, and ``off`` against a
second ``off`` (the method's own spread).

Writes ``benchmarks/out/bench_server_timing.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_frontend as bf
import side_by_side as sbs
from bench_peers import OUT, machine
from common import ROOT, cli_parser

SERVERS = ("before", "off", "on", "nowatch")
bf.PDSERVE_FLAGS.update(
    {"off": [], "on": ["--server-timing"], "nowatch": ["--instance-hang-timeout", "0"]}
)


def timed_lua(body: Path) -> Path:
    """wrk's script for ``on``: the same body, asking for Server-Timing."""
    lua = OUT / "server_timing_post.lua"
    lua.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        'wrk.headers["x-pdserve-server-timing"] = "1"\n'
        f'local f = io.open("{body}", "rb")\n'
        'wrk.body = f:read("*all")\n'
        "f:close()\n"
    )
    return lua


def baseline_checkout(ref: str) -> Path:
    """``git archive ref`` unpacked under benchmarks/out (its examples are not needed:
    the model repository is built from this checkout)."""
    dst = OUT / "server_timing_base"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", ref, "pdserve"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
    return dst


def one_round(args: argparse.Namespace, name: str, repo: Path, lua: Path) -> dict[str, Any]:
    """Start ``name``, warm it, measure one wrk point, stop it."""
    server = "baseline" if name == "before" else name
    proc, base, _ = bf.start_server(args, server, repo)
    try:
        args.lua = lua
        warm = bf.wrk_cmd(args, base, args.concurrency[0], args.warmup)
        subprocess.run(["taskset", "-c", args.client_cpu, *warm], capture_output=True, timeout=90)
        r = bf.wrk_point(args, proc, base, args.concurrency[0])
        if name == "on":  # the header really is there
            check = subprocess.run(
                ["curl", "-s", "-i", "-H", "x-pdserve-server-timing: 1", "--data-binary",
                 f"@{args.body}", base + "/v2/models/tiny/infer"],
                capture_output=True, text=True, timeout=30,
            ).stdout  # fmt: skip
            r["server_timing_header"] = next(
                (h.split(":", 1)[1].strip() for h in check.splitlines()
                 if h.lower().startswith("server-timing:")), None,
            )  # fmt: skip
    finally:
        bf.stop(proc)
    print(
        f"  {name}: {r['rps']} req/s p50 {r['p50_ms']} p99 {r['p99_ms']} ms, "
        f"{r['cpu_us_per_request']} CPU-us/req, errors {r.get('errors', 0)}",
        file=sys.stderr,
        flush=True,
    )
    return r


#: ``--side-by-side`` comparisons (a, b): the goals' pairs and an A/A pair whose spread
#: is the method's own noise.
PAIRS = (("off", "off2"), ("off", "on"), ("before", "off"), ("off", "nowatch"))


def side_by_side_results(
    args: argparse.Namespace, repo: Path, plain: Path, timed: Path, servers: list[str]
) -> list[dict[str, Any]]:
    """``--side-by-side``: each pair of :data:`PAIRS` whose servers are both in
    ``servers`` (``off2`` is a second ``off``) measured at the same time."""
    bf.PDSERVE_FLAGS["off2"] = []
    procs: dict[str, Any] = {}

    def start(name: str) -> tuple[int, str]:
        proc, base, _ = bf.start_server(args, "baseline" if name == "before" else name, repo)
        procs[name] = proc
        return proc.proc.pid, base

    def stop(name: str) -> None:
        bf.stop(procs.pop(name))

    luas = {n: timed if n == "on" else plain for n in ("off", "off2", "on", "before", "nowatch")}
    args.concurrency = args.concurrency[0]
    pairs = [p for p in PAIRS if all(n.removesuffix("2") in servers for n in p)]
    return [sbs.compare(args, a, b, start, stop, luas, args.repeats) for a, b in pairs]


def summary(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Median req/s per server and the per-round ratios on/off, off/before, nowatch/off."""
    out: dict[str, Any] = {}
    for name, runs in rounds.items():
        rps = [r["rps"] for r in runs if "rps" in r]
        cpu = [r["cpu_us_per_request"] for r in runs if r.get("cpu_us_per_request")]
        out[name] = {
            "rps_median": round(statistics.median(rps), 1) if rps else None,
            "rps": [round(x, 1) for x in rps],
            "cpu_us_median": round(statistics.median(cpu), 1) if cpu else None,
        }
    for a, b in (("on", "off"), ("off", "before"), ("nowatch", "off")):
        pairs = [
            round(x["rps"] / y["rps"], 3)
            for x, y in zip(rounds.get(a, []), rounds.get(b, []), strict=False)
            if "rps" in x and "rps" in y
        ]
        out[f"{a}/{b}"] = {
            "per_round": pairs,
            "median": round(statistics.median(pairs), 3) if pairs else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, write the JSON, print the table."""
    p = cli_parser(__doc__, __file__)
    p.add_argument("--servers", default=",".join(SERVERS), help="comma list (default all)")
    p.add_argument("--concurrency", type=int, default=32, help="wrk -c (default 32)")
    p.add_argument("--duration", type=float, default=6.0, help="seconds per point (default 6)")
    p.add_argument("--warmup", type=float, default=1.0, help="wrk seconds first (default 1)")
    p.add_argument("--repeats", type=int, default=4, help="rounds (default 4)")
    p.add_argument("--server-cpu", default="0", help="taskset cores of the server (default 0)")
    p.add_argument("--client-cpu", default="1", help="taskset cores of wrk (default 1)")
    p.add_argument("--baseline", default=None, help="checkout run as 'before' (default: archive)")
    p.add_argument(
        "--base-ref",
        default=None,
        help="git ref archived as 'before' (default: merge-base HEAD main)",
    )
    p.add_argument(
        "--side-by-side",
        action="store_true",
        help="measure each pair of servers at the same time on the server core "
        "(benchmarks/side_by_side.py): steady ratios on a noisy machine",
    )
    sbs.add_arguments(p)
    p.add_argument("--out", type=Path, default=OUT / "bench_server_timing.json")
    args = p.parse_args(argv)
    servers = [s for s in args.servers.split(",") if s]
    args.concurrency = [args.concurrency]
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        raise SystemExit("wrk and taskset are needed (apt-get install wrk util-linux)")
    if "before" in servers and args.baseline is None:
        ref = args.base_ref or subprocess.run(
            ["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True, text=True,
            check=True,
        ).stdout.strip()  # fmt: skip
        args.baseline = str(baseline_checkout(ref))
    repo = bf.build_repo()
    args.body, plain, _ = bf.write_body()
    lua = {name: timed_lua(args.body) if name == "on" else plain for name in servers}
    if args.side_by_side:
        results = side_by_side_results(args, repo, plain, timed_lua(args.body), servers)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"machine": machine(), "side_by_side": results}, indent=2, default=str)
        )
        print(sbs.markdown(results))
        return 0
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    load_before = [round(x, 2) for x in os.getloadavg()]
    start = time.monotonic()
    for rep in range(args.repeats):
        print(f"== round {rep}", file=sys.stderr, flush=True)
        order = servers if rep % 2 == 0 else servers[::-1]  # alternate who goes first
        for name in order:
            try:
                rounds[name].append(one_round(args, name, repo, lua[name]))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"  {name} failed: {e}", file=sys.stderr, flush=True)
                rounds[name].append({"error": str(e)[:500]})
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.monotonic() - start, 1),
        "concurrency": args.concurrency[0],
        "duration": args.duration,
        "repeats": args.repeats,
        "rounds": rounds,
        "summary": summary(rounds),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    s = result["summary"]
    print("| server | req/s (median) | req/s per round | CPU-us/req |")
    print("|---|---|---|---|")
    for name in servers:
        e = s[name]
        print(f"| {name} | {e['rps_median']} | {e['rps']} | {e['cpu_us_median']} |")
    for key in ("on/off", "off/before", "nowatch/off"):
        print(f"\n{key}: median {s[key]['median']}, per round {s[key]['per_round']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
