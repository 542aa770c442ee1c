"""initialize() starts a `sleep 600` program and a forked Python child when the
parameter start_children is "1"; execute() returns their PIDs and the worker's;
finalize() kills them."""

import json
import os
import signal
import subprocess
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.pids = [0, 0]
        self.program = None
        if params["start_children"]["string_value"] != "1":
            return
        self.program = subprocess.Popen(["sleep", "600"])
        pid = os.fork()
        if pid == 0:  # the forked child: sleep until killed, never return into the worker
            try:
                time.sleep(600)
            finally:
                os._exit(0)
        self.pids = [self.program.pid, pid]

    def execute(self, requests):
        pids = np.array([*self.pids, os.getpid()], dtype=np.int64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PIDS", pids)]) for _ in requests]

    def finalize(self):
        for pid in self.pids:
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except OSError:
                    pass
