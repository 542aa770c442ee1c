"""Issue 3 benchmarks: the image_classifier pipeline and the python backend's transfer cost.

1. **Shared-memory transfer** (in one process, no HTTP): a python model that returns
   its input (``tests/data/python_models/identity`` with no delay) run through its
   worker (``PythonInstance.execute``) versus the same ``TritonPythonModel.execute``
   called in-process, for 64 B, 602 KB (3x224x224 FP32) and 19 MB (32x3x224x224).
   The difference is the per-request cost of the process boundary.
2. **Stage costs in-process**: ``preprocessing.py`` per image, ORT per batch size,
   and ORT on one thread pinned to core 0 while core 1 is idle or busy (how much
   a busy neighbour core slows the predictor on this VM).
3. **Pipeline throughput**: ``image_classifier`` (raw JPEG in, top-5 out) through
   pdserve's HTTP frontend with ``benchmarks/loadgen.py`` (binary tensor extension,
   closed loop) at concurrency 1, 8 and 32, against each stage model's standalone
   capacity on the same server (preprocess: JPEG in, 602 KB tensor out;
   efficientnet_lite0: 602 KB in; postprocess: 4 KB in), for the repository and
   server variants in :data:`VARIANTS` (1 or 2 preprocess instances, the predictor
   with ``dynamic_batching``, host policies giving the predictor its own core).
   Each variant runs in rounds (stages alone, then the pipeline; the ratio is taken
   within a round, the medians are reported), and during every load point the
   predictor's *busy fraction* is read from the statistics extension.
4. With ``--triton``: the same pipeline on **real Triton** (the tritonserver 2.51 of
   ``nvidia-pytriton``, python backend only, so efficientnet_lite0 runs as a python
   model calling ONNX Runtime) and on pdserve with the same models, images and
   client; pdserve also with its own ORT backend for the predictor.

Server and client share the machine's cores (the pipeline needs all of them); each
load point is bounded in time. Usage::

    .venv/bin/python benchmarks/bench_pipeline.py [--duration 5] [--tries 3] [--variants 0,3] [--triton]

Prints Markdown tables and writes the raw figures as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    GOLDENS,
    PY,
    REPO,
    ROOT,
    cli_parser,
    free_port,
    pdserve_command,
    taskset,
    tritonserver_command,
    wait_ready,
)

sys.path.insert(0, str(ROOT))
DATA = ROOT / "tests" / "data" / "python_models"
PIPELINE_MODELS = ("preprocess", "efficientnet_lite0", "postprocess", "image_classifier")


# --------------------------------------------------------------------------- helpers


def start_server(repo: Path, log: Path, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    """Start pdserve on ``repo`` with extra CLI ``args``; return (process, http port)
    once it is ready."""
    port = free_port()
    cmd = pdserve_command(repo, port, free_port(), free_port(), *args)
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)  # noqa: SIM115
    wait_ready(proc, port, log, "pdserve", interval=0.2)
    return proc, port


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then wait."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def binary_body(
    inputs: list[tuple[str, str, list[int], bytes]], outputs: list[str]
) -> tuple[bytes, int]:
    """A V2 request with every input in the binary tensor extension.

    Returns:
        (body, JSON header length) for ``Inference-Header-Content-Length``.
    """
    header = {
        "inputs": [
            {
                "name": n,
                "datatype": dt,
                "shape": shape,
                "parameters": {"binary_data_size": len(data)},
            }
            for n, dt, shape, data in inputs
        ],
        "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in outputs],
    }
    head = json.dumps(header).encode()
    return head + b"".join(d for *_, d in inputs), len(head)


def bytes_element(data: bytes) -> bytes:
    """One BYTES element in the binary tensor extension (uint32 LE length + bytes)."""
    return struct.pack("<I", len(data)) + data


def load_point(
    port: int,
    model: str,
    body: bytes,
    head_len: int,
    concurrency: int,
    duration: float,
    warmup: float,
    core: str | None = None,
) -> dict[str, Any]:
    """One closed-loop load point with benchmarks/loadgen.py (its own process, pinned
    to ``core`` when given)."""
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        f.write(body)
        f.flush()
        out = subprocess.run(
            [
                *taskset(core),
                PY,
                str(ROOT / "benchmarks" / "loadgen.py"),
                "--url",
                f"http://127.0.0.1:{port}/v2/models/{model}/infer",
                "--body-file",
                f.name,
                "--header",
                f"Inference-Header-Content-Length: {head_len}",
                "--header",
                "Content-Type: application/octet-stream",
                "--concurrency",
                str(concurrency),
                "--duration",
                str(duration),
                "--warmup",
                str(warmup),
            ],
            capture_output=True,
            check=True,
            timeout=duration + warmup + 120,
        )
    result = json.loads(out.stdout)
    if result["errors"]:
        raise RuntimeError(
            f"{model} c={concurrency}: {result['errors']} errors: {result['first_error']}"
        )
    return result


def make_repo(
    dst: Path,
    preprocess_instances: int,
    predictor_batching: bool,
    predictor_threads: int = 0,
    *,
    preprocess_batch: int = 0,
    predictor_policy: str = "",
) -> Path:
    """A copy of the image pipeline's models with the given variations.

    ``predictor_batching`` gives efficientnet_lite0 ``dynamic_batching { }`` and one
    instance (one ONNX Runtime session using every core, instead of two sessions
    competing for them); ``predictor_threads`` > 0 limits that session's intra-op
    threads (a share of the cores for the predictor, the rest for the python steps).
    ``preprocess_batch`` > 0 gives preprocess ``preferred_batch_size: [N]``: batches
    of at most N images even when more wait (a python step gains nothing from
    batching, and one batch of every request in flight makes them move through the
    stages as a convoy, each stage idle while the other works). ``predictor_policy`` puts efficientnet_lite0's instance group under
    that host policy (``--host-policy NAME,cpu-cores=...`` on the server).
    """
    dst.mkdir(parents=True)
    for name in PIPELINE_MODELS:
        shutil.copytree(REPO / name, dst / name)
    cfg = dst / "preprocess" / "config.pbtxt"
    text = cfg.read_text()
    text, n = re.subn(r"count: \d+", f"count: {preprocess_instances}", text)
    assert n == 1
    if preprocess_batch:
        text, n = re.subn(
            r"dynamic_batching \{ \}",
            f"dynamic_batching {{ preferred_batch_size: [ {preprocess_batch} ] }}",
            text,
        )
        assert n == 1
    cfg.write_text(text)
    cfg = dst / "efficientnet_lite0" / "config.pbtxt"
    text = cfg.read_text()
    if predictor_batching and "dynamic_batching" not in text:
        policy = f', host_policy: "{predictor_policy}"' if predictor_policy else ""
        text += (
            f"dynamic_batching {{ }}\ninstance_group [ {{ count: 1, kind: KIND_CPU{policy} }} ]\n"
        )
        if predictor_threads:
            text += (
                'parameters { key: "intra_op_thread_count" '
                f'value: {{ string_value: "{predictor_threads}" }} }}\n'
            )
        cfg.write_text(text)
    return dst


# --------------------------------------------------------------------------- shm


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _bench_shm(repeats: int) -> list[dict[str, Any]]:
    from pdserve import config as cfgmod
    from pdserve.backends.base import ExecRequest, ModelSpec
    from pdserve.backends.python import triton_python_backend_utils as pb
    from pdserve.backends.python.backend import PythonBackend
    from pdserve.backends.python.worker import load_model_module
    from pdserve.core.types import InferRequest

    tmp = Path(tempfile.mkdtemp(prefix="bench_shm_"))
    model_dir = tmp / "identity"
    shutil.copytree(DATA / "identity", model_dir)
    cfg_path = model_dir / "config.pbtxt"
    cfg_path.write_text(cfg_path.read_text().replace('string_value: "0.05"', 'string_value: "0"'))
    cfg = cfgmod.load_model_config(model_dir)
    cfgmod.normalize_platform(cfg)
    cfg.max_batch_size = 64
    spec = ModelSpec("identity", 1, cfg, model_dir, model_dir / "1", tmp)
    (instance,) = await PythonBackend().load(spec)

    module = load_model_module(
        str(model_dir / "1" / "model.py"), str(model_dir / "1"), str(model_dir)
    )
    local = module.TritonPythonModel()
    local.initialize({"model_config": json.dumps(cfgmod.config_to_json(cfg))})

    rows = []
    sizes = [
        ("64 B", (1, 16)),
        ("602 KB (3x224x224 FP32)", (1, 150528)),
        ("19 MB (32x3x224x224 FP32)", (32, 150528)),
    ]
    for label, shape in sizes:
        x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        n = repeats if x.nbytes < 10_000_000 else max(repeats // 10, 50)

        async def through_worker(x: np.ndarray = x, shape: tuple[int, int] = shape) -> None:
            req = ExecRequest(
                {"INPUT0": x}, ["OUTPUT0", "CALL_SIZE", "PID"], InferRequest("identity"), shape[0]
            )
            (result,) = await instance.execute([req])
            assert result["OUTPUT0"].shape == x.shape

        def in_process(x: np.ndarray = x) -> None:
            request = pb.InferenceRequest(
                model_name="identity",
                requested_output_names=["OUTPUT0", "CALL_SIZE", "PID"],
                inputs=[pb.Tensor("INPUT0", x)],
            )
            (response,) = local.execute([request])
            assert response.output_tensors()[0].as_numpy().shape == x.shape

        for _ in range(20):
            await through_worker()
            in_process()
        worker_pid = instance.conn.pid
        worker_t, local_t = [], []
        cpu0, wcpu0 = time.process_time(), _cpu_seconds(worker_pid)
        for _ in range(n):
            t = time.perf_counter()
            await through_worker()
            worker_t.append(time.perf_counter() - t)
        server_cpu = (time.process_time() - cpu0) / n
        worker_cpu = (_cpu_seconds(worker_pid) - wcpu0) / n
        for _ in range(n):
            t = time.perf_counter()
            in_process()
            local_t.append(time.perf_counter() - t)
        w = np.array(worker_t) * 1e6
        lo = np.array(local_t) * 1e6
        rows.append(
            {
                "tensor": label,
                "bytes": int(x.nbytes),
                "requests": n,
                "worker_p50_us": round(float(np.percentile(w, 50)), 1),
                "worker_p99_us": round(float(np.percentile(w, 99)), 1),
                "in_process_p50_us": round(float(np.percentile(lo, 50)), 1),
                "overhead_p50_us": round(float(np.percentile(w, 50) - np.percentile(lo, 50)), 1),
                "server_cpu_us": round(server_cpu * 1e6, 1),
                "worker_cpu_us": round(worker_cpu * 1e6, 1),
                "worker_GBps": round(2 * x.nbytes / (np.percentile(w, 50) / 1e6) / 1e9, 2),
            }
        )
    await instance.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return rows


# --------------------------------------------------------------------------- pipeline


def best_of(tries: int, *args: Any, core: str | None = None) -> dict[str, Any]:
    """The best of ``tries`` runs of one load point (the machine is shared: other
    processes only ever make a point slower), with the load average before each."""
    runs = []
    for _ in range(tries):
        load = os.getloadavg()[0]
        r = load_point(*args, core=core)
        r["loadavg_before"] = round(load, 2)
        runs.append(r)
    best = max(runs, key=lambda r: r["rps"])
    best["tries_rps"] = [r["rps"] for r in runs]
    return best


#: The repository / server variants of the pipeline benchmark (see :func:`make_repo`).
#: ``server_args``: extra ``pdserve serve`` options; ``client_core``: the load
#: generator's core (``taskset``), else it floats; ``main_thread_core``: the core of
#: the server's main thread (its event loop), else it floats.
#: Host policies giving efficientnet_lite0 (batched, one intra-op thread) core 0 and
#: everything else — python workers, the event loop, the load generator — core 1.
PINNED: dict[str, Any] = {
    "preprocess_instances": 1,
    "predictor_batching": True,
    "predictor_threads": 1,
    "predictor_policy": "predictor",
    "server_args": ["--host-policy", "predictor,cpu-cores=0", "--host-policy", "cpu,cpu-cores=1"],
    "client_core": "1",
    "main_thread_core": "1",
}
VARIANTS: list[dict[str, Any]] = [
    {"label": "as shipped but 2 preprocess", "preprocess_instances": 2},
    {"label": "as shipped (1 preprocess)", "preprocess_instances": 1},
    {
        "label": "predictor batched, 1 preprocess",
        "preprocess_instances": 1,
        "predictor_batching": True,
    },
    {"label": "host policies: predictor on core 0, the rest on core 1", **PINNED},
    {"label": "host policies, preprocess batches of 1", **PINNED, "preprocess_batch": 1},
]


def bench_pipeline(
    duration: float, warmup: float, work: Path, rounds: int, only: set[int] | None = None
) -> dict[str, Any]:
    """Stage capacities and pipeline throughput for the repository variants
    (:data:`VARIANTS`, those whose index is in ``only`` when given), in ``rounds``
    rounds per variant (:func:`_round`); the summary takes the medians."""
    jpeg = np.load(GOLDENS / "image_classifier.npz")["image_bytes_flower"].tobytes()
    image_tensor = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    logits = np.random.default_rng(1).standard_normal((1, 1000), dtype=np.float32)
    bodies = {
        "image_classifier": binary_body(
            [("input_image_bytes", "BYTES", [1, 1], bytes_element(jpeg))],
            ["top5_labels", "top5_confidences"],
        ),
        "preprocess": binary_body(
            [("input_image_bytes", "BYTES", [1, 1], bytes_element(jpeg))], ["image_tensor"]
        ),
        "efficientnet_lite0": binary_body(
            [("input", "FP32", [1, 3, 224, 224], image_tensor.tobytes())], ["logits"]
        ),
        "postprocess": binary_body(
            [("logits", "FP32", [1, 1000], logits.tobytes())], ["top5_labels", "top5_confidences"]
        ),
    }
    out: dict[str, Any] = {"image": "flower.jpg", "image_bytes": len(jpeg), "variants": []}
    for i, variant in enumerate(VARIANTS):
        if only and i not in only:
            continue
        label = variant["label"]
        repo = make_repo(
            work / f"repo{i}",
            variant["preprocess_instances"],
            variant.get("predictor_batching", False),
            variant.get("predictor_threads", 0),
            preprocess_batch=variant.get("preprocess_batch", 0),
            predictor_policy=variant.get("predictor_policy", ""),
        )
        proc, port = start_server(repo, work / f"server{i}.log", *variant.get("server_args", ()))
        client = variant.get("client_core")
        if variant.get("main_thread_core") and shutil.which("taskset"):
            # Only the thread whose id is the pid: the event loop (HTTP, ensemble,
            # dispatch). Instances under a host policy have pinned themselves.
            subprocess.run(
                ["taskset", "-p", "-c", variant["main_thread_core"], str(proc.pid)],
                check=True,
                capture_output=True,
            )
        try:
            entry: dict[str, Any] = {**variant, "rounds": []}
            for k in range(rounds):
                entry["rounds"].append(
                    _round(port, bodies, duration, warmup, client, f"{label}, round {k + 1}")
                )
            stats = json.loads(
                urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/v2/models/efficientnet_lite0/stats"
                ).read()
            )["model_stats"][0]
            entry["predictor_batches"] = {
                "inference_count": stats["inference_count"],
                "execution_count": stats["execution_count"],
            }
            entry["summary"] = _summary(entry["rounds"])
            out["variants"].append(entry)
        finally:
            stop_server(proc)
    return out


def _busy_ns(port: int, model: str) -> int:
    """Nanoseconds ``model``'s instances have spent executing batches so far (the
    compute_input + compute_infer + compute_output totals of its ``batch_stats``)."""
    url = f"http://127.0.0.1:{port}/v2/models/{model}/stats"
    with urllib.request.urlopen(url) as r:
        stats = json.loads(r.read())["model_stats"][0]
    return sum(
        b[k]["ns"]
        for b in stats["batch_stats"]
        for k in ("compute_input", "compute_infer", "compute_output")
    )


def _instances(port: int, model: str) -> int:
    """The number of instances in ``model``'s configuration."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/config") as r:
        cfg = json.loads(r.read())
    return sum(int(g.get("count", 1)) for g in cfg.get("instance_group", [])) or 1


