"""Softmax and top-5 over ImageNet logits.

Input ``logits``: FP32 ``[batch, 1000]``. Outputs, best first: ``top5_labels``
BYTES ``[batch, 5]`` (UTF-8 label text from ``labels_file``) and
``top5_confidences`` FP32 ``[batch, 5]`` (softmax probabilities, 0..1).
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

TOP_K = 5


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        name = config.get("parameters", {}).get("labels_file", {}).get("string_value")
        path = os.path.join(args["model_repository"], args["model_version"], name or "labels.txt")
        with open(path, encoding="utf-8") as f:
            labels = [line.rstrip("\n") for line in f]
        self.labels = np.empty(len(labels), dtype=object)
        self.labels[:] = [label.encode("utf-8") for label in labels]

    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "logits").as_numpy()
            x = logits.astype(np.float64)
            x -= x.max(axis=1, keepdims=True)
            probs = np.exp(x)
            probs /= probs.sum(axis=1, keepdims=True)
            top = np.argsort(-probs, axis=1, kind="stable")[:, :TOP_K]
            confidences = np.take_along_axis(probs, top, axis=1).astype(np.float32)
            labels = self.labels[top]
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("top5_labels", labels),
                        pb_utils.Tensor("top5_confidences", confidences),
                    ]
                )
            )
        return responses
