"""Which models an ensemble steps into, which served ensembles use a model, and whether
a reload would make ensembles step into each other."""

from __future__ import annotations

from collections.abc import Mapping

from pdserve import config as cfgmod
from pdserve.repository.entry import ModelEntry
from pdserve.repository.model import ModelVersion


def step_names(cfg: cfgmod.ModelConfig) -> list[str]:
    """The models an ensemble configuration steps into, once each, in step order."""
    return list(dict.fromkeys(s.model_name for s in cfg.ensemble_scheduling.step))


def served_steps(mv: ModelVersion) -> list[str]:
    """The models ``mv`` steps into (none unless it is an ensemble)."""
    if mv.config.platform != cfgmod.ENSEMBLE_PLATFORM:
        return []
    return step_names(mv.config)


def dependents(models: Mapping[str, ModelEntry], name: str) -> list[str]:
    """Served ensembles with a step that uses model ``name`` (any served version's
    configuration), sorted."""
    found = []
    for other, entry in models.items():
        if other == name:
            continue
        if any(name in served_steps(mv) for mv in entry.serving.values()):
            found.append(other)
    return sorted(found)


def ensemble_users(models: Mapping[str, ModelEntry]) -> dict[str, list[str]]:
    """Model name -> the served ensembles with a step that uses it (default versions)."""
    users: dict[str, list[str]] = {}
    for other, entry in models.items():
        mv = entry.default_version
        if mv is None or mv.config.platform != cfgmod.ENSEMBLE_PLATFORM:
            continue
        for step in mv.config.ensemble_scheduling.step:
            users.setdefault(step.model_name, []).append(other)
    return users


def find_cycle(
    models: Mapping[str, ModelEntry], name: str, cfg: cfgmod.ModelConfig
) -> tuple[str, ...]:
    """The path by which ensemble ``name``, about to serve ``cfg``, would reach itself
    through the steps of the ensembles that serve now (``("A", "B", "A")``); ``()``:
    none, or not an ensemble."""
    if cfg.platform != cfgmod.ENSEMBLE_PLATFORM:
        return ()
    seen: set[str] = set()

    def walk(model: str, path: tuple[str, ...]) -> tuple[str, ...]:
        if model == name:
            return (*path, model)
        if model in seen:
            return ()
        seen.add(model)
        entry = models.get(model)
        for mv in entry.serving.values() if entry is not None else ():
            for step in served_steps(mv):
                found = walk(step, (*path, model))
                if found:
                    return found
        return ()

    for step in step_names(cfg):
        cycle = walk(step, (name,))
        if cycle:
            return cycle
    return ()
