"""Unit tests: ``pdserve perf`` input data and request bytes (pdserve.app.perf.inputs).

Encoded requests are decoded back with pdserve's own HTTP and gRPC codecs.
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from pdserve.app.perf.inputs import (
    HttpRequest,
    ModelSpec,
    TensorSpec,
    build_requests,
    encode_grpc,
    encode_http,
    load_input_file,
    make_batches,
    make_rows,
    resolve_dims,
)
from pdserve.app.perf.options import PerfError, PerfOptions
from pdserve.frontends.grpc.codec import decode_infer_request as decode_grpc
from pdserve.frontends.http.decode import decode_infer_request as decode_http


def _spec(mbs: int = 8) -> ModelSpec:
    return ModelSpec(
        name="m",
        version="",
        max_batch_size=mbs,
        inputs=[TensorSpec("A", "FP32", [2, 2]), TensorSpec("S", "BYTES", [-1])],
        outputs=["OUT"],
    )


def _write(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "data.json"
    path.write_text(json.dumps(doc))
    return path


def test_spec_from_metadata_and_config() -> None:
    meta = {
        "name": "m",
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": "X", "datatype": "INT64", "shape": [-1, 3, "-1"]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 3]}],
    }
    s = ModelSpec.from_metadata(meta, {"max_batch_size": 4})
    assert s.max_batch_size == 4 and s.inputs[0].dims == [3, -1] and s.outputs == ["Y"]
    # No configuration endpoint (KServe, MLServer): a leading -1 is taken as the batch dim.
    assert ModelSpec.from_metadata(meta, None).max_batch_size == -1
    assert ModelSpec.from_metadata(meta, {"max_batch_size": 0}).inputs[0].dims == [-1, 3, -1]
    with pytest.raises(PerfError, match="no inputs"):
        ModelSpec.from_metadata({"name": "m", "inputs": []}, None)
    with pytest.raises(PerfError, match="datatype 'BF16'"):
        ModelSpec.from_metadata(
            {"name": "m", "inputs": [{"name": "X", "datatype": "BF16", "shape": [1]}]}, None
        )


def test_resolve_dims() -> None:
    assert resolve_dims(_spec(), {"S": [5]}) == {"A": [2, 2], "S": [5]}
    with pytest.raises(PerfError, match="does not have"):
        resolve_dims(_spec(), {"B": [1]})
    with pytest.raises(PerfError, match="has 2 dims"):
        resolve_dims(_spec(), {"S": [1, 2]})
    with pytest.raises(PerfError, match="changes a fixed dim"):
        resolve_dims(_spec(), {"A": [2, 3]})


def test_random_and_zero_rows() -> None:
    with pytest.raises(PerfError, match="--shape S:1"):
        make_rows(PerfOptions(model="m"), _spec())
    rows = make_rows(PerfOptions(model="m", shapes={"S": [3]}, string_length=5), _spec())
    assert len(rows) == 1
    a, s = rows[0]["A"], rows[0]["S"]
    assert a.shape == (2, 2) and a.dtype == np.float32 and 0 <= a.min() and a.max() < 1
    assert s.shape == (3,) and all(len(x) == 5 and x.isalpha() for x in s)
    zero = make_rows(PerfOptions(model="m", input_data="zero", shapes={"S": [1]}), _spec())[0]
    assert not zero["A"].any() and zero["S"][0] == b"0" * 128
    # The same seed gives the same data.
    again = make_rows(PerfOptions(model="m", shapes={"S": [3]}, string_length=5), _spec())
    assert np.array_equal(again[0]["A"], a)


def test_input_file_forms(tmp_path: Path) -> None:
    raw = np.arange(4, dtype="<f4").tobytes()
    strings = struct.pack("<I", 2) + b"hi" + struct.pack("<I", 3) + b"yo!"
    doc = {
        "data": [
            {"A": [1, 2, 3, 4], "S": ["x"]},
            {"A": [[1, 2], [3, 4]], "S": {"content": ["a", "b"], "shape": [2]}},
            {"A": {"b64": base64.b64encode(raw).decode()}, "S": {"content": {"b64": base64.b64encode(strings).decode()}, "shape": [2]}},
        ],
        "validation_data": [{"OUT": [0]}],
    }  # fmt: skip
    rows = load_input_file(_write(tmp_path, doc), _spec(), {"A": [2, 2], "S": [1]})
    assert len(rows) == 3
    assert rows[0]["A"].tolist() == [[1, 2], [3, 4]] and rows[0]["S"].tolist() == [b"x"]
    assert rows[1]["S"].tolist() == [b"a", b"b"]
    assert rows[2]["A"].tolist() == [[0, 1], [2, 3]]
    assert rows[2]["S"].tolist() == [b"hi", b"yo!"]
    # One variable dim without a shape: the number of values gives it.
    rows = load_input_file(
        _write(tmp_path, {"data": [{"A": [0] * 4, "S": ["a", "b", "c"]}]}),
        _spec(),
        {"A": [2, 2], "S": [-1]},
    )
    assert rows[0]["S"].shape == (3,)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"nodata": []}, 'expected {"data"'),
        ({"data": []}, 'expected {"data"'),
        ({"data": [[{"A": [1]}]]}, "sequence streams"),
        ({"data": [5]}, r"data\[0\] is not an object"),
        ({"data": [{"A": [1, 2, 3, 4]}]}, r"data\[0\] has no value for input\(s\) S"),
        ({"data": [{"A": [1, 2, 3, 4], "S": ["x"], "Z": [1]}]}, "names Z, not inputs"),
        (
            {"data": [{"A": [1, 2, 3], "S": ["x"]}]},
            r"data\[0\]\.A: 3 values; shape \[2, 2\] needs 4",
        ),
        ({"data": [{"A": ["x", 2, 3, 4], "S": ["x"]}]}, "values are not FP32"),
        ({"data": [{"A": {"b64": "AAAA"}, "S": ["x"]}]}, "b64 content has 3 bytes"),
        ({"data": [{"A": {"b64": "!!"}, "S": ["x"]}]}, "not valid base64"),
        ({"data": [{"A": {"shape": [4]}, "S": ["x"]}]}, "needs 'content' or 'b64'"),
        ({"data": [{"A": {"content": [1] * 4, "shape": [-1, -1]}, "S": ["x"]}]}, "variable dims"),
        ({"data": [{"A": {"content": [1] * 3, "shape": [-1, 2]}, "S": ["x"]}]}, "do not fill"),
    ],
)
def test_input_file_errors(tmp_path: Path, doc: object, message: str) -> None:
    with pytest.raises(PerfError, match=message):
        load_input_file(_write(tmp_path, doc), _spec(), {"A": [2, 2], "S": [-1]})


def test_input_file_unreadable(tmp_path: Path) -> None:
    with pytest.raises(PerfError, match="cannot read input data file"):
        load_input_file(tmp_path / "missing.json", _spec(), {"A": [2, 2], "S": [1]})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PerfError, match="is not JSON"):
        load_input_file(bad, _spec(), {"A": [2, 2], "S": [1]})


def test_batches_take_consecutive_rows() -> None:
    rows = [
        {"A": np.full((2, 2), i, np.float32), "S": np.array([b"%d" % i], dtype=object)}
        for i in range(3)
    ]
    batches = make_batches(rows, _spec(), 2)
    # 3 rows, batch 2: requests cycle through rows 0,1 / 2,0 / 1,2.
    assert len(batches) == 3
    assert [b["A"][:, 0, 0].tolist() for b in batches] == [[0, 1], [2, 0], [1, 2]]
    assert batches[0]["S"].shape == (2, 1)
    with pytest.raises(PerfError, match="exceeds model 'm' max_batch_size 8"):
        make_batches(rows, _spec(), 9)
    with pytest.raises(PerfError, match="does not batch"):
        make_batches(rows, _spec(0), 2)
    assert make_batches(rows, _spec(0), 1)[0]["A"].shape == (2, 2)  # no batch dim
    ragged = [rows[0], {"A": rows[1]["A"], "S": np.array([b"a", b"b"], dtype=object)}]
    with pytest.raises(PerfError, match="different shapes"):
        make_batches(ragged, _spec(), 2)


def test_http_binary_round_trip() -> None:
    tensors = {
        "A": np.arange(8, dtype=np.float32).reshape(2, 2, 2),
        "S": np.array([[b"ab"], [b"\xff"]], dtype=object),
    }
    req = encode_http(_spec(), tensors, "3", "binary", "binary")
    assert req.path == "/v2/models/m/versions/3/infer"
    header_len = int(req.headers["Inference-Header-Content-Length"])
    decoded = decode_http(req.body, header_len, "m", "3")
    assert np.array_equal(decoded.inputs["A"], tensors["A"])
    assert decoded.inputs["S"].tolist() == [[b"ab"], [b"\xff"]]
    assert decoded.parameters == {"binary_data_output": True}
    wire = req.wire("h:1")
    head, _, body = wire.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v2/models/m/versions/3/infer HTTP/1.1\r\nHost: h:1\r\n")
    assert f"Content-Length: {len(req.body)}".encode() in head and body == req.body


def test_http_json_round_trip() -> None:
    tensors = {"A": np.ones((1, 2, 2), np.float32), "S": np.array([[b"hi"]], dtype=object)}
    req = encode_http(_spec(), tensors, "", "json", "json")
    assert req.headers == {"Content-Type": "application/json"}
    decoded = decode_http(req.body, None, "m")
    assert decoded.inputs["A"].tolist() == [[[1, 1], [1, 1]]] and decoded.inputs["S"].tolist() == [
        [b"hi"]
    ]
    assert "parameters" not in json.loads(req.body)
    with pytest.raises(PerfError, match="not UTF-8"):
        encode_http(
            _spec(), {**tensors, "S": np.array([[b"\xff"]], dtype=object)}, "", "json", "json"
        )


def test_grpc_round_trip() -> None:
    tensors = {
        "A": np.arange(4, dtype=np.float32).reshape(1, 2, 2),
        "S": np.array([[b"x"]], dtype=object),
    }
    msg = service_pb2.ModelInferRequest.FromString(encode_grpc(_spec(), tensors, "2"))
    assert (msg.model_name, msg.model_version) == ("m", "2")
    decoded = decode_grpc(msg, 0)
    assert np.array_equal(decoded.inputs["A"], tensors["A"]) and decoded.inputs["S"].tolist() == [
        [b"x"]
    ]


def test_build_requests(tmp_path: Path) -> None:
    path = _write(tmp_path, {"data": [{"A": [i] * 4, "S": ["s"]} for i in range(4)]})
    opts = PerfOptions(model="m", input_data=str(path), batch_size=2)
    reqs = build_requests(opts, _spec())
    assert len(reqs) == 2 and all(isinstance(r, HttpRequest) for r in reqs)
    opts.protocol = "grpc"
    assert all(isinstance(r, bytes) for r in build_requests(opts, _spec()))
