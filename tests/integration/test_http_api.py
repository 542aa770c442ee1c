"""V2 HTTP API against a real pdserve serving the example repository (issue 2)."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request
import zlib

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess


def _post(server: ServerProcess, path: str, body: bytes, headers: dict[str, str] | None = None):
    """POST raw bytes; return (status, parsed JSON or raw bytes)."""
    req = urllib.request.Request(
        f"http://{server.http_url}{path}", data=body, headers=headers or {}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, data = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data


def _get(server: ServerProcess, path: str):
    try:
        with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def client(example_server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(example_server.http_url)


def _tiny_expected(x: np.ndarray, version: int = 2) -> np.ndarray:
    from tests.goldens import tiny_reference

    return tiny_reference(x, version)


# -- health and metadata -------------------------------------------------------------


def test_health(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("tiny")
    assert client.is_model_ready("efficientnet_lite0")
    assert not client.is_model_ready("no_such_model")


def test_server_metadata(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_server_metadata()
    assert meta["name"] == "pdserve"
    assert "binary_tensor_data" in meta["extensions"]
    assert "classification" in meta["extensions"]


def test_model_metadata(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("efficientnet_lite0")
    assert meta["name"] == "efficientnet_lite0"
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 1000]}]
    assert meta["versions"] == ["1"]


def test_model_config(client: httpclient.InferenceServerClient) -> None:
    cfg = client.get_model_config("efficientnet_lite0")
    assert cfg["name"] == "efficientnet_lite0"
    assert cfg["max_batch_size"] == 32
    assert cfg["input"][0]["dims"] == [3, 224, 224]
    assert cfg["output"][0]["label_filename"] == "labels.txt"


def test_autocomplete_config(client: httpclient.InferenceServerClient) -> None:
    """A folder holding only 1/model.onnx is served with a config built from the graph."""
    cfg = client.get_model_config("tiny_autocomplete")
    assert cfg["platform"] == "onnxruntime_onnx"
    assert cfg["backend"] == "onnxruntime"
    assert cfg["max_batch_size"] > 0
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == [
        ("INPUT0", "TYPE_FP32", [64])
    ]
    assert [(o["name"], o["data_type"], o["dims"]) for o in cfg["output"]] == [
        ("OUTPUT0", "TYPE_FP32", [64])
    ]
    x = np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64)
    inp = httpclient.InferInput("INPUT0", [2, 64], "FP32")
    inp.set_data_from_numpy(x)
    out = client.infer("tiny_autocomplete", [inp]).as_numpy("OUTPUT0")
    np.testing.assert_allclose(out, _tiny_expected(x, 1), rtol=1e-5, atol=1e-5)


# -- inference -----------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True])
def test_tiny_json_and_binary(client: httpclient.InferenceServerClient, binary: bool) -> None:
    x = np.random.default_rng(1).standard_normal((3, 64), dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [3, 64], "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
    result = client.infer("tiny", [inp], outputs=[out], request_id="req-42")
    assert result.get_response()["id"] == "req-42"
    assert result.get_response()["model_version"] == "2"
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), _tiny_expected(x), rtol=1e-5, atol=1e-5)


def test_nested_json_data(example_server: ServerProcess) -> None:
    x = np.arange(128, dtype=np.float32).reshape(2, 64) / 100
    body = {
        "inputs": [{"name": "INPUT0", "shape": [2, 64], "datatype": "FP32", "data": x.tolist()}]
    }
    status, resp = _post(example_server, "/v2/models/tiny/infer", json.dumps(body).encode())
    assert status == 200, resp
    out = np.array(resp["outputs"][0]["data"], dtype=np.float32).reshape(
        resp["outputs"][0]["shape"]
    )
    np.testing.assert_allclose(out, _tiny_expected(x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_request_body(example_server: ServerProcess, encoding: str) -> None:
    x = np.ones((1, 64), dtype=np.float32)
    body = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": x.ravel().tolist()}
            ]
        }
    ).encode()
    packed = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
    status, resp = _post(
        example_server, "/v2/models/tiny/infer", packed, {"Content-Encoding": encoding}
    )
    assert status == 200, resp
    np.testing.assert_allclose(
        np.array(resp["outputs"][0]["data"], dtype=np.float32).reshape(1, 64),
        _tiny_expected(x),
        rtol=1e-5,
        atol=1e-4,
    )


def test_request_parameters_and_output_subset(client: httpclient.InferenceServerClient) -> None:
    from tests.goldens import load_digits_golden

    g = load_digits_golden()
    x = g["X_test"][:4].astype(np.float32)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    result = client.infer(
        "digits",
        [inp],
        outputs=[httpclient.InferRequestedOutput("probabilities", binary_data=True)],
        parameters={"note": "hello"},
    )
    names = [o["name"] for o in result.get_response()["outputs"]]
    assert names == ["probabilities"]
    np.testing.assert_allclose(result.as_numpy("probabilities"), g["probabilities"][:4], atol=1e-4)


def test_digits_accuracy(client: httpclient.InferenceServerClient) -> None:
    from tests.goldens import load_digits_golden

    g = load_digits_golden()
    X, y = g["X_test"].astype(np.float32), g["y_test"]
    preds = []
    for start in range(0, len(X), 32):
        chunk = X[start : start + 32]
        inp = httpclient.InferInput("input", list(chunk.shape), "FP32")
        inp.set_data_from_numpy(chunk, binary_data=True)
        res = client.infer("digits", [inp])
        preds.append(res.as_numpy("label").reshape(-1))
    accuracy = float((np.concatenate(preds) == y).mean())
    assert accuracy >= 0.95


def test_efficientnet_real_photos_top1(client: httpclient.InferenceServerClient) -> None:
    """Real photos preprocessed client-side: top-1 through the server equals PyTorch's."""
    from tests.goldens import load_efficientnet_goldens

    goldens = load_efficientnet_goldens()
    assert len(goldens) >= 4
    for name, g in goldens.items():
        x = g["input"][None].astype(np.float32)
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        logits = client.infer("efficientnet_lite0", [inp]).as_numpy("logits")
        assert logits.shape == (1, 1000)
        assert int(np.argmax(logits[0])) == int(g["top1"]), name
        np.testing.assert_allclose(logits[0], g["logits"], atol=1e-3)


