"""Masked mean pooling and L2 normalisation (sentence-transformers' Pooling + Normalize).

Inputs ``token_embeddings`` FP32 ``[batch, L, 384]`` and ``attention_mask`` INT64
``[batch, L]``; output ``embedding`` FP32 ``[batch, 384]`` with unit L2 norm:
``sum(e_i * m_i) / max(sum(m_i), 1e-9)``, then divided by ``max(norm, 1e-12)``.

Inputs whose batch sizes or lengths ``L`` disagree are a 400
(``TritonError.INVALID_ARG``) for that request only.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "token_embeddings").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            if tokens.ndim != 3 or mask.ndim != 2 or tokens.shape[:2] != mask.shape:
                error = pb_utils.TritonError(
                    f"token_embeddings {list(tokens.shape)} and attention_mask "
                    f"{list(mask.shape)} disagree: expected [batch, L, 384] and [batch, L]",
                    pb_utils.TritonError.INVALID_ARG,
                )
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            m = mask.astype(np.float32)[:, :, None]
            summed = (tokens * m).sum(axis=1)
            counts = np.clip(m.sum(axis=1), 1e-9, None)
            mean = summed / counts
            norms = np.linalg.norm(mean, axis=1, keepdims=True)
            embedding = (mean / np.clip(norms, 1e-12, None)).astype(np.float32)
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("embedding", embedding)])
            )
        return responses
