"""V2 gRPC frontend against a real pdserve, with ``tritonclient.grpc`` (issue 5).

Every RPC of ``inference.GRPCInferenceService`` that pdserve serves: health,
metadata, config, inference (raw and typed contents, every datatype, BYTES,
requested outputs, classification, parameters, request id, large messages,
streaming), statistics and the repository extension, with Triton's status codes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import EXAMPLE_REPO, GOLDENS, ServerProcess, copy_models, start_server

DTYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


def tiny_expected(x: np.ndarray, scale: float = 2.0, offset: float = 0.0) -> np.ndarray:
    """``relu(x @ (scale * W)) + offset``: tiny v2 is scale 2; tiny_all_versions vN is
    scale 1, offset N."""
    w = np.load(GOLDENS / "tiny.npz")["W"]
    return np.maximum(x @ (scale * w), 0) + offset


@pytest.fixture(scope="module")
def client(example_server: ServerProcess) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(example_server.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(example_server: ServerProcess) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    """The raw generated stub, for messages tritonclient does not build (typed contents)."""
    channel = grpc.insecure_channel(
        example_server.grpc_url,
        options=[("grpc.max_receive_message_length", 256 * 1024 * 1024)],
    )
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def _input(name: str, arr: np.ndarray, datatype: str | None = None) -> grpcclient.InferInput:
    dt = datatype or ("BYTES" if arr.dtype == object else grpcclient.np_to_triton_dtype(arr.dtype))
    inp = grpcclient.InferInput(name, list(arr.shape), dt)
    inp.set_data_from_numpy(arr)
    return inp


def _code(excinfo: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(excinfo.value.status())


# -- health and metadata -------------------------------------------------------------


def test_health(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("tiny")
    assert client.is_model_ready("tiny", "2")
    assert not client.is_model_ready("tiny", "1")  # v1 is not served (latest policy)
    assert not client.is_model_ready("no_such_model")


def test_server_metadata(client: grpcclient.InferenceServerClient) -> None:
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "pdserve"
    assert "model_repository" in meta["extensions"]
    assert "classification" in meta["extensions"]


def test_model_metadata(client: grpcclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("tiny", as_json=True)
    assert meta["name"] == "tiny"
    assert meta["versions"] == ["2"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": ["-1", "64"]}]
    assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": ["-1", "64"]}]
    versions = client.get_model_metadata("tiny_all_versions").versions
    assert list(versions) == ["1", "2", "3"]
    # For one version, that version only (as Triton).
    assert list(client.get_model_metadata("tiny_all_versions", "2").versions) == ["2"]


def test_model_config(client: grpcclient.InferenceServerClient) -> None:
    cfg = client.get_model_config("efficientnet_lite0").config
    assert cfg.name == "efficientnet_lite0"
    assert cfg.max_batch_size == 32
    assert list(cfg.input[0].dims) == [3, 224, 224]
    assert cfg.output[0].label_filename == "labels.txt"
    # the same configuration the HTTP route returns
    as_json = client.get_model_config("tiny", as_json=True)["config"]
    assert as_json["name"] == "tiny" and int(as_json["max_batch_size"]) == 128


def test_metadata_errors(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("no_such_model")
    assert _code(e) == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as e:
        client.get_model_config("tiny", "7")
    assert _code(e) == "StatusCode.NOT_FOUND"


# -- inference -----------------------------------------------------------------------


def test_infer_raw_matches_reference_and_http(
    client: grpcclient.InferenceServerClient, example_server: ServerProcess
) -> None:
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    result = client.infer("tiny", [_input("INPUT0", x)], request_id="req-42")
    resp = result.get_response()
    assert resp.model_name == "tiny" and resp.model_version == "2" and resp.id == "req-42"
    out = result.as_numpy("OUTPUT0")
    assert out.dtype == np.float32 and out.shape == (3, 64)
    np.testing.assert_allclose(out, tiny_expected(x), rtol=1e-5, atol=1e-5)
    h = httpclient.InferenceServerClient(example_server.http_url)
    hin = httpclient.InferInput("INPUT0", [3, 64], "FP32")
    hin.set_data_from_numpy(x, binary_data=True)
    np.testing.assert_array_equal(h.infer("tiny", [hin]).as_numpy("OUTPUT0"), out)


def test_infer_explicit_version(client: grpcclient.InferenceServerClient) -> None:
    x = np.ones((1, 64), np.float32)
    for v in (1, 2, 3):
        r = client.infer("tiny_all_versions", [_input("INPUT0", x)], model_version=str(v))
        assert r.get_response().model_version == str(v)
        np.testing.assert_allclose(
            r.as_numpy("OUTPUT0"), tiny_expected(x, 1.0, v), rtol=1e-5, atol=1e-4
        )


def test_every_datatype_raw(client: grpcclient.InferenceServerClient) -> None:
    rng = np.random.default_rng(2)
    inputs, expected = [], {}
    for dt, np_dtype in DTYPES.items():
        if dt == "BOOL":
            arr = rng.integers(0, 2, (2, 5)).astype(bool)
        elif dt.startswith("FP"):
            arr = rng.standard_normal((2, 5)).astype(np_dtype)
        else:
            arr = rng.integers(0, 100, (2, 5)).astype(np_dtype)
        inputs.append(_input(f"IN_{dt}", arr, dt))
        expected[f"OUT_{dt}"] = arr
    strings = np.array([[b"a", b"", b"\x00bin", "ünï".encode(), b"x" * 300]] * 2, dtype=object)
    inputs.append(_input("IN_STRING", strings, "BYTES"))
    expected["OUT_STRING"] = strings
    result = client.infer("tiny_dtypes", inputs)
    for name, want in expected.items():
        got = result.as_numpy(name)
        assert got.shape == want.shape, name
        if want.dtype == object:
            assert got.tolist() == want.tolist()
        else:
            assert got.dtype == want.dtype, name
            np.testing.assert_array_equal(got, want)


def test_fp16_must_be_raw(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    req = service_pb2.ModelInferRequest(model_name="tiny_dtypes")
    req.inputs.add(name="IN_FP16", datatype="FP16", shape=[1, 3]).contents.fp32_contents.extend(
        [1, 2, 3]
    )
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents" in e.value.details()


def test_raw_and_typed_cannot_mix(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    x = np.ones((1, 64), np.float32)
    req = service_pb2.ModelInferRequest(model_name="tiny", raw_input_contents=[x.tobytes()])
    t = req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 64])
    t.contents.fp32_contents.extend(x.ravel().tolist())
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_typed_contents_tiny(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    x = np.arange(64, dtype=np.float32).reshape(1, 64) / 64
    req = service_pb2.ModelInferRequest(model_name="tiny", id="t1")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 64]).contents.fp32_contents.extend(
        x.ravel().tolist()
    )
    resp = stub.ModelInfer(req)
    assert resp.id == "t1" and resp.model_version == "2"
    assert resp.outputs[0].name == "OUTPUT0" and list(resp.outputs[0].shape) == [1, 64]
    assert resp.outputs[0].datatype == "FP32"
    out = np.frombuffer(resp.raw_output_contents[0], dtype="<f4").reshape(1, 64)
    np.testing.assert_allclose(out, tiny_expected(x), rtol=1e-5, atol=1e-5)
    req.inputs[0].contents.fp32_contents.append(1.0)  # one element too many
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_requested_outputs_and_classification(client: grpcclient.InferenceServerClient) -> None:
    x = np.random.default_rng(4).random((2, 64)).astype(np.float32)
    r = client.infer(
        "digits", [_input("input", x)], outputs=[grpcclient.InferRequestedOutput("probabilities")]
    )
    assert r.as_numpy("label") is None
    probs = r.as_numpy("probabilities")
    assert probs.shape == (2, 10)
    r = client.infer(
        "digits",
        [_input("input", x)],
        outputs=[grpcclient.InferRequestedOutput("probabilities", class_count=3)],
    )
    top = r.as_numpy("probabilities")
    assert top.shape == (2, 3) and top.dtype == object
    for row, p in zip(top, probs, strict=True):
        score, index = row[0].decode().split(":")[:2]
        assert int(index) == int(np.argmax(p))
        assert abs(float(score) - float(p.max())) < 1e-5
    j = np.zeros((1, 3, 224, 224), np.float32)
    r = client.infer(
        "efficientnet_lite0",
        [_input("input", j)],
        outputs=[grpcclient.InferRequestedOutput("logits", class_count=2)],
    )
    labelled = r.as_numpy("logits")
    assert labelled.shape == (1, 2) and labelled[0, 0].decode().count(":") == 2  # score:idx:label


def test_parameters_priority_timeout(client: grpcclient.InferenceServerClient) -> None:
    x = np.ones((1, 64), np.float32)
    r = client.infer(
        "tiny", [_input("INPUT0", x)], priority=1, timeout=10_000_000, parameters={"k": "v"}
    )
    assert r.as_numpy("OUTPUT0").shape == (1, 64)


def test_infer_errors(client: grpcclient.InferenceServerClient) -> None:
    x = np.ones((1, 64), np.float32)
    cases = [
        (("no_such_model", [_input("INPUT0", x)]), {}, "StatusCode.NOT_FOUND"),
        (("tiny", [_input("INPUT0", x)]), {"model_version": "9"}, "StatusCode.NOT_FOUND"),
        (("tiny", [_input("INPUT0", np.ones((1, 63), np.float32))]), {}, "INVALID_ARGUMENT"),
        (("tiny", [_input("INPUT0", np.ones((1, 64), np.float64))]), {}, "INVALID_ARGUMENT"),
        (("tiny", [_input("WRONG", x)]), {}, "INVALID_ARGUMENT"),
        (("tiny", [_input("INPUT0", np.ones((129, 64), np.float32))]), {}, "INVALID_ARGUMENT"),
        (
            ("tiny", [_input("INPUT0", x)]),
            {"outputs": [grpcclient.InferRequestedOutput("NOPE")]},
            "INVALID_ARGUMENT",
        ),
    ]
    for args, kwargs, code in cases:
        with pytest.raises(InferenceServerException) as e:
            client.infer(*args, **kwargs)
        assert code in _code(e), (args[0], kwargs, e.value)
    # the server is unharmed
    assert client.infer("tiny", [_input("INPUT0", x)]).as_numpy("OUTPUT0").shape == (1, 64)


def test_request_parameters_are_checked(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """Triton's reserved parameters must have their types; any value must be set."""

    def request(**params: tuple[str, object]) -> service_pb2.ModelInferRequest:
        req = service_pb2.ModelInferRequest(model_name="tiny")
        req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 64]).contents.fp32_contents.extend(
            [0.5] * 64
        )
        for key, (kind, value) in params.items():
            setattr(req.parameters[key], kind, value)
        return req

    for params, words in (
        ({"priority": ("string_param", "high")}, "'priority' must be an int64_param >= 0"),
        ({"timeout": ("double_param", 1.5)}, "'timeout' must be an int64_param >= 0"),
        ({"triton_x": ("bool_param", True)}, "keys starting with 'triton_' are reserved"),
    ):
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request(**params))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in e.value.details()
    ok = stub.ModelInfer(request(priority=("uint64_param", 1), timeout=("int64_param", 10**6)))
    assert list(ok.outputs[0].shape) == [1, 64]


