"""Repository load / unload requests (issue 10, items 10-12 and 14).

* Every malformed request is a 400 / INVALID_ARGUMENT naming the problem, over raw
  HTTP, tritonclient.http and tritonclient.grpc, and no error holds the repository's
  absolute path.
* A load with ``config`` + ``file:`` contents is served from a temporary folder, as
  in Triton: the repository on disk is never written (byte-identical before and
  after, failed or not) and no temporary folder outlives what was loaded from it.
* The configuration ``GET /v2/models/{m}/config`` serves loads back unchanged.
* Decoupled and sequence-batched models fail to load with the reason in the index.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, ServerProcess, copy_models, start_server

PYTHON_MODELS = ROOT / "tests" / "data" / "python_models"

ENSEMBLE = """name: "ens_tiny"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 64 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 64 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "tiny"
      model_version: -1
      input_map { key: "INPUT0" value: "X" }
      output_map { key: "OUTPUT0" value: "Y" }
    }
  ]
}
"""

ECHO_PY = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
{extra}
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""

AUTO_DECOUPLED = """    @staticmethod
    def auto_complete_config(config):
        config.set_model_transaction_policy({"decoupled": True})
        return config
"""

ECHO_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ 1 ] }} ]
{extra}
"""

UNSERVED = {
    "decoupled": ("model_transaction_policy { decoupled: true }", ""),
    "decoupled_auto": ("", AUTO_DECOUPLED),
}


def _echo_model(repo: Path, name: str, config_extra: str, code_extra: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(ECHO_CONFIG.format(name=name, extra=config_extra))
    (repo / name / "1" / "model.py").write_text(ECHO_PY.format(extra=code_extra))


def tree_digest(root: Path) -> dict[str, str]:
    """Every path under ``root`` (folders too) -> sha256 of its bytes (``dir`` for folders)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def staged(tmpdir: Path) -> list[str]:
    """The server's staged ``file:`` folders in its temporary folder."""
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("pdserve-override-"))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    """An explicit-mode server; its TMPDIR is a folder the tests can inspect."""
    tmp = tmp_path_factory.mktemp("load")
    repo = copy_models(tmp / "repository", "tiny", "tiny_all_versions")
    for name in ("identity", "add_sub"):
        shutil.copytree(PYTHON_MODELS / name, repo / name)
    (repo / "ens_tiny" / "1").mkdir(parents=True)
    (repo / "ens_tiny" / "config.pbtxt").write_text(ENSEMBLE)
    for name, (config_extra, code_extra) in UNSERVED.items():
        _echo_model(repo, name, config_extra, code_extra)
    tmpdir = tmp / "tmpdir"
    tmpdir.mkdir()
    loads = ["tiny", "identity", "add_sub", "ens_tiny", *UNSERVED]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmpdir))
        server = start_server(
            repo,
            tmp / "log.txt",
            "--model-control-mode=explicit",
            *(f"--load-model={m}" for m in loads),
        )
    yield server, repo, tmpdir
    assert server.stop() == 0
    assert staged(tmpdir) == []


def raw_post(server: ServerProcess, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body))
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


GOOD = json.dumps({"backend": "onnxruntime", "max_batch_size": 4})
DEEP = "[" * 5000 + "]" * 5000
DEEP_OBJECT = '{"parameters":' * 3000 + "{}" + "}" * 3000

