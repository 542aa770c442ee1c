"""``pdserve analyze``'s search space (:mod:`pdserve.app.analyze.space`): the
lattice built from the shipped configuration, canonical points, neighbours, the
grid order, and the configurations and diffs a point becomes."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.app.analyze.space import (
    Dimension,
    Knobs,
    Space,
    apply_knobs,
    build_space,
    canonical_preferred,
    check_preferred_token,
    config_diff,
    point_key,
    render,
    resolve_preferred,
    shipped_knobs,
)
from pdserve.config import ModelConfig

KIND_CPU = model_config_pb2.ModelInstanceGroup.KIND_CPU

EFFNET = Knobs(instances=2, max_batch_size=32, preferred=(), delay_us=None)


def parse(text: str) -> ModelConfig:
    return text_format.Parse(text, ModelConfig())


RAW = """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def test_single_model_space_has_four_dimensions_with_the_shipped_values() -> None:
    space = build_space("m", {"m": EFFNET}, cpus=2)
    dims = {d.knob: d.values for d in space.dims}
    assert dims == {
        "instances": (1, 2),
        "max_batch_size": (1, 2, 4, 8, 16, 32),
        "preferred": ("none", "pow2"),
        "delay_us": (None, 0, 500, 2000),
    }
    assert space.start == (1, 5, 0, 0)
    assert space.shipped_point() == {"m": EFFNET}
    assert space.size() == 2 * 6 * 2 * 4
    assert space.describe_dims()[0] == "m.instances: 1, [2]"
    assert space.describe_dims()[3] == "m.delay_us: [off], 0, 500, 2000"


def test_shipped_values_off_the_default_lattice_are_added() -> None:
    shipped = Knobs(instances=7, max_batch_size=24, preferred=(4, 8), delay_us=100)
    space = build_space("m", {"m": shipped}, cpus=16)
    dims = {d.knob: d.values for d in space.dims}
    assert dims["instances"] == (1, 2, 3, 4, 5, 7)  # 1..5 (model_analyzer's default) + 7
    assert dims["max_batch_size"] == (1, 2, 4, 8, 16, 24)
    assert dims["preferred"] == ("none", "pow2", "4+8")
    assert dims["delay_us"] == (None, 0, 100, 500, 2000)
    assert space.shipped_point() == {"m": shipped}


def test_given_values_replace_the_defaults_and_single_values_drop_out() -> None:
    space = build_space(
        "m",
        {"m": EFFNET},
        instance_counts=[1, 2],
        max_batch_sizes=[32],
        preferred=["none"],
        queue_delays_us=[0],
    )
    assert [(d.knob, d.values) for d in space.dims] == [
        ("instances", (1, 2)),
        ("delay_us", (None, 0)),
    ]


def test_a_model_that_does_not_batch_only_varies_instances() -> None:
    space = build_space("m", {"m": Knobs(1, 0)}, cpus=4)
    assert [(d.knob, d.values) for d in space.dims] == [("instances", (1, 2, 3, 4))]


def test_ensemble_steps_get_instances_and_queue_delay_per_step() -> None:
    shipped = {
        "pre": Knobs(1, 32, (), 0),
        "net": Knobs(2, 32, (), None),
        "post": Knobs(1, 32, (), 0),
    }
    space = build_space("pipe", shipped, ensemble_max_batch_size=32, cpus=2)
    assert [d.name for d in space.dims] == [
        "pre.instances",
        "pre.delay_us",
        "net.instances",
        "net.delay_us",
        "post.instances",
        "post.delay_us",
    ]
    assert {d.values for d in space.dims if d.knob == "delay_us"} == {(None, 0, 1000)}
    # max_batch_size only when asked, and never below the ensemble's
    space = build_space(
        "pipe", shipped, ensemble_max_batch_size=32, cpus=2, max_batch_sizes=[8, 32, 64]
    )
    assert {d.values for d in space.dims if d.knob == "max_batch_size"} == {(32, 64)}


def test_points_without_batching_ignore_the_batching_knobs() -> None:
    space = build_space("m", {"m": EFFNET}, cpus=2)
    # 1 instance, max_batch_size 4, pow2, off: batching knobs fall back to shipped
    p = space.knobs((0, 2, 1, 0))
    assert p == {"m": Knobs(1, 32, (), None)}
    assert point_key(p) == point_key(space.knobs((0, 5, 0, 0)))  # same configuration
    # batching on: the knobs count
    assert space.knobs((0, 2, 1, 1)) == {"m": Knobs(1, 4, (1, 2, 4), 0)}
    assert space.knobs((1, 0, 0, 3)) == {"m": Knobs(2, 1, (), 2000)}


def test_preferred_tokens_resolve_against_max_batch_size() -> None:
    assert resolve_preferred("none", 8) == ()
    assert resolve_preferred("pow2", 8) == (1, 2, 4, 8)
    assert resolve_preferred("pow2", 12) == (1, 2, 4, 8, 12)
    assert resolve_preferred("pow2", 1) == ()  # only max_batch_size: same as none
    assert resolve_preferred("half", 8) == (4,)
    assert resolve_preferred("half", 1) is None  # 0 is no batch size
    assert resolve_preferred("4+2", 8) == (2, 4)
    assert resolve_preferred("8", 8) == ()
    assert resolve_preferred("16", 8) is None  # above max_batch_size: invalid point
    assert canonical_preferred([8, 8], 8) == ()
    assert check_preferred_token(" 8+4 ") == "4+8"
    assert check_preferred_token("POW2") == "pow2"
    for bad in ("x", "0", "4+-1", ""):
        with pytest.raises(ValueError):
            check_preferred_token(bad)


