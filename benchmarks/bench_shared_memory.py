"""Issue 15 item 4 benchmark: system shared memory vs the binary tensor extension for
602 KB inputs (one 1x3x224x224 FP32 image), requests/s and server CPU per request.

Two models take the image: ``efficientnet_lite0`` (about 11 ms of CPU per image, which
hides the transport) and ``pool602k``, built here: one ONNX ``GlobalAveragePool``
(3 floats out), so that what is measured is mostly moving the 602 KB in.

pdserve serves both with ``--allow-client-shm`` pinned to core 0; the
load client runs pinned to core 1 (closed loop, C concurrent requests, bounded in
time). The same image is sent each time:

- ``binary``: HTTP with the binary tensor extension (what ``tritonclient.http`` sends
  with ``binary_data=True``); gRPC with ``raw_input_contents``.
- ``shm-in``: the input in a registered region (``shared_memory_region``), the
  4 KB output in the response.
- ``shm-in-out``: the output written into a region as well (every concurrent
  request writes the same bytes: fine for a benchmark).

Server CPU per request: the server process's user + system CPU seconds over the
point, divided by the requests it completed over the same time (the model's
statistics, so the client's warm-up is counted on both sides). The client fills the
region once; a real client writes each new image into it (one 602 KB copy on its
side), which this leaves out.

Usage::

    .venv/bin/python benchmarks/bench_shared_memory.py [--duration 4] [--concurrency 1,4]

Prints a Markdown table and writes the raw figures as JSON
(``benchmarks/out/shared_memory.json``).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from bench_grpc_http import efficientnet_input, grpc_body, grpc_load, http_binary_body, http_load
from common import REPO, ROOT, cli_parser, proc_stats, start_server, stop_process

MODELS = {"efficientnet_lite0": "logits", "pool602k": "y"}


def build_repo(root: Path) -> Path:
    """A repository with ``efficientnet_lite0`` (a link to the example) and ``pool602k``."""
    import onnx
    from onnx import TensorProto, helper

    repo = root / "repo"
    (repo / "pool602k" / "1").mkdir(parents=True)
    (repo / "efficientnet_lite0").symlink_to(REPO / "efficientnet_lite0")
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["x"], ["p"]),
         helper.make_node("Flatten", ["p"], ["y"])],
        "pool602k",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(repo / "pool602k" / "1" / "model.onnx"))
    (repo / "pool602k" / "config.pbtxt").write_text(
        'name: "pool602k"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        'input [ { name: "x", data_type: TYPE_FP32, dims: [ 3, 224, 224 ] } ]\n'
        'output [ { name: "y", data_type: TYPE_FP32, dims: [ 3 ] } ]\n'
    )
    return repo


def http_shm_body(x: np.ndarray, name: str, out: str, out_in_shm: bool) -> bytes:
    outputs: list[dict[str, Any]] = [{"name": out, "parameters": {"binary_data": True}}]
    if out_in_shm:
        outputs = [
            {
                "name": out,
                "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 4000},
            }
        ]
    return json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {
                        "shared_memory_region": "in",
                        "shared_memory_byte_size": x.nbytes,
                    },
                }
            ],
            "outputs": outputs,
        }
    ).encode()


def grpc_shm_body(x: np.ndarray, model: str, name: str, out: str, out_in_shm: bool) -> bytes:
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=model)
    t = req.inputs.add(name=name, datatype="FP32", shape=list(x.shape))
    t.parameters["shared_memory_region"].string_param = "in"
    t.parameters["shared_memory_byte_size"].int64_param = x.nbytes
    if out_in_shm:
        o = req.outputs.add(name=out)
        o.parameters["shared_memory_region"].string_param = "out"
        o.parameters["shared_memory_byte_size"].int64_param = 4000
    return req.SerializeToString()


def served(http_port: int, model: str) -> int:
    url = f"http://127.0.0.1:{http_port}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=10) as r:
        stats = json.load(r)["model_stats"]
    return sum(s["inference_stats"]["success"]["count"] for s in stats)


def post(http_port: int, path: str, doc: dict[str, Any] | None = None) -> None:
    data = json.dumps(doc or {}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}{path}", data=data, method="POST")
    with urllib.request.urlopen(req, timeout=10):
        pass


def main(argv: list[str] | None = None) -> int:
    p = cli_parser(__doc__, __file__)
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per point")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "shared_memory.json")
    args = p.parse_args(argv)
    import tritonclient.utils.shared_memory as shm

    x = np.ascontiguousarray(efficientnet_input())
    assert x.nbytes == 602112, x.shape
    tag = uuid.uuid4().hex[:8]
    h_in = shm.create_shared_memory_region("in", f"/pdbench_{tag}_in", x.nbytes)
    h_out = shm.create_shared_memory_region("out", f"/pdbench_{tag}_out", 4000)
    shm.set_shared_memory_region(h_in, [x])
    import tempfile

    tmp = tempfile.TemporaryDirectory()
    proc, http_port, grpc_port, _ = start_server(build_repo(Path(tmp.name)), "--allow-client-shm")
    rows: list[dict[str, Any]] = []
    try:
        post(
            http_port,
            "/v2/systemsharedmemory/region/in/register",
            {"key": f"/pdbench_{tag}_in", "offset": 0, "byte_size": x.nbytes},
        )
        post(
            http_port,
            "/v2/systemsharedmemory/region/out/register",
            {"key": f"/pdbench_{tag}_out", "offset": 0, "byte_size": 4000},
        )
        target = f"127.0.0.1:{grpc_port}"
        d = args.duration
        for model, out in MODELS.items():
            url = f"http://127.0.0.1:{http_port}/v2/models/{model}/infer"
            name = "input" if model == "efficientnet_lite0" else "x"
            bin_body, bin_header = http_binary_body(name, out, x)
            hs = [http_shm_body(x, name, out, o) for o in (False, True)]
            gb = grpc_body(model, name, x)
            gs = [grpc_shm_body(x, model, name, out, o) for o in (False, True)]
            cases: list[tuple[str, str, bytes, list[str]]] = [
                ("HTTP", "binary", bin_body, [bin_header]),
                ("HTTP", "shm-in", hs[0], []),
                ("HTTP", "shm-in-out", hs[1], []),
                ("gRPC", "binary", gb, []),
                ("gRPC", "shm-in", gs[0], []),
                ("gRPC", "shm-in-out", gs[1], []),
            ]
            for c in [int(v) for v in args.concurrency.split(",")]:
                for proto, mode, body, headers in cases:
                    before = proc_stats(proc.pid)
                    n0 = served(http_port, model)
                    if proto == "HTTP":
                        r = http_load(url, body, headers, c, d)
                    else:
                        r = grpc_load(target, body, c, d)
                    after = proc_stats(proc.pid)
                    n = served(http_port, model) - n0
                    assert before is not None and after is not None
                    cpu_ms = (after["cpu_s"] - before["cpu_s"]) * 1000 / max(n, 1)
                    row = {
                        "model": model,
                        "protocol": proto,
                        "mode": mode,
                        "concurrency": c,
                        "rps": r["rps"],
                        "p50_ms": r["p50_ms"],
                        "p99_ms": r["p99_ms"],
                        "errors": r["errors"],
                        "server_cpu_ms_per_request": round(cpu_ms, 3),
                        "served": n,
                    }
                    rows.append(row)
                    print(
                        f"{model:<18} {proto:<5} {mode:<11} c={c:<3} {r['rps']:>8.1f} req/s  p50 "
                        f"{r['p50_ms']:>7.2f} ms  server CPU {cpu_ms:>6.2f} ms/req  "
                        f"errors {r['errors']}",
                        file=sys.stderr,
                        flush=True,
                    )
        pooled = shm.get_contents_as_numpy(h_out, np.float32, [1, 3])  # the last shm-in-out
        np.testing.assert_allclose(pooled[0], x.mean(axis=(2, 3))[0], rtol=1e-4)
    finally:
        stop_process(proc)
        tmp.cleanup()
        shm.destroy_shared_memory_region(h_in)
        shm.destroy_shared_memory_region(h_out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "load": os.getloadavg()}, indent=1))
    print(
        "| model | protocol | input / output | c | req/s | p50 ms | server CPU ms/req | vs binary req/s | vs binary CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        base = next(
            b for b in rows
            if b["protocol"] == row["protocol"] and b["concurrency"] == row["concurrency"]
            and b["mode"] == "binary" and b["model"] == row["model"]
        )  # fmt: skip
        print(
            f"| {row['model']} | {row['protocol']} | {row['mode']} | {row['concurrency']} | {row['rps']:,.1f} | "
            f"{row['p50_ms']:.2f} | {row['server_cpu_ms_per_request']:.2f} | "
            f"{row['rps'] / base['rps']:.2f} | "
            f"{row['server_cpu_ms_per_request'] / base['server_cpu_ms_per_request']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
