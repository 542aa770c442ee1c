"""Remote models end to end: the image pipeline split across two real pdserve processes.

The *predictor* serves ``efficientnet_lite0`` (ONNX Runtime); the *transformer*
serves ``image_classifier`` with ``preprocess`` and ``postprocess`` and an
``efficientnet_lite0`` of ``backend: "remote"`` (built by
``examples/split/build_split.py``) that forwards each batch to the predictor over
gRPC or HTTP with the binary extension. Both listen on loopback; the predictor starts
first.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from examples.split.build_split import build as build_transformer
from tests.conftest import (
    EXAMPLE_REPO,
    GOLDENS,
    ROOT,
    ServerProcess,
    copy_models,
    free_port,
    start_server,
)
from tests.integration.test_pipelines import _assert_top5, _image_input


def _start(repo: Path, log: Path) -> ServerProcess:
    """:func:`start_server`, tried again when a port it picked was taken meanwhile (this
    module's clients hold many ephemeral loopback ports)."""
    for attempt in range(3):
        try:
            return start_server(repo, log)
        except RuntimeError as e:
            if "address in use" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def images() -> dict[str, np.ndarray]:
    data = np.load(GOLDENS / "image_classifier.npz")
    return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def predictor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    work = tmp_path_factory.mktemp("predictor")
    server = _start(copy_models(work / "repo", "efficientnet_lite0"), work / "log")
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["grpc", "http"])
def transformer(
    request: pytest.FixtureRequest,
    predictor: ServerProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, ServerProcess]]:
    protocol = request.param
    work = tmp_path_factory.mktemp(f"transformer_{protocol}")
    url = predictor.grpc_url if protocol == "grpc" else predictor.http_url
    repo = build_transformer(work / "repo", url, protocol, EXAMPLE_REPO)
    server = _start(repo, work / "log")
    yield protocol, server
    server.stop()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:  # not listening (yet)
        return 0, b""


def test_split_pipeline_gives_the_golden_top5(
    transformer: tuple[str, ServerProcess], predictor: ServerProcess, images: dict
) -> None:
    protocol, server = transformer
    client = httpclient.InferenceServerClient(server.http_url, concurrency=8, network_timeout=120)
    names = list(images["names"])
    raws = [images[f"image_bytes_{n}"].tobytes() for n in names]
    for row, raw in enumerate(raws):
        r = client.infer("image_classifier", [_image_input([raw])])
        want = (images["top5_labels"][row], images["top5_confidences"][row])
        _assert_top5(r.as_numpy("top5_labels")[0], r.as_numpy("top5_confidences")[0], *want)
    # a batch of all photos in one request and concurrent single requests agree
    batch = client.infer("image_classifier", [_image_input(raws)])
    pending = [client.async_infer("image_classifier", [_image_input([r])]) for r in raws * 2]
    for i, p in enumerate(pending):
        row = i % len(raws)
        want = (images["top5_labels"][row], images["top5_confidences"][row])
        res = p.get_result()
        _assert_top5(res.as_numpy("top5_labels")[0], res.as_numpy("top5_confidences")[0], *want)
        _assert_top5(
            batch.as_numpy("top5_labels")[row], batch.as_numpy("top5_confidences")[row], *want
        )
    # the remote model is ready, its config is the checked local one
    assert client.is_model_ready("efficientnet_lite0")
    config = client.get_model_config("efficientnet_lite0")
    assert config["backend"] == "remote" and config["max_batch_size"] == 32
    # the predictor ran the model; the transformer counted the calls per target
    stats = httpclient.InferenceServerClient(predictor.http_url).get_inference_statistics(
        "efficientnet_lite0"
    )
    assert int(stats["model_stats"][0]["inference_count"]) >= 3 * len(raws)
    port = predictor.grpc_port if protocol == "grpc" else predictor.http_port
    labels = f'target="{protocol}://127.0.0.1:{port}",model="efficientnet_lite0"'
    metrics = _get(f"http://127.0.0.1:{server.metrics_port}/metrics")[1].decode()
    count = [
        line
        for line in metrics.splitlines()
        if line.startswith(f"pdserve_remote_requests_total{{{labels}}}")
    ]
    assert count and float(count[0].split()[-1]) >= 1 + len(raws), metrics[-2000:]
    assert f"pdserve_remote_up{{{labels}}} 1" in metrics
    assert f"pdserve_remote_request_duration_seconds_bucket{{{labels},le=" in metrics


MISMATCHED = """
name: "{name}"
backend: "remote"
max_batch_size: 32
input [ {{ name: "input", data_type: {dtype}, dims: [ {dims} ] }} ]
output [ {{ name: "logits", data_type: TYPE_FP32, dims: [ 1000 ] }} ]
parameters {{ key: "url" value: {{ string_value: "{url}" }} }}
parameters {{ key: "model_name" value: {{ string_value: "efficientnet_lite0" }} }}
"""


