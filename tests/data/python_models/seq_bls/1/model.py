"""BLS into the sequence model "accumulator", passing the correlation id and flags on."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="accumulator",
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT")],
                requested_output_names=["SUM"],
                correlation_id=request.correlation_id(),
                flags=request.flags(),
            )
            result = call.exec()
            if result.has_error():
                responses.append(pb_utils.InferenceResponse(error=result.error()))
                continue
            responses.append(
                pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(result, "SUM")])
            )
        return responses
