"""The V2 REST codec (pdserve.frontends.http.decode / .encode) and the ASGI frontend in isolation.

Codec tests use real request bodies built by ``tritonclient.http`` (the exact bytes the
real client sends) and parse our responses with ``tritonclient.http``'s own parser. The
ASGI tests drive ``HttpApp`` with an in-test harness against a fake server object: they
cover routing, limits and compression only; the real server is tested in integration.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import struct
import threading
import time
import zlib
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as triton_http

from pdserve.core.errors import ErrorCode, InferError, not_found
from pdserve.core.types import InferRequest, InferResponse, RequestedOutput
from pdserve.frontends.http.app import create_http_app
from pdserve.frontends.http.decode import decode_infer_request
from pdserve.frontends.http.encode import encode_infer_response, encode_infer_response_parts
from pdserve.frontends.http.server import LimitedHttpProtocol, serve_http
from pdserve.frontends.http.status import http_status

Client = triton_http.InferenceServerClient

# One array per V2 datatype, with edge values, shape [2, 3].
SAMPLES: dict[str, np.ndarray] = {
    "BOOL": np.array([[True, False, True], [False, False, True]]),
    "UINT8": np.array([[0, 1, 255], [7, 8, 9]], dtype=np.uint8),
    "UINT16": np.array([[0, 1, 65535], [7, 8, 9]], dtype=np.uint16),
    "UINT32": np.array([[0, 1, 2**32 - 1], [7, 8, 9]], dtype=np.uint32),
    "UINT64": np.array([[0, 1, 2**64 - 1], [7, 8, 9]], dtype=np.uint64),
    "INT8": np.array([[-128, 0, 127], [-1, 2, 3]], dtype=np.int8),
    "INT16": np.array([[-32768, 0, 32767], [-1, 2, 3]], dtype=np.int16),
    "INT32": np.array([[-(2**31), 0, 2**31 - 1], [-1, 2, 3]], dtype=np.int32),
    "INT64": np.array([[-(2**63), 0, 2**63 - 1], [-1, 2, 3]], dtype=np.int64),
    "FP16": np.array([[0.1, -2.5, 65504.0], [1e-3, 0.0, -0.0]], dtype=np.float16),
    "FP32": np.array([[0.1, -2.5, 3.4e38], [1e-30, 0.0, 1.0 / 3.0]], dtype=np.float32),
    "FP64": np.array([[0.1, -2.5, 1.7e308], [5e-324, 0.0, 1.0 / 3.0]], dtype=np.float64),
    "BYTES": np.array([[b"a", b"", "héllo".encode()], [b"x" * 300, b"\x00\x01", b"z"]], object),
}


def client_request(
    arrays: dict[str, np.ndarray], binary: bool, outputs: list[Any] | None = None, **kwargs: Any
) -> tuple[bytes, int | None]:
    """The body and JSON size tritonclient.http sends for ``arrays``."""
    inputs = []
    for name, arr in arrays.items():
        datatype = next(k for k, v in SAMPLES.items() if v.dtype == arr.dtype)
        inp = triton_http.InferInput(name, list(arr.shape), datatype)
        inp.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(inp)
    return Client.generate_request_body(inputs, outputs=outputs, **kwargs)


def parse(body: bytes, header_length: int | None) -> Any:
    return Client.parse_response_body(body, header_length=header_length)


def raw_request(doc: dict[str, Any], binary: bytes = b"") -> tuple[bytes, int | None]:
    header = orjson.dumps(doc)
    return header + binary, (len(header) if binary else None)


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("datatype", list(SAMPLES))
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_every_datatype_round_trips_through_tritonclient(datatype: str, binary: bool) -> None:
    original = SAMPLES[datatype]
    body, header_length = client_request(
        {"IN": original},
        binary,
        outputs=[triton_http.InferRequestedOutput("OUT", binary_data=binary)],
        request_id="r-1",
    )
    assert (header_length is not None) == binary
    request = decode_infer_request(body, header_length, "model", "3")
    assert (request.model_name, request.model_version, request.id) == ("model", "3", "r-1")
    decoded = request.inputs["IN"]
    assert decoded.shape == (2, 3)
    if datatype == "BYTES":
        assert decoded.dtype == object and decoded.tolist() == original.tolist()
    else:
        assert decoded.dtype == original.dtype
        np.testing.assert_array_equal(decoded, original)
    if binary and datatype != "BYTES":
        assert not decoded.flags.writeable  # a zero-copy view of the body

    body, header_length = encode_infer_response(
        InferResponse("model", "3", {"OUT": decoded}), request
    )
    result = parse(body, header_length)
    assert result.get_response()["id"] == "r-1"
    out = result.as_numpy("OUT")
    assert result.get_output("OUT")["datatype"] == datatype
    if datatype == "BYTES":
        expected = original if binary else np.vectorize(bytes.decode, otypes=[object])(original)
        assert out.tolist() == expected.tolist()
    else:
        assert out.dtype == original.dtype
        np.testing.assert_array_equal(out, original)


def test_json_data_nested_and_flat_give_the_same_array() -> None:
    flat = {"name": "X", "shape": [2, 2], "datatype": "INT32", "data": [1, 2, 3, 4]}
    nested = {"name": "X", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]}
    for spec in (flat, nested):
        request = decode_infer_request(*raw_request({"inputs": [spec]}), "m")
        np.testing.assert_array_equal(request.inputs["X"], [[1, 2], [3, 4]])
        assert request.inputs["X"].dtype == np.int32
    nested_bytes = {"name": "S", "shape": [2, 1], "datatype": "BYTES", "data": [["a"], ["ü"]]}
    request = decode_infer_request(*raw_request({"inputs": [nested_bytes]}), "m")
    assert request.inputs["S"].tolist() == [[b"a"], ["ü".encode()]]


def test_json_fp16_and_bool_values() -> None:
    doc = {
        "inputs": [
            {"name": "H", "shape": [3], "datatype": "FP16", "data": [0.5, 1, -65504]},
            {"name": "B", "shape": [2], "datatype": "BOOL", "data": [True, False]},
            {"name": "F", "shape": [2], "datatype": "FP32", "data": [1, 2.5]},
        ]
    }
    request = decode_infer_request(*raw_request(doc), "m")
    assert request.inputs["H"].dtype == np.float16
    np.testing.assert_array_equal(request.inputs["H"], [0.5, 1.0, -65504.0])
    assert request.inputs["B"].dtype == np.bool_ and request.inputs["B"].tolist() == [True, False]
    assert request.inputs["F"].dtype == np.float32


def test_mixed_binary_and_json_inputs_in_input_order() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1, 2], dtype=np.int64)
    c = np.array([b"xy", b""], dtype=object)
    ia = triton_http.InferInput("A", [2, 3], "FP32").set_data_from_numpy(a)
    ib = triton_http.InferInput("B", [2], "INT64").set_data_from_numpy(b, binary_data=False)
    ic = triton_http.InferInput("C", [2], "BYTES").set_data_from_numpy(c)
    body, header_length = Client.generate_request_body([ia, ib, ic], priority=2, timeout=500)
    request = decode_infer_request(body, header_length, "m")
    np.testing.assert_array_equal(request.inputs["A"], a)
    np.testing.assert_array_equal(request.inputs["B"], b)
    assert request.inputs["C"].tolist() == [b"xy", b""]
    assert request.parameters == {"priority": 2, "timeout": 500, "binary_data_output": True}
    assert request.outputs is None


def test_requested_outputs_are_parsed() -> None:
    outputs = [
        triton_http.InferRequestedOutput("P", binary_data=False, class_count=3),
        triton_http.InferRequestedOutput("Q"),
    ]
    body, header_length = client_request({"IN": SAMPLES["FP32"]}, False, outputs=outputs)
    request = decode_infer_request(body, header_length, "m")
    assert request.outputs == [
        RequestedOutput("P", binary_data=False, classification=3),
        RequestedOutput("Q", binary_data=True, classification=0),
    ]
    plain = {"inputs": [], "outputs": [{"name": "R"}, {"name": "S", "parameters": {"k": 1}}]}
    request = decode_infer_request(*raw_request(plain), "m")
    assert request.outputs == [RequestedOutput("R"), RequestedOutput("S", parameters={"k": 1})]


def test_zero_element_and_scalar_shapes() -> None:
    doc = {
        "inputs": [
            {"name": "E", "shape": [0, 3], "datatype": "INT8", "data": []},
            {"name": "S", "shape": [], "datatype": "FP64", "data": [2.5]},
            {
                "name": "EB",
                "shape": [0],
                "datatype": "UINT16",
                "parameters": {"binary_data_size": 0},
            },
            {"name": "SB", "shape": [], "datatype": "INT32", "parameters": {"binary_data_size": 4}},
        ]
    }
    body, header_length = raw_request(doc, struct.pack("<i", -7))
    request = decode_infer_request(body, header_length, "m")
    assert request.inputs["E"].shape == (0, 3) and request.inputs["E"].dtype == np.int8
    assert request.inputs["S"].shape == () and request.inputs["S"] == 2.5
    assert request.inputs["EB"].shape == (0,)
    assert request.inputs["SB"].shape == () and request.inputs["SB"] == -7


# --------------------------------------------------------------------------- decode errors


def decode_error(doc: dict[str, Any] | bytes, binary: bytes = b"", header: Any = "auto") -> str:
    if isinstance(doc, bytes):
        body, header_length = doc, None
    else:
        body, header_length = raw_request(doc, binary)
    if header != "auto":
        header_length = header
    with pytest.raises(InferError) as info:
        decode_infer_request(body, header_length, "m")
    assert http_status(info.value.code) == 400
    return info.value.message


def one_input(**fields: Any) -> dict[str, Any]:
    spec = {"name": "X", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}
    spec.update(fields)
    return {"inputs": [spec]}


def test_malformed_json_is_400_with_the_parser_message() -> None:
    assert "failed to parse the request JSON" in decode_error(b'{"inputs": [')
    assert "JSON object" in decode_error(b"[1, 2]")
    assert "'inputs' list" in decode_error(b"{}")


def test_bad_fields_are_400() -> None:
    assert "unsupported datatype 'FP8'" in decode_error(one_input(datatype="FP8"))
    assert "unsupported datatype 'FP8'" in decode_error(
        one_input(datatype="FP8", data=None, parameters={"binary_data_size": 0}), header=None
    )
    assert "non-negative integers" in decode_error(one_input(shape=[-1]))
    assert "non-negative integers" in decode_error(one_input(shape=[2.0]))
    assert "'shape' list" in decode_error(one_input(shape="2"))
    assert "string 'name'" in decode_error(one_input(name=3))
    assert "more than once" in decode_error({"inputs": one_input()["inputs"] * 2})
    assert "neither 'data' nor" in decode_error(
        {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32"}]}
    )
    assert "'id' must be a string" in decode_error({"id": 5, "inputs": []})
    assert "binary_data_output" in decode_error(
        {"inputs": [], "parameters": {"binary_data_output": 1}}
    )
    assert "classification" in decode_error(
        {"inputs": [], "outputs": [{"name": "o", "parameters": {"classification": -1}}]}
    )
    assert "binary_data" in decode_error(
        {"inputs": [], "outputs": [{"name": "o", "parameters": {"binary_data": "yes"}}]}
    )
    assert "shared memory" in decode_error(
        one_input(data=None, parameters={"shared_memory_region": "r"})
    )


def test_data_count_mismatch_names_input_and_counts() -> None:
    message = decode_error(one_input(shape=[2, 2], data=[1.0, 2.0, 3.0]))
    assert "'X'" in message and "3 elements" in message and "calls for 4" in message
    message = decode_error(one_input(datatype="BYTES", shape=[3], data=["a", "b"]))
    assert "2 elements" in message and "calls for 3" in message
    assert "rectangular" in decode_error(one_input(shape=[3], data=[[1.0, 2.0], [3.0]]))


def test_data_of_the_wrong_kind_is_400() -> None:
    message = decode_error(one_input(data=["1.5", "2"]))
    assert "FP32" in message and "string" in message
    assert "expected integers" in decode_error(one_input(datatype="INT32", data=[1.5, 2]))
    assert "true/false" in decode_error(one_input(datatype="BOOL", data=[1, 0]))
    assert "out of range for INT8" in decode_error(one_input(datatype="INT8", data=[1, 200]))
    assert "out of range for UINT32" in decode_error(one_input(datatype="UINT32", data=[-1, 2]))
    assert "expected strings" in decode_error(one_input(datatype="BYTES", data=[1, 2]))
    assert "null" in decode_error(one_input(data=[1.0, None]))


def test_binary_sizes_must_match_the_body() -> None:
    doc = one_input(data=None, parameters={"binary_data_size": 8})
    del doc["inputs"][0]["data"]
    payload = np.array([1, 2], dtype=np.float32).tobytes()
    assert decode_infer_request(*raw_request(doc, payload), "m").inputs["X"].tolist() == [1, 2]
    message = decode_error(doc, payload + b"\x00")
    assert "add up to 8 bytes" in message and "holds 9 bytes" in message
    assert "1 bytes follow the last binary input, 'X'" in message
    message = decode_error(doc, payload[:5])
    assert message == (
        "input 'X' has binary_data_size 8 but only 5 bytes of binary data are left in the "
        "body after the inputs before it"
    )
    assert "no input has a binary_data_size" in decode_error(one_input(), b"\x00\x00")
    assert "no Inference-Header-Content-Length" in decode_error(doc, b"", header=None)
    assert "needs the Inference-Header-Content-Length" in decode_error(doc, payload, header=None)
    doc["inputs"][0]["parameters"]["binary_data_size"] = 4
    message = decode_error(doc, payload[:4])
    assert "needs 8 bytes" in message and "binary_data_size is 4" in message
    both = one_input(parameters={"binary_data_size": 8})
    assert "both 'data' and 'binary_data_size'" in decode_error(both, payload)
    assert "non-negative integer" in decode_error(one_input(parameters={"binary_data_size": -1}))


def test_header_length_outside_the_body_is_400() -> None:
    body, _ = raw_request(one_input())
    n = len(body)  # Triton's words (http_server.cc GetInferenceHeaderLength)
    assert decode_error(body, header=9999) == (
        f"inference header size should be in range (0, {n}), got: 9999"
    )
    assert (
        decode_error(body, header=-1)
        == f"inference header size should be in range (0, {n}), got: -1"
    )


def test_truncated_bytes_are_400() -> None:
    doc = {"inputs": [{"name": "S", "shape": [2], "datatype": "BYTES", "parameters": {}}]}
    good = struct.pack("<I", 2) + b"ab" + struct.pack("<I", 1) + b"c"
    doc["inputs"][0]["parameters"]["binary_data_size"] = len(good)
    assert decode_infer_request(*raw_request(doc, good), "m").inputs["S"].tolist() == [b"ab", b"c"]
    truncated = struct.pack("<I", 9) + b"ab"
    doc["inputs"][0]["parameters"]["binary_data_size"] = len(truncated)
    message = decode_error(doc, truncated)
    assert "input 'S'" in message and "truncated" in message
    one = struct.pack("<I", 1) + b"a"
    doc["inputs"][0]["parameters"]["binary_data_size"] = len(one)
    assert "1 elements but its shape calls for 2" in decode_error(doc, one)


# --------------------------------------------------------------------------- encode


def test_binary_data_output_default_and_per_output_override() -> None:
    body, header_length = client_request({"IN": SAMPLES["FP32"]}, True)  # no outputs named
    request = decode_infer_request(body, header_length, "m")
    outputs = {"A": SAMPLES["FP32"], "B": SAMPLES["INT8"]}
    parts, json_length, total = encode_infer_response_parts(
        InferResponse("m", "1", outputs), request
    )
    assert len(parts) == 3 and json_length == len(parts[0])
    assert total == json_length + SAMPLES["FP32"].nbytes + SAMPLES["INT8"].nbytes
    header = orjson.loads(parts[0])
    assert [o["parameters"]["binary_data_size"] for o in header["outputs"]] == [24, 6]
    assert "id" not in header and "parameters" not in header

    request.outputs = [RequestedOutput("A", binary_data=False), RequestedOutput("B")]
    body, json_length = encode_infer_response(InferResponse("m", "1", outputs), request)
    header = orjson.loads(body[:json_length])
    assert "data" in header["outputs"][0] and "parameters" in header["outputs"][1]
    result = parse(body, json_length)
    np.testing.assert_array_equal(result.as_numpy("A"), SAMPLES["FP32"])
    np.testing.assert_array_equal(result.as_numpy("B"), SAMPLES["INT8"])

    request.parameters = {}
    request.outputs = None
    body, json_length = encode_infer_response(InferResponse("m", "1", outputs), request)
    assert json_length is None and b"binary_data_size" not in body


def test_response_json_layout() -> None:
    request = InferRequest("m", id="abc", outputs=[RequestedOutput("labels", binary_data=False)])
    labels = np.array([[b"0.9:3:cat", b"0.1:1:dog"]], dtype=object)  # classification result
    response = InferResponse("m", "2", {"labels": labels}, parameters={"sequence_end": True})
    body, json_length = encode_infer_response(response, request)
    assert json_length is None
    assert orjson.loads(body) == {
        "model_name": "m",
        "model_version": "2",
        "id": "abc",
        "parameters": {"sequence_end": True},
        "outputs": [
            {
                "name": "labels",
                "datatype": "BYTES",
                "shape": [1, 2],
                "data": ["0.9:3:cat", "0.1:1:dog"],
            }
        ],
    }


def test_non_contiguous_big_endian_and_string_outputs() -> None:
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    outputs = {
        "T": base.T,
        "BE": base.astype(">f4"),
        "U": np.array(["ä", "b"]),
        "S": np.array([b"x", b"yz"]),
        "Z": np.float64(1.5) * np.ones(()),
    }
    for binary in (False, True):
        request = InferRequest("m", parameters={"binary_data_output": binary})
        result = parse(*encode_infer_response(InferResponse("m", "1", outputs), request))
        np.testing.assert_array_equal(result.as_numpy("T"), base.T)
        np.testing.assert_array_equal(result.as_numpy("BE"), base)
        strings = result.as_numpy("U").tolist()
        assert strings == (["ä".encode(), b"b"] if binary else ["ä", "b"])
        assert result.as_numpy("S").tolist() == ([b"x", b"yz"] if binary else ["x", "yz"])
        assert result.as_numpy("Z").shape == () and result.as_numpy("Z") == 1.5


def test_non_utf8_bytes_output_as_json_is_400_and_fine_as_binary() -> None:
    outputs = {"O": np.array([b"ok", b"\xff\xfe"], dtype=object)}
    with pytest.raises(InferError) as info:
        encode_infer_response(InferResponse("m", "1", outputs), InferRequest("m"))
    assert http_status(info.value.code) == 400 and "binary_data" in info.value.message
    request = InferRequest("m", outputs=[RequestedOutput("O", binary_data=True)])
    result = parse(*encode_infer_response(InferResponse("m", "1", outputs), request))
    assert result.as_numpy("O").tolist() == [b"ok", b"\xff\xfe"]


# --------------------------------------------------------------------------- non-finite

NONFINITE = [np.nan, np.inf, -np.inf, 1.5, -0.0]


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal element by element, NaN equal to NaN, dtype included."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))
    )


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nonfinite_values_round_trip_json_and_binary_through_tritonclient(dtype: type) -> None:
    """tritonclient sends NaN / Infinity tokens in JSON (Python's json.dumps); they decode
    to the values sent, and JSON and binary outputs give tritonclient the same values
    (Triton reads and writes these tokens: RapidJSON's NanAndInf flags)."""
    original = np.array(NONFINITE, dtype=dtype).reshape(1, 5)
    json_output = [triton_http.InferRequestedOutput("OUT", binary_data=False)]
    body, header_length = client_request({"IN": original}, binary=False, outputs=json_output)
    assert b"NaN" in body and b"-Infinity" in body and header_length is None
    request = decode_infer_request(body, header_length, "m")
    assert same_floats(request.inputs["IN"], original)
    response = InferResponse("m", "1", {"OUT": request.inputs["IN"]})
    json_body, json_header = encode_infer_response(response, request)
    assert json_header is None and b"[NaN,Infinity,-Infinity,1.5,-0.0]" in json_body
    binary_request = InferRequest("m", outputs=[RequestedOutput("OUT", binary_data=True)])
    binary_out = parse(*encode_infer_response(response, binary_request)).as_numpy("OUT")
    json_out = parse(json_body, json_header).as_numpy("OUT")
    assert same_floats(binary_out, original)
    assert same_floats(json_out.astype(dtype), original)


def test_nonfinite_tokens_only_in_float_outputs_and_null_elsewhere_untouched() -> None:
    outputs = {
        "F": np.array([[1.0, np.nan]], np.float32),
        "S": np.array([b"null", b"NaN"], dtype=object),
    }
    body, _ = encode_infer_response(InferResponse("m", "1", outputs), InferRequest("m"))
    assert b'"data":[1.0,NaN]' in body and b'"data":["null","NaN"]' in body
    big = np.array([3e38, -3e38, 1e20], np.float32)  # huge squares, all finite: no tokens
    body, _ = encode_infer_response(InferResponse("m", "1", {"B": big}), InferRequest("m"))
    assert np.array(orjson.loads(body)["outputs"][0]["data"], np.float32).tolist() == big.tolist()


def test_numbers_out_of_range_for_the_datatype_are_400() -> None:
    message = decode_error(one_input(data=[1.0, 1e39]))
    assert "input 'X' value 1e+39 is out of range for FP32" in message
    assert "3.4028235e+38" in message
    assert "out of range for FP32" in decode_error(one_input(data=[[-1e39], [2.0]]), header=None)
    assert "out of range for FP16" in decode_error(one_input(datatype="FP16", data=[1e10, 0]))
    assert "value 100000 is out of range for FP16" in decode_error(
        one_input(datatype="FP16", data=[100000, 0])
    )
    assert "failed to parse the request JSON" in decode_error(b'{"inputs":[{"data":[1e400]}]}')
    # The largest finite values (rounding to them) and tiny ones are fine.
    ok = decode_infer_request(raw_request(one_input(data=[3.4028235e38, 1e-50]))[0], None, "m")
    assert ok.inputs["X"].tolist() == [float(np.finfo(np.float32).max), 0.0]
    fp16 = one_input(datatype="FP16", data=[65504, -65504.0])
    assert decode_infer_request(raw_request(fp16)[0], None, "m").inputs["X"].tolist() == [
        65504.0,
        -65504.0,
    ]
    fp64 = decode_infer_request(
        raw_request(one_input(datatype="FP64", data=[1e308, 1]))[0], None, "m"
    )
    assert fp64.inputs["X"].tolist() == [1e308, 1.0]


def test_nonfinite_tokens_are_read_as_strictly_as_orjson_reads_the_rest() -> None:
    def body(data: str, **extra: str) -> bytes:
        fields = "".join(f', "{k}": {v}' for k, v in extra.items())
        return (
            '{"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": '
            f"{data}}}]{fields}}}"
        ).encode()

    tokens = decode_infer_request(body("[NaN, -Infinity]"), None, "m").inputs["X"]
    assert np.isnan(tokens[0]) and tokens[1] == -np.inf
    for bad in ("[nan, 1]", "[NaN, 1e400]", "[NaN, 1,]", "[Infinity, 2] x"):
        assert "failed to parse the request JSON" in decode_error(body(bad))
    assert "failed to parse" in decode_error(body("[NaN, 1]", id='"\\ud800"'))
    paired = decode_infer_request(body("[NaN, 1]", id='"\\ud83d\\ude00"'), None, "m")
    assert paired.id == "\U0001f600"
    big = body("[NaN, 1]", parameters='{"k": 18446744073709551616}')
    assert decode_infer_request(big, None, "m").parameters["k"] == float(2**64)
    deep = b'{"inputs": [], "x": [NaN, ' + b"[" * 100_000 + b"]" * 100_000 + b"]}"
    assert "failed to parse" in decode_error(deep)
    # Tokens are numbers: refused where the datatype wants integers, booleans, strings.
    for datatype, words in (
        ("INT32", "expected integers"),
        ("BOOL", "true/false"),
        ("BYTES", "expected strings"),
    ):
        doc = body("[NaN, 1]").replace(b"FP32", datatype.encode())
        assert words in decode_error(doc)


# --------------------------------------------------------------------------- field rules


@pytest.mark.parametrize(
    ("parameters", "words"),
    [
        ({"priority": "high"}, "'priority' must be a non-negative integer, got 'high'"),
        ({"priority": -1}, "'priority' must be a non-negative integer"),
        ({"priority": 1.5}, "'priority' must be a non-negative integer"),
        ({"priority": True}, "'priority' must be a non-negative integer"),
        ({"priority": 2**64 - 1 + 1.0}, "'priority' must be a non-negative integer"),
        ({"timeout": -5}, "'timeout' must be a non-negative integer (microseconds)"),
        ({"timeout": "10"}, "'timeout' must be a non-negative integer"),
        ({"sequence_id": 1.5}, "'sequence_id' must be a non-negative integer or a string"),
        ({"sequence_start": 1}, "'sequence_start' must be true or false"),
        ({"sequence_end": "yes"}, "'sequence_end' must be true or false"),
        ({"binary_data_output": 1}, "'binary_data_output' must be true or false"),
        ({"triton_x": True}, "'triton_x': keys starting with 'triton_' are reserved"),
        ({"user": {"a": 1}}, "request parameter 'user' must be a string, number or boolean"),
        ({"user": [1]}, "'user' must be a string, number or boolean, not an array"),
        ({"user": None}, "'user' must be a string, number or boolean, not null"),
    ],
)
def test_request_parameters_follow_v2_and_triton(parameters: dict, words: str) -> None:
    assert words in decode_error({"inputs": [], "parameters": parameters})


def test_valid_request_parameters_pass_unchanged() -> None:
    parameters = {
        "priority": 2,
        "timeout": 0,
        "sequence_id": "session-1",
        "sequence_start": True,
        "binary_data_output": False,
        "user_s": "x",
        "user_i": -3,
        "user_f": 0.5,
        "user_b": False,
    }
    request = decode_infer_request(
        orjson.dumps({"inputs": [], "parameters": parameters}), None, "m"
    )
    assert request.parameters == parameters


def test_input_and_output_parameters_and_data_must_have_v2_types() -> None:
    message = decode_error(one_input(parameters={"note": ["a"]}))
    assert message == "input 'X' parameter 'note' must be a string, number or boolean, not an array"
    assert "output 'o' parameter 'k' must be a string, number or boolean, not an object" in (
        decode_error({"inputs": [], "outputs": [{"name": "o", "parameters": {"k": {}}}]})
    )
    assert "classification" in decode_error(
        {"inputs": [], "outputs": [{"name": "o", "parameters": {"classification": 1.0}}]}
    )
    for data, kind in (
        (1.0, "a number"),
        ("1", "a string"),
        ({"a": 1}, "an object"),
        (True, "a boolean"),
    ):
        message = decode_error(one_input(shape=[], data=data))
        assert (
            message
            == f"input 'X' 'data' must be a JSON array (flat or nested, row-major), not {kind}"
        )
    request = decode_infer_request(raw_request(one_input(parameters={"note": "ok"}))[0], None, "m")
    assert request.inputs["X"].tolist() == [1.0, 2.0]


def test_binary_size_errors_name_the_input() -> None:
    doc = {
        "inputs": [
            {"name": "A", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}},
            {"name": "B", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
        ]
    }
    message = decode_error(doc, b"\x00" * 10)
    assert message.startswith("input 'B' has binary_data_size 8 but only 6 bytes")
    assert "input 'A' has binary_data_size 4 but the request has no" in decode_error(
        doc, b"", header=None
    )
    assert "follow the last binary input, 'B'" in decode_error(doc, b"\x00" * 13)


def test_unsupported_output_dtype_is_500() -> None:
    with pytest.raises(InferError) as info:
        encode_infer_response(
            InferResponse("m", "1", {"C": np.zeros(2, dtype=np.complex64)}), InferRequest("m")
        )
    assert http_status(info.value.code) == 500 and "'C'" in info.value.message


# --------------------------------------------------------------------------- ASGI harness


class FakeServer:
    """Just enough of InferenceServer: an identity model named "echo"."""

    def __init__(self) -> None:
        self.is_ready = True
        self.loaded: list[tuple[Any, ...]] = []
        self.seen: list[InferRequest] = []

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.is_ready

    def metadata(self) -> dict[str, Any]:
        return {"name": "pdserve", "version": "0", "extensions": ["binary_tensor_data"]}

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        if name != "echo":
            raise not_found(f"Request for unknown model: '{name}' is not found")
        return {"name": name, "versions": ["1"], "platform": "fake", "v": version}

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        return {"name": name, "max_batch_size": 8}

    def model_ready(self, name: str, version: str = "") -> bool:
        return name == "echo" and version in ("", "1")

    async def infer(self, request: InferRequest) -> InferResponse:
        self.seen.append(request)
        if request.model_name == "boom":
            raise RuntimeError("kaboom")
        if request.model_name != "echo":
            raise InferError("model is not ready", ErrorCode.UNAVAILABLE)
        return InferResponse("echo", "1", dict(request.inputs), id=request.id)


class StatsServer(FakeServer):
    def model_statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        return {"model_stats": [{"name": name, "version": version}]}

    def repository_index(self, ready_only: bool) -> list[dict[str, Any]]:
        return [{"name": "echo", "state": "READY", "ready_only": ready_only}]

    async def load_model(self, name: str, config: str | None, files: dict[str, bytes]) -> None:
        self.loaded.append(("load", name, config, files))

    async def unload_model(self, name: str, unload_dependents: bool) -> None:
        self.loaded.append(("unload", name, unload_dependents))


class Reply:
    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages
        start = messages[0] if messages else {}
        self.status = start.get("status")
        self.headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
        self.body = b"".join(bytes(m.get("body", b"")) for m in messages[1:])

    def json(self) -> Any:
        return orjson.loads(self.body)


def call(
    app: Any,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    chunk: int | None = None,
    disconnect_after: int | None = None,
) -> Reply:
    """Run one request through the ASGI app; the body arrives in ``chunk``-byte pieces."""
    headers = dict(headers or {})
    headers.setdefault("content-length", str(len(body)))
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    size = chunk or max(len(body), 1)
    pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    events: list[dict[str, Any]] = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)
    ]
    if disconnect_after is not None:
        events = events[:disconnect_after] + [{"type": "http.disconnect"}]
    received = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        return events.pop(0) if events else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    reply = Reply(sent)
    reply.receives = received  # type: ignore[attr-defined]
    if sent:
        assert int(reply.headers["content-length"]) == len(reply.body)
    return reply


