"""initialize() sleeps init_sleep_s seconds, finalize() finalize_sleep_s (parameters);
execute() sleeps X seconds and returns X."""

import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.finalize_sleep = float(params["finalize_sleep_s"]["string_value"])
        time.sleep(float(params["init_sleep_s"]["string_value"]))

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            time.sleep(float(x[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.copy())]))
        return responses

    def finalize(self):
        time.sleep(self.finalize_sleep)
