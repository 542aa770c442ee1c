"""Issue 5 benchmark: how long a version swap takes, and what clients see during it.

pdserve runs pinned to one core (``taskset -c 0``); a gRPC client process on the
other core keeps C requests in flight without pause and records, for every
request, when it was sent, when the answer came and which version answered. The
benchmark then publishes new versions while the traffic runs:

- ``poll``: a new version folder is renamed into the model folder
  (``--model-control-mode=poll --repository-poll-secs=P``);
- ``explicit``: the new version is uploaded with the repository API (gRPC
  ``RepositoryModelLoad`` with ``config`` and ``file:N/model.onnx``).

For each swap: *switch time* = from the folder appearing (or the load call) to the
first answer from the new version; and latency percentiles of the requests sent
during the swap (from the change until 0.5 s after the switch) against those sent
in the quiet second before it. Any failed request is counted (there should be none).

Usage::

    .venv/bin/python benchmarks/bench_swap.py [--swaps 3] [--poll-secs 0.5] [--out benchmarks/out/swap.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grpc_http import METHOD, efficientnet_input, grpc_body, tiny_input  # noqa: E402
from common import PY, REPO, ROOT, cli_parser, start_server, taskset  # noqa: E402

MODELS = {
    "tiny": ("INPUT0", tiny_input, 8),
    "efficientnet_lite0": ("input", efficientnet_input, 4),
}


# --------------------------------------------------------------------------- client


async def _record(target: str, body: bytes, concurrency: int, stop_file: Path, out: Path) -> None:
    import grpc
    from tritonclient.grpc import service_pb2

    channels = [grpc.aio.insecure_channel(target, options=[("pdserve.ch", i)]) for i in range(2)]
    calls = [
        ch.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        for ch in channels
    ]
    rows: list[tuple[float, float, str]] = []
    stop = False

    async def worker(i: int) -> None:
        call = calls[i % len(calls)]
        while not stop:
            t0 = time.monotonic()
            try:
                raw = await call(body, timeout=60)
                version = service_pb2.ModelInferResponse.FromString(raw).model_version
            except grpc.aio.AioRpcError as e:
                version = f"error: {e.code()}: {e.details()}"
            rows.append((t0, time.monotonic(), version))

    async def watch() -> None:
        nonlocal stop
        while not stop_file.exists():
            await asyncio.sleep(0.05)
        stop = True

    await asyncio.gather(watch(), *(worker(i) for i in range(concurrency)))
    for ch in channels:
        await ch.close()
    out.write_text(json.dumps(rows))


# --------------------------------------------------------------------------- driver


def http_json(port: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return json.loads(r.read())
    except OSError:
        return None


def wait_versions(port: int, model: str, want: list[str], timeout: float = 120) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        meta = http_json(port, f"/v2/models/{model}")
        if meta and meta.get("versions") == want:
            return time.monotonic()
        time.sleep(0.01)
    raise RuntimeError(f"{model} never served {want}")


def start_client(
    grpc_port: int, model: str, tmp: Path
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    name, make, concurrency = MODELS[model]
    body_file = tmp / f"{model}.pb"
    body_file.write_bytes(grpc_body(model, name, make()))
    stop_file, out = tmp / f"{model}.stop", tmp / f"{model}.rows.json"
    stop_file.unlink(missing_ok=True)
    cmd = [
        *taskset("1"),
        PY,
        __file__,
        "--client",
        f"127.0.0.1:{grpc_port}",
        "--body-file",
        str(body_file),
        "--concurrency",
        str(concurrency),
        "--stop-file",
        str(stop_file),
        "--rows",
        str(out),
    ]
    return subprocess.Popen(cmd, cwd=ROOT), stop_file, out


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(values) * 1000, q)), 2) if values else float("nan")


def analyse(rows: list[list[Any]], swaps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Switch time and latency around each swap from the client's rows."""
    results = []
    for s in swaps:
        t0, new = s["t0"], s["version"]
        firsts = [r[1] for r in rows if r[2] == new and r[1] >= t0]
        t1 = min(firsts) if firsts else float("nan")
        before = [r[1] - r[0] for r in rows if t0 - 1.0 <= r[0] < t0 and not r[2].startswith("e")]
        during = [r[1] - r[0] for r in rows if t0 <= r[0] <= t1 + 0.5 and not r[2].startswith("e")]
        results.append(
            {
                **{k: v for k, v in s.items() if k != "t0"},
                "switch_ms": round((t1 - t0) * 1000, 1),
                "before_p50_ms": pct(before, 50),
                "before_p99_ms": pct(before, 99),
                "during_p50_ms": pct(during, 50),
                "during_p99_ms": pct(during, 99),
                "during_max_ms": pct(during, 100),
                "requests_during": len(during),
            }
        )
    return results