def test_health_and_metadata_routes() -> None:
    server = FakeServer()
    app = create_http_app(server)
    assert call(app, "GET", "/v2/health/live").status == 200
    ready = call(app, "GET", "/v2/health/ready")
    assert (ready.status, ready.body) == (200, b"")
    server.is_ready = False
    assert call(app, "GET", "/v2/health/ready").status == 400
    assert call(app, "GET", "/v2").json()["name"] == "pdserve"
    assert call(app, "GET", "/v2/models/echo").json()["v"] == ""
    assert call(app, "GET", "/v2/models/echo/versions/1").json()["v"] == "1"
    missing = call(app, "GET", "/v2/models/nope")
    assert missing.status == 404 and "unknown model" in missing.json()["error"]
    assert call(app, "GET", "/v2/models/echo/config").json()["max_batch_size"] == 8
    assert call(app, "GET", "/v2/models/echo/versions/1/ready").status == 200
    not_ready = call(app, "GET", "/v2/models/echo/versions/2/ready")
    assert not_ready.status == 400 and not_ready.json() == {"error": "Model version not ready"}


def test_unknown_paths_and_wrong_methods() -> None:
    app = create_http_app(FakeServer())
    for path in ("/", "/v3/models/x", "/v2/models", "/v2/models/echo/bogus", "/v2/x/y/z/w/v/u"):
        reply = call(app, "GET", path)
        assert reply.status == 404 and "no route" in reply.json()["error"], path
    # /v1/ is the OpenAI front end: its 404s are OpenAI's error body
    assert call(app, "GET", "/v1/models/x").json()["error"]["code"] == "model_not_found"
    assert call(app, "GET", "/v1/bogus").json()["error"]["code"] == "unknown_url"
    assert call(app, "POST", "/v2/health/live").status == 405
    assert call(app, "GET", "/v2/models/echo/infer").json() == {"error": "Method Not Allowed"}
    assert call(app, "POST", "/v2/models/echo/config").status == 405
    assert call(app, "GET", "/v2/repository/index").status == 405


