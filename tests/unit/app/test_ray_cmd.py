"""pdserve ray's flags: per-model values, autoscaling, the shapes' rules (no cluster)."""

from __future__ import annotations

import pytest

from pdserve.app.cli import build_parser
from pdserve.app.ray_cmd import autoscale, deployment_options, per_model, run


def parse(*argv: str) -> object:
    return build_parser().parse_args(["ray", *argv])


def test_per_model_values() -> None:
    assert per_model(["2", "tiny=3"], int) == (2, {"tiny": 3})
    assert per_model([], int) == (None, {})
    with pytest.raises(ValueError, match="two values for model 'tiny'"):
        per_model(["tiny=1", "tiny=2"], int)
    with pytest.raises(ValueError, match="every deployment"):
        per_model(["1", "2"], int)


def test_autoscale() -> None:
    assert autoscale("1:4") == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 2.0,
    }
    assert autoscale("0:2:8")["target_ongoing_requests"] == 8.0
    for bad in ("4", "3:1", "1:2:3:4", "a:b"):
        with pytest.raises(ValueError):
            autoscale(bad)


def test_server_shape_options() -> None:
    args = parse("deploy", "repo", "--replicas", "2", "--num-cpus", "1.5")
    assert deployment_options(args) == {  # type: ignore[arg-type]
        "*": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1.5}}
    }
    args = parse("deploy", "repo", "--replicas", "tiny=2")
    with pytest.raises(ValueError, match="needs --shape split"):
        deployment_options(args)  # type: ignore[arg-type]
    args = parse("deploy", "repo", "--replicas", "2", "--autoscale", "1:3")
    with pytest.raises(ValueError, match="both given for every deployment"):
        deployment_options(args)  # type: ignore[arg-type]


def test_split_shape_options_per_model() -> None:
    args = parse(
        "deploy", "repo", "--shape", "split", "--autoscale", "preprocess=1:4",
        "--num-gpus", "efficientnet_lite0=1", "--replicas", "1",
    )  # fmt: skip
    assert deployment_options(args) == {  # type: ignore[arg-type]
        "*": {"num_replicas": 1},
        "preprocess": {"autoscaling_config": autoscale("1:4")},
        "efficientnet_lite0": {"ray_actor_options": {"num_gpus": 1.0}},
    }


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("deploy", "repo", "--replicas", "x")
    with pytest.raises(SystemExit) as info:
        args.run(args)  # type: ignore[attr-defined]
    assert info.value.code == 2
    assert "--replicas: expected an integer >= 1, got 'x'" in capsys.readouterr().err
    assert run is not None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "0"], "--replicas: expected an integer >= 1, got '0'"),
        (["--num-cpus", "-1"], "--num-cpus: expected a number >= 0, got '-1'"),
        (["--num-gpus", "nan"], "--num-gpus: expected a number >= 0, got 'nan'"),
        (["--max-ongoing-requests", "0"], "--max-ongoing-requests: expected an integer >= 1"),
        (["--max-replicas-per-node", "x=0"], "--max-replicas-per-node: expected an integer >= 1"),
        (["--timeout", "-5"], "--timeout: expected a number of seconds > 0, got -5.0"),
    ],
)
def test_bad_values_are_refused_before_any_cluster(flags: list[str], message: str) -> None:
    args = parse("deploy", "repo", "--shape", "split", *flags)
    with pytest.raises(ValueError) as e:
        deployment_options(args)  # type: ignore[arg-type]
    assert message in str(e.value)


def test_serve_options_merge_into_the_other_flags() -> None:
    args = parse(
        "deploy", "repo", "--autoscale", "2:3", "--serve-options",
        '{"autoscaling_config": {"upscale_delay_s": 1}, "health_check_period_s": 2}',
    )  # fmt: skip
    assert deployment_options(args) == {  # type: ignore[arg-type]
        "*": {
            "autoscaling_config": {**autoscale("2:3"), "upscale_delay_s": 1},
            "health_check_period_s": 2,
        }
    }
    args = parse("deploy", "repo", "--serve-options", "[1]")
    with pytest.raises(ValueError, match="JSON object"):
        deployment_options(args)  # type: ignore[arg-type]


def test_build_plans_both_shapes() -> None:
    from pdserve.app.ray_cmd import _build
    from tests.conftest import EXAMPLE_REPO

    args = parse("deploy", str(EXAMPLE_REPO), "--models", "tiny", "--num-cpus", "1")
    app, planned = _build(args, deployment_options(args))  # type: ignore[arg-type]
    assert planned == {"pdserve": {"ray_actor_options": {"num_cpus": 1.0}}}
    assert app._bound_deployment.name == "pdserve"
    args = parse(
        "deploy", str(EXAMPLE_REPO), "--shape", "split", "--models", "image_classifier",
        "--replicas", "1", "--autoscale", "preprocess=1:4", "--num-cpus", "postprocess=0.5",
    )  # fmt: skip
    app, planned = _build(args, deployment_options(args))  # type: ignore[arg-type]
    assert planned["preprocess"] == {
        "ray_actor_options": {"num_cpus": 1},
        "autoscaling_config": autoscale("1:4"),
    }
    assert planned["postprocess"] == {"ray_actor_options": {"num_cpus": 0.5}, "num_replicas": 1}
    assert planned["efficientnet_lite0"]["num_replicas"] == 1
    assert planned["pdserve-ingress"] == {"ray_actor_options": {"num_cpus": 0.5}}
    assert app._bound_deployment.name == "pdserve-ingress"
    args = parse("deploy", str(EXAMPLE_REPO), "--shape", "split", "--models", "tiny",
                 "--replicas", "nope=2")  # fmt: skip
    with pytest.raises(ValueError, match="not served"):
        _build(args, deployment_options(args))  # type: ignore[arg-type]