def run_mode(mode: str, swaps: int, poll_secs: float, tmp: Path) -> list[dict[str, Any]]:
    repo = tmp / f"repo-{mode}"
    for model in MODELS:
        shutil.copytree(REPO / model, repo / model)
    args = ["--model-control-mode", mode]
    if mode == "poll":
        args += ["--repository-poll-secs", str(poll_secs)]
    else:
        args += ["--load-model", "*"]
    proc, http_port, grpc_port, _ = start_server(repo, *args)
    results: list[dict[str, Any]] = []
    try:
        import tritonclient.grpc as grpcclient

        control = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        for model in MODELS:
            client, stop_file, out = start_client(grpc_port, model, tmp)
            time.sleep(3.0)  # steady traffic first
            model_dir = repo / model
            version = max(int(p.name) for p in model_dir.iterdir() if p.name.isdigit())
            source = model_dir / str(version) / "model.onnx"
            events = []
            failures_before = 0
            for _ in range(swaps):
                version += 1
                if mode == "poll":
                    stage = repo / f".stage-{model}-{version}"
                    stage.mkdir()
                    shutil.copyfile(source, stage / "model.onnx")
                    t0 = time.monotonic()
                    os.replace(stage, model_dir / str(version))
                else:
                    cfg = control.get_model_config(model, as_json=True)["config"]
                    data = source.read_bytes()
                    t0 = time.monotonic()
                    control.load_model(
                        model, config=json.dumps(cfg), files={f"file:{version}/model.onnx": data}
                    )
                t_seen = wait_versions(http_port, model, [str(version)])
                events.append(
                    {
                        "mode": mode,
                        "model": model,
                        "version": str(version),
                        "t0": t0,
                        "observed_ms": round((t_seen - t0) * 1000, 1),
                    }
                )
                time.sleep(2.0)
            stop_file.touch()
            client.wait(60)
            rows = json.loads(out.read_text())
            failures = [r for r in rows if r[2].startswith("error")]
            for r in analyse(rows, events):
                r["failed_requests"] = len(failures) - failures_before
                failures_before = len(failures)
                results.append(r)
                print(
                    f"{mode:<8} {model:<18} v{r['version']:<2} switch {r['switch_ms']:>7.1f} ms | "
                    f"p50/p99 before {r['before_p50_ms']:>7.2f}/{r['before_p99_ms']:>7.2f} ms, "
                    f"during {r['during_p50_ms']:>7.2f}/{r['during_p99_ms']:>7.2f} ms | "
                    f"failed {r['failed_requests']}",
                    flush=True,
                )
        control.close()
    finally:
        proc.terminate()
        proc.wait(60)
    return results


def main(argv: list[str] | None = None) -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument("--swaps", type=int, default=3, help="swaps per model and mode")
    p.add_argument("--poll-secs", type=float, default=0.5, help="poll mode interval")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "swap.json")
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--body-file", help=argparse.SUPPRESS)
    p.add_argument("--concurrency", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--stop-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        body = Path(args.body_file).read_bytes()
        asyncio.run(_record(args.client, body, args.concurrency, args.stop_file, args.rows))
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="pdserve-swap-") as tmp:
        for mode in ("poll", "explicit"):
            results += run_mode(mode, args.swaps, args.poll_secs, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"poll_secs": args.poll_secs, "loadavg_after": os.getloadavg(), "swaps": results},
            indent=1,
        )
    )
    print(
        "\n| mode | model | switch ms (median / max) | p99 before | p99 during | max during "
        "| failed |\n|---|---|---|---|---|---|---|"
    )
    for mode in ("poll", "explicit"):
        for model in MODELS:
            rs = [r for r in results if r["mode"] == mode and r["model"] == model]
            if not rs:
                continue
            sw = [r["switch_ms"] for r in rs]
            print(
                f"| {mode} | {model} | {np.median(sw):.0f} / {max(sw):.0f} | "
                f"{np.median([r['before_p99_ms'] for r in rs]):.1f} | "
                f"{np.median([r['during_p99_ms'] for r in rs]):.1f} | "
                f"{max(r['during_max_ms'] for r in rs):.1f} | "
                f"{sum(r['failed_requests'] for r in rs)} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
