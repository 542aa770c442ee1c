"""Issue 11 benchmark: pdserve's front ends (native HTTP, ASGI, ``--http-workers 2``,
gRPC) against real Triton 2.51, measured with ``wrk``.

The set-up is the issue's table: the example ``tiny`` ONNX model (64 -> 64 FP32,
ONNX Runtime with 1 intra-op thread, ``max_batch_size: 32``, ``dynamic_batching {
max_queue_delay_microseconds: 2000 }``), a one-row KServe V2 JSON body, each server
on 127.0.0.1 pinned to core 0 (``taskset -c 0``, child processes included) and
``taskset -c 1 wrk -t1 -cC -dDs --latency -s post.lua`` on core 1. Servers
(``--servers``, comma list):

``triton``
    real Triton 2.51 (nvidia-pytriton's ``tritonserver``, python backend only, so
    ``peers/triton_model.py`` runs the same ONNX file in ONNX Runtime; the same
    batching settings); its venv is ``--triton-venv`` (``bench_peers.py`` makes one).
``pdserve``
    ``pdserve serve`` with no front-end flag (whatever the checkout's default is).
``asgi`` / ``native``
    ``pdserve serve --http-server asgi|native``.
``workers2``
    ``pdserve serve --http-workers 2`` pinned to cores 0 and 1 (``taskset -c 0,1``);
    wrk still runs on core 1, so it shares that core with the server: compare
    CPU-seconds per request first, then requests/s.
``grpc``
    pdserve's gRPC port driven by ``perf_analyzer -i grpc`` (``--pa-venv``; ``make
    bench-perf-tool`` makes it) or by ``pdserve perf -i grpc`` (``--grpc-tool``) at
    the same concurrency, compared with pdserve's HTTP (``native``, else ``pdserve``).
``grpc_h2``
    pdserve's gRPC port driven by ``h2load`` (nghttp2's C load generator, Debian's
    ``nghttp2-client``: the HTTP/2 counterpart of wrk, so the client is not the
    ceiling): one connection with C concurrent streams (``-c 1 -m C``, as a grpc
    channel carries perf_analyzer's C calls), each POSTing the same ``ModelInferRequest``
    (one row of 64 FP32 as ``raw_input_contents``) to ``ModelInfer``; 1 s of warm-up
    (``--warm-up-time``). h2load counts HTTP statuses only, so a call is counted OK by
    the server's statistics (successes during the run); p50/p99 come from h2load's
    per-request ``--log-file``.
``triton_grpc`` / ``triton_h2``
    real Triton's gRPC port driven by perf_analyzer (``--grpc-tool``) / by h2load as
    above: Triton's own gRPC / HTTP ratio under the same clients, for reference.
``baseline``
    with ``--baseline ROOT``: ``pdserve serve`` (no front-end flag) run from another
    checkout (e.g. ``git archive BASE | tar -x -C ROOT``), to compare a change with
    its base in one run.
``baseline_h2``
    the ``--baseline`` checkout's gRPC port under h2load, as ``grpc_h2``: its ratios are
    ``grpc_h2``'s against it.

Each server is started, warmed (``--warmup`` s of wrk at the first concurrency),
measured at every ``--concurrency`` point and stopped; servers are interleaved per
``--repeats`` round (so drift on a loaded machine hits all of them) and medians are
reported. Per point: requests/s, p50 and p99 (wrk's), server CPU-seconds per request
(the user + system CPU the server's process group and descendants used during the
run, over the requests the server's statistics extension counted meanwhile; wrk's
count where the server has none), and ratios vs ``triton`` and vs ``asgi``.

A server that refuses a flag (a checkout without ``--http-server`` or
``--http-workers``) is reported as such and the others carry on.

Usage::

    .venv/bin/python benchmarks/bench_frontend.py --servers triton,asgi,native,workers2,grpc \\
        --triton-venv benchmarks/.venvs/triton --concurrency 32,128 --duration 8 --repeats 3

Writes ``benchmarks/out/bench_frontend.json`` (``--out``) and prints a Markdown table.
Absolute figures on shared VMs swing widely: quote ratios taken in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_peers import ONE_CORE, OUT, TINY_IO, Proc, latest_version_dir, machine, start_triton
from bench_perf_tool import parse_pa_csv, parse_pdserve_perf, parse_wrk
from common import (
    PY,
    ROOT,
    cli_parser,
    descendants,
    free_port,
    pdserve_command,
    perf_analyzer_command,
)

ALL_SERVERS = (
    "triton",
    "triton_grpc",
    "triton_h2",
    "pdserve",
    "asgi",
    "native",
    "workers2",
    "grpc",
    "grpc_h2",
    "baseline",
    "baseline_h2",
)

#: Extra ``pdserve serve`` flags of each pdserve variant.
PDSERVE_FLAGS: dict[str, list[str]] = {
    "pdserve": [],
    "baseline": [],
    "baseline_h2": [],
    "asgi": ["--http-server", "asgi"],
    "native": ["--http-server", "native"],
    "workers2": ["--http-workers", "2"],
    "grpc": [],
    "grpc_h2": [],
}


class Refused(RuntimeError):
    """The server refused its command line (a flag this checkout does not know): it is
    not started again in later rounds."""


# -- set-up --------------------------------------------------------------------------


def build_repo() -> Path:
    """``benchmarks/out/frontend_repo`` holding only ``tiny`` with the issue's settings."""
    repo = OUT / "frontend_repo"
    shutil.rmtree(repo, ignore_errors=True)
    (repo / "tiny" / "1").mkdir(parents=True)
    shutil.copy(latest_version_dir("tiny") / "model.onnx", repo / "tiny" / "1" / "model.onnx")
    (repo / "tiny" / "config.pbtxt").write_text(
        'name: "tiny"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 32\n'
        "dynamic_batching { max_queue_delay_microseconds: 2000 }\n" + ONE_CORE + TINY_IO
    )
    return repo


