"""Unit tests for pdserve.backends.onnxruntime.autocomplete: a configuration completed and
checked against an ONNX model's inputs and outputs (Triton's onnxruntime backend
``AutoCompleteConfig``)."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2

from pdserve import config as cfgmod
from pdserve.backends.onnxruntime.autocomplete import (
    DEFAULT_MAX_BATCH_SIZE,
    autocomplete_from_io,
    complete_from_session,
    session_tensors,
    set_default_max_batch_size,
)
from pdserve.config import ConfigError
from pdserve.core.datatypes import ORT_TO_V2

# --------------------------------------------------------------------------- helpers


def make_model_dir(tmp_path: Path, name: str, pbtxt: str | None) -> Path:
    """A model folder with an optional config.pbtxt and an empty version 1."""
    d = tmp_path / name
    (d / "1").mkdir(parents=True)
    if pbtxt is not None:
        (d / "config.pbtxt").write_text(pbtxt)
    return d


def parse(pbtxt: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(pbtxt, model_config_pb2.ModelConfig())


def write_onnx(path: Path, in_shape: list, out_shape: list, dtype: int = TensorProto.FLOAT) -> None:
    """A one-node (Relu / Identity) ONNX model INPUT0 -> OUTPUT0."""
    x = helper.make_tensor_value_info("INPUT0", dtype, in_shape)
    y = helper.make_tensor_value_info("OUTPUT0", dtype, out_shape)
    op = "Relu" if dtype == TensorProto.FLOAT else "Identity"
    graph = helper.make_graph([helper.make_node(op, ["INPUT0"], ["OUTPUT0"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def ort_io(path: Path) -> tuple[list, list]:
    """(inputs, outputs) as ONNX Runtime reports them: (name, v2 datatype, shape)."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = [(a.name, ORT_TO_V2[a.type], a.shape) for a in sess.get_inputs()]
    outputs = [(a.name, ORT_TO_V2[a.type], a.shape) for a in sess.get_outputs()]
    return inputs, outputs


# --------------------------------------------------------------------------- from tensors


@pytest.mark.parametrize("size", [8, 0])
def test_default_max_batch_size_is_the_process_setting(tmp_path: Path, size: int) -> None:
    """tritonserver's --backend-config=default-max-batch-size=N (0: no batching)."""
    d = make_model_dir(tmp_path, "auto", None)
    write_onnx(d / "1" / "model.onnx", ["N", 64], ["N", 64])
    inputs, outputs = ort_io(d / "1" / "model.onnx")
    set_default_max_batch_size(size)
    try:
        cfg = cfgmod.load_model_config(d)
        autocomplete_from_io(cfg, inputs, outputs, True, str(d / "config.pbtxt"))
    finally:
        set_default_max_batch_size(DEFAULT_MAX_BATCH_SIZE)
    assert cfg.max_batch_size == size
    assert cfg.HasField("dynamic_batching") is (size > 1)


def test_autocomplete_no_config(tmp_path: Path) -> None:
    d = make_model_dir(tmp_path, "auto", None)
    write_onnx(d / "1" / "model.onnx", ["N", 64], ["N", 64])
    cfg = cfgmod.load_model_config(d)
    cfgmod.normalize_platform(cfg, d / "config.pbtxt", guess_from_files=["model.onnx"])
    inputs, outputs = ort_io(d / "1" / "model.onnx")
    autocomplete_from_io(cfg, inputs, outputs, True, str(d / "config.pbtxt"))
    assert cfg.backend == "onnxruntime" and cfg.platform == "onnxruntime_onnx"
    assert cfg.max_batch_size == DEFAULT_MAX_BATCH_SIZE == 4
    assert cfg.HasField("dynamic_batching")  # Triton turns the dynamic batcher on
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [
        ("INPUT0", model_config_pb2.TYPE_FP32, [64])
    ]
    assert [(o.name, list(o.dims)) for o in cfg.output] == [("OUTPUT0", [64])]
    assert cfgmod.validate_config(cfg, str(d / "config.pbtxt")) == []
    assert cfgmod.io_shape(cfg, cfg.input[0]) == [-1, 64]
    assert cfgmod.datatype_of(cfg.input[0]) == "FP32"


