"""The repository API refuses model names that would escape the repository, and
version strings are plain ASCII digits (QA findings)."""

from __future__ import annotations

import base64
import http.client
import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, copy_models, start_server


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("safety")
    repo = copy_models(tmp / "work" / "repo", "tiny")
    server = start_server(
        repo, tmp / "log.txt", "--model-control-mode", "explicit", "--load-model", "tiny"
    )
    yield server, repo
    assert server.stop() == 0


def _raw_post(server: ServerProcess, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request(
            "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


@pytest.mark.parametrize("name", ["..", ".", ".hidden"])
def test_http_load_refuses_escaping_names(explicit_server, name: str) -> None:
    server, repo = explicit_server
    config = json.dumps({"backend": "onnxruntime", "max_batch_size": 4})
    payload = base64.b64encode(b"owned").decode()
    status, body = _raw_post(
        server,
        f"/v2/repository/models/{name}/load",
        {"parameters": {"config": config, "file:1/pwn.txt": payload}},
    )
    assert status == 400, body
    assert "invalid model name" in body["error"]
    assert not (repo.parent / "1" / "pwn.txt").exists()
    assert not (repo / "1" / "pwn.txt").exists()
    names = {
        row["name"]
        for row in httpclient.InferenceServerClient(server.http_url).get_model_repository_index()
    }
    assert names == {"tiny"}


@pytest.mark.parametrize("name", ["/tmp/pdserve_abs_target", "../../escape", "a/b"])
def test_grpc_load_refuses_paths(explicit_server, name: str, tmp_path: Path) -> None:
    server, _ = explicit_server
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.load_model(
            name, config=json.dumps({"backend": "onnxruntime"}), files={"1/x.txt": b"x"}
        )
    assert "INVALID_ARGUMENT" in str(err.value.status())
    assert not Path("/tmp/pdserve_abs_target").exists()
    assert client.is_model_ready("tiny")


@pytest.mark.parametrize("version", ["+2", "%D9%A2", "2_0", "%202"])
def test_version_must_be_ascii_digits(explicit_server, version: str) -> None:
    server, _ = explicit_server
    body = {
        "inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]
    }
    status, resp = _raw_post(server, f"/v2/models/tiny/versions/{version}/infer", body)
    assert status == 400, resp
    assert "not a number" in resp["error"]
    status, resp = _raw_post(server, "/v2/models/tiny/versions/2/infer", body)
    assert status == 200, resp


def test_metadata_lists_only_served_extensions(explicit_server) -> None:
    server, _ = explicit_server
    ext = set(httpclient.InferenceServerClient(server.http_url).get_server_metadata()["extensions"])
    assert {"binary_tensor_data", "classification", "statistics", "model_repository"} <= ext
    assert "logging" in ext  # served: GET /v2/logging (tests/integration/test_logging.py)
    assert "trace" in ext  # the trace extension (issue 17)
    assert "log_info" in httpclient.InferenceServerClient(server.http_url).get_log_settings()
    assert not ext & {"system_shared_memory", "cuda_shared_memory"}
    x = np.zeros((1, 64), dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    assert httpclient.InferenceServerClient(server.http_url).infer("tiny", [inp]).as_numpy(
        "OUTPUT0"
    ).shape == (1, 64)
