"""A FIL model file: loaded through Treelite (as Triton's FIL backend loads it), and
the CPU / GPU predictors that run it.

Treelite reads every FIL ``model_type``; its view of the model (features, classes,
task, postprocessor) is the one FIL serves, so it is read for every model, and a
file Treelite cannot read fails the load with Treelite's message and the path.
The predictors return scores ``[N, num_class]`` FP32 after the model's own link
function (sigmoid, softmax, ...); FIL's output rules are
:mod:`pdserve.backends.fil.postprocess`'s.

Predictors: ``tl2cgen`` (the forest compiled to a shared library with TL2cgen and
a C compiler), ``native`` (XGBoost's ``inplace_predict``, which also runs on a CUDA
GPU, or LightGBM's ``Booster.predict``) and ``gtil`` (Treelite's interpreter).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pdserve.backends.fil.params import FilParams


class FilLoadError(RuntimeError):
    """A FIL model file that cannot be read or run; the message names the file."""


@dataclass(frozen=True)
class ForestInfo:
    """What a forest takes and gives.

    Attributes:
        num_feature: columns of an input row.
        num_class: scores per row: classes of a multi-class classifier, else 1
            (a binary classifier's one score is the positive class's).
        task_type: Treelite's task (``kBinaryClf``, ``kMultiClf``, ``kRegressor``...).
        postprocessor: Treelite's link function (``sigmoid``, ``softmax``...).
        leaf_vector_width: values per leaf (> 1: a scikit-learn style classifier
            whose leaves hold class distributions).
    """

    num_feature: int
    num_class: int
    task_type: str
    postprocessor: str
    leaf_vector_width: int = 1


def load_treelite(path: Path, params: FilParams) -> Any:
    """Load ``path`` with Treelite as ``params.model_type`` says.

    Raises:
        FilLoadError: Treelite cannot read the file; names the file, the model type
            and Treelite's own error.
    """
    import treelite

    fe = treelite.frontend
    unknown = params.allow_unknown_field
    try:
        if params.model_type == "xgboost":
            model = fe.load_xgboost_model_legacy_binary(str(path))
        elif params.model_type == "xgboost_json":
            model = fe.load_xgboost_model(
                str(path), format_choice="json", allow_unknown_field=unknown
            )
        elif params.model_type == "xgboost_ubj":
            model = fe.load_xgboost_model(
                str(path), format_choice="ubjson", allow_unknown_field=unknown
            )
        elif params.model_type == "lightgbm":
            model = fe.load_lightgbm_model(str(path))
        else:
            model = treelite.Model.deserialize(str(path))
    except Exception as e:
        raise FilLoadError(
            f"model file {path} could not be loaded as model_type '{params.model_type}': "
            f"{_short(str(e))}"
        ) from e
    if int(model.num_tree) == 0:
        # Treelite reads a LightGBM text file cut before its first tree as an empty
        # forest; serving it would answer a constant, so refuse it as LightGBM does.
        raise FilLoadError(
            f"model file {path} holds no trees as model_type '{params.model_type}'; "
            "is it truncated?"
        )
    return model


def _short(message: str) -> str:
    """A library error without its native stack trace (the lines after 'Stack trace:')."""
    head = message.split("Stack trace:")[0].strip()
    return " ".join(head.split())


def forest_info(model: Any) -> ForestInfo:
    """The :class:`ForestInfo` of a Treelite model.

    Raises:
        FilLoadError: a multi-target model (FIL serves one target).
    """
    header = model.get_header_accessor()
    num_target = int(np.asarray(header.get_field("num_target")).reshape(-1)[0])
    if num_target != 1:
        raise FilLoadError(f"the model has {num_target} targets; FIL serves single-target models")
    num_class = int(np.asarray(header.get_field("num_class")).reshape(-1)[0])
    leaf_shape = np.asarray(header.get_field("leaf_vector_shape")).reshape(-1)
    return ForestInfo(
        num_feature=int(model.num_feature),
        num_class=max(num_class, 1),
        task_type=_task_name(header.get_field("task_type")),
        postprocessor=str(header.get_field("postprocessor")),
        leaf_vector_width=int(leaf_shape[-1]) if leaf_shape.size else 1,
    )


#: Treelite's ``TaskType`` enum, by value.
TASK_TYPES = ("kBinaryClf", "kRegressor", "kMultiClf", "kLearningToRank", "kIsolationForest")


def _task_name(value: Any) -> str:
    code = int(np.asarray(value).reshape(-1)[0])
    return TASK_TYPES[code] if 0 <= code < len(TASK_TYPES) else f"task {code}"


class Predictor(Protocol):
    """Runs a forest: FP32 rows ``[N, num_feature]`` -> FP32 scores ``[N, num_class]``."""

    name: str

    def predict(self, x: np.ndarray) -> np.ndarray: ...


def c_compiler() -> str | None:
    """The C toolchain TL2cgen can compile with here (``gcc`` or ``clang``), or None."""
    for name in ("gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def compile_forest(model: Any, workdir: Path) -> Path:
    """Compile a Treelite model to a shared library with TL2cgen, in ``workdir``.

    Raises:
        FilLoadError: no C compiler, or TL2cgen failed (its message).
    """
    import tl2cgen

    toolchain = c_compiler()
    if toolchain is None:
        raise FilLoadError("predictor 'tl2cgen' needs a C compiler (gcc or clang) on PATH")
    libpath = workdir / "forest.so"
    try:
        tl2cgen.export_lib(
            model, toolchain=toolchain, libpath=str(libpath), params={"parallel_comp": 4}
        )
    except Exception as e:
        raise FilLoadError(f"TL2cgen could not compile the model: {_short(str(e))}") from e
    return libpath


class Tl2cgenPredictor:
    """A forest compiled by TL2cgen (:func:`compile_forest`)."""

    name = "tl2cgen"

    def __init__(self, libpath: Path, info: ForestInfo, nthread: int) -> None:
        import tl2cgen

        self._tl2cgen = tl2cgen
        self._pred = tl2cgen.Predictor(str(libpath), nthread=nthread)
        self._dtype = str(self._pred.threshold_type)
        self._classes = info.num_class

    def predict(self, x: np.ndarray) -> np.ndarray:
        dmat = self._tl2cgen.DMatrix(x if self._dtype == "float32" else x.astype(self._dtype))
        out = self._pred.predict(dmat)
        return np.asarray(out, dtype=np.float32).reshape(x.shape[0], self._classes)


class GtilPredictor:
    """Treelite's own interpreter (GTIL)."""

    name = "gtil"

    def __init__(self, model: Any, info: ForestInfo, nthread: int) -> None:
        import treelite

        self._gtil = treelite.gtil
        self._model = model
        self._nthread = nthread
        self._classes = info.num_class

    def predict(self, x: np.ndarray) -> np.ndarray:
        out = self._gtil.predict(self._model, x, nthread=self._nthread)
        return np.asarray(out, dtype=np.float32).reshape(x.shape[0], self._classes)