def test_efficientnet_batch_and_classification(client: httpclient.InferenceServerClient) -> None:
    from tests.goldens import load_efficientnet_goldens, load_labels

    goldens = load_efficientnet_goldens()
    labels = load_labels()
    names = sorted(goldens)
    x = np.stack([goldens[n]["input"] for n in names]).astype(np.float32)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    out = httpclient.InferRequestedOutput("logits", binary_data=False, class_count=3)
    top = client.infer("efficientnet_lite0", [inp], outputs=[out]).as_numpy("logits")
    assert top.shape == (len(names), 3)
    for row, n in zip(top, names, strict=True):
        first = row[0].decode() if isinstance(row[0], bytes) else row[0]  # JSON gives str
        score, index, label = first.split(":", 2)
        assert int(index) == int(goldens[n]["top1"])
        assert label == labels[int(index)]
        assert abs(float(score) - float(goldens[n]["logits"][int(index)])) < 1e-3


def test_every_datatype(client: httpclient.InferenceServerClient) -> None:
    """Every V2 datatype a model can use round-trips through an Identity model."""
    meta = client.get_model_metadata("tiny_dtypes")
    in_names = {i["name"]: i["datatype"] for i in meta["inputs"]}
    rng = np.random.default_rng(0)
    for binary in (False, True):
        inputs, outputs, expected = [], [], {}
        for name, dt in in_names.items():
            shape = [2, 3]
            if dt == "BYTES":
                arr = np.array(
                    [[b"a", "\u00e9t\u00e9".encode(), b""], [b"x y", b"12", b"z"]], dtype=object
                )
            elif dt == "BOOL":
                arr = rng.integers(0, 2, shape).astype(bool)
            elif dt.startswith("FP"):
                arr = rng.standard_normal(shape).astype(
                    {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}[dt]
                )
            else:
                np_dt = np.dtype(dt.lower())
                info = np.iinfo(np_dt)
                arr = np.array([[info.min, 0, info.max], [1, 2, 3]], dtype=np_dt)
            inp = httpclient.InferInput(name, shape, dt)
            inp.set_data_from_numpy(arr, binary_data=binary)
            inputs.append(inp)
            out_name = "OUT_" + name.removeprefix("IN_")
            outputs.append(httpclient.InferRequestedOutput(out_name, binary_data=binary))
            expected[out_name] = arr
        result = client.infer("tiny_dtypes", inputs, outputs=outputs)
        for out_name, arr in expected.items():
            got = result.as_numpy(out_name)
            assert got.shape == arr.shape, out_name
            if arr.dtype == object:
                as_bytes = [
                    [v if isinstance(v, bytes) else v.encode() for v in r] for r in got.tolist()
                ]
                assert as_bytes == arr.tolist(), out_name
            else:
                assert got.dtype == arr.dtype, out_name
                np.testing.assert_array_equal(got, arr, err_msg=out_name)