# (model name, load parameters, what the error must say)
MALFORMED: dict[str, tuple[str, dict[str, str], str]] = {
    "config is a JSON array": ("tiny", {"config": "[1, 2]"}, "not a JSON array"),
    "config is a JSON string": ("tiny", {"config": '"tiny"'}, "not a JSON string"),
    "config nested deep (array)": ("tiny", {"config": DEEP}, "nested too deeply"),
    "config nested deep (object)": ("tiny", {"config": DEEP_OBJECT}, "nested too deeply"),
    "config not JSON": ("tiny", {"config": "{nope"}, "not JSON"),
    "config unknown field": ("tiny", {"config": '{"no_such_field": 1}'}, "no_such_field"),
    "config names another model": ("tiny", {"config": '{"name": "x"}'}, "names model 'x'"),
    "blank config with files": (
        "tiny",
        {"config": "  ", "file:1/model.onnx": b64(b"x")},
        "config: empty",
    ),
    "files without config": ("tiny", {"file:1/model.onnx": b64(b"x")}, "require a 'config'"),
    "name too long": ("n" * 300, {}, "300 bytes long"),
    "name too long with files": ("n" * 300, {"config": GOOD, "file:1/x": b64(b"x")}, "bytes long"),
    "file names a folder": ("tiny", {"config": GOOD, "file:1/": b64(b"x")}, "names a folder"),
    "file is a folder of another": (
        "tiny",
        {"config": GOOD, "file:1": b64(b"x"), "file:1/model.onnx": b64(b"x")},
        "names a folder that other",
    ),
    "file path ..": ("tiny", {"config": GOOD, "file:../escape.txt": b64(b"x")}, "'..'"),
    "file path inner ..": (
        "tiny",
        {"config": GOOD, "file:1/../../tiny_all_versions/1/model.onnx": b64(b"x")},
        "'..'",
    ),
    "file path absolute": ("tiny", {"config": GOOD, "file:/tmp/x": b64(b"x")}, "not absolute"),
    "file path NUL": ("tiny", {"config": GOOD, "file:1/a\u0000b": b64(b"x")}, "NUL"),
    "file config.pbtxt": (
        "tiny",
        {"config": GOOD, "file:config.pbtxt": b64(b"garbage")},
        "'config' parameter",
    ),
    "file empty path": ("tiny", {"config": GOOD, "file:": b64(b"x")}, "names no file"),
    "model name NUL": ("ti\u0000ny", {}, "invalid model name"),
    "model name blank": (" ", {}, "empty or blank"),
    "model name ..": ("..", {"config": GOOD, "file:1/x": b64(b"x")}, "invalid model name"),
}


def check_clean(repo: Path, before: dict[str, str], message: str) -> None:
    assert str(repo) not in message and str(repo.resolve()) not in message, message
    assert tree_digest(repo) == before


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_load_is_400_over_raw_http(env, case: str) -> None:
    server, repo, tmpdir = env
    name, params, needle = MALFORMED[case]
    before = tree_digest(repo)
    path = f"/v2/repository/models/{quote(name, safe='')}/load"
    status, body = raw_post(server, path, {"parameters": params})
    assert status == 400, body
    assert needle in body["error"], body
    check_clean(repo, before, body["error"])
    assert staged(tmpdir) == []
    assert httpclient.InferenceServerClient(server.http_url).is_model_ready("tiny")


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_load_is_invalid_argument_over_grpc(env, case: str) -> None:
    server, repo, tmpdir = env
    name, params, needle = MALFORMED[case]
    before = tree_digest(repo)
    config = params.get("config")
    files = {k: base64.b64decode(v) for k, v in params.items() if k.startswith("file:")}
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.load_model(name, config=config, files=files or None)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value
    assert needle in err.value.message(), err.value
    check_clean(repo, before, err.value.message())
    assert staged(tmpdir) == []
    assert client.is_model_ready("tiny")


def test_malformed_load_over_tritonclient_http(env) -> None:
    server, repo, _ = env
    client = httpclient.InferenceServerClient(server.http_url)
    before = tree_digest(repo)
    for config, files, needle in [
        ("[]", None, "not a JSON array"),
        (GOOD, {"file:1/../x": b"x"}, "'..'"),
        (GOOD, {"file:1": b"x", "file:1/y": b"y"}, "names a folder"),
        ("", {"file:1/model.onnx": b"x"}, "config: empty"),
    ]:
        with pytest.raises(InferenceServerException) as err:
            client.load_model("tiny", config=config, files=files)
        assert err.value.status() == "400", err.value
        assert needle in err.value.message()
        check_clean(repo, before, err.value.message())


@pytest.mark.parametrize("name", ["n" * 300, "a\u0000b", "..", " "])
def test_malformed_unload_is_400(env, name: str) -> None:
    server, repo, _ = env
    status, body = raw_post(server, f"/v2/repository/models/{quote(name, safe='')}/unload", {})
    assert status == 400 and "invalid model name" in body["error"], body
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.unload_model(name)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "invalid model name" in err.value.message()
    assert str(repo) not in err.value.message()


