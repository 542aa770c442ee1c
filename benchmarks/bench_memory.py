"""Issue 16 item 4: memory per model and on-demand load latency, example repository.

pdserve serves ``examples/model_repository`` in ``--model-control-mode on_demand``
with nothing loaded and no budget. For each model (plain models sorted by name, then
ensembles, whose steps are then already loaded), one *cold* request (it finds the
model not loaded: the server loads it, warms it up, measures it, then runs the
request) and ``--warm`` warm requests; the cold latency minus the warm median is the
on-demand load cost. Inputs: the goldens' data where there is some (digits, tiny,
efficientnet_lite0 images, photos for preprocess / image_classifier, sentences for
tokenize / text_embedding), else zeros of the configured shape (variable dims: 8).
Every answer must be 200.

After the requests, the memory table is the repository index's ``memory_bytes`` /
``memory_source`` per version, next to the server's process tree Rss before the
first load and at the end (``pdserve.core.procmem.tree_memory``).

Usage::

    .venv/bin/python benchmarks/bench_memory.py [--runs 3] [--warm 5] [--out benchmarks/out/memory.json]

Prints a Markdown summary; figures as JSON in ``--out``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import cli_parser, start_server, stop_process  # noqa: E402
from pdserve import config as cfgmod  # noqa: E402
from pdserve.core.datatypes import v2_to_numpy  # noqa: E402
from pdserve.core.procmem import format_size, tree_memory  # noqa: E402

REPO = ROOT / "examples" / "model_repository"
GOLDENS = ROOT / "examples" / "goldens"
SENTENCE = b"A memory budget keeps many models on one machine."


def sample_inputs(name: str, cfg: Any) -> list[httpclient.InferInput]:
    """One valid request's inputs for model ``name`` (batch 1 where it batches); none
    when it has no config.pbtxt or declares no inputs (auto-complete)."""
    if cfg is None:
        return []
    batched = cfg.max_batch_size > 0
    out = []
    for inp in cfg.input:
        dt = cfgmod.datatype_of(inp)
        dims = [8 if d < 0 else d for d in inp.dims]
        shape = ([1] if batched else []) + dims
        arr: np.ndarray
        if dt == "BYTES":
            item: bytes = SENTENCE
            if "image" in inp.name:
                g = np.load(GOLDENS / "efficientnet_lite0.npz")
                item = g["image_bytes_china"].tobytes()
            arr = np.full(shape, item, dtype=object)
        elif name == "digits":
            arr = np.load(GOLDENS / "digits.npz")["X_test"][:1]
        elif name == "efficientnet_lite0":
            arr = np.load(GOLDENS / "efficientnet_lite0.npz")["inputs"][:1]
        elif name.startswith("tiny") and dt == "FP32" and dims == [64]:
            arr = np.load(GOLDENS / "tiny.npz")["inputs"][:1]
        elif dt == "INT64" and "mask" in inp.name:
            arr = np.ones(shape, np.int64)
        else:
            arr = np.zeros(shape, v2_to_numpy(dt))
        x = httpclient.InferInput(inp.name, list(arr.shape), dt)
        x.set_data_from_numpy(arr, binary_data=True)
        out.append(x)
    return out


def timed(
    client: httpclient.InferenceServerClient, name: str, inputs: list[Any], fail_ok: bool = False
) -> float:
    """Seconds one request took (it must succeed unless ``fail_ok``)."""
    t0 = time.perf_counter()
    try:
        client.infer(name, inputs)
    except Exception:
        if not fail_ok:
            raise
    return time.perf_counter() - t0


def inputs_from_metadata(client: httpclient.InferenceServerClient, name: str) -> list[Any]:
    """Zeros for the inputs the served model reports (auto-completed configurations)."""
    out = []
    for inp in client.get_model_metadata(name)["inputs"]:
        shape = [1 if d < 0 else d for d in inp["shape"]]
        x = httpclient.InferInput(inp["name"], shape, inp["datatype"])
        x.set_data_from_numpy(np.ones(shape, v2_to_numpy(inp["datatype"])), binary_data=True)
        out.append(x)
    return out


def one_run(order: list[str], models: dict[str, Any], warm_n: int) -> dict[str, Any]:
    """A fresh on_demand server: cold + warm requests to every model in ``order``."""
    proc, port, _, ready_s = start_server(REPO, "--model-control-mode=on_demand", core=None)
    url = f"127.0.0.1:{port}"
    try:
        before = tree_memory(proc.pid)
        client = httpclient.InferenceServerClient(url, network_timeout=300)
        rows = []
        for name in order:
            inputs = sample_inputs(name, models[name])
            # no inputs in config.pbtxt (auto-complete): the cold request carries none
            # and is answered 400, after the load it caused
            cold = timed(client, name, inputs, fail_ok=not inputs)
            if not inputs:
                inputs = inputs_from_metadata(client, name)
            warm = statistics.median(timed(client, name, inputs) for _ in range(warm_n))
            rows.append({"model": name, "cold_s": cold, "warm_median_s": warm})
            print(f"{name}: cold {cold * 1000:.0f} ms, warm {warm * 1000:.1f} ms", flush=True)
        req = urllib.request.Request(f"http://{url}/v2/repository/index", data=b"{}")
        with urllib.request.urlopen(req) as r:
            index = json.loads(r.read())
        after = tree_memory(proc.pid)
    finally:
        stop_process(proc)
    return {
        "ready_s": ready_s,
        "tree_rss_before": before.rss if before else None,
        "tree_rss_after": after.rss if after else None,
        "tree_processes": after.processes if after else None,
        "index": index,
        "latency": rows,
    }


def main() -> None:
    ap = cli_parser(__doc__, __file__)
    ap.add_argument("--warm", type=int, default=5, help="warm requests per model")
    ap.add_argument("--runs", type=int, default=3, help="fresh servers, one after the other")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "memory.json")
    args = ap.parse_args()

    models: dict[str, Any] = {}
    for d in sorted(REPO.iterdir()):
        if d.is_dir() and not d.name.startswith("."):
            has_config = (d / cfgmod.CONFIG_FILENAME).is_file()
            models[d.name] = cfgmod.load_model_config(d) if has_config else None
    order = [n for n, c in models.items() if c is None or c.platform != cfgmod.ENSEMBLE_PLATFORM]
    order += [n for n in models if n not in order]

    runs = [one_run(order, models, args.warm) for _ in range(args.runs)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(runs, indent=1))

    sizes: dict[tuple[str, str], list[int]] = {}
    source: dict[tuple[str, str], str] = {}
    for run in runs:
        for r in run["index"]:
            if r.get("state") == "READY":
                key = (r["name"], r["version"])
                sizes.setdefault(key, []).append(r["memory_bytes"])
                source[key] = r["memory_source"]
    cold = {
        n: statistics.median(r["cold_s"] for run in runs for r in run["latency"] if r["model"] == n)
        for n in order
    }
    warm = {
        n: statistics.median(
            r["warm_median_s"] for run in runs for r in run["latency"] if r["model"] == n
        )
        for n in order
    }

    print(f"\n{args.runs} runs. memory_bytes: min - max over runs; latencies: medians over runs")
    print("\n| model | version | memory_bytes | source | cold request | warm | load cost |")
    print("|---|---|---|---|---|---|---|")
    for (name, version), vals in sorted(sizes.items()):
        lo, hi = min(vals), max(vals)
        mem = format_size(lo) if lo == hi else f"{format_size(lo)} - {format_size(hi)}"
        print(
            f"| {name} | {version} | {mem} | {source[(name, version)]} "
            f"| {cold[name] * 1000:.0f} ms | {warm[name] * 1000:.1f} ms "
            f"| {(cold[name] - warm[name]) * 1000:.0f} ms |"
        )
    for i, run in enumerate(runs, 1):
        total = sum(r.get("memory_bytes", 0) for r in run["index"] if r.get("state") == "READY")
        before, after = run["tree_rss_before"], run["tree_rss_after"]
        if before and after:
            print(
                f"\nrun {i}: sum of memory_bytes {format_size(total)}; server tree Rss "
                f"{format_size(before)} before the first load -> {format_size(after)} after "
                f"(+{format_size(after - before)}, {run['tree_processes']} processes)"
            )


if __name__ == "__main__":
    main()
