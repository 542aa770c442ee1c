"""Build the example tree-model repository (Triton FIL layout) and its goldens.

Usage::

    python examples/build_trees.py [--force] [--out DIR]

Writes ``examples/tree_repository/`` (default), one ``backend: "fil"`` model per
folder, each trained here on a dataset bundled with scikit-learn:

* ``xgboost_breast_cancer``: XGBoost classifier on ``load_breast_cancer``
  (30 features), ``xgboost.json`` (``model_type: xgboost_json``),
  ``predict_proba``: ``output__0`` FP32 [2] = XGBoost's ``predict_proba``.
* ``xgboost_breast_cancer_class``: the same booster as ``xgboost.ubj``
  (``xgboost_ubj``), class ids with ``threshold`` 0.5: ``output__0`` FP32 [1] =
  XGBoost's ``predict``.
* ``lightgbm_diabetes``: LightGBM regressor on ``load_diabetes`` (10 features),
  ``model.txt`` (``lightgbm``): ``output__0`` FP32 [1] = LightGBM's ``predict``.
* ``sklearn_forest_iris``: scikit-learn ``RandomForestClassifier`` on ``load_iris``
  (4 features, 3 classes) through ``treelite.sklearn.import_model`` into
  ``checkpoint.tl`` (``treelite_checkpoint``): ``output__0`` FP32 [3] = scikit-learn's
  ``predict_proba``.

Each version folder holds ``MODEL_IDENTITY.json`` and ``golden.npz`` (32 rows of the
dataset and the framework's own outputs; :func:`build.write_golden`), which
``pdserve check`` runs. Cached: ``.build_stamp.json`` in the repository holds a key of
this file and the package versions, and the files written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__:
    from . import build
else:  # run as a script: examples/ is sys.path[0]
    import build

DEFAULT_OUT = build.EXAMPLES_DIR / "tree_repository"
STAMP_NAME = ".build_stamp.json"
KEY_PACKAGES = ("numpy", "scikit-learn", "xgboost", "lightgbm", "treelite")
#: Rows of each dataset stored as golden inputs.
GOLDEN_ROWS = 32
#: Tolerance of the goldens: the server's predictor against the framework's own.
ATOL = 1e-5
RTOL = 1e-5
SEED = 0


def cache_key() -> str:
    """Hash of this file and the versions of the packages that train the models."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for package in KEY_PACKAGES:
        digest.update(f"{package}={build._package_version(package)}\n".encode())
    return digest.hexdigest()


def fil_config(
    name: str, features: int, outputs: int, params: dict[str, str], max_batch_size: int = 4096
) -> str:
    """A config.pbtxt in the form of FIL's documentation."""
    parameters = ",\n".join(
        f'  {{\n    key: "{k}"\n    value: {{ string_value: "{v}" }}\n  }}'
        for k, v in params.items()
    )
    return f"""name: "{name}"
backend: "fil"
max_batch_size: {max_batch_size}
input [
  {{
    name: "input__0"
    data_type: TYPE_FP32
    dims: [ {features} ]
  }}
]
output [
  {{
    name: "output__0"
    data_type: TYPE_FP32
    dims: [ {outputs} ]
  }}
]
instance_group [{{ kind: KIND_CPU count: 1 }}]
parameters [
{parameters}
]
dynamic_batching {{ }}
"""


def _write_model(
    repo: Path,
    name: str,
    model_file: Path,
    params: dict[str, str],
    x: Any,
    want: Any,
    identity: dict[str, Any],
) -> None:
    """config.pbtxt, ``1/<file>``, MODEL_IDENTITY.json and golden.npz of one model."""
    import numpy as np

    model_dir = repo / name
    build.write_config(model_dir, fil_config(name, x.shape[1], want.shape[1], params))
    build.write_version(
        model_dir,
        1,
        model_file.read_bytes(),
        identity,
        golden=({"input__0": x}, {"output__0": np.asarray(want, dtype=np.float32)}),
        model_file=model_file.name,
    )
    entry = json.loads((model_dir / "1" / build.IDENTITY_NAME).read_text())
    entry["golden"].update(atol=ATOL, rtol=RTOL)
    (model_dir / "1" / build.IDENTITY_NAME).write_text(json.dumps(entry, indent=2) + "\n")


def _identity(package: str, estimator: str, dataset: str, **extra: Any) -> dict[str, Any]:
    return {
        "source": {"package": package, "version": build._package_version(package)},
        "estimator": estimator,
        "dataset": f"sklearn.datasets.{dataset}",
        **extra,
    }


