"""Python-backend ``model.py`` for real Triton (nvidia-pytriton's tritonserver).

That Triton build ships only the python backend, so the tiny ONNX model runs in
ONNX Runtime (1 intra-op thread) inside the backend's stub; the dynamic batcher
hands ``execute`` a list of requests, concatenated into one batch here.
``bench_peers.py`` copies this file to ``<repo>/tiny/1/model.py``.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils  # provided by the Triton stub


class TritonPythonModel:
    """``INPUT0`` FP32 [n, 64] -> ``OUTPUT0`` FP32 [n, 64]."""

    def initialize(self, args):  # noqa: ANN001, ANN201
        cfg = json.loads(args["model_config"])
        path = cfg["parameters"]["model_path"]["string_value"]
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        self.sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])

    def execute(self, requests):  # noqa: ANN001, ANN201
        xs = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        y = self.sess.run(None, {"INPUT0": np.concatenate(xs)})[0]
        responses, start = [], 0
        for x in xs:
            n = x.shape[0]
            out = pb_utils.Tensor("OUTPUT0", np.ascontiguousarray(y[start : start + n]))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            start += n
        return responses
