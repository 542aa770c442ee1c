"""Model control modes, the repository API over HTTP, warm-up, readiness, rollback (issue 5)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import EXAMPLE_REPO, GOLDENS, ROOT, ServerProcess, copy_models, start_server

POLL = "0.2"


def http(server: ServerProcess, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One HTTP call; returns (status, parsed JSON body or None)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, (json.loads(raw) if raw.strip() else None)


def index(server: ServerProcess) -> dict[tuple[str, str | None], dict[str, str]]:
    """Repository index rows keyed by (name, version)."""
    status, rows = http(server, "POST", "/v2/repository/index", {})
    assert status == 200
    return {(r["name"], r.get("version")): r for r in rows}


def versions(server: ServerProcess, model: str) -> list[str] | None:
    """Served versions of ``model`` (None when it is not served)."""
    status, meta = http(server, "GET", f"/v2/models/{model}")
    return meta["versions"] if status == 200 else None


def wait_for(check: Callable[[], Any], timeout: float = 30, what: str = "") -> Any:
    """Poll ``check`` until it returns a truthy value; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or check}")
        time.sleep(0.05)


def infer_tiny(server: ServerProcess, model: str = "tiny") -> tuple[str, np.ndarray]:
    """One request of ones; returns (model_version, OUTPUT0)."""
    c = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(np.ones((1, 64), np.float32))
    r = c.infer(model, [inp])
    return r.get_response()["model_version"], r.as_numpy("OUTPUT0")


def tiny_out(scale: float, offset: float = 0.0) -> np.ndarray:
    w = np.load(GOLDENS / "tiny.npz")["W"]
    return np.maximum(np.ones((1, 64), np.float32) @ (scale * w), 0) + offset


def publish(src: Path, dst: Path) -> None:
    """Copy ``src`` next to ``dst`` under a hidden name, then rename it into place."""
    stage = dst.parent / f".stage-{dst.name}"
    shutil.copytree(src, stage)
    os.replace(stage, dst)


# -- none mode and flags -------------------------------------------------------------


def test_none_mode_refuses_load_unload(example_server: ServerProcess) -> None:
    for action in ("load", "unload"):
        status, body = http(example_server, "POST", f"/v2/repository/models/tiny/{action}", {})
        assert status == 503
        assert "explicit model load / unload is not allowed" in body["error"]
    assert versions(example_server, "tiny") == ["2"]


def test_load_model_flag_requires_explicit(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "repo", "tiny")
    server = start_server(repo, tmp_path / "log", "--load-model=tiny", wait_ready=False)
    assert server.proc.wait(60) == 2
    assert "requires setting '--model-control-mode=explicit'" in server.log()


# -- explicit mode -------------------------------------------------------------------


