"""What pdserve does with each field of Triton's ``ModelConfig``: one table, applied at load.

Every field path reachable from ``ModelConfig`` (``instance_group.rate_limiter.priority``;
map values are entered by the map's name, ``parameters.string_value``) is one of:
honoured; refused (the load fails naming the field and why: serving it would be wrong);
or ignored (the model loads, with one warning per model naming the field and why: a
hint that changes no answer, such as a GPU-only optimisation on a CPU server). Some
fields are honoured by some backends only; on the others they are refused or ignored.

:func:`check_fields` applies the table to a configuration (from
:func:`~pdserve.config.validate_config`); :mod:`pdserve.config.reference_page` renders it
as ``docs/reference/model-config.md``. A unit test walks the protobuf descriptor, so a
field the table does not classify fails the build.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2

from pdserve.config.schema import ENSEMBLE_PLATFORM, Fail, ModelConfig

log = logging.getLogger("pdserve.config")


class Status(enum.Enum):
    """What pdserve does with a field."""

    HONOURED = "honoured"
    REFUSED = "refused"
    IGNORED = "ignored"


@dataclass(frozen=True)
class Support:
    """One field's classification.

    Attributes:
        status: what pdserve does with it (for every backend unless ``backends``).
        reason: one line: what it does, or why it is refused / ignored.
        backends: when given, the backends (``"ensemble"`` for the ensemble platform)
            that give the field ``status``; on any other, a set field is ``otherwise``.
        otherwise: ``REFUSED`` or ``IGNORED``, for a backend outside ``backends``.
        quiet: a value that draws no warning when the field is ignored (the value
            Triton's defaults fill in, which changes nothing).
        checked_elsewhere: the refusal is made, with a more precise message, by the
            validation step named here (:func:`check_fields` leaves it to that step).
    """

    status: Status
    reason: str
    backends: frozenset[str] = frozenset()
    otherwise: Status | None = None
    quiet: Any = None
    checked_elsewhere: str = ""

    def status_for(self, backend: str) -> Status:
        """The status for a model of ``backend`` (``"ensemble"`` for an ensemble)."""
        if self.backends and backend not in self.backends and self.otherwise is not None:
            return self.otherwise
        return self.status

    def label(self) -> str:
        """The status as the reference page writes it."""
        if not self.backends or self.otherwise is None:
            return self.status.value
        names = ", ".join(sorted(self.backends))
        return f"{self.status.value} ({names}); {self.otherwise.value} elsewhere"


HON, REF, IGN = Status.HONOURED, Status.REFUSED, Status.IGNORED
_ONNX = frozenset({"onnxruntime"})
_GPU_HINT = "a GPU execution hint; pdserve's answers do not depend on it"
_TRT = "TensorRT only"
_WARMUP = "honoured: warm-up samples run on every instance before the model is ready"
_QUEUE = "honoured: the queue policy (timeouts, REJECT / DELAY, queue size) per priority level"
_CONTROL = "honoured: sequence batcher control tensors, as Triton fills them"
_STATE = "honoured: implicit sequence state kept between a sequence's requests"
_PINNED = (
    "honoured by the pytorch backend (pinned host buffers for GPU copies); elsewhere pdserve "
    "makes no GPU copy, so there is nothing to pin"
)
_BATCH_INPUT = (
    "honoured by the onnxruntime backend (ragged batches); other backends do not build "
    "batch inputs, so the model would get none"
)
_CUDA_GRAPH = "CUDA graphs (TensorRT); " + _GPU_HINT
_ACCEL = "execution accelerators (TensorRT / OpenVINO providers) are not attached; " + _GPU_HINT
_RATE = (
    "honoured with --rate-limit=execution_count (the rate limiter); off: ignored, with a warning"
)

#: field path -> its classification; every field reachable from ``ModelConfig``.
FIELDS: dict[str, Support] = {
    "name": Support(HON, "honoured: must equal the model's folder name"),
    "platform": Support(
        HON, "honoured: onnxruntime_onnx, pytorch_libtorch, ensemble; any other fails to load"
    ),
    "backend": Support(
        HON, "honoured: onnxruntime, pytorch, python, remote; any other fails to load"
    ),
    "runtime": Support(
        HON,
        "honoured by the pytorch backend ('model.py': the PyTorch 2 python runtime); elsewhere "
        "it names a backend library, which pdserve does not load",
        backends=frozenset({"pytorch"}),
        otherwise=IGN,
    ),
    "version_policy": Support(HON, "honoured: which versions are served"),
    "version_policy.latest": Support(HON, "honoured"),
    "version_policy.latest.num_versions": Support(HON, "honoured"),
    "version_policy.all": Support(HON, "honoured"),
    "version_policy.specific": Support(HON, "honoured"),
    "version_policy.specific.versions": Support(HON, "honoured"),
    "max_batch_size": Support(HON, "honoured: batching, and the batch dimension of every tensor"),
    "input": Support(HON, "honoured: the model's inputs"),
    "input.name": Support(HON, "honoured"),
    "input.data_type": Support(HON, "honoured: requests of another datatype are refused"),
    "input.format": Support(HON, "honoured as in Triton: checked (3 dims), otherwise informative"),
    "input.dims": Support(HON, "honoured: requests of another shape are refused"),
    "input.reshape": Support(HON, "honoured: the model sees the reshaped tensor"),
    "input.reshape.shape": Support(HON, "honoured"),
    "input.is_shape_tensor": Support(
        REF, "shape tensors are " + _TRT, checked_elsewhere="validation"
    ),
    "input.allow_ragged_batch": Support(
        HON, "honoured: requests of different shapes batch together"
    ),
    "input.optional": Support(HON, "honoured: a request may omit the input"),
    "input.is_non_linear_format_io": Support(
        REF, "non-linear I/O formats are " + _TRT + "; the tensor bytes would be misread"
    ),
    "output": Support(HON, "honoured: the model's outputs, checked on every response"),
    "output.name": Support(HON, "honoured"),
    "output.data_type": Support(HON, "honoured: a model output of another datatype is an error"),
    "output.dims": Support(HON, "honoured: a model output of another shape is an error"),
    "output.reshape": Support(HON, "honoured: clients see the reshaped tensor"),
    "output.reshape.shape": Support(HON, "honoured"),
    "output.label_filename": Support(HON, "honoured: labels for the classification extension"),
    "output.is_shape_tensor": Support(
        REF, "shape tensors are " + _TRT, checked_elsewhere="validation"
    ),
    "output.is_non_linear_format_io": Support(
        REF, "non-linear I/O formats are " + _TRT + "; the tensor bytes would be misread"
    ),
    "batch_input": Support(HON, _BATCH_INPUT, backends=_ONNX, otherwise=REF),
    "batch_input.kind": Support(HON, _BATCH_INPUT, backends=_ONNX, otherwise=REF),
    "batch_input.target_name": Support(HON, _BATCH_INPUT, backends=_ONNX, otherwise=REF),
    "batch_input.data_type": Support(HON, _BATCH_INPUT, backends=_ONNX, otherwise=REF),
    "batch_input.source_input": Support(HON, _BATCH_INPUT, backends=_ONNX, otherwise=REF),
    "batch_output": Support(
        REF, "batch outputs are not scattered by pdserve; answers would be wrong"
    ),
    "batch_output.target_name": Support(REF, "batch outputs are not scattered by pdserve"),
    "batch_output.kind": Support(REF, "batch outputs are not scattered by pdserve"),
    "batch_output.source_input": Support(REF, "batch outputs are not scattered by pdserve"),
    "optimization": Support(HON, "a container: each of its fields says what pdserve does with it"),
    "optimization.graph": Support(
        HON,
        "honoured by the onnxruntime backend (session graph optimisation level)",
        backends=_ONNX,
        otherwise=IGN,
    ),
    "optimization.graph.level": Support(
        HON,
        "honoured by the onnxruntime backend (session graph optimisation level)",
        backends=_ONNX,
        otherwise=IGN,
    ),
    "optimization.priority": Support(IGN, "GPU stream priority; " + _GPU_HINT),
    "optimization.cuda": Support(IGN, _CUDA_GRAPH),
    "optimization.cuda.graphs": Support(IGN, _CUDA_GRAPH),
    "optimization.cuda.busy_wait_events": Support(IGN, "CUDA event busy-waiting; " + _GPU_HINT),
    "optimization.cuda.graph_spec": Support(IGN, _CUDA_GRAPH),
    "optimization.cuda.graph_spec.batch_size": Support(IGN, _CUDA_GRAPH),
    "optimization.cuda.graph_spec.input": Support(IGN, _CUDA_GRAPH),
    "optimization.cuda.graph_spec.input.dim": Support(IGN, _CUDA_GRAPH),
    "optimization.cuda.graph_spec.graph_lower_bound": Support(IGN, _CUDA_GRAPH),
    "optimization.cuda.graph_spec.graph_lower_bound.batch_size": Support(IGN, _CUDA_GRAPH),
    "optimization.cuda.graph_spec.graph_lower_bound.input": Support(IGN, _CUDA_GRAPH),
    "optimization.cuda.graph_spec.graph_lower_bound.input.dim": Support(IGN, _CUDA_GRAPH),
    "optimization.cuda.output_copy_stream": Support(
        IGN, "a separate output copy stream; " + _GPU_HINT
    ),
    "optimization.execution_accelerators": Support(IGN, _ACCEL),
    "optimization.execution_accelerators.gpu_execution_accelerator": Support(IGN, _ACCEL),
    "optimization.execution_accelerators.gpu_execution_accelerator.name": Support(IGN, _ACCEL),
    "optimization.execution_accelerators.gpu_execution_accelerator.parameters": Support(
        IGN, _ACCEL
    ),
    "optimization.execution_accelerators.cpu_execution_accelerator": Support(IGN, _ACCEL),
    "optimization.execution_accelerators.cpu_execution_accelerator.name": Support(IGN, _ACCEL),
    "optimization.execution_accelerators.cpu_execution_accelerator.parameters": Support(
        IGN, _ACCEL
    ),
    "optimization.input_pinned_memory": Support(
        HON, _PINNED, backends=frozenset({"pytorch"}), otherwise=IGN
    ),
    "optimization.input_pinned_memory.enable": Support(
        HON, _PINNED, backends=frozenset({"pytorch"}), otherwise=IGN, quiet=True
    ),
    "optimization.output_pinned_memory": Support(
        HON, _PINNED, backends=frozenset({"pytorch"}), otherwise=IGN
    ),
    "optimization.output_pinned_memory.enable": Support(
        HON, _PINNED, backends=frozenset({"pytorch"}), otherwise=IGN, quiet=True
    ),
    "optimization.gather_kernel_buffer_threshold": Support(
        IGN, "a CUDA gather kernel for input copies; " + _GPU_HINT
    ),
    "optimization.eager_batching": Support(IGN, "TensorRT eager batching; " + _GPU_HINT),
    "dynamic_batching": Support(HON, "honoured: the dynamic batcher"),
    "dynamic_batching.preferred_batch_size": Support(HON, "honoured"),
    "dynamic_batching.max_queue_delay_microseconds": Support(HON, "honoured"),
    "dynamic_batching.preserve_ordering": Support(HON, "honoured"),
    "dynamic_batching.priority_levels": Support(HON, "honoured: request priorities"),
    "dynamic_batching.default_priority_level": Support(HON, "honoured"),
    "dynamic_batching.default_queue_policy": Support(HON, _QUEUE),
    "dynamic_batching.default_queue_policy.timeout_action": Support(HON, _QUEUE),
    "dynamic_batching.default_queue_policy.default_timeout_microseconds": Support(HON, _QUEUE),
    "dynamic_batching.default_queue_policy.allow_timeout_override": Support(HON, _QUEUE),
    "dynamic_batching.default_queue_policy.max_queue_size": Support(HON, _QUEUE),
    "dynamic_batching.priority_queue_policy": Support(HON, _QUEUE),
    "dynamic_batching.priority_queue_policy.timeout_action": Support(HON, _QUEUE),
    "dynamic_batching.priority_queue_policy.default_timeout_microseconds": Support(HON, _QUEUE),
    "dynamic_batching.priority_queue_policy.allow_timeout_override": Support(HON, _QUEUE),
    "dynamic_batching.priority_queue_policy.max_queue_size": Support(HON, _QUEUE),
    "sequence_batching": Support(HON, "honoured: the sequence batcher (stateful models)"),
    "sequence_batching.direct": Support(HON, "honoured: the direct strategy"),
    "sequence_batching.direct.max_queue_delay_microseconds": Support(HON, "honoured"),
    "sequence_batching.direct.minimum_slot_utilization": Support(HON, "honoured"),
    "sequence_batching.oldest": Support(HON, "honoured: the oldest strategy"),
    "sequence_batching.oldest.max_candidate_sequences": Support(HON, "honoured"),
    "sequence_batching.oldest.preferred_batch_size": Support(HON, "honoured"),
    "sequence_batching.oldest.max_queue_delay_microseconds": Support(HON, "honoured"),
    "sequence_batching.oldest.preserve_ordering": Support(
        IGN,
        "responses of different sequences may complete out of arrival order; each request "
        "still gets its own answer, and a sequence's requests run in order",
    ),
    "sequence_batching.max_sequence_idle_microseconds": Support(HON, "honoured"),
    "sequence_batching.control_input": Support(HON, _CONTROL),
    "sequence_batching.control_input.name": Support(HON, _CONTROL),
    "sequence_batching.control_input.control": Support(HON, _CONTROL),
    "sequence_batching.control_input.control.kind": Support(HON, _CONTROL),
    "sequence_batching.control_input.control.int32_false_true": Support(HON, _CONTROL),
    "sequence_batching.control_input.control.fp32_false_true": Support(HON, _CONTROL),
    "sequence_batching.control_input.control.bool_false_true": Support(HON, _CONTROL),
    "sequence_batching.control_input.control.data_type": Support(HON, _CONTROL),
    "sequence_batching.state": Support(HON, _STATE),
    "sequence_batching.state.input_name": Support(HON, _STATE),
    "sequence_batching.state.output_name": Support(HON, _STATE),
    "sequence_batching.state.data_type": Support(HON, _STATE),
    "sequence_batching.state.dims": Support(HON, _STATE),
    "sequence_batching.state.initial_state": Support(HON, "honoured with zero_data"),
    "sequence_batching.state.initial_state.data_type": Support(HON, "honoured"),
    "sequence_batching.state.initial_state.dims": Support(HON, "honoured"),
    "sequence_batching.state.initial_state.zero_data": Support(HON, "honoured"),
    "sequence_batching.state.initial_state.data_file": Support(
        REF,
        "initial state from a file is not read by pdserve; the state would start wrong",
        checked_elsewhere="validation",
    ),
    "sequence_batching.state.initial_state.name": Support(HON, "honoured (a label)"),
    "sequence_batching.state.use_same_buffer_for_input_output": Support(
        IGN, "a GPU buffer-sharing hint for the state; the state's values are the same either way"
    ),
    "sequence_batching.state.use_growable_memory": Support(
        IGN, "a GPU growable-memory hint for the state; the state's values are the same either way"
    ),
    "sequence_batching.iterative_sequence": Support(
        REF,
        "pdserve does not reschedule a request back to the model",
        checked_elsewhere="validation",
    ),
    "ensemble_scheduling": Support(HON, "honoured: the ensemble's steps"),
    "ensemble_scheduling.step": Support(HON, "honoured"),
    "ensemble_scheduling.step.model_name": Support(HON, "honoured"),
    "ensemble_scheduling.step.model_version": Support(HON, "honoured"),
    "ensemble_scheduling.step.input_map": Support(HON, "honoured"),
    "ensemble_scheduling.step.output_map": Support(HON, "honoured"),
    "ensemble_scheduling.step.model_namespace": Support(
        REF, "pdserve has no model namespaces; the step could reach a different model"
    ),
    "ensemble_scheduling.max_inflight_requests": Support(HON, "honoured"),
    "instance_group": Support(HON, "honoured: the model instances"),
    "instance_group.name": Support(HON, "honoured"),
    "instance_group.kind": Support(HON, "honoured: KIND_CPU, KIND_GPU, KIND_MODEL, KIND_AUTO"),
    "instance_group.count": Support(HON, "honoured (at most --max-instance-count in all)"),
    "instance_group.rate_limiter": Support(HON, _RATE),
    "instance_group.rate_limiter.resources": Support(HON, _RATE),
    "instance_group.rate_limiter.resources.name": Support(HON, _RATE),
    "instance_group.rate_limiter.resources.global": Support(HON, _RATE),
    "instance_group.rate_limiter.resources.count": Support(HON, _RATE),
    "instance_group.rate_limiter.priority": Support(HON, _RATE),
    "instance_group.gpus": Support(HON, "honoured: the GPUs of a KIND_GPU group"),
    "instance_group.secondary_devices": Support(
        IGN, "secondary devices (NVDLA) are TensorRT only; instances run on their main device"
    ),
    "instance_group.secondary_devices.kind": Support(IGN, "secondary devices are TensorRT only"),
    "instance_group.secondary_devices.device_id": Support(
        IGN, "secondary devices are TensorRT only"
    ),
    "instance_group.profile": Support(IGN, "TensorRT optimisation profiles; " + _GPU_HINT),
    "instance_group.passive": Support(
        IGN,
        "passive instances are scheduled like the others: more instances serve, each answer "
        "is the same",
    ),
    "instance_group.host_policy": Support(
        HON, "honoured: the instances' CPU cores (--host-policy)"
    ),
    "default_model_filename": Support(HON, "honoured: the model file in each version folder"),
    "cc_model_filenames": Support(
        IGN, "per-GPU-compute-capability model files; default_model_filename is loaded"
    ),
    "metric_tags": Support(IGN, "pdserve's metrics carry no per-model tags"),
    "parameters": Support(HON, "honoured: handed to the backend and the model"),
    "parameters.string_value": Support(HON, "honoured"),
    "model_warmup": Support(HON, _WARMUP),
    "model_warmup.name": Support(HON, _WARMUP),
    "model_warmup.batch_size": Support(HON, _WARMUP),
    "model_warmup.inputs": Support(HON, _WARMUP),
    "model_warmup.inputs.data_type": Support(HON, _WARMUP),
    "model_warmup.inputs.dims": Support(HON, _WARMUP),
    "model_warmup.inputs.zero_data": Support(HON, _WARMUP),
    "model_warmup.inputs.random_data": Support(HON, _WARMUP),
    "model_warmup.inputs.input_data_file": Support(HON, _WARMUP + " (from <model>/warmup/)"),
    "model_warmup.count": Support(HON, _WARMUP),
    "model_operations": Support(
        IGN,
        "custom operation libraries are not loaded; a model that needs them fails to load in "
        "its backend with that backend's message",
    ),
    "model_operations.op_library_filename": Support(
        IGN, "custom operation libraries are not loaded"
    ),
    "model_transaction_policy": Support(HON, "honoured"),
    "model_transaction_policy.decoupled": Support(
        HON,
        "honoured by the python backend and ensembles; refused for the other backends "
        "(zero or several responses per request)",
    ),
    "model_repository_agents": Support(
        REF, "pdserve runs no repository agents; the model files would be loaded unprocessed"
    ),
    "model_repository_agents.agents": Support(REF, "pdserve runs no repository agents"),
    "model_repository_agents.agents.name": Support(REF, "pdserve runs no repository agents"),
    "model_repository_agents.agents.parameters": Support(REF, "pdserve runs no repository agents"),
    "response_cache": Support(HON, "honoured: the response cache (--cache-config)"),
    "response_cache.enable": Support(HON, "honoured"),
    "model_metrics": Support(IGN, "per-model metric histogram buckets are not configurable here"),
    "model_metrics.metric_control": Support(
        IGN, "per-model metric control is not configurable here"
    ),
    "model_metrics.metric_control.metric_identifier": Support(IGN, "per-model metric control"),
    "model_metrics.metric_control.metric_identifier.family": Support(
        IGN, "per-model metric control"
    ),
    "model_metrics.metric_control.histogram_options": Support(IGN, "per-model histogram buckets"),
    "model_metrics.metric_control.histogram_options.buckets": Support(
        IGN, "per-model histogram buckets"
    ),
}


def descriptor_paths(
    descriptor: Descriptor = model_config_pb2.ModelConfig.DESCRIPTOR, prefix: str = ""
) -> Iterator[str]:
    """Every field path under ``descriptor``, depth first in declaration order.

    A map field is one path; when its values are messages, their fields follow it
    (``parameters.string_value``).
    """
    for field in descriptor.fields:
        path = prefix + field.name
        yield path
        sub = _message_type(field)
        if sub is not None:
            yield from descriptor_paths(sub, path + ".")


def _message_type(field: FieldDescriptor) -> Descriptor | None:
    """The message a field holds (a map's value message), or None for a scalar."""
    if field.type != FieldDescriptor.TYPE_MESSAGE:
        return None
    sub: Descriptor = field.message_type
    if sub.GetOptions().map_entry:
        value = sub.fields_by_name["value"]
        return value.message_type if value.type == FieldDescriptor.TYPE_MESSAGE else None
    return sub


def set_fields(message: Message, prefix: str = "") -> Iterator[tuple[str, Any, bool]]:
    """``(path, value, asks)`` for every field set in ``message``, recursively.

    ``value`` is the field's value (for a repeated or map field, the container).
    ``asks`` is whether the field asks for something by itself: a scalar, or an
    element of a list or map, always does; a single message does only when none of its
    own fields is set (``version_policy { all { } }``) and it is not one Triton writes out
    empty (``optimization { cuda { } }``, ``model_repository_agents { }``: nothing asked).
    """
    for field, value in message.ListFields():
        path = prefix + field.name
        sub = _message_type(field)
        if sub is None:
            yield path, value, True
            continue
        if field.message_type.GetOptions().map_entry:
            items: list[Message] = list(value.values())
        elif _is_repeated(field):
            items = list(value)
        else:
            items = [value]
        children = [c for item in items for c in set_fields(item, path + ".")]
        single = not _is_repeated(field)
        yield path, value, not children and (not single or not sub.fields or path in _PRESENCE)
        yield from children


#: Single messages whose presence alone asks for something (the others, empty, ask nothing).
_PRESENCE = frozenset(
    {
        "dynamic_batching",
        "sequence_batching",
        "sequence_batching.direct",
        "sequence_batching.oldest",
        "ensemble_scheduling",
    }
)


def _is_repeated(field: FieldDescriptor) -> bool:
    """Whether ``field`` is a repeated field (any protobuf version)."""
    repeated = getattr(field, "is_repeated", None)
    if repeated is not None:
        return bool(repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


#: (model, field path) pairs already warned about: one warning per model and field.
_warned: set[tuple[str, str]] = set()


def check_fields(cfg: ModelConfig, fail: Fail, *, log_warnings: bool = True) -> list[str]:
    """Apply :data:`FIELDS` to a configuration.

    A set field that is refused for the model's backend fails (``fail(path, reason)``);
    a set field that is ignored adds a warning (``"<path> is ignored: <reason>"``),
    logged once per model and field when ``log_warnings``. A message field whose own
    fields are set speaks through them; an empty one asks nothing (Triton writes
    ``model_repository_agents { }`` in every configuration it serves). Refusals marked ``checked_elsewhere`` are left to that step.

    Returns:
        The warnings, in field order.
    """
    backend = ENSEMBLE_PLATFORM if cfg.platform == ENSEMBLE_PLATFORM else cfg.backend
    warnings: list[str] = []
    for path, value, asks in set_fields(cfg):
        if not asks:
            continue  # a message whose own fields speak for it, or an empty one
        support = FIELDS.get(path)
        if support is None:
            fail(path, "pdserve does not know this field of the model configuration")
            continue
        status = support.status_for(backend)
        if status is Status.REFUSED and not support.checked_elsewhere:
            where = f" with backend '{backend}'" if support.backends else ""
            fail(path, f"not supported by pdserve{where}: {support.reason}")
        elif status is Status.IGNORED and (support.quiet is None or value != support.quiet):
            warnings.append(f"{path} is ignored: {support.reason}")
    if log_warnings:
        for message in warnings:
            key = (cfg.name, message.split(" ", 1)[0])
            if key not in _warned:
                _warned.add(key)
                log.warning("model '%s': %s", cfg.name, message)
    return warnings
