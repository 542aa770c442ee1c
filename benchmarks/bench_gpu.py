"""Issue 16, item 2: the image pipeline with its predictor on a GPU.

On a machine with an NVIDIA GPU this serves the example image pipeline (raw JPEG/PNG in,
top-5 out: ``preprocess`` (python) -> predictor -> ``postprocess`` (python)) with

- the predictor on GPU 0, ``KIND_GPU``, one instance with ``dynamic_batching``
  (``max_batch_size`` 32): ``efficientnet_lite0_torch`` on the **PyTorch backend**
  (when torch is a CUDA build that sees the GPU) and ``efficientnet_lite0`` on **ONNX
  Runtime's CUDA execution provider** (when the installed onnxruntime has it);
- ``preprocess`` on **N CPU worker processes** (instance count N), N = 1, 4, 8.

For each predictor it first checks correctness: the predictor alone, on the golden
photos' preprocessed tensors, must give the CPU logits of ``examples/goldens`` within
1e-3 and the same top-1; the pipeline must give the goldens' top-1 label for every
photo. Then, with ``benchmarks/loadgen.py`` (closed loop, HTTP binary tensor extension,
its own process): images/s and p50/p99 latency at concurrency 1, 64 and 256 for the
pipeline at each N, and for the predictor alone (one 602 KB tensor per request). During
every load point the GPU's utilisation and memory are sampled (``nvidia-smi``, 200 ms;
NVML through ``pynvml`` when nvidia-smi is missing).

Without a visible NVIDIA GPU (no driver, ``CUDA_VISIBLE_DEVICES`` empty) -- or with a GPU
but neither a CUDA torch nor onnxruntime's CUDA provider -- it says so and exits 0.

Usage::

    .venv/bin/python benchmarks/bench_gpu.py [--workers 1,4,8] [--concurrency 1,64,256]
        [--duration 5] [--warmup 2] [--predictors pytorch,onnxruntime]

Prints Markdown tables; writes ``benchmarks/out/bench_gpu.json``. Bounded: each load
point runs ``warmup + duration`` s; ~5 minutes with the defaults and both predictors.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import cli_parser

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
REPO = ROOT / "examples" / "model_repository"
GOLDENS = ROOT / "examples" / "goldens"
OUT = ROOT / "benchmarks" / "out"
PY = sys.executable

#: predictor -> (predictor model, ensemble, input, output, CPU reference npz, its key)
PREDICTORS: dict[str, tuple[str, str, str, str, str, str]] = {
    "pytorch": (
        "efficientnet_lite0_torch",
        "image_classifier_torch",
        "INPUT__0",
        "OUTPUT__0",
        "efficientnet_lite0_torch.npz",
        "logits",
    ),
    "onnxruntime": (
        "efficientnet_lite0",
        "image_classifier",
        "input",
        "logits",
        "efficientnet_lite0.npz",
        "onnx_logits",
    ),
}
#: Largest |GPU - CPU| logit difference accepted.
MAX_DIFF = 1e-3


# --------------------------------------------------------------------------- what is here


def gpu_count() -> tuple[int, str]:
    """Visible NVIDIA GPUs (driver + CUDA_VISIBLE_DEVICES) and a line saying so."""
    from pdserve.backends.devices import NVIDIA_GPUS_DIR, visible_gpu_count

    count = visible_gpu_count()
    if count:
        return count, f"{count} NVIDIA GPU(s) visible"
    if not NVIDIA_GPUS_DIR.is_dir():
        return 0, f"no NVIDIA kernel driver ({NVIDIA_GPUS_DIR} does not exist)"
    return (
        0,
        f"the driver's GPUs are hidden (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})",
    )


def predictors_here(wanted: list[str]) -> tuple[list[str], list[str]]:
    """The predictors that can run on GPU 0 here, and why the others cannot."""
    usable, why = [], []
    for name in wanted:
        if name == "pytorch":
            probe = subprocess.run(
                [
                    PY,
                    "-c",
                    "import torch; print(torch.__version__, torch.version.cuda, "
                    "torch.cuda.is_available() and torch.cuda.device_count())",
                ],
                capture_output=True,
                text=True,
            )
            fields = probe.stdout.split()
            if probe.returncode != 0:
                why.append("pytorch: torch is not installed (pip install 'pdserve[pytorch]')")
            elif fields[1] == "None" or fields[2] in ("False", "0"):
                why.append(f"pytorch: torch {fields[0]} has no CUDA device here")
            else:
                usable.append(name)
        elif name == "onnxruntime":
            import onnxruntime

            if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
                usable.append(name)
            else:
                why.append(
                    f"onnxruntime: {onnxruntime.__version__} has no CUDAExecutionProvider "
                    "(onnxruntime-gpu has it)"
                )
        else:
            raise SystemExit(f"unknown predictor {name!r}; choose from {sorted(PREDICTORS)}")
    return usable, why


# --------------------------------------------------------------------------- GPU sampling


class GpuSampler:
    """Samples GPU 0's utilisation (%) and memory (MiB) every 200 ms while running."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self.source = "none"

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"
            self._proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=utilization.gpu,memory.used",
                    "--format=csv,noheader,nounits",
                    "-i",
                    "0",
                    "-lms",
                    "200",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self._thread = threading.Thread(target=self._read_smi, daemon=True)
        else:
            try:
                import pynvml

                pynvml.nvmlInit()
                self.source = "nvml"
                self._thread = threading.Thread(target=self._read_nvml, daemon=True)
            except Exception:  # noqa: BLE001 - no way to sample: report none
                return self
        self._thread.start()
        return self

    def _read_smi(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((float(parts[0]), float(parts[1])))
            except (ValueError, IndexError):
                continue

    def _read_nvml(self) -> None:
        import pynvml

        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        while not self._stop.wait(0.2):
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            self.samples.append((float(util.gpu), mem.used / 2**20))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(5)

    def summary(self) -> dict[str, Any]:
        """Mean and max utilisation, max memory, sample count, source."""
        if not self.samples:
            return {"source": self.source, "samples": 0}
        util = [u for u, _ in self.samples]
        return {
            "source": self.source,
            "samples": len(util),
            "util_mean": statistics.fmean(util),
            "util_max": max(util),
            "mem_max_mib": max(m for _, m in self.samples),
        }


# --------------------------------------------------------------------------- requests and load


def bytes_element(data: bytes) -> bytes:
    """One BYTES element of the binary tensor extension (uint32 LE length + bytes)."""
    return struct.pack("<I", len(data)) + data


def binary_body(
    inputs: list[tuple[str, str, list[int], bytes]], outputs: list[str]
) -> tuple[bytes, int]:
    """A V2 request with every input in the binary tensor extension; (body, JSON length)."""
    header = {
        "inputs": [
            {"name": n, "datatype": dt, "shape": shape, "parameters": {"binary_data_size": len(d)}}
            for n, dt, shape, d in inputs
        ],
        "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in outputs],
    }
    head = json.dumps(header).encode()
    return head + b"".join(d for *_, d in inputs), len(head)


def load_point(
    port: int, model: str, body: bytes, head_len: int, concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One closed-loop load point (benchmarks/loadgen.py in its own process) with the GPU
    sampled meanwhile."""
    with tempfile.NamedTemporaryFile(suffix=".bin") as f, GpuSampler() as gpu:
        f.write(body)
        f.flush()
        out = subprocess.run(
            [
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
                str(args.duration),
                "--warmup",
                str(args.warmup),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=args.duration + args.warmup + 180,
        )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["gpu"] = gpu.summary()
    if result["errors"]:
        raise RuntimeError(
            f"{model} c={concurrency}: {result['errors']} errors: {result['first_error']}"
        )
    return result


# --------------------------------------------------------------------------- server


def make_repo(dst: Path, predictor: str, workers: int) -> Path:
    """The pipeline's models, the predictor on GPU 0 with dynamic batching, preprocess
    with ``workers`` CPU instances."""
    model, ensemble, *_ = PREDICTORS[predictor]
    dst.mkdir(parents=True)
    for name in ("preprocess", "postprocess", model, ensemble):
        shutil.copytree(REPO / name, dst / name)
    cfg = dst / "preprocess" / "config.pbtxt"
    text, n = re.subn(r"count: \d+", f"count: {workers}", cfg.read_text())
    if n != 1:
        raise RuntimeError(f"{cfg}: expected one instance count")
    cfg.write_text(text)
    cfg = dst / model / "config.pbtxt"
    text = re.sub(r"instance_group \[[^\]]*\]", "", cfg.read_text())
    text = re.sub(r"dynamic_batching \{[^}]*\}", "", text)
    text += (
        "instance_group [ { count: 1, kind: KIND_GPU, gpus: [ 0 ] } ]\n"
        "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
    )
    cfg.write_text(text)
    return dst


def start_server(repo: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """pdserve on ``repo`` (unpinned), ready; (process, HTTP port)."""
    import socket
    import urllib.request

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    http = port()
    cmd = [PY, "-m", "pdserve", "serve", "--model-repository", str(repo), "--host", "127.0.0.1"]
    cmd += ["--http-port", str(http), "--grpc-port", str(port()), "--metrics-port", str(port())]
    cmd += ["--strict-readiness"]
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve exited ({proc.returncode}); log: {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1):
                return proc, http
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"pdserve not ready after 300 s; log: {log}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 60 s."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# --------------------------------------------------------------------------- checks


def check_correctness(port: int, predictor: str) -> dict[str, Any]:
    """The predictor alone vs the CPU logits (1e-3, same top-1), and the pipeline's
    top-1 label on every golden photo.

    Raises:
        RuntimeError: a difference over 1e-3, another top-1, another label.
    """
    import tritonclient.http as httpclient

    model, ensemble, inp, out, ref_file, ref_key = PREDICTORS[predictor]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=300)
    with np.load(GOLDENS / ref_file) as g:
        inputs, cpu_logits = g["inputs"], g[ref_key]
    tensor = httpclient.InferInput(inp, list(inputs.shape), "FP32")
    tensor.set_data_from_numpy(inputs, binary_data=True)
    gpu_logits = client.infer(model, [tensor]).as_numpy(out)
    diff = float(np.max(np.abs(gpu_logits - cpu_logits)))
    if not diff <= MAX_DIFF:
        raise RuntimeError(
            f"{model} on GPU: logits differ from the CPU's by {diff:.3g} > {MAX_DIFF}"
        )
    if not np.array_equal(np.argmax(gpu_logits, 1), np.argmax(cpu_logits, 1)):
        raise RuntimeError(f"{model} on GPU: top-1 differs from the CPU's")
    with np.load(GOLDENS / "image_classifier.npz") as g:
        images = {k: g[k] for k in g.files}
    for row, name in enumerate(images["names"]):
        raw = images[f"image_bytes_{name}"].tobytes()
        t = httpclient.InferInput("input_image_bytes", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([[raw]], dtype=object))
        got = client.infer(ensemble, [t]).as_numpy("top5_labels")[0][0].decode()
        want = str(images["top5_labels"][row][0])
        if got != want:
            raise RuntimeError(f"{ensemble}: top-1 of {name} is {got!r}, the golden {want!r}")
    return {"max_abs_diff_vs_cpu": diff, "photos_top1_ok": len(images["names"])}


# --------------------------------------------------------------------------- driver


def run(args: argparse.Namespace, predictors: list[str]) -> dict[str, Any]:
    with np.load(GOLDENS / "image_classifier.npz") as g:
        jpeg = g["image_bytes_chelsea"].tobytes()
    with np.load(GOLDENS / "efficientnet_lite0_torch.npz") as g:
        tensor = np.ascontiguousarray(g["inputs"][:1])
    report: dict[str, Any] = {"predictors": {}}
    tmp = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    workers = [int(w) for w in args.workers.split(",")]
    conc = [int(c) for c in args.concurrency.split(",")]
    try:
        for predictor in predictors:
            model, ensemble, inp, out, *_ = PREDICTORS[predictor]
            entry: dict[str, Any] = {"model": model, "pipeline": {}, "predictor_alone": {}}
            report["predictors"][predictor] = entry
            pipe_body = binary_body(
                [("input_image_bytes", "BYTES", [1, 1], bytes_element(jpeg))],
                ["top5_labels", "top5_confidences"],
            )
            pred_body = binary_body([(inp, "FP32", [1, 3, 224, 224], tensor.tobytes())], [out])
            for n in workers:
                repo = make_repo(tmp / f"{predictor}_{n}", predictor, n)
                proc, port = start_server(repo, tmp / f"{predictor}_{n}.log")
                try:
                    if n == workers[0]:
                        entry["correctness"] = check_correctness(port, predictor)
                        print(f"{predictor}: {entry['correctness']}", flush=True)
                        for c in conc:
                            r = load_point(port, model, *pred_body, c, args)
                            entry["predictor_alone"][str(c)] = r
                            _print(predictor, "predictor alone", c, r)
                    entry["pipeline"][str(n)] = {}
                    for c in conc:
                        r = load_point(port, ensemble, *pipe_body, c, args)
                        entry["pipeline"][str(n)][str(c)] = r
                        _print(predictor, f"pipeline N={n}", c, r)
                finally:
                    stop_server(proc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _print(predictor: str, what: str, c: int, r: dict[str, Any]) -> None:
    g = r["gpu"]
    util = (
        f"GPU {g['util_mean']:.0f}% (max {g['util_max']:.0f}%)" if g.get("samples") else "GPU n/a"
    )
    print(
        f"{predictor:<12} {what:<16} c={c:<4} {r['rps']:8.1f} images/s  "
        f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  {util}",
        flush=True,
    )


def markdown(report: dict[str, Any]) -> str:
    """Markdown tables of a report."""
    lines = []
    for predictor, entry in report["predictors"].items():
        lines += [
            f"**{predictor}** ({entry['model']} on GPU 0): {entry.get('correctness')}",
            "",
            "| what | c | images/s | p50 ms | p99 ms | GPU util mean / max | GPU MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        rows = [("predictor alone", entry["predictor_alone"])]
        rows += [(f"pipeline, N={n} preprocess workers", p) for n, p in entry["pipeline"].items()]
        for what, points in rows:
            for c, r in points.items():
                g = r["gpu"]
                util = (
                    f"{g['util_mean']:.0f}% / {g['util_max']:.0f}%" if g.get("samples") else "n/a"
                )
                mem = f"{g['mem_max_mib']:.0f}" if g.get("samples") else "n/a"
                lines.append(
                    f"| {what} | {c} | {r['rps']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                    f"{util} | {mem} |"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the GPU benchmark, or say why it cannot run here (exit 0)."""
    parser = cli_parser(__doc__, __file__)
    parser.add_argument("--workers", default="1,4,8", help="preprocess instance counts")
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--duration", type=float, default=5.0, help="measured s per point")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured s per point")
    parser.add_argument("--predictors", default="pytorch,onnxruntime")
    args = parser.parse_args(argv)
    count, line = gpu_count()
    if not count:
        print(f"bench_gpu: no GPU to measure on this machine: {line}. Nothing was measured.")
        return 0
    predictors, why = predictors_here(args.predictors.split(","))
    for reason in why:
        print(f"bench_gpu: skipping {reason}")
    if not predictors:
        print(f"bench_gpu: {line}, but no predictor can use it here. Nothing was measured.")
        return 0
    if not (REPO / PREDICTORS[predictors[0]][0]).is_dir():
        print("bench_gpu: examples/model_repository is not built: run examples/build.py")
        return 1
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_before = os.getloadavg()
    report = run(args, predictors)
    smi = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if shutil.which("nvidia-smi")
        else None
    )
    report.update(
        when=started,
        gpus=line,
        gpu=smi.stdout.strip().splitlines()[0] if smi and smi.stdout.strip() else "unknown",
        cpus=len(os.sched_getaffinity(0)),
        load_average_before=load_before,
        load_average_after=os.getloadavg(),
        skipped=why,
        args=vars(args),
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