def test_raw_size_mismatch(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    req = service_pb2.ModelInferRequest(model_name="tiny", raw_input_contents=[b"\0" * 10])
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 64])
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "byte size" in e.value.details()


def test_large_batch(client: grpcclient.InferenceServerClient) -> None:
    """A 32x3x224x224 FP32 batch (19 MB) goes through; outputs match a batch of one."""
    x = np.random.default_rng(5).random((32, 3, 224, 224)).astype(np.float32)
    logits = client.infer("efficientnet_lite0", [_input("input", x)]).as_numpy("logits")
    assert logits.shape == (32, 1000)
    one = client.infer("efficientnet_lite0", [_input("input", x[7:8])]).as_numpy("logits")
    np.testing.assert_allclose(logits[7:8], one, rtol=1e-3, atol=1e-3)


def test_stream_infer(client: grpcclient.InferenceServerClient) -> None:
    import queue

    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        x = np.ones((1, 64), np.float32)
        for i in range(3):
            client.async_stream_infer("tiny", [_input("INPUT0", x)], request_id=f"s{i}")
        client.async_stream_infer("no_such_model", [_input("INPUT0", x)], request_id="bad")
        got = [results.get(timeout=30) for _ in range(4)]
    finally:
        client.stop_stream()
    ids = sorted(r.get_response().id for r, err in got if err is None)
    assert ids == ["s0", "s1", "s2"]  # completion order; matched by id
    errors = [err for _, err in got if err is not None]
    assert len(errors) == 1 and "no_such_model" in str(errors[0])