def test_optional_routes_are_404_without_server_support() -> None:
    app = create_http_app(FakeServer())
    for method, path in [
        ("GET", "/v2/models/stats"),
        ("GET", "/v2/models/echo/stats"),
        ("POST", "/v2/repository/index"),
        ("POST", "/v2/repository/models/echo/load"),
        ("POST", "/v2/repository/models/echo/unload"),
    ]:
        reply = call(app, method, path)
        assert reply.status == 404 and "does not support" in reply.json()["error"], path


def test_statistics_and_repository_routes() -> None:
    server = StatsServer()
    app = create_http_app(server)
    assert call(app, "GET", "/v2/models/stats").json()["model_stats"][0]["name"] == ""
    stats = call(app, "GET", "/v2/models/echo/versions/1/stats").json()["model_stats"][0]
    assert stats == {"name": "echo", "version": "1"}
    assert call(app, "POST", "/v2/repository/index").json()[0]["ready_only"] is False
    index = call(app, "POST", "/v2/repository/index", b'{"ready": true}')
    assert index.json()[0]["ready_only"] is True
    load = {"parameters": {"config": '{"backend":"onnxruntime"}', "file:1/model.onnx": "AAEC"}}
    reply = call(app, "POST", "/v2/repository/models/new/load", orjson.dumps(load))
    assert (reply.status, reply.body) == (200, b"")
    assert call(app, "POST", "/v2/repository/models/old/unload").status == 200
    unload = {"parameters": {"unload_dependents": True}}
    assert call(app, "POST", "/v2/repository/models/ens/unload", orjson.dumps(unload)).status == 200
    assert server.loaded == [
        ("load", "new", '{"backend":"onnxruntime"}', {"1/model.onnx": b"\x00\x01\x02"}),
        ("unload", "old", False),
        ("unload", "ens", True),
    ]
    bad = {"parameters": {"file:x": "not base64!"}}
    assert call(app, "POST", "/v2/repository/models/m/load", orjson.dumps(bad)).status == 400
    assert call(app, "POST", "/v2/repository/index", b"[1]").status == 400


