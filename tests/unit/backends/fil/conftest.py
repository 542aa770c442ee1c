"""Small tree models trained once per test session for the FIL backend's unit tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def tree_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model files: binary / 3-class XGBoost (JSON, UBJSON), LightGBM regressor,
    binary and 3-class random forests as Treelite checkpoints; plus ``data.npz``."""
    import lightgbm
    import treelite
    import xgboost
    from sklearn.ensemble import RandomForestClassifier

    root = tmp_path_factory.mktemp("trees")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6)).astype(np.float32)
    y2 = (x[:, 0] + x[:, 1] > 0).astype(int)
    y3 = np.digitize(x[:, 0], [-0.5, 0.5])
    files: dict[str, Path] = {}
    clf = xgboost.XGBClassifier(n_estimators=5, max_depth=3, n_jobs=1).fit(x, y2)
    files["xgb_binary_json"] = root / "xgb_binary" / "xgboost.json"
    files["xgb_binary_json"].parent.mkdir()
    clf.get_booster().save_model(str(files["xgb_binary_json"]))
    files["xgb_binary_ubj"] = root / "xgb_binary" / "xgboost.ubj"
    clf.get_booster().save_model(str(files["xgb_binary_ubj"]))
    multi = xgboost.XGBClassifier(n_estimators=5, max_depth=3, n_jobs=1).fit(x, y3)
    files["xgb_multi_json"] = root / "xgb_multi" / "xgboost.json"
    files["xgb_multi_json"].parent.mkdir()
    multi.get_booster().save_model(str(files["xgb_multi_json"]))
    reg = lightgbm.LGBMRegressor(n_estimators=5, num_leaves=7, verbose=-1).fit(x, x[:, 2] * 3)
    files["lgb_reg"] = root / "lgb" / "model.txt"
    files["lgb_reg"].parent.mkdir()
    reg.booster_.save_model(str(files["lgb_reg"]))
    for name, target in (("rf_binary", y2), ("rf_multi", y3)):
        rf = RandomForestClassifier(n_estimators=4, max_depth=3, random_state=0).fit(x, target)
        files[name] = root / name / "checkpoint.tl"
        files[name].parent.mkdir()
        treelite.sklearn.import_model(rf).serialize(str(files[name]))
        np.save(root / name / "proba.npy", rf.predict_proba(x[:20]))
    np.savez(
        root / "data.npz",
        x=x[:20],
        xgb_binary=clf.predict_proba(x[:20]),
        xgb_binary_class=clf.predict(x[:20]),
        xgb_multi=multi.predict_proba(x[:20]),
        xgb_multi_class=multi.predict(x[:20]),
        lgb_reg=reg.predict(x[:20]),
    )
    files["data"] = root / "data.npz"
    return files