def test_stream_answers_a_malformed_message_and_goes_on(example_server: ServerProcess) -> None:
    """A message in ModelStreamInfer that is not a ModelInferRequest gets an
    ``error_message`` response naming the problem, as in Triton; the requests
    around it are all answered and the stream ends OK when the client closes it
    (before: the reader's DecodeError was swallowed, in-flight requests were
    cancelled and the stream ended OK)."""
    channel = grpc.insecure_channel(example_server.grpc_url)

    def good(i: int) -> bytes:
        r = service_pb2.ModelInferRequest(model_name="tiny", id=f"s{i}")
        r.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 64])
        r.raw_input_contents.append(np.ones((1, 64), np.float32).tobytes())
        return r.SerializeToString()

    def messages() -> Iterator[bytes]:
        yield good(0)
        yield good(1)
        yield b"\xff\xff\xff"
        yield good(2)

    stream = channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        request_serializer=lambda b: b,
        response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
    )
    try:
        call = stream(messages(), timeout=30)
        got = list(call)
        assert call.code() == grpc.StatusCode.OK
    finally:
        channel.close()
    ids = sorted(r.infer_response.id for r in got if not r.error_message)
    assert ids == ["s0", "s1", "s2"], got
    errors = [r.error_message for r in got if r.error_message]
    assert len(errors) == 1, got
    assert errors[0].startswith("malformed ModelStreamInfer request: "), errors
    assert "<class" not in errors[0]