def write_body() -> tuple[Path, Path, Path]:
    """The one-row V2 JSON body, wrk's ``post.lua`` sending it, and perf_analyzer's
    ``--input-data`` file of the same row (h2load's gRPC message of that row: ``write_grpc_body``)."""
    import numpy as np

    row = [round(float(v), 6) for v in np.random.default_rng(0).standard_normal(64)]
    OUT.mkdir(parents=True, exist_ok=True)
    body = OUT / "frontend_body.json"
    body.write_text(
        json.dumps(
            {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": row}]}
        )
    )
    lua = OUT / "frontend_post.lua"
    lua.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'local f = io.open("{body}", "rb")\n'
        'wrk.body = f:read("*all")\n'
        "f:close()\n"
    )
    data = OUT / "frontend_pa_data.json"
    data.write_text(json.dumps({"data": [{"INPUT0": row}]}))
    write_grpc_body(row)
    return body, lua, data


GRPC_BODY = OUT / "frontend_grpc_body.bin"


def write_grpc_body(row: list[float]) -> Path:
    """h2load's request body: one length-prefixed gRPC message (flag byte 0, big-endian
    uint32 length; gRPC's PROTOCOL-HTTP2.md) holding a ``ModelInferRequest`` for
    ``tiny``: ``INPUT0`` FP32 [1, 64] = ``row`` as ``raw_input_contents``, ``OUTPUT0``
    asked for (the message perf_analyzer sends)."""
    import struct

    import numpy as np
    from tritonclient.grpc import service_pb2

    msg = service_pb2.ModelInferRequest(model_name="tiny")
    tensor = msg.inputs.add(name="INPUT0", datatype="FP32")
    tensor.shape.extend([1, 64])
    msg.outputs.add(name="OUTPUT0")
    msg.raw_input_contents.append(np.asarray([row], dtype=np.float32).tobytes())
    payload = msg.SerializeToString()
    GRPC_BODY.write_bytes(struct.pack(">BI", 0, len(payload)) + payload)
    return GRPC_BODY


# -- measuring -----------------------------------------------------------------------


