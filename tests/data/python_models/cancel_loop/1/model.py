import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = os.path.join(args["model_repository"], "runs.log")

    def record(self, line):
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            seconds = float(x.reshape(-1)[0])
            self.record(f"start {seconds:g}")
            end = time.monotonic() + seconds
            while time.monotonic() < end and not request.is_cancelled():
                time.sleep(0.01)
            if request.is_cancelled():
                self.record(f"cancelled {seconds:g}")
                error = pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)
                responses.append(pb_utils.InferenceResponse([], error=error))
            else:
                self.record(f"done {seconds:g}")
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.copy())]))
        return responses
