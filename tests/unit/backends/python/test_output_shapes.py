"""pdserve.backends.python.output_shapes: the strict_output_shapes parameter, the
warning once per output and the counter, through the scheduler's OutputCheck."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from google.protobuf import text_format

from pdserve import config as cfgmod
from pdserve.backends.base import ExecRequest
from pdserve.backends.python import output_shapes
from pdserve.core.errors import InferError
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest
from pdserve.observability.metrics import model_families
from pdserve.scheduling.base import OutputCheck

CONFIG = """
name: "m"
backend: "python"
max_batch_size: {mbs}
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ 1 ] }} ]
{extra}
"""


def config(strict: str | None = None, mbs: int = 0) -> cfgmod.ModelConfig:
    extra = ""
    if strict is not None:
        extra = (
            f'parameters {{ key: "strict_output_shapes" value: {{ string_value: "{strict}" }} }}'
        )
    return text_format.Parse(CONFIG.format(mbs=mbs, extra=extra), cfgmod.ModelConfig())


def request(rows: int = 1) -> ExecRequest:
    return ExecRequest({}, ["Y"], InferRequest("m", "1", {}), rows)


@pytest.mark.parametrize(
    ("value", "strict"),
    [(None, False), ("true", True), ("TRUE", True), ("1", True), ("false", False), ("off", False)],
)
def test_strict_parameter(value: str | None, strict: bool) -> None:
    assert output_shapes.strict_output_shapes(config(value)) is strict


def test_a_strict_value_that_is_not_a_boolean_is_refused() -> None:
    with pytest.raises(cfgmod.ConfigError) as info:
        output_shapes.strict_output_shapes(config("maybe"), "repo/m/config.pbtxt")
    assert str(info.value) == (
        "repo/m/config.pbtxt: parameters.strict_output_shapes: must be true or false, not 'maybe'"
    )


def test_default_serves_the_produced_shape_warns_once_and_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stats = ModelStats("m", "1")
    hook = output_shapes.tolerance(config(), stats)
    assert hook is not None
    check = OutputCheck(config(), hook)
    y = np.arange(4, dtype=np.float32)
    with caplog.at_level(logging.WARNING, "pdserve.python"):
        for _ in range(3):
            out = check.check(request(), {"Y": y})
            assert isinstance(out, dict)
            assert out["Y"] is y
    assert stats.output_shape_mismatches == {"Y": 3}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "python model 'm' version 1 returned output 'Y' with shape [4], but its configuration "
        "says [1]; the response carries the shape the model produced"
    )
    text = "".join(f.render() for f in model_families([stats]))
    assert "# TYPE pdserve_output_shape_mismatch_total counter\n" in text
    assert 'pdserve_output_shape_mismatch_total{model="m",version="1",output="Y"} 3\n' in text


def test_a_batching_model_with_other_rows_is_served_too() -> None:
    stats = ModelStats("m", "1")
    check = OutputCheck(config(mbs=4), output_shapes.tolerance(config(mbs=4), stats))
    y = np.zeros((3, 1), np.float32)
    out = check.check(request(rows=2), {"Y": y})
    assert isinstance(out, dict) and out["Y"].shape == (3, 1)
    assert stats.output_shape_mismatches == {"Y": 1}


def test_strict_and_datatype_mismatches_are_errors() -> None:
    stats = ModelStats("m", "1")
    assert output_shapes.tolerance(config("true"), stats) is None
    strict = OutputCheck(config("true"), None).check(request(), {"Y": np.zeros(4, np.float32)})
    assert isinstance(strict, InferError)
    assert strict.message == "model 'm' returned output 'Y' with shape [4], expected [1]"
    lenient = OutputCheck(config(), output_shapes.tolerance(config(), stats))
    wrong = lenient.check(request(), {"Y": np.zeros(4, np.int32)})
    assert isinstance(wrong, InferError)
    assert wrong.message == (
        "model 'm' returned output 'Y' as INT32, but its model configuration says FP32"
    )
    assert stats.output_shape_mismatches == {}
    assert "pdserve_output_shape_mismatch_total" not in "".join(
        f.render() for f in model_families([stats])
    )
