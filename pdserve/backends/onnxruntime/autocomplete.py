"""ONNX model auto-complete: fill and check a configuration from the model file.

Triton's onnxruntime backend completes a configuration from the graph's inputs and
outputs (its ``AutoCompleteConfig``); so does :func:`complete_from_session` here,
which the ONNX Runtime backend (:mod:`pdserve.backends.onnxruntime.backend`) calls
from its ``auto_complete`` hook. :func:`autocomplete_from_io` holds the rules; it
works on plain ``(name, datatype, shape)`` tuples, so it is testable without a
model file. The generic steps before and after (platform, defaults, validation)
are :mod:`pdserve.config`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tritonclient.grpc import model_config_pb2

from pdserve.config import (
    CONFIG_FILENAME,
    ConfigError,
    ModelConfig,
    ModelInput,
    ModelOutput,
    quoted_names,
)
from pdserve.core.datatypes import ORT_TO_V2, V2_TO_CONFIG, WILDCARD_DIM, shape_str

if TYPE_CHECKING:
    import onnxruntime

#: Triton's ``--backend-config=default-max-batch-size`` default: the
#: ``max_batch_size`` auto-complete gives a model that can batch but whose
#: configuration does not say (Triton server ``qa/L0_backend_config`` asserts 4).
DEFAULT_MAX_BATCH_SIZE = 4
#: The serving process's ``default-max-batch-size`` (:func:`set_default_max_batch_size`).
_DEFAULT_MAX_BATCH = [DEFAULT_MAX_BATCH_SIZE]


def set_default_max_batch_size(size: int) -> None:
    """Set the ``max_batch_size`` auto-complete gives a model that can batch
    (tritonserver's ``--backend-config=default-max-batch-size=N``; 0: no batching)."""
    _DEFAULT_MAX_BATCH[0] = size


def default_max_batch_size() -> int:
    """The ``max_batch_size`` auto-complete gives a model that can batch, in this
    process (:func:`set_default_max_batch_size`); every backend's auto-complete uses it."""
    return _DEFAULT_MAX_BATCH[0]


#: One model-file tensor: (name, V2 datatype, shape). A shape entry is an int
#: (negative = variable) or None / a str for a symbolic (variable) dimension; a
#: shape of None means the rank is unknown.
TensorInfo = tuple[str, str, Sequence[int | str | None] | None]


def autocomplete_from_io(
    cfg: ModelConfig,
    inputs: Sequence[TensorInfo],
    outputs: Sequence[TensorInfo],
    supports_batching: bool = True,
    path: str | Path = "",
    *,
    default_max_batch_size: int | None = None,
) -> None:
    """Complete and check a configuration against a model file's tensors, in place.

    Follows Triton's onnxruntime backend auto-complete (``AutoCompleteConfig``),
    with pdserve's additions noted:

    * Batching: unless the configuration already declares both inputs and
      outputs (Triton then skips auto-complete), a model whose every input and
      output has a variable first dimension can batch; ``max_batch_size`` 0 then
      becomes ``default_max_batch_size`` (Triton's default is 4) and, when that is
      above 1 and no batcher is configured, an empty ``dynamic_batching`` is added
      (Triton turns its dynamic batcher on). ``max_batch_size > 0`` on a model
      that cannot batch is an error.
    * Inputs: configured inputs are kept in order; a missing ``data_type`` or
      ``dims`` is filled from the model; model inputs the configuration lacks are
      appended (pdserve addition: Triton fails such a model with "configuration
      expects N inputs, model provides M").
    * Outputs: with none configured, all of the model's are added. Configured
      outputs may be a subset of the model's (Triton allows it: only those are
      served), so missing ones are not added.
    * Checks: a configured tensor the model does not have, a datatype that
      differs, a rank that differs, or a fixed dimension that differs from a fixed
      model dimension. A ``-1`` on either side matches anything (pdserve is
      lenient here; Triton also rejects a config ``-1`` against a fixed model
      dimension, and compares output dims exactly). When batching, the model's
      first dimension must be variable and config dims exclude it.

    Args:
        cfg: the configuration (after :func:`pdserve.config.normalize_platform`).
        inputs / outputs: the model file's tensors as ``(name, v2_datatype,
            shape)``; shapes are full (batch dimension included).
        supports_batching: False when the backend cannot batch this model; it
            decides the auto-complete of ``max_batch_size``. Declared tensors are
            checked one by one in any case.
        path: the configuration file, for error messages.
        default_max_batch_size: Triton's ``default-max-batch-size`` backend setting
            (None: the process's, :func:`set_default_max_batch_size`).

    Raises:
        ConfigError: naming the field (``input[0].dims``...) that disagrees with
            the model file.
    """
    where = path or cfg.name or CONFIG_FILENAME
    model_inputs = {name: (dt, _model_shape(shape)) for name, dt, shape in inputs}
    model_outputs = {name: (dt, _model_shape(shape)) for name, dt, shape in outputs}

    # ---- batching (Triton's AutoCompleteMaxBatch)
    def first_dim_variable(shape: list[int] | None) -> bool:
        return shape is not None and len(shape) > 0 and shape[0] == WILDCARD_DIM

    all_shapes = [s for _, s in model_inputs.values()] + [s for _, s in model_outputs.values()]
    can_batch = supports_batching and all(first_dim_variable(s) for s in all_shapes)
    declared_both = len(cfg.input) > 0 and len(cfg.output) > 0
    if not declared_both:
        if can_batch:
            if cfg.max_batch_size == 0:
                default = (
                    _DEFAULT_MAX_BATCH[0]
                    if default_max_batch_size is None
                    else default_max_batch_size
                )
                cfg.max_batch_size = max(default, 0)
            if (
                cfg.max_batch_size > 1
                and not cfg.HasField("dynamic_batching")
                and not cfg.HasField("sequence_batching")
            ):
                cfg.dynamic_batching.SetInParent()
        elif cfg.max_batch_size != 0:
            raise ConfigError(
                where,
                "max_batch_size",
                _cannot_batch_reason(cfg.max_batch_size, model_inputs, model_outputs),
            )
    # With inputs and outputs both declared, Triton checks batching per declared
    # tensor (a model output left out of the config does not matter): see below.

    batching = cfg.max_batch_size > 0

    # ---- inputs: check / fill the declared ones, then add the missing ones
    declared_inputs: set[str] = set()
    for i, io in enumerate(cfg.input):
        declared_inputs.add(io.name)
        if io.name not in model_inputs:
            raise ConfigError(
                where,
                f"input[{i}].name",
                f"unknown input '{io.name}': the model file's inputs are "
                f"{quoted_names(model_inputs) or 'none'}",
            )
        dt, shape = model_inputs[io.name]
        if io.allow_ragged_batch and batching:
            shape = None  # ragged: the model takes the requests' values as one 1-D tensor
        _complete_io(io, f"input[{i}]", dt, shape, batching, where)
    # batch_input targets are model inputs the server builds per batch, not request inputs.
    batch_targets = {t for bi in cfg.batch_input for t in bi.target_name}
    for name, (dt, shape) in model_inputs.items():
        if name not in declared_inputs and name not in batch_targets:
            _complete_io(
                cfg.input.add(name=name), f"input[{len(cfg.input) - 1}]", dt, shape, batching, where
            )

    # ---- outputs: Triton fills them only when none is declared
    if len(cfg.output) == 0:
        for name, (dt, shape) in model_outputs.items():
            _complete_io(
                cfg.output.add(name=name),
                f"output[{len(cfg.output) - 1}]",
                dt,
                shape,
                batching,
                where,
            )
    else:
        for i, io in enumerate(cfg.output):
            if io.name not in model_outputs:
                raise ConfigError(
                    where,
                    f"output[{i}].name",
                    f"unknown output '{io.name}': the model file's outputs are "
                    f"{quoted_names(model_outputs) or 'none'}",
                )
            dt, shape = model_outputs[io.name]
            _complete_io(io, f"output[{i}]", dt, shape, batching, where)


def _model_shape(shape: Sequence[int | str | None] | None) -> list[int] | None:
    """A model file shape with every variable/symbolic dimension as -1 (None: unknown rank)."""
    if shape is None:
        return None
    out = []
    for d in shape:
        if d is None or isinstance(d, str) or int(d) < 0:
            out.append(WILDCARD_DIM)
        else:
            out.append(int(d))
    return out


def _cannot_batch_reason(
    max_batch_size: int,
    model_inputs: dict[str, tuple[str, list[int] | None]],
    model_outputs: dict[str, tuple[str, list[int] | None]],
) -> str:
    head = f"max_batch_size {max_batch_size} asks for batching, but the model cannot batch"
    for kind, tensors in (("input", model_inputs), ("output", model_outputs)):
        for name, (_, shape) in tensors.items():
            if shape is None or not shape or shape[0] != WILDCARD_DIM:
                return (
                    f"{head}: the first dimension of {kind} '{name}' (shape "
                    f"{shape_str(shape)}) is not a variable-size batch dimension; "
                    "set max_batch_size: 0 and give full shapes in dims"
                )
    return head


def _complete_io(
    io: ModelInput | ModelOutput,
    field: str,
    model_dt: str,
    model_shape: list[int] | None,
    batching: bool,
    where: str | Path,
) -> None:
    """Fill or check one configured tensor against the model file's.

    A missing ``data_type`` / ``dims`` is filled from the model; present ones
    are checked against it.
    """
    config_type = V2_TO_CONFIG.get(model_dt)
    if config_type is None:
        raise ConfigError(
            where,
            f"{field}.data_type",
            f"model tensor '{io.name}' has "
            f"datatype '{model_dt}', which has no model configuration type",
        )
    model_enum = model_config_pb2.DataType.Value(config_type)
    if io.data_type == model_config_pb2.TYPE_INVALID:
        io.data_type = model_enum
    elif io.data_type != model_enum:
        raise ConfigError(
            where,
            f"{field}.data_type",
            f"data_type {model_config_pb2.DataType.Name(io.data_type)} of '{io.name}' disagrees "
            f"with the model file, which has {config_type}",
        )

    if batching:
        if model_shape is not None and (not model_shape or model_shape[0] != WILDCARD_DIM):
            raise ConfigError(
                where,
                f"{field}.dims",
                f"the model cannot batch: the first dimension of '{io.name}' (shape "
                f"{shape_str(model_shape)}) is not a variable-size batch dimension, "
                "but max_batch_size > 0",
            )
        debatched = model_shape[1:] if model_shape is not None else None
    else:
        debatched = model_shape

    has_reshape = io.HasField("reshape")
    if len(io.dims) == 0 and not has_reshape:
        # Fill from the model, as Triton's AutoCompleteIO does.
        if debatched is None:
            io.dims.append(WILDCARD_DIM)
        elif debatched:
            io.dims.extend(debatched)
        else:
            # Scalar per batch item / scalar model tensor: dims [1]; a batching
            # model reshapes it back to [] (empty reshape).
            io.dims.append(1)
            if batching:
                io.reshape.SetInParent()
        return

    if debatched is None:
        return  # the model file does not say: nothing to compare
    configured = list(io.reshape.shape) if has_reshape else list(io.dims)
    label = "reshape.shape" if has_reshape else "dims"
    if not batching and model_shape == [] and all(d == 1 for d in configured):
        return  # a scalar model tensor: Triton accepts dims of all 1s
    if len(configured) != len(debatched) or any(
        c != m and c != WILDCARD_DIM and m != WILDCARD_DIM
        for c, m in zip(configured, debatched, strict=False)
    ):
        shown = f"[-1] + {shape_str(configured)}" if batching else shape_str(configured)
        raise ConfigError(
            where,
            f"{field}.{label}",
            f"{label} {shown} of '{io.name}' disagree with the model file's shape "
            f"{shape_str(model_shape)}",
        )


def session_tensors(args: Sequence[onnxruntime.NodeArg], where: str) -> list[TensorInfo]:
    """An ONNX Runtime session's inputs or outputs (``NodeArg``) as :data:`TensorInfo`.

    A symbolic or unknown dimension becomes None.

    Raises:
        ConfigError: a tensor type with no V2 datatype (field: the tensor's name).
    """
    out: list[TensorInfo] = []
    for a in args:
        if a.type not in ORT_TO_V2:
            raise ConfigError(where, a.name, f"unsupported ONNX type {a.type}")
        shape = [d if isinstance(d, int) and d >= 0 else None for d in a.shape]
        out.append((a.name, ORT_TO_V2[a.type], shape))
    return out


def complete_from_session(
    cfg: ModelConfig, session: onnxruntime.InferenceSession, path: str | Path, where: str
) -> None:
    """Complete and check ``cfg`` against an ``onnxruntime.InferenceSession``'s graph.

    The model can batch when every input and output has a variable first
    dimension (:func:`autocomplete_from_io` decides ``max_batch_size`` from it).

    Args:
        cfg: the configuration, updated in place.
        session: the session (a CPU session is enough: only its metadata is read).
        path: the configuration file, for auto-complete's error messages.
        where: the version folder, for an unsupported tensor type's message.

    Raises:
        ConfigError: as :func:`session_tensors` and :func:`autocomplete_from_io`.
    """
    inputs = session_tensors(session.get_inputs(), where)
    outputs = session_tensors(session.get_outputs(), where)
    batching = all(s and s[0] is None for _, _, s in inputs + outputs)
    autocomplete_from_io(cfg, inputs, outputs, batching, str(path))
