"""pdserve.app.check_python_golden: a python model's golden inputs run in a real worker;
values compared with the goldens, shapes with the configuration."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
from google.protobuf import text_format

from pdserve import config as cfgmod
from pdserve.app.check_python_golden import check_python_golden
from pdserve.app.check_report import CheckResult
from pdserve.backends.base import ModelSpec

CONFIG = """
name: "m"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { count: 2, kind: KIND_GPU, gpus: [ 7 ] } ]
"""

MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", 2 * pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""


def run(
    tmp_path: Path, dims: str, golden_y: np.ndarray, model: str = MODEL, timeout_s: float = 60.0
) -> CheckResult:
    vdir = tmp_path / "m" / "1"
    vdir.mkdir(parents=True)
    (vdir / "model.py").write_text(model)
    x = np.array([1.0, 2.0], np.float32)
    np.savez(vdir / "golden.npz", x=x, y=golden_y)
    golden = {"file": "golden.npz", "inputs": {"X": "x"}, "outputs": {"Y": "y"}, "atol": 1e-6}
    (vdir / "MODEL_IDENTITY.json").write_text(json.dumps({"golden": golden}))
    cfg = text_format.Parse(
        CONFIG.replace("dims: [ -1 ] } ]\ninstance", f"dims: {dims} }} ]\ninstance"),
        cfgmod.ModelConfig(),
    )
    spec = ModelSpec("m", 1, cfg, tmp_path / "m", vdir, tmp_path)
    result = CheckResult("m", "golden", 1)
    asyncio.run(check_python_golden(result, golden, spec, timeout_s))
    # the check ran one CPU worker, not the configured GPU instances, on a copy
    assert len(cfg.instance_group) == 1 and list(cfg.instance_group[0].gpus) == [7]
    return result


def test_matching_goldens_pass(tmp_path: Path) -> None:
    result = run(tmp_path, "[ -1 ]", np.array([2.0, 4.0], np.float32))
    assert result.problems == [], result.problems


def test_a_value_that_differs_is_an_error(tmp_path: Path) -> None:
    result = run(tmp_path, "[ -1 ]", np.array([2.0, 5.0], np.float32))
    assert [(p.severity, p.message.split(":")[0]) for p in result.problems] == [
        ("error", "output 'Y'")
    ]
    assert "1 of 2 values differ" in result.problems[0].message


def test_a_shape_other_than_configured_is_a_warning(tmp_path: Path) -> None:
    result = run(tmp_path, "[ 1 ]", np.array([2.0, 4.0], np.float32))
    [problem] = result.problems
    assert problem.severity == "warning"
    assert problem.field == "output.Y.dims"
    assert problem.message.startswith(
        "output 'Y': the model produced shape [2], its configuration says [1] (dims [1])"
    )


def test_a_model_that_does_not_answer_is_killed_at_the_timeout(tmp_path: Path) -> None:
    hangs = MODEL.replace(
        "    def execute(self, requests):\n",
        "    def execute(self, requests):\n        import time; time.sleep(600)\n",
    )
    started = time.monotonic()
    result = run(tmp_path, "[ -1 ]", np.array([2.0, 4.0], np.float32), hangs, timeout_s=1.0)
    assert time.monotonic() - started < 20
    [problem] = result.problems
    assert problem.message == "the model did not answer the golden inputs within 1 s"
