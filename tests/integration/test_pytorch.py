"""The PyTorch backend through a real pdserve (issue 16, item 1).

efficientnet_lite0_torch (TorchScript, built by examples/build.py) on the real photos,
the image pipeline with the TorchScript predictor, small TorchScript and ``model.py``
models for the naming conventions, and the load faults: a corrupt file, a file from a
newer torch, a model asking for ``cuda:3`` on a machine without it. The server and the
other models carry on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import pytorch_models as pm
from tests.conftest import GOLDENS, ServerProcess, copy_models, start_server

pytest.importorskip("torch")

TORCH_MODEL = "efficientnet_lite0_torch"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("pytorch")
    repo = copy_models(
        tmp / "repo", TORCH_MODEL, "preprocess", "postprocess", "image_classifier_torch"
    )
    pm.add_sub(repo, inputs=["INPUT__1", "INPUT__0"])
    pm.named_args(repo)
    pm.dict_input(repo)
    pm.raises_on_negative(repo)
    pm.python_runtime(repo)
    # faults: each fails to load with its reason; the rest serve
    good = pm.add_sub(tmp / "src")
    pm.corrupt_copy(good / "1" / "model.pt", pm.add_sub(repo, "pt_corrupt") / "1" / "model.pt")
    pm.newer_version_copy(good / "1" / "model.pt", pm.add_sub(repo, "pt_newer") / "1" / "model.pt")
    pm.add_sub(repo, "pt_cuda3", extra="instance_group [ { kind: KIND_GPU, gpus: [ 3 ] } ]\n")
    srv = start_server(repo, tmp / "pdserve.log")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, concurrency=8, network_timeout=120)


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDENS / f"{TORCH_MODEL}.npz") as data:
        return {k: data[k] for k in data.files}


def _http_input(name: str, array: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array, binary_data=True)
    return tensor


def test_config_is_served_as_written_with_defaults(http: httpclient.InferenceServerClient) -> None:
    cfg = http.get_model_config(TORCH_MODEL)
    assert (cfg["platform"], cfg["backend"]) == ("pytorch_libtorch", "pytorch")
    assert [i["name"] for i in cfg["input"]] == ["INPUT__0"]
    assert cfg["instance_group"][0]["kind"] == "KIND_CPU"  # KIND_AUTO: no GPU here
    assert cfg["default_model_filename"] == "model.pt"


def test_golden_logits_and_top1_on_the_photos(
    server: ServerProcess, http: httpclient.InferenceServerClient, golden: dict
) -> None:
    inputs, logits = golden["inputs"], golden["logits"]
    got = http.infer(TORCH_MODEL, [_http_input("INPUT__0", inputs)]).as_numpy("OUTPUT__0")
    assert got.shape == (len(inputs), 1000)
    np.testing.assert_allclose(got, logits, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.argmax(got, axis=1), golden["top1"])
    # the ONNX twin gave the same logits for the same inputs (examples/build.py)
    with np.load(GOLDENS / "efficientnet_lite0.npz") as onnx_golden:
        np.testing.assert_allclose(got, onnx_golden["onnx_logits"], atol=1e-4, rtol=0)
    # one photo at a time over gRPC
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for i in range(len(inputs)):
        tensor = grpcclient.InferInput("INPUT__0", [1, 3, 224, 224], "FP32")
        tensor.set_data_from_numpy(inputs[i : i + 1])
        one = client.infer(TORCH_MODEL, [tensor]).as_numpy("OUTPUT__0")
        np.testing.assert_allclose(one[0], logits[i], atol=1e-4, rtol=0)
        assert int(np.argmax(one[0])) == int(golden["top1"][i])


def test_image_pipeline_with_the_torchscript_predictor(
    http: httpclient.InferenceServerClient,
) -> None:
    with np.load(GOLDENS / "image_classifier.npz") as data:
        images = {k: data[k] for k in data.files}
    names = list(images["names"])
    raw = [images[f"image_bytes_{n}"].tobytes() for n in names]
    tensor = httpclient.InferInput("input_image_bytes", [len(raw), 1], "BYTES")
    tensor.set_data_from_numpy(np.array(raw, dtype=object).reshape(len(raw), 1))
    result = http.infer("image_classifier_torch", [tensor])
    labels, conf = result.as_numpy("top5_labels"), result.as_numpy("top5_confidences")
    for row in range(len(names)):
        assert labels[row][0].decode() == str(images["top5_labels"][row][0]), names[row]
        np.testing.assert_allclose(conf[row], images["top5_confidences"][row], atol=1e-3)


def test_naming_conventions_and_the_model_py_form(
    http: httpclient.InferenceServerClient, tmp_path: Path
) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    y = np.full((2, 4), 10, dtype=np.float32)
    # INPUT__1 is listed first in the configuration; the index decides
    r = http.infer("pt_add_sub", [_http_input("INPUT__0", x), _http_input("INPUT__1", y)])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT__0"), x + y)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT__1"), x - y)
    r = http.infer("pt_named", [_http_input("x", x), _http_input("y", y)])
    np.testing.assert_array_equal(r.as_numpy("result"), x * 2 + y)
    r = http.infer("pt_dict", [_http_input("left", y), _http_input("right", x)])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT__0"), y - x)
    _, weight = pm.python_runtime(tmp_path)  # the same weights as the served one
    r = http.infer("pt_runtime", [_http_input("INPUT__0", x)])
    np.testing.assert_allclose(r.as_numpy("OUTPUT__0"), x @ weight.T, rtol=1e-6)


def test_model_error_is_500_and_bad_input_400(http: httpclient.InferenceServerClient) -> None:
    x = np.ones((1, 4), dtype=np.float32)
    with pytest.raises(InferenceServerException) as e:
        http.infer("pt_raises", [_http_input("INPUT__0", -x)])
    assert e.value.status() == "500"
    assert "pytorch execution of model 'pt_raises' failed" in e.value.message()
    assert "negative input" in e.value.message()
    np.testing.assert_array_equal(
        http.infer("pt_raises", [_http_input("INPUT__0", x)]).as_numpy("OUTPUT__0"), x + 1
    )
    with pytest.raises(InferenceServerException) as e:  # wrong shape: refused before torch
        http.infer("pt_raises", [_http_input("INPUT__0", np.ones((1, 5), np.float32))])
    assert e.value.status() == "400"
    wrong = httpclient.InferInput("INPUT__0", [1, 4], "FP64")
    wrong.set_data_from_numpy(np.ones((1, 4)), binary_data=True)
    with pytest.raises(InferenceServerException) as e:
        http.infer("pt_raises", [wrong])
    assert e.value.status() == "400"


@pytest.mark.parametrize(
    ("model", "needles"),
    [
        ("pt_corrupt", ["model 'pt_corrupt'", "model.pt", "not a TorchScript archive"]),
        ("pt_newer", ["model 'pt_newer'", "saved by a newer torch", "version 99"]),
        (
            "pt_cuda3",
            ["model 'pt_cuda3'", "KIND_GPU (cuda:3)", "CPU-only build", "use KIND_CPU"],
        ),
    ],
)
def test_load_faults_are_reported_and_the_rest_serves(
    server: ServerProcess, http: httpclient.InferenceServerClient, model: str, needles: list[str]
) -> None:
    rows = {row["name"]: row for row in http.get_model_repository_index()}
    assert rows[model]["state"] == "UNAVAILABLE", rows[model]
    for needle in needles:
        assert needle in rows[model]["reason"], rows[model]
    assert needles[-1] in server.log()
    assert not http.is_model_ready(model)
    assert http.is_model_ready(TORCH_MODEL) and http.is_server_ready()
