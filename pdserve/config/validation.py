"""Triton's generic checks of a completed model configuration (``ValidateModelConfig`` /
``ValidateIOShape``), run after auto-complete as Triton does."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tritonclient.grpc import model_config_pb2

from pdserve.config.batching import validate_dynamic_batching, validate_sequence_batching
from pdserve.config.defaults import max_instance_count
from pdserve.config.field_support import check_fields
from pdserve.config.schema import (
    ENSEMBLE_PLATFORM,
    KNOWN_BACKENDS,
    KNOWN_PLATFORMS,
    PLATFORM_TO_BACKEND,
    PYTHON_BACKEND,
    BackendCheck,
    ConfigError,
    Fail,
    ModelConfig,
    ModelInput,
    ModelOutput,
)
from pdserve.core.datatypes import WILDCARD_DIM, dims_element_count, fixed_dim_chunks, shape_str


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
    platform/backend pair (and, with ``backends``, a backend this server runs);
    ``max_batch_size >= 0``; every input/output has a ``name`` (no duplicates), a ``data_type`` and ``dims``; each dim is ``>= 1``
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
    ``sequence_batching`` as :func:`~pdserve.config.batching.validate_sequence_batching` says;
    every set field as :data:`pdserve.config.field_support.FIELDS` classifies it (a refused
    one fails, an ignored one is a warning, logged once per model and field unless
    ``errors`` is given).

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
        queues but never batches its requests), and the ignored fields set.

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
    _validate_identity(cfg, backends, fail)
    for kind, ios in (("input", cfg.input), ("output", cfg.output)):
        _validate_ios(cfg, kind, ios, folder, complete, fail)
    if cfg.HasField("dynamic_batching"):
        validate_dynamic_batching(cfg, where, warnings, fail)
    if cfg.HasField("sequence_batching"):
        validate_sequence_batching(cfg, fail)
    _refuse_unserved_scheduling(cfg, fail)
    _validate_instance_groups(cfg, fail)
    _validate_ensemble_fields(cfg, fail)
    warnings.extend(check_fields(cfg, fail, log_warnings=errors is None))
    return warnings


def _validate_identity(cfg: ModelConfig, backends: BackendCheck | None, fail: Fail) -> None:
    """``name``, the platform / backend pair and ``max_batch_size``."""
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
    if cfg.platform == ENSEMBLE_PLATFORM and cfg.backend:
        fail("backend", "an ensemble must have an empty backend")
    if cfg.platform in PLATFORM_TO_BACKEND and cfg.backend not in (
        "",
        PLATFORM_TO_BACKEND[cfg.platform],
    ):
        fail(
            "backend",
            f"unexpected 'platform' and 'backend' pair: '{cfg.platform}', '{cfg.backend}'",
        )
    if cfg.max_batch_size < 0:
        fail("max_batch_size", f"must be non-negative, got {cfg.max_batch_size}")


def _validate_ios(
    cfg: ModelConfig,
    kind: str,
    ios: Sequence[ModelInput] | Sequence[ModelOutput],
    folder: Path,
    complete: bool,
    fail: Fail,
) -> None:
    """The inputs (``kind`` ``"input"``) or the outputs of a configuration."""
    seen: set[str] = set()
    for i, io in enumerate(ios):
        field = f"{kind}[{i}]"
        if not io.name:
            fail(f"{field}.name", f"model {kind} must specify 'name'")
        elif io.name in seen:
            fail(f"{field}.name", f"duplicate {kind} name '{io.name}'")
        seen.add(io.name)
        _validate_io_shape(io, field, kind, cfg.max_batch_size, complete, fail)
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


def _validate_instance_groups(cfg: ModelConfig, fail: Fail) -> None:
    """CPU and model groups list no GPUs; the instance limit holds."""
    group_pb = model_config_pb2.ModelInstanceGroup
    for i, group in enumerate(cfg.instance_group):
        if group.kind in (group_pb.KIND_CPU, group_pb.KIND_MODEL) and len(group.gpus) > 0:
            kind_name = group_pb.Kind.Name(group.kind)
            fail(
                f"instance_group[{i}].gpus",
                f"instance group has kind {kind_name} but specifies one or more GPUs",
            )
    _validate_instance_count(cfg, fail)


def _validate_ensemble_fields(cfg: ModelConfig, fail: Fail) -> None:
    """Only an ensemble has ``ensemble_scheduling``, with steps and no instance groups."""
    is_ensemble = cfg.platform == ENSEMBLE_PLATFORM
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


def _validate_instance_count(cfg: ModelConfig, fail: Fail) -> None:
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


def _refuse_unserved_scheduling(cfg: ModelConfig, fail: Fail) -> None:
    """Refuse what pdserve cannot serve yet rather than serve it wrongly.

    A decoupled model (``model_transaction_policy { decoupled: true }``) sends zero or
    several responses per request through a response sender; pdserve streams them for
    python-backend models (and decoupled ensembles) only, so a decoupled model of
    another backend fails to load with this reason (Triton serves it).
    (``sequence_batching`` is served: :func:`~pdserve.config.batching.validate_sequence_batching`.)
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
    fail: Fail,
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