def busy_load_point(
    port: int,
    model: str,
    body: bytes,
    head_len: int,
    concurrency: int,
    duration: float,
    warmup: float,
    core: str | None,
    watched: str = "efficientnet_lite0",
) -> dict[str, Any]:
    """:func:`load_point`, plus how busy ``watched``'s instances were meanwhile.

    The statistics extension is polled every 0.25 s while the load runs; the
    fraction is the growth of the instances' execution time over the wall time
    between the first poll after warm-up and the last before the end, divided by
    the instance count (1.0: an instance was always executing a batch). Measured
    in the same seconds as the throughput, so it does not suffer from the VM's
    speed drifting between measurements.
    """
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            samples.append((time.monotonic(), _busy_ns(port, watched)))
            done.wait(0.25)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        r = load_point(port, model, body, head_len, concurrency, duration, warmup, core=core)
    finally:
        done.set()
        thread.join()
    end = time.monotonic()
    # loadgen's own start-up is part of [start, end - duration - warmup]; keep clear of it.
    lo, hi = end - duration + 0.5, end - 0.5
    window = [x for x in samples if lo <= x[0] <= hi]
    if len(window) >= 2:
        (t0, b0), (t1, b1) = window[0], window[-1]
        r["predictor_busy"] = round((b1 - b0) / ((t1 - t0) * 1e9 * _instances(port, watched)), 3)
    return r


