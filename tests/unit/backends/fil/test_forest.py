"""Unit tests for pdserve.backends.fil.forest: model files read through Treelite and
the predictors (TL2cgen, XGBoost / LightGBM, GTIL) against the frameworks' own predict."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.backends.fil import forest
from pdserve.backends.fil.forest import (
    FilLoadError,
    GtilPredictor,
    LightGBMPredictor,
    Tl2cgenPredictor,
    XGBoostPredictor,
    compile_forest,
    forest_info,
    load_treelite,
    resolve_predictor,
    set_fil_postprocessor,
)
from pdserve.backends.fil.params import FilParams

TYPES = {
    "xgb_binary_json": "xgboost_json",
    "xgb_binary_ubj": "xgboost_ubj",
    "xgb_multi_json": "xgboost_json",
    "lgb_reg": "lightgbm",
    "rf_binary": "treelite_checkpoint",
    "rf_multi": "treelite_checkpoint",
}


def loaded(
    files: dict[str, Path], key: str, proba: bool = True
) -> tuple[object, forest.ForestInfo]:
    params = FilParams(model_type=TYPES[key], is_classifier=True, predict_proba=proba)
    model = load_treelite(files[key], params)
    return model, set_fil_postprocessor(model, forest_info(model), params)


def test_info_is_treelites_view(tree_files: dict[str, Path]) -> None:
    got = {k: forest_info(loaded(tree_files, k)[0]) for k in TYPES}
    assert {k: (i.num_feature, i.num_class, i.task_type) for k, i in got.items()} == {
        "xgb_binary_json": (6, 1, "kBinaryClf"),
        "xgb_binary_ubj": (6, 1, "kBinaryClf"),
        "xgb_multi_json": (6, 3, "kMultiClf"),
        "lgb_reg": (6, 1, "kRegressor"),
        "rf_binary": (6, 2, "kMultiClf"),
        "rf_multi": (6, 3, "kMultiClf"),
    }
    assert got["xgb_binary_json"].postprocessor == "sigmoid"
    assert got["rf_multi"].leaf_vector_width == 3


def _scores(tree_files: dict[str, Path], key: str, tmp_path: Path) -> dict[str, np.ndarray]:
    model, info = loaded(tree_files, key)
    x = np.load(tree_files["data"])["x"]
    preds: list[object] = [
        GtilPredictor(model, info, 1),
        Tl2cgenPredictor(compile_forest(model, tmp_path), info, 1),
    ]
    if key.startswith("xgb"):
        preds.append(XGBoostPredictor(tree_files[key], info, 1))
    if key.startswith("lgb"):
        preds.append(LightGBMPredictor(tree_files[key], info, 1))
    out = {}
    for p in preds:
        got = p.predict(x)  # type: ignore[attr-defined]
        assert got.dtype == np.float32 and got.shape == (20, info.num_class)
        out[f"{type(p).__name__}"] = got
    return out


@pytest.mark.parametrize(
    ("key", "want"),
    [("xgb_binary_ubj", "xgb_binary"), ("xgb_multi_json", "xgb_multi"), ("lgb_reg", "lgb_reg")],
)
def test_predictors_equal_the_frameworks_predict(
    tree_files: dict[str, Path], key: str, want: str, tmp_path: Path
) -> None:
    ref = np.load(tree_files["data"])[want]
    ref = ref[:, 1:] if want == "xgb_binary" else ref.reshape(20, -1)
    for name, got in _scores(tree_files, key, tmp_path).items():
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5, err_msg=name)


def test_forest_checkpoint_equals_sklearn(tree_files: dict[str, Path], tmp_path: Path) -> None:
    ref = np.load(tree_files["rf_multi"].parent / "proba.npy")
    for name, got in _scores(tree_files, "rf_multi", tmp_path).items():
        np.testing.assert_allclose(got, ref, atol=1e-6, err_msg=name)


def test_corrupt_file_names_file_and_library_error(tmp_path: Path) -> None:
    bad = tmp_path / "xgboost.json"
    bad.write_text("{ not json")
    with pytest.raises(FilLoadError) as e:
        load_treelite(bad, FilParams(model_type="xgboost_json"))
    msg = str(e.value)
    assert f"model file {bad} could not be loaded as model_type 'xgboost_json'" in msg
    assert "Parsing error at offset 2" in msg and "Stack trace" not in msg


def test_truncated_lightgbm_file_with_no_trees_is_refused(
    tree_files: dict[str, Path], tmp_path: Path
) -> None:
    # Treelite reads a LightGBM header cut before the first tree as a forest of
    # zero trees, which would serve a constant 0.0; the load must fail instead.
    cut = tmp_path / "model.txt"
    cut.write_bytes(tree_files["lgb_reg"].read_bytes()[:300])
    with pytest.raises(FilLoadError) as e:
        load_treelite(cut, FilParams(model_type="lightgbm"))
    assert f"model file {cut} holds no trees" in str(e.value)


def test_wrong_format_is_refused(tree_files: dict[str, Path]) -> None:
    with pytest.raises(FilLoadError, match="as model_type 'lightgbm'"):
        load_treelite(tree_files["xgb_binary_json"], FilParams(model_type="lightgbm"))


def test_resolve_predictor(monkeypatch: pytest.MonkeyPatch) -> None:
    lgb, ckpt = FilParams(model_type="lightgbm"), FilParams(model_type="treelite_checkpoint")
    assert resolve_predictor(lgb, gpu=False) == "tl2cgen"  # gcc is on PATH here
    assert resolve_predictor(FilParams(model_type="xgboost_ubj"), gpu=True) == "native"
    with pytest.raises(FilLoadError, match="model_type 'lightgbm' runs on the CPU only"):
        resolve_predictor(lgb, gpu=True)
    with pytest.raises(FilLoadError, match="no library for model_type 'treelite_checkpoint'"):
        resolve_predictor(FilParams(model_type="treelite_checkpoint", predictor="native"), False)
    monkeypatch.setattr(forest, "c_compiler", lambda: None)
    assert resolve_predictor(lgb, gpu=False) == "native"
    assert resolve_predictor(ckpt, gpu=False) == "gtil"


def _runtime_scores(pred: Tl2cgenPredictor, x: np.ndarray) -> np.ndarray:
    """The same library's scores through TL2cgen's own runtime (its DMatrix and Predictor)."""
    import tl2cgen

    dtype = str(pred._pred.threshold_type)
    out = pred._pred.predict(tl2cgen.DMatrix(x if dtype == "float32" else x.astype(dtype)))
    return np.asarray(out, dtype=np.float32).reshape(x.shape[0], -1)


@pytest.mark.parametrize("key", ["xgb_binary_json", "xgb_multi_json", "lgb_reg", "rf_multi"])
def test_compiled_rows_entry_point_equals_tl2cgens_runtime(
    tree_files: dict[str, Path], key: str, tmp_path: Path
) -> None:
    """pdserve_predict_rows is in the library and gives TL2cgen's runtime's scores bit for
    bit, NaN (missing) features included, for float32 and float64 forests."""
    model, info = loaded(tree_files, key)
    pred = Tl2cgenPredictor(compile_forest(model, tmp_path), info, 1)
    assert pred._rows is not None
    rng = np.random.default_rng(3)
    x = rng.normal(size=(300, 6)).astype(np.float32)
    x[rng.random(x.shape) < 0.2] = np.nan
    for rows in (x[:1], x[:8], x):
        got = pred.predict(rows)
        assert got.dtype == np.float32 and got.shape == (len(rows), info.num_class)
        np.testing.assert_array_equal(got, _runtime_scores(pred, rows))


def test_large_batches_with_threads_go_to_tl2cgens_runtime(
    tree_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, info = loaded(tree_files, "lgb_reg")
    pred = Tl2cgenPredictor(compile_forest(model, tmp_path), info, 2)
    calls: list[int] = []
    rows_fn = pred._rows
    assert rows_fn is not None

    def counted(*args: object) -> int:
        calls.append(int(args[1]))  # type: ignore[call-overload]
        return int(rows_fn(*args))

    monkeypatch.setattr(pred, "_rows", counted)
    x = np.random.default_rng(4).normal(size=(forest.PARALLEL_ROWS_PER_THREAD * 2, 6))
    x = x.astype(np.float32)
    small = pred.predict(x[:64])
    large = pred.predict(x)
    assert calls == [64]  # the large batch ran on TL2cgen's thread pool
    np.testing.assert_array_equal(large[:64], small)
    np.testing.assert_array_equal(large, _runtime_scores(pred, x))