def server_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process group ``pid`` and by every
    descendant of ``pid`` (one count each)."""
    tick = os.sysconf("SC_CLK_TCK")
    wanted = set(descendants(pid)) | {pid}
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(d) in wanted or int(fields[2]) == pid:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / tick


def success_count(base: str) -> int | None:
    """Successful inferences of ``tiny`` so far (statistics extension), None if unknown."""
    try:
        with urllib.request.urlopen(base + "/v2/models/tiny/stats", timeout=10) as r:
            doc = json.load(r)
        return sum(int(m["inference_stats"]["success"]["count"]) for m in doc["model_stats"])
    except (OSError, ValueError, KeyError):
        return None


def measure(
    args: argparse.Namespace, server: Proc, base: str, cmd: list[str], env: dict | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run a client ``cmd`` pinned to ``--client-cpu``; the server's CPU-seconds,
    completed requests and wall time over the client's run."""
    n0 = success_count(base)
    cpu0 = server_cpu_seconds(server.proc.pid)
    t0 = time.monotonic()
    out = subprocess.run(
        ["taskset", "-c", args.client_cpu, *cmd],
        capture_output=True,
        text=True,
        timeout=args.duration * 4 + 120,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    wall = time.monotonic() - t0
    cpu = server_cpu_seconds(server.proc.pid) - cpu0
    n1 = success_count(base)
    n = n1 - n0 if n0 is not None and n1 is not None else None
    return out, {"wall_s": round(wall, 2), "server_cpu_s": round(cpu, 3), "server_requests": n}


def wrk_cmd(args: argparse.Namespace, base: str, c: int, seconds: float) -> list[str]:
    return [
        "wrk", "-t1", f"-c{c}", f"-d{seconds:g}s", "--latency", "-s", str(args.lua),
        base + "/v2/models/tiny/infer",
    ]  # fmt: skip


def wrk_point(args: argparse.Namespace, server: Proc, base: str, c: int) -> dict[str, Any]:
    """One wrk point: req/s, p50/p99 ms, errors, server CPU-s per request."""
    out, m = measure(args, server, base, wrk_cmd(args, base, c, args.duration))
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed: {out.stderr[-1000:]}")
    r: dict[str, Any] = parse_wrk(out.stdout)
    done = re.search(r"(\d+) requests in", out.stdout)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out.stdout)
    sock = re.search(r"Socket errors: (.*)", out.stdout)
    r["wrk_requests"] = int(done.group(1)) if done else None
    r["errors"] = int(non2xx.group(1)) if non2xx else 0
    r["socket_errors"] = sock.group(1).strip() if sock else None
    r.update(m)
    n = m["server_requests"] or r["wrk_requests"]
    r["cpu_us_per_request"] = round(m["server_cpu_s"] / n * 1e6, 1) if n else None
    return r


def pa_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """perf_analyzer from ``--pa-venv`` (bench_perf_tool.py's recipe for its libraries)."""
    return perf_analyzer_command(Path(args.pa_venv), " or pass --pa-venv")