def _round(
    port: int,
    bodies: dict[str, tuple[bytes, int]],
    duration: float,
    warmup: float,
    client: str | None,
    label: str,
) -> dict[str, Any]:
    """One round: each stage alone (c = 8 and 32, the better is its capacity), then
    the pipeline at c = 1, 8, 32, and the pipeline's ratio to the slowest stage of
    this round (measured minutes apart at most: the VM's speed drifts)."""
    rnd: dict[str, Any] = {"stages": {}, "pipeline": []}
    for model in ("preprocess", "efficientnet_lite0", "postprocess"):
        rnd["stages"][model] = [
            busy_load_point(port, model, *bodies[model], c, duration, warmup, client)
            if model == "efficientnet_lite0"
            else load_point(port, model, *bodies[model], c, duration, warmup, core=client)
            for c in (8, 32)
        ]
    caps = {m: max(r["rps"] for r in rs) for m, rs in rnd["stages"].items()}
    slowest = min(caps, key=caps.__getitem__)
    rnd["capacity"], rnd["slowest_stage"] = caps, slowest
    for c in (1, 8, 32):
        r = busy_load_point(
            port, "image_classifier", *bodies["image_classifier"], c, duration, warmup, client
        )
        r["loadavg_before"] = round(os.getloadavg()[0], 2)
        r["ratio_to_slowest"] = round(r["rps"] / caps[slowest], 3)
        rnd["pipeline"].append(r)
    print(
        f"  [{label}] alone: "
        + " / ".join(f"{m} {v:.0f}" for m, v in caps.items())
        + "; pipeline: "
        + ", ".join(
            f"c={r['concurrency']} {r['rps']:.1f}/s ({r['ratio_to_slowest']:.2f}, "
            f"predictor busy {r.get('predictor_busy', 0):.2f})"
            for r in rnd["pipeline"]
        ),
        file=sys.stderr,
    )
    return rnd


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds: each stage's capacity, and per concurrency the
    pipeline's images/s, p50, p99 and ratio to that round's slowest stage."""
    caps = {
        m: round(statistics.median(r["capacity"][m] for r in rounds), 1)
        for m in rounds[0]["capacity"]
    }
    rows = []
    for i, first in enumerate(rounds[0]["pipeline"]):
        runs = [r["pipeline"][i] for r in rounds]
        rows.append(
            {
                "concurrency": first["concurrency"],
                "rps": round(statistics.median(r["rps"] for r in runs), 1),
                "p50_ms": round(statistics.median(r["p50_ms"] for r in runs), 1),
                "p99_ms": round(statistics.median(r["p99_ms"] for r in runs), 1),
                "ratio_to_slowest": round(
                    statistics.median(r["ratio_to_slowest"] for r in runs), 3
                ),
                "ratios": [r["ratio_to_slowest"] for r in runs],
                "predictor_busy": round(
                    statistics.median(r.get("predictor_busy", 0.0) for r in runs), 3
                ),
                "predictor_busy_each": [r.get("predictor_busy") for r in runs],
            }
        )
    alone_busy = [
        r.get("predictor_busy", 0.0) for rnd in rounds for r in rnd["stages"]["efficientnet_lite0"]
    ]
    return {
        "capacity": caps,
        "slowest_stage": min(caps, key=caps.__getitem__),
        "pipeline": rows,
        "predictor_alone_busy": round(statistics.median(alone_busy), 3),
    }


def _ort_images_per_s(session: Any, batch: int, runs: int) -> tuple[float, float]:
    """(median ms per run, images/s) of ``session`` on random ``batch`` images."""
    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224), dtype=np.float32)
    session.run(None, {"input": x})
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        session.run(None, {"input": x})
        ts.append(time.perf_counter() - t)
    ms = statistics.median(ts) * 1000
    return round(ms, 1), round(batch * 1000 / ms, 1)


#: Work for the other core while the predictor is timed on core 0: a pure Python
#: loop (no memory traffic) or the image preprocessing of the pipeline.
NEIGHBOURS = {
    "idle": None,
    "python spin loop": "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n",
    "preprocessing.py loop": (
        "import sys, time\nimport numpy as np\nsys.path.insert(0, {examples!r})\n"
        "import preprocessing\nd = np.load({goldens!r})['image_bytes_flower'].tobytes()\n"
        "t = time.time()\nwhile time.time() - t < {s}: preprocessing.preprocess_image(d)\n"
    ),
}


def bench_in_process_stages() -> dict[str, Any]:
    """Stage costs without the server: preprocessing.py per image, ORT per batch size
    on every core, and ORT on one thread pinned to core 0 while core 1 is idle or
    busy (how much a busy neighbour core slows the predictor on this machine)."""
    import onnxruntime as ort

    sys.path.insert(0, str(ROOT / "examples"))
    import preprocessing

    jpeg = np.load(GOLDENS / "image_classifier.npz")["image_bytes_flower"].tobytes()
    times = []
    for _ in range(30):
        t = time.perf_counter()
        preprocessing.preprocess_image(jpeg)
        times.append(time.perf_counter() - t)
    model = str(REPO / "efficientnet_lite0" / "1" / "model.onnx")
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    ort_rows = []
    for bs in (1, 8, 32):
        ms, ips = _ort_images_per_s(session, bs, max(3, 48 // bs))
        ort_rows.append({"batch": bs, "ms": ms, "images_per_s": ips})
    out: dict[str, Any] = {
        "preprocess_ms_per_image_one_core": round(statistics.median(times) * 1000, 2),
        "onnxruntime": ort_rows,
    }
    if not {0, 1} <= os.sched_getaffinity(0) or shutil.which("taskset") is None:
        return out
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})  # this thread only: ORT runs in it with one thread
    try:
        one = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        rows = []
        for name, code in NEIGHBOURS.items():
            neighbour = None
            if code is not None:
                script = code.format(
                    s=20,
                    examples=str(ROOT / "examples"),
                    goldens=str(GOLDENS / "image_classifier.npz"),
                )
                neighbour = subprocess.Popen(["taskset", "-c", "1", PY, "-c", script])
                time.sleep(1.0)
            try:
                for bs in (1, 4):
                    ms, ips = _ort_images_per_s(one, bs, 48 // bs)
                    rows.append({"neighbour": name, "batch": bs, "ms": ms, "images_per_s": ips})
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
        out["onnxruntime_core0_one_thread"] = rows
    finally:
        os.sched_setaffinity(0, saved)
    return out


# --------------------------------------------------------------------------- real Triton

#: efficientnet_lite0 as a python-backend model running ONNX Runtime (the tritonserver
#: in the nvidia-pytriton wheel has only the python backend). It batches the
#: requests of one execute() call into one session run, as an ONNX backend would.
ORT_PYTHON_MODEL = """
import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        threads = int(config.get("parameters", {}).get("intra_op_thread_count", {}).get("string_value", "0") or 0)
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(r, "input").as_numpy() for r in requests]
        logits = self.session.run(["logits"], {"input": np.concatenate(arrays)})[0]
        responses, start = [], 0
        for a in arrays:
            part = logits[start : start + len(a)]
            start += len(a)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("logits", part)]))
        return responses
