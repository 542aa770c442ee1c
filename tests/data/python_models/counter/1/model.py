"""Counts execute() calls: CALLS = the calls this instance has run, this one included."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.calls = 0

    def execute(self, requests):
        self.calls += 1
        out = pb_utils.Tensor("CALLS", np.array([self.calls], dtype=np.int64))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