# -- version policies ----------------------------------------------------------------


FLOAT_DTYPES = {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}


def test_nonfinite_floats_give_the_same_values_in_json_and_binary(
    client: httpclient.InferenceServerClient,
) -> None:
    """NaN and +/-inf travel as Triton sends them: ``NaN`` / ``Infinity`` tokens in JSON
    (both ways), raw IEEE values in binary; tritonclient reads the same arrays."""
    meta = client.get_model_metadata("tiny_dtypes")
    values = [np.nan, np.inf, -np.inf, 0.5, -0.0, 2.0]
    results = {}
    for binary_in, binary_out in ((False, False), (True, True), (False, True), (True, False)):
        inputs, outputs = [], []
        for spec in meta["inputs"]:
            dt = spec["datatype"]
            if dt == "BYTES":
                arr = np.array([[b"x"] * 6], dtype=object)
            elif dt.startswith("FP"):
                arr = np.array([values], dtype=FLOAT_DTYPES[dt])
            else:
                arr = np.zeros((1, 6), dtype=bool if dt == "BOOL" else dt.lower())
            inp = httpclient.InferInput(spec["name"], [1, 6], dt)
            inp.set_data_from_numpy(arr, binary_data=binary_in)
            inputs.append(inp)
            out = "OUT_" + spec["name"].removeprefix("IN_")
            outputs.append(httpclient.InferRequestedOutput(out, binary_data=binary_out))
        result = client.infer("tiny_dtypes", inputs, outputs=outputs)
        for dt, np_dt in FLOAT_DTYPES.items():
            got = result.as_numpy(f"OUT_{dt}").astype(np_dt)
            expected = np.array([values], dtype=np_dt)
            assert got.shape == (1, 6)
            assert np.array_equal(got, expected, equal_nan=True), (binary_in, binary_out, dt)
            assert np.signbit(got[0, 4])  # -0.0 kept
            results[(binary_in, binary_out, dt)] = got
    assert len(results) == 12  # every combination was checked


def test_metadata_for_one_version_lists_that_version(
    client: httpclient.InferenceServerClient,
) -> None:
    assert client.get_model_metadata("tiny_all_versions")["versions"] == ["1", "2", "3"]
    for v in ("1", "3"):
        assert client.get_model_metadata("tiny_all_versions", v)["versions"] == [v]


def test_repository_index_has_no_reason_for_ready_models(
    client: httpclient.InferenceServerClient,
) -> None:
    index = client.get_model_repository_index()
    ready = [row for row in index if row.get("state") == "READY"]
    assert {"tiny", "tiny_dtypes", "efficientnet_lite0"} <= {row["name"] for row in ready}
    for row in ready:
        # memory_bytes / memory_source: pdserve's addition (issue 16), not a reason
        assert set(row) == {"name", "version", "state", "memory_bytes", "memory_source"}, row


