"""Model configuration: ``config.pbtxt`` <-> Triton's ``ModelConfig`` protobuf.

The schema is Triton's own (``tritonclient.grpc.model_config_pb2``), parsed with
``google.protobuf.text_format``; nothing here re-declares it. The functions follow
the order in which Triton prepares a model's configuration:

1. :func:`load_model_config` reads ``<model>/config.pbtxt`` (or starts empty) and
   sets / checks ``name``.
2. :func:`normalize_platform` fills the missing half of the ``platform`` /
   ``backend`` pair and ``default_model_filename`` (Triton core's
   ``AutoCompleteBackendFields``); given the backend registry's check, it also
   refuses a backend this server cannot run.
3. A backend auto-completes what only the model file knows (its ``auto_complete``
   hook; for ONNX, :mod:`pdserve.backends.onnxruntime.autocomplete`, as Triton's
   onnxruntime backend's ``AutoCompleteConfig``).
4. :func:`apply_defaults` fills Triton's defaults (``NormalizeModelConfig`` and
   ``NormalizeInstanceGroup``): version policy, preferred batch size, instance
   groups.
5. :func:`validate_config` applies Triton's generic checks
   (``ValidateModelConfig`` / ``ValidateIOShape``).

:func:`config_to_json` renders the configuration as ``GET /v2/models/{m}/config``
returns it; :func:`config_from_json` parses the repository API's config override.

Every problem is a :class:`ConfigError` naming the file and the dotted field
(``input[1].dims``), so a user can go straight to the line to fix.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeAlias

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from tritonclient.grpc import model_config_pb2

from pdserve.core.datatypes import (
    CONFIG_TO_V2,
    WILDCARD_DIM,
    dims_element_count,
    fixed_dim_chunks,
    shape_str,
)

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
#: The ensemble platform: no backend, no model file, ``ensemble_scheduling`` instead.
ENSEMBLE_PLATFORM = "ensemble"

#: ``backend`` names.
ONNXRUNTIME_BACKEND = "onnxruntime"
PYTORCH_BACKEND = "pytorch"
PYTHON_BACKEND = "python"
#: pdserve's own backend forwarding to another V2 server (no model file, no platform).
REMOTE_BACKEND = "remote"

#: platform -> backend for the platforms pdserve knows (Triton's equivalences).
PLATFORM_TO_BACKEND: dict[str, str] = {
    ONNXRUNTIME_PLATFORM: ONNXRUNTIME_BACKEND,
    PYTORCH_PLATFORM: PYTORCH_BACKEND,
}
#: backend -> the platform Triton fills in for it (python has none).
BACKEND_TO_PLATFORM: dict[str, str] = {v: k for k, v in PLATFORM_TO_BACKEND.items()}
#: Backend names a configuration may give (the registry says which can run here).
KNOWN_BACKENDS = frozenset({ONNXRUNTIME_BACKEND, PYTORCH_BACKEND, PYTHON_BACKEND, REMOTE_BACKEND})
#: Platform names a configuration may give.
KNOWN_PLATFORMS = frozenset({*PLATFORM_TO_BACKEND, ENSEMBLE_PLATFORM})

#: backend -> the model file Triton looks for in a version folder by default, in
#: the order Triton's auto-complete tries them (onnxruntime, (openvino), pytorch, python).
DEFAULT_MODEL_FILENAMES: dict[str, str] = {
    ONNXRUNTIME_BACKEND: "model.onnx",
    PYTORCH_BACKEND: "model.pt",
    PYTHON_BACKEND: "model.py",
}

#: Default of the most model instances one model version may ask for (the sum over
#: its instance groups; a ``KIND_GPU`` group has ``count`` per GPU). Triton has no
#: such limit (``NormalizeInstanceGroup`` only raises a count below 1 to 1), so a
#: typo such as ``count: 100000`` would start that many workers or sessions;
#: ``serve`` / ``check`` ``--max-instance-count`` change it (:func:`set_max_instance_count`).
DEFAULT_MAX_INSTANCE_COUNT = 128
_max_instance_count = DEFAULT_MAX_INSTANCE_COUNT


def set_max_instance_count(limit: int) -> None:
    """Set the most instances a model may ask for (process-wide; the CLI sets it once).

    Raises:
        ValueError: ``limit`` < 1.
    """
    global _max_instance_count
    if limit < 1:
        raise ValueError(f"the instance limit must be >= 1, got {limit}")
    _max_instance_count = limit


def max_instance_count() -> int:
    """The most instances a model may ask for (:data:`DEFAULT_MAX_INSTANCE_COUNT`)."""
    return _max_instance_count


#: Backends whose CPU instance groups default to 2 instances (Triton's
#: ``SetDefaultInstanceCount``; everything else defaults to 1).
_TWO_CPU_INSTANCE_BACKENDS = frozenset({ONNXRUNTIME_BACKEND, "tensorflow"})

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


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


# --------------------------------------------------------------------------- loading


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read ``<model_dir>/config.pbtxt`` into a ``ModelConfig``.

    A missing file gives an empty configuration (Triton allows that while
    auto-complete is on, its default). An empty ``name`` becomes the folder
    name; a ``name`` that differs from the folder name is an error, as in Triton
    (the model repository manager requires them to be equal).

    Raises:
        ConfigError: the text does not parse (``field`` is ``line:column``), the
            file cannot be read, or the name differs from the folder's.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / CONFIG_FILENAME
    cfg = ModelConfig()
    if config_path.is_file():
        try:
            text = config_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(config_path, "file", f"cannot read: {exc}") from None
        try:
            text_format.Parse(text, cfg)
        except text_format.ParseError as exc:
            line, column = exc.GetLine(), exc.GetColumn()
            where = f"{line}:{column}" if line is not None else "syntax"
            message = str(exc)
            prefix = f"{line}:{column} : "
            if message.startswith(prefix):
                message = message[len(prefix) :]
            raise ConfigError(config_path, where, message) from None
    folder = model_dir.name
    if not cfg.name:
        cfg.name = folder
    elif cfg.name != folder:
        raise ConfigError(
            config_path,
            "name",
            f"model name '{cfg.name}' differs from its folder name '{folder}'; "
            "Triton requires the configuration name to equal the directory name",
        )
    return cfg


# --------------------------------------------------------------------------- platform


def normalize_platform(
    cfg: ModelConfig,
    path: str | Path = "",
    *,
    guess_from_files: Iterable[str] | None = None,
    backends: BackendCheck | None = None,
) -> None:
    """Fill the missing half of the platform/backend pair, in place.

    Triton's equivalences: ``platform: "onnxruntime_onnx"`` <-> ``backend:
    "onnxruntime"``, ``"pytorch_libtorch"`` <-> ``"pytorch"``; ``backend:
    "python"`` has no platform; ``platform: "ensemble"`` has no backend. With
    neither set, the backend is inferred like Triton's auto-complete: first from
    ``default_model_filename``, then from ``guess_from_files`` (the names in the
    model's first version folder): ``model.onnx`` -> onnxruntime, ``model.pt`` ->
    pytorch, ``model.py`` -> python. ``default_model_filename`` is then set to the
    backend's default when empty (Triton shows it in the served configuration).

    Args:
        cfg: the configuration, updated in place.
        path: the configuration file, for error messages.
        guess_from_files: file names of a version folder, used only when neither
            platform nor backend is set.
        backends: the backend registry's check
            (:func:`pdserve.backends.registry.unavailable_reason`); with it, a backend this
            server cannot run (``pytorch``, a missing optional package) is an error
            with the registry's reason. None: any backend Triton names is accepted.

    Raises:
        ConfigError: an unknown platform or backend, a pair that disagrees,
            nothing to infer the backend from, or (with ``backends``) a backend
            that cannot run here.
    """
    where = path or cfg.name or CONFIG_FILENAME
    platform, backend = cfg.platform, cfg.backend

    if platform and platform not in KNOWN_PLATFORMS:
        raise ConfigError(
            where,
            "platform",
            f"unknown platform '{platform}'; pdserve serves {quoted_names(KNOWN_PLATFORMS)}",
        )
    if backend and backend not in KNOWN_BACKENDS:
        raise ConfigError(where, "backend", _unknown_backend(backend, backends))

    if not platform and not backend:
        backend = _guess_backend(cfg.default_model_filename, guess_from_files)
        if backend is None:
            raise ConfigError(
                where,
                "platform",
                "must specify 'platform' or 'backend' (no model.onnx, model.pt or "
                "model.py in the version folder to infer it from)",
            )

    if platform == ENSEMBLE_PLATFORM:
        if backend:
            raise ConfigError(
                where,
                "backend",
                f"ensemble model must have platform '{ENSEMBLE_PLATFORM}' and an empty backend, "
                f"got backend '{backend}'",
            )
        return

    if platform:
        expected = PLATFORM_TO_BACKEND[platform]
        if backend and backend != expected:
            raise ConfigError(
                where,
                "backend",
                f"unexpected 'platform' and 'backend' pair: '{platform}' goes with backend "
                f"'{expected}', got '{backend}'",
            )
        backend = expected
    else:
        platform = BACKEND_TO_PLATFORM.get(backend, "")

    reason = backends(backend) if backends is not None else None
    if reason:
        raise ConfigError(where, "backend" if cfg.backend else "platform", reason)

    cfg.platform = platform
    cfg.backend = backend
    # Triton: a pytorch model with runtime "model.py" keeps an empty default.
    python_runtime = backend == PYTORCH_BACKEND and cfg.runtime == "model.py"
    if not cfg.default_model_filename and not python_runtime and backend in DEFAULT_MODEL_FILENAMES:
        cfg.default_model_filename = DEFAULT_MODEL_FILENAMES[backend]


def _guess_backend(default_filename: str, files: Iterable[str] | None) -> str | None:
    """The backend Triton would infer from the model file name(s), or None."""
    by_file = {filename: backend for backend, filename in DEFAULT_MODEL_FILENAMES.items()}
    if default_filename:
        return by_file.get(default_filename)
    names = set(files or ())
    for backend, filename in DEFAULT_MODEL_FILENAMES.items():  # Triton's order
        if filename in names:
            return backend
    return None


def quoted_names(items: Iterable[str]) -> str:
    """Names as messages list them: ``'a', 'b'`` (sorted)."""
    return ", ".join(f"'{i}'" for i in sorted(items))


def _unknown_backend(backend: str, backends: BackendCheck | None) -> str:
    """The message for a backend name Triton's configuration does not know."""
    reason = backends(backend) if backends is not None else None
    return reason or f"unknown backend '{backend}'; pdserve knows {quoted_names(KNOWN_BACKENDS)}"


# --------------------------------------------------------------------------- helpers


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


# --------------------------------------------------------------------------- model file


def model_file_path(cfg: ModelConfig, version_dir: Path) -> Path | None:
    """Where the model file of a version is: ``<version_dir>/<filename>``
    (``version_dir`` is ``<repository>/<model>/<version>``).

    The one model-file lookup: the model manager and every backend find a version's
    model file here. The file name is ``default_model_filename`` or the backend's
    default (``model.onnx``, ``model.pt``, ``model.py``:
    :data:`pdserve.config.DEFAULT_MODEL_FILENAMES`). An ensemble has no model file
    (None). As in Triton's onnxruntime backend, an ONNX "file" that is a folder
    means ``<folder>/model.onnx``. A PyTorch model with ``runtime: "model.py"``
    (Triton's PyTorch 2 form) and no ``default_model_filename`` is its ``model.py``. The path is not checked for existence
    (:func:`find_model_file` checks).

    Raises:
        ValueError: no file name can be determined (no backend).
    """
    if cfg.platform == ENSEMBLE_PLATFORM:
        return None
    filename = cfg.default_model_filename or DEFAULT_MODEL_FILENAMES.get(cfg.backend, "")
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


def find_model_file(cfg: ModelConfig, version_dir: Path) -> Path:
    """:func:`model_file_path`, which must be an existing file.

    Raises:
        FileNotFoundError: the file does not exist (the message names the path).
        ValueError: no file name can be determined, or an ensemble (no model file).
    """
    path = model_file_path(cfg, version_dir)
    if path is None:
        raise ValueError(f"model '{cfg.name}': an ensemble has no model file")
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    return path


# --------------------------------------------------------------------------- defaults


def apply_defaults(cfg: ModelConfig, *, gpus: Sequence[int] = ()) -> None:
    """Fill Triton's defaults into a completed configuration, in place.

    Follows Triton core's ``NormalizeModelConfig`` and ``NormalizeInstanceGroup``:

    * no ``version_policy`` -> ``latest { num_versions: 1 }``;
    * ``dynamic_batching`` without ``preferred_batch_size`` -> ``[max_batch_size]``
      when ``max_batch_size > 0``;
    * ``sequence_batching`` without ``max_sequence_idle_microseconds`` -> 1000000 (1 s);
    * non-ensembles: ``optimization`` input/output pinned memory enabled; no
      ``instance_group`` -> one group named after the model; unnamed groups ->
      ``<model>_<index>``; ``KIND_AUTO`` -> ``KIND_GPU`` if ``gpus`` else
      ``KIND_CPU``; ``count < 1`` -> 1 (2 for onnxruntime on CPU); a GPU group
      without ``gpus`` -> every GPU.

    Args:
        cfg: the configuration, updated in place.
        gpus: the GPU device ids available to the server.
    """
    if not cfg.HasField("version_policy"):
        cfg.version_policy.latest.num_versions = 1

    if cfg.HasField("dynamic_batching"):
        db = cfg.dynamic_batching
        if len(db.preferred_batch_size) == 0 and cfg.max_batch_size > 0:
            db.preferred_batch_size.append(cfg.max_batch_size)

    if cfg.HasField("sequence_batching"):
        sb = cfg.sequence_batching
        if sb.max_sequence_idle_microseconds == 0:  # Triton's default: 1 s
            sb.max_sequence_idle_microseconds = DEFAULT_MAX_SEQUENCE_IDLE_US

    if cfg.HasField("ensemble_scheduling") or cfg.platform == ENSEMBLE_PLATFORM:
        return

    opt = cfg.optimization
    if not opt.HasField("input_pinned_memory"):
        opt.input_pinned_memory.enable = True
    if not opt.HasField("output_pinned_memory"):
        opt.output_pinned_memory.enable = True

    group_pb = model_config_pb2.ModelInstanceGroup
    if len(cfg.instance_group) == 0:
        cfg.instance_group.add(name=cfg.name)
    for index, group in enumerate(cfg.instance_group):
        if not group.name:
            group.name = f"{cfg.name}_{index}"
        if group.kind == group_pb.KIND_AUTO:
            use_gpu = bool(gpus) and all(g in gpus for g in group.gpus)
            group.kind = group_pb.KIND_GPU if use_gpu else group_pb.KIND_CPU
        if group.count < 1:
            two = group.kind == group_pb.KIND_CPU and cfg.backend in _TWO_CPU_INSTANCE_BACKENDS
            group.count = 2 if two else 1
        if group.kind == group_pb.KIND_GPU and len(group.gpus) == 0:
            group.gpus.extend(gpus)


# --------------------------------------------------------------------------- validation


def validate_config(
    cfg: ModelConfig,
    path: str | Path,
    *,
    model_dir: Path | None = None,
    complete: bool = True,
    backends: BackendCheck | None = None,
    errors: list[ConfigError] | None = None,
) -> list[str]:
    """Check a configuration against Triton's generic rules.

    The rules are Triton core's ``ValidateModelConfig`` and ``ValidateIOShape``:
    platform/backend pair (and, with ``backends``, a backend this server runs); ``max_batch_size >= 0``; every input/output has a
    ``name`` (no duplicates), a ``data_type`` and ``dims``; each dim is ``>= 1``
    or ``-1``; ``reshape`` has valid dims, the same element count as ``dims``
    (chunk by chunk around ``-1``) and is not empty on a non-batching model;
    ``FORMAT_NHWC``/``FORMAT_NCHW`` inputs have 3 dims; no shape tensors (TensorRT
    only); dynamic batching's preferred sizes in ``[1, max_batch_size]``,
    priority levels in range, no DELAY timeout with ``preserve_ordering``;
    ``KIND_CPU``/``KIND_MODEL`` groups list no GPUs (and, beyond Triton, ask for no
    more than :func:`max_instance_count` instances in all); an output's
    ``label_filename`` exists (relative to the model folder); an ensemble has
    ``ensemble_scheduling`` with steps, no backend and no instance groups, and
    only an ensemble has ``ensemble_scheduling``. Beyond Triton's rules: the
    decoupled transaction policy only with the python backend (and ensembles);
    ``sequence_batching`` as :func:`_validate_sequence_batching` says.

    Run it after auto-complete, as Triton does. With ``complete=False`` the
    checks auto-complete could still satisfy (a missing ``data_type`` or
    ``dims``) are skipped.

    Args:
        cfg: the configuration.
        path: the configuration file, for error messages.
        model_dir: the model folder (``label_filename`` is relative to it);
            defaults to ``path``'s parent.
        complete: whether auto-complete has run.
        backends: the backend registry's check
            (:func:`pdserve.backends.registry.unavailable_reason`): a backend this server
            cannot run is then an error with its reason.
        errors: when given, every broken rule is appended to it (in the order the
            rules are checked) and nothing is raised: ``pdserve check`` reports them
            all. None (the server's way): the first one is raised.

    Returns:
        Warnings: things Triton accepts that are probably not what the user
        meant (``dynamic_batching`` on a model with ``max_batch_size: 0``: Triton
        queues but never batches its requests).

    Raises:
        ConfigError: the first rule broken, naming the field (not with ``errors``).
    """
    where = str(path)

    def fail(field: str, message: str) -> None:
        error = ConfigError(where, field, message)
        if errors is None:
            raise error
        errors.append(error)

    folder = Path(model_dir) if model_dir is not None else Path(where).parent
    warnings: list[str] = []
    mbs = cfg.max_batch_size
    is_ensemble = cfg.platform == ENSEMBLE_PLATFORM

    if not cfg.name:
        fail("name", "model configuration must specify 'name'")
    if not cfg.platform and not cfg.backend:
        fail("platform", "must specify 'platform' or 'backend'")
    if cfg.platform and cfg.platform not in KNOWN_PLATFORMS:
        fail("platform", f"unknown platform '{cfg.platform}'")
    reason = backends(cfg.backend) if backends is not None and cfg.backend else None
    if cfg.backend and cfg.backend not in KNOWN_BACKENDS:
        fail("backend", f"unknown backend '{cfg.backend}'")
    elif reason:
        fail("backend", reason)
    if is_ensemble and cfg.backend:
        fail("backend", "an ensemble must have an empty backend")
    if cfg.platform in PLATFORM_TO_BACKEND and cfg.backend not in (
        "",
        PLATFORM_TO_BACKEND[cfg.platform],
    ):
        fail(
            "backend",
            f"unexpected 'platform' and 'backend' pair: '{cfg.platform}', '{cfg.backend}'",
        )
    if mbs < 0:
        fail("max_batch_size", f"must be non-negative, got {mbs}")

    for kind, ios in (("input", cfg.input), ("output", cfg.output)):
        seen: set[str] = set()
        for i, io in enumerate(ios):
            field = f"{kind}[{i}]"
            if not io.name:
                fail(f"{field}.name", f"model {kind} must specify 'name'")
            elif io.name in seen:
                fail(f"{field}.name", f"duplicate {kind} name '{io.name}'")
            seen.add(io.name)
            _validate_io_shape(io, field, kind, mbs, complete, fail)
            image_formats = (ModelInput.FORMAT_NHWC, ModelInput.FORMAT_NCHW)
            if kind == "input" and io.format in image_formats and len(io.dims) != 3:
                fail(f"{field}.format", "NHWC/NCHW inputs require 3 dims")
            if io.is_shape_tensor:
                fail(
                    f"{field}.is_shape_tensor",
                    "shape tensors are only supported for the TensorRT platform",
                )
            label = io.label_filename if kind == "output" else ""
            if label and not (folder / label).is_file():
                fail(
                    f"{field}.label_filename",
                    f"label file '{label}' not found in the model folder",
                )

    if cfg.HasField("dynamic_batching"):
        _validate_dynamic_batching(cfg, where, warnings, fail)
    if cfg.HasField("sequence_batching"):
        _validate_sequence_batching(cfg, fail)
    _refuse_unserved_scheduling(cfg, fail)

    group_pb = model_config_pb2.ModelInstanceGroup
    for i, group in enumerate(cfg.instance_group):
        if group.kind in (group_pb.KIND_CPU, group_pb.KIND_MODEL) and len(group.gpus) > 0:
            kind_name = group_pb.Kind.Name(group.kind)
            fail(
                f"instance_group[{i}].gpus",
                f"instance group has kind {kind_name} but specifies one or more GPUs",
            )
    _validate_instance_count(cfg, fail)

    if cfg.HasField("ensemble_scheduling") and not is_ensemble:
        fail(
            "ensemble_scheduling",
            f"ensemble_scheduling is only for platform '{ENSEMBLE_PLATFORM}'",
        )
    if is_ensemble:
        if len(cfg.ensemble_scheduling.step) == 0:
            fail("ensemble_scheduling.step", "an ensemble must specify at least one 'step'")
        if len(cfg.instance_group) > 0:
            fail("instance_group", "instance groups must not be specified for an ensemble")
    return warnings


def _validate_instance_count(cfg: ModelConfig, fail: Callable[[str, str], None]) -> None:
    """No group, and not all groups together, ask for more than :func:`max_instance_count`
    instances (a ``KIND_GPU`` group: ``count`` on each of its ``gpus``). Beyond Triton,
    which has no limit."""
    limit = max_instance_count()
    group_pb = model_config_pb2.ModelInstanceGroup
    hint = "per model (serve's --max-instance-count)"
    total = 0
    over = False
    for i, group in enumerate(cfg.instance_group):
        count = max(int(group.count), 1)
        if count > limit:
            fail(
                f"instance_group[{i}].count",
                f"count {group.count} is more than the limit of {limit} instances {hint}",
            )
            over = True
        gpus = len(group.gpus) if group.kind == group_pb.KIND_GPU else 0
        total += count * max(gpus, 1)
    if total > limit and not over:
        fail(
            "instance_group",
            f"the instance groups ask for {total} instances, more than the limit of {limit} {hint}",
        )


def _refuse_unserved_scheduling(cfg: ModelConfig, fail: Callable[[str, str], None]) -> None:
    """Refuse what pdserve cannot serve yet rather than serve it wrongly.

    A decoupled model (``model_transaction_policy { decoupled: true }``) sends zero or
    several responses per request through a response sender; pdserve streams them for
    python-backend models (and decoupled ensembles) only, so a decoupled model of
    another backend fails to load with this reason (Triton serves it).
    (``sequence_batching`` is served: :func:`_validate_sequence_batching`.)
    """
    if (
        cfg.model_transaction_policy.decoupled
        and cfg.backend != PYTHON_BACKEND
        and (cfg.platform != ENSEMBLE_PLATFORM)
    ):
        fail(
            "model_transaction_policy.decoupled",
            "pdserve serves decoupled models (zero or several responses per request) "
            "with the python backend only (and decoupled ensembles); set 'decoupled: false' "
            "or serve this model with Triton",
        )


def _validate_io_shape(
    io: ModelInput | ModelOutput,
    field: str,
    kind: str,
    mbs: int,
    complete: bool,
    fail: Callable[[str, str], None],
) -> None:
    """Triton's ``ValidateIOShape`` for one input or output."""
    if complete and io.data_type == model_config_pb2.TYPE_INVALID:
        fail(f"{field}.data_type", f"{kind} '{io.name}' must specify 'data_type'")
    if complete and len(io.dims) == 0:
        fail(f"{field}.dims", f"{kind} '{io.name}' must specify 'dims'")
    for d in io.dims:
        if d < 1 and d != WILDCARD_DIM:
            fail(
                f"{field}.dims",
                f"dimension {d} of '{io.name}': a dimension must be an integer >= 1, "
                "or -1 for a variable-size dimension",
            )
            break
    if not io.HasField("reshape"):
        return
    shape = list(io.reshape.shape)
    if not shape and mbs == 0:
        fail(
            f"{field}.reshape",
            f"'{io.name}' cannot have an empty reshape on a non-batching model "
            "(scalar tensors are not supported)",
        )
        return
    for d in shape:
        if d < 1 and d != WILDCARD_DIM:
            fail(
                f"{field}.reshape.shape",
                f"reshape dimension {d} of '{io.name}' must be an integer >= 1, or -1",
            )
            return
    dims_count = dims_element_count(io.dims)
    reshape_count = dims_element_count(shape)
    if dims_count != reshape_count and (reshape_count != 0 or dims_count != 1):
        fail(
            f"{field}.reshape",
            f"'{io.name}' has a different element count for dims {shape_str(list(io.dims))} "
            f"and reshape {shape_str(shape)}",
        )
    elif dims_count == WILDCARD_DIM and fixed_dim_chunks(io.dims) != fixed_dim_chunks(shape):
        fail(
            f"{field}.reshape",
            f"'{io.name}': dims {shape_str(list(io.dims))} and reshape {shape_str(shape)} "
            "differ around their variable-size dimensions",
        )


def _validate_dynamic_batching(
    cfg: ModelConfig, where: str, warnings: list[str], fail: Callable[[str, str], None]
) -> None:
    db = cfg.dynamic_batching
    mbs = cfg.max_batch_size
    for size in db.preferred_batch_size:
        if size <= 0:
            fail(
                "dynamic_batching.preferred_batch_size",
                f"preferred batch size {size} must be positive",
            )
        elif size > mbs:
            what = (
                "batching asked of a model that cannot batch (max_batch_size is 0)"
                if mbs == 0
                else f"must be <= max_batch_size {mbs} (a served configuration lists "
                "max_batch_size here when none was configured: lower or remove it "
                "together with max_batch_size)"
            )
            fail(
                "dynamic_batching.preferred_batch_size",
                f"preferred batch size {size}: {what}",
            )
    if mbs == 0:
        warnings.append(
            f"{where}: dynamic_batching: max_batch_size is 0, so requests are queued "
            "(priorities, timeouts) but never batched"
        )
    levels = db.priority_levels
    if levels != 0:
        if db.default_priority_level == 0 or db.default_priority_level > levels:
            fail(
                "dynamic_batching.default_priority_level",
                f"default priority level must be in range [1, {levels}]",
            )
        for level in db.priority_queue_policy:
            if level == 0 or level > levels:
                fail(
                    "dynamic_batching.priority_queue_policy",
                    f"priority queue policy level {level} must be in range [1, {levels}]",
                )
    if db.preserve_ordering:
        if levels > 1:
            fail(
                "dynamic_batching.priority_levels",
                "only one priority level is allowed when 'preserve_ordering' is true",
            )
        delay = model_config_pb2.ModelQueuePolicy.DELAY
        policies = [("default_queue_policy", db.default_queue_policy)] + [
            (f"priority_queue_policy[{k}]", v) for k, v in db.priority_queue_policy.items()
        ]
        for name, policy in policies:
            if policy.default_timeout_microseconds != 0 and policy.timeout_action == delay:
                fail(
                    f"dynamic_batching.{name}.timeout_action",
                    "a queue policy cannot have DELAY as timeout action when "
                    "'preserve_ordering' is true",
                )


_SB = model_config_pb2.ModelSequenceBatching
#: Triton's default ``max_sequence_idle_microseconds`` (1 s).
DEFAULT_MAX_SEQUENCE_IDLE_US = 1_000_000
#: datatypes a ``CONTROL_SEQUENCE_CORRID`` control may have (Triton's)
CORRID_TYPES = frozenset(
    {
        model_config_pb2.TYPE_UINT64,
        model_config_pb2.TYPE_INT64,
        model_config_pb2.TYPE_UINT32,
        model_config_pb2.TYPE_INT32,
        model_config_pb2.TYPE_STRING,
    }
)


def _validate_sequence_batching(cfg: ModelConfig, fail: Callable[[str, str], None]) -> None:
    """Triton's rules for ``sequence_batching`` (``model_config.proto``
    ``ModelSequenceBatching``; ``ValidateModelConfig`` / the sequence batcher's setup):

    - each ``control_input`` has a name not used by a model input, at least one
      control; each control kind appears once in all; ``START``/``END``/``READY`` have
      exactly one of ``int32_false_true``/``fp32_false_true``/``bool_false_true`` with
      two values (false, true); ``CORRID`` has a ``data_type`` of
      UINT64/INT64/UINT32/INT32/STRING and no false/true values;
    - each ``state`` has ``input_name``, ``output_name``, ``data_type`` and ``dims``
      (all >= 1), names unique and not model inputs/outputs; at most one
      ``initial_state``, with ``zero_data`` (pdserve does not read ``data_file``),
      whose datatype and dims equal the state's;
    - ``oldest.max_candidate_sequences`` >= 0, ``oldest.preferred_batch_size`` in
      ``[1, max_batch_size]``; ``direct.minimum_slot_utilization`` in [0, 1];
      ``iterative_sequence`` is refused (pdserve does not reschedule requests);
    - beyond Triton: no ``response_cache`` (a stateful model's answer depends on the
      sequence, not only on the request).
    """
    sb = cfg.sequence_batching
    field = "sequence_batching"
    io_names = {i.name for i in cfg.input} | {o.name for o in cfg.output}
    names: set[str] = set()
    kinds: set[int] = set()
    control = _SB.Control
    for i, ci in enumerate(sb.control_input):
        where = f"{field}.control_input[{i}]"
        if not ci.name:
            fail(f"{where}.name", "a sequence batching control input must have a name")
        elif ci.name in names or ci.name in io_names:
            fail(f"{where}.name", f"control input name '{ci.name}' is already used")
        names.add(ci.name)
        if len(ci.control) == 0:
            fail(f"{where}.control", f"control input '{ci.name}' must specify a control")
        for c in ci.control:
            kind = control.Kind.Name(c.kind)
            if c.kind in kinds:
                fail(f"{where}.control", f"sequence batching specifies multiple {kind} tensors")
            kinds.add(c.kind)
            given = [
                n
                for n, v in (
                    ("int32_false_true", c.int32_false_true),
                    ("fp32_false_true", c.fp32_false_true),
                    ("bool_false_true", c.bool_false_true),
                )
                if len(v) > 0
            ]
            if c.kind == control.CONTROL_SEQUENCE_CORRID:
                if given:
                    fail(f"{where}.control", f"{kind} control '{ci.name}' takes no {given[0]}")
                if c.data_type not in CORRID_TYPES:
                    fail(
                        f"{where}.control",
                        f"{kind} control '{ci.name}' must specify data_type TYPE_UINT64, "
                        "TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING",
                    )
                continue
            if len(given) != 1:
                fail(
                    f"{where}.control",
                    f"{kind} control '{ci.name}' must specify exactly one of "
                    "'int32_false_true', 'fp32_false_true' or 'bool_false_true'",
                )
                continue
            values = getattr(c, given[0])
            if len(values) != 2:
                fail(
                    f"{where}.control",
                    f"{kind} control '{ci.name}' must have exactly 2 entries in "
                    f"'{given[0]}' (false, true)",
                )
    for i, st in enumerate(sb.state):
        where = f"{field}.state[{i}]"
        for attr in ("input_name", "output_name"):
            name = getattr(st, attr)
            if not name:
                fail(f"{where}.{attr}", f"a sequence state must specify '{attr}'")
            elif name in names or name in io_names:
                fail(f"{where}.{attr}", f"state name '{name}' is already used")
            names.add(name)
        if st.data_type == model_config_pb2.TYPE_INVALID:
            fail(f"{where}.data_type", "a sequence state must specify 'data_type'")
        if len(st.dims) == 0 or any(d < 1 for d in st.dims):
            fail(f"{where}.dims", "a sequence state must specify 'dims', each >= 1")
        if len(st.initial_state) > 1:
            fail(f"{where}.initial_state", "a sequence state takes at most one initial_state")
        for init in st.initial_state:
            if init.WhichOneof("state_data") != "zero_data":
                fail(
                    f"{where}.initial_state",
                    "only 'zero_data' initial states are supported by pdserve (not 'data_file')",
                )
            if init.data_type != st.data_type or list(init.dims) != list(st.dims):
                fail(
                    f"{where}.initial_state",
                    "initial_state data_type and dims must equal the state's",
                )
    if sb.HasField("oldest"):
        old = sb.oldest
        if old.max_candidate_sequences < 0:
            fail(f"{field}.oldest.max_candidate_sequences", "must be >= 0")
        for size in old.preferred_batch_size:
            if size < 1 or size > max(1, cfg.max_batch_size):
                fail(
                    f"{field}.oldest.preferred_batch_size",
                    f"preferred batch size {size} must be in [1, {max(1, cfg.max_batch_size)}]",
                )
    if sb.HasField("direct"):
        util = sb.direct.minimum_slot_utilization
        if not 0.0 <= util <= 1.0:
            fail(f"{field}.direct.minimum_slot_utilization", "must be in [0, 1]")
    if cfg.response_cache.enable:
        fail(
            "response_cache.enable",
            "a stateful model's responses depend on its sequence, so the response cache "
            "cannot serve them; disable response_cache for a sequence_batching model",
        )
    if sb.iterative_sequence:
        fail(
            f"{field}.iterative_sequence",
            "iterative sequences (requests rescheduled by the model) are not supported by "
            "pdserve; serve this model with Triton",
        )


# --------------------------------------------------------------------------- JSON


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    """Triton's JSON form of a configuration (``GET /v2/models/{m}/config``).

    Protobuf's JSON mapping with field names as in the ``.proto`` and fields
    without presence printed even when default (Triton's
    ``always_print_primitive_fields``); enums stay names (``"TYPE_FP32"``).
    Protobuf writes 64-bit integers as strings; Triton turns them back into
    numbers (``"dims": [64]``), and so does this, by walking the message
    descriptor alongside the dict.
    """
    try:
        d = json_format.MessageToDict(
            cfg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    except TypeError:  # protobuf < 5.26
        d = json_format.MessageToDict(
            cfg, preserving_proto_field_name=True, including_default_value_fields=True
        )
    _fix_int64(d, cfg.DESCRIPTOR)
    return d


def _fix_int64(d: dict[str, Any], desc: Descriptor) -> None:
    """Turn protobuf-JSON's string-encoded 64-bit integers in ``d`` back into ints."""
    for field in desc.fields:
        if field.name not in d:
            continue
        value = d[field.name]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = field.message_type
            if sub.GetOptions().map_entry:
                value_field = sub.fields_by_name["value"]
                for key, item in value.items():
                    value[key] = _fix_value(item, value_field)
            elif _is_repeated(field):
                for item in value:
                    if isinstance(item, dict):
                        _fix_int64(item, sub)
            elif isinstance(value, dict):
                _fix_int64(value, sub)
        elif field.type in _INT64_TYPES:
            d[field.name] = [int(v) for v in value] if _is_repeated(field) else int(value)


def _fix_value(value: Any, field: FieldDescriptor) -> Any:
    """Fix one map value (a message dict or a scalar)."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if isinstance(value, dict):
            _fix_int64(value, field.message_type)
        return value
    if field.type in _INT64_TYPES:
        return int(value)
    return value


def _is_repeated(field: FieldDescriptor) -> bool:
    """Whether a field is repeated, without protobuf 6's deprecated ``label``."""
    is_repeated = getattr(field, "is_repeated", None)
    if is_repeated is None:  # older protobuf
        return field.label == FieldDescriptor.LABEL_REPEATED
    return bool(is_repeated() if callable(is_repeated) else is_repeated)


def config_from_json(d: Any, path: str | Path = OVERRIDE_PATH) -> ModelConfig:
    """Parse a JSON configuration (the repository API's ``config`` override).

    Accepts what :func:`config_to_json` produces (numbers or strings for 64-bit
    integers, enum names).

    Raises:
        ConfigError: not a JSON object, unknown fields, values of the wrong type, or
            nested too deeply.
    """
    if not isinstance(d, dict):
        raise ConfigError(
            path, "config", f"must be a JSON object (a ModelConfig), not {_json_kind(d)}"
        )
    cfg = ModelConfig()
    try:
        json_format.ParseDict(d, cfg)
    except json_format.ParseError as exc:
        raise ConfigError(path, "config", str(exc)) from None
    except RecursionError:
        raise ConfigError(path, "config", "nested too deeply") from None
    return cfg


def parse_config_override(
    value: str | bytes | dict[str, Any] | ModelConfig | None,
) -> ModelConfig | None:
    """The repository API's ``config`` load parameter as a ``ModelConfig``.

    Args:
        value: Triton's JSON form as text (HTTP and gRPC send a string) or already
            parsed, or a ``ModelConfig`` (returned as is); None: no override.

    Returns:
        The configuration, or None when there is no override.

    Raises:
        ConfigError (path :data:`OVERRIDE_PATH`, field ``config``): the text is empty
            or blank (Triton cannot parse it either; leave the parameter out instead),
            not UTF-8, not JSON, nested too deeply, not a JSON object, or not a
            ModelConfig.
    """
    if value is None or getattr(value, "DESCRIPTOR", None) is ModelConfig.DESCRIPTOR:
        return value
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(OVERRIDE_PATH, "config", "not UTF-8 text") from None
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(
                OVERRIDE_PATH,
                "config",
                "empty: give the model configuration as a JSON object, "
                "or leave the 'config' parameter out",
            )
        try:
            value = json.loads(value)
        except RecursionError:
            raise ConfigError(OVERRIDE_PATH, "config", "nested too deeply") from None
        except ValueError as exc:
            raise ConfigError(OVERRIDE_PATH, "config", f"not JSON: {exc}") from None
    return config_from_json(value)


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (``a JSON array``...)."""
    if isinstance(value, bool):
        return "a JSON boolean"
    if value is None:
        return "JSON null"
    if isinstance(value, int | float):
        return "a JSON number"
    if isinstance(value, str):
        return "a JSON string"
    if isinstance(value, list):
        return "a JSON array"
    return type(value).__name__