def test_malformed_protobuf_is_invalid_argument(example_server: ServerProcess) -> None:
    """Bytes that are not the RPC's request message: INVALID_ARGUMENT naming the
    method (was UNKNOWN "Unexpected <class 'google.protobuf.message.DecodeError'>"),
    and the server carries on."""
    channel = grpc.insecure_channel(example_server.grpc_url)
    try:
        for method in ["ModelInfer", "ServerLive", "ModelMetadata", "RepositoryIndex"]:
            call = channel.unary_unary(
                f"/inference.GRPCInferenceService/{method}",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            bad = [b"\xff\xff\xff", b"\x0a\x10ab"]  # a bad tag, a truncated field
            if method in ("ModelInfer", "ModelMetadata"):
                bad.append(b"\x0a\x02\xff\xfe")  # a name that is not UTF-8
            for payload in bad:
                with pytest.raises(grpc.RpcError) as excinfo:
                    call(payload, timeout=10)
                err = excinfo.value
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.details())
                assert err.details().startswith(f"malformed {method} request: "), err.details()
                assert "<class" not in err.details(), err.details()
        live = channel.unary_unary(
            "/inference.GRPCInferenceService/ServerLive",
            request_serializer=service_pb2.ServerLiveRequest.SerializeToString,
            response_deserializer=service_pb2.ServerLiveResponse.FromString,
        )
        assert live(service_pb2.ServerLiveRequest(), timeout=10).live
    finally:
        channel.close()


# -- statistics and repository -------------------------------------------------------


def test_statistics(client: grpcclient.InferenceServerClient) -> None:
    x = np.ones((4, 64), np.float32)
    before = client.get_inference_statistics("tiny_specific", "3").model_stats[0]
    for _ in range(2):
        client.infer("tiny_specific", [_input("INPUT0", x)], model_version="3")
    stats = client.get_inference_statistics("tiny_specific", "3").model_stats
    assert len(stats) == 1 and stats[0].name == "tiny_specific" and stats[0].version == "3"
    assert stats[0].inference_count - before.inference_count == 8
    assert stats[0].inference_stats.success.count - before.inference_stats.success.count == 2
    everything = client.get_inference_statistics().model_stats
    assert {"tiny", "tiny_specific", "efficientnet_lite0"} <= {s.name for s in everything}
    # Triton answers INVALID_ARGUMENT (HTTP 400) for a model or version it cannot report.
    for args in (("no_such_model",), ("tiny_specific", "2"), ("tiny", "x")):
        with pytest.raises(InferenceServerException) as e:
            client.get_inference_statistics(*args)
        assert _code(e) == "StatusCode.INVALID_ARGUMENT", args
        assert "is not available" in str(e.value)