def test_failed_file_load_changes_nothing_on_disk(env) -> None:
    """A ``config`` + ``file:`` load that fails leaves the repository byte-identical,
    no staged folder behind, and the serving version in place."""
    server, repo, tmpdir = env
    before = tree_digest(repo)
    cfg = httpclient.InferenceServerClient(server.http_url).get_model_config("tiny")
    params = {
        "config": json.dumps(cfg),
        "file:3/model.onnx": b64(b"not a model"),
        "file:labels.txt": b64(b"a\nb\n"),
    }
    status, body = raw_post(server, "/v2/repository/models/tiny/load", {"parameters": params})
    assert status == 400, body
    assert "version 3" in body["error"] and "<override>/tiny/3/model.onnx" in body["error"]
    check_clean(repo, before, body["error"])
    assert staged(tmpdir) == []
    assert not any(".pdserve-tmp" in p for p in tree_digest(repo))
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.get_model_metadata("tiny")["versions"] == ["2"]
    rows = {(r["name"], r.get("version")): r for r in client.get_model_repository_index()}
    assert rows[("tiny", "2")]["state"] == "READY"  # kept serving
    assert rows[("tiny", "3")]["state"] == "UNAVAILABLE"
    assert "<override>/tiny/3/model.onnx" in rows[("tiny", "3")]["reason"]
    assert str(repo) not in json.dumps(list(rows.values()))


def test_file_load_serves_from_a_staged_folder_until_unloaded(env) -> None:
    """Triton's override: the model loads from the request's files alone; the staged
    folder lives while a version loaded from it serves and is removed after."""
    server, repo, tmpdir = env
    before = tree_digest(repo)
    onnx = (repo / "tiny_all_versions" / "3" / "model.onnx").read_bytes()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    cfg = client.get_model_config("tiny", as_json=True)["config"]
    cfg["name"] = "uploaded"
    client.load_model("uploaded", config=json.dumps(cfg), files={"file:7/model.onnx": onnx})
    assert list(client.get_model_metadata("uploaded").versions) == ["7"]
    x = np.ones((1, 64), np.float32)
    inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    assert client.infer("uploaded", [inp]).as_numpy("OUTPUT0").shape == (1, 64)
    assert len(staged(tmpdir)) == 1
    assert tree_digest(repo) == before  # nothing written into the repository
    assert not (repo / "uploaded").exists()
    client.unload_model("uploaded")
    deadline = time.monotonic() + 30  # the retired version closes in the background
    while staged(tmpdir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert staged(tmpdir) == []


ROUND_TRIP = ["tiny", "identity", "add_sub", "ens_tiny"]


@pytest.mark.parametrize("model", ROUND_TRIP)
def test_served_config_loads_back_over_http(env, model: str) -> None:
    server, _, _ = env
    client = httpclient.InferenceServerClient(server.http_url)
    cfg = client.get_model_config(model)
    client.load_model(model, config=json.dumps(cfg))
    assert client.is_model_ready(model)
    assert client.get_model_config(model) == cfg  # a fixed point


@pytest.mark.parametrize("model", ROUND_TRIP)
def test_served_config_loads_back_over_grpc(env, model: str) -> None:
    server, _, _ = env
    client = grpcclient.InferenceServerClient(server.grpc_url)
    cfg = client.get_model_config(model, as_json=True)["config"]
    client.load_model(model, config=json.dumps(cfg))
    assert client.is_model_ready(model)
    assert client.get_model_config(model, as_json=True)["config"] == cfg


def test_override_errors_name_the_override(env) -> None:
    """An edited served config that no longer validates: the error names the
    override and the field, not config.pbtxt, and what served keeps serving."""
    server, repo, _ = env
    client = httpclient.InferenceServerClient(server.http_url)
    cfg = client.get_model_config("identity")
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [8]  # filled in
    cfg["max_batch_size"] = 2
    with pytest.raises(InferenceServerException) as err:
        client.load_model("identity", config=json.dumps(cfg))
    message = err.value.message()
    assert "<config override>: dynamic_batching.preferred_batch_size" in message
    assert "config.pbtxt" not in message and str(repo) not in message
    assert client.is_model_ready("identity")


@pytest.mark.parametrize("model", ["decoupled", "decoupled_auto"])
def test_decoupled_python_models_load(env, model: str) -> None:
    """Decoupled python models are served (streaming: tests/integration/test_decoupled.py)."""
    server, _, _ = env
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_model_ready(model)
    assert client.get_model_config(model)["model_transaction_policy"]["decoupled"] is True


def test_override_adding_sequence_batching_is_refused(env) -> None:
    server, _, _ = env
    client = httpclient.InferenceServerClient(server.http_url)
    cfg = client.get_model_config("tiny")
    cfg.pop("dynamic_batching", None)
    cfg["sequence_batching"] = {"iterative_sequence": True}  # served, but not iterative
    with pytest.raises(InferenceServerException) as err:
        client.load_model("tiny", config=json.dumps(cfg))
    assert "sequence_batching" in err.value.message()
    assert client.get_model_metadata("tiny")["versions"] == ["2"]