def h2load_point(
    args: argparse.Namespace, server: Proc, base: str, grpc_port: int, c: int, tag: str
) -> dict[str, Any]:
    """One gRPC point driven by h2load: ``--duration`` s after 1 s of warm-up, one
    connection, ``c`` streams. Returns req/s (h2load's), p50/p99 ms (from its per-request
    log), ``errors`` (calls h2load saw answered that the server did not count as
    successes, plus h2load's failed/errored and non-2xx), and the server's CPU-us/req."""
    log = OUT / f"frontend_h2load_{tag}.log"
    cmd = [
        "h2load", "-t", "1", "-c", "1", "-m", str(c), "-D", f"{args.duration:g}",
        "--warm-up-time=1", "-d", str(GRPC_BODY), "-H", "content-type: application/grpc",
        "-H", "te: trailers", "--log-file", str(log),
        f"http://127.0.0.1:{grpc_port}/inference.GRPCInferenceService/ModelInfer",
    ]  # fmt: skip
    out, m = measure(args, server, base, cmd)
    rps = re.search(r"finished in [\d.]+s, ([\d.]+) req/s", out.stdout)
    ok = re.search(r"(\d+) succeeded, (\d+) failed, (\d+) errored", out.stdout)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out.stdout)
    if out.returncode != 0 or rps is None or ok is None or codes is None:
        raise RuntimeError(f"h2load failed: {(out.stdout + out.stderr)[-1500:]}")
    durations = sorted(
        int(parts[2]) for line in log.read_text().splitlines() if len(parts := line.split()) >= 3
    )
    # the log holds the measured requests only (not the warm-up's); durations in us
    q = statistics.quantiles(durations, n=100, method="inclusive") if len(durations) > 1 else [0.0]
    ok2xx = int(codes.group(1))
    n = m["server_requests"]
    not_ok = int(ok.group(2)) + int(ok.group(3)) + sum(int(codes.group(i)) for i in (2, 3, 4))
    r: dict[str, Any] = {
        "rps": float(rps.group(1)),
        "p50_ms": round(q[49] / 1e3, 2),
        "p99_ms": round(q[98] / 1e3, 2),
        "h2load_2xx": ok2xx,
        # the server's successes span the warm-up too, so fewer than h2load's 2xx means
        # calls answered with a non-OK grpc-status
        "errors": not_ok + (max(0, ok2xx - n) if n is not None else 0),
    }
    r.update(m)
    r["cpu_us_per_request"] = round(m["server_cpu_s"] / n * 1e6, 1) if n else None
    r["tool"] = "h2load"
    return r


def grpc_point(
    args: argparse.Namespace, server: Proc, base: str, grpc_port: int, c: int, tag: str
) -> dict[str, Any]:
    """One gRPC point: three windows of ``--duration``/3 s (stability not required)."""
    window = str(max(int(args.duration * 1000 / 3), 500))
    url = f"127.0.0.1:{grpc_port}"
    if args.grpc_tool == "perf_analyzer":
        pa, env = pa_command(args)
        csv = OUT / f"frontend_pa_{tag}.csv"
        cmd = [
            *pa, "-m", "tiny", "-u", url, "-i", "grpc", "--concurrency-range", str(c),
            "-p", window, "-r", "3", "-s", "1000", "--input-data", str(args.pa_data),
            "-f", str(csv),
        ]  # fmt: skip
        out, m = measure(args, server, base, cmd, env)
        r: dict[str, Any] = parse_pa_csv(csv)
    else:
        js = OUT / f"frontend_pdperf_{tag}.json"
        cmd = [
            PY, "-m", "pdserve", "perf", "-m", "tiny", "-u", url, "-i", "grpc",
            "--concurrency-range", str(c), "-p", window, "-r", "3", "-s", "1000",
            "-q", "--json", str(js),
        ]  # fmt: skip
        out, m = measure(args, server, base, cmd)
        r = parse_pdserve_perf(js)
    if r.get("rps") is None:
        raise RuntimeError(f"{args.grpc_tool} failed: {(out.stdout + out.stderr)[-1500:]}")
    r.update(m)
    n = m["server_requests"]
    r["server_rps"] = round(n / m["wall_s"], 1) if n else None
    r["cpu_us_per_request"] = round(m["server_cpu_s"] / n * 1e6, 1) if n else None
    r["tool"] = args.grpc_tool
    return r


# -- servers -------------------------------------------------------------------------