def test_repository_index(client: grpcclient.InferenceServerClient) -> None:
    index = client.get_model_repository_index(as_json=True)["models"]
    rows = {(m["name"], m.get("version")): m for m in index}
    assert rows[("tiny", "2")]["state"] == "READY"
    assert rows[("tiny_specific", "1")]["state"] == "READY"
    assert ("tiny_specific", "2") not in rows


def test_load_unload_refused_in_none_mode(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as e:
        client.load_model("tiny")
    assert _code(e) == "StatusCode.UNAVAILABLE"
    assert "explicit" in str(e.value)
    with pytest.raises(InferenceServerException) as e:
        client.unload_model("tiny")
    assert _code(e) == "StatusCode.UNAVAILABLE"
    assert client.is_model_ready("tiny")


# -- repository extension in explicit mode, message limits ---------------------------


#: Datatypes with a typed ``contents`` field (FP16 has none).
TYPED = [dt for dt in DTYPES if dt != "FP16"] + ["BYTES"]


def write_typed_identity(repo: Path) -> None:
    """``typed_identity``: ONNX Identity ``IN_<T>`` -> ``OUT_<T>`` for every datatype
    with a typed contents field, so one request can carry them all typed."""
    import onnx
    from onnx import TensorProto, helper

    onnx_types = {
        "BOOL": TensorProto.BOOL,
        "UINT8": TensorProto.UINT8,
        "UINT16": TensorProto.UINT16,
        "UINT32": TensorProto.UINT32,
        "UINT64": TensorProto.UINT64,
        "INT8": TensorProto.INT8,
        "INT16": TensorProto.INT16,
        "INT32": TensorProto.INT32,
        "INT64": TensorProto.INT64,
        "FP32": TensorProto.FLOAT,
        "FP64": TensorProto.DOUBLE,
        "BYTES": TensorProto.STRING,
    }
    nodes, inputs, outputs, cfg_in, cfg_out = [], [], [], [], []
    for dt in TYPED:
        t = onnx_types[dt]
        inputs.append(helper.make_tensor_value_info(f"IN_{dt}", t, ["b", "n"]))
        outputs.append(helper.make_tensor_value_info(f"OUT_{dt}", t, ["b", "n"]))
        nodes.append(helper.make_node("Identity", [f"IN_{dt}"], [f"OUT_{dt}"]))
        cfg_type = "TYPE_STRING" if dt == "BYTES" else f"TYPE_{dt}"
        cfg_in.append(f'{{ name: "IN_{dt}" data_type: {cfg_type} dims: [ -1 ] }}')
        cfg_out.append(f'{{ name: "OUT_{dt}" data_type: {cfg_type} dims: [ -1 ] }}')
    graph = helper.make_graph(nodes, "typed_identity", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "typed_identity" / "1").mkdir(parents=True)
    onnx.save(model, str(repo / "typed_identity" / "1" / "model.onnx"))
    (repo / "typed_identity" / "config.pbtxt").write_text(
        'name: "typed_identity"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        f"input [ {', '.join(cfg_in)} ]\noutput [ {', '.join(cfg_out)} ]\n"
    )


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("grpc_explicit")
    repo = copy_models(root / "repo", "tiny", "tiny_all_versions", "efficientnet_lite0")
    write_typed_identity(repo)
    server = start_server(
        repo,
        root / "pdserve.log",
        "--model-control-mode=explicit",
        "--load-model=tiny",
        "--load-model=typed_identity",
        "--grpc-max-message-bytes=4000000",
    )
    yield server
    assert server.stop() == 0


def test_repository_load_unload(explicit_server: ServerProcess) -> None:
    c = grpcclient.InferenceServerClient(explicit_server.grpc_url)
    index = c.get_model_repository_index(as_json=True)["models"]
    assert {"name": "tiny_all_versions"} in index  # present, never loaded: no state
    assert not c.is_model_ready("tiny_all_versions")
    c.load_model("tiny_all_versions")
    assert [c.is_model_ready("tiny_all_versions", str(v)) for v in (1, 2, 3)] == [True] * 3
    # config override: pin version 2
    cfg = c.get_model_config("tiny_all_versions", as_json=True)["config"]
    cfg["version_policy"] = {"specific": {"versions": [2]}}
    c.load_model("tiny_all_versions", config=json.dumps(cfg))
    assert list(c.get_model_metadata("tiny_all_versions").versions) == ["2"]
    # an invalid override leaves it as it was
    with pytest.raises(InferenceServerException) as e:
        c.load_model("tiny_all_versions", config='{"max_batch_size": "many"}')
    assert _code(e) == "StatusCode.INVALID_ARGUMENT"
    assert list(c.get_model_metadata("tiny_all_versions").versions) == ["2"]
    # unload, and unload again
    c.unload_model("tiny_all_versions", unload_dependents=True)
    assert not c.is_model_ready("tiny_all_versions")
    with pytest.raises(InferenceServerException) as e:
        c.unload_model("tiny_all_versions")
    assert _code(e) == "StatusCode.INVALID_ARGUMENT"
    # the versions retire in the background (UNLOADING until their instances are closed)
    unloaded = {"name": "tiny_all_versions", "state": "UNAVAILABLE", "reason": "unloaded"}
    deadline = time.monotonic() + 15
    while unloaded not in (index := c.get_model_repository_index(as_json=True)["models"]):
        assert time.monotonic() < deadline, index
        time.sleep(0.05)
    with pytest.raises(InferenceServerException) as e:
        c.load_model("no_such_model")
    assert _code(e) == "StatusCode.INVALID_ARGUMENT"
    c.close()


def test_repository_load_files(explicit_server: ServerProcess, tmp_path: Path) -> None:
    """``file:`` parameters add a version folder; they require ``config``."""
    c = grpcclient.InferenceServerClient(explicit_server.grpc_url)
    onnx = (EXAMPLE_REPO / "tiny_all_versions" / "3" / "model.onnx").read_bytes()
    with pytest.raises(InferenceServerException) as e:
        c.load_model("tiny", files={"file:7/model.onnx": onnx})
    assert _code(e) == "StatusCode.INVALID_ARGUMENT" and "config" in str(e.value)
    cfg = c.get_model_config("tiny", as_json=True)["config"]
    for escape in ("file:../tiny_all_versions/9/model.onnx", "file:/tmp/x", "file:."):
        with pytest.raises(InferenceServerException) as e:
            c.load_model("tiny", config=json.dumps(cfg), files={escape: onnx})
        assert _code(e) == "StatusCode.INVALID_ARGUMENT", escape
    c.load_model("tiny", config=json.dumps(cfg), files={"file:7/model.onnx": onnx})
    assert list(c.get_model_metadata("tiny").versions) == ["7"]
    x = np.ones((1, 64), np.float32)
    out = c.infer("tiny", [_input("INPUT0", x)]).as_numpy("OUTPUT0")
    np.testing.assert_allclose(out, tiny_expected(x, 1.0, 3.0), rtol=1e-5, atol=1e-4)
    c.close()


def test_message_limit(explicit_server: ServerProcess) -> None:
    """Above --grpc-max-message-bytes: RESOURCE_EXHAUSTED, and the server carries on."""
    c = grpcclient.InferenceServerClient(explicit_server.grpc_url)
    c.load_model("efficientnet_lite0")
    x = np.zeros((4, 3, 224, 224), np.float32)  # 2.4 MB: fits
    assert c.infer("efficientnet_lite0", [_input("input", x)]).as_numpy("logits").shape == (4, 1000)
    big = np.zeros((8, 3, 224, 224), np.float32)  # 4.8 MB: over the 4 MB limit
    with pytest.raises(InferenceServerException) as e:
        c.infer("efficientnet_lite0", [_input("input", big)])
    assert _code(e) == "StatusCode.RESOURCE_EXHAUSTED"
    assert c.is_server_live()
    c.close()


def test_typed_contents_every_datatype(explicit_server: ServerProcess) -> None:
    """Every typed ``contents`` field in one request; outputs come back raw."""
    fields = {
        "BOOL": "bool_contents",
        "UINT8": "uint_contents",
        "UINT16": "uint_contents",
        "UINT32": "uint_contents",
        "UINT64": "uint64_contents",
        "INT8": "int_contents",
        "INT16": "int_contents",
        "INT32": "int_contents",
        "INT64": "int64_contents",
        "FP32": "fp32_contents",
        "FP64": "fp64_contents",
        "BYTES": "bytes_contents",
    }
    req = service_pb2.ModelInferRequest(model_name="typed_identity", id="typed")
    expected: dict[str, list] = {}
    for dt in TYPED:
        if dt == "BOOL":
            values: list = [True, False, True, True]
        elif dt == "BYTES":
            values = [b"hello", b"", b"\x00\x01", "ü".encode()]
        elif dt.startswith("INT"):
            values = [-3, 0, 7, 100]
        else:
            values = [0, 1, 7, 100]
        t = req.inputs.add(name=f"IN_{dt}", datatype=dt, shape=[2, 2])
        getattr(t.contents, fields[dt]).extend(values)
        expected[f"OUT_{dt}"] = values
    with grpc.insecure_channel(explicit_server.grpc_url) as channel:
        resp = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req)
    assert resp.id == "typed"
    outs = {o.name: (i, o) for i, o in enumerate(resp.outputs)}
    assert set(outs) == set(expected)
    for name, values in expected.items():
        i, o = outs[name]
        assert list(o.shape) == [2, 2]
        raw = resp.raw_output_contents[i]
        if o.datatype == "BYTES":
            assert raw == b"".join(len(v).to_bytes(4, "little") + v for v in values)
        else:
            dtype = np.dtype(DTYPES[o.datatype]).newbyteorder("<")
            assert np.frombuffer(raw, dtype=dtype).tolist() == values, name


