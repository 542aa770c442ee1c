"""Issue 14 item 4: cold start of a model repository on S3 against a local folder.

A real local S3 server (``moto_server`` on 127.0.0.1, the ``test`` extra) holds a copy
of a subset of the example repository (``--models``, default tiny, tiny_dtypes, digits
and efficientnet_lite0: ~19 MB, mostly efficientnet's ONNX file). Three ways to start
pdserve, each ``--rounds`` times, seconds from process start to ``/v2/health/ready``
(and the sync's own seconds, from the server's log line):

- ``local``: ``--model-repository`` a local folder with the same models;
- ``s3_cold``: ``s3://bench/repo`` with an empty ``--model-repository-cache`` (every
  file downloaded, checked and published before the load);
- ``s3_warm``: the same URL and a cache left by an earlier start (one listing, nothing
  fetched: a restarted pod that kept its cache volume).

Usage::

    .venv/bin/python benchmarks/bench_s3_repository.py [--rounds 3] [--models tiny,digits]

Prints a Markdown table and writes ``benchmarks/out/bench_s3_repository.json``.
"""

from __future__ import annotations

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
from pathlib import Path

from common import REPO, ROOT, cli_parser, free_port, pressure, start_server, stop_process

MODELS = ("tiny", "tiny_dtypes", "digits", "efficientnet_lite0")


def start_moto() -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1):
                return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)


def main() -> None:
    ap = cli_parser(__doc__, __file__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    models = args.models.split(",")
    import boto3

    tmp = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    local = tmp / "local"
    for m in models:
        shutil.copytree(REPO / m, local / m)
    size = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    moto, port = start_moto()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="bench")
    for p in sorted(local.rglob("*")):
        if p.is_file():
            s3.upload_file(str(p), "bench", f"repo/{p.relative_to(local).as_posix()}")
    url = "s3://bench/repo"
    times: dict[str, list[float]] = {"local": [], "s3_cold": [], "s3_warm": []}
    syncs: dict[str, list[float]] = {"local": [], "s3_cold": [], "s3_warm": []}
    load_before = pressure()
    try:
        for r in range(args.rounds):
            cache = tmp / f"cache{r}"
            for mode in ("local", "s3_cold", "s3_warm"):
                repo = local if mode == "local" else url
                extra = () if mode == "local" else ("--model-repository-cache", str(cache))
                proc, http_port, _, secs = start_server(repo, *extra)  # type: ignore[arg-type]
                stop_process(proc)
                times[mode].append(secs)
                log = Path(tempfile.gettempdir()) / f"pdserve-bench-{http_port}.log"
                m = re.search(r"synced into \S+ in ([\d.]+)s", log.read_text(errors="replace"))
                if m:
                    syncs[mode].append(float(m.group(1)))
                print(f"round {r} {mode}: {secs:.2f}s", flush=True)
    finally:
        stop_process(moto)
        shutil.rmtree(tmp, ignore_errors=True)
    rows = {m: statistics.median(v) for m, v in times.items()}
    print(
        f"\n{len(models)} models ({', '.join(models)}), {size / 1e6:.1f} MB, {args.rounds} rounds"
    )
    print("| start | median s to ready | runs | ratio vs local | median sync s |")
    print("|---|---|---|---|---|")
    for m, v in times.items():
        runs = ", ".join(f"{x:.2f}" for x in v)
        sync = f"{statistics.median(syncs[m]):.2f}" if syncs[m] else "-"
        print(f"| {m} | {rows[m]:.2f} | {runs} | {rows[m] / rows['local']:.2f} | {sync} |")
    out = ROOT / "benchmarks" / "out"
    out.mkdir(exist_ok=True)
    (out / "bench_s3_repository.json").write_text(
        json.dumps(
            {
                "models": models,
                "bytes": size,
                "seconds": times,
                "sync_seconds": syncs,
                "median": rows,
                "load_before": load_before,
                "load_after": pressure(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
