"""Reading ``config.pbtxt`` and completing its platform / backend pair.

:func:`load_model_config` reads ``<model>/config.pbtxt`` (or starts empty) and sets or
checks ``name``; :func:`normalize_platform` fills the missing half of the ``platform`` /
``backend`` pair and ``default_model_filename`` (Triton core's
``AutoCompleteBackendFields``) and, given the backend registry's check, refuses a backend
this server cannot run.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from google.protobuf import text_format

from pdserve.config.schema import (
    BACKEND_TO_PLATFORM,
    CONFIG_FILENAME,
    DEFAULT_MODEL_FILENAMES,
    ENSEMBLE_PLATFORM,
    KNOWN_BACKENDS,
    KNOWN_PLATFORMS,
    PLATFORM_MODEL_FILENAMES,
    PLATFORM_TO_BACKEND,
    PYTORCH_BACKEND,
    TORCH_AOTI_PLATFORM,
    BackendCheck,
    ConfigError,
    ModelConfig,
    quoted_names,
)


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
    pytorch, ``model.py`` -> python, ``model.xml`` -> openvino, ``model.savedmodel`` ->
    tensorflow_savedmodel, ``model.pt2`` -> torch_aoti. A pytorch model whose
    ``default_model_filename`` ends in ``.pt2`` is ``torch_aoti``. ``default_model_filename``
    is then set to the platform's or backend's default when empty (Triton shows it in
    the served configuration).

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
        guessed = _guess_backend(cfg.default_model_filename, guess_from_files)
        if guessed is None:
            raise ConfigError(
                where,
                "platform",
                "must specify 'platform' or 'backend' (no model.onnx, model.pt, model.py, "
                "model.xml, model.savedmodel or model.pt2 in the version folder to infer it "
                "from)",
            )
        backend, platform = guessed

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
    elif backend == PYTORCH_BACKEND and cfg.default_model_filename.endswith(".pt2"):
        platform = TORCH_AOTI_PLATFORM  # a PyTorch 2 package, not TorchScript
    else:
        platform = BACKEND_TO_PLATFORM.get(backend, "")

    reason = backends(backend) if backends is not None else None
    if reason:
        raise ConfigError(where, "backend" if cfg.backend else "platform", reason)

    cfg.platform = platform
    cfg.backend = backend
    # Triton: a pytorch model with runtime "model.py" keeps an empty default.
    python_runtime = backend == PYTORCH_BACKEND and cfg.runtime == "model.py"
    if not cfg.default_model_filename and not python_runtime:
        default = PLATFORM_MODEL_FILENAMES.get(platform) or DEFAULT_MODEL_FILENAMES.get(backend)
        if default:
            cfg.default_model_filename = default


def _guess_backend(default_filename: str, files: Iterable[str] | None) -> tuple[str, str] | None:
    """The (backend, platform) Triton would infer from the model file name(s), or None."""
    by_file = {filename: (backend, "") for backend, filename in DEFAULT_MODEL_FILENAMES.items()}
    by_file.update(
        {name: (PLATFORM_TO_BACKEND[p], p) for p, name in PLATFORM_MODEL_FILENAMES.items()}
    )
    if default_filename:
        return by_file.get(default_filename)
    names = set(files or ())
    for filename, found in by_file.items():  # Triton's order, then PyTorch 2's model.pt2
        if filename in names:
            return found
    return None


def _unknown_backend(backend: str, backends: BackendCheck | None) -> str:
    """The message for a backend name Triton's configuration does not know."""
    reason = backends(backend) if backends is not None else None
    return reason or f"unknown backend '{backend}'; pdserve knows {quoted_names(KNOWN_BACKENDS)}"
