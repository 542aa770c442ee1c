"""Running sum and mean per sequence, its state kept by the sequence batcher.

Inputs per request: INPUT [1, 1] FP32 and, added by the sequence batcher, START /
READY [1, 1] INT32, SEQ_ID [1, 1] BYTES (the correlation id) and ACC_STATE [1, 2] FP32
([sum, count] so far; zeros on a sequence's first request). Outputs: SUM, MEAN, the
id echoed as CORRID, and ACC_STATE_OUT (the new state, kept by the batcher, never
sent to the client).
"""

import numpy as np
import triton_python_backend_utils as pb_utils


def _get(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = _get(request, "INPUT").astype(np.float32)
            state = _get(request, "ACC_STATE").astype(np.float32)
            if int(_get(request, "START")[0, 0]):
                state = np.zeros_like(state)
            state = state + np.concatenate([x, np.ones_like(x)], axis=1)
            total, count = state[:, :1], state[:, 1:]
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("SUM", total),
                        pb_utils.Tensor("MEAN", (total / np.maximum(count, 1)).astype(np.float32)),
                        pb_utils.Tensor("CORRID", _get(request, "SEQ_ID")),
                        pb_utils.Tensor("ACC_STATE_OUT", state),
                    ]
                )
            )
        return responses
