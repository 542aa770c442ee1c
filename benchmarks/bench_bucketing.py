"""Issue 16 item 3: ``text_embedding`` on a realistic mix of sentence lengths, with and
without batching requests of different lengths (minilm's ``padding`` policy).

Sentences: every sentence of scikit-learn's dataset descriptions
(``sklearn/datasets/descr/*.rst``, English prose shipped in the venv; reST markup
lines dropped), drawn at random with a fixed seed, one sentence per request (V2 JSON,
``text`` BYTES [1,1]). Closed loop at concurrency 32 (the raw HTTP client of
``loadgen.py``), a warm-up then ``--duration`` measured seconds per mode, one pdserve
per mode on a copy of the example repository where only the configuration differs:

- ``none``: minilm without the ``padding`` parameter: requests of different lengths
  never share a batch (Triton's rule), tokenize gives each request its own length.
- ``pow2_tokenizer``: the same, with tokenize rounding lengths up to a power of two
  (``round_to_power_of_two``: how this example batched before the server could pad).
- ``max``: ``pad_to=max``: any lengths share a batch, padded to its longest.
- ``buckets``: ``pad_to=16,32,64,128,256``, each batch padded to its bucket.
- ``buckets_longest``: the same buckets with ``bucket_pad=longest``: each batch padded
  to its longest request (the shipped example's policy).
- ``buckets_longest_pool``: that, and the same policy on ``pool`` (its two inputs
  padded with 0; its output has no length), so that pool's python worker also gets
  requests of different lengths in one batch.

For every mode: requests/s, p50/p99 latency, errors, and minilm's statistics (requests
per execution, instance busy time per request). Every answer is checked (HTTP 200 with an
``embedding``). Usage::

    .venv/bin/python benchmarks/bench_bucketing.py [--duration 20] [--rounds 1] [--modes none,buckets]

Prints a Markdown table and writes ``benchmarks/out/bench_bucketing.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from common import REPO, ROOT, cli_parser, pressure, start_server, stop_process, tree_stats
from loadgen import _Conn, build_request

MODELS = ("tokenize", "minilm", "pool", "text_embedding")
MODES = ("none", "pow2_tokenizer", "max", "buckets", "buckets_longest", "buckets_longest_pool")
BUCKETS = "inputs=input_ids:0:0, attention_mask:0:0, token_type_ids:0:0; outputs=token_embeddings:0"


def sentences() -> list[str]:
    """Every sentence (3 words or more) of scikit-learn's dataset descriptions."""
    import sklearn

    descr = Path(sklearn.__file__).parent / "datasets" / "descr"
    lines = []
    for path in sorted(descr.glob("*.rst")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and not re.match(r"^\s*([=\-~*:.|+]|\.\.)", line):
                lines.append(line)
    flat = " ".join(" ".join(lines).split())
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat)
    return [s.strip() for s in parts if len(s.split()) >= 3]


def token_lengths(texts: list[str]) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(REPO / "tokenize" / "1" / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=256)
    return [len(e.ids) for e in tok.encode_batch(texts)]


def make_repo(dst: Path, mode: str) -> Path:
    """A copy of the text pipeline configured for ``mode`` (minilm's model file linked)."""
    for name in MODELS:
        if name == "minilm":
            (dst / name).mkdir(parents=True)
            (dst / name / "1").symlink_to((REPO / name / "1").resolve())
            shutil.copy2(REPO / name / "config.pbtxt", dst / name / "config.pbtxt")
        else:
            shutil.copytree(REPO / name, dst / name, symlinks=True)
    cfg_path = dst / "minilm" / "config.pbtxt"
    cfg = re.sub(
        r'parameters \{\s*key: "padding".*?\}\s*\}\n', "", cfg_path.read_text(), flags=re.S
    )
    if mode == "max":
        cfg += (
            f'parameters {{ key: "padding" value: {{ string_value: "{BUCKETS}; pad_to=max" }} }}\n'
        )
    elif mode.startswith("buckets"):
        extra = "; bucket_pad=longest" if mode.startswith("buckets_longest") else ""
        cfg += (
            f'parameters {{ key: "padding" value: {{ string_value: "{BUCKETS}; '
            f'pad_to=16,32,64,128,256{extra}" }} }}\n'
        )
    cfg_path.write_text(cfg)
    if mode == "buckets_longest_pool":
        pool = dst / "pool" / "config.pbtxt"
        pool.write_text(
            pool.read_text()
            + 'parameters { key: "padding" value: { string_value: "inputs=token_embeddings:0:0, '
            'attention_mask:0:0; pad_to=16,32,64,128,256; bucket_pad=longest" } }\n'
        )
    if mode == "pow2_tokenizer":
        tok = dst / "tokenize" / "config.pbtxt"
        tok.write_text(
            tok.read_text()
            + 'parameters { key: "round_to_power_of_two" value: { string_value: "true" } }\n'
        )
    return dst


def body(text: str) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}
    ).encode()


