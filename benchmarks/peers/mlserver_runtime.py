"""MLServer custom runtime for the tiny ONNX model (V2 ``INPUT0`` -> ``OUTPUT0``).

``bench_peers.py`` writes ``settings.json`` and ``model-settings.json`` next to a
copy of this file (adaptive batching on: ``max_batch_size`` / ``max_batch_time``)
and starts ``mlserver start DIR``.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class TinyRuntime(MLModel):
    """ONNX Runtime with 1 intra-op thread; adaptive batching merges requests."""

    async def load(self) -> bool:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        path = self.settings.parameters.uri
        self.sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32, copy=False)
        y = self.sess.run(None, {"INPUT0": x})[0]
        return InferenceResponse(
            model_name=self.name, outputs=[NumpyCodec.encode_output("OUTPUT0", y)]
        )
