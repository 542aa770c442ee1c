"""OpenVINO auto-complete, checks and reshapes (Triton's openvino backend rules)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.backends.openvino.model import complete_config, pad_batch, prepare_model, read_model
from pdserve.backends.openvino.options import Options
from pdserve.config import ConfigError
from tests.openvino_models import write_double

ov = pytest.importorskip("openvino")


def _cfg(text: str = "") -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig(name="m"))


def _model(tmp_path: Path, shape: list[int], layout: str = "") -> object:
    return read_model(ov.Core(), write_double(tmp_path / "1", shape, layout), "m")


def test_a_batch_layout_autocompletes_batching_and_tensors(tmp_path: Path) -> None:
    cfg = _cfg()
    complete_config(cfg, _model(tmp_path, [-1, 4], "N..."), "m/config.pbtxt")
    assert cfg.max_batch_size == 4 and cfg.HasField("dynamic_batching")
    assert [(i.name, list(i.dims), i.data_type) for i in cfg.input] == [
        ("x", [4], model_config_pb2.TYPE_FP32)
    ]
    assert [(o.name, list(o.dims)) for o in cfg.output] == [("y", [4])]


def test_without_a_layout_the_model_does_not_batch(tmp_path: Path) -> None:
    cfg = _cfg()
    complete_config(cfg, _model(tmp_path, [2, 4]), "m/config.pbtxt")
    assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")
    assert list(cfg.input[0].dims) == [2, 4]


def test_a_configured_batch_on_a_fixed_first_dim_is_accepted(tmp_path: Path) -> None:
    """Triton's backend sets the batch dimension itself (ov::set_batch)."""
    cfg = _cfg('max_batch_size: 8 input { name: "x" data_type: TYPE_FP32 dims: [4] }')
    model = _model(tmp_path, [1, 4])
    complete_config(cfg, model, "m/config.pbtxt")
    compiled = ov.Core().compile_model(prepare_model(model, cfg, Options()), "CPU")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(compiled(x)[0], x * 2)


@pytest.mark.parametrize(
    ("text", "field", "needle"),
    [
        ('input { name: "z" data_type: TYPE_FP32 dims: [4] }', "input[0].name", "'z' is not one"),
        ('input { name: "x" data_type: TYPE_FP32 dims: [5] }', "input[0].dims", "do not fit"),
        (
            'input { name: "x" data_type: TYPE_FP32 dims: [4] } '
            'input { name: "w" data_type: TYPE_FP32 dims: [4] }',
            "input",
            "configuration expects 2 inputs, model provides 1",
        ),
        ('input { name: "x" data_type: TYPE_STRING dims: [4] }', "input[0].data_type", "STRING"),
    ],
)
def test_config_against_the_model(tmp_path: Path, text: str, field: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        complete_config(_cfg("max_batch_size: 2 " + text), _model(tmp_path, [-1, 4]), "c")
    assert e.value.field == field and needle in e.value.message


def test_reshape_io_layers_takes_the_configured_dims(tmp_path: Path) -> None:
    cfg = _cfg(
        'max_batch_size: 4 input { name: "x" data_type: TYPE_FP32 dims: [-1] } '
        'output { name: "y" data_type: TYPE_FP32 dims: [-1] } '
        'parameters { key: "RESHAPE_IO_LAYERS" value { string_value: "yes" } }'
    )
    model = _model(tmp_path, [1, 4])
    complete_config(cfg, model, "c")
    prepared = prepare_model(model, cfg, Options.from_config(cfg))
    assert str(prepared.inputs[0].get_partial_shape()) == "[?,?]"


def test_skip_dynamic_batchsize_fixes_the_batch_and_pads(tmp_path: Path) -> None:
    cfg = _cfg(
        'max_batch_size: 4 input { name: "x" data_type: TYPE_FP32 dims: [4] } '
        'parameters { key: "SKIP_OV_DYNAMIC_BATCHSIZE" value { string_value: "YES" } }'
    )
    prepared = prepare_model(_model(tmp_path, [-1, 4]), cfg, Options.from_config(cfg))
    assert str(prepared.inputs[0].get_partial_shape()) == "[4,4]"
    padded = pad_batch(np.ones((1, 4), np.float32), 4)
    assert padded.shape == (4, 4) and padded[1:].sum() == 0


def test_an_unreadable_file_names_it_and_openvinos_error(tmp_path: Path) -> None:
    path = tmp_path / "model.xml"
    path.write_text("<net><layers><layer")
    with pytest.raises(RuntimeError) as e:
        read_model(ov.Core(), path, "broken")
    text = str(e.value)
    assert "model 'broken': OpenVINO cannot read" in text and str(path) in text
    assert "OpenVINO 2026" in text
