"""The framework backends against their frameworks' own in-process infer calls: pdserve's
server-side compute time per batch (from the statistics extension) against the same
model run by OpenVINO, TensorFlow and torch.export in this process, at batch 1, 8, 64.

The models are examples/framework_repository's (``examples/build_frameworks.py``):
``efficientnet_lite0_openvino`` (``CompiledModel`` infer request), ``iris_keras``
(the SavedModel's ``serving_default`` signature) and ``efficientnet_lite0_pt2``
(``torch.export.load(...).module()`` under ``torch.inference_mode``). pdserve serves
copies of them (``max_batch_size`` 64, dynamic batching on, one ``KIND_CPU`` instance,
each framework's default threads), by default each model in a server of its own with
its in-process side in a process of its own (``--together``: one server and one process
for all; frameworks sharing a process slow each other down, see RESULTS.md). A client
sends one request of ``b`` rows at a time, so each execution is one request, and the
server's time per execution is the ``compute_input + compute_infer + compute_output``
of ``/v2/models/<m>/stats``'s ``batch_stats`` entry for size ``b``, differenced around
the round. In-process the same framework call runs on the same rows, twice: back to
back (a hot loop), and paced, one call per interval the server side's requests came at
(idle in between, as a server's calls are: a sub-millisecond TensorFlow call costs far
more paced, its inter-op threads asleep). The sides alternate per (model, batch) in
``--rounds`` rounds; each side of a round runs at least one call and stops after
``--seconds``. Reported: mean ms per batch each side (median over rounds), the
pdserve/framework ratios (goal <= 1.10) with their ranges over rounds.

Usage::

    .venv/bin/python benchmarks/bench_frameworks.py [--rounds 4] [--seconds 0.5] [--batches 1,8,64]

Prints a Markdown table and writes ``benchmarks/out/bench_frameworks.json``; ~3 minutes
by default (the server's start, TensorFlow's import included).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import cli_parser, interrupt_on_sigterm, start_server, stop_process

ROOT = Path(__file__).resolve().parents[1]
# As pdserve's PyTorch backend does before it imports torch: libgomp's threads otherwise
# spin at every barrier, and the in-process side would not run as the server does.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = ROOT / "examples" / "framework_repository"
OUT = ROOT / "benchmarks" / "out"
#: calls on each side of a round at least
MIN_CALLS = 1
#: model -> (input, output, row shape)
MODELS: dict[str, tuple[str, str, tuple[int, ...]]] = {
    "efficientnet_lite0_openvino": ("input", "logits", (3, 224, 224)),
    "iris_keras": ("features", "probabilities", (4,)),
    "efficientnet_lite0_pt2": ("INPUT__0", "OUTPUT__0", (3, 224, 224)),
}


def _bench_repo(tmp: Path, models: list[str]) -> Path:
    """Copies of ``models`` with max_batch_size 64 (one CPU instance each)."""
    repo = tmp / "repo"
    for name in models:
        shutil.copytree(REPO / name, repo / name)
        cfg = repo / name / "config.pbtxt"
        cfg.write_text(re.sub(r"max_batch_size: \d+", "max_batch_size: 64", cfg.read_text()))
    return repo


def _in_process(model: str) -> Callable[[np.ndarray], np.ndarray]:
    """The framework's own call on ``model`` (rows in, first output out)."""
    version = REPO / model / "1"
    name, output, _ = MODELS[model]
    if model.endswith("openvino"):
        import openvino as ov

        from pdserve.backends.openvino.options import CPU_PRECISION

        compiled = ov.Core().compile_model(str(version / "model.xml"), "CPU", CPU_PRECISION)
        request = compiled.create_infer_request()
        return lambda x: request.infer({name: x})[output]
    if model == "iris_keras":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        fn = tf.saved_model.load(str(version / "model.savedmodel")).signatures["serving_default"]
        return lambda x: fn(**{name: tf.constant(x)})[output].numpy()
    import torch

    module = torch.export.load(str(version / "model.pt2")).module()

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(x)).numpy()

    return run


def _batch_ns(port: int, model: str, size: int) -> tuple[int, int]:
    """(executions, compute ns) of ``model``'s batches of ``size`` so far."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/stats") as r:
        stats = json.loads(r.read())["model_stats"][0]
    for b in stats.get("batch_stats", []):
        if int(b["batch_size"]) == size:
            ns = sum(int(b[k]["ns"]) for k in ("compute_input", "compute_infer", "compute_output"))
            return int(b["compute_infer"]["count"]), ns
    return 0, 0


def _timed(fn: Callable[[], object], seconds: float) -> int:
    """Run ``fn`` at least MIN_CALLS times and until ``seconds`` passed; the calls made."""
    calls, t0 = 0, time.perf_counter()
    while calls < MIN_CALLS or time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    return calls


def _server_side(
    client: Any, port: int, model: str, x: np.ndarray, seconds: float
) -> tuple[float, float]:
    """(server compute ms per batch, seconds from one request to the next)."""
    import tritonclient.http as httpclient

    name, output, _ = MODELS[model]
    tensor = httpclient.InferInput(name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    wanted = [httpclient.InferRequestedOutput(output, binary_data=True)]
    count0, ns0 = _batch_ns(port, model, len(x))
    t0 = time.perf_counter()
    calls = _timed(lambda: client.infer(model, [tensor], outputs=wanted), seconds)
    interval = (time.perf_counter() - t0) / calls
    count1, ns1 = _batch_ns(port, model, len(x))
    return (ns1 - ns0) / max(count1 - count0, 1) / 1e6, interval


def _framework_side(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, seconds: float) -> float:
    """ms per call, back to back (a hot loop)."""
    t0 = time.perf_counter()
    calls = _timed(lambda: fn(x), seconds)
    return (time.perf_counter() - t0) / calls * 1e3


def _framework_paced(
    fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, seconds: float, interval: float
) -> float:
    """ms per call, one call every ``interval`` seconds (idle in between), as the server
    side's calls come: one per request of a client that waits for each answer."""
    spent, calls, t0 = 0.0, 0, time.perf_counter()
    while calls < MIN_CALLS or time.perf_counter() - t0 < seconds:
        start = time.perf_counter()
        fn(x)
        took = time.perf_counter() - start
        spent += took
        calls += 1
        if interval > took:
            time.sleep(interval - took)
    return spent / calls * 1e3


