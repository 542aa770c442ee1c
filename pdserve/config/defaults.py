"""Triton's defaults for a completed configuration, and the per-model instance limit."""

from __future__ import annotations

from collections.abc import Sequence

from tritonclient.grpc import model_config_pb2

from pdserve.config.schema import ENSEMBLE_PLATFORM, ONNXRUNTIME_BACKEND, ModelConfig

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

#: Triton's default ``max_sequence_idle_microseconds`` (1 s).
DEFAULT_MAX_SEQUENCE_IDLE_US = 1_000_000


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
