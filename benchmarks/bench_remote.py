"""Issue 14 item 1: the image pipeline in one process vs split into transformer + predictor.

Three setups of ``image_classifier`` (raw JPEG in, top-5 out), one after the other on
the same machine, same client and same photo:

1. **one process**: pdserve serving ``preprocess``, ``efficientnet_lite0``,
   ``postprocess`` and the ensemble (copies of the example models, unchanged);
2. **split, gRPC**: a *predictor* pdserve serving only ``efficientnet_lite0`` and a
   *transformer* pdserve serving the ensemble, ``preprocess``, ``postprocess`` and an
   ``efficientnet_lite0`` of ``backend: "remote"`` calling the predictor over gRPC
   (``examples/split/build_split.py``: 8 batches in flight, pool of 4 channels);
3. **split, HTTP+binary**: the same, the remote model speaking V2 REST with the binary
   tensor extension (8 keep-alive connections, one per batch in flight).

Every setup's servers run at once (the idle ones cost a health probe a second); the
setups are measured interleaved, ``--rounds`` rounds per concurrency, with closed-loop
load from ``benchmarks/loadgen.py`` (HTTP binary extension, one JPEG per request) at
concurrency 1, 8 and 32 for ``--duration`` seconds after ``--warmup``; the tables give
medians over the rounds. The *added latency per image* is the split's p50 minus
the one-process p50 at concurrency 1. Also measured: the remote hop alone
(``efficientnet_lite0`` with a 602 KB FP32 input, concurrency 1): on the predictor
directly vs through the transformer's remote model.

With ``--triton PY`` (the interpreter of a venv holding ``nvidia-pytriton``,
``numpy<2``, ``onnxruntime``; ``benchmarks/bench_peers.py --install`` makes
``benchmarks/.venvs/triton``) the predictor is also **real Triton** 2.51 (python
backend: efficientnet_lite0 as a python model running ONNX Runtime, as in
``bench_pipeline.py --triton``), the transformer calling it over gRPC; skipped with a
note when that interpreter is absent.

No pinning: both servers and the client share the machine's cores, so on a small
machine the split measures the cost of the hop, not the gain of giving the predictor
its own machine. Usage::

    .venv/bin/python benchmarks/bench_remote.py [--duration 4] [--warmup 1] [--rounds 3] [--triton benchmarks/.venvs/triton/bin/python]

Prints a Markdown table and writes ``benchmarks/out/remote.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_pipeline import (
    binary_body,
    bytes_element,
    check_top5,
    load_point,
    make_python_predictor_repo,
    stop_server,
)
from common import (
    GOLDENS,
    REPO,
    ROOT,
    cli_parser,
    free_port,
    pdserve_command,
    tritonserver_command,
    wait_ready,
)

sys.path.insert(0, str(ROOT))
from examples.split.build_split import build as build_transformer  # noqa: E402

PIPELINE = ("preprocess", "efficientnet_lite0", "postprocess", "image_classifier")
CONCURRENCY = (1, 8, 32)


def serve(repo: Path, log: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    """pdserve on ``repo``; (process, http port, grpc port) once ready."""
    http, grpc = free_port(), free_port()
    cmd = pdserve_command(repo, http, grpc, free_port())
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)  # noqa: SIM115
    wait_ready(proc, http, log, "pdserve", interval=0.2, tail=3000)
    return proc, http, grpc


def serve_triton(py: Path, repo: Path, work: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    """Real Triton on ``repo``; (process, http port, grpc port) once ready."""
    http = free_port()
    cmd, env = tritonserver_command(py, repo, http, work / "backends")
    grpc = free_port()
    cmd = [a if not a.startswith("--grpc-port=") else f"--grpc-port={grpc}" for a in cmd]
    log = work / "triton.log"
    proc = subprocess.Popen(  # noqa: SIM115
        cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env={**os.environ, **env}
    )
    wait_ready(proc, http, log, "tritonserver", interval=0.3, tail=3000)
    return proc, http, grpc


def hop(port: int, body: tuple[bytes, int], duration: float, warmup: float) -> dict[str, Any]:
    """efficientnet_lite0 alone at concurrency 1 on ``port``."""
    return load_point(port, "efficientnet_lite0", *body, 1, duration, warmup)


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of rps / p50 / p99 over rounds, with every round's figures."""
    row: dict[str, Any] = {
        k: statistics.median(r[k] for r in runs) for k in ("rps", "p50_ms", "p99_ms")
    }
    row["rounds"] = [{k: r[k] for k in ("rps", "p50_ms", "p99_ms", "loadavg_before")} for r in runs]
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start every setup's servers at once (idle ones cost a health probe a second),
    then measure the setups interleaved: per concurrency, ``--rounds`` rounds, each
    setup once per round; report medians over rounds."""
    goldens = np.load(GOLDENS / "image_classifier.npz")
    jpeg = goldens["image_bytes_china"].tobytes()
    expected = [str(x) for x in goldens["top5_labels"][list(goldens["names"]).index("china")]]
    body = binary_body(
        [("input_image_bytes", "BYTES", [1, 1], bytes_element(jpeg))],
        ["top5_labels", "top5_confidences"],
    )
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    hop_body = binary_body([("input", "FP32", [1, 3, 224, 224], x.tobytes())], ["logits"])
    work = Path(tempfile.mkdtemp(prefix="bench_remote_"))
    out: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "rounds": args.rounds,
        "setups": {},
        "hop_c1": {},
    }
    procs: list[subprocess.Popen[bytes]] = []
    ports: dict[str, int] = {}
    hop_ports: dict[str, int] = {}
    try:
        # one snapshot of the example models for every setup (the shared repository
        # may be rebuilt while this runs)
        src = work / "src"
        src.mkdir()
        for m in PIPELINE:
            shutil.copytree(REPO / m, src / m)
        one = work / "one"
        shutil.copytree(src, one)
        proc, ports["one process"], _ = serve(one, work / "one.log")
        procs.append(proc)
        pred_repo = work / "predictor"
        pred_repo.mkdir()
        shutil.copytree(src / "efficientnet_lite0", pred_repo / "efficientnet_lite0")
        pred, p_http, p_grpc = serve(pred_repo, work / "predictor.log")
        procs.append(pred)
        hop_ports["predictor directly (HTTP+binary)"] = p_http
        for protocol in ("grpc", "http"):
            url = f"127.0.0.1:{p_grpc if protocol == 'grpc' else p_http}"
            trepo = build_transformer(
                work / f"t_{protocol}", url, protocol, src, pool_size=4 if protocol == "grpc" else 8
            )  # fmt: skip
            label = f"split, {'gRPC' if protocol == 'grpc' else 'HTTP+binary'}"
            tr, ports[label], _ = serve(trepo, work / f"t_{protocol}.log")
            procs.append(tr)
            hop_ports[f"through the transformer ({label})"] = ports[label]
        if args.triton is not None and not Path(args.triton).exists():
            out["triton"] = f"skipped: no interpreter at {args.triton}"
            print(f"  triton: {out['triton']}", file=sys.stderr)
        elif args.triton is not None:
            trepo_src = make_python_predictor_repo(work / "triton_repo_full", 1)
            t_repo = work / "triton_repo"
            t_repo.mkdir()
            shutil.copytree(trepo_src / "efficientnet_lite0", t_repo / "efficientnet_lite0")
            tproc, _, tt_grpc = serve_triton(Path(args.triton), t_repo, work)
            procs.append(tproc)
            trepo = build_transformer(work / "t_triton", f"127.0.0.1:{tt_grpc}", "grpc", src)
            tr, ports["split, gRPC, predictor = real Triton 2.51"], _ = serve(trepo, work / "t_triton.log")  # fmt: skip
            procs.append(tr)
        for port in ports.values():
            check_top5(port, jpeg, expected)
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {k: {} for k in ports}
        hops: dict[str, list[dict[str, Any]]] = {k: [] for k in hop_ports}
        for _ in range(args.rounds):
            for label, port in hop_ports.items():
                r = hop(port, hop_body, args.duration, args.warmup)
                r["loadavg_before"] = round(os.getloadavg()[0], 2)
                hops[label].append(r)
        for c in CONCURRENCY:
            for _ in range(args.rounds):
                for label, port in ports.items():
                    load = os.getloadavg()[0]
                    r = load_point(port, "image_classifier", *body, c, args.duration, args.warmup)
                    r["loadavg_before"] = round(load, 2)
                    runs[label].setdefault(c, []).append(r)
                    print(f"  [{label}] c={c}: {r['rps']:.1f}/s p50 {r['p50_ms']:.1f} p99 {r['p99_ms']:.1f} ms", file=sys.stderr)  # fmt: skip
        for label, by_c in runs.items():
            out["setups"][label] = [
                {"concurrency": c, **median_row(rs)} for c, rs in sorted(by_c.items())
            ]
        for label, rs in hops.items():
            out["hop_c1"][label] = median_row(rs)
    finally:
        for proc in reversed(procs):
            stop_server(proc)
        shutil.rmtree(work, ignore_errors=True)
    return out


def markdown(out: dict[str, Any]) -> str:
    base = {r["concurrency"]: r for r in out["setups"]["one process"]}
    lines = [
        "| setup | c=1 img/s (p50 / p99 ms) | c=8 img/s (p50 / p99) | c=32 img/s (p50 / p99) | c=32 vs one process | added p50 per image at c=1 |",  # fmt: skip
        "|---|---|---|---|---|---|",
    ]
    for label, rows in out["setups"].items():
        by_c = {r["concurrency"]: r for r in rows}
        cells = [
            f"{by_c[c]['rps']:.1f} ({by_c[c]['p50_ms']:.1f} / {by_c[c]['p99_ms']:.1f})"
            for c in CONCURRENCY
        ]
        ratio = by_c[32]["rps"] / base[32]["rps"] if base[32]["rps"] else float("nan")
        added = by_c[1]["p50_ms"] - base[1]["p50_ms"]
        lines.append(f"| {label} | {' | '.join(cells)} | {ratio:.2f}x | {added:+.1f} ms |")
    lines += ["", "| efficientnet_lite0, 602 KB FP32 in, c=1 | req/s | p50 ms | p99 ms |", "|---|---|---|---|"]  # fmt: skip
    for label, r in out["hop_c1"].items():
        lines.append(f"| {label} | {r['rps']:.1f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    if isinstance(out.get("triton"), str):
        lines += ["", f"Real Triton: {out['triton']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per load point")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per load point")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per load point")
    p.add_argument(
        "--triton",
        type=Path,
        default=None,
        help="python of a venv with nvidia-pytriton: also run real Triton as the predictor",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "remote.json")
    args = p.parse_args(argv)
    load = os.getloadavg()
    out = run(args)
    out["loadavg_start"] = [round(v, 2) for v in load]
    out["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(markdown(out))
    print(
        f"\nload average {out['loadavg_start']} -> {out['loadavg_end']}; raw figures in {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
