"""pdserve.scheduling.padding: the ``padding`` policy (issue 16 item 3).

Parsing, the load-time check (every problem reported), pad values per datatype, and
the pad / cut functions (property tests: cutting a padded tensor gives it back).
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from google.protobuf import text_format
from hypothesis import given, settings
from tritonclient.grpc import model_config_pb2 as mc

from pdserve.backends.base import ExecRequest
from pdserve.config import ConfigError
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferRequest
from pdserve.scheduling.padding import (
    FIELD,
    CutOutput,
    PaddedInput,
    PaddingPolicy,
    PaddingSyntaxError,
    pad_array,
    pad_scalar,
    policy_of,
    validate_padding,
)

MINILM = (
    "inputs=input_ids:0:0, attention_mask:0:0, token_type_ids:0:0; "
    "outputs=token_embeddings:0; pad_to=16,32,64,128,256"
)


def model(padding: str, extra: str = "dynamic_batching { }", mbs: int = 8) -> mc.ModelConfig:
    """A token model: ids / mask INT64 [-1], FIXED FP32 [4], TEXT BYTES [-1],
    RAGGED INT64 [-1] (allow_ragged_batch), RESHAPED INT64 [-1] with a reshape."""
    text = f"""
        name: "tok" max_batch_size: {mbs}
        input {{ name: "ids" data_type: TYPE_INT64 dims: [ -1 ] }}
        input {{ name: "mask" data_type: TYPE_INT64 dims: [ -1 ] }}
        input {{ name: "small" data_type: TYPE_UINT8 dims: [ -1 ] }}
        input {{ name: "half" data_type: TYPE_FP16 dims: [ -1 ] }}
        input {{ name: "flag" data_type: TYPE_BOOL dims: [ -1 ] }}
        input {{ name: "fixed" data_type: TYPE_FP32 dims: [ 4 ] }}
        input {{ name: "text" data_type: TYPE_STRING dims: [ -1 ] }}
        input {{ name: "ragged" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true }}
        input {{ name: "reshaped" data_type: TYPE_INT64 dims: [ -1 ] reshape {{ shape: [ -1, 1 ] }} }}
        output {{ name: "emb" data_type: TYPE_FP32 dims: [ -1, 3 ] }}
        output {{ name: "pooled" data_type: TYPE_FP32 dims: [ 3 ] }}
        {extra}
        parameters {{ key: "padding" value: {{ string_value: "{padding}" }} }}
    """
    return text_format.Parse(text, mc.ModelConfig())


def problems(cfg: mc.ModelConfig) -> list[str]:
    found: list[str] = []

    def fail(field: str, message: str) -> None:
        assert field == FIELD
        found.append(message)

    validate_padding(cfg, fail)
    return found


# -- parsing -------------------------------------------------------------------------


def test_parses_the_minilm_policy() -> None:
    p = PaddingPolicy.parse(MINILM)
    assert p.inputs == (
        PaddedInput("input_ids", 0, "0"),
        PaddedInput("attention_mask", 0, "0"),
        PaddedInput("token_type_ids", 0, "0"),
    )
    assert p.outputs == (CutOutput("token_embeddings", 0),)
    assert p.buckets == (16, 32, 64, 128, 256)


def test_pad_to_max_and_no_outputs() -> None:
    p = PaddingPolicy.parse(" pad_to = max ;inputs=ids:0:-1;")
    assert p.buckets == ()
    assert p.inputs == (PaddedInput("ids", 0, "-1"),)
    assert p.outputs == ()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("inputs=ids:0:0", "missing 'pad_to"),
        ("pad_to=max", "missing 'inputs"),
        ("inputs=; pad_to=max", "no input listed"),
        ("inputs=ids:0:0; pad_to=max; mode=x", "unknown clause 'mode'"),
        ("inputs=ids:0:0; pad_to=max; pad_to=8", "given twice"),
        ("inputs=ids:0; pad_to=max", "'ids:0' is not NAME:DIM:VALUE"),
        ("inputs=ids:x:0; pad_to=max", "dimension 'x' of 'ids' is not an integer"),
        ("inputs=ids:0:0,ids:0:1; pad_to=max", "'ids' is listed twice"),
        ("inputs=ids:0:0; outputs=emb; pad_to=max", "'emb' is not NAME:DIM"),
        ("inputs=ids:0:0; pad_to=16,big", "neither 'max' nor a list"),
        ("inputs ids:0:0; pad_to=max", "is not KEY=VALUE"),
        ("inputs=ids:0:0; pad_to=8; bucket_pad=short", "neither 'full' nor 'longest'"),
        ("inputs=ids:0:0; pad_to=max; bucket_pad=longest", "bucket_pad needs bucket lengths"),
    ],
)
def test_syntax_errors_say_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(PaddingSyntaxError, match=words):
        PaddingPolicy.parse(text)


# -- the load-time check ---------------------------------------------------------------


def test_a_good_policy_has_no_problem_and_binds_pad_values() -> None:
    cfg = model(
        "inputs=ids:0:0, mask:0:0, small:0:255, half:0:-inf, flag:0:true; "
        "outputs=emb:0; pad_to=8,16"
    )
    assert problems(cfg) == []
    policy = policy_of(cfg)
    assert policy is not None
    values = policy.pad_values or {}
    assert values["small"].dtype == np.uint8 and int(values["small"]) == 255
    assert values["half"].dtype == np.float16 and np.isneginf(values["half"])
    assert values["flag"].dtype == np.bool_ and bool(values["flag"])
    assert values["ids"].dtype == np.int64


def test_no_parameter_no_policy() -> None:
    cfg = text_format.Parse('name: "m" max_batch_size: 4', mc.ModelConfig())
    assert policy_of(cfg) is None
    assert problems(cfg) == []


def test_padding_an_input_without_a_variable_dimension_is_refused() -> None:
    found = problems(model("inputs=fixed:0:0; pad_to=max"))
    assert found == [
        "input 'fixed' has no variable dimension at index 0: its dims are [4]; "
        "only a -1 dimension can be padded"
    ]
    found = problems(model("inputs=ids:1:0; outputs=emb:1; pad_to=max"))
    assert found == [
        "input 'ids' has no dimension 1: its dims are [-1] (batch dimension not counted)",
        "output 'emb' has no variable dimension at index 1: its dims are [-1,3]; only a -1 "
        "dimension can be padded",
    ]


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("ids:0:0.5", "input 'ids': pad value '0.5' is not an integer, as INT64 needs"),
        ("ids:0:pad", "input 'ids': pad value 'pad' is not an integer, as INT64 needs"),
        ("small:0:300", "input 'small': pad value 300 is out of the range of UINT8 [0, 255]"),
        ("small:0:-1", "input 'small': pad value -1 is out of the range of UINT8 [0, 255]"),
        ("half:0:1e6", "input 'half': pad value 1000000.0 is out of the range of FP16"),
        ("half:0:zero", "input 'half': pad value 'zero' is not a number, as FP16 needs"),
        ("flag:0:2", "input 'flag': pad value '2' is not a BOOL (true, false, 1, 0)"),
        (
            "text:0:x",
            "input 'text': BYTES inputs cannot be padded (numeric and BOOL inputs only)",
        ),
    ],
)
def test_pad_values_of_the_wrong_dtype_are_refused(item: str, words: str) -> None:
    assert problems(model(f"inputs={item}; pad_to=max")) == [words]


def test_every_problem_is_reported() -> None:
    cfg = model(
        "inputs=nope:0:0, fixed:0:0, ragged:0:0, reshaped:0:0, ids:0:0.5; "
        "outputs=gone:0, pooled:0; pad_to=32,16",
        extra="",
        mbs=0,
    )
    found = problems(cfg)
    assert found == [
        "padding lets requests of different lengths share a batch: it needs max_batch_size > 0",
        "padding lets the dynamic batcher batch requests of different lengths: it needs "
        "'dynamic_batching { }'",
        "input 'nope' is not an input of the model ('fixed', 'flag', 'half', 'ids', 'mask', "
        "'ragged', 'reshaped', 'small', 'text')",
        "input 'fixed' has no variable dimension at index 0: its dims are [4]; only a -1 "
        "dimension can be padded",
        "input 'ragged' is allow_ragged_batch: it is batched ragged, not padded",
        "input 'reshaped' has a reshape: padding an input with a reshape is not supported",
        "input 'ids': pad value '0.5' is not an integer, as INT64 needs",
        "output 'gone' is not an output of the model ('emb', 'pooled')",
        "output 'pooled' has no variable dimension at index 0: its dims are [3]; only a -1 "
        "dimension can be padded",
        "pad_to: bucket lengths must be strictly increasing, got [32, 16]",
    ]


def test_zero_bucket_and_syntax_error_are_reported() -> None:
    assert problems(model("inputs=ids:0:0; pad_to=0,8")) == [
        "pad_to: bucket lengths must be >= 1, got [0, 8]"
    ]
    (found,) = problems(model("inputs=ids:0:0"))
    assert found.startswith("missing 'pad_to=max' or 'pad_to=LENGTH,LENGTH,...' (syntax: ")


def test_the_load_check_raises_the_first_problem_without_an_errors_list() -> None:
    import asyncio

    from pdserve.backends.base import Backend, ModelSpec
    from pdserve.repository.prepare import complete_config

    class NoBackend(Backend):
        name = "onnxruntime"

        async def load(self, spec: ModelSpec) -> list:  # pragma: no cover - not called
            return []

        def usable_gpus(self) -> list[int]:
            return []

    cfg = model("inputs=fixed:0:0; pad_to=max")
    cfg.backend = "onnxruntime"
    spec = ModelSpec("tok", 1, cfg, None, None, None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        asyncio.run(complete_config(spec, NoBackend(), where="tok/config.pbtxt"))
    assert str(info.value) == (
        "tok/config.pbtxt: parameters.padding: input 'fixed' has no variable dimension at "
        "index 0: its dims are [4]; only a -1 dimension can be padded"
    )
    errors: list[ConfigError] = []
    cfg2 = model("inputs=fixed:0:0, ids:0:x; pad_to=max")
    cfg2.backend = "onnxruntime"
    spec2 = ModelSpec("tok", 1, cfg2, None, None, None)  # type: ignore[arg-type]
    asyncio.run(complete_config(spec2, NoBackend(), errors=errors, where="tok/config.pbtxt"))
    assert [e.field for e in errors] == [FIELD, FIELD]


# -- per request ---------------------------------------------------------------------


def exec_request(**inputs: np.ndarray) -> ExecRequest:
    rows = next(iter(inputs.values())).shape[0]
    return ExecRequest(dict(inputs), ["emb", "pooled"], InferRequest("tok", inputs=inputs), rows)


def bound(text: str) -> PaddingPolicy:
    policy = policy_of(model(text))
    assert policy is not None
    return policy


def test_buckets_targets_and_groups() -> None:
    p = bound("inputs=ids:0:0; pad_to=8,16,32")
    assert [p.target(n) for n in (1, 8, 9, 16, 17, 32, 33, 100)] == [8, 8, 16, 16, 32, 32, 33, 100]
    # longer than every bucket: its own group (served unpadded, batched with its length only)
    assert [p.group(n) for n in (3, 8, 12, 33, 34)] == [8, 8, 16, 33, 34]
    assert p.group(-1) == -2  # no padded input in the request
    m = bound("inputs=ids:0:0; pad_to=max")
    assert [m.group(n) for n in (1, 300)] == [-1, -1]
    assert m.target(300) == 300


def test_batch_targets_bucket_or_longest() -> None:
    full = bound("inputs=ids:0:0; pad_to=8,16")
    assert PaddingPolicy.parse("inputs=ids:0:0; pad_to=8,16").bucket_longest is False
    longest = bound("inputs=ids:0:0; pad_to=8,16; bucket_pad=longest")
    assert longest.bucket_longest is True and longest.buckets == (8, 16)
    assert [full.batch_target(g) for g in ([3, 5], [9, 12], [20, 20], [-1])] == [8, 16, 20, -1]
    assert [longest.batch_target(g) for g in ([3, 5], [9, 12], [20, 20])] == [5, 12, 20]
    assert bound("inputs=ids:0:0; pad_to=max").batch_target([4, 30, 2]) == 30


def test_the_requests_length_and_lengths_that_disagree() -> None:
    p = bound("inputs=ids:0:0, mask:0:0; pad_to=max")
    ids = np.ones((2, 5), np.int64)
    assert p.length({"ids": ids, "mask": ids}) == 5
    assert p.length({"fixed": np.zeros((2, 4), np.float32)}) == -1
    with pytest.raises(InferError) as info:
        p.length({"ids": ids, "mask": np.ones((2, 6), np.int64)})
    assert info.value.code == ErrorCode.INVALID_ARG
    assert str(info.value) == (
        "inputs 'ids' and 'mask' are padded together (parameter 'padding') and must have "
        "the same length; got 5 and 6"
    )


def test_pad_and_cut_a_request() -> None:
    p = bound("inputs=ids:0:7, mask:0:0; outputs=emb:0; pad_to=8")
    ids = np.arange(3, dtype=np.int64).reshape(1, 3)
    mask = np.ones((1, 3), np.int64)
    req = exec_request(ids=ids, mask=mask)
    original = req.inputs
    p.pad(req, 8)
    assert req.inputs is not original and original["ids"] is ids  # the request's arrays kept
    np.testing.assert_array_equal(req.inputs["ids"], [[0, 1, 2, 7, 7, 7, 7, 7]])
    np.testing.assert_array_equal(req.inputs["mask"], [[1, 1, 1, 0, 0, 0, 0, 0]])
    emb = np.arange(24, dtype=np.float32).reshape(1, 8, 3)
    pooled = np.ones((1, 3), np.float32)
    out = p.cut("tok", {"emb": emb, "pooled": pooled}, 3, 8)
    assert isinstance(out, dict)
    np.testing.assert_array_equal(out["emb"], emb[:, :3])
    assert out["pooled"] is pooled
    # a model that did not keep the padded length there: an INTERNAL error, never cut wrongly
    bad = p.cut("tok", {"emb": emb[:, :5]}, 3, 8)
    assert isinstance(bad, InferError) and bad.code == ErrorCode.INTERNAL
    assert str(bad) == (
        "model 'tok' returned output 'emb' with shape [1,5,3]: dimension 1 should have the "
        "padded length 8 (parameter 'padding' cuts it back to the request's length 3)"
    )
    err = InferError("model failed")
    assert p.cut("tok", err, 3, 8) is err


def test_pad_nothing_when_already_at_the_target() -> None:
    p = bound("inputs=ids:0:0; pad_to=4")
    req = exec_request(ids=np.ones((1, 4), np.int64))
    before = req.inputs
    p.pad(req, 4)
    assert req.inputs is before


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    data=st.data(),
    extra=st.integers(0, 6),
    value=st.integers(-3, 3),
)
def test_cutting_a_padded_array_gives_it_back(
    shape: list[int], data: st.DataObject, extra: int, value: int
) -> None:
    axis = data.draw(st.integers(0, len(shape) - 1))
    arr = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape) + 10
    target = shape[axis] + extra
    padded = pad_array(arr, axis, target, np.int32(value))
    assert padded.dtype == arr.dtype
    assert padded.shape == (*shape[:axis], target, *shape[axis + 1 :])
    index = [slice(None)] * arr.ndim
    index[axis] = slice(0, shape[axis])
    np.testing.assert_array_equal(padded[tuple(index)], arr)
    index[axis] = slice(shape[axis], None)
    assert (padded[tuple(index)] == value).all()


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_policy_pad_then_cut_round_trips(lengths: list[int]) -> None:
    """Requests of any lengths padded to a bucket: the cut outputs are each request's own."""
    p = bound("inputs=ids:0:0, mask:0:0; outputs=emb:0; pad_to=8,16,32")
    target = p.target(max(lengths))
    for n in lengths:
        ids = np.arange(1, n + 1, dtype=np.int64).reshape(1, n)
        req = exec_request(ids=ids, mask=np.ones_like(ids))
        p.pad(req, target)
        assert req.inputs["ids"].shape == (1, target)
        assert int(req.inputs["mask"].sum()) == n
        emb = np.repeat(req.inputs["ids"][..., None], 3, axis=2).astype(np.float32)
        out = p.cut("tok", {"emb": emb}, n, target)
        assert isinstance(out, dict)
        np.testing.assert_array_equal(out["emb"][0, :, 0], ids[0])


def test_pad_scalar_accepts_what_the_datatype_holds() -> None:
    assert pad_scalar("-128", "INT8") == -128
    assert pad_scalar("18446744073709551615", "UINT64") == np.uint64(2**64 - 1)
    assert np.isnan(pad_scalar("nan", "FP32"))
    assert pad_scalar("FALSE", "BOOL") == np.bool_(False)
    with pytest.raises(ValueError, match="out of the range of INT8"):
        pad_scalar("128", "INT8")
