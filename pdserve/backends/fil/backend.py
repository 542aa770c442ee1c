"""FIL backend (``backend: "fil"``): tree models, as Triton's FIL backend serves them.

A version holds one file named by ``model_type`` (``xgboost.json``, ``xgboost.ubj``,
``xgboost.model``, ``model.txt``, ``checkpoint.tl``) or ``default_model_filename``;
``input__0`` is FP32 ``[N, features]``, ``output__0`` FP32 as
:mod:`~pdserve.backends.fil.postprocess` says. Auto-complete (pdserve's addition: FIL
has none) fills both from the model file and checks configured ones against it.

``KIND_CPU`` instances run the predictor :func:`~pdserve.backends.fil.forest.resolve_predictor`
picks; ``KIND_GPU`` runs XGBoost models on XGBoost's CUDA predictor (a GPU not visible
fails the load); ``KIND_AUTO`` is a GPU group only for models that can run there. A
batch runs on the event loop while runs are short, else on the instance's own thread
(:class:`~pdserve.backends.base.InlineRuns`; the predictors release the GIL).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import (
    Backend,
    ExecRequest,
    ExecResult,
    InlineRuns,
    ModelInstance,
    ModelSpec,
    merge_batch,
    run_on_thread,
    split_batch,
)
from pdserve.backends.devices import check_gpu_ids, visible_gpus
from pdserve.backends.fil.forest import (
    FilLoadError,
    ForestInfo,
    GtilPredictor,
    LightGBMPredictor,
    Predictor,
    Tl2cgenPredictor,
    XGBoostPredictor,
    compile_forest,
    forest_info,
    load_treelite,
    resolve_predictor,
    set_fil_postprocessor,
)
from pdserve.backends.fil.params import FilParams, read_params
from pdserve.backends.fil.postprocess import allowed_widths, fil_output, output_width
from pdserve.backends.host_policy import instance_cores, name_current_thread, pin_current_thread
from pdserve.backends.onnxruntime.autocomplete import autocomplete_from_io
from pdserve.config import ConfigError, ModelConfig
from pdserve.core.errors import InferError, internal

#: FIL's tensor names (its docs: "should always be input__0 / output__0").
INPUT_NAME = "input__0"
OUTPUT_NAME = "output__0"
#: FIL's optional SHAP output, which this backend does not compute.
TREESHAP_OUTPUT = "treeshap_output"
#: ``model_type`` values a GPU instance can run (XGBoost's CUDA predictor).
GPU_MODEL_TYPES = frozenset({"xgboost_json", "xgboost_ubj"})


@dataclass
class LoadedForest:
    """A model file read for one version: parameters, Treelite model, its info."""

    params: FilParams
    path: Path
    model: Any
    info: ForestInfo


def read_forest(cfg: ModelConfig, version_dir: Path, where: str) -> LoadedForest:
    """Read a FIL model version's parameters and model file.

    Raises:
        ConfigError: bad parameters.
        FileNotFoundError: no model file (the message names the path).
        FilLoadError: Treelite cannot read it (names the file and Treelite's error).
    """
    params = read_params(cfg, where)
    path = cfgmod.find_model_file(cfg, version_dir)
    model = load_treelite(path, params)
    info = set_fil_postprocessor(model, forest_info(model), params)
    return LoadedForest(params, path, model, info)


def complete_fil_config(cfg: ModelConfig, forest: LoadedForest, where: str) -> None:
    """Fill and check ``input__0`` / ``output__0`` and ``KIND_AUTO`` groups, in place.

    ``input__0`` is FP32 ``[features]``; ``output__0`` FP32 ``[width]``
    (:func:`pdserve.backends.fil.postprocess.output_width`; a binary classifier's
    ``predict_proba`` may declare 1 or 2). A ``KIND_AUTO`` group of a model no GPU
    predictor runs becomes ``KIND_CPU``.

    Raises:
        ConfigError: a tensor other than FIL's, ``treeshap_output``, or dims / data
            types that disagree with the model file (naming the field).
    """
    from tritonclient.grpc import model_config_pb2 as mc

    for i, io in enumerate(cfg.output):
        if io.name == TREESHAP_OUTPUT:
            raise ConfigError(
                where,
                f"output[{i}].name",
                f"'{TREESHAP_OUTPUT}' (FIL's SHAP values) is not served by pdserve's fil backend",
            )
    info, params = forest.info, forest.params
    width = output_width(info, params)
    allowed = allowed_widths(info, params)
    for io in cfg.output:
        if io.name == OUTPUT_NAME and len(io.dims) == 1 and io.dims[0] in allowed:
            width = int(io.dims[0])
    autocomplete_from_io(
        cfg,
        [(INPUT_NAME, "FP32", [None, info.num_feature])],
        [(OUTPUT_NAME, "FP32", [None, width])],
        True,
        where,
    )
    if params.model_type not in GPU_MODEL_TYPES:
        for group in cfg.instance_group:
            if group.kind == mc.ModelInstanceGroup.KIND_AUTO:
                group.kind = mc.ModelInstanceGroup.KIND_CPU


def default_nthread(instances: int) -> int:
    """Threads per prediction when ``cpu_nthread`` <= 0: the CPUs this process may
    use, shared among the model's instances, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, instances))


@dataclass
class InstancePlan:
    """One instance to create: its kind, GPU id and host-policy cores."""

    kind: str
    gpu: int
    cores: frozenset[int] | None


def instance_plans(spec: ModelSpec) -> list[InstancePlan]:
    """The instances of ``instance_group``, in order.

    Raises:
        RuntimeError: ``KIND_GPU`` on a GPU this process cannot see, or a kind the
            FIL backend does not run.
    """
    from tritonclient.grpc import model_config_pb2 as mc

    plans: list[InstancePlan] = []
    for group in list(spec.config.instance_group) or [None]:
        count = group.count if group is not None and group.count > 0 else 1
        kind = mc.ModelInstanceGroup.Kind.Name(group.kind) if group is not None else "KIND_CPU"
        if kind == "KIND_AUTO":
            kind = "KIND_GPU" if visible_gpus() else "KIND_CPU"
        if kind == "KIND_GPU":
            assert group is not None
            gpus = list(group.gpus) or [0]
            check_gpu_ids(group.name or spec.name, gpus)
            for gpu in gpus:
                cores = instance_cores(spec.host_policies, group, gpu)
                plans.extend(InstancePlan("KIND_GPU", gpu, cores) for _ in range(count))
        elif kind in ("KIND_CPU", "KIND_MODEL"):
            cores = instance_cores(spec.host_policies, group, 0)
            plans.extend(InstancePlan("KIND_CPU", 0, cores) for _ in range(count))
        else:
            raise RuntimeError(f"instance_group kind {kind} is not supported by the fil backend")
    return plans


def build_predictors(forest: LoadedForest, plans: list[InstancePlan]) -> list[Predictor]:
    """One predictor per instance plan (a TL2cgen library is compiled once).

    Raises:
        FilLoadError: the predictor cannot run this model here (names why).
    """
    nthread = forest.params.cpu_nthread
    if nthread <= 0:
        nthread = default_nthread(len(plans))
    out: list[Predictor] = []
    workdir: Path | None = None
    libpath = Path()
    try:
        for plan in plans:
            choice = resolve_predictor(forest.params, plan.kind == "KIND_GPU")
            if plan.kind == "KIND_GPU":
                out.append(
                    XGBoostPredictor(forest.path, forest.info, nthread, device=f"cuda:{plan.gpu}")
                )
            elif choice == "tl2cgen":
                if workdir is None:
                    workdir = Path(tempfile.mkdtemp(prefix="pdserve-fil-"))
                    libpath = compile_forest(forest.model, workdir)
                out.append(Tl2cgenPredictor(libpath, forest.info, nthread))
            elif choice == "native" and forest.params.model_type == "lightgbm":
                out.append(LightGBMPredictor(forest.path, forest.info, nthread))
            elif choice == "native":
                out.append(XGBoostPredictor(forest.path, forest.info, nthread))
            else:
                out.append(GtilPredictor(forest.model, forest.info, nthread))
    finally:
        if workdir is not None:  # the libraries are loaded: the files may go
            shutil.rmtree(workdir, ignore_errors=True)
    return out


class FilBackend(Backend):
    """Loads FIL model files (:func:`read_forest`) into :class:`FilInstance` s."""

    name = cfgmod.FIL_BACKEND

    def usable_gpus(self) -> list[int]:
        """The visible GPUs: XGBoost models run on XGBoost's CUDA predictor."""
        return visible_gpus()

    async def auto_complete(self, spec: ModelSpec) -> None:
        """Read the model file and complete / check the configuration
        (:func:`complete_fil_config`), on a worker thread.

        Raises:
            ConfigError, FileNotFoundError, FilLoadError: as :func:`read_forest`
                and :func:`complete_fil_config`.
        """
        where = str(spec.model_dir / cfgmod.CONFIG_FILENAME)

        def complete() -> None:
            forest = read_forest(spec.config, spec.version_dir, where)
            complete_fil_config(spec.config, forest, where)

        await asyncio.to_thread(complete)

    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """Read the model file and build one predictor per instance.

        Raises:
            FileNotFoundError, FilLoadError: the model file is missing or unreadable
                (the message names the file and the library's error).
            RuntimeError: ``KIND_GPU`` on a GPU this process cannot see.
        """
        where = str(spec.model_dir / cfgmod.CONFIG_FILENAME)
        plans = instance_plans(spec)

        def build() -> tuple[LoadedForest, list[Predictor]]:
            forest = read_forest(spec.config, spec.version_dir, where)
            return forest, build_predictors(forest, plans)

        forest, predictors = await asyncio.to_thread(build)
        width = _configured_width(spec.config)
        return [
            FilInstance(f"{spec.name}_{i}", plan, predictor, forest.params, width)
            for i, (plan, predictor) in enumerate(zip(plans, predictors, strict=True))
        ]


def _configured_width(cfg: ModelConfig) -> int:
    for io in cfg.output:
        if io.name == OUTPUT_NAME and len(io.dims) == 1:
            return int(io.dims[0])
    raise FilLoadError(f"the configuration declares no '{OUTPUT_NAME}' of one dimension")


def _start_thread(name: str, cores: frozenset[int] | None) -> None:
    if cores:
        pin_current_thread(cores)
    name_current_thread(name)


class FilInstance(ModelInstance):
    """One predictor; a batch runs inline while runs are short, else on its thread
    (always on its thread, pinned, under a host policy)."""

    def __init__(
        self, name: str, plan: InstancePlan, predictor: Predictor, params: FilParams, width: int
    ) -> None:
        self.name = name
        self.kind = plan.kind
        self.predictor = predictor
        self._params = params
        self._width = width
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=name, initializer=_start_thread, initargs=(name, plan.cores)
        )
        self.runs = InlineRuns(name, "thread" if plan.cores else "auto")
        self._closed = False

    def _run(self, x: np.ndarray) -> np.ndarray:
        return fil_output(self.predictor.predict(x), self._params, self._width)

    def _timed_run(self, x: np.ndarray) -> np.ndarray:  # on the instance's thread
        mark = self.runs.start_on_thread()
        try:
            return self._run(x)
        finally:
            self.runs.ran_on_thread(mark)

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """Merge the batch's ``input__0`` rows, predict, split ``output__0`` per request.

        Raises:
            InferError: INTERNAL with the library's message when prediction fails;
                UNAVAILABLE when the instance is closed.
        """
        x = merge_batch(batch)[INPUT_NAME]
        x = np.ascontiguousarray(x, dtype=np.float32)
        try:
            if self.runs.inline():
                mark = self.runs.start(self._closed)
                try:
                    out = self._run(x)
                finally:
                    self.runs.ran_inline(mark)
            else:
                out = await run_on_thread(
                    self._executor, self._closed, self.name, self._timed_run, x
                )
        except InferError:
            raise
        except Exception as e:
            raise internal(f"fil prediction failed ({self.predictor.name}): {e}") from e
        return split_batch(batch, {OUTPUT_NAME: out})

    async def close(self) -> None:
        """Stop the instance's thread and drop the predictor."""
        self._closed = True
        self._executor.shutdown(wait=True)


def predict_on_cpu(cfg: ModelConfig, version_dir: Path, x: np.ndarray) -> np.ndarray:
    """``output__0`` for rows ``x`` (FP32 ``[N, features]``) as a ``KIND_CPU`` instance
    of the completed configuration ``cfg`` computes it (``pdserve check``'s goldens).

    Raises:
        ConfigError, FileNotFoundError, FilLoadError: as :func:`read_forest` and
            :func:`build_predictors`.
    """
    forest = read_forest(cfg, version_dir, str(version_dir.parent / cfgmod.CONFIG_FILENAME))
    predictor = build_predictors(forest, [InstancePlan("KIND_CPU", 0, None)])[0]
    rows = np.ascontiguousarray(x, dtype=np.float32)
    return fil_output(predictor.predict(rows), forest.params, _configured_width(cfg))