def test_infer_json_and_binary_through_the_app() -> None:
    server = FakeServer()
    app = create_http_app(server)
    arr = np.arange(64, dtype=np.float32).reshape(1, 64)
    body, _ = client_request(
        {"IN": arr}, False, outputs=[triton_http.InferRequestedOutput("IN", binary_data=False)]
    )
    reply = call(app, "POST", "/v2/models/echo/infer", body)
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in reply.headers
    np.testing.assert_array_equal(parse(reply.body, None).as_numpy("IN"), arr)

    big = np.random.default_rng(0).standard_normal((3, 40000)).astype(np.float32)
    body, json_size = client_request({"IN": big}, True, request_id="7")
    headers = {"Inference-Header-Content-Length": str(json_size)}
    reply = call(app, "POST", "/v2/models/echo/versions/1/infer", body, headers, chunk=65536)
    assert reply.status == 200 and reply.headers["content-type"] == "application/octet-stream"
    length = int(reply.headers["inference-header-content-length"])
    result = parse(reply.body, length)
    np.testing.assert_array_equal(result.as_numpy("IN"), big)
    assert result.get_response()["id"] == "7"
    assert server.seen[-1].model_version == "1"


def test_infer_errors_keep_the_app_serving() -> None:
    app = create_http_app(FakeServer())
    body, _ = client_request({"IN": SAMPLES["INT8"]}, False)
    assert call(app, "POST", "/v2/models/sleepy/infer", body).status == 503
    boom = call(app, "POST", "/v2/models/boom/infer", body)
    assert boom.status == 500 and "kaboom" in boom.json()["error"]
    assert call(app, "POST", "/v2/models/echo/infer", body).status == 200
    assert "failed to parse" in call(app, "POST", "/v2/models/echo/infer", b"{").json()["error"]
    headers = {"Inference-Header-Content-Length": "abc"}
    reply = call(app, "POST", "/v2/models/echo/infer", body, headers)
    assert reply.status == 400 and "'abc'" in reply.json()["error"]
    headers = {"Inference-Header-Content-Length": str(len(body) + 1)}
    assert call(app, "POST", "/v2/models/echo/infer", body, headers).status == 400
    assert call(app, "POST", "/v2/models//infer", body).status == 400