@pytest.fixture(scope="module")
def explicit(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("explicit")
    repo = copy_models(root / "repo", "tiny", "tiny_all_versions", "digits")
    server = start_server(
        repo,
        root / "log",
        "--model-control-mode=explicit",
        "--load-model=tiny",
        "--strict-readiness",
    )
    yield server
    assert server.stop() == 0


def test_explicit_loads_only_what_is_asked(explicit: ServerProcess) -> None:
    rows = index(explicit)
    assert rows[("tiny", "2")]["state"] == "READY"
    assert rows[("digits", None)] == {"name": "digits"}  # on disk, never loaded
    assert versions(explicit, "digits") is None
    status, _ = http(explicit, "GET", "/v2/models/digits/ready")
    assert status == 400
    status, _ = http(explicit, "GET", "/v2/health/ready")
    assert status == 200  # strict readiness counts models meant to be loaded only


def test_explicit_load_override_and_unload_over_http(explicit: ServerProcess) -> None:
    assert http(explicit, "POST", "/v2/repository/models/tiny_all_versions/load", {})[0] == 200
    assert versions(explicit, "tiny_all_versions") == ["1", "2", "3"]
    _, cfg = http(explicit, "GET", "/v2/models/tiny_all_versions/config")
    cfg["version_policy"] = {"specific": {"versions": [1, 3]}}
    body = {"parameters": {"config": json.dumps(cfg)}}
    assert http(explicit, "POST", "/v2/repository/models/tiny_all_versions/load", body)[0] == 200
    assert versions(explicit, "tiny_all_versions") == ["1", "3"]
    wait_for(lambda: ("tiny_all_versions", "2") not in index(explicit), 10, "v2 to be retired")
    status, body = http(
        explicit,
        "POST",
        "/v2/repository/models/tiny_all_versions/unload",
        {"parameters": {"unload_dependents": False}},
    )
    assert status == 200
    assert versions(explicit, "tiny_all_versions") is None
    # the versions drain and close in the background; then the model's row remains
    wait_for(lambda: ("tiny_all_versions", None) in index(explicit), 10, "the unload to finish")
    row = index(explicit)[("tiny_all_versions", None)]
    assert row["state"] == "UNAVAILABLE" and row["reason"] == "unloaded"
    status, body = http(explicit, "POST", "/v2/repository/models/tiny_all_versions/unload", {})
    assert status == 400 and "not loaded" in body["error"]
    status, body = http(explicit, "POST", "/v2/repository/models/no_such/load", {})
    assert status == 400 and "no_such" in body["error"]
    assert ("no_such", None) not in index(explicit)
    assert http(explicit, "GET", "/v2/health/ready")[0] == 200


def test_rollback_cli(explicit: ServerProcess) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pdserve", "rollback", *args, "--url", explicit.http_url],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    assert versions(explicit, "tiny") == ["2"]
    done = cli("tiny", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "serving versions 1" in done.stdout
    assert versions(explicit, "tiny") == ["1"]
    version, out = infer_tiny(explicit)
    assert version == "1"
    np.testing.assert_allclose(out, tiny_out(1.0), rtol=1e-5, atol=1e-4)
    bad = cli("tiny", "9")  # no such version folder: nothing changes
    assert bad.returncode == 1 and "no version folder" in bad.stdout
    assert versions(explicit, "tiny") == ["1"]
    assert cli("tiny", "--unpin").returncode == 0
    assert versions(explicit, "tiny") == ["2"]


def test_strict_readiness(tmp_path: Path) -> None:
    """A model that fails keeps a strict server not ready; the others serve and are ready."""
    repo = copy_models(tmp_path / "repo", "tiny", "digits")
    (repo / "digits" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    server = start_server(repo, tmp_path / "log", "--strict-readiness", wait_ready=False)
    try:
        wait_for(lambda: index_or_none(server), 60, "the server to answer")
        wait_for(
            lambda: (
                index(server).get(("digits", "1"), {}).get("state") == "UNAVAILABLE"
                and index(server).get(("tiny", "2"), {}).get("state") == "READY"
            ),
            60,
            "the initial load to finish",
        )
        assert http(server, "GET", "/v2/health/live")[0] == 200
        assert http(server, "GET", "/v2/health/ready")[0] == 400
        assert http(server, "GET", "/v2/models/tiny/ready")[0] == 200
        assert http(server, "GET", "/v2/models/digits/ready")[0] == 400
        assert infer_tiny(server)[0] == "2"
        row = index(server)[("digits", "1")]
        assert row["state"] == "UNAVAILABLE" and "onnx" in row["reason"].lower()
    finally:
        assert server.stop() == 0
    relaxed = start_server(repo, tmp_path / "log2")  # not strict: ready with digits down
    try:
        assert http(relaxed, "GET", "/v2/health/ready")[0] == 200
    finally:
        relaxed.stop()


def index_or_none(server: ServerProcess) -> Any:
    try:
        return index(server)
    except OSError:
        return None


# -- poll mode -----------------------------------------------------------------------

WARMUP_OK = """
model_warmup [ {
  name: "zeros"
  batch_size: 4
  count: 2
  inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 64 ] zero_data: true } }
} ]
"""
WARMUP_BAD = """
model_warmup [ {
  name: "wrong"
  batch_size: 1
  inputs { key: "NOPE" value: { data_type: TYPE_FP32 dims: [ 64 ] random_data: true } }
} ]
"""


@pytest.fixture(scope="module")
def polled(tmp_path_factory: pytest.TempPathFactory) -> tuple[ServerProcess, Path]:
    root = tmp_path_factory.mktemp("poll")
    repo = copy_models(root / "repo", "tiny", "tiny_all_versions")
    server = start_server(
        repo, root / "log", "--model-control-mode=poll", f"--repository-poll-secs={POLL}"
    )
    yield server, repo
    assert server.stop() == 0


def test_poll_add_and_remove_model(polled: tuple[ServerProcess, Path]) -> None:
    server, repo = polled
    publish(EXAMPLE_REPO / "digits", repo / "digits")
    wait_for(lambda: versions(server, "digits") == ["1"], 30, "digits to appear")
    status, _ = http(server, "POST", "/v2/repository/models/digits/unload", {})
    assert status == 503  # poll mode: the API does not control models
    shutil.rmtree(repo / "digits")
    wait_for(lambda: versions(server, "digits") is None, 30, "digits to go")
    assert versions(server, "tiny") == ["2"]


def test_poll_config_change_and_in_place_file_change(polled: tuple[ServerProcess, Path]) -> None:
    server, repo = polled
    cfg_path = repo / "tiny" / "config.pbtxt"
    original = cfg_path.read_text()
    cfg_path.write_text(original + "\nversion_policy: { all: {} }\n")
    wait_for(lambda: versions(server, "tiny") == ["1", "2"], 30, "policy 'all'")
    cfg_path.write_text(original)
    wait_for(lambda: versions(server, "tiny") == ["2"], 30, "policy back to latest")
    # same version folder, new model file: reloaded beside the serving one
    np.testing.assert_allclose(infer_tiny(server)[1], tiny_out(2.0), rtol=1e-5, atol=1e-4)
    src = repo / "tiny_all_versions" / "3" / "model.onnx"
    stage = repo / "tiny" / "2" / ".model.onnx.new"
    shutil.copyfile(src, stage)
    os.replace(stage, repo / "tiny" / "2" / "model.onnx")
    wait_for(
        lambda: np.allclose(infer_tiny(server)[1], tiny_out(1.0, 3.0), atol=1e-4),
        30,
        "the rewritten v2 to serve",
    )
    assert versions(server, "tiny") == ["2"]


def test_poll_version_folder_removed(polled: tuple[ServerProcess, Path]) -> None:
    """Removing a served version folder retires that version (policy 'all')."""
    server, repo = polled
    assert versions(server, "tiny_all_versions") == ["1", "2", "3"]
    shutil.rmtree(repo / "tiny_all_versions" / "1")
    wait_for(lambda: versions(server, "tiny_all_versions") == ["2", "3"], 30, "v1 retired")
    wait_for(lambda: ("tiny_all_versions", "1") not in index(server), 10, "v1 out of the index")
    assert http(server, "GET", "/v2/models/tiny_all_versions/versions/1/ready")[0] == 400


def test_poll_broken_version_keeps_serving_and_fix_is_picked_up(
    polled: tuple[ServerProcess, Path],
) -> None:
    server, repo = polled
    model = repo / "tiny_all_versions"
    (model / "config.pbtxt").write_text(
        (model / "config.pbtxt").read_text().replace("version_policy: { all: {} }", "")
    )
    wait_for(lambda: versions(server, "tiny_all_versions") == ["3"], 30, "latest policy")
    broken = repo / ".broken4"
    broken.mkdir()
    (broken / "model.onnx").write_bytes(b"garbage")
    os.replace(broken, model / "4")
    wait_for(
        lambda: index(server).get(("tiny_all_versions", "4"), {}).get("state") == "UNAVAILABLE",
        30,
        "v4 to fail",
    )
    rows = index(server)
    assert rows[("tiny_all_versions", "3")]["state"] == "READY"
    assert versions(server, "tiny_all_versions") == ["3"]
    assert infer_tiny(server, "tiny_all_versions")[0] == "3"
    # the fix: a good model file in v4 (the v1 graph: output + 1)
    shutil.rmtree(model / "4")
    publish(EXAMPLE_REPO / "tiny_all_versions" / "1", model / "4")
    wait_for(lambda: versions(server, "tiny_all_versions") == ["4"], 30, "fixed v4")
    version, out = infer_tiny(server, "tiny_all_versions")
    assert version == "4"
    np.testing.assert_allclose(out, tiny_out(1.0, 1.0), rtol=1e-5, atol=1e-4)
    assert ("tiny_all_versions", "3") not in wait_for(
        lambda: (lambda r: r if ("tiny_all_versions", "3") not in r else None)(index(server)),
        10,
        "v3 retired",
    )


def test_poll_warmup(polled: tuple[ServerProcess, Path]) -> None:
    """A configured warm-up runs before the switch; one that fails keeps the old config."""
    server, repo = polled
    cfg_path = repo / "tiny" / "config.pbtxt"
    original = cfg_path.read_text()
    cfg_path.write_text(original + WARMUP_OK)
    wait_for(
        lambda: http(server, "GET", "/v2/models/tiny/config")[1].get("model_warmup"),
        30,
        "the config with warm-up",
    )
    assert "warmed up tiny version 2: 1 sample on 2 instances" in server.log()
    cfg_path.write_text(original + WARMUP_BAD)
    wait_for(
        lambda: "warm-up sample 'wrong'" in index(server)[("tiny", "2")].get("reason", ""),
        30,
        "failed warm-up in the index",
    )
    row = index(server)[("tiny", "2")]
    assert row["state"] == "READY"  # the previous tiny v2 still serves
    _, cfg = http(server, "GET", "/v2/models/tiny/config")
    assert cfg["model_warmup"][0]["name"] == "zeros"
    assert infer_tiny(server)[0] == "2"
    cfg_path.write_text(original)
    wait_for(
        lambda: not http(server, "GET", "/v2/models/tiny/config")[1].get("model_warmup"),
        30,
        "the config without warm-up",
    )
    # A READY version has no reason, so the index omits it (as Triton).
    # (memory_bytes / memory_source: pdserve's addition, issue 16)
    row = {k: v for k, v in index(server)[("tiny", "2")].items() if not k.startswith("memory_")}
    assert row == {"name": "tiny", "version": "2", "state": "READY"}


IMAGE_MODELS = ("preprocess", "efficientnet_lite0", "postprocess", "image_classifier")


def prep_ensemble(name: str, step: str) -> str:
    """config.pbtxt of an ensemble of one step, ``step``: preprocess's own tensors
    (``step`` is preprocess, or an ensemble made by this function)."""
    return f"""name: "{name}"
platform: "ensemble"
max_batch_size: 32
input [ {{ name: "input_image_bytes" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "image_tensor" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] }} ]
ensemble_scheduling {{
  step [
    {{
      model_name: "{step}"
      model_version: -1
      input_map {{ key: "input_image_bytes" value: "input_image_bytes" }}
      output_map {{ key: "image_tensor" value: "image_tensor" }}
    }}
  ]
}}
"""


def add_model(repo: Path, name: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)


def unload(server: ServerProcess, model: str, dependents: bool | None = None) -> int:
    body = {} if dependents is None else {"parameters": {"unload_dependents": dependents}}
    status, answer = http(server, "POST", f"/v2/repository/models/{model}/unload", body)
    assert status == 200, answer
    return status


def unloaded_reason(server: ServerProcess, model: str) -> str:
    """The index reason of ``model`` once it is unloaded (waits for its retirement)."""
    row = wait_for(
        lambda: (r := index(server).get((model, None))) and r.get("state") == "UNAVAILABLE" and r,
        30,
        f"{model} unloaded in the index",
    )
    return str(row["reason"])


def classify(server: ServerProcess) -> None:
    """One photo through image_classifier: PyTorch's top-1 and top-5 confidences."""
    images = np.load(GOLDENS / "image_classifier.npz")
    name = str(images["names"][0])
    tensor = httpclient.InferInput("input_image_bytes", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[images[f"image_bytes_{name}"].tobytes()]], object))
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    result = client.infer("image_classifier", [tensor])
    labels = [x.decode() for x in result.as_numpy("top5_labels")[0]]
    assert labels[0] == str(images["top5_labels"][0][0])
    np.testing.assert_allclose(
        result.as_numpy("top5_confidences")[0], images["top5_confidences"][0], atol=1e-3
    )


def test_explicit_load_of_an_ensemble_loads_its_steps(tmp_path: Path) -> None:
    """Loading an ensemble loads its steps first (Triton); unloading it leaves them;
    unloading a step unloads the ensemble, which says why in the index."""
    repo = copy_models(tmp_path / "repo", *IMAGE_MODELS)
    server = start_server(repo, tmp_path / "log", "--model-control-mode=explicit")
    try:
        assert all(versions(server, m) is None for m in IMAGE_MODELS)
        status, body = http(server, "POST", "/v2/repository/models/image_classifier/load", {})
        assert status == 200, body
        for model in IMAGE_MODELS:
            assert versions(server, model) == ["1"], model
            assert index(server)[(model, "1")]["state"] == "READY"
        classify(server)

        # without unload_dependents the steps stay
        unload(server, "image_classifier", dependents=False)
        assert unloaded_reason(server, "image_classifier") == "unloaded"
        for model in IMAGE_MODELS[:3]:
            assert versions(server, model) == ["1"], model

        # a step goes: so does the ensemble (Triton marks it invalid and unloads it)
        assert http(server, "POST", "/v2/repository/models/image_classifier/load", {})[0] == 200
        unload(server, "efficientnet_lite0")
        assert versions(server, "image_classifier") is None
        assert unloaded_reason(server, "image_classifier") == (
            "unloaded: ensemble 'image_classifier' contains models that are not available: "
            "efficientnet_lite0"
        )
        assert versions(server, "preprocess") == ["1"]
        assert versions(server, "postprocess") == ["1"]
        assert "contains models that are not available" in server.log()
    finally:
        assert server.stop() == 0


def test_unload_dependents_unloads_the_steps_loaded_for_the_ensemble(tmp_path: Path) -> None:
    """``unload_dependents`` on an ensemble unloads its steps that were loaded only for
    it, not one loaded by name nor one another loaded ensemble uses; recursively
    (ensembles of ensembles), as are the ensembles a step's unload takes down. A step
    that cannot load fails the ensemble's load, saying which."""
    repo = copy_models(tmp_path / "repo", *IMAGE_MODELS)
    add_model(repo, "prep", prep_ensemble("prep", "preprocess"))
    add_model(repo, "prep_outer", prep_ensemble("prep_outer", "prep"))
    add_model(repo, "broken", prep_ensemble("broken", "no_such_step"))
    server = start_server(
        repo, tmp_path / "log", "--model-control-mode=explicit", "--load-model=postprocess"
    )

    def load(model: str) -> None:
        status, body = http(server, "POST", f"/v2/repository/models/{model}/load", {})
        assert status == 200, body

    try:
        load("image_classifier")  # preprocess and efficientnet_lite0 only as its steps
        load("prep_outer")  # prep as its step; preprocess is loaded already
        for model in (*IMAGE_MODELS, "prep", "prep_outer"):
            assert versions(server, model) == ["1"], model

        unload(server, "image_classifier", dependents=True)
        assert versions(server, "image_classifier") is None
        assert versions(server, "efficientnet_lite0") is None
        assert unloaded_reason(server, "efficientnet_lite0") == (
            "unloaded: a step of ensemble 'image_classifier', unloaded with it (unload_dependents)"
        )
        assert versions(server, "postprocess") == ["1"]  # loaded by name
        assert versions(server, "preprocess") == ["1"]  # prep still uses it

        unload(server, "prep_outer", dependents=True)  # prep, then preprocess
        for model in ("prep_outer", "prep", "preprocess"):
            assert versions(server, model) is None, model
        assert versions(server, "postprocess") == ["1"]

        # a step's unload takes down the ensembles above it, recursively
        load("prep_outer")
        assert versions(server, "preprocess") == ["1"]
        unload(server, "preprocess")
        assert "contains models that are not available: preprocess" in unloaded_reason(
            server, "prep"
        )
        assert "contains models that are not available: prep" in unloaded_reason(
            server, "prep_outer"
        )

        # a step that cannot load fails the ensemble (Triton: INVALID_ARG)
        status, body = http(server, "POST", "/v2/repository/models/broken/load", {})
        assert status == 400
        want = "ensemble 'broken' depends on 'no_such_step' which has no loaded version"
        assert want in body["error"]
        assert "no such model in the repository" in body["error"]
        assert want in index(server)[("broken", None)]["reason"]
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    ("flag", "steps_stay"), [("--load-model=image_classifier", False), ("--load-model=*", True)]
)
def test_load_model_flag_and_unload_dependents(tmp_path: Path, flag: str, steps_stay: bool) -> None:
    """``--load-model=ENSEMBLE`` loads its steps as steps only: ``unload_dependents``
    takes them with it; ``--load-model=*`` asks for every model: they stay."""
    repo = copy_models(tmp_path / "repo", *IMAGE_MODELS)
    server = start_server(repo, tmp_path / "log", "--model-control-mode=explicit", flag)
    try:
        for model in IMAGE_MODELS:
            assert versions(server, model) == ["1"], model
        unload(server, "image_classifier", dependents=True)
        assert versions(server, "image_classifier") is None
        for model in IMAGE_MODELS[:3]:
            assert (versions(server, model) == ["1"]) is steps_stay, model
    finally:
        assert server.stop() == 0