def test_a_config_that_disagrees_with_the_target_fails_to_load(
    predictor: ServerProcess, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    cases = {
        "wrong_dims": ("TYPE_FP32", "3, 224, 225", "input[0].dims", "[3, 224, 224]"),
        "wrong_dtype": ("TYPE_FP16", "3, 224, 224", "input[0].data_type", "FP16 here but FP32"),
    }
    for name, (dtype, dims, _, _) in cases.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(
            MISMATCHED.format(name=name, dtype=dtype, dims=dims, url=predictor.grpc_url)
        )
    # and one that agrees, with inputs and outputs completed from the target
    (repo / "completed" / "1").mkdir(parents=True)
    (repo / "completed" / "config.pbtxt").write_text(
        'name: "completed" backend: "remote"\n'
        f'parameters {{ key: "url" value: {{ string_value: "{predictor.http_url}" }} }}\n'
        'parameters { key: "protocol" value: { string_value: "http" } }\n'
        'parameters { key: "model_name" value: { string_value: "efficientnet_lite0" } }\n'
    )
    server = _start(repo, tmp_path / "log")
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        rows = {r["name"]: r for r in client.get_model_repository_index()}
        for name, (_, _, field, words) in cases.items():
            row = rows[name]
            assert row["state"] == "UNAVAILABLE", row
            assert field in row["reason"] and words in row["reason"], row["reason"]
            assert not client.is_model_ready(name)
        assert rows["completed"]["state"] == "READY"
        cfg = client.get_model_config("completed")
        assert cfg["max_batch_size"] == 32
        assert [(i["name"], i["dims"]) for i in cfg["input"]] == [("input", [3, 224, 224])]
        x = np.random.default_rng(0).random((2, 3, 224, 224), dtype=np.float32)
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        got = client.infer("completed", [inp]).as_numpy("logits")
        direct = httpclient.InferenceServerClient(predictor.http_url).infer(
            "efficientnet_lite0", [inp]
        )
        np.testing.assert_allclose(got, direct.as_numpy("logits"), rtol=1e-5, atol=1e-5)
    finally:
        server.stop()


def _serve(repo: Path, log: Path, http: int, grpc: int, metrics: int) -> subprocess.Popen[bytes]:
    """``pdserve serve`` on given ports (a restarted predictor keeps its address)."""
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model-repository", str(repo),
           "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics)]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def _wait(what: str, check: object, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():  # type: ignore[operator]  # a callable
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout} s")


def test_predictor_gone_fails_fast_with_503_and_recovers(tmp_path: Path, images: dict) -> None:
    repo = copy_models(tmp_path / "pred_repo", "efficientnet_lite0")
    ports = (free_port(), free_port(), free_port())
    pred = _serve(repo, tmp_path / "pred.log", *ports)
    transformer: ServerProcess | None = None
    try:
        _wait("predictor ready", lambda: _get(f"http://127.0.0.1:{ports[0]}/v2/health/ready")[0] == 200, 120)  # fmt: skip
        trepo = build_transformer(
            tmp_path / "t_repo", f"127.0.0.1:{ports[1]}", "grpc", EXAMPLE_REPO,
            health_interval_ms=200,
        )  # fmt: skip
        transformer = _start(trepo, tmp_path / "t.log")
        client = httpclient.InferenceServerClient(transformer.http_url, network_timeout=60)
        gclient = grpcclient.InferenceServerClient(transformer.grpc_url)
        raw = images["image_bytes_china"].tobytes()
        want = (images["top5_labels"][0], images["top5_confidences"][0])

        def top5_ok() -> None:
            r = client.infer("image_classifier", [_image_input([raw])])
            _assert_top5(r.as_numpy("top5_labels")[0], r.as_numpy("top5_confidences")[0], *want)

        top5_ok()
        pred.send_signal(signal.SIGKILL)
        pred.wait(30)
        took = _wait("remote model not ready", lambda: not client.is_model_ready("efficientnet_lite0"), 10)  # fmt: skip
        assert took < 5
        assert client.is_server_ready()  # the transformer itself stays up
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(InferenceServerException) as info:
                client.infer("image_classifier", [_image_input([raw])])
            assert time.monotonic() - start < 1.0  # fails fast, no connect hang
            assert info.value.status() == "503", info.value.message()
            assert "is not ready" in info.value.message()
        g_in = grpcclient.InferInput("input_image_bytes", [1, 1], "BYTES")
        g_in.set_data_from_numpy(np.array([[raw]], dtype=object))
        start = time.monotonic()
        with pytest.raises(InferenceServerException) as ginfo:
            gclient.infer("image_classifier", [g_in], client_timeout=30)
        assert time.monotonic() - start < 1.0
        assert ginfo.value.status() == "StatusCode.UNAVAILABLE", ginfo.value.status()
        metrics = _get(f"http://127.0.0.1:{transformer.metrics_port}/metrics")[1].decode()
        assert f'pdserve_remote_up{{target="grpc://127.0.0.1:{ports[1]}",model="efficientnet_lite0"}} 0' in metrics  # fmt: skip
        # the predictor comes back on the same address: the remote model recovers
        pred = _serve(repo, tmp_path / "pred.log", *ports)
        _wait("remote model ready again", lambda: client.is_model_ready("efficientnet_lite0"), 120)  # fmt: skip
        top5_ok()
        log = (tmp_path / "t.log").read_text()
        assert "is down" in log and "is ready again" in log
    finally:
        if transformer is not None:
            transformer.stop()
        if pred.poll() is None:
            pred.send_signal(signal.SIGTERM)
            try:
                pred.wait(30)
            except subprocess.TimeoutExpired:
                pred.kill()
                pred.wait(10)


