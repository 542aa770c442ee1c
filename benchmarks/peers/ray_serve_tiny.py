"""A plain Ray Serve deployment of the example ``tiny`` model (bench_ray.py's peer):
ONNX Runtime in a ``@serve.deployment`` with ``@serve.batch``, answering a V2 JSON
request of one input with a V2 JSON response, as a Ray Serve user would write it."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
from ray import serve
from starlette.requests import Request

#: ``@serve.batch``'s settings: at most this many requests per batch ...
MAX_BATCH_SIZE = 32
#: ... waiting at most this long (seconds) after the first for the others. bench_ray.py
#: gives pdserve's one-hop replica the same batching (its dynamic batcher).
BATCH_WAIT_S = 0.001


@serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 1})
class PlainTiny:
    """``POST`` a V2 JSON body with ``INPUT0`` [n, 64] FP32 -> ``OUTPUT0``."""

    def __init__(self, model_path: str) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        self.session = ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])

    @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_S)
    async def run(self, xs: list[np.ndarray]) -> list[np.ndarray]:
        sizes = [len(x) for x in xs]
        out = self.session.run(None, {"INPUT0": np.concatenate(xs)})[0]
        return np.split(out, np.cumsum(sizes)[:-1])

    async def __call__(self, request: Request) -> dict[str, Any]:
        doc = await request.json()
        inp = doc["inputs"][0]
        x = np.asarray(inp["data"], dtype=np.float32).reshape(inp["shape"])
        y = await self.run(x)
        return {
            "model_name": "tiny",
            "outputs": [
                {
                    "name": "OUTPUT0",
                    "datatype": "FP32",
                    "shape": list(y.shape),
                    "data": y.ravel().tolist(),
                }
            ],
        }
