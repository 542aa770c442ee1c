"""cProfile of pdserve's in-process path for one-row requests to the tiny model (issue 11,
point 2): what the core does per request, without any HTTP transport.

Builds the server as ``pdserve serve`` does (``build_server`` from default settings,
metrics hooks installed, a trace manager with tracing off) on ``bench_frontend.py``'s
repository (the tiny 64->64 ONNX model, ``max_batch_size: 32``, 2 ms queue delay,
1 ORT thread), then runs ``--concurrency`` coroutines, each looping: decode the
one-row V2 JSON body (``decode_infer_request``), ``admission.begin_request``,
``InferenceServer.infer``, encode the response (``encode_infer_response_parts``).

Usage::

    .venv/bin/python benchmarks/profile_hotpath.py [--requests 20000] [--concurrency 32]
        [--top 30] [--no-profile] [--root OTHER_CHECKOUT]

Prints requests/s (CPU-bound on one core; with the profiler on it is slower) and the
top functions by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

from common import cli_parser

ROOT = Path(__file__).resolve().parents[1]


async def run(args: argparse.Namespace) -> None:
    from bench_frontend import build_repo

    from pdserve.app.build import build_server
    from pdserve.app.settings import Settings, add_arguments
    from pdserve.frontends.admission import begin_request
    from pdserve.frontends.http.decode import decode_infer_request
    from pdserve.frontends.http.encode import encode_infer_response_parts
    from pdserve.observability import metrics

    repo = build_repo()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--model-repository", str(repo)])
    settings = Settings.from_namespace(ns)
    metrics.install_hooks()
    server = build_server(settings)
    await server.start()
    row = [0.5] * 64
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": row}]}
    ).encode()
    left = args.requests

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            request = decode_infer_request(body, None, "tiny", "", time.monotonic_ns())
            begin_request(request.id, None)
            response = await server.infer(request)
            encode_infer_response_parts(response, request, None)

    # warm up
    left = 2000
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    left = args.requests
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    c0 = time.process_time()
    n0 = server.model_statistics("tiny")["model_stats"][0]["execution_count"]
    if prof is not None:
        prof.enable()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    batches = server.model_statistics("tiny")["model_stats"][0]["execution_count"] - n0
    print(
        f"{args.requests / wall:.0f} req/s in-process, {cpu / args.requests * 1e6:.1f} CPU-us "
        f"per request ({args.requests} requests in {batches} batches, {wall:.2f} s)"
    )
    await server.stop(5)
    if prof is not None:
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key).print_stats(args.top)
            print(out.getvalue())


def main() -> None:
    """Parse the flags and run the profile on uvloop (as ``pdserve serve`` does)."""
    p = cli_parser(__doc__, __file__)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--root",
        type=Path,
        default=ROOT,
        help="the pdserve checkout to profile (default: this one)",
    )
    args = p.parse_args()
    sys.path.insert(0, str(args.root))
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
