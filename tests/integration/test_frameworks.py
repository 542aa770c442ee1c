"""The framework backends through a real pdserve: OpenVINO, TensorFlow SavedModel and
PyTorch 2 exported (``torch_aoti``) models of examples/framework_repository (built by
examples/build_frameworks.py), over tritonclient HTTP and gRPC with dynamic batching
on, against the goldens each model ships; and the load faults (corrupt model files, a
KIND_GPU group no framework here can serve), while the other models keep serving.
One server for the module: TensorFlow's import is paid once.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import GOLDENS, ROOT, ServerProcess, start_server

pytest.importorskip("openvino")
pytest.importorskip("tensorflow")
pytest.importorskip("torch")

FRAMEWORK_REPO = ROOT / "examples" / "framework_repository"
MODELS = {
    # model: (backend, platform, input, output)
    "efficientnet_lite0_openvino": ("openvino", "", "input", "logits"),
    "iris_keras": ("tensorflow", "tensorflow_savedmodel", "features", "probabilities"),
    "efficientnet_lite0_pt2": ("pytorch", "torch_aoti", "INPUT__0", "OUTPUT__0"),
}
GPU_GROUP = "instance_group [ { kind: KIND_GPU, gpus: [ 0 ] } ]\n"


def _with_config(src: Path, dst: Path, extra: str = "") -> Path:
    """A copy of model folder ``src`` named ``dst`` (its config's name changed)."""
    shutil.copytree(src, dst)
    cfg = dst / "config.pbtxt"
    text = cfg.read_text().replace(f'name: "{src.name}"', f'name: "{dst.name}"')
    text = text.replace("instance_group [ { count: 1, kind: KIND_CPU } ]\n", "")
    cfg.write_text(text + extra)
    return dst


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if not FRAMEWORK_REPO.is_dir():
        pytest.fail("examples/framework_repository is missing: run examples/build_frameworks.py")
    tmp = tmp_path_factory.mktemp("frameworks")
    repo = tmp / "repo"
    repo.mkdir()
    for name in MODELS:
        shutil.copytree(FRAMEWORK_REPO / name, repo / name)
    # faults: each fails to load with its reason; the rest serve
    ov = _with_config(FRAMEWORK_REPO / "efficientnet_lite0_openvino", repo / "ov_corrupt")
    (ov / "1" / "model.xml").write_text("<net name='x'><layers><layer id=")
    tf = _with_config(FRAMEWORK_REPO / "iris_keras", repo / "tf_corrupt")
    (tf / "1" / "model.savedmodel" / "saved_model.pb").write_bytes(b"\x08\x01garbage" * 10)
    pt = _with_config(FRAMEWORK_REPO / "efficientnet_lite0_pt2", repo / "pt2_corrupt")
    (pt / "1" / "model.pt2").write_bytes(b"PK\x03\x04 this is no archive")
    _with_config(FRAMEWORK_REPO / "efficientnet_lite0_openvino", repo / "ov_gpu", GPU_GROUP)
    _with_config(FRAMEWORK_REPO / "iris_keras", repo / "tf_gpu", GPU_GROUP)
    srv = start_server(repo, tmp / "pdserve.log", ready_timeout=240)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, concurrency=16, network_timeout=120)


@pytest.fixture(scope="module")
def grpc(server: ServerProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def _golden(model: str) -> tuple[np.ndarray, np.ndarray, float]:
    """The model's golden input and output (MODEL_IDENTITY.json's entry) and its atol."""
    vdir = FRAMEWORK_REPO / model / "1"
    entry = json.loads((vdir / "MODEL_IDENTITY.json").read_text())["golden"]
    with np.load(vdir / entry["file"]) as data:
        x = data[next(iter(entry["inputs"].values()))]
        y = data[next(iter(entry["outputs"].values()))]
    return x, y, max(float(entry["atol"]), 1e-6)


def _infer(client: object, model: str, x: np.ndarray) -> np.ndarray:
    _, _, name, output = MODELS[model]
    mod = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    tensor = mod.InferInput(name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor]).as_numpy(output)  # type: ignore[attr-defined]


@pytest.mark.parametrize("model", list(MODELS))
def test_config_names_the_backend_and_batches(
    http: httpclient.InferenceServerClient, model: str
) -> None:
    backend, platform, name, output = MODELS[model]
    cfg = http.get_model_config(model)
    assert (cfg["backend"], cfg.get("platform", "")) == (backend, platform)
    assert cfg["max_batch_size"] == 32 and "dynamic_batching" in cfg
    assert [i["name"] for i in cfg["input"]] == [name]
    assert [o["name"] for o in cfg["output"]] == [output]
    default = {"openvino": "model.xml", "tensorflow": "model.savedmodel"}.get(backend, "model.pt2")
    assert cfg["default_model_filename"] == default


