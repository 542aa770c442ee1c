"""Running sum per sequence, kept by the model itself by its SEQ_ID control (see config.pbtxt).

Faults on demand: IN == -1 raises (that request fails, the sum is unchanged); IN == -2
exits the worker process (its batch fails, the worker restarts with no sums).
"""

import os

import numpy as np
import triton_python_backend_utils as pb_utils


def _get(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for slot, request in enumerate(requests):
            x = _get(request, "IN")
            cid = int(_get(request, "SEQ_ID")[0, 0])
            if not bool(_get(request, "READY")[0, 0]):  # a null request: empty slot
                responses.append(
                    pb_utils.InferenceResponse(
                        [
                            pb_utils.Tensor("OUT", np.zeros_like(x)),
                            pb_utils.Tensor("SLOT", np.full_like(x, slot)),
                            pb_utils.Tensor("CORRID", np.zeros((1, 1), np.uint64)),
                        ]
                    )
                )
                continue
            if int(x[0, 0]) == -1:
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"sequence {cid}: -1 is not allowed")
                    )
                )
                continue
            if int(x[0, 0]) == -2:
                os._exit(3)
            if float(_get(request, "START")[0, 0]) == 1.0:
                self.sums[cid] = 0
            total = self.sums.get(cid, 0) + int(x[0, 0])
            if bool(_get(request, "END")[0, 0]):
                self.sums.pop(cid, None)
            else:
                self.sums[cid] = total
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("OUT", np.array([[total]], np.int32)),
                        pb_utils.Tensor("SLOT", np.array([[slot]], np.int32)),
                        pb_utils.Tensor("CORRID", np.array([[cid]], np.uint64)),
                    ]
                )
            )
        return responses
