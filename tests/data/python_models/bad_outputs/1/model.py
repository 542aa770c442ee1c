"""Y = X and V = X, unless MODE (its first element) says otherwise:

"few_rows" -> Y without its last row; "many_rows" -> Y twice as long; "wrong_shape" ->
each value of Y three times (last dim x3); "wrong_dtype" -> Y as INT64; "drop_batch" ->
Y without its first dimension; "short_v" -> V without its last column.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy().reshape(-1)[0]
            mode = mode.decode() if isinstance(mode, bytes) else str(mode)
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            y = v = x
            if mode == "few_rows":
                y = x[:-1]
            elif mode == "many_rows":
                y = np.concatenate([x, x])
            elif mode == "wrong_shape":
                y = np.repeat(x, 3, axis=-1)
            elif mode == "wrong_dtype":
                y = x.astype(np.int64)
            elif mode == "drop_batch":
                y = x[0]
            elif mode == "short_v":
                v = x[..., :-1]
            outputs = [pb_utils.Tensor("Y", np.ascontiguousarray(y)), pb_utils.Tensor("V", v)]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