"""


def make_python_predictor_repo(dst: Path, threads: int) -> Path:
    """The image pipeline as both servers can run it: the example repository's
    ``preprocess``, ``postprocess`` and ``image_classifier`` unchanged (raw image as
    BYTES), and efficientnet_lite0 as a python model running ONNX Runtime
    (:data:`ORT_PYTHON_MODEL`) with ``dynamic_batching { }``, one instance and
    ``threads`` intra-op threads.
    """
    make_repo(dst, 2, True, threads)
    model_dir = dst / "efficientnet_lite0"
    cfg = model_dir / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('platform: "onnxruntime_onnx"', 'backend: "python"'))
    (model_dir / "1" / "model.py").write_text(ORT_PYTHON_MODEL.lstrip())
    return dst


def check_top5(port: int, jpeg: bytes, expected: list[str]) -> list[str]:
    """Send ``jpeg`` once to ``image_classifier`` and check its top-5 labels.

    Raises:
        RuntimeError: the labels differ from ``expected`` (the build-time PyTorch
            top-5), i.e. the server computed something else.
    """
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    inp = httpclient.InferInput("input_image_bytes", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[jpeg]], dtype=object), binary_data=True)
    result = client.infer("image_classifier", [inp])
    labels = [x.decode() for x in result.as_numpy("top5_labels")[0]]
    client.close()
    if labels != expected:
        raise RuntimeError(f"top-5 {labels} differs from the golden {expected}")
    return labels


def bench_triton(
    triton_python: Path, duration: float, warmup: float, work: Path, tries: int, threads: int = 1
) -> dict[str, Any]:
    """The same pipeline, images and client on real Triton (pytriton's tritonserver
    2.51) and on pdserve, with efficientnet_lite0 as a python model running ORT on
    both; pdserve also with its own ONNX Runtime backend for the predictor.

    ``triton_python``: the interpreter of a venv holding nvidia-pytriton, numpy < 2,
    onnxruntime and Pillow (``benchmarks/bench_peers.py --install`` makes
    ``benchmarks/.venvs/triton``).
    """
    goldens = np.load(GOLDENS / "image_classifier.npz")
    jpeg = goldens["image_bytes_flower"].tobytes()
    expected = [str(x) for x in goldens["top5_labels"][list(goldens["names"]).index("flower")]]
    body = binary_body(
        [("input_image_bytes", "BYTES", [1, 1], bytes_element(jpeg))],
        ["top5_labels", "top5_confidences"],
    )
    out: dict[str, Any] = {"predictor_intra_op_threads": threads, "servers": {}}
    for name in ("triton", "pdserve", "pdserve (ORT backend)"):
        if name == "pdserve (ORT backend)":
            repo = make_repo(work / "pdserve_onnx_repo", 2, True, threads)
        else:
            repo = make_python_predictor_repo(work / f"{name}_repo", threads)
        if name == "triton":
            port = free_port()
            cmd, env = tritonserver_command(triton_python, repo, port, work / "backends")
            log = work / "triton.log"
            proc = subprocess.Popen(  # noqa: SIM115
                cmd,
                stdout=open(log, "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
            )
            wait_ready(proc, port, log, "tritonserver", interval=0.3, tail=3000)
        else:
            proc, port = start_server(repo, work / f"pdserve{len(out['servers'])}.log")
        try:
            check_top5(port, jpeg, expected)
            rows = []
            for c in (1, 8, 32):
                r = best_of(tries, port, "image_classifier", *body, c, duration, warmup)
                rows.append(r)
                print(
                    f"  [{name}] image_classifier c={c}: {r['rps']:.1f}/s p99 {r['p99_ms']:.0f} ms",
                    file=sys.stderr,
                )
            out["servers"][name] = rows
        finally:
            stop_server(proc)
    return out


# --------------------------------------------------------------------------- report


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown tables."""
    lines = []
    if "shm" in results:
        lines += [
            "| tensor | through the worker p50 / p99 | in-process call p50 | overhead per request (p50) | CPU per request: server + worker | effective GB/s (in+out) |",
            "|---|---|---|---|---|---|",
        ]
        for r in results["shm"]:
            lines.append(
                f"| {r['tensor']} | {r['worker_p50_us']:.0f} / {r['worker_p99_us']:.0f} µs | "
                f"{r['in_process_p50_us']:.0f} µs | {r['overhead_p50_us']:.0f} µs | "
                f"{r['server_cpu_us']:.0f} + {r['worker_cpu_us']:.0f} µs | {r['worker_GBps']} |"
            )
        lines.append("")
    if "in_process" in results:
        ip = results["in_process"]
        lines.append(
            f"In-process stage costs: preprocessing.py {ip['preprocess_ms_per_image_one_core']} ms/image on one core; "
            + ", ".join(
                f"ORT batch {r['batch']}: {r['ms']} ms ({r['images_per_s']} img/s)"
                for r in ip["onnxruntime"]
            )
        )
        for r in ip.get("onnxruntime_core0_one_thread", []):
            lines.append(
                f"- ORT, 1 thread on core 0, batch {r['batch']}, core 1 {r['neighbour']}: "
                f"{r['ms']} ms ({r['images_per_s']} img/s)"
            )
        lines.append("")
    if "pipeline" in results:
        lines += [
            "| variant | stage capacity (images/s): preprocess / efficientnet / postprocess | c | images/s | p50 ms | p99 ms | ratio to slowest stage: median (each round) | predictor busy: median (each round) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for v in results["pipeline"]["variants"]:
            sm = v["summary"]
            caps = sm["capacity"]
            cap_text = " / ".join(
                f"{caps[m]:.0f}" for m in ("preprocess", "efficientnet_lite0", "postprocess")
            )
            for r in sm["pipeline"]:
                each = ", ".join(f"{x:.2f}" for x in r["ratios"])
                busy = ", ".join(f"{x or 0:.2f}" for x in r["predictor_busy_each"])
                lines.append(
                    f"| {v['label']} | {cap_text} | {r['concurrency']} | {r['rps']:.1f} | "
                    f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | **{r['ratio_to_slowest']:.2f}** ({each}) "
                    f"| **{r['predictor_busy']:.2f}** ({busy}) |"
                )
            lines.append(
                f"| {v['label']}: efficientnet_lite0 alone | | 8, 32 | | | | | "
                f"{sm['predictor_alone_busy']:.2f} |"
            )
        lines.append("")
        for v in results["pipeline"]["variants"]:
            b = v["predictor_batches"]
            lines.append(
                f"- {v['label']}: efficientnet_lite0 ran {b['inference_count']} images in "
                f"{b['execution_count']} executions ({b['inference_count'] / max(b['execution_count'], 1):.1f} per batch)"
            )
    if "triton" in results:
        t = results["triton"]["servers"]
        lines += [
            "",
            "| server (predictor: a python model running ORT, or pdserve's ORT backend) | c | images/s | p50 ms | p99 ms |",
            "|---|---|---|---|---|",
        ]
        for name, rows in t.items():
            for r in rows:
                lines.append(
                    f"| {name} | {r['concurrency']} | {r['rps']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} |"
                )
        for a, b in zip(t.get("pdserve", []), t.get("triton", []), strict=False):
            lines.append(
                f"- c={a['concurrency']}: pdserve / Triton throughput {a['rps'] / b['rps']:.2f}, "
                f"p99 {a['p99_ms']:.0f} vs {b['p99_ms']:.0f} ms"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; print Markdown; write JSON."""
    p = cli_parser(__doc__, __file__)
    p.add_argument("--duration", type=float, default=6.0, help="measured seconds per load point")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per load point")
    p.add_argument("--repeats", type=int, default=2000, help="shared-memory round trips per size")
    p.add_argument(
        "--tries",
        type=int,
        default=3,
        help="pipeline: rounds per variant (medians reported); Triton: runs per point (best counts)",
    )
    p.add_argument("--skip-shm", action="store_true")
    p.add_argument("--skip-pipeline", action="store_true")
    p.add_argument(
        "--variants",
        default="",
        help="comma list of indices into VARIANTS to run (default: all): "
        + "; ".join(f"{i}: {v['label']}" for i, v in enumerate(VARIANTS)),
    )
    p.add_argument(
        "--triton",
        type=Path,
        nargs="?",
        const=ROOT / "benchmarks" / ".venvs" / "triton" / "bin" / "python",
        default=None,
        help="also run the pipeline on real Triton: the python of a venv with "
        "nvidia-pytriton, numpy<2, onnxruntime and Pillow (default: "
        "benchmarks/.venvs/triton/bin/python, created when missing)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "pipeline.json")
    args = p.parse_args(argv)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }
    if not args.skip_shm:
        results["shm"] = asyncio.run(_bench_shm(args.repeats))
    results["in_process"] = bench_in_process_stages()
    if not args.skip_pipeline:
        with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
            only = {int(x) for x in args.variants.split(",") if x.strip()} or None
            results["pipeline"] = bench_pipeline(
                args.duration, args.warmup, Path(tmp), args.tries, only
            )
    if args.triton is not None:
        if not args.triton.exists() and args.triton.parent.parent.name == "triton":
            from bench_peers import ensure_venv  # its PEER_REQUIREMENTS["triton"]

            ensure_venv("triton", install=True)
        with tempfile.TemporaryDirectory(prefix="bench_triton_") as tmp:
            results["triton"] = bench_triton(
                args.triton, args.duration, args.warmup, Path(tmp), args.tries
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