def test_body_limit_is_413_without_reading_the_rest() -> None:
    app = create_http_app(FakeServer(), max_request_bytes=1000)
    body = b"x" * 5000
    reply = call(app, "POST", "/v2/models/echo/infer", body)
    assert reply.status == 413 and reply.receives == 0  # type: ignore[attr-defined]
    assert reply.json()["error"] == "request body of 5000 bytes exceeds the limit of 1000 bytes"
    assert reply.headers["connection"] == "close"
    # No content-length (chunked transfer): stop at the first chunk over the limit.
    reply = call(app, "POST", "/v2/models/echo/infer", body, {"content-length": ""}, chunk=300)
    assert reply.status == 413 and reply.receives == 4  # type: ignore[attr-defined]
    assert "at least 1200 bytes" in reply.json()["error"]


def test_gzip_and_deflate_bodies() -> None:
    app = create_http_app(FakeServer(), max_request_bytes=100_000)
    arr = np.arange(1000, dtype=np.int32)
    body, json_size = client_request({"IN": arr}, True)
    headers = {"Inference-Header-Content-Length": str(json_size)}
    for encoding, packed in [
        ("gzip", gzip.compress(body)),
        ("deflate", zlib.compress(body)),
        ("deflate", _raw_deflate(body)),
        ("gzip", gzip.compress(body[:100]) + gzip.compress(body[100:])),
    ]:
        reply = call(
            app, "POST", "/v2/models/echo/infer", packed, {**headers, "Content-Encoding": encoding}
        )
        assert reply.status == 200, reply.body
        result = parse(reply.body, int(reply.headers["inference-header-content-length"]))
        np.testing.assert_array_equal(result.as_numpy("IN"), arr)
    corrupt = call(app, "POST", "/v2/models/echo/infer", b"not gzip", {"Content-Encoding": "gzip"})
    assert corrupt.status == 400 and "decompress" in corrupt.json()["error"]
    cut = gzip.compress(body)[:-20]
    assert (
        "truncated"
        in call(app, "POST", "/v2/models/echo/infer", cut, {"Content-Encoding": "gzip"}).json()[
            "error"
        ]
    )
    assert (
        call(app, "POST", "/v2/models/echo/infer", body, {"Content-Encoding": "br"}).status == 415
    )
    bomb = gzip.compress(b"{" + b" " * 1_000_000 + b"}")
    reply = call(app, "POST", "/v2/models/echo/infer", bomb, {"Content-Encoding": "gzip"})
    assert reply.status == 413 and "decompressed" in reply.json()["error"]


