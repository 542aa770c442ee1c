"""Streams the prompt's words in reverse order, one ``text_output`` response per word
(the first bare, the next ones after a space): ``"one two three"`` gives ``"three"``,
``" two"``, ``" one"``, then the final flag alone.

Request parameters (as the OpenAI front end passes them): ``max_tokens`` (default 16)
caps the words sent; ``stop`` (a JSON array of strings) ends the stream before a word
that would make the text contain one of them; ``delay_ms`` waits that long before each
word. A client that goes away stops the stream between two words.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def tokens(prompt, max_tokens, stops):
    """The words to send for ``prompt``, at most ``max_tokens``, before any stop."""
    text = ""
    out = []
    for i, word in enumerate(reversed(prompt.split())):
        piece = word if i == 0 else " " + word
        if len(out) >= max_tokens or any(s in text + piece for s in stops):
            break
        text += piece
        out.append(piece)
    return out


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            params = json.loads(request.parameters() or "{}")
            raw = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            prompt = raw.reshape(-1)[0].decode("utf-8", errors="replace")
            stops = json.loads(params.get("stop", "[]"))
            delay = float(params.get("delay_ms", 0)) / 1000.0
            for piece in tokens(prompt, int(params.get("max_tokens", 16)), stops):
                if delay:
                    time.sleep(delay)
                if sender.is_cancelled():
                    break
                out = pb_utils.Tensor(
                    "text_output", np.array([piece.encode("utf-8")], dtype=object)
                )
                sender.send(pb_utils.InferenceResponse([out]))
            sender.send(flags=FINAL)
        return None