def test_missing_inputs_are_all_named(client: httpclient.InferenceServerClient) -> None:
    inp = httpclient.InferInput("IN_BOOL", [1, 1], "BOOL")
    inp.set_data_from_numpy(np.array([[True]]))
    with pytest.raises(InferenceServerException) as e:
        client.infer("tiny_dtypes", [inp])
    names = [spec["name"] for spec in client.get_model_metadata("tiny_dtypes")["inputs"]]
    missing = "[" + ",".join(f"'{n}'" for n in names if n != "IN_BOOL") + "]"
    assert e.value.status() == "400"
    assert f"expected {len(names)} inputs but got 1 inputs for model 'tiny_dtypes'" in str(e.value)
    assert f"Got input(s) ['IN_BOOL'], but missing required input(s) {missing}" in str(e.value)


def test_version_policy_latest_default(client: httpclient.InferenceServerClient) -> None:
    assert client.is_model_ready("tiny", "2")
    assert not client.is_model_ready("tiny", "1")
    assert client.get_model_metadata("tiny")["versions"] == ["2"]


def test_version_policy_all_and_specific(client: httpclient.InferenceServerClient) -> None:
    assert client.get_model_metadata("tiny_all_versions")["versions"] == ["1", "2", "3"]
    assert client.get_model_metadata("tiny_specific")["versions"] == ["1", "3"]
    assert not client.is_model_ready("tiny_specific", "2")
    x = np.zeros((1, 64), dtype=np.float32)
    for model, versions in (("tiny_all_versions", [1, 2, 3]), ("tiny_specific", [1, 3])):
        for v in versions:
            inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            res = client.infer(model, [inp], model_version=str(v))
            assert res.get_response()["model_version"] == str(v)
            np.testing.assert_allclose(
                res.as_numpy("OUTPUT0"), np.full((1, 64), float(v)), atol=1e-5
            )
    with pytest.raises(InferenceServerException, match="version 2"):
        inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
        inp.set_data_from_numpy(x)
        client.infer("tiny_specific", [inp], model_version="2")


# -- bad input: clear errors, server keeps serving -------------------------------------

_GOOD = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [0.25] * 64}]}
).encode()


def _bad(
    name: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    path: str = "/v2/models/tiny/infer",
):
    return pytest.param(path, body, headers or {}, id=name)