def test_invalid_points_are_none() -> None:
    space = Space(
        {"m": Knobs(1, 16, (), 0)},
        [
            Dimension("max_batch_size", ("m",), (4, 16)),
            Dimension("preferred", ("m",), ("none", "8")),
        ],
    )
    assert space.start == (1, 0)
    assert [d.knob for d in space.dims] == ["max_batch_size", "preferred"]
    assert space.knobs((0, 1)) is None  # preferred 8 > max_batch_size 4
    assert space.knobs((1, 1)) == {"m": Knobs(1, 16, (8,), 0)}


def test_neighbours_are_one_step_along_one_dimension() -> None:
    space = build_space("m", {"m": EFFNET}, cpus=2)
    assert space.neighbours(space.start) == [(0, 5, 0, 0), (1, 4, 0, 0), (1, 5, 1, 0), (1, 5, 0, 1)]
    inner = (0, 2, 0, 1)
    assert len(space.neighbours(inner)) == 6  # instances at its low end: 1 + 2 + 1 + 2


def test_radius_two_is_two_steps_along_one_dimension_then_one_along_two() -> None:
    space = build_space("m", {"m": EFFNET}, cpus=2)
    ring = space.neighbours((1, 2, 0, 1), radius=2)
    # two steps along one dimension: max_batch_size 2 -> 0 or 4, delay 1 -> 3
    assert ring[:3] == [(1, 0, 0, 1), (1, 4, 0, 1), (1, 2, 0, 3)]
    assert all(sum(abs(a - b) for a, b in zip(p, (1, 2, 0, 1), strict=True)) == 2 for p in ring)
    assert len(ring) == len(set(ring))
    # pairs: instances (1 way: down) x mbs (2) + instances x pref (1) + instances x delay (2)
    # + mbs x pref (2) + mbs x delay (4) + pref x delay (2) = 13, plus the 3 above
    assert len(ring) == 16
    assert (1, 2, 0, 1) not in ring


def test_the_grid_yields_every_point_once_shipped_first() -> None:
    space = build_space("m", {"m": EFFNET}, cpus=2)
    points = list(space.grid())
    assert points[0] == space.start
    assert len(points) == len(set(points)) == space.size()
    canonical = {point_key(p) for i in points if (p := space.knobs(i)) is not None}
    # off: 2 (instances); on: 2 instances x 6 sizes x 3 delays x distinct preferred
    # (pow2 at 1 is none): 2 x 3 x (6 + 5) = 66
    assert len(canonical) == 2 + 66


def test_shipped_knobs_of_a_served_configuration() -> None:
    cfg = parse(
        RAW
        + """
instance_group [ { count: 2 kind: KIND_CPU }, { count: 1 kind: KIND_CPU } ]
dynamic_batching { preferred_batch_size: [ 32 ] max_queue_delay_microseconds: 100 }
"""
    )
    assert shipped_knobs(cfg) == Knobs(3, 32, (), 100)
    assert shipped_knobs(parse(RAW)) == Knobs(1, 32, (), None)


def test_apply_knobs_changes_only_what_differs() -> None:
    raw = parse(RAW)
    shipped = Knobs(2, 32, (), None)  # served: ORT's 2 CPU instances by default
    assert render(apply_knobs(raw, shipped, shipped)) == render(raw)
    assert config_diff("m", raw, apply_knobs(raw, shipped, shipped)) == ""

    new = apply_knobs(raw, Knobs(3, 8, (2, 4), 500), shipped)
    assert new.max_batch_size == 8
    assert [(g.count, g.kind) for g in new.instance_group] == [(3, KIND_CPU)]
    assert new.dynamic_batching.max_queue_delay_microseconds == 500
    assert list(new.dynamic_batching.preferred_batch_size) == [2, 4]
    assert raw.max_batch_size == 32 and not raw.HasField("dynamic_batching")  # a copy

    diff = config_diff("m", raw, new)
    assert diff.startswith("--- a/m/config.pbtxt\n+++ b/m/config.pbtxt\n")
    added = [ln for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    removed = [ln for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert removed == ["-max_batch_size: 32"]
    assert "+max_batch_size: 8" in added
    assert "+  count: 3" in added and "+  max_queue_delay_microseconds: 500" in added
    assert "+  preferred_batch_size: 2" in added and "+  preferred_batch_size: 4" in added


def test_apply_knobs_keeps_other_batching_fields_and_turns_batching_off() -> None:
    raw = parse(
        RAW
        + """
instance_group [ { count: 1 kind: KIND_CPU }, { count: 2 kind: KIND_CPU } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] preserve_ordering: true }
"""
    )
    shipped = shipped_knobs(raw)
    assert shipped == Knobs(3, 32, (4, 8), 0)
    new = apply_knobs(raw, Knobs(2, 32, (), 1000), shipped)
    assert [g.count for g in new.instance_group] == [2]  # one group
    assert new.dynamic_batching.preserve_ordering is True
    assert new.dynamic_batching.max_queue_delay_microseconds == 1000
    assert list(new.dynamic_batching.preferred_batch_size) == []
    off = apply_knobs(raw, Knobs(3, 32, (), None), shipped)
    assert not off.HasField("dynamic_batching")
    assert "-dynamic_batching {" in config_diff("m", raw, off)
