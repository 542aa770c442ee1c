"""Property-based fuzzing of the request decoders: the V2 REST JSON decoder, its binary
tensor data extension, and the gRPC ``ModelInferRequest`` decoder
(pdserve.frontends.http.decode / pdserve.frontends.grpc.codec).

Whatever the input, a decoder either returns a request whose every input has exactly
the declared shape and the datatype's dtype, or raises InferError with a client error
code (never INTERNAL, which is a 500, and never any other exception). Inputs mix
well-formed tensors, small corruptions of them, and arbitrary JSON / bytes / protobuf
fields. Examples are bounded and derandomized: the run takes seconds and is the same
every time.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, given, settings
from tritonclient.grpc import service_pb2

from pdserve.core.datatypes import V2_TO_NUMPY
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferRequest
from pdserve.frontends.grpc import codec as grpc_codec
from pdserve.frontends.http import decode as http_codec

#: Examples per test; PDSERVE_FUZZ_EXAMPLES=5000 for a longer run.
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "250"))

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

DATATYPES = list(V2_TO_NUMPY)


def mostly(valid: st.SearchStrategy[Any], *invalid: st.SearchStrategy[Any]) -> Any:
    """``valid`` four times in five, else one of ``invalid``."""
    return st.integers(0, 4).flatmap(lambda i: st.one_of(*invalid) if i == 4 else valid)


#: True about once in 20 draws (not at an end of the range, which hypothesis favours).
RARELY = st.integers(0, 19).map(lambda i: i == 10)

#: Datatype strings: the real ones, near misses and junk.
datatype_strings = mostly(
    st.sampled_from(DATATYPES),
    st.sampled_from(["fp32", "FP8", "BF16", "STRING", "", "INT128", "BYTES "]),
    st.text(max_size=8),
)
#: Shapes: small valid ones mostly, then negative, huge, and many-dimensional ones.
shapes = mostly(
    st.lists(st.integers(0, 3), max_size=3),
    st.lists(st.integers(-3, 3), max_size=4),
    st.lists(st.sampled_from([0, 1, 2**31, 2**40, 2**59, 2**63 - 1]), max_size=3),
    st.lists(st.just(1), min_size=60, max_size=70),
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _element(datatype: str) -> st.SearchStrategy[Any]:
    """One JSON element of ``datatype`` (mostly in range, sometimes not)."""
    if datatype == "BOOL":
        return st.booleans()
    if datatype == "BYTES":
        return st.text(max_size=5)
    if datatype.startswith("FP"):
        return st.one_of(st.floats(width=32, allow_nan=False), st.integers(-1000, 1000))
    info = np.iinfo(V2_TO_NUMPY[datatype])
    return st.integers(int(info.min) - 2, int(info.max) + 2)


def _nest(flat: list[Any], shape: list[int]) -> Any:
    """``flat`` as nested lists of ``shape`` (row-major)."""
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


@st.composite
def json_tensors(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed JSON input, sometimes corrupted in one field."""
    datatype = draw(st.sampled_from(DATATYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    count = int(np.prod(shape)) if shape else 1
    flat = draw(st.lists(_element(datatype), min_size=count, max_size=count))
    tensor: dict[str, Any] = {
        "name": draw(st.sampled_from(["x", "y", "IN"])),
        "datatype": datatype,
        "shape": shape,
        "data": _nest(flat, shape) if draw(st.booleans()) else flat,
    }
    corruption = draw(st.sampled_from(["none"] * 7 + ["drop", "replace", "extra"]))
    key = draw(st.sampled_from(["name", "datatype", "shape", "data", "parameters"]))
    if corruption == "drop":
        tensor.pop(key, None)
    elif corruption == "replace":
        tensor[key] = draw(json_values)
    elif corruption == "extra":
        tensor["data"] = flat + draw(st.lists(json_scalars, min_size=1, max_size=3))
    return tensor


requested_outputs = st.lists(
    mostly(
        st.fixed_dictionaries(
            {"name": st.text(max_size=4)},
            optional={
                "parameters": mostly(
                    st.fixed_dictionaries(
                        {},
                        optional={
                            "binary_data": mostly(st.booleans(), json_scalars),
                            "classification": mostly(
                                st.integers(0, 5), st.integers(-2, -1), json_scalars
                            ),
                            "shared_memory_region": st.text(max_size=3),
                        },
                    ),
                    json_values,
                )
            },
        ),
        json_values,
    ),
    max_size=3,
)


@st.composite
def json_requests(draw: st.DrawFn) -> Any:
    tensors = st.lists(json_tensors(), max_size=3, unique_by=lambda t: str(t.get("name")))
    doc: dict[str, Any] = {"inputs": draw(mostly(tensors, json_values))}
    if draw(st.booleans()):
        doc["id"] = draw(mostly(st.text(max_size=4), json_values))
    if draw(st.booleans()):
        doc["parameters"] = draw(
            mostly(
                st.dictionaries(
                    st.sampled_from(["binary_data_output", "priority", "timeout", "x"]),
                    json_scalars,
                    max_size=3,
                ),
                json_values,
            )
        )
    if draw(st.booleans()):
        doc["outputs"] = draw(mostly(requested_outputs, json_values))
    return draw(json_values) if draw(RARELY) else doc


def _binary(datatype: str, count: int, draw: st.DrawFn) -> bytes:
    """``count`` elements of ``datatype`` as binary tensor data."""
    if datatype == "BYTES":
        items = draw(st.lists(st.binary(max_size=4), min_size=count, max_size=count))
        return b"".join(struct.pack("<I", len(b)) + b for b in items)
    size = np.dtype(V2_TO_NUMPY[datatype]).itemsize * count
    return draw(st.binary(min_size=size, max_size=size))


@st.composite
def binary_requests(draw: st.DrawFn) -> tuple[bytes, int | None]:
    """A body with binary tensor data and its ``Inference-Header-Content-Length``."""
    inputs = []
    blobs = []
    names = mostly(
        st.lists(st.sampled_from(["a", "b", "c"]), max_size=3, unique=True),
        st.lists(st.sampled_from(["a", "b"]), max_size=3),
    )
    for name in draw(names):
        datatype = draw(st.sampled_from(DATATYPES))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        count = int(np.prod(shape)) if shape else 1
        blob = _binary(datatype, count, draw)
        declared: Any = len(blob)
        match draw(st.sampled_from(["exact"] * 7 + ["size", "type", "blob"])):
            case "size":
                declared = draw(st.one_of(st.integers(-2, 2**40), json_scalars))
            case "type":
                datatype = draw(datatype_strings)
            case "blob":
                blob = draw(st.binary(max_size=40))
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatype,
            "shape": shape,
            "parameters": {"binary_data_size": declared},
        }
        if draw(RARELY):
            entry["data"] = [1]
        inputs.append(entry)
        blobs.append(blob)
    header = json.dumps({"inputs": inputs}).encode()
    body = header + b"".join(blobs) + draw(mostly(st.just(b""), st.sampled_from([b"\0", b"junk"])))
    header_length = draw(mostly(st.just(len(header)), st.none(), st.integers(-1, len(body) + 2)))
    return body, header_length


def _check(request: InferRequest, declared: dict[str, tuple[str, list[int]]]) -> None:
    """What a decoded request must be: every declared input, with its declared shape and
    its datatype's dtype (BYTES: an object array of ``bytes``)."""
    assert isinstance(request, InferRequest)
    assert set(request.inputs) == set(declared)
    for name, arr in request.inputs.items():
        datatype, shape = declared[name]
        assert isinstance(arr, np.ndarray), name
        assert list(arr.shape) == shape, (name, arr.shape, shape)
        assert arr.dtype == V2_TO_NUMPY[datatype], (name, arr.dtype, datatype)
        if arr.dtype == object:
            assert all(type(item) is bytes for item in arr.reshape(-1).tolist())


def _refused(exc: InferError) -> None:
    """A refusal must be the client's error, with a message."""
    assert exc.code is ErrorCode.INVALID_ARG, (exc.code, exc.message)
    assert exc.message


def _decode_http(body: bytes, header_length: int | None) -> None:
    try:
        request = http_codec.decode_infer_request(body, header_length, "m")
    except InferError as exc:
        _refused(exc)
        return
    doc = json.loads(body[:header_length] if header_length is not None else body)
    _check(request, {t["name"]: (t["datatype"], t["shape"]) for t in doc["inputs"]})


@FUZZ
@given(doc=json_requests())
def test_http_json_decoder(doc: Any) -> None:
    _decode_http(json.dumps(doc).encode(), None)


@FUZZ
@given(body=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)))
def test_http_decoder_on_arbitrary_bytes(body: bytes) -> None:
    _decode_http(body, None)


