"""Load-time validation of ensembles (pdserve.config.ensemble.validate_ensemble)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.backends.base import ModelSpec
from pdserve.config.ensemble import validate_ensemble
from pdserve.config.schema import ConfigError
from pdserve.scheduling.ensemble import EnsembleBackend


def _cfg(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


#: Step models: preprocess (BYTES [1] -> FP32 [3,224,224]), classifier (FP32
#: [3,224,224] -> FP32 [1000]), postprocess (FP32 [1000] -> BYTES [5] + FP32 [5]),
#: all batching (max_batch_size 8), and "unbatched" (max_batch_size 0).
MODELS = {
    "preprocess": _cfg(
        """
        name: "preprocess" backend: "python" max_batch_size: 8
        input { name: "image" data_type: TYPE_STRING dims: [1] }
        output { name: "tensor" data_type: TYPE_FP32 dims: [3, 224, 224] }
        """
    ),
    "classifier": _cfg(
        """
        name: "classifier" platform: "onnxruntime_onnx" max_batch_size: 8
        input { name: "input" data_type: TYPE_FP32 dims: [3, 224, 224] }
        input { name: "scale" data_type: TYPE_FP32 dims: [1] optional: true }
        output { name: "logits" data_type: TYPE_FP32 dims: [1000] }
        """
    ),
    "postprocess": _cfg(
        """
        name: "postprocess" backend: "python" max_batch_size: 8
        input { name: "logits" data_type: TYPE_FP32 dims: [1000] }
        output { name: "labels" data_type: TYPE_STRING dims: [5] }
        output { name: "scores" data_type: TYPE_FP32 dims: [5] }
        """
    ),
    "unbatched": _cfg(
        """
        name: "unbatched" backend: "python" max_batch_size: 0
        input { name: "x" data_type: TYPE_FP32 dims: [-1, 1000] }
        output { name: "y" data_type: TYPE_FP32 dims: [-1, 1000] }
        """
    ),
    "double": _cfg(
        """
        name: "double" backend: "python" max_batch_size: 8
        input { name: "a" data_type: TYPE_FP32 dims: [1000] }
        output { name: "b" data_type: TYPE_FP32 dims: [1000] }
        """
    ),
}


def lookup(name: str, version: str) -> model_config_pb2.ModelConfig | None:
    return MODELS.get(name)


HEAD = """
name: "pipe" platform: "ensemble" max_batch_size: 8
input { name: "IMAGE" data_type: TYPE_STRING dims: [1] }
output { name: "LABELS" data_type: TYPE_STRING dims: [5] }
output { name: "SCORES" data_type: TYPE_FP32 dims: [5] }
"""

PRE = """
step { model_name: "preprocess" model_version: -1
       input_map { key: "image" value: "IMAGE" } output_map { key: "tensor" value: "t" } }
"""
CLS = """
step { model_name: "classifier" model_version: -1
       input_map { key: "input" value: "t" } output_map { key: "logits" value: "logits" } }
"""
POST = """
step { model_name: "postprocess" model_version: -1
       input_map { key: "logits" value: "logits" }
       output_map { key: "labels" value: "LABELS" } output_map { key: "scores" value: "SCORES" } }