def test_on_demand_ensemble_steps_leave_with_unload_dependents(tmp_path: Path) -> None:
    """On demand, a request for the ensemble loads its steps as steps only:
    ``unload_dependents`` takes them with it, and the next request loads all again."""
    repo = copy_models(tmp_path / "repo", *IMAGE_MODELS)
    server = start_server(repo, tmp_path / "log", "--model-control-mode=on_demand")
    try:
        classify(server)
        for model in IMAGE_MODELS:
            assert versions(server, model) == ["1"], model
        unload(server, "image_classifier", dependents=True)
        for model in IMAGE_MODELS:
            assert versions(server, model) is None, model
        classify(server)
        unload(server, "preprocess")  # takes the ensemble down
        assert "not available: preprocess" in unloaded_reason(server, "image_classifier")
        assert versions(server, "efficientnet_lite0") == ["1"]
    finally:
        assert server.stop() == 0


def test_health_answers_while_an_onnx_model_loads(tmp_path: Path) -> None:
    """Loading an ONNX model (ORT session build for auto-complete and instances:
    ~0.2-0.5 s for minilm, seconds for a 400 MB graph) runs off the event loop, so
    /v2/health/live keeps answering during the load: no health answer waits half as
    long as a load takes. A load that held the loop would hold a health request for
    about the whole load; the bar is relative because both stretch alike on a busy
    machine (a health answer takes ~1-5 ms, minilm's load 0.2-0.5 s on a quiet one)."""
    import threading
    from http.client import HTTPConnection

    repo = copy_models(tmp_path / "repo", "minilm")
    server = start_server(repo, tmp_path / "pdserve.log", "--model-control-mode=explicit")
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        conn = HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        while not stop.is_set():
            t = time.monotonic()
            conn.request("GET", "/v2/health/live")
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.005)
        conn.close()

    thread = threading.Thread(target=probe)
    try:
        thread.start()
        time.sleep(0.2)
        loads: list[float] = []
        for _ in range(2):  # the first load also imports onnxruntime in the server
            t = time.monotonic()
            assert http(server, "POST", "/v2/repository/models/minilm/load", {})[0] == 200
            loads.append(time.monotonic() - t)
            assert http(server, "POST", "/v2/repository/models/minilm/unload", {})[0] == 200
        time.sleep(0.1)
    finally:
        stop.set()
        thread.join()
        assert server.stop() == 0
    assert len(latencies) > 20, latencies
    bar = 0.5 * min(loads)
    assert max(latencies) < bar, (
        f"worst /v2/health/live {max(latencies) * 1000:.0f} ms, loads {loads} s"
    )