def _case_bodies():
    good_json = {
        "inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [0.25] * 64}]
    }

    def with_(**kw):
        d = json.loads(json.dumps(good_json))
        d["inputs"][0].update(kw)
        return json.dumps(d).encode()

    binary_header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, 64],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 256},
                }
            ]
        }
    ).encode()
    return [
        (_bad("malformed-json", b'{"inputs": [ {"name": '), 400, "json"),
        (_bad("wrong-datatype", with_(datatype="INT32", data=[1] * 64)), 400, "INT32"),
        (_bad("unknown-datatype", with_(datatype="FP12")), 400, "FP12"),
        (_bad("shape-vs-data", with_(shape=[1, 63])), 400, "63"),
        (_bad("model-shape", with_(shape=[1, 32], data=[0.5] * 32)), 400, "shape"),
        (_bad("unknown-input", with_(name="NOPE")), 400, "NOPE"),
        (_bad("missing-input", b'{"inputs": []}'), 400, "INPUT0"),
        (_bad("unknown-model", _GOOD, path="/v2/models/nope/infer"), 404, "nope"),
        (_bad("unknown-version", _GOOD, path="/v2/models/tiny/versions/9/infer"), 404, "9"),
        (
            _bad(
                "binary-size-mismatch",
                binary_header + b"\0" * 100,
                {"Inference-Header-Content-Length": str(len(binary_header))},
            ),
            400,
            "binary",
        ),
        (
            _bad(
                "header-length-past-body",
                binary_header,
                {"Inference-Header-Content-Length": str(len(binary_header) + 50)},
            ),
            400,
            "",
        ),
        (_bad("bad-gzip", b"not gzip at all", {"Content-Encoding": "gzip"}), 400, ""),
        (
            _bad(
                "unknown-output",
                json.dumps(dict(good_json, outputs=[{"name": "NOPE_OUT"}])).encode(),
            ),
            400,
            "NOPE_OUT",
        ),
        (_bad("batch-over-max", with_(shape=[129, 64], data=[0.1] * 129 * 64)), 400, "128"),
        (_bad("fp32-out-of-range", with_(data=[1e39] * 64)), 400, "out of range for FP32"),
        (_bad("data-not-array", with_(shape=[], data=0.5)), 400, "'data' must be a JSON array"),
        (
            _bad(
                "bad-priority",
                json.dumps(dict(good_json, parameters={"priority": "high"})).encode(),
            ),
            400,
            "'priority' must be a non-negative integer",
        ),
        (
            _bad("param-object", json.dumps(dict(good_json, parameters={"k": {"a": 1}})).encode()),
            400,
            "parameter 'k' must be a string, number or boolean",
        ),
        (
            _bad(
                "reserved-param", json.dumps(dict(good_json, parameters={"triton_x": 1})).encode()
            ),
            400,
            "reserved",
        ),
        (
            _bad("empty-version", _GOOD, path="/v2/models/tiny/versions//infer"),
            400,
            "empty model version",
        ),
        (
            _bad("version-not-a-number", _GOOD, path="/v2/models/tiny/versions/v2/infer"),
            400,
            "not a number",
        ),
        (
            _bad(
                "version-too-long", _GOOD, path="/v2/models/tiny/versions/" + "9" * 5000 + "/infer"
            ),
            404,
            "not found",
        ),
    ]


@pytest.mark.parametrize(("case", "status", "needle"), _case_bodies())
def test_bad_input(example_server: ServerProcess, case, status: int, needle: str) -> None:
    path, body, headers = case.values
    got_status, resp = _post(example_server, path, body, headers)
    assert got_status == status, resp
    assert isinstance(resp, dict) and isinstance(resp.get("error"), str) and resp["error"]
    assert needle.lower() in resp["error"].lower()
    # the server still serves the next request
    ok_status, ok = _post(example_server, "/v2/models/tiny/infer", _GOOD)
    assert ok_status == 200, ok


def test_body_over_limit(tmp_path) -> None:
    """A body over --max-request-bytes gets 413 and the server carries on."""
    from tests.conftest import copy_models, start_server

    repo = copy_models(tmp_path / "repo", "tiny")
    server = start_server(repo, tmp_path / "log.txt", "--max-request-bytes", "4096")
    try:
        big = json.dumps(
            {
                "inputs": [
                    {"name": "INPUT0", "shape": [100, 64], "datatype": "FP32", "data": [0.5] * 6400}
                ]
            }
        ).encode()
        status, resp = _post(server, "/v2/models/tiny/infer", big)
        assert status == 413, resp
        assert "4096" in resp["error"]
        status, resp = _post(server, "/v2/models/tiny/infer", _GOOD)
        assert status == 200, resp
    finally:
        assert server.stop() == 0


def test_truncated_body_then_serving(example_server: ServerProcess) -> None:
    """A client that promises more body than it sends and hangs up leaves the server serving."""
    import socket

    with socket.create_connection(("127.0.0.1", example_server.http_port), timeout=5) as s:
        s.sendall(
            b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n"
            + _GOOD[:100]
        )
    status, resp = _post(example_server, "/v2/models/tiny/infer", _GOOD)
    assert status == 200, resp


def test_unknown_path_and_method(example_server: ServerProcess) -> None:
    status, body = _get(example_server, "/v2/nothing/here")
    assert status == 404
    assert "error" in json.loads(body)
    status, body = _get(example_server, "/v2/models/tiny/infer")
    assert status in (400, 405)
