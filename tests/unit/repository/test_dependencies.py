"""pdserve.repository.dependencies (ensemble step graph), entry (ModelEntry) and serving
(ServedModels lookups)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.core.errors import ErrorCode, InferError
from pdserve.repository import dependencies
from pdserve.repository.entry import ModelEntry
from pdserve.repository.serving import ServedModels


def _ensemble(name: str, *steps: str) -> model_config_pb2.ModelConfig:
    text = f'name: "{name}" platform: "ensemble" ensemble_scheduling {{ '
    text += " ".join(f'step {{ model_name: "{s}" model_version: -1 }}' for s in steps)
    return text_format.Parse(text + " }", model_config_pb2.ModelConfig())


def _served(name: str, cfg: model_config_pb2.ModelConfig) -> ModelEntry:
    entry = ModelEntry(name)
    mv: Any = SimpleNamespace(config=cfg)
    entry.serving = {1: mv}
    return entry


def test_step_graph() -> None:
    plain = model_config_pb2.ModelConfig(name="a", backend="python")
    models = {
        "a": _served("a", plain),
        "e1": _served("e1", _ensemble("e1", "a", "a")),
        "e2": _served("e2", _ensemble("e2", "e1")),
    }
    assert dependencies.step_names(_ensemble("x", "a", "b", "a")) == ["a", "b"]
    assert dependencies.dependents(models, "a") == ["e1"]
    assert dependencies.ensemble_users(models) == {"a": ["e1", "e1"], "e1": ["e2"]}
    # a reload of e1 stepping into e2 would close a cycle
    assert dependencies.find_cycle(models, "e1", _ensemble("e1", "e2")) == ("e1", "e2", "e1")
    assert dependencies.find_cycle(models, "e1", _ensemble("e1", "a")) == ()
    assert dependencies.find_cycle(models, "a", plain) == ()


def test_served_models_lookups(tmp_path: Path) -> None:
    served = ServedModels(tmp_path)
    with pytest.raises(InferError) as e:
        served.get("nope")
    assert e.value.code is ErrorCode.NOT_FOUND
    served.models["m"] = ModelEntry("m", reason="broken")
    with pytest.raises(InferError) as e:
        served.get("m")
    assert e.value.code is ErrorCode.UNAVAILABLE
    assert "broken" in str(e.value)
    assert served.ready_versions("m") == []
    assert not served.is_serving("m")