def start_server(args: argparse.Namespace, name: str, repo: Path) -> tuple[Proc, str, int | None]:
    """Start server ``name``; (process, HTTP base URL, gRPC port or None).

    Raises:
        Refused: the server exited before it was ready (its log's last lines).
    """
    if name.startswith("triton"):
        py = Path(args.triton_venv) / "bin" / "python"
        if not py.exists():
            raise Refused(f"no Triton venv at {args.triton_venv} (pass --triton-venv)")
        ns = argparse.Namespace(server_cpu=args.server_cpu)
        http, grpc = distinct_ports(2)
        tiny = latest_version_dir("tiny") / "model.onnx"
        proc, base = start_triton(ns, py, tiny, http, grpc)
        return proc, base, grpc
    http, grpc, metrics = distinct_ports(3)
    core = f"{args.server_cpu},{args.client_cpu}" if name == "workers2" else args.server_cpu
    cmd = pdserve_command(repo, http, grpc, metrics, *PDSERVE_FLAGS[name], core=core)
    cwd = Path(args.baseline) if name.startswith("baseline") else ROOT
    proc = Proc(f"frontend_{name}", cmd, cwd=cwd, env={"PYTHONPATH": str(cwd)})
    base = f"http://127.0.0.1:{http}"
    try:
        proc.wait_ready(base + "/v2/health/ready")
    except RuntimeError as e:
        stop(proc)
        tail = (OUT / f"frontend_{name}.log").read_text(errors="replace").strip()
        lines = " | ".join(tail.splitlines()[-3:])
        if "unrecognized arguments" in tail or "invalid choice" in tail:
            raise Refused(f"{e}: {lines}") from None  # a flag this checkout lacks
        raise RuntimeError(f"{e}: {lines}") from None  # this round only
    return proc, base, grpc


def distinct_ports(n: int) -> list[int]:
    """``n`` different free ports (two calls of ``free_port`` may return the same one)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def run_server(
    args: argparse.Namespace, name: str, repo: Path, rep: int
) -> dict[int, dict[str, Any]]:
    """Every concurrency point of one server in one round."""
    proc, base, grpc = start_server(args, name, repo)
    points: dict[int, dict[str, Any]] = {}
    try:
        if args.warmup > 0:
            subprocess.run(
                ["taskset", "-c", args.client_cpu,
                 *wrk_cmd(args, base, args.concurrency[0], args.warmup)],
                capture_output=True, timeout=args.warmup + 60,
            )  # fmt: skip
        for c in args.concurrency:
            if name in ("grpc", "triton_grpc"):
                assert grpc is not None
                r = grpc_point(args, proc, base, grpc, c, f"{c}_{rep}")
            elif name in ("grpc_h2", "triton_h2", "baseline_h2"):
                assert grpc is not None
                r = h2load_point(args, proc, base, grpc, c, f"{c}_{rep}")
            else:
                r = wrk_point(args, proc, base, c)
            points[c] = r
            print(
                f"  [{rep}] {name} c={c}: {r['rps']} req/s p50 {r['p50_ms']} p99 {r['p99_ms']} ms, "
                f"server {r['cpu_us_per_request']} CPU-us/req, errors {r.get('errors', 0)}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        stop(proc)
    return points


def stop(proc: Proc) -> None:
    """Stop a server's process group: SIGTERM, SIGKILL after 20 s, then wait up to
    60 s more (tritonserver's group can take that long to go after a SIGKILL)."""
    if proc.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.proc.pid, signal.SIGTERM)
        try:
            proc.proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.proc.pid, signal.SIGKILL)
            try:
                proc.proc.wait(60)
            except subprocess.TimeoutExpired:
                print(f"  {proc.name} (pid {proc.proc.pid}) still exiting", file=sys.stderr)
    proc.log.close()


# -- report --------------------------------------------------------------------------


def medians(runs: list[dict[str, Any]], stat: str = "median") -> dict[str, Any]:
    """Per numeric key, the median over rounds (``stat`` ``best``: the round with the
    most requests/s, whose figures are all taken; on a loaded machine the least
    disturbed round); ``runs`` keeps them all."""
    out: dict[str, Any] = {"runs": runs}
    if stat == "best":
        best = max(runs, key=lambda r: r.get("rps") or 0)
        out.update({k: v for k, v in best.items() if k != "runs"})
        return out
    for key in runs[0]:
        vals = [r[key] for r in runs if isinstance(r.get(key), int | float)]
        out[key] = round(statistics.median(vals), 3) if vals else runs[-1][key]
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


#: The servers others are compared with (when they ran).
REFS = ("triton", "asgi", "pdserve", "baseline", "baseline_h2")


