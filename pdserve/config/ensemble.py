"""Validation of an ensemble's steps against its step models, and the plan it yields.

Triton's ``ValidateEnsembleConfig`` (``ensemble_utils.cc``): every step model is loaded;
every key of a map is an input / output of that model; every required model input is
mapped; every tensor a step reads is an ensemble input or produced by exactly one step;
no step writes an ensemble input; every ensemble output is produced; every ensemble input
is read by some step; the steps form no cycle; and wherever a tensor passes between the
ensemble and a step or between two steps, datatypes are equal and shapes agree (a ``-1``
matches any size; batching models contribute a leading ``-1``). An ensemble that batches
needs steps whose ``max_batch_size`` is at least its own. Every error is a
:class:`~pdserve.config.schema.ConfigError` naming the ensemble, the step and the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from tritonclient.grpc import model_config_pb2

from pdserve.config.schema import (
    CONFIG_FILENAME,
    ConfigError,
    ModelConfig,
    ModelInput,
    ModelOutput,
    datatype_of,
    io_shape,
)
from pdserve.core.datatypes import WILDCARD_DIM, shape_str

#: ``fail(field, message)`` -> the error to raise, naming the ensemble.
_Fail = Callable[[str, str], ConfigError]
#: ``lookup(model_name, version)`` -> that step model's completed configuration, or None
#: when it is not loaded (``version`` ``""``: the version policy's choice).
StepLookup = Callable[[str, str], "ModelConfig | None"]


@dataclass(slots=True)
class TensorInfo:
    """A tensor as one side of a connection sees it.

    Attributes:
        datatype: V2 datatype name.
        shape: full shape, leading ``-1`` for a batching model's batch dimension.
        where: who it belongs to, for messages (``"input 'x' of model 'm'"``).
    """

    datatype: str
    shape: list[int]
    where: str


@dataclass
class EnsembleStep:
    """One step of a validated ensemble.

    Attributes:
        index: position in ``ensemble_scheduling.step``.
        model_name / model_version: the model to run (``""`` = policy's choice).
        input_map: model input -> ensemble tensor.
        output_map: model output -> ensemble tensor.
        reads: ensemble tensors the step needs (its mapped required inputs and any
            mapped optional ones produced inside the ensemble).
    """

    index: int
    model_name: str
    model_version: str
    input_map: dict[str, str]
    output_map: dict[str, str]
    reads: set[str] = field(default_factory=set)


@dataclass
class EnsemblePlan:
    """A validated ensemble: its steps and who produces / reads each tensor."""

    name: str
    inputs: list[str]
    outputs: list[str]
    steps: list[EnsembleStep]
    producer: dict[str, int]
    consumers: dict[str, list[int]]

    def steps_for(self, outputs: list[str]) -> list[int]:
        """Indices of the steps needed to produce ``outputs``, in config order."""
        needed: set[int] = set()
        stack = [self.producer[o] for o in outputs if o in self.producer]
        while stack:
            index = stack.pop()
            if index in needed:
                continue
            needed.add(index)
            for tensor in self.steps[index].reads:
                if tensor in self.producer:
                    stack.append(self.producer[tensor])
        return sorted(needed)


@dataclass
class _Wiring:
    """What the steps read and write, gathered step by step."""

    ens_inputs: dict[str, TensorInfo]
    ens_outputs: dict[str, TensorInfo]
    steps: list[EnsembleStep] = field(default_factory=list)
    producer: dict[str, int] = field(default_factory=dict)
    produced: dict[str, TensorInfo] = field(default_factory=dict)
    #: (step, tensor, the step's view of it, whether the model input is optional)
    reads: list[tuple[int, str, TensorInfo, bool]] = field(default_factory=list)


def _info(cfg: ModelConfig, io: ModelInput | ModelOutput, where: str) -> TensorInfo:
    return TensorInfo(datatype_of(io), io_shape(cfg, io), where)


def _shapes_agree(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(
        x == y or WILDCARD_DIM in (x, y) for x, y in zip(a, b, strict=True)
    )


def validate_ensemble(cfg: ModelConfig, lookup: StepLookup, path: str = "") -> EnsemblePlan:
    """Check an ensemble configuration against its step models; build its plan.

    Args:
        cfg: the ensemble's configuration.
        lookup: ``lookup(model_name, version)`` -> that model's (auto-completed)
            configuration, or None when it is not loaded. ``version`` is ``""``
            for the version policy's choice.
        path: the configuration file, for error messages.

    Returns:
        the plan the ensemble scheduler runs.

    Raises:
        ConfigError: the first problem found (see the module docstring), naming the
            ensemble, the step and the tensor.
    """
    name = cfg.name
    where = path or f"{name}/{CONFIG_FILENAME}"

    def fail(field_name: str, message: str) -> ConfigError:
        return ConfigError(where, field_name, f"ensemble '{name}': {message}")

    steps_cfg = list(cfg.ensemble_scheduling.step)
    if not steps_cfg:
        raise fail("ensemble_scheduling.step", "must have at least one step")
    wiring = _Wiring(
        {io.name: _info(cfg, io, f"ensemble input '{io.name}'") for io in cfg.input},
        {io.name: _info(cfg, io, f"ensemble output '{io.name}'") for io in cfg.output},
    )
    for index, step in enumerate(steps_cfg):
        _add_step(wiring, cfg, index, step, lookup, fail)
    consumers = _connect(wiring, fail)
    _check_acyclic(fail, wiring.steps, wiring.producer)
    return EnsemblePlan(
        name=name,
        inputs=list(wiring.ens_inputs),
        outputs=list(wiring.ens_outputs),
        steps=wiring.steps,
        producer=wiring.producer,
        consumers=consumers,
    )


def _add_step(
    wiring: _Wiring,
    cfg: ModelConfig,
    index: int,
    step: model_config_pb2.ModelEnsembling.Step,
    lookup: StepLookup,
    fail: _Fail,
) -> None:
    """Check one step against its model and record what it reads and writes."""
    field_name = f"ensemble_scheduling.step[{index}]"
    if not step.model_name:
        raise fail(f"{field_name}.model_name", f"step {index} must name a model")
    version = "" if step.model_version < 0 else str(step.model_version)
    model = lookup(step.model_name, version)
    label = f"step {index} (model '{step.model_name}')"
    if model is None:
        shown = f" version {version}" if version else ""
        raise fail(
            f"{field_name}.model_name",
            f"{label}: model '{step.model_name}'{shown} is not loaded; load it before the ensemble",
        )
    if cfg.max_batch_size > 0 and model.max_batch_size < cfg.max_batch_size:
        raise fail(
            "max_batch_size",
            f"the ensemble allows batches of {cfg.max_batch_size}, but {label} only allows "
            f"max_batch_size {model.max_batch_size}",
        )
    input_map = dict(step.input_map)
    output_map = dict(step.output_map)
    if not output_map:
        raise fail(f"{field_name}.output_map", f"{label} maps no output")
    checked = _Step(index, model, label, field_name, fail)
    _add_reads(wiring, checked, input_map)
    _add_writes(wiring, checked, output_map)
    wiring.steps.append(EnsembleStep(index, step.model_name, version, input_map, output_map))


#: How a step's map key that names no tensor of its model is refused, by map.
_NOT_THE_MODELS = {
    "input": "ensemble tensor '{tensor}' is mapped to '{name}', which is not an input of the model",
    "output": "'{name}' (mapped to ensemble tensor '{tensor}') is not an output of the model",
}


@dataclass(frozen=True)
class _Step:
    """One step under check: its index, its model's configuration, how errors name it
    (``label``: step 0 (model 'm'); ``field_name``: ensemble_scheduling.step[0])."""

    index: int
    model: ModelConfig
    label: str
    field_name: str
    fail: _Fail

    def refuse(self, side: str, message: str) -> ConfigError:
        """The error of the step's ``{side}_map`` (side: ``input`` or ``output``)."""
        return self.fail(f"{self.field_name}.{side}_map", message)

    def mapped(
        self, side: str, mapping: dict[str, str], ios: Iterable[ModelInput | ModelOutput]
    ) -> Iterator[tuple[str, str, ModelInput | ModelOutput]]:
        """The step's ``{side}_map`` entries, in order, as (model tensor, ensemble
        tensor, its config); a key that names none of the model's ``ios`` is refused
        (when reached), listing them."""
        by_name = {io.name: io for io in ios}
        for name, tensor in mapping.items():
            io = by_name.get(name)
            if io is None:
                known = sorted(by_name) or "none"
                message = _NOT_THE_MODELS[side].format(tensor=tensor, name=name)
                raise self.refuse(side, f"{self.label}: {message} (its {side}s: {known})")
            yield name, tensor, io


def _add_reads(wiring: _Wiring, step: _Step, input_map: dict[str, str]) -> None:
    """A step's ``input_map``: every key a model input, every required input mapped."""
    for model_in, tensor, io in step.mapped("input", input_map, step.model.input):
        info = _info(step.model, io, f"input '{model_in}' of {step.label}")
        wiring.reads.append((step.index, tensor, info, io.optional))
    for io in step.model.input:
        if io.name not in input_map and not io.optional:
            raise step.refuse(
                "input",
                f"{step.label}: required input '{io.name}' of the model is not mapped from any "
                "ensemble tensor",
            )


def _add_writes(wiring: _Wiring, step: _Step, output_map: dict[str, str]) -> None:
    """A step's ``output_map``: every key a model output, no tensor written twice."""
    producer = wiring.producer
    label = step.label
    for model_out, tensor, io in step.mapped("output", output_map, step.model.output):
        if tensor in wiring.ens_inputs:
            raise step.refuse(
                "output",
                f"ensemble tensor '{tensor}' is an ensemble input and cannot also be "
                f"produced by {label}",
            )
        if tensor in producer:
            other = wiring.steps[producer[tensor]] if producer[tensor] < len(wiring.steps) else None
            first = (
                f"step {producer[tensor]} (model '{other.model_name}')"
                if other
                else f"step {producer[tensor]}"
            )
            raise step.refuse(
                "output",
                f"ensemble tensor '{tensor}' is produced twice: by {first} and by {label}",
            )
        producer[tensor] = step.index
        wiring.produced[tensor] = _info(step.model, io, f"output '{model_out}' of {label}")


def _connect(wiring: _Wiring, fail: _Fail) -> dict[str, list[int]]:
    """Every read tensor exists with a matching datatype and shape, every ensemble
    output is produced and every ensemble input read; returns tensor -> reading steps."""
    consumers: dict[str, list[int]] = {}
    for index, tensor, info, optional in wiring.reads:
        source = wiring.ens_inputs.get(tensor) or wiring.produced.get(tensor)
        if source is None:
            raise fail(
                f"ensemble_scheduling.step[{index}].input_map",
                f"ensemble tensor '{tensor}', read by {info.where}, is neither an ensemble "
                "input nor produced by any step",
            )
        _check_match(fail, tensor, source, info, f"ensemble_scheduling.step[{index}].input_map")
        if tensor in wiring.produced or not optional:
            wiring.steps[index].reads.add(tensor)
        consumers.setdefault(tensor, []).append(index)
    for tensor, info in wiring.ens_outputs.items():
        source = wiring.produced.get(tensor)
        if source is None:
            raise fail("output", f"ensemble output '{tensor}' is not produced by any step")
        _check_match(fail, tensor, source, info, "output")
    for tensor in wiring.ens_inputs:
        if tensor not in consumers:
            raise fail("input", f"ensemble input '{tensor}' is not read by any step")
    return consumers


def _check_match(
    fail: _Fail,
    tensor: str,
    source: TensorInfo,
    sink: TensorInfo,
    field_name: str,
) -> None:
    if source.datatype != sink.datatype:
        raise fail(
            field_name,
            f"ensemble tensor '{tensor}': datatype mismatch: {source.where} is "
            f"{source.datatype} but {sink.where} is {sink.datatype}",
        )
    if not _shapes_agree(source.shape, sink.shape):
        raise fail(
            field_name,
            f"ensemble tensor '{tensor}': shape mismatch: {source.where} has shape "
            f"{shape_str(source.shape)} but {sink.where} has shape {shape_str(sink.shape)}",
        )


def _check_acyclic(
    fail: _Fail,
    steps: list[EnsembleStep],
    producer: dict[str, int],
) -> None:
    """Raise when the steps' data dependencies contain a cycle (names its tensors)."""
    state = [0] * len(steps)  # 0 new, 1 on the path, 2 done
    path: list[tuple[int, str]] = []

    def visit(index: int) -> None:
        state[index] = 1
        for tensor in sorted(steps[index].reads):
            before = producer.get(tensor)
            if before is None:
                continue
            if state[before] == 1:
                start = next(i for i, (s, _) in enumerate(path) if s == before)
                loop = [t for _, t in path[start:]] + [tensor]
                raise fail(
                    "ensemble_scheduling.step",
                    "the steps form a cycle through ensemble tensors "
                    + " -> ".join(f"'{t}'" for t in loop),
                )
            if state[before] == 0:
                path.append((index, tensor))
                visit(before)
                path.pop()
        state[index] = 2

    for i in range(len(steps)):
        if state[i] == 0:
            visit(i)
