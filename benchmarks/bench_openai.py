"""The OpenAI front end's ``/v1/embeddings`` against the V2 route on the same pipeline.

pdserve serves the example ``text_embedding`` pipeline (tokenize -> minilm -> pool; its
own copy of the four models). ``benchmarks/loadgen.py`` (closed loop, C requests in
flight) sends the same sentences (the ordinary ones of ``examples/perf/sentences.json``) in batches of B:

- ``v2``: ``POST /v2/models/text_embedding/infer``, JSON ``BYTES [B, 1]`` in, JSON out;
- ``openai-float``: ``POST /v1/embeddings`` with ``encoding_format: float``;
- ``openai-base64``: the same with ``base64`` (what the ``openai`` client asks for);
- ``fastapi-float``, ``fastapi-base64``: the same two requests to the plainest common
  alternative, ``benchmarks/peers/fastapi_embeddings.py`` (FastAPI + the same ONNX
  model and tokenizer, one uvicorn process). Before the rounds, its vectors are checked
  against pdserve's (within 1e-5).

Rounds alternate the order of the routes; each point is bounded in time and requests.
Servers and client share the machine's cores (the pipeline's python stages need them). With
``--codec``, no server: the front ends' own work per request in process (the body
parsed into the request, the vectors encoded into the answer), the least of 5 rounds.
Usage::

    .venv/bin/python benchmarks/bench_openai.py [--duration 4] [--rounds 4] [--concurrency 8] [--batches 1,16]
    .venv/bin/python benchmarks/bench_openai.py --codec

Prints a Markdown table (medians over the rounds, and each route's ratio to v2 and
to the FastAPI route of the same encoding, each the median of the per-round ratios
with their range) and writes the raw figures to ``benchmarks/out/openai.json``.
"""

from __future__ import annotations

import base64
import json
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    LOADGEN,
    PY,
    REPO,
    ROOT,
    cli_parser,
    free_port,
    run_client,
    start_server,
    stop_process,
    taskset,
)

MODELS = ("text_embedding", "tokenize", "minilm", "pool")
ROUTES = ("v2", "openai-float", "openai-base64", "fastapi-float", "fastapi-base64")
PEER = ROOT / "benchmarks" / "peers" / "fastapi_embeddings.py"
MAX_REQUESTS = 200_000


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


def start_fastapi() -> tuple[subprocess.Popen[bytes], int]:
    """Start the FastAPI peer on cores 0-1; return (process, port) once it answers."""
    port = free_port()
    onnx = REPO / "minilm" / "1" / "model.onnx"
    tok = REPO / "tokenize" / "1" / "tokenizer.json"
    cmd = [*taskset("0-1"), PY, str(PEER), str(onnx), str(tok), str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the FastAPI peer exited")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=1):
                return proc, port
        except OSError:
            time.sleep(0.2)
    stop_process(proc)
    raise RuntimeError("the FastAPI peer did not answer")


def vectors(route: str, port: int, batch: int) -> np.ndarray:
    """The embeddings one request of ``route`` answers, FP32 ``[batch, 384]``."""
    url, body = request(route, port, batch)
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        doc = json.loads(r.read())
    if route == "v2":
        out = doc["outputs"][0]
        return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    items = sorted(doc["data"], key=lambda d: d["index"])
    if route.endswith("base64"):
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in items])
    return np.asarray([d["embedding"] for d in items], dtype=np.float32)


def check_vectors(pd_port: int, fa_port: int, batch: int) -> float:
    """Largest absolute difference between pdserve's and the peer's vectors (raises
    over 1e-5, or when the routes' shapes differ)."""
    ref = vectors("v2", pd_port, batch)
    worst = 0.0
    for route in ROUTES[1:]:
        got = vectors(route, fa_port if route.startswith("fastapi") else pd_port, batch)
        if got.shape != ref.shape:
            raise RuntimeError(f"{route}: shape {got.shape} != {ref.shape}")
        worst = max(worst, float(np.abs(got - ref).max()))
    if worst > 1e-5:
        raise RuntimeError(f"vectors differ by {worst:g} (> 1e-5)")
    return worst


def point(route: str, port: int, batch: int, concurrency: int, duration: float) -> dict[str, Any]:
    url, body = request(route, port, batch)
    result: dict[str, Any] = run_client(
        str(LOADGEN),
        "--url",
        url,
        body,
        concurrency,
        duration,
        extra=[
            "--warmup",
            "1",
            "--max-requests",
            str(MAX_REQUESTS),
            "--header",
            "Content-Type: application/json",
        ],
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
            peer, peer_port = start_fastapi()
            try:
                for batch in batches:
                    diff = check_vectors(port, peer_port, batch)
                    print(f"batch {batch}: vectors of every route within {diff:.1e} of v2's")
                for r in range(args.rounds):
                    order = ROUTES if r % 2 == 0 else tuple(reversed(ROUTES))
                    for batch in batches:
                        for route in order:
                            target = peer_port if route.startswith("fastapi") else port
                            res = point(route, target, batch, args.concurrency, args.duration)
                            runs.setdefault(f"{route} b={batch}", []).append(res)
            finally:
                stop_process(peer)
        finally:
            stop_process(proc)
    out = ROOT / "benchmarks" / "out"
    out.mkdir(exist_ok=True)
    (out / "openai.json").write_text(json.dumps(runs, indent=1))
    print(table(runs, batches, args.concurrency))
    return 0


def ratio(runs: dict[str, list[dict[str, Any]]], num: str, den: str) -> str:
    """Median [min-max] of the per-round req/s ratios ``num / den``."""
    rs = [
        a["rps"] / b["rps"] if b["rps"] else float("nan")
        for a, b in zip(runs[num], runs[den], strict=True)
    ]
    return f"{statistics.median(rs):.2f} [{min(rs):.2f}-{max(rs):.2f}]"


def table(runs: dict[str, list[dict[str, Any]]], batches: list[int], concurrency: int) -> str:
    """Medians per point (ranges in brackets), each round's req/s, and the ratios to the
    V2 route and (pdserve's OpenAI routes) to the FastAPI route of the same encoding."""
    lines = [
        f"| route, batch (c={concurrency}) | req/s | req/s per round | p99 ms | errors"
        " | req/s vs v2 | req/s vs fastapi |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in batches:
        for route in ROUTES:
            rs = runs[f"{route} b={batch}"]
            rps = [r["rps"] for r in rs]
            p99 = [r["p99_ms"] for r in rs]
            errors = sum(r["errors"] for r in rs)
            peer = "fastapi-" + route.split("-", 1)[1] if route.startswith("openai") else None
            vs_peer = ratio(runs, f"{route} b={batch}", f"{peer} b={batch}") if peer else ""
            lines.append(
                f"| {route}, {batch} | {statistics.median(rps):.1f} [{min(rps):.1f}-{max(rps):.1f}]"
                f" | {', '.join(f'{x:.1f}' for x in rps)}"
                f" | {statistics.median(p99):.1f} [{min(p99):.1f}-{max(p99):.1f}] | {errors}"
                f" | {ratio(runs, f'{route} b={batch}', f'v2 b={batch}')} | {vs_peer} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