def _same_protocol(name: str, ref: str) -> bool:
    """``baseline_h2`` is compared with the gRPC servers only, and ``baseline`` with
    the HTTP ones only; the other references with every server."""
    if ref == "baseline_h2":
        return name in ("grpc_h2", "grpc")
    if ref == "baseline":
        return not name.endswith("_h2") and not name.startswith("grpc")
    return True


def summarise(results: dict[str, Any]) -> None:
    """Medians and ratios (vs triton, vs asgi; gRPC vs pdserve HTTP) into ``results``."""
    summary: dict[str, dict[int, dict[str, Any]]] = {}
    for name, rounds in results["rounds"].items():
        ok = [r for r in rounds if "error" not in r]
        if not ok:
            continue
        summary[name] = {}
        for c in results["concurrency"]:
            runs = [r[str(c)] if str(c) in r else r[c] for r in ok]
            summary[name][c] = medians(runs, results.get("stat", "median"))
    http_ref = "native" if "native" in summary else "pdserve"
    for name, pts in summary.items():
        for c, m in pts.items():
            for ref in REFS:
                if ref in summary and ref != name and _same_protocol(name, ref):
                    other = summary[ref][c]
                    m[f"rps_vs_{ref}"] = ratio(m["rps"], other["rps"])
                    m[f"cpu_per_req_vs_{ref}"] = ratio(
                        m["cpu_us_per_request"], other["cpu_us_per_request"]
                    )
            if name.startswith("grpc") and http_ref in summary:
                m[f"rps_vs_{http_ref}_http"] = ratio(m["rps"], summary[http_ref][c]["rps"])
            if name in ("triton_grpc", "triton_h2") and "triton" in summary:
                m["rps_vs_triton_http"] = ratio(m["rps"], summary["triton"][c]["rps"])
    results["summary"] = summary


