"""Model monitoring's cost on the request path: payload logging (off, 100% and 1% of
requests to JSON Lines on local disk, inputs and outputs), prediction metrics with
drift windows on versus off, and p99 with a stalled sink, on ``bench_frontend.py``'s
set-up (tiny ONNX model, one-row V2 JSON body, server pinned to core 0, ``wrk -t1``
on core 1, c=32).

Variants, each a repository whose ``tiny`` differs only in its monitoring parameters:

``off``
    no monitoring (``bench_frontend.py``'s repository as it is).
``log100`` / ``log1``
    ``payload_log`` ``sink=jsonl:DIR,rate=1`` (or ``rate=0.01``), ``record=all``,
    ``roll_secs=1`` (a file written every second during the run).
``predictions``
    ``prediction_metrics`` ``bins=0:10:40,range=0:5`` alone (histogram, out-of-range
    count): what the issue's "prediction metrics on" goal names.
``metrics``
    ``predictions`` plus ``drift`` ``reference=first:2000,window=10000`` (a drift window
    too).
``stalled``
    ``payload_log`` to a Kafka sink whose "broker" is a socket that accepts connections
    and never answers: the writer thread hangs in each send until its 5 s timeout, the
    queue fills and records are dropped and counted.

Variants are interleaved per round (``--repeats``, default 4) so drift on a loaded
machine hits all of them; medians are reported with the ratio of each variant's
requests/s, p99 and server CPU-seconds per request to ``off`` (on a shared machine the
CPU per request moves least). The payload log's counters are read from ``/metrics``
after each run (written / dropped per sampled request).

Usage::

    .venv/bin/python benchmarks/bench_monitoring.py --repeats 4 --duration 5
    .venv/bin/python benchmarks/bench_monitoring.py --side-by-side --repeats 6 --duration 4

``--side-by-side`` runs ``off`` and one variant at a time together on the server core
(``side_by_side.py``), plus ``off`` against a second ``off``: on a noisy machine their
ratios hold still where separate runs' do not. The payload-log writer is a second busy
thread, which the scheduler gives its share of the core: there the CPU per request
ratio is the variant's cost, the requests/s ratio flatters it.

Writes ``benchmarks/out/bench_monitoring.json`` (``--out``) and prints a Markdown table.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import side_by_side as sbs
from bench_frontend import build_repo, distinct_ports, stop, write_body, wrk_cmd, wrk_point
from bench_peers import OUT, Proc, machine
from common import ROOT, cli_parser, pdserve_command

VARIANTS = ("off", "log100", "log1", "predictions", "metrics", "stalled")


def _param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'


def variant_repo(base: Path, name: str, stall_port: int) -> Path:
    """A copy of ``base`` whose ``tiny`` has variant ``name``'s monitoring parameters."""
    repo = OUT / f"monitoring_repo_{name}"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(base, repo)
    logs = OUT / f"monitoring_logs_{name}"
    shutil.rmtree(logs, ignore_errors=True)
    extra = {
        "off": "",
        "log100": _param("payload_log", f"sink=jsonl:{logs},rate=1,record=all,roll_secs=1"),
        "log1": _param("payload_log", f"sink=jsonl:{logs},rate=0.01,record=all,roll_secs=1"),
        "predictions": _param("prediction_metrics", "bins=0:10:40,range=0:5"),
        "metrics": _param("prediction_metrics", "bins=0:10:40,range=0:5")
        + _param("drift", "reference=first:2000,window=10000"),
        "stalled": _param("payload_log", f"sink=kafka://127.0.0.1:{stall_port}/t,queue=1000"),
    }[name]
    config = repo / "tiny" / "config.pbtxt"
    config.write_text(config.read_text() + extra)
    return repo


