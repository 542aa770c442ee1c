"""SmolLM2-135M-Instruct on the CPU with PyTorch and ``transformers``, following
Triton's generate conventions: ``text_input`` (the whole prompt; the OpenAI front end
has already applied the chat template shipped in this folder) in, the continuation out
as one ``text_output`` response per token's new text (decoupled), then the final flag.

Request parameters (as the OpenAI front end passes them): ``max_tokens`` (default 64),
``temperature`` (0 or absent: greedy, the same text every time), ``top_p`` and ``seed``
when sampling. The last text response carries ``finish_reason`` (``stop`` at the end
of turn token, ``length`` at ``max_tokens``), ``prompt_tokens`` and
``completion_tokens`` as response parameters. A client that goes away stops the
generation before the next token. Requests run one after the other (one instance, one CPU thread).
"""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every file is in this folder

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
HERE = Path(__file__).resolve().parent


def _number(params, key, default, kind=float):
    value = params.get(key, default)
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise pb_utils.TritonModelException(f"'{key}' must be a number, got {value!r}") from None


class TritonPythonModel:
    def initialize(self, args):
        # one thread per instance: a 135M model gains little from more, and threads
        # that wait on busy cores make each token many times slower
        torch.set_num_threads(1)
        self.tokenizer = AutoTokenizer.from_pretrained(HERE)
        # bfloat16 on disk; float32 here (the CPU kernels are fastest in it)
        self.model = AutoModelForCausalLM.from_pretrained(HERE, dtype=torch.float32).eval()
        self.eos = {self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id}

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._generate(request, sender)
            except Exception as e:  # an error response for this request only
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
            sender.send(flags=FINAL)
        return None

    def _next_token(self, logits, temperature, top_p, generator):
        if temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / temperature, dim=-1)
        ordered, index = torch.sort(probs, descending=True)
        keep = torch.cumsum(ordered, dim=-1) - ordered < top_p  # the top-p nucleus
        ordered = ordered * keep
        pick = torch.multinomial(ordered / ordered.sum(), 1, generator=generator)
        return int(index[pick])

    @torch.inference_mode()
    def _generate(self, request, sender):
        params = json.loads(request.parameters() or "{}")
        raw = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
        prompt = raw.reshape(-1)[0].decode("utf-8", errors="replace")
        max_tokens = _number(params, "max_tokens", 64, int)
        temperature = _number(params, "temperature", 0.0)
        top_p = _number(params, "top_p", 1.0)
        generator = torch.Generator().manual_seed(_number(params, "seed", 0, int))
        ids = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        tokens, sent, cache, step = [], "", None, ids
        finish = "length"
        pending = None  # the last text, sent with the finish parameters
        while len(tokens) < max_tokens and not sender.is_cancelled():
            out = self.model(input_ids=step, cache=cache, use_cache=True)
            cache = out.cache
            token = self._next_token(out.logits[0, -1], temperature, top_p, generator)
            if token in self.eos:
                finish = "stop"
                break
            tokens.append(token)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # a character whose bytes are not all here yet
                if pending:
                    sender.send(self._response(pending))
                pending, sent = text[len(sent) :], text
            step = torch.tensor([[token]])
        usage = {
            "finish_reason": finish,
            "prompt_tokens": int(ids.shape[1]),
            "completion_tokens": len(tokens),
        }
        sender.send(self._response(pending or "", usage))

    def _response(self, text, parameters=None):
        out = pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))
        return pb_utils.InferenceResponse([out], parameters=parameters)