async def closed_loop(
    port: int,
    server_pid: int,
    bodies: list[bytes],
    concurrency: int,
    warmup: float,
    duration: float,
    seed: int,
) -> dict[str, Any]:
    """``concurrency`` connections, each sending a random body after the previous answer.

    Counts the answers completed in the measured window (after ``warmup`` s, for
    ``duration`` s) and the CPU seconds the server's process tree (python workers
    included) used in it: on a shared machine, requests per CPU second compare modes
    more fairly than requests per second."""
    url = f"http://127.0.0.1:{port}/v2/models/text_embedding/infer"
    parts = urlsplit(url)
    prepared = [build_request(url, b, {"Content-Type": "application/json"}) for b in bodies]
    rng = random.Random(seed)
    order = [rng.randrange(len(prepared)) for _ in range(200_000)]
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    errors: list[str] = []
    nxt = 0
    warm_end = time.perf_counter() + warmup
    end = warm_end + duration

    async def worker() -> None:
        nonlocal nxt
        _, conn = await loop.create_connection(_Conn, parts.hostname, parts.port)
        while time.perf_counter() < end:
            data = prepared[order[nxt % len(order)]]
            nxt += 1
            t0 = time.perf_counter()
            status, _, rbody = await conn.request(data, True)
            t1 = time.perf_counter()
            ok = status == 200 and rbody is not None and b'"embedding"' in rbody
            if warm_end <= t1 <= end:  # every answer completed in the window
                if ok:
                    lat.append(t1 - t0)
                else:
                    errors.append(f"HTTP {status}: {(rbody or b'')[:200]!r}")

    cpu: list[float] = []

    async def sample_cpu() -> None:
        for at in (warm_end, end):
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            cpu.append(tree_stats(server_pid)["cpu_s"])

    t_start = time.perf_counter()
    await asyncio.gather(sample_cpu(), *(worker() for _ in range(concurrency)))
    seconds = min(time.perf_counter(), end) - max(t_start, warm_end)
    cpu_s = cpu[1] - cpu[0]
    ms = np.asarray(lat) * 1000 if lat else np.zeros(1)
    return {
        "requests": len(lat),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "seconds": round(seconds, 2),
        "rps": round(len(lat) / seconds, 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 1),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "server_cpu_s": round(cpu_s, 2),
        "requests_per_cpu_s": round(len(lat) / max(cpu_s, 1e-9), 2),
    }


def minilm_stats(port: int) -> dict[str, int]:
    url = f"http://127.0.0.1:{port}/v2/models/minilm/stats"
    with urllib.request.urlopen(url, timeout=10) as r:
        s = json.load(r)["model_stats"][0]
    return {
        "inference_count": s["inference_count"],
        "execution_count": s["execution_count"],
        # instance busy time: the batches' own durations (inference_stats counts a
        # batch's duration once per request in it)
        "busy_ns": sum(b["compute_infer"]["ns"] for b in s["batch_stats"]),
    }


def run_mode(
    mode: str, bodies: list[bytes], concurrency: int, warmup: float, duration: float
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bucketing-{mode}-"))
    proc = None
    try:
        repo = make_repo(tmp / "repo", mode)
        proc, port, _, ready_s = start_server(repo, core=None)  # type: ignore[arg-type]  # None: not pinned
        before = minilm_stats(port)
        load_before = os.getloadavg()[0]
        result = asyncio.run(
            closed_loop(port, proc.pid, bodies, concurrency, warmup, duration, seed=16)
        )
        after = minilm_stats(port)
        delta = {k: after[k] - before[k] for k in after}
        result.update(
            mode=mode,
            ready_s=round(ready_s, 1),
            loadavg_before=round(load_before, 2),
            loadavg_after=round(os.getloadavg()[0], 2),
            pressure=pressure(),
            minilm_requests_per_batch=round(
                delta["inference_count"] / max(1, delta["execution_count"]), 2
            ),
            minilm_busy_ms_per_request=round(
                delta["busy_ns"] / 1e6 / max(1, delta["inference_count"]), 2
            ),
        )
        return result
    finally:
        if proc is not None:
            stop_process(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per mode")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--concurrency", "-c", type=int, default=32)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=1, help="every mode once per round")
    args = p.parse_args(argv)
    texts = sentences()
    lengths = np.asarray(token_lengths(texts))
    hist = np.histogram(lengths, [1, 17, 33, 65, 129, 257])[0]  # per bucket: <= 16, 32, ...
    print(
        f"{len(texts)} sentences; word pieces p10/p50/p90/max = "
        f"{np.percentile(lengths, [10, 50, 90]).round(0).tolist()} / {lengths.max()}; "
        f"per bucket <=16/32/64/128/256: {hist.tolist()}, {int((lengths == 256).sum())} truncated",
        file=sys.stderr,
    )
    bodies = [body(t) for t in texts]
    results = []
    for round_ in range(1, args.rounds + 1):
        for mode in args.modes.split(","):
            r = run_mode(mode, bodies, args.concurrency, args.warmup, args.duration)
            r["round"] = round_
            print(json.dumps(r), file=sys.stderr)
            results.append(r)
    print(
        "| round | mode | req/s | p50 ms | p99 ms | errors | req per server CPU s "
        "| minilm req/batch | minilm busy ms/req | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['round']} | {r['mode']} | {r['rps']} | {r['p50_ms']} | {r['p99_ms']} | "
            f"{r['errors']} | {r['requests_per_cpu_s']} | {r['minilm_requests_per_batch']} | "
            f"{r['minilm_busy_ms_per_request']} | {r['loadavg_before']} |"
        )
    for round_ in range(1, args.rounds + 1):
        by = {r["mode"]: r for r in results if r["round"] == round_}
        for base in ("none", "max"):
            for mode in ("buckets", "buckets_longest"):
                if base in by and mode in by and by[base]["rps"]:
                    print(
                        f"round {round_}: {mode} / {base}: req/s "
                        f"{by[mode]['rps'] / by[base]['rps']:.2f}x, req per CPU s "
                        f"{by[mode]['requests_per_cpu_s'] / by[base]['requests_per_cpu_s']:.2f}x"
                    )
    out = ROOT / "benchmarks" / "out"
    out.mkdir(exist_ok=True)
    (out / "bench_bucketing.json").write_text(
        json.dumps(
            {
                "sentences": len(texts),
                "lengths_histogram": hist.tolist(),
                "loadavg": os.getloadavg(),
                "cpus": os.cpu_count(),
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