@FUZZ
@given(request=binary_requests())
def test_http_binary_extension_decoder(request: tuple[bytes, int | None]) -> None:
    _decode_http(*request)


@st.composite
def grpc_requests(draw: st.DrawFn) -> service_pb2.ModelInferRequest:
    msg = service_pb2.ModelInferRequest(
        model_name=draw(st.text(max_size=4)), id=draw(st.text(max_size=4))
    )
    use_raw = draw(st.booleans())
    names = mostly(
        st.lists(st.sampled_from(["a", "b", "c"]), max_size=3, unique=True),
        st.lists(st.sampled_from(["a", "b"]), max_size=3),
    )
    for name in draw(names):
        tensor = msg.inputs.add(name=name, datatype=draw(datatype_strings))
        shape = draw(shapes)
        tensor.shape.extend(shape)
        datatype = tensor.datatype
        count = int(np.prod(shape)) if shape and all(0 <= d < 8 for d in shape) else 2
        if use_raw:
            if datatype in V2_TO_NUMPY and not draw(RARELY):
                msg.raw_input_contents.append(_binary(datatype, count, draw))
            else:
                msg.raw_input_contents.append(draw(st.binary(max_size=32)))
            if draw(RARELY):
                tensor.contents.int_contents.append(1)
        else:
            field = grpc_codec._CONTENTS_FIELD.get(datatype) or draw(
                st.sampled_from(sorted(set(grpc_codec._CONTENTS_FIELD.values())))
            )
            n = draw(st.sampled_from([count] * 8 + [count + 1, max(count - 1, 0)]))
            values: Any
            if field == "bool_contents":
                values = draw(st.lists(st.booleans(), min_size=n, max_size=n))
            elif field == "bytes_contents":
                values = draw(st.lists(st.binary(max_size=4), min_size=n, max_size=n))
            elif field in ("fp32_contents", "fp64_contents"):
                values = draw(st.lists(st.floats(width=32), min_size=n, max_size=n))
            elif field == "int_contents":
                values = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n))
            elif field == "uint_contents":
                values = draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n))
            elif field == "int64_contents":
                values = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n))
            else:
                values = draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n))
            getattr(tensor.contents, field).extend(values)
        if draw(RARELY):
            tensor.parameters["shared_memory_region"].string_param = "r"
    if use_raw and draw(RARELY):
        msg.raw_input_contents.append(b"extra")
    for name in draw(st.lists(st.text(max_size=3), max_size=2)):
        out = msg.outputs.add(name=name)
        kind = draw(
            st.sampled_from(["none"] * 4 + ["int"] * 4 + ["bool", "string", "double", "shm"])
        )
        p = out.parameters["classification" if kind != "shm" else "shared_memory_region"]
        if kind in ("int", "shm"):
            p.int64_param = draw(st.integers(0 if kind == "int" else -3, 5))
        elif kind == "bool":
            p.bool_param = draw(st.booleans())
        elif kind == "string":
            p.string_param = draw(st.text(max_size=3))
        elif kind == "double":
            p.double_param = draw(st.floats())
    for key in draw(st.lists(st.sampled_from(["priority", "timeout", "x"]), max_size=2)):
        msg.parameters[key].int64_param = draw(st.integers(-5, 2**40))
    return msg


def _decode_grpc(msg: service_pb2.ModelInferRequest) -> None:
    try:
        request = grpc_codec.decode_infer_request(msg, 0)
    except InferError as exc:
        _refused(exc)
        return
    _check(request, {t.name: (t.datatype, list(t.shape)) for t in msg.inputs})


@FUZZ
@given(msg=grpc_requests())
def test_grpc_decoder(msg: service_pb2.ModelInferRequest) -> None:
    _decode_grpc(msg)


@FUZZ
@given(data=st.binary(max_size=96))
def test_grpc_decoder_on_arbitrary_wire_bytes(data: bytes) -> None:
    msg = service_pb2.ModelInferRequest()
    try:
        msg.ParseFromString(data)
    except Exception:  # noqa: BLE001 - not a message: grpc refuses it before pdserve sees it
        return
    _decode_grpc(msg)
