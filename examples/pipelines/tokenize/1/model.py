"""WordPiece tokenisation for MiniLM with the ``tokenizers`` library.

Input ``text``: BYTES ``[batch, 1]``, UTF-8. Outputs ``input_ids``,
``attention_mask``, ``token_type_ids``: INT64 ``[batch, L]``.

Texts are truncated to ``max_seq_length`` tokens (sentence-transformers does the
same) and padded (with 0, masked) to ``L``, the longest text of the request. The
server batches requests of different lengths for ``minilm`` itself: its config's
``padding`` parameter pads them to a bucket and cuts the token embeddings back to
each request's ``L`` (README, "Batching requests of different lengths"). With the
parameter ``round_to_power_of_two: "true"`` this model rounds ``L`` up to a power of
two (16 at least, ``max_seq_length`` at most) instead, the way this example batched
before the server could pad (kept to measure against: benchmarks/bench_bucketing.py).

A text that is not valid UTF-8 is a 400 (``TritonError.INVALID_ARG``) for its
request only.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

MIN_LENGTH = 16


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = config.get("parameters", {})
        self.max_len = int(params.get("max_seq_length", {}).get("string_value", "") or 256)
        rounding = params.get("round_to_power_of_two", {}).get("string_value", "") or "false"
        self.round = rounding.strip().lower() == "true"
        path = os.path.join(args["model_repository"], args["model_version"], "tokenizer.json")
        self.tokenizer = Tokenizer.from_file(path)
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=self.max_len)

    def _bucket(self, longest: int) -> int:
        if not self.round:
            return longest
        length = MIN_LENGTH
        while length < longest:
            length *= 2
        return min(length, max(self.max_len, longest))

    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1)
            try:
                strings = []
                for i, item in enumerate(texts):
                    try:
                        strings.append(
                            item.decode("utf-8") if isinstance(item, bytes) else str(item)
                        )
                    except UnicodeDecodeError as e:
                        raise ValueError(
                            f"text[{i}] is not valid UTF-8 (byte {e.start}: {item[e.start : e.start + 4]!r})"
                        ) from None
            except ValueError as e:
                error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            encodings = self.tokenizer.encode_batch(strings)
            length = self._bucket(max(len(e.ids) for e in encodings))
            ids = np.zeros((len(encodings), length), dtype=np.int64)
            mask = np.zeros((len(encodings), length), dtype=np.int64)
            types = np.zeros((len(encodings), length), dtype=np.int64)
            for row, enc in enumerate(encodings):
                n = len(enc.ids)
                ids[row, :n] = enc.ids
                mask[row, :n] = enc.attention_mask
                types[row, :n] = enc.type_ids
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("input_ids", ids),
                        pb_utils.Tensor("attention_mask", mask),
                        pb_utils.Tensor("token_type_ids", types),
                    ]
                )
            )
        return responses
