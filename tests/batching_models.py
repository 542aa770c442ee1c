"""Small ONNX models, built with ``onnx.helper`` at test time, for batching tests.

- :func:`rowwise_model`: ``OUTPUT0 = INPUT0 * 2 + sum(INPUT0 row)`` — every row's
  result depends on that row only, so a request answered with another request's
  rows (a wrong split) or a wrong merge is caught by comparing with
  :func:`rowwise_expected`.
- :func:`slow_model`: ``OUTPUT0 = INPUT0 + 1``, after ``max(WORK)`` iterations of a
  128x128 ``Tanh(MatMul)`` loop: a request with ``WORK = [n]`` keeps the model
  instance busy for about ``n`` x 0.1-1 ms, which lets tests fill a queue while
  an instance is busy (ONNX cannot sleep).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _save(model: object, path: Path) -> None:
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))  # type: ignore[arg-type]


def rowwise_model(path: Path, width: int | None = 16) -> None:
    """Write the row-wise model to ``path`` (input ``[batch, width]`` FP32;
    ``width=None``: a variable second dim)."""
    from onnx import TensorProto, helper

    dim = width if width is not None else "w"
    x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", dim])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", dim])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    nodes = [
        helper.make_node("Mul", ["INPUT0", "two"], ["doubled"]),
        helper.make_node("ReduceSum", ["INPUT0", "axes"], ["rowsum"], keepdims=1),
        helper.make_node("Add", ["doubled", "rowsum"], ["OUTPUT0"]),
    ]
    graph = helper.make_graph(nodes, "rowwise", [x], [y], [two, axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    _save(model, path)


def rowwise_expected(x: np.ndarray) -> np.ndarray:
    """What :func:`rowwise_model` returns for ``x`` ``[rows, width]``."""
    x = x.astype(np.float32)
    return x * np.float32(2) + x.sum(axis=1, keepdims=True, dtype=np.float32)


def slow_model(path: Path, size: int = 128) -> None:
    """Write the slow model: inputs ``INPUT0 [batch, 4]`` FP32, ``WORK [batch, 1]``
    INT64; output ``OUTPUT0 = INPUT0 + 1`` after ``max(WORK)`` loop iterations."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])
    work = helper.make_tensor_value_info("WORK", TensorProto.INT64, ["batch", 1])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
    init = [
        helper.make_tensor("W", TensorProto.FLOAT, [size, size], w.ravel().tolist()),
        helper.make_tensor(
            "S0", TensorProto.FLOAT, [size, size], np.eye(size, dtype=np.float32).ravel().tolist()
        ),
        helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
        helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
        helper.make_tensor("cond", TensorProto.BOOL, [], [True]),
    ]
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["s_in", "W"], ["m"]),
            helper.make_node("Tanh", ["m"], ["s_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [size, size]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [size, size]),
        ],
    )
    nodes = [
        helper.make_node("ReduceMax", ["WORK"], ["wmax"], keepdims=0),
        helper.make_node("Loop", ["wmax", "cond", "S0"], ["s_final"], body=body),
        helper.make_node("ReduceSum", ["s_final"], ["ssum"], keepdims=0),
        helper.make_node("Mul", ["ssum", "zero"], ["nothing"]),
        helper.make_node("Add", ["INPUT0", "one"], ["plus"]),
        helper.make_node("Add", ["plus", "nothing"], ["OUTPUT0"]),
    ]
    graph = helper.make_graph(nodes, "slow", [x, work], [y], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    _save(model, path)


def write_model(repo: Path, name: str, config: str, builder: str, **kwargs: object) -> Path:
    """Create ``repo/name/config.pbtxt`` and ``repo/name/1/model.onnx``.

    Args:
        config: config.pbtxt text without the ``name`` line.
        builder: ``"rowwise"``, ``"slow"`` or ``"ragged"``.
    """
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(f'name: "{name}"\n{config}')
    build = {"rowwise": rowwise_model, "slow": slow_model, "ragged": ragged_model}[builder]
    build(model_dir / "1" / "model.onnx", **kwargs)  # type: ignore[operator]
    return model_dir


ROWWISE_IO = """
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ %s ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ %s ] } ]
"""

SLOW_IO = """
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "WORK" data_type: TYPE_INT64 dims: [ 1 ] }
]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def rowwise_io(width: int) -> str:
    """The input/output section of a row-wise model's config (``width`` -1: variable)."""
    return ROWWISE_IO % (width, width)


def ragged_model(path: Path) -> None:
    """Write a ragged-batch model: ``INPUT`` FP32 1-D (every request's values,
    concatenated) and ``INDEX`` FP32 ``[requests]`` (the batch input
    ``BATCH_ACCUMULATED_ELEMENT_COUNT`` of ``INPUT``) -> ``OUTPUT`` FP32
    ``[requests, 1]``: the sum of each request's values."""
    from onnx import TensorProto, helper

    inp = helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["n"])
    index = helper.make_tensor_value_info("INDEX", TensorProto.FLOAT, ["b"])
    out = helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["b", 1])
    init = [
        helper.make_tensor("axis0", TensorProto.INT64, [], [0]),
        helper.make_tensor("one", TensorProto.INT64, [1], [1]),
        helper.make_tensor("zero_f", TensorProto.FLOAT, [1], [0.0]),
        helper.make_tensor("s0", TensorProto.INT64, [1], [0]),
        helper.make_tensor("e_last", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("ax1", TensorProto.INT64, [1], [1]),
    ]
    nodes = [
        helper.make_node("Concat", ["zero_f", "INPUT"], ["padded"], axis=0),
        helper.make_node("CumSum", ["padded", "axis0"], ["cs"]),
        helper.make_node("Cast", ["INDEX"], ["idx"], to=TensorProto.INT64),
        helper.make_node("Gather", ["cs", "idx"], ["ends"], axis=0),
        helper.make_node("Slice", ["ends", "s0", "e_last"], ["head"]),
        helper.make_node("Concat", ["zero_f", "head"], ["starts"], axis=0),
        helper.make_node("Sub", ["ends", "starts"], ["sums"]),
        helper.make_node("Unsqueeze", ["sums", "ax1"], ["OUTPUT"]),
    ]
    graph = helper.make_graph(nodes, "ragged", [inp, index], [out], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    _save(model, path)


RAGGED_CONFIG = """
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
batch_input [ {
  kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX" data_type: TYPE_FP32
  source_input: "INPUT"
} ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
