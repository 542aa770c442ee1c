"""BLS, asynchronous: two async_exec() calls to add_sub awaited together.

OUTPUT0 = (a + b) + (a - b) = 2a and OUTPUT1 = (a + b) - (a - b) = 2b.
"""

import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()

            def call(x, y):
                return pb_utils.InferenceRequest(
                    model_name="add_sub",
                    requested_output_names=["OUTPUT0", "OUTPUT1"],
                    inputs=[pb_utils.Tensor("INPUT0", x), pb_utils.Tensor("INPUT1", y)],
                ).async_exec()

            first, second = await asyncio.gather(call(a, b), call(b, a))
            for r in (first, second):
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
            s = pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy()
            d = pb_utils.get_output_tensor_by_name(first, "OUTPUT1").as_numpy()
            d2 = pb_utils.get_output_tensor_by_name(second, "OUTPUT1").as_numpy()
            out0 = (s + d).astype(np.float32)
            out1 = (s + d2).astype(np.float32)
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", out0), pb_utils.Tensor("OUTPUT1", out1)]
                )
            )
        return responses
