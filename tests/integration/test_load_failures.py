"""Models that fail to load are reported with their reason; the others serve (issue 2)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from pdserve.backends.devices import visible_gpu_count
from tests.conftest import ROOT, copy_models, start_server
from tests.goldens import tiny_reference

PYTHON_MODELS = ROOT / "tests" / "data" / "python_models"


def _variant(
    repo: Path, src: str, name: str, extra: str = "", replace: tuple[str, str] | None = None
) -> None:
    shutil.copytree(repo / src, repo / name)
    cfg = (repo / name / "config.pbtxt").read_text().replace(f'name: "{src}"', f'name: "{name}"')
    if replace:
        cfg = cfg.replace(*replace)
    (repo / name / "config.pbtxt").write_text(cfg + extra)


@pytest.fixture(scope="module")
def broken_repo_server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("broken")
    repo = copy_models(tmp / "repo", "tiny")
    # KIND_GPU on a machine (or onnxruntime build) without CUDA
    _variant(repo, "tiny", "tiny_gpu", "instance_group [{ count: 1, kind: KIND_GPU }]\n")
    # dims that disagree with the model file
    _variant(
        repo,
        "tiny",
        "tiny_bad_dims",
        replace=("dims: [ 64 ]\n  }\n]\noutput", "dims: [ 32 ]\n  }\n]\noutput"),
    )
    # an unknown platform
    _variant(
        repo,
        "tiny",
        "tiny_bad_platform",
        replace=('platform: "onnxruntime_onnx"', 'platform: "tensorrt_magic"'),
    )
    # a PyTorch model whose version folder holds no model.pt (tiny's model.onnx only)
    _variant(
        repo,
        "tiny",
        "tiny_pytorch",
        replace=('platform: "onnxruntime_onnx"', 'platform: "pytorch_libtorch"'),
    )
    # duplicate input names
    _variant(
        repo,
        "tiny",
        "tiny_dup_input",
        'input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 64 ] }]\n',
    )
    # a config that does not parse
    _variant(repo, "tiny", "tiny_syntax", "this is { not pbtxt\n")
    # a python model on KIND_GPU where no GPU is visible (this machine, CI)
    shutil.copytree(PYTHON_MODELS / "identity", repo / "identity_gpu")
    cfg = (repo / "identity_gpu" / "config.pbtxt").read_text()
    cfg = re.sub(r"instance_group \[[^\]]*\]", "", cfg).replace('"identity"', '"identity_gpu"')
    (repo / "identity_gpu" / "config.pbtxt").write_text(
        cfg + "instance_group [{ count: 1, kind: KIND_GPU, gpus: [ 1 ] }]\n"
    )
    server = start_server(repo, tmp / "log.txt")
    yield server
    assert server.stop() == 0


def _index(server) -> dict[str, dict]:
    client = httpclient.InferenceServerClient(server.http_url)
    return {row["name"]: row for row in client.get_model_repository_index()}


def test_good_model_still_serves(broken_repo_server) -> None:
    client = httpclient.InferenceServerClient(broken_repo_server.http_url)
    assert client.is_server_ready()
    x = np.full((1, 64), 0.5, dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    out = client.infer("tiny", [inp]).as_numpy("OUTPUT0")
    np.testing.assert_allclose(out, tiny_reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("model", "needles"),
    [
        ("tiny_gpu", ["KIND_GPU", "CUDAExecutionProvider"]),
        ("tiny_bad_dims", ["config.pbtxt", "INPUT0", "32"]),
        ("tiny_bad_platform", ["config.pbtxt", "platform", "tensorrt_magic"]),
        ("tiny_pytorch", ["model.pt", "does not exist"]),
        ("tiny_dup_input", ["config.pbtxt", "INPUT0"]),
        ("tiny_syntax", ["config.pbtxt"]),
    ],
)
def test_failed_model_reports_reason(broken_repo_server, model: str, needles: list[str]) -> None:
    row = _index(broken_repo_server)[model]
    assert row.get("state") == "UNAVAILABLE", row
    for needle in needles:
        assert needle in row["reason"], row
    assert needle in broken_repo_server.log()
    client = httpclient.InferenceServerClient(broken_repo_server.http_url)
    assert not client.is_model_ready(model)
    inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 64), dtype=np.float32))
    with pytest.raises(InferenceServerException):
        client.infer(model, [inp])


@pytest.mark.skipif(visible_gpu_count() >= 2, reason="GPU 1 exists here")
def test_python_model_on_a_missing_gpu_fails_to_load(broken_repo_server) -> None:
    row = _index(broken_repo_server)["identity_gpu"]
    assert row.get("state") == "UNAVAILABLE", row
    for needle in ("identity_gpu", "KIND_GPU on GPU 1", "use KIND_CPU"):
        assert needle in row["reason"], row
    assert not httpclient.InferenceServerClient(broken_repo_server.http_url).is_model_ready(
        "identity_gpu"
    )
