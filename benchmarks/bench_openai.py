"""The OpenAI front end's ``/v1/embeddings`` against the V2 route on the same pipeline.

pdserve serves the example ``text_embedding`` pipeline (tokenize -> minilm -> pool; its
own copy of the four models). ``benchmarks/loadgen.py`` (closed loop, C requests in
flight) sends the same sentences (the ordinary ones of ``examples/perf/sentences.json``) in batches of B:

- ``v2``: ``POST /v2/models/text_embedding/infer``, JSON ``BYTES [B, 1]`` in, JSON out;
- ``openai-float``: ``POST /v1/embeddings`` with ``encoding_format: float``;
- ``openai-base64``: the same with ``base64`` (what the ``openai`` client asks for).

Rounds alternate the order of the routes; each point is bounded in time. Server and
client share the machine's cores (the pipeline's python stages need them). With
``--codec``, no server: the front ends' own work per request in process (the body
parsed into the request, the vectors encoded into the answer), the least of 5 rounds.
Usage::

    .venv/bin/python benchmarks/bench_openai.py [--duration 4] [--rounds 4] [--concurrency 8]
    .venv/bin/python benchmarks/bench_openai.py --codec

Prints a Markdown table (medians over the rounds, and each route's ratio to v2) and
writes the raw figures to ``benchmarks/out/openai.json``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import LOADGEN, REPO, ROOT, cli_parser, run_client, start_server, stop_process

MODELS = ("text_embedding", "tokenize", "minilm", "pool")
ROUTES = ("v2", "openai-float", "openai-base64")


def sentences(n: int) -> list[str]:
    """``n`` of the perf inputs' ordinary sentences (repeated in turn): the empty one
    (which /v1/embeddings refuses, as OpenAI) and the 2,000-character one (which pads
    every sentence of its batch to 512 tokens) are left out."""
    doc = json.loads((ROOT / "examples" / "perf" / "sentences.json").read_text())
    texts = [row["text"][0] for row in doc["data"] if 0 < len(row["text"][0]) <= 200]
    return [texts[i % len(texts)] for i in range(n)]


def request(route: str, port: int, batch: int) -> tuple[str, bytes]:
    """``(url, body)`` of one request of ``batch`` sentences on ``route``."""
    texts = sentences(batch)
    base = f"http://127.0.0.1:{port}"
    if route == "v2":
        tensor = {"name": "text", "datatype": "BYTES", "shape": [batch, 1], "data": texts}
        return f"{base}/v2/models/text_embedding/infer", json.dumps({"inputs": [tensor]}).encode()
    fmt = route.split("-", 1)[1]
    doc = {"model": "text_embedding", "input": texts, "encoding_format": fmt}
    return f"{base}/v1/embeddings", json.dumps(doc).encode()


def point(route: str, port: int, batch: int, concurrency: int, duration: float) -> dict[str, Any]:
    url, body = request(route, port, batch)
    result: dict[str, Any] = run_client(
        str(LOADGEN),
        "--url",
        url,
        body,
        concurrency,
        duration,
        extra=["--warmup", "1"],
        timeout=duration + 60,
        core="0-1",
    )
    return result


def codec_costs(batches: list[int], n: int = 2000) -> str:
    """µs per request of each front end's decode + encode (no model, no HTTP)."""
    import time

    import numpy as np
    import orjson

    from pdserve.core.types import InferRequest, InferResponse, RequestedOutput
    from pdserve.frontends.http.decode import decode_infer_request
    from pdserve.frontends.http.encode import encode_infer_response_parts
    from pdserve.frontends.openai import codec
    from pdserve.frontends.openai.routes import _text_tensor

    meta = {"name": "text", "datatype": "BYTES", "shape": [-1, 1]}
    lines = ["| batch | v2 µs | openai-float µs | openai-base64 µs |", "|---|---|---|---|"]
    for batch in batches:
        vecs = np.random.default_rng(0).standard_normal((batch, 384)).astype(np.float32)

        def v2(body: bytes, vecs: np.ndarray = vecs) -> None:
            request = decode_infer_request(body, None, "text_embedding")
            response = InferResponse("text_embedding", "1", {"embedding": vecs})
            encode_infer_response_parts(response, request)

        def openai_route(body: bytes, vecs: np.ndarray = vecs) -> None:
            req = codec.embedding_request(orjson.loads(body))
            InferRequest(
                model_name=req.model,
                inputs={"text": _text_tensor(req.texts, meta, True)},
                outputs=[RequestedOutput("embedding")],
            )
            items = [codec.embedding_item(v, i, req.base64) for i, v in enumerate(vecs)]
            codec.embeddings_body(req.model, items, 0)

        row = [str(batch)]
        for route in ROUTES:
            body = request(route, 0, batch)[1]
            func = v2 if route == "v2" else openai_route
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(n):
                    func(body)
                best = min(best, (time.perf_counter() - t0) / n * 1e6)
            row.append(f"{best:.1f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument("--codec", action="store_true", help="the front ends' codec cost only")
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per point")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--batches", default="1,16")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.codec:
        print(codec_costs(batches))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        for name in MODELS:
            shutil.copytree(REPO / name, repo / name, symlinks=True)
        proc, port, _, _ = start_server(repo, core="0-1")
        try:
            for r in range(args.rounds):
                order = ROUTES if r % 2 == 0 else tuple(reversed(ROUTES))
                for batch in batches:
                    for route in order:
                        res = point(route, port, batch, args.concurrency, args.duration)
                        runs.setdefault(f"{route} b={batch}", []).append(res)
        finally:
            stop_process(proc)
    out = ROOT / "benchmarks" / "out"
    out.mkdir(exist_ok=True)
    (out / "openai.json").write_text(json.dumps(runs, indent=1))
    print(table(runs, batches, args.concurrency))
    return 0


def table(runs: dict[str, list[dict[str, Any]]], batches: list[int], concurrency: int) -> str:
    """Medians per point (ranges in brackets) and the ratio to the V2 route."""
    lines = [
        f"| route, batch (c={concurrency}) | req/s | p99 ms | errors | req/s vs v2 |",
        "|---|---|---|---|---|",
    ]
    for batch in batches:
        base = statistics.median(r["rps"] for r in runs[f"v2 b={batch}"]) or float("nan")
        for route in ROUTES:
            rs = runs[f"{route} b={batch}"]
            rps = [r["rps"] for r in rs]
            p99 = [r["p99_ms"] for r in rs]
            errors = sum(r["errors"] for r in rs)
            lines.append(
                f"| {route}, {batch} | {statistics.median(rps):.1f} [{min(rps):.1f}-{max(rps):.1f}]"
                f" | {statistics.median(p99):.1f} [{min(p99):.1f}-{max(p99):.1f}] | {errors}"
                f" | {statistics.median(rps) / base:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