def test_reload_that_would_close_an_ensemble_cycle_is_refused(tmp_path: Path) -> None:
    """A reload of an ensemble whose new steps lead back to it through served
    ensembles (a config override, or an edited config.pbtxt) fails with Triton's
    "circular dependency between ensembles" and keeps the old version serving: it
    was accepted, and every request to either ensemble then recursed until its client
    left (GBs of server memory in seconds); an ensemble that steps into itself too."""
    repo = copy_models(tmp_path / "repo", "preprocess")
    add_model(repo, "prep_a", prep_ensemble("prep_a", "preprocess"))
    add_model(repo, "prep_b", prep_ensemble("prep_b", "prep_a"))
    add_model(repo, "prep_self", prep_ensemble("prep_self", "prep_self"))
    server = start_server(repo, tmp_path / "log", "--model-control-mode=explicit")
    try:
        assert http(server, "POST", "/v2/repository/models/prep_b/load", {})[0] == 200
        override = json.dumps(
            {
                "name": "prep_a",
                "platform": "ensemble",
                "max_batch_size": 32,
                "input": [{"name": "input_image_bytes", "data_type": "TYPE_STRING", "dims": [1]}],
                "output": [
                    {"name": "image_tensor", "data_type": "TYPE_FP32", "dims": [3, 224, 224]}
                ],
                "ensemble_scheduling": {
                    "step": [
                        {
                            "model_name": "prep_b",
                            "model_version": -1,
                            "input_map": {"input_image_bytes": "input_image_bytes"},
                            "output_map": {"image_tensor": "image_tensor"},
                        }
                    ]
                },
            }
        )
        status, body = http(
            server,
            "POST",
            "/v2/repository/models/prep_a/load",
            {"parameters": {"config": override}},
        )
        cycle = "circular dependency between ensembles: prep_a -> prep_b -> prep_a"
        assert status == 400 and cycle in body["error"], body
        row = index(server)[("prep_a", "1")]
        assert row["state"] == "READY" and cycle in row["reason"], row
        # both still answer, through the old prep_a
        images = np.load(GOLDENS / "image_classifier.npz")
        photo = images[f"image_bytes_{images['names'][0]}"].tobytes()
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=30)
        for model in ("prep_a", "prep_b"):
            tensor = httpclient.InferInput("input_image_bytes", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[photo]], object))
            out = client.infer(model, [tensor]).as_numpy("image_tensor")
            assert out.shape == (1, 3, 224, 224), model

        status, body = http(server, "POST", "/v2/repository/models/prep_self/load", {})
        assert status == 400, body
        assert "circular dependency between ensembles: prep_self -> prep_self" in body["error"]
    finally:
        assert server.stop() == 0