@pytest.mark.parametrize("model", list(MODELS))
def test_goldens_over_http_and_grpc(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient, model: str
) -> None:
    x, want, atol = _golden(model)
    for client in (http, grpc):
        got = _infer(client, model, x)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=atol, rtol=atol)


@pytest.mark.parametrize("model", list(MODELS))
def test_concurrent_rows_are_batched_and_each_gets_its_own(
    http: httpclient.InferenceServerClient, model: str
) -> None:
    x, want, atol = _golden(model)
    rows = np.concatenate([x] * 6)
    expected = np.concatenate([want] * 6)
    before = http.get_inference_statistics(model)["model_stats"][0]
    _, _, name, output = MODELS[model]
    pending = []
    for i in range(len(rows)):  # all in flight at once (the client's 16 connections)
        tensor = httpclient.InferInput(name, [1, *rows.shape[1:]], "FP32")
        tensor.set_data_from_numpy(rows[i : i + 1])
        pending.append(http.async_infer(model, [tensor]))
    got = [p.get_result().as_numpy(output) for p in pending]
    for i, out in enumerate(got):
        np.testing.assert_allclose(out[0], expected[i], atol=atol, rtol=atol)
    after = http.get_inference_statistics(model)["model_stats"][0]
    inferences = int(after["inference_count"]) - int(before["inference_count"])
    executions = int(after["execution_count"]) - int(before["execution_count"])
    assert inferences == len(rows)
    assert 1 <= executions <= len(rows)
    assert int(after["inference_stats"]["compute_infer"]["ns"]) > 0


def test_openvino_top1_equals_onnxruntime_on_the_photos(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    with np.load(GOLDENS / "efficientnet_lite0.npz") as data:
        photos, onnx_logits = data["inputs"], data["onnx_logits"]
    got = _infer(grpc, "efficientnet_lite0_openvino", photos)
    np.testing.assert_array_equal(got.argmax(1), onnx_logits.argmax(1))
    np.testing.assert_allclose(got, onnx_logits, atol=1e-4, rtol=0)
    pt2 = _infer(grpc, "efficientnet_lite0_pt2", photos)
    np.testing.assert_array_equal(pt2.argmax(1), onnx_logits.argmax(1))


@pytest.mark.parametrize("model", list(MODELS))
def test_wrong_dtype_or_shape_is_400_naming_the_input(
    http: httpclient.InferenceServerClient, model: str
) -> None:
    x, _, _ = _golden(model)
    name = MODELS[model][2]
    wrong = httpclient.InferInput(name, list(x[:1].shape), "FP64")
    wrong.set_data_from_numpy(x[:1].astype(np.float64))
    with pytest.raises(InferenceServerException) as e:
        http.infer(model, [wrong])
    assert e.value.status() == "400" and name in e.value.message()
    bad_shape = x[:1, ..., :-1].copy()
    with pytest.raises(InferenceServerException) as e:
        _infer(http, model, bad_shape)
    assert e.value.status() == "400" and name in e.value.message()
    assert http.is_model_ready(model)


@pytest.mark.parametrize(
    ("model", "needles"),
    [
        ("ov_corrupt", ["model 'ov_corrupt'", "OpenVINO cannot read", "model.xml"]),
        ("tf_corrupt", ["model 'tf_corrupt'", "TensorFlow cannot load", "model.savedmodel"]),
        ("pt2_corrupt", ["model 'pt2_corrupt'", "model.pt2", "torch.export.load refused it"]),
        ("ov_gpu", ["KIND_GPU", "OpenVINO sees no such GPU", "use KIND_CPU"]),
        ("tf_gpu", ["KIND_GPU", "CPU-only build", "use KIND_CPU"]),
    ],
)
def test_load_faults_are_reported_and_the_rest_serves(
    http: httpclient.InferenceServerClient, model: str, needles: list[str]
) -> None:
    rows = {row["name"]: row for row in http.get_model_repository_index()}
    assert rows[model]["state"] == "UNAVAILABLE", rows[model]
    for needle in needles:
        assert needle in rows[model]["reason"], rows[model]
    assert not http.is_model_ready(model)
    assert all(http.is_model_ready(m) for m in MODELS) and http.is_server_ready()
