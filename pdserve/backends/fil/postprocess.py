"""FIL's output rules: what ``output__0`` holds for a forest's scores.

As Triton's FIL backend (``tl_model.h``) computes it from the scores ``[N, K]``
(``K``: :attr:`pdserve.backends.fil.forest.ForestInfo.num_class`):

- a regressor (``is_classifier`` false): the predictions, ``[N, 1]``;
- ``predict_proba``: the class scores, ``[N, K]``; a binary classifier's one
  score ``p`` becomes ``[1 - p, p]`` when ``output__0`` has two columns
  (FIL's examples declare ``dims: [ 2 ]``), else stays ``[p]``;
- a classifier without it: the class id as FP32, ``[N, 1]``: the first class
  with the highest score, or for a binary classifier ``1.0`` when ``p`` is
  above ``threshold``, else ``0.0``.
"""

from __future__ import annotations

import numpy as np

from pdserve.backends.fil.forest import ForestInfo
from pdserve.backends.fil.params import FilParams


def output_width(info: ForestInfo, params: FilParams, binary_proba_width: int = 2) -> int:
    """Columns of ``output__0`` (its ``dims``) for a model and its parameters.

    Args:
        binary_proba_width: 2 (``[1 - p, p]``, FIL's examples) or 1 (``[p]``) for a
            binary classifier with ``predict_proba``.
    """
    if params.is_classifier and params.predict_proba:
        return binary_proba_width if info.num_class == 1 else info.num_class
    if params.is_classifier:
        return 1
    return info.num_class


def allowed_widths(info: ForestInfo, params: FilParams) -> tuple[int, ...]:
    """The ``output__0`` dims a configuration may give: one width, or 2 and 1 for a
    binary classifier's ``predict_proba``."""
    if params.is_classifier and params.predict_proba and info.num_class == 1:
        return (2, 1)
    return (output_width(info, params),)


def fil_output(scores: np.ndarray, params: FilParams, width: int) -> np.ndarray:
    """FIL's ``output__0`` from a forest's scores.

    Args:
        scores: FP32 ``[N, K]`` after the model's link function.
        params: the model's parameters.
        width: the configured ``output__0`` columns (:func:`output_width`).

    Returns:
        FP32 ``[N, width]``.
    """
    n, k = scores.shape
    if not params.is_classifier:
        return scores
    if params.predict_proba:
        if k == 1 and width == 2:
            out = np.empty((n, 2), dtype=np.float32)
            out[:, 1] = scores[:, 0]
            out[:, 0] = 1.0 - scores[:, 0]
            return out
        return scores
    if k == 1:
        return (scores > np.float32(params.threshold)).astype(np.float32)
    return np.argmax(scores, axis=1).astype(np.float32).reshape(n, 1)