def _raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


def test_disconnect_mid_body_sends_nothing() -> None:
    server = FakeServer()
    app = create_http_app(server)
    body, _ = client_request({"IN": SAMPLES["FP64"]}, False)
    reply = call(app, "POST", "/v2/models/echo/infer", body, chunk=10, disconnect_after=2)
    assert reply.status is None and server.seen == []


def test_cancelled_probe_reads_uvicorns_disconnected_flag() -> None:
    class Cycle:  # stands in for uvicorn's RequestResponseCycle
        disconnected = False

        async def receive(self) -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

    server = FakeServer()
    app = create_http_app(server)
    body, _ = client_request({"IN": SAMPLES["UINT8"]}, False)
    cycle = Cycle()
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v2/models/echo/infer", "headers": []}
    asyncio.run(app(scope, cycle.receive, send))
    cancelled = server.seen[-1].cancelled
    assert cancelled is not None and cancelled() is False
    cycle.disconnected = True
    assert cancelled() is True


BIG = np.random.default_rng(1).standard_normal((4, 50_000)).astype(np.float32)


def test_serve_http_on_a_real_socket() -> None:
    async def main() -> tuple[list[tuple[bytes, int]], bytes]:
        server = serve_http(create_http_app(FakeServer()), "127.0.0.1", 0)
        assert issubclass(server.config.http, LimitedHttpProtocol)  # httptools, limited
        assert server.config.lifespan == "off"
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        body, _ = client_request({"IN": SAMPLES["INT16"]}, False)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        big_body, big_json_length = client_request({"IN": BIG}, True)
        writer.write(
            b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
            b"Inference-Header-Content-Length: %d\r\n\r\n" % (len(big_body), big_json_length)
        )
        writer.write(big_body)
        writer.write(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        replies = []
        for _ in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            fields = dict(line.split(b": ", 1) for line in head.lower().split(b"\r\n")[1:-2])
            body = await reader.readexactly(int(fields[b"content-length"]))
            replies.append((body, int(fields[b"inference-header-content-length"])))
        ready_head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        server.should_exit = True
        await task
        return replies, ready_head

    (small, big), ready_head = asyncio.run(main())
    np.testing.assert_array_equal(parse(*small).as_numpy("IN"), SAMPLES["INT16"])
    np.testing.assert_array_equal(parse(*big).as_numpy("IN"), BIG)  # sent part by part
    assert ready_head.startswith(b"HTTP/1.1 200")


def test_load_parameter_base64_uses_standard_alphabet() -> None:
    payload = bytes(range(256))
    encoded = base64.b64encode(payload).decode()
    server = StatsServer()
    body = orjson.dumps({"parameters": {"file:1/m.bin": encoded}})
    assert call(create_http_app(server), "POST", "/v2/repository/models/m/load", body).status == 200
    assert server.loaded[0][3] == {"1/m.bin": payload}


# --------------------------------------------------------------------------- robustness


def test_shapes_numpy_cannot_hold_are_400() -> None:
    assert "at most 64" in decode_error(one_input(shape=[1] * 70, data=[1.0]))
    for shape in ([0, 2**63 - 1], [2**31, 2**31, 4], [1, 2**62], [0, 2**59]):
        assert "too many elements" in decode_error(one_input(shape=shape, data=[]))
    # 64 dimensions, and an empty array with a wide but representable dimension, are fine.
    assert decode_infer_request(*raw_request(one_input(shape=[1] * 64, data=[2.0])), "m")
    empty = decode_infer_request(*raw_request(one_input(shape=[0, 2**58], data=[])), "m")
    assert empty.inputs["X"].shape == (0, 2**58)


def test_bytes_binary_stops_at_the_first_element_past_the_shape() -> None:
    n = 2_000_000
    doc = {"inputs": [{"name": "S", "shape": [1, 1], "datatype": "BYTES"}]}
    doc["inputs"][0]["parameters"] = {"binary_data_size": 4 * n}
    start = time.perf_counter()
    message = decode_error(doc, b"\0" * (4 * n))
    assert time.perf_counter() - start < 0.5
    assert "more than 1 elements" in message and "calls for 1" in message
    # Too short for the count: rejected before parsing.
    doc["inputs"][0]["shape"] = [1000]
    doc["inputs"][0]["parameters"] = {"binary_data_size": 8}
    assert "at most 2 elements but its shape calls for 1000" in decode_error(doc, b"\0" * 8)


def test_json_data_far_longer_than_the_shape_is_400_before_conversion() -> None:
    message = decode_error(one_input(shape=[1, 64], data=[1.0] * 100_000))
    assert "at least 100000 elements" in message and "calls for 64" in message
    bytes_doc = {"inputs": [{"name": "S", "shape": [1], "datatype": "BYTES", "data": [""] * 10000}]}
    assert "at least 10000 elements" in decode_error(bytes_doc)


def test_many_gzip_members_decompress_in_linear_time() -> None:
    from pdserve.frontends.http.compression import decompress

    payload = np.random.default_rng(0).bytes(2 << 20)
    packed = gzip.compress(b"") * 4000 + gzip.compress(payload, 1)
    start = time.perf_counter()
    assert decompress(packed, ["gzip"], 4 << 20) == payload
    # The quadratic loop copied the 2 MiB tail once per member: 8 GB.
    assert time.perf_counter() - start < 2.0
    app = create_http_app(FakeServer())
    reply = call(
        app,
        "POST",
        "/v2/models/echo/infer",
        gzip.compress(b"") * 5000,
        {"Content-Encoding": "gzip"},
    )
    assert reply.status == 400 and "more than 4096 gzip members" in reply.json()["error"]


def test_content_encoding_lists_and_corrupt_bodies() -> None:
    app = create_http_app(FakeServer(), max_request_bytes=100_000)
    arr = np.arange(10, dtype=np.int32)
    body, _ = client_request({"IN": arr}, False)
    for encoding, packed in [
        ("gzip, identity", gzip.compress(body)),
        ("identity,GZIP", gzip.compress(body)),
        ("deflate, gzip", gzip.compress(zlib.compress(body))),  # applied in order
        ("gzip, deflate", zlib.compress(gzip.compress(body))),
        ("identity", body),
    ]:
        reply = call(app, "POST", "/v2/models/echo/infer", packed, {"Content-Encoding": encoding})
        assert reply.status == 200, (encoding, reply.body)
        length = reply.headers.get("inference-header-content-length")
        result = parse(reply.body, None if length is None else int(length))
        np.testing.assert_array_equal(result.as_numpy("IN"), arr)
    reply = call(app, "POST", "/v2/models/echo/infer", body, {"Content-Encoding": "gzip, br"})
    assert reply.status == 415 and "'br'" in reply.json()["error"]
    bad_crc = bytearray(gzip.compress(body))
    bad_crc[-8] ^= 0xFF
    reply = call(app, "POST", "/v2/models/echo/infer", bytes(bad_crc), {"Content-Encoding": "gzip"})
    assert reply.status == 400 and "corrupt" in reply.json()["error"]
    trailing = zlib.compress(body) + b"junk"
    reply = call(app, "POST", "/v2/models/echo/infer", trailing, {"Content-Encoding": "deflate"})
    assert reply.status == 400 and "corrupt" in reply.json()["error"]


def test_stalled_body_is_408_and_closes() -> None:
    app = create_http_app(FakeServer(), body_timeout=0.2)
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v2/models/echo/infer",
        "headers": [(b"content-length", b"1000")],
    }
    sent: list[dict[str, Any]] = []
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b"{" * 100, "more_body": True}
        await asyncio.sleep(3600)  # the client sends nothing more
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    start = time.perf_counter()
    asyncio.run(app(scope, receive, send))
    assert time.perf_counter() - start < 2
    reply = Reply(sent)
    assert reply.status == 408 and reply.headers["connection"] == "close"
    assert "0.2 seconds" in reply.json()["error"]
    # The same through the other routes' body reader, and when nothing came at all.
    sent.clear()
    first = False
    scope = {**scope, "path": "/v2/repository/index"}
    asyncio.run(create_http_app(StatsServer(), body_timeout=0.2)(scope, receive, send))
    assert Reply(sent).status == 408


