"""Reading an OpenVINO model and fitting it to its configuration.

:func:`read_model` opens ``model.xml`` (+ ``model.bin``), an ONNX file or any other
format ``Core.read_model`` reads (``default_model_filename``). :func:`complete_config`
is Triton's openvino backend auto-complete and checks; :func:`prepare_model` applies
the configuration to the graph before it is compiled: tensor element types, a
variable batch dimension (or a fixed one, ``SKIP_OV_DYNAMIC_BATCHSIZE``), and the
configured shapes under ``RESHAPE_IO_LAYERS``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.onnxruntime.autocomplete import default_max_batch_size
from pdserve.backends.openvino.options import Options
from pdserve.config import ConfigError, ModelConfig
from pdserve.core import datatypes
from pdserve.core.datatypes import WILDCARD_DIM, shape_str

if TYPE_CHECKING:
    import openvino as ov


def _ov() -> Any:
    import openvino

    return openvino


def read_model(core: ov.Core, path: Path, model: str) -> ov.Model:
    """``core.read_model(path)``.

    Raises:
        RuntimeError: OpenVINO cannot read the file; the message names the model, the
            file and OpenVINO's own error.
    """
    try:
        return core.read_model(str(path))
    except Exception as e:
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        first = next((ln for ln in lines if not ln.startswith("Exception from")), "")
        raise RuntimeError(
            f"model '{model}': OpenVINO cannot read {path}: "
            f"{first or type(e).__name__} (OpenVINO {_ov().__version__})"
        ) from e


def _v2(port: Any) -> str:
    try:
        return datatypes.numpy_to_v2(port.get_element_type().to_dtype())
    except Exception:
        return ""


def _shape(port: Any) -> list[int] | None:
    """A port's shape with each dynamic dimension as -1 (None: dynamic rank)."""
    ps = port.get_partial_shape()
    if ps.rank.is_dynamic:
        return None
    return [d.get_length() if d.is_static else WILDCARD_DIM for d in ps]


def _has_batch_layout(port: Any) -> bool:
    layout = _ov().layout_helpers.get_layout(port)
    return bool(layout.has_name("N"))


def complete_config(cfg: ModelConfig, model: ov.Model, where: str | Path) -> None:
    """Triton's openvino auto-complete, then its checks, on ``cfg`` in place.

    * ``max_batch_size`` 0 becomes the default (4) when the layout of every input and
      output has a batch (``N``) dimension; above 1 with no batcher, an empty
      ``dynamic_batching`` is added.
    * Inputs (outputs) are filled from the model when the configuration lists none:
      name, datatype, dims (the batch dimension left out when batching; a dynamic
      dimension is -1).
    * Checks: as many inputs as the model has, every configured tensor one of the
      model's, a datatype OpenVINO can convert to, and (unless ``RESHAPE_IO_LAYERS``)
      dims that fit the model's shape; a -1 matches any size.

    Raises:
        ConfigError: naming the field that disagrees with the model.
    """
    inputs, outputs = list(model.inputs), list(model.outputs)
    if cfg.max_batch_size == 0 and all(_has_batch_layout(p) for p in inputs + outputs):
        cfg.max_batch_size = max(default_max_batch_size(), 1)
    if (
        cfg.max_batch_size > 1
        and not cfg.HasField("dynamic_batching")
        and not cfg.HasField("sequence_batching")
    ):
        cfg.dynamic_batching.SetInParent()
    batching = cfg.max_batch_size > 0
    for kind, ports, ios in (("input", inputs, cfg.input), ("output", outputs, cfg.output)):
        if len(ios) == 0:
            for port in ports:
                shape = _shape(port)
                io = ios.add(name=port.get_any_name())
                config_type = datatypes.V2_TO_CONFIG.get(_v2(port))
                if config_type is None:
                    raise ConfigError(
                        where,
                        f"{kind}.data_type",
                        f"{kind} '{io.name}' has OpenVINO type "
                        f"{port.get_element_type()}, which has no model configuration type",
                    )
                io.data_type = cfgmod.model_config_pb2.DataType.Value(config_type)
                dims = (shape[1:] if batching else shape) if shape is not None else [-1]
                io.dims.extend(dims or [1])
    opts = Options.from_config(cfg)
    if len(cfg.input) != len(inputs):
        raise ConfigError(
            where,
            "input",
            f"configuration expects {len(cfg.input)} inputs, model provides "
            f"{len(inputs)} ({', '.join(p.get_any_name() for p in inputs)})",
        )
    for kind, ports, ios in (("input", inputs, cfg.input), ("output", outputs, cfg.output)):
        by_name = {n: p for p in ports for n in p.get_names()}
        for i, io in enumerate(ios):
            port = by_name.get(io.name)
            if port is None:
                raise ConfigError(
                    where,
                    f"{kind}[{i}].name",
                    f"{kind} '{io.name}' is not one of the "
                    f"model's {kind}s ({', '.join(sorted(p.get_any_name() for p in ports))})",
                )
            type_name = cfgmod.model_config_pb2.DataType.Name(io.data_type)
            if type_name == "TYPE_STRING":
                raise ConfigError(
                    where,
                    f"{kind}[{i}].data_type",
                    f"{kind} '{io.name}': the openvino backend serves no TYPE_STRING tensors",
                )
            if kind == "input" and opts.reshape_io_layers:
                continue  # the configured dims become the model's shape
            _check_dims(where, f"{kind}[{i}]", io, _shape(port), batching)


