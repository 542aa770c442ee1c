"""A model's wrong output is a 500, never a 200; ``reshape`` as Triton applies it (issue 10).

Against a real pdserve, through ``tritonclient.http`` and ``tritonclient.grpc``:

* ``bad_outputs`` (python, ``tests/data/python_models``, with ``strict_output_shapes``:
  without it a python model's shapes are served as produced, see
  test_python_output_shapes.py) returns too few rows, too many rows, the wrong per-row
  shape, the wrong datatype or no batch dimension on demand; ``bad_outputs_plain`` is
  the same model served without batching;
* ``bad_onnx``, an ONNX model built here with ``onnx.helper``, whose outputs have
  too few rows, too many rows, the wrong width, or no batch dimension;
* ``ens_bad_outputs``, an ensemble over ``bad_outputs``;
* ``reshape_rank`` (python) and ``reshape_onnx`` (built here), whose inputs and
  outputs have ``reshape``.

Each wrong output fails its request with HTTP 500 / gRPC INTERNAL and a message
naming the model, the output, the expected and the actual shape (or datatype);
the next good request is answered as usual.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, start_server

DATA = Path(__file__).resolve().parents[1] / "data" / "python_models"

PLAIN_CONFIG = """
name: "bad_outputs_plain"
backend: "python"
max_batch_size: 0
input [
  { name: "MODE", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "X", data_type: TYPE_FP32, dims: [ 1 ] }
]
output [
  { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "V", data_type: TYPE_FP32, dims: [ -1 ] }
]
instance_group [ { count: 1, kind: KIND_CPU } ]
parameters { key: "strict_output_shapes" value: { string_value: "true" } }
"""

ONNX_CONFIG = """
name: "bad_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [
  { name: "OK", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "FEW", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "MANY", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "NARROW", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "DROP", data_type: TYPE_FP32, dims: [ 4 ] }
]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


