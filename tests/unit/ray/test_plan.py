"""pdserve.ray.plan: a repository's Serve deployments, resources from instance groups
(auto-completed), the one-hop deployment; pdserve.ray.deployments without a cluster."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferRequest, InferResponse
from pdserve.ray.deployments import Failure, ModelReplica, RayCore, build_app
from pdserve.ray.plan import ENSEMBLE_CPUS, INGRESS_NAME, plan_application, plan_server
from tests.conftest import EXAMPLE_REPO, copy_models

CPU_MODEL = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ 1 ] }} ]
{groups}
"""

ENSEMBLE = """
name: "ens"
platform: "ensemble"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "pre" model_version: -1 input_map { key: "X" value: "X" }
      output_map { key: "Y" value: "mid" } },
    { model_name: "gpu" model_version: -1 input_map { key: "X" value: "mid" }
      output_map { key: "Y" value: "Y" } }
  ]
}
"""


def write(root: Path, name: str, text: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(text)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write(
        tmp_path,
        "pre",
        CPU_MODEL.format(name="pre", groups="instance_group [ { count: 3, kind: KIND_CPU } ]"),
    )
    write(
        tmp_path,
        "gpu",
        CPU_MODEL.format(
            name="gpu", groups="instance_group [ { count: 2, kind: KIND_GPU, gpus: [ 0, 1 ] } ]"
        ),
    )
    write(tmp_path, "plain", CPU_MODEL.format(name="plain", groups=""))
    write(tmp_path, "ens", ENSEMBLE)
    return tmp_path


def test_resources_from_instance_groups(repo: Path) -> None:
    plans = {p.model: p for p in plan_application(repo)}
    assert plans["pre"].options == {"ray_actor_options": {"num_cpus": 3}}
    assert plans["gpu"].options == {"ray_actor_options": {"num_cpus": 1, "num_gpus": 2}}
    assert plans["plain"].options == {"ray_actor_options": {"num_cpus": 1}}
    assert plans["ens"].ensemble and plans["ens"].steps == ["pre", "gpu"]
    assert plans["ens"].options == {"ray_actor_options": {"num_cpus": ENSEMBLE_CPUS}}


def test_ensemble_brings_its_steps_first(repo: Path) -> None:
    plans = plan_application(repo, ["ens"])
    assert [p.model for p in plans] == ["pre", "gpu", "ens"]


def test_overrides_merge(repo: Path) -> None:
    auto = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2}
    plans = plan_application(
        repo,
        ["ens"],
        {
            "gpu": {"autoscaling_config": auto, "ray_actor_options": {"num_gpus": 0.5}},
            "pre": {"num_replicas": 3},
        },
    )
    by = {p.model: p.options for p in plans}
    assert by["gpu"] == {
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 0.5},
        "autoscaling_config": auto,
    }
    assert by["pre"]["num_replicas"] == 3


