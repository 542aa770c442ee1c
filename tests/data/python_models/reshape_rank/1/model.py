"""Asserts the shapes `reshape` gives its inputs: X [batch], M [batch, 4]. Returns
Y = X * 2 + sum(M) as [batch] and SHAPES, the shapes it received ([rows, 2, 2])."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            m = pb_utils.get_input_tensor_by_name(request, "M").as_numpy()
            rows = x.shape[0]
            if x.shape != (rows,) or m.shape != (rows, 4):
                raise pb_utils.TritonModelException(
                    f"reshape_rank got X {list(x.shape)} and M {list(m.shape)}, "
                    f"expected [{rows}] and [{rows}, 4]"
                )
            y = (x * 2 + m.sum(axis=1)).astype(np.float32)
            shapes = np.array([[x.shape + (0,), m.shape]] * rows, dtype=np.int64)
            outputs = [pb_utils.Tensor("Y", y), pb_utils.Tensor("SHAPES", shapes)]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
