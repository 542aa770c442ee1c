"""What a Ray Serve application of a model repository is made of (no Ray import).

:func:`plan_server` plans the one-hop deployment (every replica holds every model and
reserves the sum of their CPUs); :func:`plan_application` one deployment per model (its
Serve options and, for an ensemble, the steps it calls through handles). Plain data, tested
without Ray, printed by ``python -m pdserve.ray.plan REPO``.

Resources come from the instance groups as auto-complete fills them (:func:`actor_options`;
an ONNX Runtime model without ``instance_group`` runs 2 CPU instances). Overrides replace
any of ``num_replicas``, ``autoscaling_config``, ``ray_actor_options`` (merged),
``max_ongoing_requests``, ``max_replicas_per_node``; ``autoscaling_config`` and
``num_replicas`` exclude each other (Serve's rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from pdserve import config as cfgmod
from pdserve.config import ModelConfig
from pdserve.repository import layout

#: Options a model's deployment takes from ``options[model]`` (Serve's names).
DEPLOYMENT_KEYS = frozenset(
    {
        "num_replicas",
        "autoscaling_config",
        "ray_actor_options",
        "max_ongoing_requests",
        "max_replicas_per_node",
        "health_check_period_s",
        "graceful_shutdown_timeout_s",
    }
)

#: Logical CPUs an ensemble replica reserves: it only forwards tensors between steps.
ENSEMBLE_CPUS = 0.25

#: The ingress deployment's name (the V2 HTTP API).
INGRESS_NAME = "pdserve-ingress"

# instance_group kinds (model_config.proto ModelInstanceGroup.Kind)
_KIND_AUTO, _KIND_GPU, _KIND_CPU = 0, 1, 2


@dataclass
class DeploymentPlan:
    """One model's Serve deployment.

    Attributes:
        model: the model name (also the deployment's name).
        ensemble: the model is a ``platform: "ensemble"``.
        steps: an ensemble's step model names, in step order, without repeats.
        options: Serve deployment options (``ray_actor_options``, ``num_replicas`` or
            ``autoscaling_config``, ...), ready for ``Deployment.options(**options)``.
    """

    model: str
    ensemble: bool = False
    steps: list[str] = field(default_factory=list)
    options: dict[str, object] = field(default_factory=dict)


def actor_options(cfg: ModelConfig) -> dict[str, object]:
    """``ray_actor_options`` for a replica of the model ``cfg``, which hosts one copy of
    every instance of the model:

    =====================================  ===========================================
    instance groups                        ``ray_actor_options``
    =====================================  ===========================================
    ``KIND_CPU`` / ``KIND_AUTO``, count N  ``num_cpus``: the sum of the counts (a
                                           group without ``count`` counts 1)
    ``KIND_GPU`` with ``gpus [a, b]``      ``num_gpus``: the number of distinct GPUs
                                           named (1 when none is named); ``num_cpus``
                                           1 for the host side
    none                                   ``num_cpus`` 1
    ``platform: "ensemble"``               ``num_cpus`` 0.25: it only routes tensors
    =====================================  ===========================================

    Returns:
        ``{"num_cpus": float}`` plus ``"num_gpus": int`` for a GPU model.
    """
    if cfg.platform == cfgmod.ENSEMBLE_PLATFORM:
        return {"num_cpus": ENSEMBLE_CPUS}
    cpus = 0
    gpus: set[int] = set()
    any_gpu = False
    for group in cfg.instance_group:
        if group.kind == _KIND_GPU:
            any_gpu = True
            gpus.update(group.gpus)
        else:
            cpus += group.count or 1
    if any_gpu:
        return {"num_cpus": max(1, cpus), "num_gpus": max(1, len(gpus))}
    return {"num_cpus": max(1, cpus)}


def _completed(cfg: ModelConfig, model_dir: Path) -> ModelConfig:
    """``cfg`` with the instance groups auto-complete gives it on a node without GPUs
    (Triton's defaults: an ONNX Runtime model without ``instance_group`` runs 2 CPU
    instances); ``cfg`` unchanged when its backend cannot be told."""
    done = ModelConfig()
    done.CopyFrom(cfg)
    versions = sorted(
        (d for d in model_dir.iterdir() if d.is_dir() and d.name.isdigit()),
        key=lambda d: int(d.name),
    )
    files = [f.name for f in versions[0].iterdir()] if versions else []
    try:
        cfgmod.normalize_platform(done, guess_from_files=files)
    except cfgmod.ConfigError:
        return cfg
    cfgmod.apply_defaults(done)
    return done


def _collect(root: Path, models: list[str] | None) -> tuple[dict[str, ModelConfig], list[str]]:
    """The completed configurations of ``models`` (all: None) and of every ensemble's
    steps, and their order (steps before their ensembles).

    Raises:
        ValueError: an unknown model, a configuration that does not parse, a cycle.
    """
    on_disk = layout.scan_repository(root)
    wanted = sorted(on_disk) if models is None else list(models)
    configs: dict[str, ModelConfig] = {}
    order: list[str] = []

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in configs:
            return
        if name in chain:
            raise ValueError(f"ensemble cycle: {' -> '.join((*chain, name))}")
        if name not in on_disk:
            raise ValueError(f"model '{name}' is not in the repository {root}")
        try:
            cfg = cfgmod.load_model_config(on_disk[name].path)
        except Exception as e:  # noqa: BLE001 - any parse error names the model
            raise ValueError(f"model '{name}': {e}") from None
        if cfg.platform == cfgmod.ENSEMBLE_PLATFORM:
            for step in cfg.ensemble_scheduling.step:
                visit(step.model_name, (*chain, name))
        configs[name] = _completed(cfg, Path(on_disk[name].path))
        order.append(name)

    for name in wanted:
        visit(name, ())
    return configs, order


def plan_application(
    repository: Path | str,
    models: list[str] | None = None,
    options: Mapping[str, Mapping[str, object]] | None = None,
) -> list[DeploymentPlan]:
    """One :class:`DeploymentPlan` per model to serve, step models before ensembles.

    Args:
        repository: the model repository root.
        models: the models to serve (``None``: every model of the repository). An
            ensemble's step models are added when missing.
        options: model name -> deployment option overrides (keys: ``DEPLOYMENT_KEYS``).

    Raises:
        ValueError: an unknown model, a model whose ``config.pbtxt`` does not parse,
            an unknown option key, ``num_replicas`` together with
            ``autoscaling_config``, or options for a model that is not served.
    """
    configs, order = _collect(Path(repository), models)
    options = dict(options or {})
    unknown_models = sorted(set(options) - set(configs))
    if unknown_models:
        raise ValueError(f"options given for models that are not served: {unknown_models}")
    plans = []
    for name in order:
        cfg = configs[name]
        ensemble = cfg.platform == cfgmod.ENSEMBLE_PLATFORM
        steps = list(dict.fromkeys(s.model_name for s in cfg.ensemble_scheduling.step))
        override = dict(options.get(name, {}))
        bad = sorted(set(override) - DEPLOYMENT_KEYS)
        if bad:
            raise ValueError(
                f"model '{name}': unknown deployment options {bad}; expected some of "
                f"{sorted(DEPLOYMENT_KEYS)}"
            )
        if "num_replicas" in override and "autoscaling_config" in override:
            raise ValueError(f"model '{name}': give num_replicas or autoscaling_config, not both")
        actor = actor_options(cfg)
        if "ray_actor_options" in override:
            extra = override.pop("ray_actor_options")
            if not isinstance(extra, Mapping):
                raise ValueError(f"model '{name}': ray_actor_options must be a mapping")
            actor = {**actor, **extra}
        opts: dict[str, object] = {"ray_actor_options": actor, **override}
        plans.append(DeploymentPlan(name, ensemble, steps if ensemble else [], opts))
    return plans


#: The one-hop deployment's name (:func:`plan_server`).
SERVER_NAME = "pdserve"

#: Options of the one-hop deployment (Serve's names).
SERVER_KEYS = DEPLOYMENT_KEYS


@dataclass
class ServerPlan:
    """The one-hop deployment: every replica a whole server for ``models``.

    Attributes:
        models: the models each replica loads, steps before their ensembles.
        options: Serve deployment options; ``ray_actor_options`` reserve the sum of the
            models' CPUs (their instances run in the replica's process) and the most
            GPUs any one model asks for (the models share the replica's GPUs).
        asked: each model's own ``ray_actor_options`` (what the sum is made of).
    """

    models: list[str]
    options: dict[str, object]
    asked: dict[str, dict[str, object]] = field(default_factory=dict)


def plan_server(
    repository: Path | str,
    models: list[str] | None = None,
    options: Mapping[str, object] | None = None,
) -> ServerPlan:
    """The one-hop deployment of ``models`` (all: None; ensembles bring their steps).

    Args:
        repository: the model repository root.
        models: the models every replica serves.
        options: the deployment's Serve options (keys: ``DEPLOYMENT_KEYS``);
            ``ray_actor_options`` given here are merged over the planned ones.

    Raises:
        ValueError: as :func:`plan_application`; also an unknown option key or
            ``num_replicas`` together with ``autoscaling_config``.
    """
    configs, order = _collect(Path(repository), models)
    override = dict(options or {})
    bad = sorted(set(override) - SERVER_KEYS)
    if bad:
        raise ValueError(
            f"unknown deployment options {bad}; expected some of {sorted(SERVER_KEYS)}"
        )
    if "num_replicas" in override and "autoscaling_config" in override:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    asked = {name: actor_options(configs[name]) for name in order}
    # an ensemble routes tensors between steps inside the replica: nothing of its own
    cpus = 0.0
    gpus = 0
    for name, a in asked.items():
        if configs[name].platform != cfgmod.ENSEMBLE_PLATFORM:
            cpus += float(cast(float, a["num_cpus"]))
        gpus = max(gpus, int(cast(int, a.get("num_gpus", 0))))
    actor: dict[str, object] = {"num_cpus": cpus}
    if gpus:
        actor["num_gpus"] = gpus
    extra = override.pop("ray_actor_options", None)
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise ValueError("ray_actor_options must be a mapping")
        actor = {**actor, **extra}
    return ServerPlan(order, {"ray_actor_options": actor, **override}, asked)


if __name__ == "__main__":  # pragma: no cover - a look at a repository's plan
    import json
    import sys

    server = plan_server(sys.argv[1])
    print(json.dumps({"deployment": SERVER_NAME, "models": server.models, **server.options}))
    for p in plan_application(sys.argv[1]):
        print(json.dumps({"model": p.model, "steps": p.steps, "options": p.options}))
