"""Instance plans of the in-process framework backends."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.backends.base import ModelSpec
from pdserve.backends.instance_plan import InstancePlan, instance_plans


def _spec(text: str, policies: dict[str, frozenset[int]] | None = None) -> ModelSpec:
    cfg = text_format.Parse(text, model_config_pb2.ModelConfig(name="m"))
    return ModelSpec("m", 1, cfg, Path("m"), Path("m/1"), Path("."), host_policies=policies or {})


def _ok(group: str, gpus: list[int]) -> str | None:
    return None


def test_counts_kinds_and_gpus() -> None:
    spec = _spec(
        "instance_group [ { count: 2, kind: KIND_CPU }, { count: 1, kind: KIND_GPU, gpus: [0, 1] },"
        " { kind: KIND_AUTO } ]"
    )
    assert instance_plans(spec, "x", [0], _ok) == [
        InstancePlan("KIND_CPU", None, None),
        InstancePlan("KIND_CPU", None, None),
        InstancePlan("KIND_GPU", 0, None),
        InstancePlan("KIND_GPU", 1, None),
        InstancePlan("KIND_GPU", 0, None),  # KIND_AUTO with a usable GPU
    ]
    assert instance_plans(_spec(""), "x", [], _ok) == [InstancePlan("KIND_CPU", None, None)]
    auto = _spec("instance_group [ { count: 2, kind: KIND_AUTO } ]")
    assert [p.kind for p in instance_plans(auto, "x", [], _ok)] == ["KIND_CPU", "KIND_CPU"]


def test_host_policy_cores_pin_the_instances() -> None:
    spec = _spec("instance_group [ { count: 1, kind: KIND_CPU } ]", {"cpu": frozenset({1})})
    assert instance_plans(spec, "x", [], _ok) == [InstancePlan("KIND_CPU", None, frozenset({1}))]


def test_a_gpu_the_backend_cannot_use_and_kind_model_fail() -> None:
    spec = _spec('instance_group [ { name: "g", kind: KIND_GPU, gpus: [3] } ]')
    with pytest.raises(RuntimeError, match=r"model 'm': group g wants \[3\]"):
        instance_plans(spec, "x", [], lambda g, ids: f"group {g} wants {ids}")
    with pytest.raises(RuntimeError, match="kind KIND_MODEL is not supported by the x backend"):
        instance_plans(_spec("instance_group [ { kind: KIND_MODEL } ]"), "x", [], _ok)
