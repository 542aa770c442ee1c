"""Small OpenVINO models written at test time (``y = x * 2``), for the backend's tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_double(version_dir: Path, shape: list[int], layout: str = "") -> Path:
    """``<version_dir>/model.xml`` (+ ``model.bin``): input ``x`` FP32 ``shape``, output
    ``y = 2 * x``; ``layout`` (``"N..."``) marks a batch dimension."""
    import openvino as ov
    import openvino.opset13 as ops

    x = ops.parameter(shape, ov.Type.f32, name="x")
    x.output(0).get_tensor().set_names({"x"})
    if layout:
        x.set_layout(ov.Layout(layout))
    y = ops.multiply(x, ops.constant(np.float32(2)))
    y.output(0).get_tensor().set_names({"y"})
    model = ov.Model([y], [x], "double")
    if layout:
        model.outputs[0].get_node().set_layout(ov.Layout(layout))
    version_dir.mkdir(parents=True, exist_ok=True)
    path = version_dir / "model.xml"
    ov.save_model(model, str(path), compress_to_fp16=False)
    return path
