"""In process, the scheduler's compute span of one FIL or TensorFlow model instance (the
time ``run_batch`` spends on a one-request batch, which the statistics extension records
as compute) against the framework's own call on the same rows, alternated call by call,
at batch 1, 8 and 64: the minimum and the median of each side and their ratios.

Models: ``examples/tree_repository``'s ``lightgbm_diabetes`` (LightGBM ``Booster.predict``,
one thread) and ``xgboost_breast_cancer`` (XGBoost ``inplace_predict``, one thread), and
``examples/framework_repository``'s ``iris_keras`` (the SavedModel's ``serving_default``).
The process is pinned to core 0. The minimum stands for a quiet machine where a loaded
one inflates means (other processes preempt either side); the median is given beside it.
No HTTP: what this measures is the backend's own share of the compute time, the part
``benchmarks/bench_trees.py`` (``compute``) and ``benchmarks/bench_frameworks.py``
compare with the framework over HTTP.

Usage::

    .venv/bin/python benchmarks/bench_compute_span.py [--backends fil,tensorflow] [--calls 300]

Prints one line per (model, batch) and the figures as JSON (last line); under a minute.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from common import ROOT, cli_parser

EXAMPLES = ROOT / "examples"
#: backend -> (repository, {model: (input, output)})
MODELS: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "fil": (
        "tree_repository",
        {
            "lightgbm_diabetes": ("input__0", "output__0"),
            "xgboost_breast_cancer": ("input__0", "output__0"),
        },
    ),
    "tensorflow": ("framework_repository", {"iris_keras": ("features", "probabilities")}),
}


def framework_call(model: str) -> Callable[[np.ndarray], Any]:
    """The framework's own in-process call on ``model``'s file."""
    if model == "lightgbm_diabetes":
        import lightgbm

        lgb = lightgbm.Booster(
            model_file=str(EXAMPLES / "tree_repository" / model / "1" / "model.txt")
        )
        return lambda a: lgb.predict(a, num_threads=1)
    if model == "xgboost_breast_cancer":
        import xgboost

        xgb = xgboost.Booster(
            model_file=str(EXAMPLES / "tree_repository" / model / "1" / "xgboost.json")
        )
        xgb.set_param({"nthread": 1})
        return xgb.inplace_predict
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    path = EXAMPLES / "framework_repository" / model / "1" / "model.savedmodel"
    fn = tf.saved_model.load(str(path)).signatures["serving_default"]
    return lambda x: fn(features=tf.constant(x))["probabilities"].numpy()


async def load_instance(backend: str, repo: str, model: str) -> Any:
    """One instance of ``model`` loaded by pdserve's backend (auto-completed config)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from pdserve.backends.base import ModelSpec

    d = EXAMPLES / repo / model
    cfg = text_format.Parse((d / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    if backend == "fil":
        from pdserve.backends.fil.backend import FilBackend as Loader
    else:
        from pdserve.backends.tensorflow.backend import TensorFlowBackend as Loader

        cfg.backend = "tensorflow"  # what the repository makes of the platform
    spec = ModelSpec(model, 1, cfg, d, d / "1", EXAMPLES / repo)
    loader = Loader()
    await loader.auto_complete(spec)
    (inst,) = await loader.load(spec)
    return inst


async def measure_model(backend: str, repo: str, model: str, calls: int) -> dict[str, Any]:
    """``{"<model>@<batch>": {srv_min, srv_med, fw_min, fw_med}}`` in µs."""
    from pdserve.backends.base import ExecRequest
    from pdserve.core.stats import ModelStats
    from pdserve.core.types import InferRequest
    from pdserve.scheduling.base import run_batch

    inst = await load_instance(backend, repo, model)
    fw, (inp, outp) = framework_call(model), MODELS[backend][1][model]
    stats, out = ModelStats(model, "1"), {}
    with np.load(EXAMPLES / repo / model / "1" / "golden.npz") as g:
        x0 = g[next(k for k in g.files if k.startswith("input"))]
    for b in (1, 8, 64):
        x = np.ascontiguousarray(np.resize(x0, (b, x0.shape[1])), dtype=np.float32)
        srv, fwk = [], []
        for i in range(calls + 20):  # 20 warm-up calls each
            req = ExecRequest({inp: x}, [outp], InferRequest(model), b)
            t0 = time.perf_counter_ns()
            (res,) = await run_batch(inst, [req], stats)
            t1 = time.perf_counter_ns()
            fw(x)
            t2 = time.perf_counter_ns()
            assert isinstance(res, dict), res
            if i >= 20:
                srv.append((t1 - t0) / 1e3)
                fwk.append((t2 - t1) / 1e3)
            await asyncio.sleep(0)
        r = {"srv_min": min(srv), "srv_med": statistics.median(srv)}
        r |= {"fw_min": min(fwk), "fw_med": statistics.median(fwk)}
        out[f"{model}@{b}"] = r
        print(
            f"{model}@{b}: compute min {r['srv_min']:.1f} med {r['srv_med']:.1f} us | framework "
            f"min {r['fw_min']:.1f} med {r['fw_med']:.1f} us | ratio min "
            f"{r['srv_min'] / r['fw_min']:.2f} med {r['srv_med'] / r['fw_med']:.2f}",
            flush=True,
        )
    await inst.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure; print a line per point and the JSON."""
    parser = cli_parser(__doc__, __file__)
    parser.add_argument("--backends", default="fil,tensorflow", help="fil and/or tensorflow")
    parser.add_argument("--calls", type=int, default=300, help="calls per point (default 300)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.sched_setaffinity(0, {0})
    report: dict[str, Any] = {}
    for backend in args.backends.split(","):
        repo, models = MODELS[backend]
        for model in models:
            report |= asyncio.run(measure_model(backend, repo, model, args.calls))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
