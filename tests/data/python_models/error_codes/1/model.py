"""MODE "<how>:<CODE>", CODE a pb_utils.TritonError code name (e.g. ALREADY_EXISTS):

* "respond:<CODE>" -> a response whose error is TritonError("error_codes responds
  <CODE>", code);
* "raise:<CODE>" -> execute() raises TritonError("error_codes raises <CODE>", code);
* "bls:<CODE>" -> a BLS call to this model with "respond:<CODE>", whose error comes
  back as TritonError("BLS: <its message>", <its code>).

Anything else (e.g. "") -> OUT = [0]."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0].decode()
            if ":" not in mode:
                out = pb_utils.Tensor("OUT", np.zeros(1, dtype=np.int64))
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
                continue
            how, name = mode.split(":", 1)
            code = getattr(pb_utils.TritonError, name)
            if how == "raise":
                raise pb_utils.TritonError(f"error_codes raises {name}", code)
            if how == "bls":
                inner = pb_utils.Tensor(
                    "MODE", np.array([f"respond:{name}".encode()], dtype=object)
                )
                bls = pb_utils.InferenceRequest(
                    model_name="error_codes", requested_output_names=["OUT"], inputs=[inner]
                ).exec()
                inner_error = bls.error()
                error = pb_utils.TritonError(f"BLS: {inner_error.message()}", inner_error.code())
            else:
                error = pb_utils.TritonError(f"error_codes responds {name}", code)
            responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
        return responses
