"""BLS that passes its request's trace on (``trace=request.trace()``), as Triton's
docs/user_guide/trace.md shows, and returns ``request.trace().get_context()``."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            bls_request = pb_utils.InferenceRequest(
                model_name="add_sub",
                requested_output_names=["OUTPUT0"],
                inputs=[
                    pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                    pb_utils.get_input_tensor_by_name(request, "INPUT1"),
                ],
                trace=request.trace(),
            )
            bls_response = bls_request.exec()
            if bls_response.has_error():
                raise pb_utils.TritonModelException(bls_response.error().message())
            out0 = pb_utils.get_output_tensor_by_name(bls_response, "OUTPUT0")
            context = request.trace().get_context() or ""
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        out0,
                        pb_utils.Tensor("CONTEXT", np.array([context.encode()], dtype=object)),
                    ]
                )
            )
        return responses