class XGBoostPredictor:
    """XGBoost's own ``Booster.inplace_predict``, on the CPU or a CUDA GPU."""

    name = "native"

    def __init__(self, path: Path, info: ForestInfo, nthread: int, device: str = "cpu") -> None:
        import xgboost

        try:
            self._booster = xgboost.Booster(model_file=str(path))
        except Exception as e:
            raise FilLoadError(f"XGBoost could not load model file {path}: {_short(str(e))}") from e
        params: dict[str, Any] = {"device": device}
        if nthread > 0:
            params["nthread"] = nthread
        self._booster.set_param(params)
        objective = _xgboost_objective(self._booster)
        # multi:softmax predicts class ids; FIL scores are the softmax of the margins
        self._softmax = objective == "multi:softmax"
        self._classes = info.num_class

    def predict(self, x: np.ndarray) -> np.ndarray:
        if self._softmax:
            margin = np.asarray(self._booster.inplace_predict(x, predict_type="margin"))
            margin = margin.reshape(x.shape[0], self._classes)
            e = np.exp(margin - margin.max(axis=1, keepdims=True))
            return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
        out = self._booster.inplace_predict(x)
        return np.asarray(out, dtype=np.float32).reshape(x.shape[0], self._classes)


def _xgboost_objective(booster: Any) -> str:
    import json

    try:
        return str(json.loads(booster.save_config())["learner"]["objective"]["name"])
    except (KeyError, ValueError, TypeError):
        return ""


class LightGBMPredictor:
    """LightGBM's own ``Booster.predict``."""

    name = "native"

    def __init__(self, path: Path, info: ForestInfo, nthread: int) -> None:
        import lightgbm

        try:
            self._booster = lightgbm.Booster(model_file=str(path))
        except Exception as e:
            raise FilLoadError(
                f"LightGBM could not load model file {path}: {_short(str(e))}"
            ) from e
        self._kwargs: dict[str, Any] = {"num_threads": nthread} if nthread > 0 else {}
        self._classes = info.num_class

    def predict(self, x: np.ndarray) -> np.ndarray:
        out = self._booster.predict(x, **self._kwargs)
        return np.asarray(out, dtype=np.float32).reshape(x.shape[0], self._classes)


def resolve_predictor(params: FilParams, gpu: bool) -> str:
    """The predictor a model runs on: ``tl2cgen``, ``native`` or ``gtil``.

    ``auto``: XGBoost's own on a GPU; on the CPU ``tl2cgen`` when a C compiler is
    on PATH, else the framework's own predictor (``gtil`` for a Treelite
    checkpoint or a legacy XGBoost binary, which neither framework reads).

    Raises:
        FilLoadError: a GPU asked for a model XGBoost cannot run, or ``native``
            asked for a Treelite checkpoint.
    """
    has_native = params.model_type in ("xgboost_json", "xgboost_ubj", "lightgbm")
    if gpu:
        if params.model_type not in ("xgboost_json", "xgboost_ubj"):
            raise FilLoadError(
                f"KIND_GPU runs XGBoost models (model_type xgboost_json / xgboost_ubj) on "
                f"XGBoost's CUDA predictor; model_type '{params.model_type}' runs on the CPU "
                "only here: use KIND_CPU"
            )
        return "native"
    choice = params.predictor
    if choice == "auto":
        if c_compiler() is not None:
            return "tl2cgen"
        return "native" if has_native else "gtil"
    if choice == "native" and not has_native:
        raise FilLoadError(
            f"predictor 'native' has no library for model_type '{params.model_type}'; "
            "use 'tl2cgen' or 'gtil'"
        )
    return choice


def set_fil_postprocessor(model: Any, info: ForestInfo, params: FilParams) -> ForestInfo:
    """Give a multi-class model the link function FIL gives it for ``predict_proba``
    (``softmax`` for one score per tree, ``identity_multiclass`` for leaf vectors),
    in place; returns the updated info."""
    if not (params.predict_proba and info.task_type == "kMultiClf"):
        return info
    post = "softmax" if info.leaf_vector_width == 1 else "identity_multiclass"
    if post != info.postprocessor:
        model.get_header_accessor().set_field("postprocessor", post)
        return forest_info(model)
    return info
