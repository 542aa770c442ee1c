"""Tree models (backend "fil") through a real pdserve, over HTTP and gRPC.

The example tree repository (examples/build_trees.py: an XGBoost classifier as JSON and
as UBJSON, a LightGBM regressor, a scikit-learn forest as a Treelite checkpoint) must
give its goldens (the frameworks' own predict) to tritonclient, also when concurrent
one-row requests are batched by the dynamic batcher; a corrupt and a wrong-format model
file fail their own load with the file and the library's error while the rest serve;
wrong dtypes and shapes get a 400 naming the input; ``pdserve check`` passes.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from examples import build_trees
from pdserve.app.analyze import AnalyzeOptions, run_analyze
from pdserve.app.check import check_repository
from pdserve.backends.devices import visible_gpu_count
from tests.conftest import ServerProcess, start_server

pytest.importorskip("treelite")

MODELS = (
    "xgboost_breast_cancer",
    "xgboost_breast_cancer_class",
    "lightgbm_diabetes",
    "sklearn_forest_iris",
)


@pytest.fixture(scope="module")
def tree_repo() -> Path:
    return build_trees.ensure_built()


@pytest.fixture(scope="module")
def goldens(tree_repo: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for m in MODELS:
        with np.load(tree_repo / m / "1" / "golden.npz") as g:
            out[m] = (g["input_0"], g["output_0"])
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tree_repo: Path) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("fil")
    repo = tmp / "repo"
    shutil.copytree(tree_repo, repo)
    # faults: a corrupt XGBoost JSON file, and an XGBoost file declared as LightGBM
    shutil.copytree(repo / "xgboost_breast_cancer", repo / "xgb_corrupt")
    (repo / "xgb_corrupt" / "1" / "xgboost.json").write_text('{"learner": ')
    shutil.copytree(repo / "lightgbm_diabetes", repo / "lgb_wrong_format")
    shutil.copy(
        repo / "xgboost_breast_cancer" / "1" / "xgboost.json",
        repo / "lgb_wrong_format" / "1" / "model.txt",
    )
    shutil.copytree(repo / "xgboost_breast_cancer", repo / "xgb_gpu")
    cfg = repo / "xgb_gpu" / "config.pbtxt"
    cfg.write_text(
        cfg.read_text().replace("kind: KIND_CPU count: 1", 'name: "gpu" kind: KIND_GPU gpus: [ 0 ]')
    )
    # a queue delay gathers concurrent rows into shared batches however quickly each
    # batch runs (a short one runs inline, before the next request is read)
    cfg = repo / "lightgbm_diabetes" / "config.pbtxt"
    cfg.write_text(
        cfg.read_text().replace(
            "dynamic_batching { }", "dynamic_batching { max_queue_delay_microseconds: 5000 }"
        )
    )
    for name in ("xgb_corrupt", "lgb_wrong_format", "xgb_gpu"):
        text = (repo / name / "config.pbtxt").read_text()
        (repo / name / "config.pbtxt").write_text(text.replace('name: "', f'name: "{name}" #', 1))
    srv = start_server(repo, tmp / "pdserve.log")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, concurrency=32)


@pytest.fixture(scope="module")
def grpc(server: ServerProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def _http_in(x: np.ndarray, datatype: str = "FP32") -> list[httpclient.InferInput]:
    t = httpclient.InferInput("input__0", list(x.shape), datatype)
    t.set_data_from_numpy(x, binary_data=True)
    return [t]


def _grpc_in(x: np.ndarray) -> list[grpcclient.InferInput]:
    t = grpcclient.InferInput("input__0", list(x.shape), "FP32")
    t.set_data_from_numpy(x)
    return [t]


@pytest.mark.parametrize("model", MODELS)
def test_goldens_over_http_and_grpc(
    http: httpclient.InferenceServerClient,
    grpc: grpcclient.InferenceServerClient,
    goldens: dict[str, tuple[np.ndarray, np.ndarray]],
    model: str,
) -> None:
    x, want = goldens[model]
    got = http.infer(model, _http_in(x)).as_numpy("output__0")
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    got = grpc.infer(model, _grpc_in(x)).as_numpy("output__0")
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_class_ids_and_probabilities_agree(
    goldens: dict[str, tuple[np.ndarray, np.ndarray]],
) -> None:
    x, proba = goldens["xgboost_breast_cancer"]
    _, ids = goldens["xgboost_breast_cancer_class"]
    assert proba.shape == (32, 2) and ids.shape == (32, 1)
    np.testing.assert_array_equal(ids[:, 0], (proba[:, 1] > 0.5).astype(np.float32))
    assert 0 < ids.sum() < 32  # both classes occur


def _stats(http: httpclient.InferenceServerClient, model: str) -> tuple[int, int]:
    s = http.get_inference_statistics(model)["model_stats"][0]
    return int(s["inference_count"]), int(s["execution_count"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_concurrent_rows_are_batched(
    server: ServerProcess,
    http: httpclient.InferenceServerClient,
    goldens: dict[str, tuple[np.ndarray, np.ndarray]],
    protocol: str,
) -> None:
    model = "lightgbm_diabetes"
    x, want = goldens[model]
    before = _stats(http, model)

    def one(i: int) -> np.ndarray:
        row = x[i : i + 1]
        if protocol == "http":
            c = httpclient.InferenceServerClient(server.http_url)
            return c.infer(model, _http_in(row)).as_numpy("output__0")
        g = grpcclient.InferenceServerClient(server.grpc_url)
        return g.infer(model, _grpc_in(row)).as_numpy("output__0")

    rounds = 4
    with ThreadPoolExecutor(32) as pool:
        for _ in range(rounds):
            got = list(pool.map(one, range(32)))
            np.testing.assert_allclose(np.concatenate(got), want, atol=1e-5, rtol=1e-5)
    inferences, executions = (a - b for a, b in zip(_stats(http, model), before, strict=True))
    assert inferences == 32 * rounds
    assert executions < inferences  # some requests shared a batch


@pytest.mark.parametrize(
    ("x", "datatype", "needle"),
    [
        (np.zeros((1, 10), np.float64), "FP64", "input__0"),
        (np.zeros((1, 9), np.float32), "FP32", "input__0"),
        (np.zeros((10,), np.float32), "FP32", "input__0"),
    ],
)
def test_wrong_dtype_or_shape_is_a_400_naming_the_input(
    http: httpclient.InferenceServerClient, x: np.ndarray, datatype: str, needle: str
) -> None:
    with pytest.raises(InferenceServerException) as e:
        http.infer("lightgbm_diabetes", _http_in(x, datatype))
    assert e.value.status() == "400" and needle in e.value.message()
    assert http.is_model_ready("lightgbm_diabetes")


def test_config_is_fils(http: httpclient.InferenceServerClient) -> None:
    cfg = http.get_model_config("sklearn_forest_iris")
    assert cfg["backend"] == "fil"
    assert cfg["parameters"]["model_type"]["string_value"] == "treelite_checkpoint"
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == [
        ("input__0", "TYPE_FP32", [4])
    ]
    assert [(o["name"], o["dims"]) for o in cfg["output"]] == [("output__0", [3])]


def test_load_faults_name_the_file_and_the_rest_serves(
    server: ServerProcess, http: httpclient.InferenceServerClient
) -> None:
    rows = {row["name"]: row for row in http.get_model_repository_index()}
    corrupt, wrong = rows["xgb_corrupt"], rows["lgb_wrong_format"]
    assert corrupt["state"] == "UNAVAILABLE" and wrong["state"] == "UNAVAILABLE"
    assert (
        "xgb_corrupt/1/xgboost.json could not be loaded as model_type 'xgboost_json'"
        in (corrupt["reason"])
    )
    assert (
        "lgb_wrong_format/1/model.txt could not be loaded as model_type 'lightgbm'"
        in (wrong["reason"])
    )
    assert "Ill-formed LightGBM model file" in wrong["reason"]
    if visible_gpu_count() == 0:
        gpu = rows["xgb_gpu"]
        assert gpu["state"] == "UNAVAILABLE"
        assert "instance group 'gpu' asks for KIND_GPU on GPU 0" in gpu["reason"]
    assert all(http.is_model_ready(m) for m in MODELS) and http.is_server_ready()


def test_pdserve_check_passes(tree_repo: Path) -> None:
    report = check_repository(tree_repo)
    assert report.exit_code == 0, report.to_json()
    ran = {(r.model, r.check) for r in report.all_results if r.status == "passed"}
    for model in MODELS:
        assert {(model, "fil-config"), (model, "golden"), (model, "identity")} <= ran


def test_pdserve_analyze_tunes_a_fil_model(tree_repo: Path, tmp_path: Path) -> None:
    res = run_analyze(
        AnalyzeOptions(
            model="lightgbm_diabetes",
            repository=tree_repo,
            server_mode="reload",
            search="grid",
            instance_counts=[1, 2],
            max_batch_sizes=[4096],
            preferred=["none"],
            queue_delays_us=[0],
            concurrency=[4],
            measurement_interval_ms=200,
            max_trials=3,
            stability_percentage=100,
            confirm=0,
            max_minutes=1.5,
            output_dir=tmp_path / "out",
        )
    )
    measured = [r for r in res.results if r.levels]
    assert len(measured) >= 2
    assert all(lv.infer_per_sec > 0 for r in measured for lv in r.levels)
    assert res.recommended in res.results
    points = {
        (r.point["lightgbm_diabetes"].instances, r.point["lightgbm_diabetes"].delay_us)
        for r in measured
    }
    assert points == {(1, 0), (2, 0)}


def test_pdserve_check_finds_wrong_dims_and_goldens(tree_repo: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for m in ("xgboost_breast_cancer", "lightgbm_diabetes"):
        shutil.copytree(tree_repo / m, repo / m)
    cfg = repo / "xgboost_breast_cancer" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("dims: [ 30 ]", "dims: [ 29 ]"))
    npz = repo / "lightgbm_diabetes" / "1" / "golden.npz"
    with np.load(npz) as g:
        arrays = {k: g[k] for k in g.files}
    arrays["output_0"] = arrays["output_0"] + 1.0
    np.savez(npz, **arrays)
    report = check_repository(repo)
    problems = {(p.model, p.check): p.message for r in report.all_results for p in r.problems}
    assert (
        "disagree with the model file's shape [-1,30]"
        in (problems[("xgboost_breast_cancer", "fil-config")])
    )
    assert "32 of 32 values differ" in problems[("lightgbm_diabetes", "golden")]
    assert report.exit_code == 1
