"""The plainest common alternative to pdserve for embeddings: FastAPI + ONNX Runtime.

``python fastapi_embeddings.py MODEL.onnx TOKENIZER.json PORT`` serves
``POST /v1/embeddings`` (OpenAI's request and response shape: ``input`` a string or a
list of strings, ``encoding_format`` ``float`` or ``base64``) with one uvicorn process
on 127.0.0.1, the way a team would write it: a pydantic body, a plain ``def`` route
(FastAPI runs it in its thread pool), the ``tokenizers`` tokenizer (truncation at
256 tokens, padding to the longest text), ONNX Runtime with its default options,
then masked mean pooling and L2 normalisation exactly as the example ``pool`` model.
No batching across requests.
"""

from __future__ import annotations

import base64
import sys

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from tokenizers import Tokenizer

MAX_SEQ_LENGTH = 256

app = FastAPI()
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
tokenizer = Tokenizer.from_file(sys.argv[2])
tokenizer.enable_truncation(max_length=MAX_SEQ_LENGTH)
tokenizer.enable_padding()


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request (the fields this server reads)."""

    model: str
    input: str | list[str]
    encoding_format: str = "float"


def embed(texts: list[str]) -> tuple[np.ndarray, int]:
    """FP32 ``[len(texts), 384]`` unit vectors and the number of tokens."""
    encodings = tokenizer.encode_batch(texts)
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    types = np.array([e.type_ids for e in encodings], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    tokens = session.run(None, feeds)[0]
    m = mask.astype(np.float32)[:, :, None]
    mean = (tokens * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
    norms = np.linalg.norm(mean, axis=1, keepdims=True)
    return (mean / np.clip(norms, 1e-12, None)).astype(np.float32), int(mask.sum())


@app.post("/v1/embeddings")
def create_embeddings(req: EmbeddingRequest) -> dict:
    """OpenAI's ``/v1/embeddings``: one item per input text, in order."""
    texts = [req.input] if isinstance(req.input, str) else req.input
    vectors, n_tokens = embed(texts)
    data = []
    for i, vec in enumerate(vectors):
        if req.encoding_format == "base64":
            value: object = base64.b64encode(vec.tobytes()).decode()
        else:
            value = vec.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")
