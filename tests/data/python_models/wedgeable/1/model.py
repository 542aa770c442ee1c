"""Doubles IN and answers the worker's PID; IN < 0 deadlocks ``execute`` (a lock taken
twice); the model folder's files NOT_READY / IS_READY_RAISES / BROKEN drive
``is_ready()`` and failures."""

import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.folder = os.path.join(args["model_repository"])
        self.lock = threading.Lock()
        time.sleep(0.3)  # a restart takes a moment: the tests see the model not ready

    def _flag(self, name):
        return os.path.exists(os.path.join(self.folder, name))

    def is_ready(self):
        if self._flag("IS_READY_RAISES"):
            raise RuntimeError("the model's device is gone")
        return not self._flag("NOT_READY")

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if self._flag("BROKEN"):
                error = pb_utils.TritonError("the model is broken")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            if x[0] == 7777:
                pb_utils.Logger.log_info("seven requested")
            if x[0] < 0:
                self.lock.acquire()
                self.lock.acquire()  # deadlock: never returns
            out = pb_utils.Tensor("OUT", (x * 2).astype(np.float32))
            pid = pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out, pid]))
        return responses
