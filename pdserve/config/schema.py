"""The model configuration's vocabulary: Triton's ``ModelConfig`` message, the platform and
backend names, :class:`ConfigError`, and small readers of a configuration's fields.

The schema is Triton's own (``tritonclient.grpc.model_config_pb2``); nothing here
re-declares it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeAlias

from tritonclient.grpc import model_config_pb2

from pdserve.core.datatypes import CONFIG_TO_V2, WILDCARD_DIM

ModelConfig: TypeAlias = model_config_pb2.ModelConfig
ModelInput: TypeAlias = model_config_pb2.ModelInput
ModelOutput: TypeAlias = model_config_pb2.ModelOutput

#: File name of the model configuration inside a model folder.
CONFIG_FILENAME = "config.pbtxt"
#: How errors name a configuration given in a repository load request (the ``config``
#: parameter) instead of read from ``config.pbtxt``.
OVERRIDE_PATH = "<config override>"

# Triton's platform and backend names, the one place pdserve spells them. Which
# backends this server can actually run is the backend registry's business
# (:mod:`pdserve.backends`), which validation asks through ``backends=``.

#: ``platform`` of an ONNX model (backend ``onnxruntime``).
ONNXRUNTIME_PLATFORM = "onnxruntime_onnx"
#: ``platform`` of a TorchScript model (backend ``pytorch``).
PYTORCH_PLATFORM = "pytorch_libtorch"
#: ``platform`` of a PyTorch 2 exported model (``model.pt2``; backend ``pytorch``).
TORCH_AOTI_PLATFORM = "torch_aoti"
#: ``platform`` of a TensorFlow SavedModel (``model.savedmodel/``; backend ``tensorflow``).
TENSORFLOW_SAVEDMODEL_PLATFORM = "tensorflow_savedmodel"
#: The ensemble platform: no backend, no model file, ``ensemble_scheduling`` instead.
ENSEMBLE_PLATFORM = "ensemble"

#: ``backend`` names.
ONNXRUNTIME_BACKEND = "onnxruntime"
PYTORCH_BACKEND = "pytorch"
PYTHON_BACKEND = "python"
OPENVINO_BACKEND = "openvino"
TENSORFLOW_BACKEND = "tensorflow"
#: Triton's FIL backend: tree models (XGBoost, LightGBM, Treelite checkpoints).
FIL_BACKEND = "fil"
#: pdserve's own backend forwarding to another V2 server (no model file, no platform).
REMOTE_BACKEND = "remote"

#: platform -> backend for the platforms pdserve knows (Triton's equivalences).
PLATFORM_TO_BACKEND: dict[str, str] = {
    ONNXRUNTIME_PLATFORM: ONNXRUNTIME_BACKEND,
    PYTORCH_PLATFORM: PYTORCH_BACKEND,
    TORCH_AOTI_PLATFORM: PYTORCH_BACKEND,
    TENSORFLOW_SAVEDMODEL_PLATFORM: TENSORFLOW_BACKEND,
}
#: backend -> the platform Triton fills in for it (python and openvino have none; a
#: pytorch model without a platform is TorchScript).
BACKEND_TO_PLATFORM: dict[str, str] = {
    ONNXRUNTIME_BACKEND: ONNXRUNTIME_PLATFORM,
    PYTORCH_BACKEND: PYTORCH_PLATFORM,
    TENSORFLOW_BACKEND: TENSORFLOW_SAVEDMODEL_PLATFORM,
}
#: Backend names a configuration may give (the registry says which can run here).
KNOWN_BACKENDS = frozenset(
    {
        ONNXRUNTIME_BACKEND,
        PYTORCH_BACKEND,
        PYTHON_BACKEND,
        REMOTE_BACKEND,
        OPENVINO_BACKEND,
        TENSORFLOW_BACKEND,
        FIL_BACKEND,
    }
)
#: FIL's ``model_type`` parameter -> the model file it looks for in a version folder
#: (Triton's fil_backend ``model.h``); ``xgboost`` when the parameter is absent.
FIL_MODEL_FILENAMES: dict[str, str] = {
    "xgboost": "xgboost.model",
    "xgboost_json": "xgboost.json",
    "xgboost_ubj": "xgboost.ubj",
    "lightgbm": "model.txt",
    "treelite_checkpoint": "checkpoint.tl",
}
FIL_DEFAULT_MODEL_TYPE = "xgboost"
#: Platform names a configuration may give.
KNOWN_PLATFORMS = frozenset({*PLATFORM_TO_BACKEND, ENSEMBLE_PLATFORM})

#: backend -> the model file Triton looks for in a version folder by default, in
#: the order Triton's auto-complete tries them (onnxruntime, (openvino), pytorch, python).
DEFAULT_MODEL_FILENAMES: dict[str, str] = {
    ONNXRUNTIME_BACKEND: "model.onnx",
    PYTORCH_BACKEND: "model.pt",
    PYTHON_BACKEND: "model.py",
    OPENVINO_BACKEND: "model.xml",
    TENSORFLOW_BACKEND: "model.savedmodel",
}
#: platform -> its default model file where it differs from its backend's.
PLATFORM_MODEL_FILENAMES: dict[str, str] = {TORCH_AOTI_PLATFORM: "model.pt2"}

#: The backend registry's answer to "can backend NAME run here?": None if it can, else
#: the reason (:func:`pdserve.backends.registry.unavailable_reason`). The configuration sits
#: below the backends in the import order, so its callers hand the registry in.
BackendCheck = Callable[[str], str | None]


class ConfigError(Exception):
    """A model configuration that cannot be served.

    Attributes:
        path: the configuration file (or model folder) the problem is in.
        field: dotted path of the offending field, e.g. ``input[1].dims`` or
            ``platform``; for a parse error, ``line:column``.
        message: what is wrong, in words.

    ``str(error)`` is ``"{path}: {field}: {message}"``.
    """

    def __init__(self, path: str | Path, field: str, message: str) -> None:
        self.path = str(path)
        self.field = field
        self.message = message
        super().__init__(f"{self.path}: {field}: {message}")


#: How a validation step reports a broken rule: ``fail(field, message)``.
Fail = Callable[[str, str], None]


def quoted_names(items: Iterable[str]) -> str:
    """Names as messages list them: ``'a', 'b'`` (sorted)."""
    return ", ".join(f"'{i}'" for i in sorted(items))


def datatype_of(io: ModelInput | ModelOutput) -> str:
    """The V2 datatype name of a configured tensor (``TYPE_STRING`` -> ``"BYTES"``).

    Raises:
        ValueError: the tensor's ``data_type`` is ``TYPE_INVALID`` (not set).
    """
    name = model_config_pb2.DataType.Name(io.data_type)
    if name == "TYPE_INVALID":
        raise ValueError(f"tensor '{io.name}' has no data_type")
    return CONFIG_TO_V2.get(name, name.removeprefix("TYPE_"))


def io_shape(cfg: ModelConfig, io: ModelInput | ModelOutput) -> list[int]:
    """The full shape a client sees for a tensor.

    That is ``dims``, with a leading ``-1`` batch dimension when the model
    batches (``max_batch_size > 0``).
    """
    dims = [int(d) for d in io.dims]
    return [WILDCARD_DIM, *dims] if cfg.max_batch_size > 0 else dims


def get_parameter(cfg: ModelConfig, key: str, default: str | None = None) -> str | None:
    """The ``string_value`` of model parameter ``key``, or ``default`` if absent.

    Model parameters are ``parameters { key: "x" value: { string_value: "y" } }``.
    """
    if key in cfg.parameters:
        return cfg.parameters[key].string_value
    return default
