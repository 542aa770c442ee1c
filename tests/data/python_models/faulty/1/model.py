"""Y = X, with a fault switched by the file <model folder>/fault.<version> (see config.pbtxt)."""

import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.fault_file = os.path.join(args["model_repository"], f"fault.{args['model_version']}")

    def execute(self, requests):
        try:
            with open(self.fault_file) as f:
                mode = f.read().strip()
        except OSError:
            mode = ""
        if mode == "error":
            raise RuntimeError("fault injected: every request of this version fails")
        if mode == "crash":
            os._exit(3)
        if mode.startswith("slow:"):
            time.sleep(float(mode.split(":", 1)[1]))
        shift = 0.5 if mode == "diverge" else 0.0
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + shift)]))
        return responses
