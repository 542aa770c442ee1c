"""Issue 16: the PyTorch backend against the ONNX Runtime backend, efficientnet-lite0 on CPU.

Both examples of the same network and weights (``efficientnet_lite0``: ONNX, and
``efficientnet_lite0_torch``: TorchScript, from ``examples/build.py``) are loaded by
pdserve's own backends in this process (``OnnxRuntimeBackend`` / ``PyTorchBackend``,
one ``KIND_CPU`` instance each, their default thread counts: every core of the process)
and driven through ``ModelInstance.execute`` -- the path a scheduler takes, without
HTTP. Inputs are the real photos of the goldens, tiled to the batch size. For each
batch size the two backends take turns (ORT, torch, ORT, torch ...) in short rounds, so
both see the same machine load; each round runs ``--seconds`` (after three warm-up
batches that are not timed). ``--threads N`` gives both the same intra-op thread count
(torch's is process-wide; ORT's per session). Reported: images/s and the p50 time of one batch, per
backend and batch size; the best batch; the torch/ORT ratio at batch 1 and at each
one's best batch. Outputs are checked against the golden logits (1e-3) first.

Usage::

    .venv/bin/python benchmarks/bench_pytorch.py [--batches 1,2,4,8,16,32] [--seconds 2] [--rounds 2] [--threads N]

Prints a Markdown table and writes ``benchmarks/out/bench_pytorch_t<threads>.json``. Bounded:
``len(batches) * rounds * 2 * (seconds + one batch)``, ~1 minute by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import cli_parser

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve import config as cfgmod  # noqa: E402
from pdserve.backends.base import ExecRequest, ModelInstance, ModelSpec  # noqa: E402
from pdserve.core.types import InferRequest  # noqa: E402

REPO = ROOT / "examples" / "model_repository"
GOLDENS = ROOT / "examples" / "goldens"
OUT = ROOT / "benchmarks" / "out"
#: untimed batches before each round
WARMUP = 3

#: backend -> (model name, input, output)
MODELS = {
    "onnxruntime": ("efficientnet_lite0", "input", "logits"),
    "pytorch": ("efficientnet_lite0_torch", "INPUT__0", "OUTPUT__0"),
}


def _spec(name: str, threads: int) -> ModelSpec:
    model_dir = REPO / name
    cfg = cfgmod.load_model_config(model_dir)
    cfgmod.normalize_platform(cfg, model_dir / "config.pbtxt")
    from tritonclient.grpc import model_config_pb2 as mc

    del cfg.instance_group[:]
    cfg.instance_group.add(name=name, count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    if threads:
        key = "INTRA_OP_THREAD_COUNT" if cfg.backend == "pytorch" else "intra_op_thread_count"
        cfg.parameters[key].string_value = str(threads)
    return ModelSpec(name, 1, cfg, model_dir, model_dir / "1", REPO)


async def _load(backend_name: str, threads: int) -> ModelInstance:
    from pdserve.backends.registry import get_backend

    name = MODELS[backend_name][0]
    spec = _spec(name, threads)
    backend = get_backend(backend_name)
    completing = backend.auto_complete(spec)
    if asyncio.iscoroutine(completing):
        await completing
    cfgmod.apply_defaults(spec.config)
    instances = await backend.load(spec)
    return instances[0]


def _batch(images: np.ndarray, size: int, input_name: str, output: str) -> list[ExecRequest]:
    reps = -(-size // len(images))
    x = np.ascontiguousarray(np.tile(images, (reps, 1, 1, 1))[:size])
    return [ExecRequest({input_name: x}, [output], InferRequest("bench"), size)]


async def _round(instance: ModelInstance, batch: list[ExecRequest], seconds: float) -> list[float]:
    for _ in range(WARMUP):  # not timed (TorchScript's profiling executor specialises
        await instance.execute(batch)  # on the first runs of each new shape)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or not times:
        start = time.perf_counter()
        await instance.execute(batch)
        times.append(time.perf_counter() - start)
    return times


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with np.load(GOLDENS / "efficientnet_lite0_torch.npz") as g:
        images, logits = g["inputs"], g["logits"]
    instances = {b: await _load(b, args.threads) for b in MODELS}
    # correctness first: both give the golden logits for the photos
    for b, instance in instances.items():
        _, inp, out = MODELS[b]
        got = (await instance.execute(_batch(images, len(images), inp, out)))[0]
        assert isinstance(got, dict)
        diff = float(np.max(np.abs(got[out] - logits)))
        if diff > 1e-3:
            raise SystemExit(f"{b}: logits differ from the golden by {diff:.2g}")
        print(f"{b}: golden logits within {diff:.1e}", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, dict[int, dict[str, float]]] = {b: {} for b in MODELS}
    times: dict[str, dict[int, list[float]]] = {b: {n: [] for n in batches} for b in MODELS}
    for n in batches:
        for _ in range(args.rounds):
            for b, instance in instances.items():
                _, inp, out = MODELS[b]
                times[b][n] += await _round(instance, _batch(images, n, inp, out), args.seconds)
        for b in MODELS:
            t = times[b][n]
            results[b][n] = {
                "images_per_s": n * len(t) / sum(t),
                "p50_ms": statistics.median(t) * 1e3,
                "batches": len(t),
            }
            print(
                f"batch {n:>3} {b:<12} {results[b][n]['images_per_s']:8.1f} images/s  "
                f"p50 {results[b][n]['p50_ms']:8.1f} ms ({len(t)} batches)",
                flush=True,
            )
    for instance in instances.values():
        await instance.close()
    import onnxruntime
    import torch

    best = {b: max(results[b], key=lambda n: results[b][n]["images_per_s"]) for b in MODELS}
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average_before": args.load_before,
        "load_average_after": os.getloadavg(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "threads_asked": args.threads,
        "onnxruntime": onnxruntime.__version__,
        "seconds_per_round": args.seconds,
        "rounds": args.rounds,
        "results": results,
        "best_batch": best,
        "ratio_torch_over_ort": {
            "batch_1": results["pytorch"][batches[0]]["images_per_s"]
            / results["onnxruntime"][batches[0]]["images_per_s"],
            "best": results["pytorch"][best["pytorch"]]["images_per_s"]
            / results["onnxruntime"][best["onnxruntime"]]["images_per_s"],
        },
    }


def markdown(report: dict[str, Any]) -> str:
    """The Markdown table of a report."""
    res = report["results"]
    lines = [
        "| batch | ORT images/s | ORT p50 ms | PyTorch images/s | PyTorch p50 ms | PyTorch / ORT |",
        "|---|---|---|---|---|---|",
    ]
    for n in res["onnxruntime"]:
        o, p = res["onnxruntime"][n], res["pytorch"][n]
        lines.append(
            f"| {n} | {o['images_per_s']:.1f} | {o['p50_ms']:.1f} | {p['images_per_s']:.1f} | "
            f"{p['p50_ms']:.1f} | {p['images_per_s'] / o['images_per_s']:.2f} |"
        )
    r = report["ratio_torch_over_ort"]
    lines.append("")
    lines.append(
        f"Best batch: ORT {report['best_batch']['onnxruntime']}, PyTorch "
        f"{report['best_batch']['pytorch']}; PyTorch / ORT at batch 1 **{r['batch_1']:.2f}**, "
        f"at each one's best batch **{r['best']:.2f}**."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; exit code 0 on success."""
    parser = cli_parser(__doc__, __file__)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--seconds", type=float, default=2.0, help="per round and batch size")
    parser.add_argument("--rounds", type=int, default=2, help="turns per backend and batch size")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads of both backends (0: their defaults, every core)",
    )
    args = parser.parse_args(argv)
    if not (REPO / MODELS["pytorch"][0]).is_dir():
        print("examples/model_repository lacks efficientnet_lite0_torch: run examples/build.py")
        return 1
    args.load_before = os.getloadavg()
    report = asyncio.run(main_async(args))
    report["results"] = {b: {str(n): v for n, v in r.items()} for b, r in report["results"].items()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"bench_pytorch_t{args.threads}.json").write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