def build_xgboost(repo: Path, work: Path) -> None:
    """The XGBoost classifier, as JSON (probabilities) and UBJSON (class ids)."""
    import numpy as np
    import xgboost
    from sklearn.datasets import load_breast_cancer

    x_all, y = load_breast_cancer(return_X_y=True)
    x_all = x_all.astype(np.float32)
    clf = xgboost.XGBClassifier(n_estimators=50, max_depth=4, random_state=SEED, n_jobs=1)
    clf.fit(x_all, y)
    x = np.ascontiguousarray(x_all[:: len(x_all) // GOLDEN_ROWS][:GOLDEN_ROWS])
    booster = clf.get_booster()
    json_file, ubj_file = work / "xgboost.json", work / "xgboost.ubj"
    booster.save_model(str(json_file))
    booster.save_model(str(ubj_file))
    est = "xgboost.XGBClassifier(n_estimators=50, max_depth=4)"
    proba = {"model_type": "xgboost_json", "is_classifier": "true", "predict_proba": "true"}
    _write_model(
        repo,
        "xgboost_breast_cancer",
        json_file,
        proba,
        x,
        clf.predict_proba(x),
        _identity("xgboost", est, "load_breast_cancer", golden_from="predict_proba"),
    )
    classes = {
        "model_type": "xgboost_ubj",
        "is_classifier": "true",
        "predict_proba": "false",
        "threshold": "0.5",
    }
    _write_model(
        repo,
        "xgboost_breast_cancer_class",
        ubj_file,
        classes,
        x,
        clf.predict(x).reshape(-1, 1),
        _identity("xgboost", est, "load_breast_cancer", golden_from="predict"),
    )


def build_lightgbm(repo: Path, work: Path) -> None:
    """The LightGBM regressor (text model file)."""
    import lightgbm
    import numpy as np
    from sklearn.datasets import load_diabetes

    x_all, y = load_diabetes(return_X_y=True)
    x_all = x_all.astype(np.float32)
    reg = lightgbm.LGBMRegressor(n_estimators=50, num_leaves=15, random_state=SEED, verbose=-1)
    reg.fit(x_all, y)
    x = np.ascontiguousarray(x_all[:: len(x_all) // GOLDEN_ROWS][:GOLDEN_ROWS])
    model_file = work / "model.txt"
    reg.booster_.save_model(str(model_file))
    _write_model(
        repo,
        "lightgbm_diabetes",
        model_file,
        {"model_type": "lightgbm", "is_classifier": "false"},
        x,
        reg.predict(x).reshape(-1, 1),
        _identity(
            "lightgbm",
            "lightgbm.LGBMRegressor(n_estimators=50, num_leaves=15)",
            "load_diabetes",
            golden_from="predict",
        ),
    )


def build_forest(repo: Path, work: Path) -> None:
    """The scikit-learn random forest, through Treelite into a checkpoint."""
    import numpy as np
    import treelite
    from sklearn.datasets import load_iris
    from sklearn.ensemble import RandomForestClassifier

    x_all, y = load_iris(return_X_y=True)
    x_all = x_all.astype(np.float32)
    rf = RandomForestClassifier(n_estimators=30, max_depth=6, random_state=SEED)
    rf.fit(x_all, y)
    x = np.ascontiguousarray(x_all[:: len(x_all) // GOLDEN_ROWS][:GOLDEN_ROWS])
    model_file = work / "checkpoint.tl"
    treelite.sklearn.import_model(rf).serialize(str(model_file))
    _write_model(
        repo,
        "sklearn_forest_iris",
        model_file,
        {"model_type": "treelite_checkpoint", "is_classifier": "true", "predict_proba": "true"},
        x,
        rf.predict_proba(x),
        _identity(
            "scikit-learn",
            "sklearn.ensemble.RandomForestClassifier(n_estimators=30, max_depth=6)",
            "load_iris",
            golden_from="predict_proba",
            converter={"package": "treelite", "version": build._package_version("treelite")},
        ),
    )


BUILDERS: tuple[Callable[[Path, Path], None], ...] = (build_xgboost, build_lightgbm, build_forest)


def is_up_to_date(out: Path, key: str) -> bool:
    """True when ``out`` holds a complete build for ``key``."""
    try:
        stamp = json.loads((out / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    if stamp.get("key") != key or not stamp.get("files"):
        return False
    for rel, size in stamp["files"].items():
        try:
            if (out / rel).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def ensure_built(out: Path | None = None, force: bool = False) -> Path:
    """Build the tree repository unless an up-to-date build is there; returns its path."""
    out = (out or DEFAULT_OUT).resolve()
    key = cache_key()
    if not force and is_up_to_date(out, key):
        build._log(f"up to date: {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".trees-", dir=out.parent))
    try:
        repo, work = staging / "repository", staging / "work"
        repo.mkdir()
        for builder in BUILDERS:
            work.mkdir()
            builder(repo, work)
            shutil.rmtree(work)
        files = {
            str(p.relative_to(repo)): p.stat().st_size
            for p in sorted(repo.rglob("*"))
            if p.is_file()
        }
        (repo / STAMP_NAME).write_text(json.dumps({"key": key, "files": files}, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        shutil.move(str(repo), str(out))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    build._log(f"built {len(files)} files into {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--out", type=Path, default=None, help="repository folder")
    args = parser.parse_args(argv)
    ensure_built(args.out, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