def test_poll_ensembles_come_back_with_their_removed_step(tmp_path: Path) -> None:
    """Poll mode: removing a step unloads the ensembles that use it (recursively);
    when the step is back, so are they, as Triton's dependency graph reloads the
    models downstream of a changed one (they stayed unloaded until their own
    config.pbtxt changed)."""
    repo = copy_models(tmp_path / "repo", "preprocess")
    add_model(repo, "prep_a", prep_ensemble("prep_a", "preprocess"))
    add_model(repo, "prep_b", prep_ensemble("prep_b", "prep_a"))
    server = start_server(
        repo, tmp_path / "log", "--model-control-mode=poll", f"--repository-poll-secs={POLL}"
    )
    try:
        assert versions(server, "prep_b") == ["1"]
        aside = tmp_path / "preprocess"
        os.replace(repo / "preprocess", aside)
        wait_for(lambda: versions(server, "prep_b") is None, 30, "prep_b to go")
        assert "contains models that are not available: prep_a" in unloaded_reason(server, "prep_b")
        os.replace(aside, repo / "preprocess")
        for model in ("preprocess", "prep_a", "prep_b"):
            wait_for(lambda m=model: versions(server, m) == ["1"], 30, f"{model} back")
            assert index(server)[(model, "1")]["state"] == "READY"
    finally:
        assert server.stop() == 0
