"""Where a model version's model file is (``<repository>/<model>/<version>/<file>``)."""

from __future__ import annotations

from pathlib import Path

from pdserve.config.schema import (
    DEFAULT_MODEL_FILENAMES,
    ENSEMBLE_PLATFORM,
    FIL_BACKEND,
    FIL_DEFAULT_MODEL_TYPE,
    FIL_MODEL_FILENAMES,
    ONNXRUNTIME_BACKEND,
    OPENVINO_BACKEND,
    PLATFORM_MODEL_FILENAMES,
    PYTORCH_BACKEND,
    TENSORFLOW_BACKEND,
    ModelConfig,
    get_parameter,
)


def model_file_path(cfg: ModelConfig, version_dir: Path) -> Path | None:
    """Where the model file of a version is: ``<version_dir>/<filename>``
    (``version_dir`` is ``<repository>/<model>/<version>``).

    The one model-file lookup: the model manager and every backend find a version's
    model file here. The file name is ``default_model_filename`` or the backend's
    default (``model.onnx``, ``model.pt``, ``model.py``:
    :data:`pdserve.config.DEFAULT_MODEL_FILENAMES`). An ensemble has no model file
    (None). As in Triton's onnxruntime backend, an ONNX "file" that is a folder
    means ``<folder>/model.onnx``; a TensorFlow SavedModel is a folder
    (``model.savedmodel/``), and OpenVINO reads one too. A PyTorch model with
    ``runtime: "model.py"`` (Triton's PyTorch 2 form) and no ``default_model_filename``
    is its ``model.py``. A FIL model's file is named by its ``model_type`` parameter
    (``xgboost.json``, ``model.txt``...: :data:`pdserve.config.FIL_MODEL_FILENAMES`),
    also inside a folder named by ``default_model_filename``, as in Triton's FIL
    backend. The path is not checked for existence (:func:`find_model_file` checks).

    Raises:
        ValueError: no file name can be determined (no backend).
    """
    if cfg.platform == ENSEMBLE_PLATFORM:
        return None
    if cfg.backend == FIL_BACKEND:
        fil_name = FIL_MODEL_FILENAMES.get(
            get_parameter(cfg, "model_type") or FIL_DEFAULT_MODEL_TYPE, ""
        )
        path = version_dir / (cfg.default_model_filename or fil_name)
        return path / fil_name if fil_name and path.is_dir() else path
    filename = (
        cfg.default_model_filename
        or PLATFORM_MODEL_FILENAMES.get(cfg.platform)
        or DEFAULT_MODEL_FILENAMES.get(cfg.backend, "")
    )
    if (
        not cfg.default_model_filename
        and cfg.backend == PYTORCH_BACKEND
        and cfg.runtime == "model.py"
    ):
        filename = cfg.runtime  # Triton's PyTorch 2 form: model.py (+ optional model.pt weights)
    if not filename:
        raise ValueError(f"model '{cfg.name}': no default_model_filename and no known backend")
    path = version_dir / filename
    if cfg.backend == ONNXRUNTIME_BACKEND and path.is_dir():
        path = path / DEFAULT_MODEL_FILENAMES[ONNXRUNTIME_BACKEND]
    return path


def model_may_be_folder(cfg: ModelConfig) -> bool:
    """Whether the backend of ``cfg`` reads a folder as its model: a TensorFlow
    SavedModel (``model.savedmodel/``), or one that OpenVINO reads."""
    return cfg.backend in (TENSORFLOW_BACKEND, OPENVINO_BACKEND)


def find_model_file(cfg: ModelConfig, version_dir: Path) -> Path:
    """:func:`model_file_path`, which must be an existing file.

    Raises:
        FileNotFoundError: the file does not exist (the message names the path).
        ValueError: no file name can be determined, or an ensemble (no model file).
    """
    path = model_file_path(cfg, version_dir)
    if path is None:
        raise ValueError(f"model '{cfg.name}': an ensemble has no model file")
    folder_ok = model_may_be_folder(cfg) and path.is_dir()
    if not path.is_file() and not folder_ok:
        raise FileNotFoundError(f"model file {path} does not exist")
    return path
