"""Answers "<CUDA_VISIBLE_DEVICES>|<model_instance_kind>|<model_instance_device_id>"."""

import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.text = "|".join(
            [
                os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
                args["model_instance_kind"],
                args["model_instance_device_id"],
            ]
        )

    def execute(self, requests):
        out = np.array([self.text.encode()], dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("ENV", out)]) for _ in requests]
