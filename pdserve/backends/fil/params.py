"""The FIL backend's ``parameters``, read as Triton's FIL backend reads them.

Triton's fil_backend (``shared_state.h``) reads ``model_type`` (default ``xgboost``),
``is_classifier`` (or the older ``output_class``, still honoured),
``predict_proba``, ``threshold`` (classifiers; default 0.5),
``xgboost_allow_unknown_field`` and ``cpu_nthread`` (unset: 1 here; <= 0: every CPU). Its GPU tuning
knobs (``layout``, ``chunk_size``, ``transfer_threshold``, and the removed
``storage_type``, ``algo``, ``threads_per_tree``, ``blocks_per_sm``,
``use_experimental_optimizations``) do not change results and are accepted and
ignored. ``predictor`` is pdserve's own: which CPU predictor runs the trees.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve import config as cfgmod
from pdserve.config import ConfigError, ModelConfig

#: FIL parameters that tune FIL's own GPU kernels; accepted, without effect here.
IGNORED_PARAMETERS = frozenset(
    {
        "layout",
        "chunk_size",
        "transfer_threshold",
        "storage_type",
        "algo",
        "threads_per_tree",
        "blocks_per_sm",
        "use_experimental_optimizations",
    }
)

#: ``predictor`` values: ``auto`` picks ``tl2cgen`` when a C compiler is on PATH,
#: else the framework's own (``native``; ``gtil`` for a Treelite checkpoint).
PREDICTORS = ("auto", "tl2cgen", "native", "gtil")

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", ""}


@dataclass(frozen=True)
class FilParams:
    """One FIL model's parameters.

    Attributes:
        model_type: ``xgboost`` (legacy binary), ``xgboost_json``, ``xgboost_ubj``,
            ``lightgbm`` or ``treelite_checkpoint``.
        is_classifier: a classifier (``is_classifier`` / ``output_class``).
        predict_proba: a classifier returns its class scores, not class ids.
        threshold: a binary classifier's decision threshold (class 1 when the
            score is above it).
        allow_unknown_field: XGBoost JSON / UBJSON files may hold fields Treelite
            does not know.
        cpu_nthread: threads per prediction; <= 0: the CPUs, shared among the
            model's instances. Unset: 1 (FIL's default is every CPU): a server's
            batches are small, and OpenMP threads waiting on each other on a busy
            machine cost more than they save; more instances scale instead.
        predictor: one of :data:`PREDICTORS`.
    """

    model_type: str = cfgmod.FIL_DEFAULT_MODEL_TYPE
    is_classifier: bool = False
    predict_proba: bool = False
    threshold: float = 0.5
    allow_unknown_field: bool = False
    cpu_nthread: int = 1
    predictor: str = "auto"


def _bool(cfg: ModelConfig, key: str, where: str) -> bool | None:
    raw = cfgmod.get_parameter(cfg, key)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(where, f"parameters.{key}", f"'{raw}' is not true or false")


def _number(cfg: ModelConfig, key: str, where: str, kind: type[int] | type[float]) -> float | None:
    raw = cfgmod.get_parameter(cfg, key)
    if raw is None or not raw.strip():
        return None
    try:
        return kind(raw.strip())
    except ValueError:
        raise ConfigError(
            where,
            f"parameters.{key}",
            f"'{raw}' is not {'an integer' if kind is int else 'a number'}",
        ) from None


def read_params(cfg: ModelConfig, where: str) -> FilParams:
    """Read a FIL model's ``parameters``.

    Args:
        cfg: the model configuration.
        where: the configuration file, for messages.

    Raises:
        ConfigError: an unknown ``model_type`` or ``predictor``, or a value of the
            wrong kind (``predict_proba: "maybe"``); names the parameter.
    """
    model_type = cfgmod.get_parameter(cfg, "model_type") or cfgmod.FIL_DEFAULT_MODEL_TYPE
    if model_type not in cfgmod.FIL_MODEL_FILENAMES:
        raise ConfigError(
            where,
            "parameters.model_type",
            f"'{model_type}' is not a FIL model_type; use one of "
            f"{cfgmod.quoted_names(cfgmod.FIL_MODEL_FILENAMES)}",
        )
    classifier = _bool(cfg, "is_classifier", where)
    if classifier is None:
        classifier = _bool(cfg, "output_class", where)
    predictor = (cfgmod.get_parameter(cfg, "predictor") or "auto").strip()
    if predictor not in PREDICTORS:
        raise ConfigError(
            where, "parameters.predictor", f"'{predictor}' is not one of {', '.join(PREDICTORS)}"
        )
    threshold = _number(cfg, "threshold", where, float)
    nthread = _number(cfg, "cpu_nthread", where, int)
    return FilParams(
        model_type=model_type,
        is_classifier=bool(classifier),
        predict_proba=bool(_bool(cfg, "predict_proba", where)),
        threshold=0.5 if threshold is None else float(threshold),
        allow_unknown_field=bool(_bool(cfg, "xgboost_allow_unknown_field", where)),
        cpu_nthread=1 if nthread is None else int(nthread),
        predictor=predictor,
    )