def test_load_waits_for_a_target_and_names_it_when_absent(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    (tmp_path / "repo" / "m" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text(
        'name: "m" backend: "remote"\n'
        f'parameters {{ key: "url" value: {{ string_value: "{dead}" }} }}\n'
        'parameters { key: "load_wait_ms" value: { string_value: "300" } }\n'
    )
    server = _start(tmp_path / "repo", tmp_path / "log")
    try:
        row = httpclient.InferenceServerClient(server.http_url).get_model_repository_index()[0]
        assert row["state"] == "UNAVAILABLE"
        assert "parameters.url" in row["reason"] and dead in row["reason"], row
        assert json.dumps(row)  # a plain JSON row
    finally:
        server.stop()


#: The interpreter of a venv holding nvidia-pytriton (its bundled tritonserver 2.51),
#: numpy < 2 and onnxruntime: ``benchmarks/bench_peers.py --install`` makes it.
TRITON_PY = Path(
    os.environ.get(
        "PDSERVE_TRITON_PYTHON", str(ROOT / "benchmarks" / ".venvs" / "triton" / "bin" / "python")
    )  # fmt: skip
)


@pytest.mark.skipif(
    not TRITON_PY.exists(),
    reason=f"no real Triton: {TRITON_PY} is absent (benchmarks/bench_peers.py --install)",
)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_real_triton_as_the_predictor(protocol: str, tmp_path: Path, images: dict) -> None:
    """The transformer forwards to real Triton 2.51 (python backend running
    efficientnet_lite0 with ONNX Runtime): its config is fetched from Triton and
    checked, and the photos get the golden top-5 (Triton starts in about 5 s)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_pipeline import make_python_predictor_repo
    from common import tritonserver_command

    full = make_python_predictor_repo(tmp_path / "full", 1)
    repo = tmp_path / "triton_repo"
    repo.mkdir()
    shutil.copytree(full / "efficientnet_lite0", repo / "efficientnet_lite0")
    http = free_port()
    cmd, env = tritonserver_command(TRITON_PY, repo, http, tmp_path / "backends")
    grpc = free_port()
    cmd = [f"--grpc-port={grpc}" if a.startswith("--grpc-port=") else a for a in cmd]
    with open(tmp_path / "triton.log", "wb") as log:
        triton = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})  # fmt: skip
    transformer: ServerProcess | None = None
    try:
        _wait("triton ready", lambda: _get(f"http://127.0.0.1:{http}/v2/health/ready")[0] == 200, 120)  # fmt: skip
        url = f"127.0.0.1:{grpc if protocol == 'grpc' else http}"
        trepo = build_transformer(tmp_path / "t_repo", url, protocol, EXAMPLE_REPO)
        transformer = _start(trepo, tmp_path / "t.log")
        client = httpclient.InferenceServerClient(transformer.http_url, network_timeout=120)
        for row, name in enumerate(images["names"]):
            r = client.infer(
                "image_classifier", [_image_input([images[f"image_bytes_{name}"].tobytes()])]
            )
            want = (images["top5_labels"][row], images["top5_confidences"][row])
            _assert_top5(r.as_numpy("top5_labels")[0], r.as_numpy("top5_confidences")[0], *want)
        stats = httpclient.InferenceServerClient(f"127.0.0.1:{http}").get_inference_statistics(
            "efficientnet_lite0"
        )
        assert int(stats["model_stats"][0]["inference_count"]) >= len(images["names"])
    finally:
        if transformer is not None:
            transformer.stop()
        triton.terminate()
        try:
            triton.wait(30)
        except subprocess.TimeoutExpired:
            triton.kill()
            triton.wait(10)