"""


def _ensemble(*steps: str, head: str = HEAD) -> model_config_pb2.ModelConfig:
    return _cfg(head + "ensemble_scheduling {" + "".join(steps) + "}")


def _error(cfg: model_config_pb2.ModelConfig) -> str:
    with pytest.raises(ConfigError) as info:
        validate_ensemble(cfg, lookup, "repo/pipe/config.pbtxt")
    text = str(info.value)
    assert text.startswith("repo/pipe/config.pbtxt: ")
    assert "ensemble 'pipe'" in text
    return text


def test_a_valid_pipeline_gives_its_plan() -> None:
    plan = validate_ensemble(_ensemble(POST, PRE, CLS), lookup)
    assert [s.model_name for s in plan.steps] == ["postprocess", "preprocess", "classifier"]
    assert plan.producer == {"LABELS": 0, "SCORES": 0, "t": 1, "logits": 2}
    assert plan.steps[2].reads == {"t"}  # the optional 'scale' input is not mapped
    assert plan.steps_for(["LABELS"]) == [0, 1, 2]
    assert plan.steps[1].model_version == ""


def test_unknown_step_model() -> None:
    text = _error(_ensemble(PRE, CLS.replace('"classifier"', '"resnet"'), POST))
    assert "model 'resnet' is not loaded" in text and "step 1" in text


def test_unknown_model_input_in_input_map() -> None:
    text = _error(_ensemble(PRE, CLS.replace('key: "input"', 'key: "pixels"'), POST))
    assert "mapped to 'pixels', which is not an input of the model" in text
    assert "ensemble tensor 't'" in text


def test_required_model_input_must_be_mapped() -> None:
    step = """step { model_name: "classifier" input_map { key: "scale" value: "IMAGE" }
              output_map { key: "logits" value: "logits" } }"""
    text = _error(_ensemble(PRE, step, POST))
    assert "required input 'input' of the model is not mapped" in text


def test_unknown_model_output_in_output_map() -> None:
    text = _error(_ensemble(PRE, CLS.replace('key: "logits" value', 'key: "probs" value'), POST))
    assert "'probs' (mapped to ensemble tensor 'logits') is not an output" in text


def test_a_tensor_nobody_produces() -> None:
    text = _error(_ensemble(PRE, CLS.replace('value: "t"', 'value: "tensor"'), POST))
    assert "ensemble tensor 'tensor'" in text
    assert "neither an ensemble input nor produced by any step" in text


def test_a_tensor_produced_twice() -> None:
    step = """step { model_name: "double" input_map { key: "a" value: "logits" }
              output_map { key: "b" value: "logits" } }"""
    text = _error(_ensemble(PRE, CLS, POST, step))
    assert "ensemble tensor 'logits' is produced twice" in text
    assert "step 1 (model 'classifier')" in text and "step 3 (model 'double')" in text


def test_a_step_may_not_write_an_ensemble_input() -> None:
    step = """step { model_name: "double" input_map { key: "a" value: "logits" }
              output_map { key: "b" value: "IMAGE" } }"""
    text = _error(_ensemble(PRE, CLS, POST, step))
    assert "'IMAGE' is an ensemble input and cannot also be produced" in text


def test_every_ensemble_output_is_produced() -> None:
    head = HEAD + 'output { name: "EXTRA" data_type: TYPE_FP32 dims: [5] }\n'
    text = _error(_ensemble(PRE, CLS, POST, head=head))
    assert "ensemble output 'EXTRA' is not produced by any step" in text


def test_every_ensemble_input_is_read() -> None:
    head = HEAD + 'input { name: "UNUSED" data_type: TYPE_FP32 dims: [1] }\n'
    text = _error(_ensemble(PRE, CLS, POST, head=head))
    assert "ensemble input 'UNUSED' is not read by any step" in text


def test_cycles_are_refused() -> None:
    head = """
    name: "pipe" platform: "ensemble" max_batch_size: 8
    input { name: "IN" data_type: TYPE_FP32 dims: [1000] }
    output { name: "OUT" data_type: TYPE_FP32 dims: [1000] }
    """
    a = """step { model_name: "double" input_map { key: "a" value: "x" }
           output_map { key: "b" value: "y" } }"""
    b = """step { model_name: "double" input_map { key: "a" value: "y" }
           output_map { key: "b" value: "x" } }"""
    out = """step { model_name: "double" input_map { key: "a" value: "IN" }
             output_map { key: "b" value: "OUT" } }"""
    text = _error(_ensemble(a, b, out, head=head))
    assert "the steps form a cycle through ensemble tensors" in text
    assert "'x'" in text and "'y'" in text


def test_datatype_mismatch_between_steps() -> None:
    step = """step { model_name: "postprocess" input_map { key: "logits" value: "t" }
              output_map { key: "labels" value: "LABELS" } output_map { key: "scores" value: "S2" } }"""
    head = HEAD.replace('"SCORES"', '"S2"')
    text = _error(_ensemble(PRE, step, head=head))
    assert "ensemble tensor 't': shape mismatch" in text
    assert "output 'tensor' of step 0 (model 'preprocess') has shape [-1,3,224,224]" in text
    assert "input 'logits' of step 1 (model 'postprocess') has shape [-1,1000]" in text
    bad_type = HEAD.replace(
        'name: "IMAGE" data_type: TYPE_STRING', 'name: "IMAGE" data_type: TYPE_FP32'
    )
    text = _error(_ensemble(PRE, CLS, POST, head=bad_type))
    assert "ensemble tensor 'IMAGE': datatype mismatch" in text
    assert "ensemble input 'IMAGE' is FP32" in text and "is BYTES" in text


def test_ensemble_output_shape_must_match_its_producer() -> None:
    head = HEAD.replace(
        'name: "SCORES" data_type: TYPE_FP32 dims: [5]',
        'name: "SCORES" data_type: TYPE_FP32 dims: [10]',
    )
    text = _error(_ensemble(PRE, CLS, POST, head=head))
    assert "ensemble tensor 'SCORES': shape mismatch" in text
    assert "ensemble output 'SCORES' has shape [-1,10]" in text


def test_wildcards_and_unbatched_steps_agree_with_batched_ones() -> None:
    head = """
    name: "pipe" platform: "ensemble" max_batch_size: 0
    input { name: "IN" data_type: TYPE_FP32 dims: [-1, 1000] }
    output { name: "OUT" data_type: TYPE_FP32 dims: [-1, 1000] }
    """
    a = """step { model_name: "unbatched" input_map { key: "x" value: "IN" }
           output_map { key: "y" value: "mid" } }"""
    b = """step { model_name: "double" input_map { key: "a" value: "mid" }
           output_map { key: "b" value: "OUT" } }"""
    plan = validate_ensemble(_ensemble(a, b, head=head), lookup)
    assert plan.steps_for(["OUT"]) == [0, 1]


def test_a_batching_ensemble_needs_batching_steps() -> None:
    head = HEAD.replace("max_batch_size: 8", "max_batch_size: 16")
    text = _error(_ensemble(PRE, CLS, POST, head=head))
    assert "the ensemble allows batches of 16" in text and "max_batch_size 8" in text


def test_the_ensemble_backend_validates_at_load(tmp_path: Path) -> None:
    """The scheduler's backend keeps the plan validate_ensemble builds."""
    spec = ModelSpec(
        name="pipe",
        version=1,
        config=_ensemble(PRE, CLS, POST),
        model_dir=tmp_path / "pipe",
        version_dir=tmp_path / "pipe" / "1",
        repository=tmp_path,
    )
    EnsembleBackend(lookup).auto_complete(spec)
    assert spec.extra["ensemble_plan"].producer == {"t": 0, "logits": 1, "LABELS": 2, "SCORES": 2}
