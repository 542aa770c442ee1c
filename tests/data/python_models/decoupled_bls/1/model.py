"""BLS ``exec(decoupled=True)`` test model: sends IN (and the request's ``mode``
parameter) to ``decoupled_repeat`` and answers VALUES, the OUT of every response in
order, and EMPTY, the number of responses without outputs (the empty final one). An
error response of the target fails this request with that error's message."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            mode = json.loads(request.parameters()).get("mode", "repeat")
            call = pb_utils.InferenceRequest(
                model_name="decoupled_repeat",
                requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("IN", values)],
                parameters={"mode": mode},
            )
            got, empty, error = [], 0, None
            for response in call.exec(decoupled=True):
                if response.has_error():
                    error = response.error().message()
                    continue
                if len(response.output_tensors()) == 0:
                    empty += 1
                    continue
                got.append(int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0]))
            if error is not None:
                responses.append(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(f"relayed: {error}"))
                )
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("VALUES", np.array(got, dtype=np.int32)),
                        pb_utils.Tensor("EMPTY", np.array([empty], dtype=np.int32)),
                    ]
                )
            )
        return responses
