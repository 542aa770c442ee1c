"""Readers for the golden outputs that examples/build.py computes with the source
frameworks (PyTorch, scikit-learn, numpy) at build time."""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from tests.conftest import EXAMPLE_REPO, GOLDENS, require_examples


@cache
def _npz(name: str) -> dict[str, np.ndarray]:
    require_examples()
    with np.load(GOLDENS / f"{name}.npz", allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def tiny_reference(x: np.ndarray, version: int = 2) -> np.ndarray:
    """``tiny`` computed in numpy: relu(x @ (version * W)), FP32 [rows, 64]."""
    w = _npz("tiny")["W"].astype(np.float32)
    return np.maximum(x.astype(np.float32) @ (w * version), 0)


def load_digits_golden() -> dict[str, np.ndarray]:
    """``X_test`` f32 [450,64], ``y_test`` i64 [450], sklearn ``probabilities`` f32 [450,10]."""
    return _npz("digits")


def load_efficientnet_goldens() -> dict[str, dict[str, Any]]:
    """Per real photo: preprocessed ``input`` f32 [3,224,224], PyTorch ``logits`` [1000],
    ``top1`` index, ``top5`` indices, ``image_bytes`` (the raw file)."""
    g = _npz("efficientnet_lite0")
    out: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(g["names"].tolist()):
        out[str(name)] = {
            "input": g["inputs"][i],
            "logits": g["logits"][i],
            "top1": int(g["top1"][i]),
            "top5": g["top5"][i],
            "image_bytes": g[f"image_bytes_{name}"].tobytes(),
        }
    return out


@cache
def load_labels() -> list[str]:
    """ImageNet class names of efficientnet_lite0, index order."""
    return (EXAMPLE_REPO / "efficientnet_lite0" / "labels.txt").read_text().splitlines()
