"""BLS, synchronous: forwards INPUT0/INPUT1 to the model named by TARGET."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            target = pb_utils.get_input_tensor_by_name(request, "TARGET").as_numpy()[0].decode()
            inputs = [
                pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                pb_utils.get_input_tensor_by_name(request, "INPUT1"),
            ]
            bls_request = pb_utils.InferenceRequest(
                model_name=target or "add_sub",
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=inputs,
            )
            bls_response = bls_request.exec()
            if bls_response.has_error():
                error = bls_response.error()
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"BLS failed: {error.message()}", error.code())
                    )
                )
                continue
            out0 = pb_utils.get_output_tensor_by_name(bls_response, "OUTPUT0")
            out1 = pb_utils.get_output_tensor_by_name(bls_response, "OUTPUT1")
            responses.append(pb_utils.InferenceResponse(output_tensors=[out0, out1]))
        return responses