# -- over-size stream responses --------------------------------------------------------


def _tile_model(repo: Path) -> None:
    """``tile``: Y = X (FP32 [4]) tiled R (INT64 [1]) times: 16 * R bytes of output."""
    from onnx import TensorProto, helper, save

    graph = helper.make_graph(
        [helper.make_node("Tile", ["X", "R"], ["Y"])],
        "tile",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("R", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    (repo / "tile" / "1").mkdir(parents=True)
    save(model, str(repo / "tile" / "1" / "model.onnx"))
    (repo / "tile" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
        'input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] },'
        ' { name: "R", data_type: TYPE_INT64, dims: [ 1 ] } ]\n'
        'output [ { name: "Y", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
    )


def test_an_over_size_stream_response_is_an_error_response_and_the_stream_goes_on(
    tmp_path: Path,
) -> None:
    """With --grpc-max-message-bytes 1 MiB, a stream request whose response would be
    2 MiB gets an ``error_message`` response naming the limit; the requests before and
    after it on the same stream are answered (the stream used to end RESOURCE_EXHAUSTED)."""
    import queue

    repo = tmp_path / "repo"
    _tile_model(repo)
    limit = 1024 * 1024
    server = start_server(repo, tmp_path / "pdserve.log", f"--grpc-max-message-bytes={limit}")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    x = np.arange(4, dtype=np.float32)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for rid, reps in (("small0", 10), ("big", limit // 8), ("small1", 1000)):
            r = np.array([reps], dtype=np.int64)
            client.async_stream_infer("tile", [_input("X", x), _input("R", r)], request_id=rid)
        got = [results.get(timeout=30) for _ in range(3)]
        # the stream is still usable afterwards
        client.async_stream_infer(
            "tile", [_input("X", x), _input("R", np.array([2], np.int64))], request_id="after"
        )
        got.append(results.get(timeout=30))
        client.stop_stream()
        assert results.empty()
    finally:
        client.close()
        server.stop()
    ok = {res.get_response().id: res.as_numpy("Y") for res, err in got if err is None}
    assert sorted(ok) == ["after", "small0", "small1"], got
    np.testing.assert_array_equal(ok["small1"], np.tile(x, 1000))
    np.testing.assert_array_equal(ok["after"], np.tile(x, 2))
    (error,) = [err for _, err in got if err is not None]
    message = str(error)
    assert f"larger than the gRPC message limit of {limit} bytes" in message, message
    assert "--grpc-max-message-bytes" in message, message
