import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            time.sleep(float(x[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.copy())]))
        return responses
