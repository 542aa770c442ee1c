import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            child = pb_utils.InferenceRequest(
                model_name="cancel_loop", requested_output_names=["Y"], inputs=[x]
            ).exec()
            if child.has_error():
                responses.append(pb_utils.InferenceResponse([], error=child.error()))
            else:
                y = pb_utils.get_output_tensor_by_name(child, "Y")
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y.as_numpy())]))
        return responses
