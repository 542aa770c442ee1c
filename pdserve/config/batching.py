"""Validation of a configuration's batching: ``dynamic_batching`` and ``sequence_batching``
(Triton's rules, and what pdserve cannot serve)."""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2

from pdserve.config.schema import Fail, ModelConfig


def validate_dynamic_batching(
    cfg: ModelConfig, where: str, warnings: list[str], fail: Fail
) -> None:
    """``dynamic_batching``: preferred sizes, priority levels, queue policies (Triton's
    rules); a warning when the model cannot batch."""
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


def validate_sequence_batching(cfg: ModelConfig, fail: Fail) -> None:
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
    io_names = {i.name for i in cfg.input} | {o.name for o in cfg.output}
    names: set[str] = set()
    _validate_controls(sb, io_names, names, fail)
    _validate_states(sb, io_names, names, fail)
    field = "sequence_batching"
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


def _validate_controls(
    sb: model_config_pb2.ModelSequenceBatching, io_names: set[str], names: set[str], fail: Fail
) -> None:
    """``control_input``: names unused (added to ``names``), each kind once, values well formed."""
    field = "sequence_batching"
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


def _validate_states(
    sb: model_config_pb2.ModelSequenceBatching, io_names: set[str], names: set[str], fail: Fail
) -> None:
    """``state``: names unused, datatype and dims given, at most one zero-data initial state."""
    field = "sequence_batching"
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