def test_autocomplete_fixed_batch_dim_means_no_batching() -> None:
    cfg = model_config_pb2.ModelConfig(name="m", backend="onnxruntime")
    autocomplete_from_io(
        cfg, [("x", "FP32", [1, 3])], [("y", "FP32", [1, 3])], True, "m/config.pbtxt"
    )
    assert cfg.max_batch_size == 0
    assert not cfg.HasField("dynamic_batching")
    assert list(cfg.input[0].dims) == [1, 3]
    assert cfgmod.io_shape(cfg, cfg.input[0]) == [1, 3]


def test_autocomplete_keeps_explicit_max_batch_size_and_batcher() -> None:
    cfg = parse('name: "m" max_batch_size: 1')
    autocomplete_from_io(cfg, [("x", "FP32", [None, 3])], [("y", "FP32", [None])])
    assert cfg.max_batch_size == 1 and not cfg.HasField("dynamic_batching")
    # A scalar per batch item: dims [1] reshaped to [] (Triton's AutoCompleteIO).
    assert list(cfg.output[0].dims) == [1]
    assert cfg.output[0].HasField("reshape") and list(cfg.output[0].reshape.shape) == []


def test_autocomplete_partial_config() -> None:
    cfg = parse(
        """
        name: "m" max_batch_size: 8
        input [ { name: "b" dims: [ -1 ] }, { name: "a" data_type: TYPE_FP32 } ]
        """
    )
    inputs = [("a", "FP32", ["N", 4]), ("b", "INT64", ["N", 7]), ("c", "BYTES", ["N"])]
    outputs = [("y", "FP32", ["N", 4]), ("z", "INT32", ["N", 2, 2])]
    autocomplete_from_io(cfg, inputs, outputs, True, "m/config.pbtxt")
    # Declared inputs keep their order and their dims; gaps are filled; missing appended.
    got = [(i.name, cfgmod.datatype_of(i), list(i.dims)) for i in cfg.input]
    assert got == [("b", "INT64", [-1]), ("a", "FP32", [4]), ("c", "BYTES", [1])]
    assert cfg.input[2].HasField("reshape")
    assert [(o.name, list(o.dims)) for o in cfg.output] == [("y", [4]), ("z", [2, 2])]
    assert cfg.max_batch_size == 8
    assert cfg.HasField("dynamic_batching")


def test_autocomplete_output_subset_is_kept() -> None:
    cfg = parse(
        """
        name: "m" max_batch_size: 2
        input [ { name: "a" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
        """
    )
    outputs = [("y", "FP32", [None, 4]), ("z", "FP32", [None, 4])]
    autocomplete_from_io(cfg, [("a", "FP32", [None, 4])], outputs, True, "m/config.pbtxt")
    assert [o.name for o in cfg.output] == ["y"]
    assert not cfg.HasField("dynamic_batching")  # both declared: Triton skips auto-complete


@pytest.mark.parametrize(
    ("io", "field", "words"),
    [
        (
            'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 32 ] } ]',
            "input[0].dims",
            "disagree with the model file",
        ),
        (
            'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 64, 1 ] } ]',
            "input[0].dims",
            "disagree with the model file",
        ),
        (
            'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 8 ] } ]',
            "output[0].dims",
            "disagree with the model file",
        ),
        (
            'input [ { name: "INPUT0" data_type: TYPE_FP16 dims: [ 64 ] } ]',
            "input[0].data_type",
            "disagrees with the model file, which has TYPE_FP32",
        ),
        (
            'input [ { name: "nope" data_type: TYPE_FP32 dims: [ 64 ] } ]',
            "input[0].name",
            "unknown input 'nope'",
        ),
        (
            'output [ { name: "nope" data_type: TYPE_FP32 dims: [ 64 ] } ]',
            "output[0].name",
            "unknown output 'nope'",
        ),
    ],
)
def test_autocomplete_mismatch_errors(tmp_path: Path, io: str, field: str, words: str) -> None:
    path = tmp_path / "m" / "1" / "model.onnx"
    write_onnx(path, ["N", 64], ["N", 64])
    inputs, outputs = ort_io(path)
    cfg = parse('name: "m" max_batch_size: 8 ' + io)
    with pytest.raises(ConfigError) as e:
        autocomplete_from_io(cfg, inputs, outputs, True, "m/config.pbtxt")
    assert e.value.path == "m/config.pbtxt"
    assert e.value.field == field
    assert words in e.value.message