def measure(
    rounds: int, seconds: float, batches: list[int], models: list[str] | None = None
) -> dict[str, Any]:
    """Alternate server and in-process rounds per (model, batch) of ``models`` (default
    all of :data:`MODELS`); the figures."""
    import tritonclient.http as httpclient

    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="bench-frameworks-"))
    proc, port, _, ready_s = start_server(_bench_repo(tmp, models or list(MODELS)), core=None)  # type: ignore[arg-type]  # no pinning: each framework's threads
    rows: list[dict[str, Any]] = []
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=300)
        for model in models or list(MODELS):
            shape = MODELS[model][2]
            fn = _in_process(model)
            for b in batches:
                x = rng.standard_normal((b, *shape)).astype(np.float32)
                fn(x), _server_side(client, port, model, x, 0)  # warm both sides
                server, framework, paced = [], [], []
                for _ in range(rounds):
                    ms, interval = _server_side(client, port, model, x, seconds)
                    server.append(ms)
                    framework.append(_framework_side(fn, x, seconds))
                    paced.append(_framework_paced(fn, x, seconds, interval))
                ratios = [s / f for s, f in zip(server, framework, strict=True)]
                paced_ratios = [s / f for s, f in zip(server, paced, strict=True)]
                rows.append(
                    {
                        "model": model,
                        "batch": b,
                        "server_ms": statistics.median(server),
                        "framework_ms": statistics.median(framework),
                        "ratio": statistics.median(server) / statistics.median(framework),
                        "ratio_range": [min(ratios), max(ratios)],
                        "paced_ms": statistics.median(paced),
                        "paced_ratio": statistics.median(server) / statistics.median(paced),
                        "paced_ratio_range": [min(paced_ratios), max(paced_ratios)],
                        "server_rounds_ms": server,
                        "framework_rounds_ms": framework,
                        "paced_rounds_ms": paced,
                    }
                )
                print(f"  {model} b={b}: {rows[-1]['ratio']:.3f}", file=sys.stderr, flush=True)
                OUT.mkdir(parents=True, exist_ok=True)  # what is measured so far survives a kill
                (OUT / "bench_frameworks.partial.json").write_text(json.dumps(rows, indent=2))
    finally:
        stop_process(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"ready_s": ready_s, "rounds": rounds, "seconds": seconds, "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table."""
    lines = [
        "| model | batch | pdserve compute ms | framework ms, hot loop | ratio (range) "
        "| framework ms, paced | ratio (range) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lo, hi = r["ratio_range"]
        plo, phi = r["paced_ratio_range"]
        lines.append(
            f"| `{r['model']}` | {r['batch']} | {r['server_ms']:.3f} | {r['framework_ms']:.3f} "
            f"| {r['ratio']:.2f} ({lo:.2f}-{hi:.2f}) | {r['paced_ms']:.3f} "
            f"| {r['paced_ratio']:.2f} ({plo:.2f}-{phi:.2f}) |"
        )
    return "\n".join(lines)


def separately(args: argparse.Namespace, models: list[str]) -> dict[str, Any]:
    """Each model measured by a child run of this script (``--together --models M``):
    its own server and its own in-process side, no other framework loaded in either."""
    rows: list[dict[str, Any]] = []
    ready = 0.0
    for model in models:
        out = OUT / f"bench_frameworks.{model}.json"
        cmd = [
            sys.executable, __file__, "--together", "--models", model, "--rounds",
            str(args.rounds), "--seconds", str(args.seconds), "--batches", args.batches,
            "--out", str(out),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        part = json.loads(out.read_text())
        rows += part["rows"]
        ready = max(ready, part["ready_s"])
    return {"ready_s": ready, "rounds": args.rounds, "seconds": args.seconds, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table, write the JSON."""
    parser = cli_parser(__doc__, __file__)
    parser.add_argument("--rounds", type=int, default=4, help="alternated rounds (default 4)")
    parser.add_argument("--seconds", type=float, default=0.5, help="per side of a round")
    parser.add_argument("--batches", default="1,8,64", help="batch sizes (default 1,8,64)")
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma list (default all: %(default)s)"
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="one server holding every model, one process for the in-process side "
        "(default: each model in a process of its own on both sides)",
    )
    parser.add_argument("--out", type=Path, default=OUT / "bench_frameworks.json")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if bad := [m for m in models if m not in MODELS]:
        parser.error(f"unknown model(s) {bad}; choose from {', '.join(MODELS)}")
    interrupt_on_sigterm()  # a SIGTERM still stops the server (finally)
    if not REPO.is_dir():
        print("examples/framework_repository is missing: run examples/build_frameworks.py")
        return 1
    t0 = time.monotonic()
    if args.together or len(models) == 1:
        batches = [int(b) for b in args.batches.split(",")]
        report = measure(args.rounds, args.seconds, batches, models)
    else:
        report = separately(args, models)
    report["together"] = args.together
    report["elapsed_s"] = time.monotonic() - t0
    report["nproc"] = os.cpu_count()
    report["uname"] = subprocess.run(["uname", "-srm"], capture_output=True, text=True).stdout
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\n{report['elapsed_s']:.0f} s; server ready in {report['ready_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