def markdown(results: dict[str, Any]) -> str:
    """The summary table (medians, or best, of the rounds)."""
    s = results["summary"]
    refs = [r for r in REFS if r in s]
    lines = [
        f"{results['machine']['cpu']}, {results['date']}, load average "
        f"{results['load_before']} before, {results['load_after']} after; "
        f"{'medians' if results.get('stat', 'median') == 'median' else 'best (most req/s)'} of "
        f"{results['repeats']} round(s), {results['duration']:g} s per point; server on core "
        f"{results['server_cpu']} (workers2: {results['server_cpu']},{results['client_cpu']}), "
        f"client on core {results['client_cpu']}",
        "",
        "| server | c | req/s | p50 ms | p99 ms | server CPU-us/req | "
        + " | ".join(f"req/s vs {r} | CPU/req vs {r}" for r in refs)
        + " |",
        "|---|---|---|---|---|---|" + "---|---|" * len(refs),
    ]
    for name, pts in s.items():
        for c, m in pts.items():
            cells = [
                f"{m['rps']:,.0f}" if m["rps"] else "-",
                str(m["p50_ms"]),
                str(m["p99_ms"]),
                str(m["cpu_us_per_request"]),
            ]
            for r in refs:
                cells += [str(m.get(f"rps_vs_{r}", "-")), str(m.get(f"cpu_per_req_vs_{r}", "-"))]
            label = f"{name} ({m.get('tool')})" if "grpc" in name or "h2" in name else name
            lines.append(f"| {label} | {c} | " + " | ".join(cells) + " |")
    for pts in s.values():
        for c, m in pts.items():
            for k, v in m.items():
                if k.endswith("_http"):
                    who = "Triton" if k == "rps_vs_triton_http" else "pdserve"
                    lines.append(
                        f"\n{who} gRPC ({m.get('tool')}) / {who} HTTP ({k[7:-5]}) at c={c}: "
                        f"{v}x req/s"
                    )
    for name, rounds in results["rounds"].items():
        errs = [r["error"] for r in rounds if "error" in r]
        if errs and len(errs) == len(rounds):
            lines += [f"\n**{name}: not measured**: {e}" for e in dict.fromkeys(errs)]
        elif errs:
            lines.append(f"\n{name}: {len(errs)} of {len(rounds)} rounds failed: {errs[0]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, write the JSON, print the Markdown table."""
    p = cli_parser(__doc__, __file__)
    p.add_argument(
        "--servers",
        default="triton,asgi,native,workers2,grpc",
        help=f"comma list from {', '.join(ALL_SERVERS)}",
    )
    p.add_argument(
        "--concurrency", default="32,128", help="wrk -c points, comma list (default 32,128)"
    )
    p.add_argument("--duration", type=float, default=8.0, help="seconds per point (default 8)")
    p.add_argument(
        "--warmup", type=float, default=2.0, help="wrk seconds after each start (default 2)"
    )
    p.add_argument("--repeats", type=int, default=1, help="rounds, servers interleaved (default 1)")
    p.add_argument(
        "--stat",
        choices=("median", "best"),
        default="median",
        help="summary over rounds: the median, or the round with the most req/s "
        "(the least disturbed one on a loaded machine)",
    )
    p.add_argument(
        "--server-cpu",
        default="0",
        help="taskset cores of each server (default 0; workers2 gets these and --client-cpu)",
    )
    p.add_argument("--client-cpu", default="1", help="taskset cores of wrk/h2load (default 1)")
    p.add_argument(
        "--triton-venv",
        default=str(ROOT / "benchmarks" / ".venvs" / "triton"),
        help="virtual environment holding tritonserver (default benchmarks/.venvs/triton; "
        "see ANCHORS.md)",
    )
    p.add_argument(
        "--pa-venv",
        default=str(ROOT / "benchmarks" / ".venvs" / "perf_analyzer"),
        help="virtual environment holding perf_analyzer (default "
        "benchmarks/.venvs/perf_analyzer; made by `make bench-frontend`)",
    )
    p.add_argument(
        "--grpc-tool",
        choices=("perf_analyzer", "pdserve"),
        default=None,
        help="gRPC load client (default perf_analyzer when --pa-venv has it, else pdserve perf)",
    )
    p.add_argument("--baseline", default=None, help="checkout run as server 'baseline'")
    p.add_argument(
        "--out",
        type=Path,
        default=OUT / "bench_frontend.json",
        help="JSON of every round (default benchmarks/out/bench_frontend.json)",
    )
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    bad = [s for s in args.servers if s not in ALL_SERVERS]
    if bad:
        p.error(f"unknown server(s) {bad}; choose from {ALL_SERVERS}")
    if {"baseline", "baseline_h2"} & set(args.servers) and not args.baseline:
        p.error("servers 'baseline' and 'baseline_h2' need --baseline ROOT")
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    if args.grpc_tool is None:
        has_pa = (Path(args.pa_venv) / "bin" / "perf_analyzer").exists()
        args.grpc_tool = "perf_analyzer" if has_pa else "pdserve"
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        raise SystemExit("wrk and taskset are needed (apt-get install wrk util-linux)")
    if {"grpc_h2", "triton_h2", "baseline_h2"} & set(args.servers) and shutil.which(
        "h2load"
    ) is None:
        raise SystemExit("servers grpc_h2 / triton_h2 need h2load (apt-get install nghttp2-client)")
    repo = build_repo()
    _, args.lua, args.pa_data = write_body()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "servers": args.servers,
        "concurrency": args.concurrency,
        "duration": args.duration,
        "repeats": args.repeats,
        "stat": args.stat,
        "server_cpu": args.server_cpu,
        "client_cpu": args.client_cpu,
        "grpc_tool": args.grpc_tool,
        "rounds": {name: [] for name in args.servers},
    }
    refused: set[str] = set()
    for rep in range(args.repeats):
        for name in args.servers:
            if name in refused:
                continue
            print(f"== round {rep} {name}", file=sys.stderr, flush=True)
            try:
                results["rounds"][name].append(run_server(args, name, repo, rep))
            except Refused as e:
                refused.add(name)
                print(f"  {name} not measured: {e}", file=sys.stderr, flush=True)
                results["rounds"][name].append({"error": str(e)})
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"  {name} failed: {e}", file=sys.stderr, flush=True)
                results["rounds"][name].append({"error": str(e)[:500]})
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    summarise(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
