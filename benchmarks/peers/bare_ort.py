"""Bare ONNX Runtime in-process: images/s of a model at several batch sizes.

``python bare_ort.py MODEL.onnx INPUT_NAME SECONDS 1,2,4,8,16,32`` prints one JSON
object ``{"wall": {batch_size: images/s}, "cpu": {batch_size: images per CPU-second}}``.
One intra-op thread (the same CPU budget as the servers); random FP32 input of
shape ``[batch, 3, 224, 224]``. The CPU-second figure is what other load on the
machine disturbs least.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import onnxruntime as ort


def main() -> None:
    """Measure and print images/s per batch size."""
    path, name, seconds, sizes = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    wall: dict[int, float] = {}
    cpu: dict[int, float] = {}
    for bs in (int(s) for s in sizes.split(",")):
        x = rng.standard_normal((bs, 3, 224, 224)).astype(np.float32)
        sess.run(None, {name: x})  # warm-up
        n = 0
        t0, c0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            sess.run(None, {name: x})
            n += bs
        wall[bs] = round(n / (time.perf_counter() - t0), 2)
        cpu[bs] = round(n / max(time.process_time() - c0, 1e-9), 2)
    print(json.dumps({"wall": wall, "cpu": cpu}))


if __name__ == "__main__":
    main()