@contextlib.contextmanager
def stalled_broker() -> Iterator[int]:
    """A listening socket that never accepts: connections open, nothing answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1024)
        yield s.getsockname()[1]


def payload_counts(metrics_port: int) -> dict[str, float]:
    """sampled / written / dropped of ``tiny``'s payload log (empty: no payload log)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for key in ("sampled", "written", "dropped"):
            if line.startswith(f"pdserve_payload_log_{key}_total{{") and 'model="tiny"' in line:
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run_variant(args: Any, name: str, repo: Path) -> dict[str, Any]:
    http, grpc, metrics = distinct_ports(3)
    cmd = pdserve_command(repo, http, grpc, metrics, core=args.server_cpu)
    proc = Proc(f"monitoring_{name}", cmd, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    base = f"http://127.0.0.1:{http}"
    try:
        proc.wait_ready(base + "/v2/health/ready")
        if args.warmup > 0:
            subprocess.run(
                ["taskset", "-c", args.client_cpu, *wrk_cmd(args, base, args.concurrency, args.warmup)],
                capture_output=True, timeout=args.warmup + 60,
            )  # fmt: skip
        r = wrk_point(args, proc, base, args.concurrency)
        r["payload_log"] = payload_counts(metrics)
    finally:
        stop(proc)
    print(
        f"  {name}: {r['rps']} req/s p50 {r['p50_ms']} p99 {r['p99_ms']} ms, "
        f"{r['cpu_us_per_request']} CPU-us/req, errors {r.get('errors', 0)}, log {r['payload_log']}",
        file=sys.stderr,
        flush=True,
    )
    return r


def side_by_side_results(args: Any, names: list[str], repos: dict[str, Path]) -> list[dict]:
    """``--side-by-side``: ``off`` against a second ``off`` (the method's own spread) and
    against each variant, measured at the same time (``side_by_side.py``)."""
    procs: dict[str, Proc] = {}

    def start(name: str) -> tuple[int, str]:
        http, grpc, metrics = distinct_ports(3)
        repo = repos["off" if name == "off2" else name]
        cmd = pdserve_command(repo, http, grpc, metrics, core=args.server_cpu)
        proc = Proc(f"monitoring_{name}", cmd, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
        procs[name] = proc
        base = f"http://127.0.0.1:{http}"
        proc.wait_ready(base + "/v2/health/ready")
        return proc.proc.pid, base

    def stop_one(name: str) -> None:
        stop(procs.pop(name))

    luas = {n: args.lua for n in ["off", "off2", *names]}
    pairs = [("off", "off2"), *(("off", n) for n in names if n != "off")]
    return [sbs.compare(args, a, b, start, stop_one, luas, args.repeats) for a, b in pairs]


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds if name in r]
        keys = ("rps", "p50_ms", "p99_ms", "cpu_us_per_request")
        med = {k: statistics.median(float(x[k]) for x in runs) for k in keys}
        med["rps_range"] = [min(float(x["rps"]) for x in runs), max(float(x["rps"]) for x in runs)]
        out[name] = med
    off = out.get("off")
    for name, med in out.items():
        if off:
            med["rps_ratio"] = round(med["rps"] / off["rps"], 3)
            med["p99_ratio"] = round(med["p99_ms"] / off["p99_ms"], 3)
            med["cpu_ratio"] = round(med["cpu_us_per_request"] / off["cpu_us_per_request"], 3)
            # per-round ratios against the same round's off: their spread is the noise
            med["rps_ratio_rounds"] = [
                round(float(r[name]["rps"]) / float(r["off"]["rps"]), 3)
                for r in rounds
                if name in r
            ]
    return out


def markdown(summary: dict[str, dict[str, Any]], rounds: int, args: Any) -> str:
    lines = [
        f"c={args.concurrency}, {args.duration:g} s per run, {rounds} alternated rounds, medians",
        "",
        "| variant | req/s | x off | per-round x off | p50 ms | p99 ms | p99 x off "
        "| server CPU-us/req | x off |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in summary.items():
        lines.append(
            f"| {name} | {m['rps']:.0f} | {m.get('rps_ratio', '')} | "
            f"{m.get('rps_ratio_rounds', '')} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
            f"{m.get('p99_ratio', '')} | {m['cpu_us_per_request']:.1f} | {m.get('cpu_ratio', '')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma list from {', '.join(VARIANTS)}"
    )
    p.add_argument("--concurrency", type=int, default=32, help="wrk -c (default 32)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per run (default 5)")
    p.add_argument(
        "--warmup", type=float, default=1.0, help="wrk seconds after each start (default 1)"
    )
    p.add_argument("--repeats", type=int, default=4, help="alternated rounds (default 4)")
    p.add_argument("--server-cpu", default="0", help="taskset cores of the server (default 0)")
    p.add_argument("--client-cpu", default="1", help="taskset cores of wrk (default 1)")
    p.add_argument(
        "--side-by-side",
        action="store_true",
        help="measure off and each variant at the same time on the server core "
        "(benchmarks/side_by_side.py): steady ratios on a noisy machine",
    )
    sbs.add_arguments(p)
    p.add_argument(
        "--out", type=Path, default=OUT / "bench_monitoring.json", help="JSON of every round"
    )
    args = p.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if bad := [v for v in names if v not in VARIANTS]:
        p.error(f"unknown variant(s) {bad}; choose from {VARIANTS}")
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        raise SystemExit("wrk and taskset are needed (apt-get install wrk util-linux)")
    base = build_repo()
    _, args.lua, _ = write_body()
    rounds: list[dict[str, dict[str, Any]]] = []
    with stalled_broker() as stall_port:
        repos = {n: variant_repo(base, n, stall_port) for n in {"off", *names}}
        if args.side_by_side:
            results = side_by_side_results(args, names, repos)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(
                json.dumps({"machine": machine(), "side_by_side": results}, indent=1)
            )
            print(sbs.markdown(results))
            return 0
        for rep in range(args.repeats):
            print(f"round {rep + 1}/{args.repeats}", file=sys.stderr, flush=True)
            order = names if rep % 2 == 0 else list(reversed(names))
            rounds.append({n: run_variant(args, n, repos[n]) for n in order})
    summary = summarise([{n: r[n] for n in names} for r in rounds])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"machine": machine(), "rounds": rounds, "summary": summary}, indent=1, default=str
        )
    )
    print(markdown(summary, len(rounds), args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
