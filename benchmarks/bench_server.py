"""Issue 2 benchmarks: per-request overhead, efficientnet_lite0 vs bare ONNX Runtime,
memory and start-up time.

The server runs pinned to one core (``taskset -c 0``), the load client
(``benchmarks/loadgen.py``, its own process) on the other. Every load point is
bounded in time and requests; the server listens on 127.0.0.1 only.

Usage::

    .venv/bin/python benchmarks/bench_server.py [--duration 6] [--out benchmarks/out/server.json]

Prints a Markdown table and writes the raw figures as JSON.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    GOLDENS,
    LOADGEN,
    PY,
    REPO,
    ROOT,
    cli_parser,
    header_args,
    run_client,
    start_server,
    taskset,
)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (python-backend workers are children of a
    forkserver, grandchildren of the server), from the parent ids in /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants, MiB (from /proc)."""
    total = 0
    for p in descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def load(
    url: str, body: bytes, concurrency: int, duration: float, headers: list[str]
) -> dict[str, Any]:
    """One load point with benchmarks/loadgen.py pinned to core 1."""
    return run_client(
        str(LOADGEN),
        "--url",
        url,
        body,
        concurrency,
        duration,
        extra=["--max-requests", "2000000", *header_args(headers)],
        timeout=duration + 60,
    )


def tiny_body() -> bytes:
    """A one-row V2 JSON request for ``tiny`` (64 FP32 values)."""
    data = np.linspace(-1, 1, 64, dtype=np.float32).tolist()
    return json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": data}]}
    ).encode()


def efficientnet_body() -> tuple[bytes, str]:
    """A batch-1 binary-extension request for efficientnet_lite0 (a real photo)."""
    x = np.load(GOLDENS / "efficientnet_lite0.npz")["inputs"][:1].astype(np.float32)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return header + x.tobytes(), f"Inference-Header-Content-Length: {len(header)}"


def bare_ort(duration: float) -> dict[str, float]:
    """efficientnet_lite0 batch 1 in-process with ONNX Runtime on core 0, one intra-op
    thread: the CPU budget the pinned server's sessions get (pdserve gives each of
    a model's instances its share of the process's CPUs)."""
    code = f"""
import json, time, numpy as np, onnxruntime as ort
x = np.load({str(GOLDENS / "efficientnet_lite0.npz")!r})["inputs"][:1].astype(np.float32)
so = ort.SessionOptions()
so.intra_op_num_threads = 1  # ORT pins its own pool threads past taskset: one core, one thread
s = ort.InferenceSession({str(REPO / "efficientnet_lite0" / "1" / "model.onnx")!r},
                         sess_options=so, providers=["CPUExecutionProvider"])
for _ in range(5): s.run(None, {{"input": x}})
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < {duration}:
    s.run(None, {{"input": x}}); n += 1
print(json.dumps({{"ips": n / (time.perf_counter() - t0)}}))
"""
    out = subprocess.run(
        [*taskset("0"), PY, "-c", code], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def main() -> int:
    """Run every point and print the table."""
    p = cli_parser(__doc__, __file__)
    p.add_argument("--duration", type=float, default=6.0, help="seconds per load point")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "server.json")
    args = p.parse_args()
    if not REPO.is_dir():
        print("build the example repository first: python examples/build.py", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    proc, port, _, startup_s = start_server(REPO, log=False)
    try:
        results["startup_to_ready_s"] = round(startup_s, 2)
        results["rss_idle_mib"] = round(rss_mib(proc.pid), 1)
        results["processes"] = len(descendants(proc.pid))
        base = f"http://127.0.0.1:{port}/v2/models"
        for c in (1, 32):
            r = load(f"{base}/tiny/infer", tiny_body(), c, args.duration, [])
            results[f"tiny_json_c{c}"] = r
        body, hdr = efficientnet_body()
        for c in (1, 4):
            r = load(f"{base}/efficientnet_lite0/infer", body, c, args.duration, [hdr])
            results[f"efficientnet_b1_c{c}"] = r
        results["rss_after_load_mib"] = round(rss_mib(proc.pid), 1)
    finally:
        proc.terminate()
        proc.wait(30)
    results["bare_ort_efficientnet_b1"] = bare_ort(args.duration)
    best = max(results["efficientnet_b1_c1"]["rps"], results["efficientnet_b1_c4"]["rps"])
    results["efficientnet_ratio_vs_bare_ort"] = round(
        best / results["bare_ort_efficientnet_b1"]["ips"], 3
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))

    print(f"machine: {results['machine']}; server on core 0, client on core 1")
    print("| point | req/s | p50 ms | p99 ms | errors |")
    print("|---|---|---|---|---|")
    for key in ("tiny_json_c1", "tiny_json_c32", "efficientnet_b1_c1", "efficientnet_b1_c4"):
        r = results[key]
        print(f"| {key} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |")
    print(
        f"bare ORT efficientnet batch 1: {results['bare_ort_efficientnet_b1']['ips']:.1f} img/s; "
        f"server/bare = {results['efficientnet_ratio_vs_bare_ort']}"
    )
    print(
        f"start-up to ready: {results['startup_to_ready_s']} s; RSS idle "
        f"{results['rss_idle_mib']} MiB, after load {results['rss_after_load_mib']} MiB "
        f"({results['processes']} processes)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
