"""Streams one sentence embedding per sentence of a document (a decoupled model).

The document is split into sentences (after ``.``, ``!`` or ``?`` followed by white
space); each sentence goes through the ``text_embedding`` pipeline (a BLS call) and is
sent at once as its own response: ``sentence`` (the text), ``index`` (its position) and
``embedding`` (384 floats, unit length). The final flag follows alone (an empty final
response). A client that goes away stops the work between two sentences
(``response_sender.is_cancelled()``).
"""

import re

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text):
    """The non-empty sentences of ``text``, stripped."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            raw = pb_utils.get_input_tensor_by_name(request, "document").as_numpy().reshape(-1)
            text = raw[0].decode("utf-8", errors="replace") if len(raw) else ""
            failed = False
            for index, sentence in enumerate(split_sentences(text)):
                if sender.is_cancelled():
                    break
                call = pb_utils.InferenceRequest(
                    model_name="text_embedding",
                    requested_output_names=["embedding"],
                    inputs=[
                        pb_utils.Tensor(
                            "text", np.array([[sentence.encode("utf-8")]], dtype=object)
                        )
                    ],
                )
                result = call.exec()
                if result.has_error():  # the error is this request's last response
                    sender.send(pb_utils.InferenceResponse(error=result.error()), flags=FINAL)
                    failed = True
                    break
                embedding = pb_utils.get_output_tensor_by_name(result, "embedding").as_numpy()
                sender.send(
                    pb_utils.InferenceResponse(
                        [
                            pb_utils.Tensor(
                                "sentence", np.array([sentence.encode("utf-8")], dtype=object)
                            ),
                            pb_utils.Tensor("index", np.array([index], dtype=np.int32)),
                            pb_utils.Tensor("embedding", embedding.reshape(384).astype(np.float32)),
                        ]
                    )
                )
            if not failed:  # all sent, or cancelled: the final flag alone
                sender.send(flags=FINAL)
        return None
