"""Two servers measured at the same time: the noise of a shared machine hits both alike.

Both servers run pinned to the same core (``--server-cpu``), each loaded by its own
``wrk -t1`` on the client core at once, for ``rounds`` points (after one warm-up point).
Each point gives each server's requests/s, p99 and server CPU-microseconds per request;
the ratios b/a of one point are taken under the same moment's machine, so they stay
steady while the absolute figures swing with the machine's other tenants. The CPU ratio
is the cost ratio; the requests/s ratio is it too when both servers run one busy thread
each (the scheduler splits the core between runnable threads, so a server with a second
busy thread, a payload-log writer, gets more of the core than its cost says).

``bench_server_timing.py --side-by-side`` and ``bench_monitoring.py --side-by-side`` use it;
run alone, it checks the method on this machine: two identical pdserve servers (the
example ``tiny``, one-row V2 JSON, c=32), whose ratios should stay near 1.

Usage::

    .venv/bin/python benchmarks/side_by_side.py --repeats 6 --duration 4
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import cli_parser, tree_cpu_seconds, wrk_latency_ms

#: (process id, HTTP base URL) of a started server.
Started = tuple[int, str]


def _wrk(args: argparse.Namespace, base: str, lua: Path, seconds: float) -> subprocess.Popen[str]:
    cmd = [
        "taskset", "-c", args.client_cpu, "wrk", "-t1", f"-c{args.concurrency}",
        f"-d{seconds:g}s", "--latency", "-s", str(lua), base + "/v2/models/tiny/infer",
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def point(
    args: argparse.Namespace, servers: dict[str, Started], luas: dict[str, Path], seconds: float
) -> dict[str, dict[str, Any]]:
    """One simultaneous point: per server req/s, p99 ms, errors, CPU-us per request.

    Raises:
        RuntimeError: a wrk run failed.
    """
    cpu0 = {n: tree_cpu_seconds(pid) for n, (pid, _) in servers.items()}
    runs = {n: _wrk(args, base, luas[n], seconds) for n, (_, base) in servers.items()}
    out: dict[str, dict[str, Any]] = {}
    for n, proc in runs.items():
        text, err = proc.communicate(timeout=seconds * 4 + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"wrk against {n} failed: {err[-500:]}")
        done = re.search(r"(\d+) requests in", text)
        rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
        non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
        out[n] = {
            "rps": float(rps.group(1)) if rps else 0.0,
            "p99_ms": wrk_latency_ms(text, "99%"),
            "errors": int(non2xx.group(1)) if non2xx else 0,
            "requests": int(done.group(1)) if done else 0,
        }
    for n, (pid, _) in servers.items():
        cpu = tree_cpu_seconds(pid) - cpu0[n]
        reqs = out[n]["requests"]
        out[n]["cpu_us_per_request"] = round(cpu / reqs * 1e6, 1) if reqs else None
    return out


def compare(
    args: argparse.Namespace,
    a: str,
    b: str,
    start: Callable[[str], Started],
    stop: Callable[[str], None],
    luas: dict[str, Path],
    rounds: int,
) -> dict[str, Any]:
    """``rounds`` points of ``a`` and ``b`` side by side: on ``args.pairs`` fresh pairs of
    processes (``start(name)``, in turn ``a`` first and ``b`` first; each pair one warm-up
    point, then its share of the points, then ``stop``), the wrk runs launched in turn
    ``a`` first and ``b`` first. A process's own layout (hash seed, addresses) moves its
    cost by a percent or two for its whole life: fresh pairs spread that over both sides.
    Per-point figures and the b/a ratios' medians and ranges."""
    pairs = max(1, min(getattr(args, "pairs", 1), rounds))
    points: list[dict[str, dict[str, Any]]] = []
    for j in range(pairs):
        order = [a, b] if j % 2 == 0 else [b, a]
        servers: dict[str, Started] = {}
        try:
            for n in order:
                servers[n] = start(n)
            point(args, servers, luas, args.warmup)
            for i in range(rounds * (j + 1) // pairs - rounds * j // pairs):
                turn = dict(servers) if i % 2 == 0 else dict(reversed(servers.items()))
                points.append(point(args, turn, luas, args.duration))
                p = points[-1]
                print(
                    f"  {a} vs {b} #{len(points)} (pair {j + 1}): "
                    + ", ".join(
                        f"{n} {p[n]['rps']:.0f} req/s {p[n]['cpu_us_per_request']} CPU-us/req"
                        for n in (a, b)
                    ),
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            for n in servers:
                stop(n)
    return {"a": a, "b": b, "points": points, **ratios(points, a, b)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--pairs`` option of a benchmark that uses :func:`compare`."""
    p.add_argument(
        "--pairs",
        type=int,
        default=4,
        help="fresh server processes per comparison, the points split among them (default 4)",
    )


def ratios(points: list[dict[str, dict[str, Any]]], a: str, b: str) -> dict[str, Any]:
    """Median and range over points of b/a for req/s, CPU per request and p99."""
    out: dict[str, Any] = {}
    for key, stat in (("rps", "rps"), ("cpu", "cpu_us_per_request"), ("p99", "p99_ms")):
        xs = [
            p[b][stat] / p[a][stat] for p in points if p[a].get(stat) and p[b].get(stat) is not None
        ]
        if xs:
            out[key] = {
                "median": round(statistics.median(xs), 3),
                "range": [round(min(xs), 3), round(max(xs), 3)],
            }
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    """The comparisons as a Markdown table (b/a: median (range))."""

    def cell(r: dict[str, Any], key: str) -> str:
        m = r.get(key)
        return f"{m['median']:.3f} ({m['range'][0]:.3f}-{m['range'][1]:.3f})" if m else ""

    lines = [
        "| b vs a | points | req/s b/a | CPU-us/req b/a | p99 b/a |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['b']} vs {r['a']} | {len(r['points'])} | {cell(r, 'rps')} "
            f"| {cell(r, 'cpu')} | {cell(r, 'p99')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The A/A check: two identical servers side by side; print the table."""
    import bench_frontend as bf

    p = cli_parser(__doc__, __file__)
    p.add_argument("--repeats", type=int, default=6, help="points (default 6)")
    p.add_argument("--duration", type=float, default=4.0, help="seconds per point (default 4)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of the warm-up point")
    p.add_argument("--concurrency", type=int, default=32, help="wrk -c (default 32)")
    p.add_argument("--server-cpu", default="0", help="taskset cores of the servers (default 0)")
    p.add_argument("--client-cpu", default="1", help="taskset cores of wrk (default 1)")
    add_arguments(p)
    args = p.parse_args(argv)
    repo = bf.build_repo()
    _, lua, _ = bf.write_body()
    procs: dict[str, Any] = {}

    def start(name: str) -> Started:
        proc, base, _ = bf.start_server(args, "pdserve", repo)
        procs[name] = proc
        return proc.proc.pid, base

    def stop(name: str) -> None:
        bf.stop(procs.pop(name))

    result = compare(args, "a", "b", start, stop, {"a": lua, "b": lua}, args.repeats)
    print(markdown([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