def test_large_bodies_decode_and_encode_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.frontends.http import app as http_module

    threads: list[str] = []
    real_decode, real_encode = (
        http_module.decode_infer_request,
        http_module.encode_infer_response_parts,
    )

    def decode(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_decode(*args)

    def encode(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_encode(*args)

    monkeypatch.setattr(http_module, "decode_infer_request", decode)
    monkeypatch.setattr(http_module, "encode_infer_response_parts", encode)
    app = create_http_app(FakeServer())
    small, json_size = client_request({"IN": SAMPLES["FP32"]}, True)
    headers = {"Inference-Header-Content-Length": str(json_size)}
    assert call(app, "POST", "/v2/models/echo/infer", small, headers).status == 200
    assert threads == ["MainThread", "MainThread"]
    threads.clear()
    big = np.arange(1 << 19, dtype=np.float32)  # 2 MiB
    body, json_size = client_request(
        {"IN": big}, True, outputs=[triton_http.InferRequestedOutput("IN", binary_data=True)]
    )
    headers = {"Inference-Header-Content-Length": str(json_size)}
    reply = call(app, "POST", "/v2/models/echo/infer", body, headers)
    assert reply.status == 200
    result = parse(reply.body, int(reply.headers["inference-header-content-length"]))
    np.testing.assert_array_equal(result.as_numpy("IN"), big)
    assert all(name.startswith("pdserve-codec") for name in threads), threads


def test_shared_memory_input_is_recorded_and_output_sent_without_data() -> None:
    doc = {
        "inputs": [
            {
                "name": "X",
                "shape": [2],
                "datatype": "FP32",
                "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8},
            }
        ],
        "outputs": [
            {
                "name": "Y",
                "parameters": {"shared_memory_region": "o", "shared_memory_byte_size": 8},
            },
            {"name": "Z", "parameters": {"binary_data": False}},
        ],
    }
    req = decode_infer_request(orjson.dumps(doc), None, "m", "", 0)
    assert req.shm_inputs is not None and req.shm_inputs["X"].region == "r"
    resp = InferResponse(
        "m", "1", outputs={"Y": np.ones(2, np.float32), "Z": np.zeros(2, np.float32)}
    )
    body, header_length = encode_infer_response(resp, req)
    assert header_length is None
    out = orjson.loads(body)["outputs"]
    assert out[0] == {"name": "Y", "datatype": "FP32", "shape": [2]}
    assert out[1]["data"] == [0.0, 0.0]
    bad_input = {
        "name": "X",
        "shape": [2],
        "datatype": "FP32",
        "data": [1, 2],
        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8},
    }
    bad = orjson.dumps({"inputs": [bad_input]})
    with pytest.raises(InferError, match="both 'data' and 'shared_memory_region'"):
        decode_infer_request(bad, None, "m", "", 0)
