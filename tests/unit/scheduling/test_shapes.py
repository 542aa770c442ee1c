"""pdserve.scheduling.shapes: Triton's reshape and the output check (issue 10, items 1-2)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pdserve.backends.base import ExecRequest, ExecResult, ModelInstance, ModelSpec
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest
from pdserve.repository.model import ModelVersion
from pdserve.scheduling.base import DirectScheduler, InstancePool, OutputCheck, run_batch
from pdserve.scheduling.shapes import reshape_dims, shape_matches


def config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


BATCHING = config(
    """
    name: "m" max_batch_size: 8
    input { name: "X" data_type: TYPE_FP32 dims: [ 4 ] }
    output { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }
    output { name: "V" data_type: TYPE_INT64 dims: [ -1, 2 ] }
    output { name: "S" data_type: TYPE_STRING dims: [ 1 ] }
    output { name: "R" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ ] } }
    output { name: "RV" data_type: TYPE_FP32 dims: [ -1, 6 ] reshape { shape: [ -1, 2, 3 ] } }
    """
)
PLAIN = config(
    """
    name: "p" max_batch_size: 0
    input { name: "X" data_type: TYPE_FP32 dims: [ 3 ] }
    output { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }
    """
)


def req(rows: int, *outputs: str, model: str = "m") -> ExecRequest:
    return ExecRequest({}, list(outputs), InferRequest(model), rows)


def internal_message(result: object) -> str:
    assert isinstance(result, InferError), result
    assert result.code is ErrorCode.INTERNAL
    return result.message


# -- reshape_dims ----------------------------------------------------------------


def test_reshape_dims_moves_variable_sizes_in_order() -> None:
    assert reshape_dims([3, 5], [-1, 5], [5, -1]) == (5, 3)
    assert reshape_dims([7, 2, 9], [-1, 2, -1], [-1, -1, 2]) == (7, 9, 2)
    assert reshape_dims([1], [1], []) == ()
    assert reshape_dims([], [], [1]) == (1,)
    assert reshape_dims([2, 2], [2, 2], [4]) == (4,)


def test_reshape_dims_refuses_impossible_pairs() -> None:
    with pytest.raises(ValueError, match="rank"):
        reshape_dims([2, 3], [-1], [-1])
    with pytest.raises(ValueError, match="more variable"):
        reshape_dims([4], [4], [-1])


def test_shape_matches() -> None:
    assert shape_matches((2, 5), (-1, 5))
    assert not shape_matches((2, 5), (-1, 4))
    assert not shape_matches((2, 5, 1), (-1, 5))
    assert shape_matches((), ())


# -- OutputCheck -----------------------------------------------------------------


def test_good_outputs_pass_unchanged() -> None:
    check = OutputCheck(BATCHING)
    outputs = {
        "Y": np.zeros((2, 4), np.float32),
        "V": np.zeros((2, 7, 2), np.int64),
        "S": np.array([[b"a"], [b"b"]], dtype=object),
    }
    assert check.check(req(2, "Y", "V", "S"), outputs) is outputs
    # BYTES may also come as numpy bytes_ / str_ arrays; byte order does not matter
    assert check.check(req(1, "S"), {"S": np.array([[b"a"]])}) is not None
    swapped = {"Y": np.zeros((1, 4), np.dtype(">f4"))}
    assert check.check(req(1, "Y"), swapped) is swapped


@pytest.mark.parametrize(
    ("shape", "fragment"),
    [
        ((1, 4), "with shape [1,4], expected [2,4]: 1 rows for a request of 2 rows"),
        ((3, 4), "with shape [3,4], expected [2,4]: 3 rows for a request of 2 rows"),
        ((4,), "with shape [4], expected [2,4]: 4 rows for a request of 2 rows"),
        ((2, 3), "with shape [2,3], expected [2,4]"),
        ((2, 4, 1), "with shape [2,4,1], expected [2,4]"),
        ((), "with shape [], expected [2,4]: no rows for a request of 2 rows"),
    ],
)
def test_wrong_rows_or_dims_are_internal_errors(shape: tuple[int, ...], fragment: str) -> None:
    result = OutputCheck(BATCHING).check(req(2, "Y"), {"Y": np.zeros(shape, np.float32)})
    message = internal_message(result)
    assert message.startswith("model 'm' returned output 'Y' ")
    assert fragment in message


def test_variable_dims_accept_any_size_but_not_another_rank() -> None:
    check = OutputCheck(BATCHING)
    assert isinstance(check.check(req(1, "V"), {"V": np.zeros((1, 0, 2), np.int64)}), dict)
    message = internal_message(check.check(req(1, "V"), {"V": np.zeros((1, 5, 3), np.int64)}))
    assert "with shape [1,5,3], expected [1,-1,2]" in message


def test_wrong_datatype_is_an_internal_error() -> None:
    check = OutputCheck(BATCHING)
    message = internal_message(check.check(req(1, "Y"), {"Y": np.zeros((1, 4), np.int64)}))
    assert message == (
        "model 'm' returned output 'Y' as INT64, but its model configuration says FP32"
    )
    message = internal_message(check.check(req(1, "S"), {"S": np.zeros((1, 1), np.float32)}))
    assert "returned output 'S' as FP32, but its model configuration says BYTES" in message
    message = internal_message(check.check(req(1, "Y"), {"Y": np.zeros((1, 4), np.complex64)}))
    assert "as numpy complex64, but its model configuration says FP32" in message


def test_a_missing_requested_output_is_an_internal_error() -> None:
    message = internal_message(
        OutputCheck(BATCHING).check(req(1, "Y", "V"), {"Y": np.zeros((1, 4), np.float32)})
    )
    assert message == "model 'm' did not return requested output 'V' (it returned ['Y'])"


def test_non_batching_model_compares_the_whole_shape() -> None:
    check = OutputCheck(PLAIN)
    ok = {"Y": np.zeros(1, np.float32)}
    assert check.check(req(1, "Y", model="p"), ok) is ok
    message = internal_message(check.check(req(1, "Y", model="p"), {"Y": np.zeros(3, np.float32)}))
    assert message == "model 'p' returned output 'Y' with shape [3], expected [1]"


def test_reshape_shape_is_turned_into_dims() -> None:
    check = OutputCheck(BATCHING)
    result = check.check(req(3, "R"), {"R": np.arange(3, dtype=np.float32)})
    assert isinstance(result, dict)
    assert result["R"].shape == (3, 1)
    assert result["R"].ravel().tolist() == [0, 1, 2]
    # a model that already returns dims is served as it is
    served = {"R": np.zeros((3, 1), np.float32)}
    assert check.check(req(3, "R"), served) is served
    # variable dims keep their size across the reshape: [-1,2,3] -> [-1,6]
    result = check.check(req(1, "RV"), {"RV": np.zeros((1, 5, 2, 3), np.float32)})
    assert isinstance(result, dict) and result["RV"].shape == (1, 5, 6)
    message = internal_message(check.check(req(3, "R"), {"R": np.zeros((3, 2), np.float32)}))
    assert message == (
        "model 'm' returned output 'R' with shape [3,2], expected [3,1] (or its reshape.shape [3])"
    )


def test_results_checks_each_request_of_a_batch_and_keeps_errors() -> None:
    check = OutputCheck(BATCHING)
    batch = [req(1, "Y"), req(2, "Y"), req(1, "Y")]
    earlier = InferError("model said no", ErrorCode.INVALID_ARG)
    results: list[ExecResult] = [
        {"Y": np.zeros((1, 4), np.float32)},
        {"Y": np.zeros((1, 4), np.float32)},
        earlier,
    ]
    out = check.results(batch, results)
    assert isinstance(out[0], dict)
    assert "1 rows for a request of 2 rows" in internal_message(out[1])
    assert out[2] is earlier


# -- through a scheduler and a ModelVersion ------------------------------------------


class _Returns(ModelInstance):
    """Returns a fixed output for every request."""

    name = "fake_0"

    def __init__(self, outputs: dict[str, np.ndarray]) -> None:
        self.outputs = outputs
        self.seen: list[dict[str, np.ndarray]] = []

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        self.seen.extend(r.inputs for r in batch)
        return [dict(self.outputs) for _ in batch]


def test_run_batch_applies_the_check() -> None:
    instance = _Returns({"Y": np.zeros((1, 4), np.float32)})
    stats = ModelStats("m", "1")
    check = OutputCheck(BATCHING)
    ok, bad = asyncio.run(run_batch(instance, [req(1, "Y"), req(2, "Y")], stats, check))
    assert isinstance(ok, dict)
    assert "expected [2,4]" in internal_message(bad)


def _model(text: str, tmp_path: object) -> ModelVersion:
    from pathlib import Path

    base = Path(str(tmp_path))
    spec = ModelSpec("m", 1, config(text), base / "m", base / "m" / "1", base)
    return ModelVersion(spec, "python", "python")


def test_prepare_reshapes_inputs_as_the_model_takes_them(tmp_path: object) -> None:
    mv = _model(
        """
        name: "m" max_batch_size: 4
        input { name: "A" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ ] } }
        input { name: "B" data_type: TYPE_FP32 dims: [ -1, 4 ] reshape { shape: [ -1, 2, 2 ] } }
        input { name: "C" data_type: TYPE_FP32 dims: [ 2 ] }
        output { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }
        """,
        tmp_path,
    )
    a = np.arange(3, dtype=np.float32).reshape(3, 1)
    b = np.arange(3 * 5 * 4, dtype=np.float32).reshape(3, 5, 4)
    c = np.zeros((3, 2), np.float32)
    request = InferRequest("m", inputs={"A": a, "B": b, "C": c})
    exec_req = mv.prepare(request)
    assert exec_req.inputs["A"].shape == (3,)
    assert exec_req.inputs["B"].shape == (3, 5, 2, 2)
    assert exec_req.inputs["C"] is c
    assert np.shares_memory(exec_req.inputs["B"], b)  # a view, no copy
    assert request.inputs["A"].shape == (3, 1)  # the client's request is left alone


def test_prepare_reshapes_inputs_of_a_non_batching_model(tmp_path: object) -> None:
    mv = _model(
        """
        name: "m" max_batch_size: 0
        input { name: "A" data_type: TYPE_INT32 dims: [ 2, 3 ] reshape { shape: [ 6 ] } }
        output { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }
        """,
        tmp_path,
    )
    exec_req = mv.prepare(InferRequest("m", inputs={"A": np.zeros((2, 3), np.int32)}))
    assert exec_req.inputs["A"].shape == (6,)


def test_direct_scheduler_of_a_model_version_checks_outputs(tmp_path: object) -> None:
    # a python model: checked when strict_output_shapes is on (else served as produced)
    mv = _model(
        """
        name: "m" max_batch_size: 4
        input { name: "X" data_type: TYPE_FP32 dims: [ 2 ] }
        output { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }
        parameters { key: "strict_output_shapes" value { string_value: "true" } }
        """,
        tmp_path,
    )
    instance = _Returns({"Y": np.zeros((1, 2), np.float32)})
    scheduler = DirectScheduler(InstancePool([instance]), mv.stats, mv.output_check)

    async def run(rows: int) -> dict[str, np.ndarray]:
        x = np.zeros((rows, 2), np.float32)
        return await scheduler.submit(mv.prepare(InferRequest("m", inputs={"X": x})))

    assert asyncio.run(run(1))["Y"].shape == (1, 2)
    with pytest.raises(InferError) as info:
        asyncio.run(run(3))
    assert info.value.code is ErrorCode.INTERNAL
    assert info.value.message == (
        "model 'm' returned output 'Y' with shape [1,2], expected [3,2]: "
        "1 rows for a request of 3 rows"
    )
