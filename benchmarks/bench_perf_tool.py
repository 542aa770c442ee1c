"""``pdserve perf`` as a load client: against wrk (client cost on one core) and
against Triton's perf_analyzer (the same points, the same server) — issue 13.

pdserve serves the example ``tiny`` model (64 FP32 in, 64 out, no dynamic
batching) pinned to core 0 (``taskset -c 0``); every client runs pinned to core 1.

1. **Client vs wrk.** The same V2 JSON body of one row, closed loop, concurrency
   1 and 32: ``wrk -t1 -cC -dDs --latency -s post.lua`` (ANCHORS.md's method),
   ``pdserve perf --workers 1 --input-tensor-format json --output-tensor-format
   json`` and perf_analyzer (JSON too). Reported: requests/s (the server's
   success-count delta over the client's whole run, divided by its wall time,
   and the tool's own figure), p50/p99, and the client's CPU time per request
   (``getrusage`` of the client process tree, start-up included).
2. **pdserve perf vs perf_analyzer**, HTTP (binary tensors, both tools' default)
   and gRPC (pdserve perf's raw HTTP/2 client and its grpcio one), concurrency 1,
   4 and 16, the same windows and stability settings: each tool's reported
   throughput and p50, and the ratios (medians of ``--repeats`` runs; the tools
   alternate per point so drift hits both).
3. ``--only triton``: both tools against real Triton 2.51 (nvidia-pytriton's
   tritonserver, the python backend running the same ONNX model), HTTP and gRPC.

Usage::

    make bench-perf-tool     # installs wrk and benchmarks/.venvs/perf_analyzer first
    .venv/bin/python benchmarks/bench_perf_tool.py [--duration 8] [--interval-ms 2000]

Writes ``benchmarks/out/perf_tool.json`` and prints the markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    PY,
    REPO,
    ROOT,
    cli_parser,
    free_port,
    parse_pa_csv,
    perf_analyzer_command,
    start_logged_server,
    success_count,
    taskset,
    tiny_repo,
    wait_ready,
)

PA_VENV = ROOT / "benchmarks" / ".venvs" / "perf_analyzer"
OUT = ROOT / "benchmarks" / "out" / "perf_tool.json"


def measured(cmd: list[str], http_port: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a client pinned to core 1; its wall time, CPU time (whole process tree),
    the requests the server completed meanwhile, and its output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    n0 = success_count(http_port)
    t0 = time.monotonic()
    out = subprocess.run(
        [*taskset("1"), *cmd],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    wall = time.monotonic() - t0
    n = success_count(http_port) - n0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "rc": out.returncode,
        "stdout": out.stdout,
        "stderr": out.stderr[-2000:],
        "wall_s": round(wall, 2),
        "server_requests": n,
        "server_rps": round(n / wall, 1),
        "cpu_s": round(cpu, 3),
        "cpu_us_per_request": round(cpu / n * 1e6, 1) if n else None,
    }


def start_pdserve(tmp: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    """pdserve on a repository holding only ``tiny``, pinned to core 0."""
    return start_logged_server(tiny_repo(tmp), tmp / "pdserve.log", core="0")


def json_body(tmp: Path) -> Path:
    """The V2 JSON body of one random row, as ``pdserve perf --input-tensor-format
    json`` builds it (so every client sends the same bytes)."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from pdserve.app.perf.inputs import ModelSpec, TensorSpec, encode_http

    spec = ModelSpec("tiny", "", 128, [TensorSpec("INPUT0", "FP32", [64])], ["OUTPUT0"])
    row = np.random.default_rng(0).random((1, 64)).astype(np.float32)
    body = encode_http(spec, {"INPUT0": row}, "", "json", "json").body
    path = tmp / "body.json"
    path.write_bytes(body)
    lua = tmp / "post.lua"
    lua.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'local f = io.open("{path}", "rb")\n'
        'wrk.body = f:read("*all")\n'
        "f:close()\n"
    )
    data = tmp / "data.json"
    data.write_text(json.dumps({"data": [{"INPUT0": row.reshape(-1).tolist()}]}))
    return tmp


def parse_wrk(text: str) -> dict[str, float | None]:
    """Requests/sec, p50 and p99 (ms) from ``wrk --latency`` output."""

    def ms(label: str) -> float | None:
        m = re.search(rf"^\s+{label}\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        if not m:
            return None
        scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]
        return round(float(m.group(1)) * scale, 3)

    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    return {"rps": float(rps.group(1)) if rps else None, "p50_ms": ms("50%"), "p99_ms": ms("99%")}


