"""Issue 4 benchmarks: pdserve vs Python peers, binary throughput, batching on/off.

One script reruns everything (``python benchmarks/bench_peers.py``; sections with
``--only peers,binary,efficientnet``). Every server runs on 127.0.0.1 pinned to
one core (``taskset -c SERVER_CPU``, child processes included); the load client
(``benchmarks/loadgen.py``, the same for every server) runs on another core.

Sections:

``peers``
    The example ``tiny`` ONNX model (64->64 MatMul+Relu, dynamic batch dim, ORT
    with 1 intra-op thread), one-row V2 JSON requests, concurrency 1, 8, 32, 128:
    pdserve (dynamic batcher), KServe 0.21 ``ModelServer`` (no server-side
    batching), MLServer 1.7.1 (adaptive batching, ``uvloop<0.22``), LitServe
    0.2.19 (batching). Peers are installed into their own venvs under
    ``benchmarks/.venvs/`` (gitignored) so they never touch pdserve's pins.
``binary``
    A 3x224x224 FP32 tensor (602,112 bytes) sent with the binary tensor
    extension to an identity model and returned binary: MB/s each way, vs a bare
    uvicorn ASGI echo of the same body.
``efficientnet``
    ``efficientnet_lite0`` at concurrency 32, one image per request (binary):
    dynamic batching on vs off (images/s, p99), and images/s with batching as a
    ratio of bare ONNX Runtime in-process at its best batch size (same core,
    1 intra-op thread).

Results go to ``benchmarks/out/bench_peers.json`` and a Markdown summary is printed
(paste it into ``benchmarks/RESULTS.md``).

Usage::

    .venv/bin/python benchmarks/bench_peers.py [--only peers,binary,efficientnet]
        [--servers pdserve,kserve,mlserver,litserve,triton] [--concurrency 1,8,32,128]
        [--duration 5] [--no-install]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    PY,
    REPO,
    ROOT,
    cli_parser,
    free_port,
    pdserve_command,
    taskset,
    tritonserver_command,
)

BENCH = ROOT / "benchmarks"
OUT = BENCH / "out"
VENVS = BENCH / ".venvs"
PEERS = BENCH / "peers"
EXAMPLES = REPO

#: pip requirements of each peer's venv.
PEER_REQUIREMENTS: dict[str, list[str]] = {
    "kserve": ["kserve==0.21.*", "onnxruntime==1.32.0", "numpy"],
    "mlserver": ["mlserver==1.7.1", "uvloop<0.22", "onnxruntime==1.32.0", "numpy"],
    "litserve": ["litserve==0.2.19", "onnxruntime==1.32.0", "numpy"],
    # numpy < 2: the bundled python backend stub's pybind11 predates numpy 2's ABI.
    # Pillow: bench_pipeline.py runs the image pipeline's preprocess model there.
    "triton": ["nvidia-pytriton==0.7.0", "onnxruntime==1.32.0", "numpy<2", "pillow==13.0.0"],
}

#: Declared inputs/outputs: with both declared, auto-complete does not turn the dynamic
#: batcher on by itself (Triton's rule), so the "plain" models really run unbatched.
TINY_IO = (
    'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]\n'
    'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]\n'
)
IDENTITY_IO = (
    'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]\n'
    'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]\n'
)
EFFNET_IO = (
    'input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]\n'
    'output [ { name: "logits" data_type: TYPE_FP32 dims: [ 1000 ] } ]\n'
)

ONE_CORE = (
    'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n'
    "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
)


#: glibc hands out large buffers fresh (mmap) each time below this threshold
#: (DESIGN.md: raising it lifts 602 KB bodies from ~3 to ~4.4 GB/s); the pdserve
#: server and the bare echo both run with it.
MALLOC_ENV = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=16777216"}


def latest_version_dir(model: str) -> Path:
    """The highest numbered version folder of an example model."""
    d = EXAMPLES / model
    versions = sorted((int(p.name) for p in d.iterdir() if p.name.isdigit()), reverse=True)
    if not versions:
        raise SystemExit(f"{d} has no version: run `python examples/build.py` first")
    return d / str(versions[0])


# -- model repository for pdserve -------------------------------------------------


def identity_onnx(path: Path) -> None:
    """An ONNX Identity model: ``INPUT0`` FP32 [b,3,224,224] -> ``OUTPUT0``."""
    from onnx import TensorProto, helper, save

    x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["b", 3, 224, 224])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["b", 3, 224, 224])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "id", [x], [y]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    save(model, str(path))


def build_repo(delay_us: int) -> Path:
    """``benchmarks/out/repo``: tiny (batched), identity_224, effnet on/off."""
    repo = OUT / "repo"
    shutil.rmtree(repo, ignore_errors=True)

    def model(name: str, onnx_src: Path | None, config: str) -> None:
        (repo / name / "1").mkdir(parents=True)
        if onnx_src is not None:
            shutil.copy(onnx_src, repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\nplatform: "onnxruntime_onnx"\n{config}'
        )

    tiny = latest_version_dir("tiny") / "model.onnx"
    model(
        "tiny",
        tiny,
        "max_batch_size: 128\n"
        f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n" + ONE_CORE + TINY_IO,
    )
    model("identity_224", None, "max_batch_size: 8\n" + ONE_CORE + IDENTITY_IO)
    identity_onnx(repo / "identity_224" / "1" / "model.onnx")
    eff = latest_version_dir("efficientnet_lite0") / "model.onnx"
    model(
        "effnet_batched",
        eff,
        "max_batch_size: 32\ndynamic_batching { max_queue_delay_microseconds: 2000 }\n"
        + ONE_CORE
        + EFFNET_IO,
    )
    model("effnet_plain", eff, "max_batch_size: 32\n" + ONE_CORE + EFFNET_IO)
    return repo


# -- processes ---------------------------------------------------------------------


class Proc:
    """A server process group, stopped with SIGTERM then SIGKILL."""

    def __init__(
        self, name: str, cmd: list[str], *, cwd: Path | None = None, env: dict | None = None
    ) -> None:
        self.name = name
        log_path = OUT / f"{name}.log"
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, url: str, timeout: float = 120) -> None:
        """Poll ``url`` until it answers 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.returncode}); see out/{self.name}.log"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout}s; see out/{self.name}.log")

    def stop(self) -> None:
        """Stop the whole process group."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self.log.close()


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds used so far by every process in process group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / tick


def load(
    args: argparse.Namespace,
    url: str,
    body: Path,
    c: int,
    extra: list[str] | None = None,
    server: Proc | None = None,
) -> dict[str, Any]:
    """One loadgen point (client pinned to ``--client-cpu``).

    With ``server``, also reports the CPU its process group used during the run
    (``server_cores``) and requests per server CPU-second (``req_per_cpu_s``): a
    figure that other load on the machine disturbs less than req/s does.
    """
    cmd = [
        *taskset(args.client_cpu),
        PY,
        str(BENCH / "loadgen.py"),
        "--url",
        url,
        "--body-file",
        str(body),
        "-c",
        str(c),
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        *(extra or []),
    ]
    cpu0 = group_cpu_seconds(server.proc.pid) if server is not None else 0.0
    t0 = time.monotonic()
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=args.duration + args.warmup + 120
    )
    wall = time.monotonic() - t0
    if out.returncode != 0:
        raise RuntimeError(f"loadgen failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if server is not None:
        cores = (group_cpu_seconds(server.proc.pid) - cpu0) / wall
        result["server_cores"] = round(cores, 3)
        result["req_per_cpu_s"] = round(result["rps"] / cores, 1) if cores > 0 else None
    return result


def ensure_venv(name: str, install: bool) -> Path | None:
    """The peer's venv python, creating and installing it when asked; None if absent."""
    py = VENVS / name / "bin" / "python"
    if py.exists():
        return py
    if not install:
        return None
    VENVS.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENVS / name)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *PEER_REQUIREMENTS[name]], check=True)
    return py


