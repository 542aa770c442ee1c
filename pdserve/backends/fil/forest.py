"""A FIL model file: loaded through Treelite (as Triton's FIL backend loads it), and
the CPU / GPU predictors that run it.

Treelite reads every FIL ``model_type``; its view of the model (features, classes,
task, postprocessor) is the one FIL serves, so it is read for every model, and a
file Treelite cannot read fails the load with Treelite's message and the path.
The predictors return scores ``[N, num_class]`` FP32 after the model's own link
function (sigmoid, softmax, ...); FIL's output rules are
:mod:`pdserve.backends.fil.postprocess`'s.

Predictors: ``tl2cgen`` (the forest compiled to a shared library with TL2cgen and
a C compiler, with a batch entry point of pdserve's, :data:`ROWS_SOURCE`), ``native`` (XGBoost's ``inplace_predict``, which also runs on a CUDA
GPU, or LightGBM's ``Booster.predict``) and ``gtil`` (Treelite's interpreter).
"""

from __future__ import annotations

import ctypes
import json
import re
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


#: pdserve's batch entry point, compiled into the forest's library beside TL2cgen's
#: ``predict`` (one row): FP32 rows ``[rows, cols]`` -> scores ``[rows, N_TARGET *
#: MAX_N_CLASS]`` of the model's type ``SCORE_T``, the loop of TL2cgen's own runtime
#: for dense rows (every feature missing, ``-1``, but the row's non-NaN values; scores
#: zeroed, then ``predict`` with the postprocessor), without its per-call wrapper
#: (data matrix, output shape queries, thread pool), which costs more than a small
#: forest's trees. Returns 0, or -1 when out of memory.
ROWS_SOURCE = """
#include "header.h"

int64_t pdserve_predict_rows(const float* x, int64_t rows, int64_t cols, SCORE_T* out) {
  const int64_t width = (int64_t)N_TARGET * MAX_N_CLASS;
  const int64_t n = cols > get_num_feature() ? cols : get_num_feature();
  union Entry* inst = (union Entry*)malloc(sizeof(union Entry) * (size_t)n);
  if (inst == NULL) {
    return -1;
  }
  for (int64_t j = 0; j < n; ++j) {
    inst[j].missing = -1;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    SCORE_T* result = out + r * width;
    for (int64_t j = 0; j < cols; ++j) {
      if (!isnan(row[j])) {
        inst[j].fvalue = (SCORE_T)row[j];
      }
    }
    for (int64_t k = 0; k < width; ++k) {
      result[k] = 0;
    }
    predict(inst, 0, result);
    for (int64_t j = 0; j < cols; ++j) {
      inst[j].missing = -1;
    }
  }
  free(inst);
  return 0;
}
"""
#: TL2cgen's declaration of ``predict`` in its ``header.h``: the score type.
_PREDICT_DECL = re.compile(
    r"void predict\(union Entry\* data, int pred_margin, (float|double)\* result\);"
)


def compile_forest(model: Any, workdir: Path) -> Path:
    """Compile a Treelite model to a shared library with TL2cgen, in ``workdir``, with
    :data:`ROWS_SOURCE`'s entry point when TL2cgen's ``predict`` is the one it was
    written for (else without it: :class:`Tl2cgenPredictor` then runs TL2cgen's runtime).

    Raises:
        FilLoadError: no C compiler, or TL2cgen failed (its message).
    """
    import tl2cgen

    toolchain = c_compiler()
    if toolchain is None:
        raise FilLoadError("predictor 'tl2cgen' needs a C compiler (gcc or clang) on PATH")
    libpath = workdir / "forest.so"
    src = workdir / "src"
    try:
        tl2cgen.generate_c_code(model, str(src), params={"parallel_comp": 4})
        decl = _PREDICT_DECL.search((src / "header.h").read_text())
        if decl is not None:
            rows = ROWS_SOURCE.replace("SCORE_T", decl.group(1))
            (src / "pdserve_rows.c").write_text(rows)
            recipe = json.loads((src / "recipe.json").read_text())
            recipe["sources"].append({"name": "pdserve_rows", "length": rows.count("\n")})
            (src / "recipe.json").write_text(json.dumps(recipe))
        built = tl2cgen.create_shared(toolchain, str(src), long_build_time_warning=False)
        shutil.move(str(built), str(libpath))
    except Exception as e:
        raise FilLoadError(f"TL2cgen could not compile the model: {_short(str(e))}") from e
    return libpath


#: Rows per thread from which a TL2cgen predictor with several threads hands a batch to
#: TL2cgen's runtime (its thread pool) instead of running it on the calling thread.
PARALLEL_ROWS_PER_THREAD = 512


class Tl2cgenPredictor:
    """A forest compiled by TL2cgen (:func:`compile_forest`): batches run through the
    library's ``pdserve_predict_rows`` on the calling thread; with ``nthread`` > 1,
    batches of :data:`PARALLEL_ROWS_PER_THREAD` rows per thread or more (and every batch
    of a library without the entry point) through TL2cgen's runtime."""

    name = "tl2cgen"

    def __init__(self, libpath: Path, info: ForestInfo, nthread: int) -> None:
        import tl2cgen

        self._tl2cgen = tl2cgen
        self._pred = tl2cgen.Predictor(str(libpath), nthread=nthread)
        self._dtype = str(self._pred.threshold_type)
        self._classes = info.num_class
        self._parallel_rows = PARALLEL_ROWS_PER_THREAD * nthread if nthread > 1 else None
        lib = ctypes.CDLL(str(libpath))  # releases the GIL while it runs
        self._rows = getattr(lib, "pdserve_predict_rows", None)
        if self._rows is not None:
            self._rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            self._rows.restype = ctypes.c_int64
            self._lib = lib  # kept loaded while the predictor lives

    def predict(self, x: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        if self._rows is None or (self._parallel_rows is not None and rows >= self._parallel_rows):
            dmat = self._tl2cgen.DMatrix(x if self._dtype == "float32" else x.astype(self._dtype))
            out = self._pred.predict(dmat)
            return np.asarray(out, dtype=np.float32).reshape(rows, self._classes)
        x = np.ascontiguousarray(x, dtype=np.float32)
        scores = np.empty((rows, self._classes), dtype=self._dtype)
        if self._rows(x.ctypes.data, rows, x.shape[1], scores.ctypes.data) != 0:
            raise MemoryError("pdserve_predict_rows could not allocate a row")
        return scores if self._dtype == "float32" else scores.astype(np.float32)


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
