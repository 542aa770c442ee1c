"""Model configuration: ``config.pbtxt`` <-> Triton's ``ModelConfig`` protobuf.

The steps follow the order in which Triton prepares a model's configuration:
:func:`load_model_config` reads ``config.pbtxt``; :func:`normalize_platform` completes the
platform / backend pair; a backend auto-completes what only its model file knows; then
:func:`apply_defaults` fills Triton's defaults and :func:`validate_config` (and, for an
ensemble, :func:`validate_ensemble`) applies Triton's checks. :func:`config_to_json` and
:func:`config_from_json` are its JSON form. Every problem is a :class:`ConfigError`
naming the file and the dotted field (``input[1].dims``).

This package's names are its public API; each lives in the submodule that does its job:
``schema`` (names, types, errors), ``loading``, ``model_file``, ``defaults``,
``validation``, ``batching``, ``ensemble``, ``json_form``.
"""

from tritonclient.grpc import model_config_pb2

from pdserve.config.defaults import (
    DEFAULT_MAX_INSTANCE_COUNT,
    DEFAULT_MAX_SEQUENCE_IDLE_US,
    apply_defaults,
    max_instance_count,
    set_max_instance_count,
)
from pdserve.config.ensemble import (
    EnsemblePlan,
    EnsembleStep,
    StepLookup,
    validate_ensemble,
)
from pdserve.config.json_form import config_from_json, config_to_json, parse_config_override
from pdserve.config.loading import load_model_config, normalize_platform
from pdserve.config.model_file import find_model_file, model_file_path, model_may_be_folder
from pdserve.config.schema import (
    BACKEND_TO_PLATFORM,
    CONFIG_FILENAME,
    DEFAULT_MODEL_FILENAMES,
    ENSEMBLE_PLATFORM,
    FIL_BACKEND,
    FIL_DEFAULT_MODEL_TYPE,
    FIL_MODEL_FILENAMES,
    KNOWN_BACKENDS,
    KNOWN_PLATFORMS,
    ONNXRUNTIME_BACKEND,
    ONNXRUNTIME_PLATFORM,
    OPENVINO_BACKEND,
    OVERRIDE_PATH,
    PLATFORM_MODEL_FILENAMES,
    PLATFORM_TO_BACKEND,
    PYTHON_BACKEND,
    PYTORCH_BACKEND,
    PYTORCH_PLATFORM,
    REMOTE_BACKEND,
    TENSORFLOW_BACKEND,
    TENSORFLOW_SAVEDMODEL_PLATFORM,
    TORCH_AOTI_PLATFORM,
    BackendCheck,
    ConfigError,
    ModelConfig,
    ModelInput,
    ModelOutput,
    datatype_of,
    get_parameter,
    io_shape,
    quoted_names,
)
from pdserve.config.validation import validate_config

__all__ = [
    "BACKEND_TO_PLATFORM",
    "CONFIG_FILENAME",
    "DEFAULT_MAX_INSTANCE_COUNT",
    "DEFAULT_MAX_SEQUENCE_IDLE_US",
    "DEFAULT_MODEL_FILENAMES",
    "ENSEMBLE_PLATFORM",
    "FIL_BACKEND",
    "FIL_DEFAULT_MODEL_TYPE",
    "FIL_MODEL_FILENAMES",
    "KNOWN_BACKENDS",
    "KNOWN_PLATFORMS",
    "ONNXRUNTIME_BACKEND",
    "ONNXRUNTIME_PLATFORM",
    "OPENVINO_BACKEND",
    "PLATFORM_MODEL_FILENAMES",
    "TENSORFLOW_BACKEND",
    "TENSORFLOW_SAVEDMODEL_PLATFORM",
    "TORCH_AOTI_PLATFORM",
    "OVERRIDE_PATH",
    "PLATFORM_TO_BACKEND",
    "PYTHON_BACKEND",
    "PYTORCH_BACKEND",
    "PYTORCH_PLATFORM",
    "REMOTE_BACKEND",
    "BackendCheck",
    "ConfigError",
    "EnsemblePlan",
    "EnsembleStep",
    "ModelConfig",
    "ModelInput",
    "ModelOutput",
    "StepLookup",
    "apply_defaults",
    "config_from_json",
    "config_to_json",
    "datatype_of",
    "find_model_file",
    "get_parameter",
    "io_shape",
    "load_model_config",
    "max_instance_count",
    "model_config_pb2",
    "model_file_path",
    "model_may_be_folder",
    "normalize_platform",
    "parse_config_override",
    "quoted_names",
    "set_max_instance_count",
    "validate_config",
    "validate_ensemble",
]
