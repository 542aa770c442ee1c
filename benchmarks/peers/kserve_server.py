"""KServe ``ModelServer`` (kserve 0.21) serving the tiny ONNX model over V2 REST.

Run in its own venv: ``python kserve_server.py MODEL.onnx PORT``. KServe has no
server-side batching; predict runs ONNX Runtime (1 intra-op thread) on the loop.
"""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
import uvicorn
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer

_config_init = uvicorn.Config.__init__


def _loopback_config(self, app, **kwargs):  # noqa: ANN001, ANN202
    """KServe's REST server hard-codes host 0.0.0.0: listen on loopback only, and
    drop the per-request access log (pdserve logs no line per request either)."""
    kwargs["host"] = "127.0.0.1"
    kwargs["access_log"] = False
    _config_init(self, app, **kwargs)


uvicorn.Config.__init__ = _loopback_config


class Tiny(Model):
    """V2 ``INPUT0`` FP32 [n, 64] -> ``OUTPUT0`` FP32 [n, 64]."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        self.sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        self.ready = True

    async def predict(self, payload: InferRequest, headers=None, response_headers=None):  # noqa: ANN001, ANN201
        x = payload.inputs[0].as_numpy().astype(np.float32, copy=False)
        y = self.sess.run(None, {"INPUT0": x})[0]
        out = InferOutput(name="OUTPUT0", shape=list(y.shape), datatype="FP32")
        out.set_data_from_numpy(y, binary_data=False)
        return InferResponse(
            model_name=self.name, infer_outputs=[out], response_id=payload.id or "0"
        )


if __name__ == "__main__":
    path, port = sys.argv[1], int(sys.argv[2])
    server = ModelServer(http_port=port, grpc_port=port + 1, workers=1, enable_grpc=False)
    server.start([Tiny("tiny", path)])