def _check_dims(
    where: str | Path, field: str, io: Any, model_shape: list[int] | None, batching: bool
) -> None:
    if model_shape is None:
        return
    dims = list(io.reshape.shape) if io.HasField("reshape") else list(io.dims)
    full = [WILDCARD_DIM, *dims] if batching else dims
    if not batching and model_shape == [] and all(d == 1 for d in dims):
        return
    if batching and model_shape:
        model_shape = [WILDCARD_DIM, *model_shape[1:]]  # the batch dim is set at load
    if len(full) != len(model_shape) or any(
        c != m and WILDCARD_DIM not in (c, m) for c, m in zip(full, model_shape, strict=False)
    ):
        raise ConfigError(
            where,
            f"{field}.dims",
            f"dims {shape_str(full)} of '{io.name}' (batch dimension "
            f"first when batching) do not fit the model's shape {shape_str(model_shape)}",
        )


def _ov_type(io: Any) -> Any:
    v2 = datatypes.CONFIG_TO_V2[cfgmod.model_config_pb2.DataType.Name(io.data_type)]
    return _ov().Type(datatypes.v2_to_numpy(v2))


def prepare_model(model: ov.Model, cfg: ModelConfig, opts: Options) -> ov.Model:
    """Fit the (completed) configuration onto ``model``, returning the model to compile.

    Element types become the configured ones (OpenVINO converts); with
    ``max_batch_size > 0`` the first dimension of every input becomes variable, or
    ``max_batch_size`` with ``SKIP_OV_DYNAMIC_BATCHSIZE``; with ``RESHAPE_IO_LAYERS`` the
    inputs take the configured dims (-1: any size).

    Raises:
        RuntimeError: OpenVINO refuses the reshape (the message names the model).
    """
    ov = _ov()
    from openvino.preprocess import PrePostProcessor

    batching = cfg.max_batch_size > 0
    shapes: dict[str, Any] = {}
    for io in cfg.input:
        port = model.input(io.name)
        current = _shape(port)
        if opts.reshape_io_layers:
            dims = list(io.reshape.shape) if io.HasField("reshape") else list(io.dims)
            shape = [WILDCARD_DIM, *dims] if batching else dims
        elif batching and current:
            shape = [WILDCARD_DIM, *current[1:]]
        else:
            continue
        if batching and opts.skip_dynamic_batchsize:
            shape[0] = cfg.max_batch_size
        shapes[io.name] = ov.PartialShape(shape)
    if shapes:
        try:
            model.reshape(shapes)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(
                f"model '{cfg.name}': OpenVINO cannot reshape its inputs to "
                f"{ {n: str(s) for n, s in shapes.items()} }: {first}"
            ) from e
    ppp = PrePostProcessor(model)
    for io in cfg.input:
        ppp.input(io.name).tensor().set_element_type(_ov_type(io))
    for io in cfg.output:
        ppp.output(io.name).tensor().set_element_type(_ov_type(io))
    return ppp.build()


def pad_batch(array: np.ndarray, size: int) -> np.ndarray:
    """``array`` with zero rows appended up to ``size`` rows (``ENABLE_BATCH_PADDING``)."""
    pad = size - array.shape[0]
    if pad <= 0:
        return array
    return np.concatenate([array, np.zeros((pad, *array.shape[1:]), dtype=array.dtype)])
