"""MODE: "" / "pid" -> PID; "sleep:<s>" -> sleep, then PID; "raise" -> exception;
"exit" -> os._exit(3); "bad_arg" -> INVALID_ARG error; "internal" -> TritonError
with the default code; "wrong_dtype" -> PID as FP64; "missing" -> no outputs.
initialize() fails while a file FAIL_INITIALIZE is in the model folder."""

import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # lets a test make restarts fail: a file FAIL_INITIALIZE in the model folder
        if os.path.exists(os.path.join(args["model_repository"], "FAIL_INITIALIZE")):
            raise RuntimeError("FAIL_INITIALIZE is present")

    def execute(self, requests):
        responses = []
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0].decode()
            pid = np.array([os.getpid()], dtype=np.int64)
            if mode.startswith("sleep:"):
                time.sleep(float(mode.split(":", 1)[1]))
            if mode == "raise":
                raise ValueError("crashy was asked to raise")
            if mode == "exit":
                os._exit(3)
            if mode == "bad_arg":
                error = pb_utils.TritonError(
                    "MODE bad_arg is a bad argument", pb_utils.TritonError.INVALID_ARG
                )
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            if mode == "internal":
                error = pb_utils.TritonError("crashy failed inside")
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            if mode == "wrong_dtype":
                pid = pid.astype(np.float64)
            if mode == "missing":
                responses.append(pb_utils.InferenceResponse(output_tensors=[]))
                continue
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("PID", pid)])
            )
        return responses
