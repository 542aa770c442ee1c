"""Triton's add_sub example, with auto_complete_config declaring its tensors."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        inputs = [
            {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
            {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]},
        ]
        outputs = [
            {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]},
            {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [4]},
        ]
        config = auto_complete_model_config.as_dict()
        input_names = [i["name"] for i in config["input"]]
        output_names = [o["name"] for o in config["output"]]
        for i in inputs:
            if i["name"] not in input_names:
                auto_complete_model_config.add_input(i)
        for o in outputs:
            if o["name"] not in output_names:
                auto_complete_model_config.add_output(o)
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    def initialize(self, args):
        self.args = args
        self.model_config = json.loads(args["model_config"])
        self.out0_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(self.model_config, "OUTPUT0")["data_type"]
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            out_0 = pb_utils.Tensor("OUTPUT0", (in_0 + in_1).astype(self.out0_dtype))
            out_1 = pb_utils.Tensor("OUTPUT1", (in_0 - in_1).astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_0, out_1]))
        return responses
