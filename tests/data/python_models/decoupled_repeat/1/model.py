"""Decoupled test model: one response per element of IN (OUT = the element, IDX = its
index), then the final flag. Request parameters:

* ``mode``: ``repeat`` (default, from execute), ``thread`` (from a thread execute
  starts; execute returns at once), ``raise_after`` (sends every element, then
  execute raises), ``after_final`` (one response with the final flag, then another
  send, whose exception is remembered), ``last_error`` (answers the remembered
  exception as an error response, final), ``never_final`` (responses, no final
  flag), ``until_cancelled`` (a thread sends every ``delay_ms`` until
  ``is_cancelled()``, then remembers "cancelled" and sends the final flag),
  ``bad_output`` (a response with an undeclared output).
* ``delay_ms``: pause before each response.
* ``final_alone``: true (default): the final flag is sent alone (an empty final
  response); false: it rides on the last response.
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _response(value, index):
    return pb_utils.InferenceResponse(
        [
            pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
            pb_utils.Tensor("IDX", np.array([index], dtype=np.int32)),
        ]
    )


class TritonPythonModel:
    def initialize(self, args):
        self.last_error = ""
        self.threads = []

    def _stream(self, sender, values, delay, final_alone, final=True):
        for i, v in enumerate(values):
            if delay:
                time.sleep(delay)
            last = i == len(values) - 1
            flags = FINAL if (final and last and not final_alone) else 0
            sender.send(_response(int(v), i), flags=flags)
        if final and (final_alone or len(values) == 0):
            sender.send(flags=FINAL)

    def _until_cancelled(self, sender, delay):
        i = 0
        while not sender.is_cancelled():
            sender.send(_response(i, i))
            i += 1
            time.sleep(delay or 0.01)
        self.last_error = f"cancelled after {i}"
        sender.send(flags=FINAL)

    def execute(self, requests):
        for request in requests:
            params = json.loads(request.parameters())
            mode = params.get("mode", "repeat")
            delay = float(params.get("delay_ms", 0)) / 1000.0
            final_alone = params.get("final_alone", True) not in (False, "false")
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            sender = request.get_response_sender()
            if mode == "repeat":
                self._stream(sender, values, delay, final_alone)
            elif mode == "thread":
                t = threading.Thread(
                    target=self._stream, args=(sender, values, delay, final_alone), daemon=True
                )
                t.start()
                self.threads.append(t)
            elif mode == "raise_after":
                self._stream(sender, values, delay, final_alone, final=False)
                raise ValueError(f"boom after {len(values)} responses")
            elif mode == "after_final":
                sender.send(_response(7, 0), flags=FINAL)
                try:
                    sender.send(_response(8, 1))
                except pb_utils.TritonModelException as e:
                    self.last_error = str(e)
            elif mode == "last_error":
                error = pb_utils.TritonError(self.last_error or "none")
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            elif mode == "never_final":
                self._stream(sender, values, delay, final_alone, final=False)
            elif mode == "until_cancelled":
                t = threading.Thread(
                    target=self._until_cancelled, args=(sender, delay), daemon=True
                )
                t.start()
            elif mode == "bad_output":
                bad = pb_utils.InferenceResponse([pb_utils.Tensor("NOPE", np.zeros(1, np.int32))])
                sender.send(bad, flags=FINAL)
        return None