@pytest.mark.parametrize(
    ("models", "options", "message"),
    [
        (["nope"], None, "model 'nope' is not in the repository"),
        (
            ["pre"],
            {"gpu": {"num_replicas": 1}},
            "options given for models that are not served: ['gpu']",
        ),
        (["pre"], {"pre": {"replicas": 1}}, "unknown deployment options ['replicas']"),
        (["pre"], {"pre": {"num_replicas": 1, "autoscaling_config": {}}}, "not both"),
    ],
)
def test_bad_plans(repo: Path, models: list[str], options: dict | None, message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        plan_application(repo, models, options)
    assert message in str(info.value)


def test_broken_config_names_the_model(repo: Path) -> None:
    (repo / "pre" / "config.pbtxt").write_text("name: [")
    with pytest.raises(ValueError) as info:
        plan_application(repo, ["pre"])
    assert str(info.value).startswith("model 'pre':")


def test_onnx_models_reserve_what_auto_complete_gives_them() -> None:
    """tiny has no instance_group: auto-complete gives an ONNX Runtime model 2 CPU
    instances (Triton's default), so its replica reserves 2 CPUs."""
    plans = {p.model: p for p in plan_application(EXAMPLE_REPO, ["tiny", "preprocess"])}
    assert plans["tiny"].options == {"ray_actor_options": {"num_cpus": 2}}
    assert plans["preprocess"].options == {"ray_actor_options": {"num_cpus": 1}}


def test_the_one_hop_plan_adds_up_its_models(repo: Path) -> None:
    plan = plan_server(repo, ["ens", "plain"])
    assert plan.models == ["pre", "gpu", "ens", "plain"]
    # pre 3 + gpu 1 + plain 1 CPUs (the ensemble nothing of its own), the most GPUs
    assert plan.options == {"ray_actor_options": {"num_cpus": 5.0, "num_gpus": 2}}
    assert plan.asked["gpu"] == {"num_cpus": 1, "num_gpus": 2}
    plan = plan_server(repo, ["plain"], {"num_replicas": 3, "ray_actor_options": {"num_cpus": 0.5}})
    assert plan.options == {"ray_actor_options": {"num_cpus": 0.5}, "num_replicas": 3}
    with pytest.raises(ValueError, match="unknown deployment options"):
        plan_server(repo, ["plain"], {"replicas": 2})
    with pytest.raises(ValueError, match="not both"):
        plan_server(repo, ["plain"], {"num_replicas": 2, "autoscaling_config": {}})


@pytest.mark.parametrize(
    ("name", "shape", "cpus"),
    [("serve_config.yaml", "server", 2), ("serve_config_split.yaml", "split", None)],
)
def test_example_serve_configs(name: str, shape: str, cpus: int | None) -> None:
    """examples/ray/*.yaml are valid Serve configs whose builder args plan; the one-hop
    example fits a 2-CPU machine and registers the V2 gRPC service."""
    import yaml
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from pdserve.ray import build_app

    root = Path(__file__).resolve().parents[3]
    doc = yaml.safe_load((root / "examples" / "ray" / name).read_text())
    schema = ServeDeploySchema.model_validate(doc)
    (app,) = schema.applications
    assert app.import_path == "pdserve.ray:build_app"
    args = dict(app.args)
    assert args["shape"] == shape
    args["model_repository"] = str(root / args["model_repository"])
    if shape == "server":
        plan = plan_server(args["model_repository"], args["models"], args["deployment"])
        assert plan.options["ray_actor_options"] == {"num_cpus": cpus}
        assert plan.models[-1] == "tiny"
        (servicer,) = doc["grpc_options"]["grpc_servicer_functions"]
        assert servicer == "pdserve.ray.grpc_proxy.add_GRPCInferenceServiceServicer_to_server"
    else:
        plans = plan_application(args["model_repository"], args["models"], args["options"])
        assert [p.model for p in plans][-1] == "tiny"
        assert {"preprocess", "efficientnet_lite0", "postprocess", "image_classifier"} <= {
            p.model for p in plans
        }
    assert isinstance(build_app(args), Application)


# -- pdserve.ray.deployments without a cluster: the application graph, a replica's
# -- methods on a real InferenceServer, errors across the boundary, the ingress core.


def test_build_app_binds_one_deployment_per_model_behind_the_ingress() -> None:
    app = build_app(
        {
            "model_repository": str(EXAMPLE_REPO),
            "models": "tiny,pool",
            "http": {"x": 1},
            "shape": "split",
        }
    )
    ingress = app._bound_deployment
    assert ingress.name == INGRESS_NAME
    assert ingress.num_replicas == 1 and ingress.ray_actor_options == {"num_cpus": 0.5}
    models, http = ingress.init_args
    assert sorted(models) == ["pool", "tiny"] and http == {"x": 1}
    tiny = models["tiny"]._bound_deployment
    assert tiny.name == "tiny"
    assert tiny.init_args == (str(EXAMPLE_REPO.resolve()), "tiny", None)
    with pytest.raises(ValueError, match="needs model_repository"):
        build_app({})
    with pytest.raises(ValueError, match="shape must be 'server' or 'split'"):
        build_app({"model_repository": str(EXAMPLE_REPO), "shape": "one"})
    one = build_app({"model_repository": str(EXAMPLE_REPO), "models": "tiny"})
    assert one._bound_deployment.name == "pdserve"
    assert one._bound_deployment.init_args[1] == ["tiny"]


def test_failure_carries_an_infer_error_across_replicas() -> None:
    failure = Failure.of(InferError("gone", ErrorCode.NOT_FOUND))
    assert failure == Failure("gone", ErrorCode.NOT_FOUND.value)
    error = failure.error()
    assert isinstance(error, InferError) and error.code is ErrorCode.NOT_FOUND
    assert error.message == "gone"


def test_ray_core_answers_for_itself_and_refuses_an_unknown_model() -> None:
    core = RayCore({})
    assert core.started and core.live() and core.ready()
    meta = core.metadata()
    assert meta["name"] == "pdserve" and "statistics" in meta["extensions"]
    assert "model_repository" not in meta["extensions"]
    with pytest.raises(InferError, match="'nope' is not found") as err:
        asyncio.run(core.model_metadata("nope"))
    assert err.value.code is ErrorCode.NOT_FOUND


# Serve awaits the async __del__; garbage collection later calls it too, unawaited.
@pytest.mark.filterwarnings("ignore:coroutine 'ModelReplica.__del__' was never awaited")
def test_a_model_replica_serves_its_one_model(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "tiny", "pool")

    async def main() -> None:
        replica = object.__new__(ModelReplica)
        await ModelReplica.__init__(replica, str(repo), "tiny")  # as Serve constructs it
        try:
            assert replica.model_ready("tiny", "") and not replica.model_ready("pool", "")
            replica.check_health()
            assert replica.model_metadata("tiny", "")["name"] == "tiny"
            assert replica.model_config("tiny", "")["max_batch_size"] == 128
            assert [r["name"] for r in replica.repository_index(False)] == ["tiny"]
            x = np.ones((1, 64), np.float32)
            answer = await replica.infer(InferRequest("tiny", inputs={"INPUT0": x}))
            assert isinstance(answer, InferResponse)
            assert answer.outputs["OUTPUT0"].shape == (1, 64)
            stats = replica.model_statistics("tiny", "")
            assert isinstance(stats, dict)
            assert stats["model_stats"][0]["inference_count"] == 1
            unknown = await replica.infer(InferRequest("pool", inputs={"INPUT0": x}))
            assert isinstance(unknown, Failure)
            assert isinstance(replica.model_metadata("pool", ""), Failure)
        finally:
            await replica.__del__()
        with pytest.raises(RuntimeError, match="'tiny' has no ready version"):
            replica.check_health()

    asyncio.run(main())