# -- servers -----------------------------------------------------------------------


def start_pdserve(args: argparse.Namespace, repo: Path) -> tuple[Proc, str]:
    port = free_port()
    cmd = pdserve_command(repo, port, free_port(), free_port(), core=args.server_cpu)
    env = MALLOC_ENV
    p = Proc("pdserve", cmd, cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    p.wait_ready(base + "/v2/health/ready")
    return p, base


def start_triton(
    args: argparse.Namespace, py: Path, tiny: Path, port: int, grpc_port: int | None = None
) -> tuple[Proc, str]:
    """Real Triton 2.51 from the nvidia-pytriton wheel (ANCHORS.md): python backend
    only, so ``peers/triton_model.py`` runs the ONNX model; dynamic batching with a
    2 ms queue delay and max_batch_size 32. HTTP on ``port``, gRPC on ``grpc_port``
    (None: a free port)."""
    repo = OUT / "triton_repo"
    shutil.rmtree(repo, ignore_errors=True)
    (repo / "tiny" / "1").mkdir(parents=True)
    shutil.copy(PEERS / "triton_model.py", repo / "tiny" / "1" / "model.py")
    (repo / "tiny" / "config.pbtxt").write_text(
        'name: "tiny"\nbackend: "python"\nmax_batch_size: 32\n'
        + TINY_IO
        + "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        f'parameters {{ key: "model_path" value {{ string_value: "{tiny}" }} }}\n'
    )
    cmd, env = tritonserver_command(
        py, repo, port, OUT / "triton_backends", core=args.server_cpu, grpc_port=grpc_port
    )
    p = Proc("triton", cmd, env=env)
    base = f"http://127.0.0.1:{port}"
    p.wait_ready(base + "/v2/health/ready", timeout=180)
    return p, base


def start_peer(args: argparse.Namespace, name: str, tiny: Path) -> tuple[Proc, str] | None:
    py = ensure_venv(name, args.install)
    if py is None:
        print(f"  {name}: no venv at {VENVS / name} (run with --install)", file=sys.stderr)
        return None
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    if name == "triton":
        return start_triton(args, py, tiny, port)
    if name == "kserve":
        p = Proc(
            name,
            [
                *taskset(args.server_cpu),
                str(py),
                str(PEERS / "kserve_server.py"),
                str(tiny),
                str(port),
            ],
        )
        p.wait_ready(base + "/v2/health/ready")
    elif name == "litserve":
        p = Proc(
            name,
            [
                *taskset(args.server_cpu),
                str(py),
                str(PEERS / "litserve_server.py"),
                str(tiny),
                str(port),
            ],
        )
        p.wait_ready(base + "/health")
    else:
        d = OUT / "mlserver"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        shutil.copy(PEERS / "mlserver_runtime.py", d / "mlserver_runtime.py")
        (d / "settings.json").write_text(
            json.dumps(
                {
                    "host": "127.0.0.1",
                    "http_port": port,
                    "grpc_port": free_port(),
                    "metrics_port": free_port(),
                    "parallel_workers": args.mlserver_workers,
                }
            )
        )
        (d / "model-settings.json").write_text(
            json.dumps(
                {
                    "name": "tiny",
                    "implementation": "mlserver_runtime.TinyRuntime",
                    "max_batch_size": 32,
                    "max_batch_time": 0.002,
                    "parameters": {"uri": str(tiny)},
                }
            )
        )
        mlserver = py.parent / "mlserver"
        p = Proc(name, [*taskset(args.server_cpu), str(mlserver), "start", str(d)], cwd=d)
        p.wait_ready(base + "/v2/models/tiny/ready", timeout=180)
    return p, base


# -- sections ----------------------------------------------------------------------


def tiny_body() -> Path:
    body = OUT / "tiny_body.json"
    rng = np.random.default_rng(0)
    data = [round(float(v), 6) for v in rng.standard_normal(64)]
    body.write_text(
        json.dumps(
            {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": data}]}
        )
    )
    return body


def binary_body(name: str, shape: list[int], out_binary: bool = True) -> tuple[Path, int]:
    """A binary-extension request body; returns (path, JSON header length)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    header = {
        "inputs": [
            {
                "name": name,
                "shape": shape,
                "datatype": "FP32",
                "parameters": {"binary_data_size": x.nbytes},
            }
        ],
        "parameters": {"binary_data_output": out_binary},
    }
    h = json.dumps(header).encode()
    path = OUT / f"binary_{name}_{'x'.join(map(str, shape))}.bin"
    path.write_bytes(h + x.tobytes())
    return path, len(h)


def section_peers(args: argparse.Namespace, repo: Path, results: dict[str, Any]) -> None:
    body = tiny_body()
    tiny_onnx = latest_version_dir("tiny") / "model.onnx"
    results["peers"] = {}
    for name in args.servers:
        print(f"== {name}", file=sys.stderr)
        started = (
            start_pdserve(args, repo) if name == "pdserve" else start_peer(args, name, tiny_onnx)
        )
        if started is None:
            continue
        proc, base = started
        try:
            points = {}
            for c in args.concurrency:
                r = load(
                    args, base + "/v2/models/tiny/infer", body, c, ["--expect", "OUTPUT0"], proc
                )
                points[c] = r
                print(
                    f"  c={c}: {r['rps']} req/s p50 {r['p50_ms']} p99 {r['p99_ms']} ms "
                    f"errors {r['errors']} server cores {r['server_cores']} "
                    f"req/cpu-s {r['req_per_cpu_s']}",
                    file=sys.stderr,
                )
            results["peers"][name] = points
        finally:
            proc.stop()


def section_binary(args: argparse.Namespace, repo: Path, results: dict[str, Any]) -> None:
    body, hlen = binary_body("INPUT0", [1, 3, 224, 224])
    header = [
        "--header",
        f"Inference-Header-Content-Length: {hlen}",
        "--header",
        "Content-Type: application/octet-stream",
    ]
    out: dict[str, Any] = {}
    proc, base = start_pdserve(args, repo)
    try:
        out["pdserve"] = load(
            args,
            base + "/v2/models/identity_224/infer",
            body,
            args.binary_concurrency,
            header,
            proc,
        )
    finally:
        proc.stop()
    port = free_port()
    echo = Proc(
        "echo",
        [*taskset(args.server_cpu), PY, str(PEERS / "echo_server.py"), str(port)],
        env=MALLOC_ENV,
    )
    try:
        echo.wait_ready(f"http://127.0.0.1:{port}/")
        out["echo"] = load(
            args, f"http://127.0.0.1:{port}/echo", body, args.binary_concurrency, header, echo
        )
    finally:
        echo.stop()
    results["binary"] = out
    for k, r in out.items():
        print(
            f"  {k}: {r['rps']} req/s, {r['mbps_out']} MB/s in, {r['mbps_in']} MB/s out, p99 {r['p99_ms']} ms",
            file=sys.stderr,
        )


def section_efficientnet(args: argparse.Namespace, repo: Path, results: dict[str, Any]) -> None:
    """Bare ORT per batch size first; then pdserve with batching (preferred batch size =
    bare ORT's best, as Triton's tuning guide suggests) and without, at c=32."""
    eff = latest_version_dir("efficientnet_lite0") / "model.onnx"
    sizes = "1,2,4,8,16,32"
    bare = subprocess.run(
        [
            *taskset(args.server_cpu),
            PY,
            str(PEERS / "bare_ort.py"),
            str(eff),
            "input",
            str(args.bare_seconds),
            sizes,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(bare.stdout)
    wall = {int(k): v for k, v in measured["wall"].items()}
    cpu = {int(k): v for k, v in measured["cpu"].items()}
    best_wall = max(wall, key=wall.get)
    # The largest batch size within 5% of the best rate per CPU-second (the rates are
    # nearly flat on CPU; a larger batch amortises the per-batch overheads).
    best_cpu = max(bs for bs, v in cpu.items() if v >= 0.95 * max(cpu.values()))
    (repo / "effnet_batched" / "config.pbtxt").write_text(
        'name: "effnet_batched"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 32\n'
        f"dynamic_batching {{ preferred_batch_size: [ {best_cpu} ] "
        "max_queue_delay_microseconds: 2000 }\n" + ONE_CORE + EFFNET_IO
    )
    body, hlen = binary_body("input", [1, 3, 224, 224], out_binary=True)
    header = [
        "--header",
        f"Inference-Header-Content-Length: {hlen}",
        "--header",
        "Content-Type: application/octet-stream",
    ]
    out: dict[str, Any] = {
        "bare_ort_wall": wall,
        "bare_ort_cpu": cpu,
        "preferred_batch_size": best_cpu,
    }
    saved = (args.duration, args.warmup)
    args.duration, args.warmup = max(args.duration, 10.0), max(args.warmup, 3.0)
    proc, base = start_pdserve(args, repo)
    try:
        for model in ("effnet_batched", "effnet_plain"):
            r = load(args, base + f"/v2/models/{model}/infer", body, 32, header, proc)
            out[model] = r
            print(
                f"  {model}: {r['rps']} images/s p50 {r['p50_ms']} p99 {r['p99_ms']} ms, "
                f"{r['req_per_cpu_s']} images per server CPU-s",
                file=sys.stderr,
            )
        with urllib.request.urlopen(base + "/v2/models/effnet_batched/stats", timeout=10) as resp:
            stats = json.loads(resp.read())["model_stats"][0]
        out["batched_batch_sizes"] = {
            b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]
        }
    finally:
        proc.stop()
        args.duration, args.warmup = saved
    out["bare_best_wall"] = {"batch_size": best_wall, "images_per_s": wall[best_wall]}
    out["bare_best_cpu"] = {"batch_size": best_cpu, "images_per_cpu_s": cpu[best_cpu]}
    out["ratio_batched_vs_bare"] = round(out["effnet_batched"]["rps"] / wall[best_wall], 3)
    per_cpu = out["effnet_batched"].get("req_per_cpu_s") or 0
    out["ratio_batched_vs_bare_per_cpu"] = round(per_cpu / cpu[best_cpu], 3)
    results["efficientnet"] = out
    print(
        f"  bare ORT wall {wall} cpu {cpu}; ratio {out['ratio_batched_vs_bare']} "
        f"(per CPU-second {out['ratio_batched_vs_bare_per_cpu']})",
        file=sys.stderr,
    )


# -- report ------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """CPU model, core count, kernel, Python."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
    }


def markdown(results: dict[str, Any]) -> str:
    """The summary tables."""
    lines = []
    peers = results.get("peers") or {}
    if peers:
        cs = sorted({int(c) for pts in peers.values() for c in pts})
        lines.append("| server | " + " | ".join(f"c={c} req/s (p50 / p99 ms)" for c in cs) + " |")
        lines.append("|---|" + "---|" * len(cs))
        for name, pts in peers.items():
            cells = []
            for c in cs:
                r = pts.get(c) or pts.get(str(c))
                cells.append(
                    f"{r['rps']:,.0f} ({r['p50_ms']:.2f} / {r['p99_ms']:.2f})" if r else "-"
                )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("\nRequests per server CPU-second (cores the server used):\n")
        lines.append("| server | " + " | ".join(f"c={c} req/cpu-s (cores)" for c in cs) + " |")
        lines.append("|---|" + "---|" * len(cs))
        for name, pts in peers.items():
            cells = []
            for c in cs:
                r = pts.get(c) or pts.get(str(c))
                per = (r or {}).get("req_per_cpu_s") or 0
                cores = (r or {}).get("server_cores") or 0
                cells.append(f"{per:,.0f} ({cores:.2f})" if r else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        if "pdserve" in peers:
            others = {n: p for n, p in peers.items() if n not in ("pdserve", "triton")}
            for c in cs:
                best = max(
                    others.items(),
                    key=lambda kv: (kv[1].get(c) or kv[1].get(str(c)) or {"rps": 0})["rps"],
                    default=None,
                )
                if best is None:
                    break
                ours = peers["pdserve"].get(c) or peers["pdserve"].get(str(c))
                theirs = best[1].get(c) or best[1].get(str(c))
                if ours and theirs and theirs["rps"]:
                    lines.append(
                        f"\nc={c}: pdserve / best peer ({best[0]}) = {ours['rps'] / theirs['rps']:.1f}x req/s; "
                        f"p99 {ours['p99_ms']:.2f} vs {theirs['p99_ms']:.2f} ms"
                    )
                tri = peers.get("triton", {}).get(c) or peers.get("triton", {}).get(str(c))
                if ours and tri and tri["rps"]:
                    lines.append(
                        f"c={c}: pdserve / real Triton = {ours['rps'] / tri['rps']:.2f}x req/s, "
                        f"{(ours.get('req_per_cpu_s') or 0) / (tri.get('req_per_cpu_s') or 1):.2f}x "
                        f"req per CPU-s; p99 {ours['p99_ms']:.2f} vs {tri['p99_ms']:.2f} ms"
                    )
    b = results.get("binary")
    if b:
        lines.append("\n| 3x224x224 FP32 binary | req/s | MB/s in | MB/s out | p99 ms |")
        lines.append("|---|---|---|---|---|")
        for k, r in b.items():
            lines.append(
                f"| {k} | {r['rps']:,.0f} | {r['mbps_out']:,.0f} | {r['mbps_in']:,.0f} | {r['p99_ms']:.2f} |"
            )
        if "echo" in b and b["echo"]["mbps_out"]:
            per = [b[k].get("req_per_cpu_s") or 0 for k in ("pdserve", "echo")]
            lines.append(
                f"\npdserve / bare echo = {b['pdserve']['mbps_out'] / b['echo']['mbps_out']:.2f} "
                f"(MB/s), {per[0] / per[1] if per[1] else 0:.2f} (bytes per server CPU-second)"
            )
    e = results.get("efficientnet")
    if e:
        lines.append(
            "\n| efficientnet_lite0, c=32 | images/s | p50 ms | p99 ms | images per server CPU-s |"
        )
        lines.append("|---|---|---|---|---|")
        for k in ("effnet_batched", "effnet_plain"):
            r = e[k]
            lines.append(
                f"| {k} | {r['rps']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                f"{r.get('req_per_cpu_s') or 0:.1f} |"
            )
        lines.append(
            f"\nbare ORT in-process, 1 thread: images/s {e['bare_ort_wall']}; images per CPU-s "
            f"{e['bare_ort_cpu']}. Batched pdserve / bare at its best batch size = "
            f"{e['ratio_batched_vs_bare']} (wall), {e['ratio_batched_vs_bare_per_cpu']} (per CPU-s); "
            f"preferred_batch_size {e['preferred_batch_size']}; batches run: {e['batched_batch_sizes']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections and print the Markdown summary."""
    p = cli_parser(__doc__, __file__)
    p.add_argument("--only", default="peers,binary,efficientnet")
    p.add_argument(
        "--servers",
        default="pdserve,kserve,mlserver,litserve",
        help="comma list; 'triton' (real Triton from nvidia-pytriton) may be added",
    )
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--server-cpu", default="0")
    p.add_argument("--client-cpu", default="1")
    p.add_argument(
        "--delay-us", type=int, default=0, help="pdserve tiny max_queue_delay_microseconds"
    )
    p.add_argument("--binary-concurrency", type=int, default=8)
    p.add_argument("--bare-seconds", type=float, default=3.0)
    p.add_argument("--mlserver-workers", type=int, default=1)
    p.add_argument(
        "--install",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="create missing peer venvs",
    )
    args = p.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    OUT.mkdir(parents=True, exist_ok=True)
    repo = build_repo(args.delay_us)
    results: dict[str, Any] = {"machine": machine(), "args": {k: v for k, v in vars(args).items()}}
    sections = {
        "peers": section_peers,
        "binary": section_binary,
        "efficientnet": section_efficientnet,
    }
    for name in args.only.split(","):
        print(f"# {name}", file=sys.stderr)
        sections[name](args, repo, results)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (OUT / "bench_peers.json").write_text(json.dumps(results, indent=1))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
