"""LitServe (0.2.x) serving the tiny ONNX model with batching on.

Run in its own venv: ``python litserve_server.py MODEL.onnx PORT``. The route
accepts the same V2 JSON body as the other servers (one request = rows of
``INPUT0``) and answers a V2-shaped JSON response.
"""

from __future__ import annotations

import inspect
import sys

import litserve as ls
import numpy as np
import onnxruntime as ort

MAX_BATCH, BATCH_TIMEOUT = 32, 0.002


class TinyAPI(ls.LitAPI):
    """Batched: ``batch`` concatenates rows, ``unbatch`` splits them back."""

    def setup(self, device):  # noqa: ANN001, ANN201
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        self.sess = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])

    def decode_request(self, request):  # noqa: ANN001, ANN201
        inp = request["inputs"][0]
        return np.asarray(inp["data"], dtype=np.float32).reshape(inp["shape"])

    def batch(self, inputs):  # noqa: ANN001, ANN201
        self._rows = [x.shape[0] for x in inputs]
        return np.concatenate(inputs)

    def predict(self, x):  # noqa: ANN001, ANN201
        return self.sess.run(None, {"INPUT0": x})[0]

    def unbatch(self, output):  # noqa: ANN001, ANN201
        out, start = [], 0
        for n in self._rows:
            out.append(output[start : start + n])
            start += n
        return out

    def encode_response(self, output):  # noqa: ANN001, ANN201
        return {
            "model_name": "tiny",
            "outputs": [
                {
                    "name": "OUTPUT0",
                    "datatype": "FP32",
                    "shape": list(output.shape),
                    "data": output.ravel().tolist(),
                }
            ],
        }


if __name__ == "__main__":
    port = int(sys.argv[2])
    kwargs = {"max_batch_size": MAX_BATCH, "batch_timeout": BATCH_TIMEOUT}
    if "max_batch_size" in inspect.signature(ls.LitAPI.__init__).parameters:
        api, server_kw = TinyAPI(**kwargs), {}
    else:
        api, server_kw = TinyAPI(), kwargs
    server = ls.LitServer(
        api, accelerator="cpu", workers_per_device=1, api_path="/v2/models/tiny/infer", **server_kw
    )
    server.run(host="127.0.0.1", port=port, generate_client_file=False)