def parse_pdserve_perf(path: Path) -> dict[str, float | None]:
    """Throughput and p50/p99 (ms) of the last level in a ``pdserve perf --json`` file."""
    try:
        res = json.loads(path.read_text())["results"][-1]
    except (OSError, ValueError, IndexError, KeyError):
        return {
            "client_cpu_us_per_request_steady": None,
            "rps": None,
            "p50_ms": None,
            "p99_ms": None,
            "stable": None,
        }
    lat = res["latency_us"]
    return {
        "client_cpu_us_per_request_steady": round(res["client_cpu_us_per_request"], 1),
        "rps": round(res["infer_per_sec"], 1),
        "p50_ms": round(lat["p50"] / 1000, 3) if "p50" in lat else None,
        "p99_ms": round(lat["p99"] / 1000, 3) if "p99" in lat else None,
        "stable": res["stable"],
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median of the runs' numbers (None ignored); ``runs`` keeps all."""
    out: dict[str, Any] = {"runs": runs}
    for key in runs[0]:
        values = [r[key] for r in runs if isinstance(r.get(key), int | float)]
        if values and not isinstance(runs[0][key], bool):
            out[key] = round(statistics.median(values), 3)
        elif key not in ("stdout", "stderr"):
            out[key] = runs[-1][key]
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded, None when either is missing."""
    return round(a / b, 2) if a and b else None


def section_wrk(args: argparse.Namespace, tmp: Path, http_port: int) -> list[dict[str, Any]]:
    """Client vs wrk (and perf_analyzer), JSON body, one core."""
    pa, pa_env = perf_analyzer_command(PA_VENV)
    url = f"127.0.0.1:{http_port}"
    interval = int(args.duration * 1000 / 3)
    rows = []
    for c in args.wrk_concurrency:
        runs: dict[str, list[dict[str, Any]]] = {"wrk": [], "mine": [], "theirs": []}
        for rep in range(args.repeats):
            wrk = measured(
                ["wrk", "-t1", f"-c{c}", f"-d{args.duration:g}s", "--latency", "-s",
                 str(tmp / "post.lua"), f"http://{url}/v2/models/tiny/infer"],
                http_port,
            )  # fmt: skip
            wrk.update(parse_wrk(wrk.pop("stdout")))
            out = tmp / f"wrk_pdserve_{c}_{rep}.json"
            mine = measured(
                [PY, "-m", "pdserve", "perf", "-m", "tiny", "-u", url,
                 "--concurrency-range", str(c), "-p", str(interval), "-r", "3", "-s", "1000",
                 "--workers", "1", "--input-tensor-format", "json",
                 "--output-tensor-format", "json", "-q", "--json", str(out)],
                http_port,
            )  # fmt: skip
            mine.pop("stdout")
            mine.update(parse_pdserve_perf(out))
            pa_csv = tmp / f"wrk_pa_{c}_{rep}.csv"
            theirs = measured(
                [*pa, "-m", "tiny", "-u", url, "-i", "http", "--concurrency-range", str(c),
                 "-p", str(interval), "-r", "3", "-s", "1000",
                 "--input-data", str(tmp / "data.json"), "--input-tensor-format", "json",
                 "--output-tensor-format", "json", "-f", str(pa_csv)],
                http_port,
                pa_env,
            )  # fmt: skip
            theirs.pop("stdout")
            theirs.update(parse_pa_csv(pa_csv))
            runs["wrk"].append(wrk)
            runs["mine"].append(mine)
            runs["theirs"].append(theirs)
        wrk, mine, theirs = (median_of(runs[k]) for k in ("wrk", "mine", "theirs"))
        row = {
            "concurrency": c,
            "wrk": wrk,
            "pdserve_perf": mine,
            "perf_analyzer": theirs,
            "rps_ratio_vs_wrk": ratio(mine["rps"], wrk["rps"]),
            "server_rps_ratio_vs_wrk": ratio(mine["server_rps"], wrk["server_rps"]),
        }
        print(
            f"wrk c={c}: wrk {wrk['rps']} req/s ({wrk['cpu_us_per_request']} us CPU/req) | "
            f"pdserve perf {mine['rps']} ({mine['cpu_us_per_request']}, steady "
            f"{mine['client_cpu_us_per_request_steady']}) | perf_analyzer {theirs['rps']} "
            f"({theirs['cpu_us_per_request']})",
            flush=True,
        )
        rows.append(row)
    return rows


def section_pa(
    args: argparse.Namespace, tmp: Path, http_port: int, grpc_port: int, prefix: str = ""
) -> list[dict[str, Any]]:
    """The same points through perf_analyzer and pdserve perf (default formats)."""
    pa, pa_env = perf_analyzer_command(PA_VENV)
    rows = []
    common = ["-p", str(args.interval_ms), "-r", str(args.max_trials), "-s", str(args.stability)]
    for proto, port in (("http", http_port), ("grpc", grpc_port)):
        for c in args.pa_concurrency:
            url = f"127.0.0.1:{port}"
            clients = ["raw", "grpcio"] if proto == "grpc" else ["raw"]
            runs: dict[str, list[dict[str, Any]]] = {"pa": [], **{k: [] for k in clients}}
            for rep in range(args.repeats):
                pa_csv = tmp / f"{prefix}pa_{proto}_{c}_{rep}.csv"
                theirs = measured(
                    [*pa, "-m", "tiny", "-u", url, "-i", proto, "--concurrency-range", str(c),
                     *common, "-f", str(pa_csv)],
                    http_port,
                    pa_env,
                )  # fmt: skip
                theirs.pop("stdout")
                theirs.update(parse_pa_csv(pa_csv))
                runs["pa"].append(theirs)
                for client in clients:
                    out = tmp / f"{prefix}pd_{proto}_{c}_{client}_{rep}.json"
                    mine = measured(
                        [PY, "-m", "pdserve", "perf", "-m", "tiny", "-u", url, "-i", proto,
                         "--grpc-client", client, "--concurrency-range", str(c), *common,
                         "-q", "--json", str(out)],
                        http_port,
                    )  # fmt: skip
                    mine.pop("stdout")
                    mine.update(parse_pdserve_perf(out))
                    runs[client].append(mine)
            theirs = median_of(runs["pa"])
            row: dict[str, Any] = {"protocol": proto, "concurrency": c, "perf_analyzer": theirs}
            for client in clients:
                mine = median_of(runs[client])
                key = "pdserve_perf" if client == "raw" else "pdserve_perf_grpcio"
                row[key] = mine
                row[f"{key}_throughput_ratio"] = ratio(mine["rps"], theirs["rps"])
                row[f"{key}_p50_ratio"] = ratio(mine["p50_ms"], theirs["p50_ms"])
                print(
                    f"{prefix}{proto} c={c} ({client}): perf_analyzer {theirs['rps']} infer/s p50 "
                    f"{theirs['p50_ms']} ms | pdserve perf {mine['rps']} infer/s p50 "
                    f"{mine['p50_ms']} ms | ratios {row[f'{key}_throughput_ratio']} / "
                    f"{row[f'{key}_p50_ratio']}",
                    flush=True,
                )
            rows.append(row)
    return rows


TRITON_VENV = ROOT / "benchmarks" / ".venvs" / "triton"
TRITON_REQUIREMENTS = ["nvidia-pytriton==0.7.0", "onnxruntime==1.32.0", "numpy<2"]


def start_triton(tmp: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    """Real Triton 2.51 (nvidia-pytriton's tritonserver, python backend only) serving
    ``tiny`` through ``peers/triton_model.py`` (no dynamic batching: one request per
    execution, like pdserve's ``tiny``), pinned to core 0; its venv
    (``benchmarks/.venvs/triton``, as bench_peers.py makes it) is created if missing."""
    from common import tritonserver_command

    py = TRITON_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TRITON_VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *TRITON_REQUIREMENTS], check=True)
    repo = tmp / "triton_repo"
    (repo / "tiny" / "1").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "peers" / "triton_model.py", repo / "tiny" / "1" / "model.py")
    versions = sorted(int(p.name) for p in (REPO / "tiny").iterdir() if p.name.isdigit())
    onnx = REPO / "tiny" / str(versions[-1]) / "model.onnx"
    (repo / "tiny" / "config.pbtxt").write_text(
        'name: "tiny"\nbackend: "python"\nmax_batch_size: 32\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]\n'
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        f'parameters {{ key: "model_path" value {{ string_value: "{onnx}" }} }}\n'
    )
    http_port, grpc_port = free_port(), free_port()
    cmd, env = tritonserver_command(py, repo, http_port, tmp / "triton_backends", core="0")
    cmd = [a if not a.startswith("--grpc-port=") else f"--grpc-port={grpc_port}" for a in cmd]
    log = tmp / "triton.log"
    proc = subprocess.Popen(
        cmd,
        stdout=open(log, "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )
    wait_ready(proc, http_port, log, "tritonserver", 0.2, tail=3000)
    return proc, http_port, grpc_port


def section_triton(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Section 2's points against real Triton (HTTP and gRPC)."""
    server, http_port, grpc_port = start_triton(tmp)
    try:
        return section_pa(args, tmp, http_port, grpc_port, prefix="triton_")
    finally:
        server.terminate()
        server.wait(60)


def markdown(results: dict[str, Any]) -> str:
    """The tables for RESULTS.md (medians of the repeats)."""
    lines = [
        f"load average {results['load_before']} before, {results['load_after']} after; "
        f"medians of {results['repeats']} runs",
        "",
        "| c | client | req/s (tool) | req/s (server count / wall) | p50 ms | p99 ms "
        "| client CPU us/request (whole run) | (steady) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["wrk"]:
        for name in ("wrk", "pdserve_perf", "perf_analyzer"):
            r = row[name]
            lines.append(
                f"| {row['concurrency']} | {name.replace('_', ' ')} | {r['rps']} | "
                f"{r['server_rps']} | {r['p50_ms']} | {r['p99_ms']} | {r['cpu_us_per_request']} "
                f"| {r.get('client_cpu_us_per_request_steady', '')} |"
            )
        lines.append(
            f"| {row['concurrency']} | **pdserve perf / wrk** | **{row['rps_ratio_vs_wrk']}** | "
            f"{row['server_rps_ratio_vs_wrk']} | | | | |"
        )
    for title, key in (("pdserve", "perf_analyzer"), ("real Triton 2.51", "triton")):
        if not results.get(key):
            continue
        lines += [
            "",
            f"Against {title}:",
            "",
            "| protocol | c | client | perf_analyzer infer/s | pdserve perf infer/s | ratio | "
            "perf_analyzer p50 ms | pdserve perf p50 ms | ratio | pdserve perf client CPU us/req |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in results[key]:
            a = row["perf_analyzer"]
            for k, client in (("pdserve_perf", "raw"), ("pdserve_perf_grpcio", "grpcio")):
                if k not in row:
                    continue
                b = row[k]
                lines.append(
                    f"| {row['protocol']} | {row['concurrency']} | {client} | {a['rps']} | "
                    f"{b['rps']} | {row[f'{k}_throughput_ratio']} | {a['p50_ms']} | "
                    f"{b['p50_ms']} | {row[f'{k}_p50_ratio']} | "
                    f"{b['client_cpu_us_per_request_steady']} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run both sections and write ``benchmarks/out/perf_tool.json``."""
    p = cli_parser(__doc__, __file__)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per wrk point")
    p.add_argument(
        "--wrk-concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32]
    )
    p.add_argument(
        "--pa-concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16]
    )
    p.add_argument("--interval-ms", type=int, default=2000, help="measurement window, both tools")
    p.add_argument("--max-trials", type=int, default=6)
    p.add_argument("--stability", type=float, default=15.0, help="stability percentage, both tools")
    p.add_argument("--repeats", type=int, default=3, help="runs per point (medians reported)")
    p.add_argument(
        "--only",
        default="wrk,perf_analyzer",
        help="sections: wrk, perf_analyzer, triton (real Triton; creates benchmarks/.venvs/triton)",
    )
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if shutil.which("wrk") is None and "wrk" in args.only:
        raise SystemExit("wrk is missing: run `make bench-perf-tool` (apt-get install wrk)")
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "repeats": args.repeats,
        "wrk": [],
        "perf_analyzer": [],
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = json_body(Path(d))
        server, http_port, grpc_port = start_pdserve(tmp)
        try:
            if "wrk" in args.only:
                results["wrk"] = section_wrk(args, tmp, http_port)
            if "perf_analyzer" in args.only:
                results["perf_analyzer"] = section_pa(args, tmp, http_port, grpc_port)
        finally:
            server.terminate()
            server.wait(30)
        if "triton" in args.only:
            results["triton"] = section_triton(args, tmp)
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
