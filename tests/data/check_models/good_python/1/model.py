"""Doubles IN into OUT; its tensors come from auto_complete_config."""

import numpy as np
import triton_python_backend_utils as pb_utils

print("good_python: imported")  # on stdout, as chatty libraries do: not in check's report


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4]})
        auto_complete_model_config.add_output(
            {"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}
        )
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out = pb_utils.Tensor("OUT", (x * 2).astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
