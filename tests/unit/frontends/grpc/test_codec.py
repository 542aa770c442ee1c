"""gRPC codec (ModelInferRequest/Response <-> InferRequest/Response), error codes,
warm-up samples and the Kubernetes example (issue 5). No server process."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferResponse
from pdserve.frontends.grpc.codec import (
    EMPTY_FINAL_PARAM,
    decode_infer_request,
    empty_final_requested,
    encode_infer_response,
)
from pdserve.frontends.grpc.service import grpc_status
from pdserve.frontends.http.status import http_status

ROOT = Path(__file__).resolve().parents[4]


def test_decode_raw_inputs_are_zero_copy_views() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    msg = service_pb2.ModelInferRequest(
        model_name="m", model_version="3", id="r1", raw_input_contents=[x.tobytes()]
    )
    msg.inputs.add(name="X", datatype="FP32", shape=[2, 3])
    msg.outputs.add(name="Y").parameters["classification"].int64_param = 2
    msg.parameters["priority"].uint64_param = 2
    msg.parameters["timeout"].int64_param = 1000
    req = decode_infer_request(msg, 123)
    assert (req.model_name, req.model_version, req.id, req.arrival_ns) == ("m", "3", "r1", 123)
    np.testing.assert_array_equal(req.inputs["X"], x)
    assert not req.inputs["X"].flags.writeable
    assert req.outputs is not None and req.outputs[0].name == "Y"
    assert req.outputs[0].classification == 2
    assert req.parameters == {"priority": 2, "timeout": 1000}


def test_decode_bytes_raw_and_typed() -> None:
    items = [b"a", b"", b"\x00\xff"]
    raw = b"".join(len(b).to_bytes(4, "little") + b for b in items)
    msg = service_pb2.ModelInferRequest(model_name="m", raw_input_contents=[raw])
    msg.inputs.add(name="S", datatype="BYTES", shape=[1, 3])
    assert decode_infer_request(msg, 0).inputs["S"].tolist() == [items]
    typed = service_pb2.ModelInferRequest(model_name="m")
    typed.inputs.add(name="S", datatype="BYTES", shape=[3]).contents.bytes_contents.extend(items)
    arr = decode_infer_request(typed, 0).inputs["S"]
    assert arr.dtype == object and arr.tolist() == items


@pytest.mark.parametrize(
    ("datatype", "field", "values", "dtype"),
    [
        ("BOOL", "bool_contents", [True, False], np.bool_),
        ("INT8", "int_contents", [-1, 2], np.int8),
        ("INT32", "int_contents", [-1, 2], np.int32),
        ("INT64", "int64_contents", [-(2**40), 2], np.int64),
        ("UINT16", "uint_contents", [1, 60000], np.uint16),
        ("UINT64", "uint64_contents", [2**63, 2], np.uint64),
        ("FP32", "fp32_contents", [0.5, -1.0], np.float32),
        ("FP64", "fp64_contents", [0.1, -1.0], np.float64),
    ],
)
def test_decode_typed(datatype: str, field: str, values: list, dtype: type) -> None:
    msg = service_pb2.ModelInferRequest(model_name="m")
    getattr(msg.inputs.add(name="I", datatype=datatype, shape=[2]).contents, field).extend(values)
    arr = decode_infer_request(msg, 0).inputs["I"]
    assert arr.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(arr, np.array(values, dtype=dtype))


def _bad_requests() -> dict[str, service_pb2.ModelInferRequest]:
    cases: dict[str, service_pb2.ModelInferRequest] = {}

    def new(name: str) -> service_pb2.ModelInferRequest:
        cases[name] = service_pb2.ModelInferRequest(model_name="m")
        return cases[name]

    m = new("raw size does not match the shape")
    m.raw_input_contents.append(b"\0" * 7)
    m.inputs.add(name="I", datatype="FP32", shape=[2])
    m = new("raw count is not the input count")
    m.raw_input_contents.append(b"\0" * 8)
    m.inputs.add(name="I", datatype="FP32", shape=[2])
    m.inputs.add(name="J", datatype="FP32", shape=[2])
    m = new("raw and typed mixed")
    m.raw_input_contents.append(b"\0" * 4)
    m.inputs.add(name="I", datatype="FP32", shape=[1]).contents.fp32_contents.append(1)
    new("FP16 typed").inputs.add(
        name="I", datatype="FP16", shape=[1]
    ).contents.fp32_contents.append(1)
    new("unknown datatype").inputs.add(
        name="I", datatype="FP8", shape=[1]
    ).contents.fp32_contents.append(1)
    new("typed element count").inputs.add(
        name="I", datatype="FP32", shape=[3]
    ).contents.fp32_contents.append(1)
    new("negative dimension").inputs.add(name="I", datatype="FP32", shape=[-1])
    m = new("shared memory input")
    t = m.inputs.add(name="I", datatype="FP32", shape=[1])
    t.parameters["shared_memory_region"].string_param = "region"
    m = new("input twice")
    m.inputs.add(name="I", datatype="FP32", shape=[1]).contents.fp32_contents.append(1)
    m.inputs.add(name="I", datatype="FP32", shape=[1]).contents.fp32_contents.append(1)
    return cases


@pytest.mark.parametrize("case", list(_bad_requests()))
def test_decode_errors(case: str) -> None:
    with pytest.raises(InferError) as e:
        decode_infer_request(_bad_requests()[case], 0)
    assert http_status(e.value.code) == 400


def test_encode_raw_outputs() -> None:
    words = np.empty(2, dtype=object)
    words[:] = [b"x", b"yz"]
    resp = InferResponse(
        "m",
        "2",
        {"A": np.arange(4, dtype=">i4").reshape(2, 2), "B": words, "C": np.array([True, False])},
        id="r",
        parameters={"flag": True, "n": 3},
    )
    msg = encode_infer_response(resp)
    assert (msg.model_name, msg.model_version, msg.id) == ("m", "2", "r")
    assert [(o.name, o.datatype, list(o.shape)) for o in msg.outputs] == [
        ("A", "INT32", [2, 2]),
        ("B", "BYTES", [2]),
        ("C", "BOOL", [2]),
    ]
    assert np.frombuffer(msg.raw_output_contents[0], "<i4").tolist() == [0, 1, 2, 3]
    assert msg.raw_output_contents[1] == b"\x01\0\0\0x\x02\0\0\0yz"
    assert msg.raw_output_contents[2] == b"\x01\x00"
    assert msg.parameters["flag"].bool_param and msg.parameters["n"].int64_param == 3


def test_status_codes_follow_triton() -> None:
    assert grpc_status(InferError("x", ErrorCode.INVALID_ARG)) == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_status(InferError("x", ErrorCode.NOT_FOUND)) == grpc.StatusCode.NOT_FOUND
    assert grpc_status(InferError("x", ErrorCode.UNAVAILABLE)) == grpc.StatusCode.UNAVAILABLE
    assert grpc_status(InferError("x", ErrorCode.INTERNAL)) == grpc.StatusCode.INTERNAL
    assert grpc_status(InferError("x", ErrorCode.UNSUPPORTED)) == grpc.StatusCode.UNIMPLEMENTED
    assert grpc_status(InferError("x", ErrorCode.CLIENT_GONE)) == grpc.StatusCode.CANCELLED


# The Kubernetes manifests' agreement with pdserve's flags: tests/unit/test_deploy.py.


# -- warm-up -------------------------------------------------------------------------


class _Recorder:
    """A model instance that records what it runs (and fails when told)."""

    def __init__(self, fail: bool = False) -> None:
        self.seen: list[dict[str, np.ndarray]] = []
        self.fail = fail

    async def execute(self, batch: list) -> list:
        self.seen.append(dict(batch[0].inputs))
        if self.fail:
            return [InferError("model says no", ErrorCode.INTERNAL)]
        return [{"OUTPUT0": np.zeros((batch[0].batch_size, 64), np.float32)}]


def _model_version(tmp_path: Path, extra: str = "", fail: bool = False):  # noqa: ANN202
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from pdserve.backends.base import ModelSpec
    from pdserve.repository.model import ModelVersion

    cfg = text_format.Parse(
        'name: "m" platform: "onnxruntime_onnx" max_batch_size: 8 '
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, 4 ] } ] '
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ] ' + extra,
        model_config_pb2.ModelConfig(),
    )
    spec = ModelSpec("m", 1, cfg, tmp_path, tmp_path / "1", tmp_path)
    mv = ModelVersion(spec, "onnxruntime_onnx", "onnxruntime")
    mv.instances = [_Recorder(fail), _Recorder(fail)]
    return mv


def test_no_warmup_without_model_warmup(tmp_path: Path) -> None:
    """As in Triton, a configuration without model_warmup gets no request at load."""
    import asyncio

    from pdserve.repository.warmup import warmup

    mv = _model_version(tmp_path)
    asyncio.run(warmup(mv))
    assert [inst.seen for inst in mv.instances] == [[], []]


def test_warmup_configured_samples(tmp_path: Path) -> None:
    import asyncio

    from pdserve.repository.warmup import WarmupError, warmup

    (tmp_path / "warmup").mkdir()
    data = np.arange(8, dtype="<f4")
    (tmp_path / "warmup" / "in.bin").write_bytes(data.tobytes())
    extra = """model_warmup [
      { name: "file" batch_size: 2 count: 3
        inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 1, 4 ]
                                       input_data_file: "in.bin" } } },
      { name: "rand" batch_size: 1
        inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 2, 4 ] random_data: true } } }
    ]"""
    mv = _model_version(tmp_path, extra)
    asyncio.run(warmup(mv))
    for inst in mv.instances:
        shapes = [a["INPUT0"].shape for a in inst.seen]
        assert shapes == [(2, 1, 4)] * 3 + [(1, 2, 4)]
        np.testing.assert_array_equal(inst.seen[0]["INPUT0"].ravel(), data)
    with pytest.raises(WarmupError, match="model says no"):
        asyncio.run(warmup(_model_version(tmp_path, extra, fail=True)))
    missing = extra.replace("in.bin", "missing.bin")
    with pytest.raises(WarmupError, match="cannot read"):
        asyncio.run(warmup(_model_version(tmp_path, missing)))


# -- robustness ---------------------------------------------------------------------


def _grpc_decode_error(msg: service_pb2.ModelInferRequest) -> str:
    with pytest.raises(InferError) as info:
        decode_infer_request(msg, 0)
    assert http_status(info.value.code) == 400
    assert grpc_status(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.message


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ([1] * 70, "at most 64"),
        ([0, 2**63 - 1], "too many elements"),
        ([2**31, 2**31, 4], "too many elements"),
        ([1, 2**62], "too many elements"),
    ],
)
def test_decode_shapes_numpy_cannot_hold_are_invalid_argument(shape: list[int], words: str) -> None:
    raw = service_pb2.ModelInferRequest(model_name="m", raw_input_contents=[b""])
    raw.inputs.add(name="X", datatype="FP32", shape=shape)
    assert words in _grpc_decode_error(raw)
    typed = service_pb2.ModelInferRequest(model_name="m")
    typed.inputs.add(name="X", datatype="FP32", shape=shape)
    assert words in _grpc_decode_error(typed)


@pytest.mark.parametrize(
    ("datatype", "field", "values", "bad"),
    [
        ("INT8", "int_contents", [1, 1000], 1000),
        ("INT8", "int_contents", [-129, 0], -129),
        ("INT16", "int_contents", [40000], 40000),
        ("UINT8", "uint_contents", [256], 256),
        ("UINT16", "uint_contents", [70000], 70000),
    ],
)
def test_decode_typed_contents_out_of_range_are_invalid_argument(
    datatype: str, field: str, values: list[int], bad: int
) -> None:
    msg = service_pb2.ModelInferRequest(model_name="m")
    tensor = msg.inputs.add(name="X", datatype=datatype, shape=[len(values)])
    getattr(tensor.contents, field).extend(values)
    message = _grpc_decode_error(msg)
    assert f"value {bad} is out of range for {datatype}" in message


def test_decode_typed_contents_at_the_range_edges() -> None:
    msg = service_pb2.ModelInferRequest(model_name="m")
    msg.inputs.add(name="A", datatype="INT8", shape=[2]).contents.int_contents.extend([-128, 127])
    msg.inputs.add(name="B", datatype="UINT16", shape=[2]).contents.uint_contents.extend([0, 65535])
    msg.inputs.add(name="C", datatype="INT16", shape=[0])
    inputs = decode_infer_request(msg, 0).inputs
    assert inputs["A"].dtype == np.int8 and inputs["A"].tolist() == [-128, 127]
    assert inputs["B"].dtype == np.uint16 and inputs["B"].tolist() == [0, 65535]
    assert inputs["C"].shape == (0,)


def test_decode_raw_bytes_with_millions_of_extra_elements_stops_early() -> None:
    import time

    msg = service_pb2.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 8_000_000])
    msg.inputs.add(name="S", datatype="BYTES", shape=[1, 1])
    start = time.perf_counter()
    assert "more than 1 elements" in _grpc_decode_error(msg)
    assert time.perf_counter() - start < 0.5
    short = service_pb2.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 8])
    short.inputs.add(name="S", datatype="BYTES", shape=[1000])
    assert "at most 2 elements" in _grpc_decode_error(short)


# -- field rules (issue 10): the HTTP rules, in gRPC's types ----------------------------


def _one_input() -> service_pb2.ModelInferRequest:
    msg = service_pb2.ModelInferRequest(model_name="m")
    msg.inputs.add(name="X", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
    return msg


def _decode_error(msg: service_pb2.ModelInferRequest) -> str:
    with pytest.raises(InferError) as e:
        decode_infer_request(msg, 0)
    assert grpc_status(e.value) == grpc.StatusCode.INVALID_ARGUMENT
    return e.value.message


@pytest.mark.parametrize(
    ("key", "kind", "value", "words"),
    [
        (
            "priority",
            "string_param",
            "1",
            "'priority' must be an int64_param >= 0 or a uint64_param",
        ),
        ("priority", "int64_param", -1, "'priority' must be an int64_param >= 0"),
        ("priority", "double_param", 1.0, "'priority' must be an int64_param >= 0"),
        ("timeout", "double_param", 0.5, "'timeout' must be an int64_param >= 0 (microseconds)"),
        ("timeout", "int64_param", -1, "'timeout' must be an int64_param >= 0"),
        (
            "sequence_id",
            "bool_param",
            True,
            "'sequence_id' must be an int64_param >= 0 or a string",
        ),
        ("sequence_start", "int64_param", 1, "'sequence_start' must be a bool_param"),
        ("sequence_end", "string_param", "yes", "'sequence_end' must be a bool_param"),
        ("triton_other", "bool_param", True, "keys starting with 'triton_' are reserved"),
        (
            "triton_enable_empty_final_response",
            "int64_param",
            1,
            "'triton_enable_empty_final_response' must be a bool_param",
        ),
    ],
)
def test_request_parameters_follow_triton_grpc(
    key: str, kind: str, value: object, words: str
) -> None:
    msg = _one_input()
    setattr(msg.parameters[key], kind, value)
    assert words in _decode_error(msg)


def test_parameters_without_a_value_are_invalid_argument() -> None:
    msg = _one_input()
    msg.parameters["user"].CopyFrom(service_pb2.InferParameter())
    assert "request parameter 'user' must be a string, number or boolean, not null" in (
        _decode_error(msg)
    )
    msg = _one_input()
    msg.inputs[0].parameters["note"].CopyFrom(service_pb2.InferParameter())
    assert "input 'X' parameter 'note' must be a string, number or boolean" in _decode_error(msg)
    msg = _one_input()
    msg.outputs.add(name="Y").parameters["note"].CopyFrom(service_pb2.InferParameter())
    assert "output 'Y' parameter 'note' must be a string, number or boolean" in _decode_error(msg)


def test_requested_output_parameters_are_checked() -> None:
    for kind, value, words in (
        ("int64_param", -2, "'classification' must be an int64_param >= 0"),
        ("double_param", 2.0, "'classification' must be an int64_param >= 0"),
        ("bool_param", True, "'classification' must be an int64_param >= 0"),
    ):
        msg = _one_input()
        setattr(msg.outputs.add(name="Y").parameters["classification"], kind, value)
        assert f"output 'Y' parameter {words}" in _decode_error(msg)
    msg = _one_input()
    msg.outputs.add(name="Y").parameters["binary_data"].string_param = "yes"
    assert "output 'Y' parameter 'binary_data' must be a bool_param" in _decode_error(msg)


def test_valid_parameters_pass_unchanged() -> None:
    msg = _one_input()
    msg.parameters["priority"].uint64_param = 2**64 - 1
    msg.parameters["timeout"].int64_param = 0
    msg.parameters["sequence_id"].string_param = "s"
    msg.parameters["sequence_start"].bool_param = True
    msg.parameters["triton_enable_empty_final_response"].bool_param = False
    msg.parameters["binary_data_output"].string_param = "any: an ordinary key on gRPC"
    msg.parameters["user"].double_param = 0.5
    out = msg.outputs.add(name="Y")
    out.parameters["classification"].uint64_param = 3
    out.parameters["binary_data"].bool_param = True
    out.parameters["note"].string_param = "kept"
    req = decode_infer_request(msg, 0)
    assert req.parameters["priority"] == 2**64 - 1 and req.parameters["user"] == 0.5
    assert req.outputs is not None
    assert (req.outputs[0].classification, req.outputs[0].parameters) == (3, {"note": "kept"})


def test_raw_bytes_errors_name_the_input() -> None:
    msg = service_pb2.ModelInferRequest(model_name="m", raw_input_contents=[b"\x05\x00\x00\x00ab"])
    msg.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    assert _decode_error(msg).startswith("input 'TEXT': BYTES tensor data is truncated")


def test_shared_memory_inputs_are_recorded_and_raw_contents_skip_them() -> None:
    """tritonclient sends no raw_input_contents entry for an input in shared memory."""
    m = service_pb2.ModelInferRequest(model_name="m")
    a = m.inputs.add(name="A", datatype="FP32", shape=[1, 4])
    a.parameters["shared_memory_region"].string_param = "r"
    a.parameters["shared_memory_byte_size"].int64_param = 16
    a.parameters["shared_memory_offset"].int64_param = 8
    m.inputs.add(name="B", datatype="INT32", shape=[2])
    m.raw_input_contents.append(np.array([1, 2], dtype=np.int32).tobytes())
    o = m.outputs.add(name="Y")
    o.parameters["shared_memory_region"].string_param = "r"
    o.parameters["shared_memory_byte_size"].int64_param = 64
    req = decode_infer_request(m, 0)
    assert req.shm_inputs is not None and set(req.shm_inputs) == {"A"}
    ref = req.shm_inputs["A"]
    assert (ref.region, ref.byte_size, ref.offset, ref.shape, ref.count) == ("r", 16, 8, [1, 4], 4)
    assert req.inputs["B"].tolist() == [1, 2] and list(req.inputs) == ["A", "B"]
    assert req.outputs is not None and req.outputs[0].parameters["shared_memory_byte_size"] == 64
    m.raw_input_contents.append(b"\0" * 4)  # one entry too many
    with pytest.raises(InferError, match="one per input not in shared memory"):
        decode_infer_request(m, 0)


def test_shared_memory_outputs_are_sent_without_data() -> None:
    resp = InferResponse(
        "m", "1", outputs={"Y": np.ones((2, 3), np.float32), "Z": np.zeros(2, np.int64)}
    )
    msg = encode_infer_response(resp, frozenset({"Y"}))
    assert [o.name for o in msg.outputs] == ["Y", "Z"]
    assert msg.outputs[0].datatype == "FP32" and list(msg.outputs[0].shape) == [2, 3]
    assert list(msg.raw_output_contents) == [b"", np.zeros(2, np.int64).tobytes()]


def test_empty_final_parameter_is_checked_then_kept_from_the_core() -> None:
    # perf_analyzer's every gRPC request carries it (bool_param true); Triton's frontend
    # reads it and its backends never see it ("not accessible in the Triton C-API")
    msg = _one_input()
    msg.parameters[EMPTY_FINAL_PARAM].bool_param = True
    assert empty_final_requested(msg) is True
    assert decode_infer_request(msg, 0).parameters == {}
    msg.parameters["user"].int64_param = 7
    assert decode_infer_request(msg, 0).parameters == {"user": 7}
    msg = _one_input()
    msg.parameters[EMPTY_FINAL_PARAM].bool_param = False
    assert empty_final_requested(msg) is False
    assert decode_infer_request(msg, 0).parameters == {}
    assert empty_final_requested(_one_input()) is False
    for kind, value in (("string_param", "true"), ("int64_param", 1)):
        msg = _one_input()
        setattr(msg.parameters[EMPTY_FINAL_PARAM], kind, value)
        assert empty_final_requested(msg) is False
        assert f"'{EMPTY_FINAL_PARAM}' must be a bool_param" in _decode_error(msg)