def test_autocomplete_wildcards_match() -> None:
    # config -1 vs model fixed, and config fixed vs model variable: both accepted.
    cfg = parse(
        """
        name: "m" max_batch_size: 8
        input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 5 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 3, 5 ] } ]
        """
    )
    autocomplete_from_io(cfg, [("x", "FP32", [None, 3, "W"])], [("y", "FP32", [-1, -1, 5])])
    assert list(cfg.input[0].dims) == [-1, 5]


def test_autocomplete_non_batchable_model_with_max_batch_size(tmp_path: Path) -> None:
    path = tmp_path / "m" / "1" / "model.onnx"
    write_onnx(path, [1, 64], [1, 64])
    inputs, outputs = ort_io(path)
    cfg = parse('name: "m" max_batch_size: 8')
    with pytest.raises(ConfigError) as e:
        autocomplete_from_io(cfg, inputs, outputs, True, "m/config.pbtxt")
    assert e.value.field == "max_batch_size"
    assert "cannot batch" in e.value.message and "INPUT0" in e.value.message
    # The same with inputs and outputs declared: caught per tensor.
    cfg = parse(
        """
        name: "m" max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
        """
    )
    with pytest.raises(ConfigError) as e:
        autocomplete_from_io(cfg, inputs, outputs, True, "m/config.pbtxt")
    assert e.value.field == "input[0].dims"
    assert "cannot batch" in e.value.message


def test_autocomplete_scalar_model_tensor() -> None:
    cfg = parse('name: "m" backend: "onnxruntime"')
    autocomplete_from_io(cfg, [("x", "FP32", [])], [("y", "FP32", [3])])
    assert cfg.max_batch_size == 0
    assert list(cfg.input[0].dims) == [1] and not cfg.input[0].HasField("reshape")
    cfgmod.validate_config(cfg, "m/config.pbtxt")


# --------------------------------------------------------------------------- from a session


def test_session_tensors_and_complete_from_session(tmp_path: Path) -> None:
    path = tmp_path / "m" / "1" / "model.onnx"
    write_onnx(path, ["N", 8], [None, 8], TensorProto.INT64)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session_tensors(sess.get_inputs(), "m/1") == [("INPUT0", "INT64", [None, 8])]
    assert session_tensors(sess.get_outputs(), "m/1") == [("OUTPUT0", "INT64", [None, 8])]
    cfg = parse('name: "m" backend: "onnxruntime"')
    complete_from_session(cfg, sess, "m/config.pbtxt", "m/1")
    assert cfg.max_batch_size == 4 and cfg.HasField("dynamic_batching")
    assert [(i.name, cfgmod.datatype_of(i), list(i.dims)) for i in cfg.input] == [
        ("INPUT0", "INT64", [8])
    ]
    # a fixed first dimension: no batching
    write_onnx(path, [2, 8], [2, 8])
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cfg = parse('name: "m" backend: "onnxruntime"')
    complete_from_session(cfg, sess, "m/config.pbtxt", "m/1")
    assert cfg.max_batch_size == 0 and list(cfg.output[0].dims) == [2, 8]


def test_session_tensors_refuses_types_without_a_datatype() -> None:
    class Arg:
        name, type, shape = "x", "tensor(complex64)", [1]

    with pytest.raises(ConfigError) as e:
        session_tensors([Arg()], "m/1")
    assert (e.value.path, e.value.field) == ("m/1", "x")
    assert "unsupported ONNX type tensor(complex64)" in e.value.message