def _bad_onnx_model() -> bytes:
    """X [N,4] -> OK = X; FEW = X[1:]; MANY = X twice; NARROW = X[:, :-1]; DROP = sum
    over rows ([4]). The declared output shapes keep a variable first dim (and NARROW a
    variable width), so the model loads as a batching model whose outputs are wrong."""
    from onnx import TensorProto, helper

    def const(name: str, value: int) -> object:
        return helper.make_tensor(name, TensorProto.INT64, [1], [value])

    nodes = [
        helper.make_node("Identity", ["X"], ["OK"]),
        helper.make_node("Slice", ["X", "one", "big", "zero"], ["FEW"]),
        helper.make_node("Concat", ["X", "X"], ["MANY"], axis=0),
        # computed (not constant) slice end and reduce axis: shape inference cannot
        # pin NARROW's width or DROP's rank
        helper.make_node("Shape", ["X"], ["shape"]),
        helper.make_node("Slice", ["shape", "one", "big"], ["width"]),
        helper.make_node("Sub", ["width", "one"], ["width1"]),
        helper.make_node("Slice", ["X", "zero", "width1", "one"], ["NARROW"]),
        helper.make_node("Slice", ["shape", "zero", "one"], ["rows"]),
        helper.make_node("Sub", ["rows", "rows"], ["axis0"]),
        helper.make_node("ReduceSum", ["X", "axis0"], ["DROP"], keepdims=0),
    ]
    shapes = {"OK": ["N", 4], "FEW": ["F", 4], "MANY": ["M", 4], "NARROW": ["N", "K"]}
    shapes["DROP"] = ["D", 4]
    graph = helper.make_graph(
        nodes,
        "bad_onnx",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()],
        [const("zero", 0), const("one", 1), const("big", 2**62)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


RESHAPE_ONNX_CONFIG = """
name: "reshape_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ], reshape: { shape: [ ] } } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ], reshape: { shape: [ ] } } ]
"""


def _reshape_onnx_model() -> bytes:
    """X [N] -> Y = 2 X [N]: a scalar per batch row, served as [N, 1] by ``reshape``."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["X", "two"], ["Y"])],
        "reshape_onnx",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("output_checks") / "models"
    for name in ("bad_outputs", "ens_bad_outputs", "reshape_rank"):
        shutil.copytree(DATA / name, repo / name)
    plain = repo / "bad_outputs_plain"
    shutil.copytree(DATA / "bad_outputs", plain)
    (plain / "config.pbtxt").write_text(PLAIN_CONFIG)
    onnx_dir = repo / "bad_onnx"
    (onnx_dir / "1").mkdir(parents=True)
    (onnx_dir / "config.pbtxt").write_text(ONNX_CONFIG)
    (onnx_dir / "1" / "model.onnx").write_bytes(_bad_onnx_model())
    (repo / "reshape_onnx" / "1").mkdir(parents=True)
    (repo / "reshape_onnx" / "config.pbtxt").write_text(RESHAPE_ONNX_CONFIG)
    (repo / "reshape_onnx" / "1" / "model.onnx").write_bytes(_reshape_onnx_model())
    proc = start_server(repo, repo.parent / "pdserve.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, network_timeout=60)


@pytest.fixture(scope="module")
def grpc(server: ServerProcess) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def _inputs(module: object, mode: str, x: np.ndarray, batching: bool = True) -> list[object]:
    rows = x.shape[0] if batching else 1
    modes = np.array([mode.encode()] * rows, dtype=object).reshape([rows, 1] if batching else [1])
    m = module.InferInput("MODE", list(modes.shape), "BYTES")  # type: ignore[attr-defined]
    m.set_data_from_numpy(modes)
    t = module.InferInput("X", list(x.shape), "FP32")  # type: ignore[attr-defined]
    t.set_data_from_numpy(x)
    return [m, t]


def _infer(kind: str, clients: dict[str, object], model: str, inputs: list[object]) -> object:
    return clients[kind].infer(model, inputs)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def clients(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> dict[str, object]:
    return {"http": http, "grpc": grpc}


MODULES = {"http": httpclient, "grpc": grpcclient}
STATUS = {"http": "500", "grpc": "StatusCode.INTERNAL"}
X2 = np.arange(8, dtype=np.float32).reshape(2, 4)


def _expect_internal(kind: str, call: object, message: str) -> None:
    with pytest.raises(InferenceServerException) as info:
        call()  # type: ignore[operator]
    assert info.value.status() == STATUS[kind]
    assert message in info.value.message()


def _expect_good(kind: str, clients: dict[str, object], model: str = "bad_outputs") -> None:
    result = _infer(kind, clients, model, _inputs(MODULES[kind], "ok", X2))
    np.testing.assert_array_equal(result.as_numpy("Y"), X2)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["http", "grpc"])
@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (
            "few_rows",
            "model 'bad_outputs' returned output 'Y' with shape [1,4], expected [2,4]: "
            "1 rows for a request of 2 rows",
        ),
        (
            "many_rows",
            "model 'bad_outputs' returned output 'Y' with shape [4,4], expected [2,4]: "
            "4 rows for a request of 2 rows",
        ),
        (
            "wrong_shape",
            "model 'bad_outputs' returned output 'Y' with shape [2,12], expected [2,4]",
        ),
        (
            "wrong_dtype",
            "model 'bad_outputs' returned output 'Y' as INT64, but its model configuration "
            "says FP32",
        ),
        (
            "drop_batch",
            "model 'bad_outputs' returned output 'Y' with shape [4], expected [2,4]: "
            "4 rows for a request of 2 rows",
        ),
    ],
)
def test_python_model_wrong_outputs_are_internal_errors(
    kind: str, mode: str, message: str, clients: dict[str, object]
) -> None:
    module = MODULES[kind]
    _expect_internal(
        kind, lambda: _infer(kind, clients, "bad_outputs", _inputs(module, mode, X2)), message
    )
    _expect_good(kind, clients)  # the server and the model carry on


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_non_batching_python_model_returning_three_values_for_one(
    kind: str, clients: dict[str, object]
) -> None:
    module = MODULES[kind]
    x = np.array([5.0], dtype=np.float32)

    def call(mode: str) -> object:
        return _infer(kind, clients, "bad_outputs_plain", _inputs(module, mode, x, False))

    _expect_internal(
        kind,
        lambda: call("wrong_shape"),
        "model 'bad_outputs_plain' returned output 'Y' with shape [3], expected [1]",
    )
    np.testing.assert_array_equal(call("ok").as_numpy("Y"), x)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["http", "grpc"])
@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("FEW", "returned output 'FEW' with shape [1,4], expected [2,4]: 1 rows for a request"),
        ("MANY", "returned output 'MANY' with shape [4,4], expected [2,4]: 4 rows for a request"),
        ("NARROW", "returned output 'NARROW' with shape [2,3], expected [2,4]"),
        ("DROP", "returned output 'DROP' with shape [4], expected [2,4]: 4 rows for a request"),
    ],
)
def test_onnx_model_wrong_outputs_are_internal_errors(
    kind: str, output: str, message: str, clients: dict[str, object]
) -> None:
    module = MODULES[kind]
    x = module.InferInput("X", [2, 4], "FP32")  # type: ignore[attr-defined]
    x.set_data_from_numpy(X2)
    wanted = [module.InferRequestedOutput(output)]  # type: ignore[attr-defined]
    client = clients[kind]
    _expect_internal(
        kind,
        lambda: client.infer("bad_onnx", [x], outputs=wanted),  # type: ignore[attr-defined]
        f"model 'bad_onnx' {message}",
    )
    ok = client.infer("bad_onnx", [x], outputs=[module.InferRequestedOutput("OK")])  # type: ignore[attr-defined]
    np.testing.assert_array_equal(ok.as_numpy("OK"), X2)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_ensemble_step_with_a_wrong_shape_fails_the_ensemble_request(
    kind: str, clients: dict[str, object]
) -> None:
    module = MODULES[kind]

    def call(mode: str) -> object:
        return _infer(kind, clients, "ens_bad_outputs", _inputs(module, mode, X2))

    # the step model's own check names the step model
    _expect_internal(
        kind,
        lambda: call("wrong_shape"),
        "model 'bad_outputs' returned output 'Y' with shape [2,12], expected [2,4]",
    )
    # V passes the step ([-1]) but not the ensemble's narrower [4]
    _expect_internal(
        kind,
        lambda: call("short_v"),
        "model 'ens_bad_outputs' returned output 'V' with shape [2,3], expected [2,4]",
    )
    result = call("ok")
    np.testing.assert_array_equal(result.as_numpy("Y"), X2)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(result.as_numpy("V"), X2)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_python_model_gets_its_inputs_reshaped(kind: str, clients: dict[str, object]) -> None:
    module = MODULES[kind]
    x = np.array([[1.0], [2.0], [3.0]], dtype=np.float32)
    m = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    tx = module.InferInput("X", [3, 1], "FP32")  # type: ignore[attr-defined]
    tx.set_data_from_numpy(x)
    tm = module.InferInput("M", [3, 2, 2], "FP32")  # type: ignore[attr-defined]
    tm.set_data_from_numpy(m)
    result = clients[kind].infer("reshape_rank", [tx, tm])  # type: ignore[attr-defined]
    # the model asserted X [3] and M [3,4]; it returned Y as [3], served as dims [3,1]
    y = result.as_numpy("Y")
    assert y.shape == (3, 1)
    np.testing.assert_array_equal(y, x * 2 + m.reshape(3, 4).sum(axis=1, keepdims=True))
    shapes = result.as_numpy("SHAPES")
    np.testing.assert_array_equal(shapes, np.array([[[3, 0], [3, 4]]] * 3))


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_onnx_model_gets_its_inputs_and_outputs_reshaped(
    kind: str, clients: dict[str, object]
) -> None:
    module = MODULES[kind]
    x = np.array([[1.0], [2.0], [-3.0]], dtype=np.float32)
    tx = module.InferInput("X", [3, 1], "FP32")  # type: ignore[attr-defined]
    tx.set_data_from_numpy(x)
    y = clients[kind].infer("reshape_onnx", [tx]).as_numpy("Y")  # type: ignore[attr-defined]
    assert y.shape == (3, 1)
    np.testing.assert_array_equal(y, x * 2)
