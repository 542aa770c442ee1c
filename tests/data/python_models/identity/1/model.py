"""Returns INPUT0 unchanged; reports how many requests came in one execute() call."""

import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.delay = float(config["parameters"]["delay_s"]["string_value"])
        self.args = args

    def execute(self, requests):
        if self.delay:
            time.sleep(self.delay)  # lets the next requests queue up behind this call
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            rows = data.shape[0]
            outputs = [
                pb_utils.Tensor("OUTPUT0", data),
                pb_utils.Tensor("CALL_SIZE", np.full((rows, 1), len(requests), np.int32)),
                pb_utils.Tensor("PID", np.full((rows, 1), os.getpid(), np.int64)),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
