"""Unit tests for pdserve.config.model_file: where a version's model file is, for FIL's
per-``model_type`` file names."""

from __future__ import annotations

from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2

from pdserve.config import find_model_file, model_file_path


def fil(model_type: str | None = None, default: str = "") -> model_config_pb2.ModelConfig:
    cfg = model_config_pb2.ModelConfig(name="m", backend="fil", default_model_filename=default)
    if model_type is not None:
        cfg.parameters["model_type"].string_value = model_type
    return cfg


@pytest.mark.parametrize(
    ("model_type", "name"),
    [
        (None, "xgboost.model"),  # FIL's default model_type is xgboost (legacy binary)
        ("xgboost_json", "xgboost.json"),
        ("xgboost_ubj", "xgboost.ubj"),
        ("lightgbm", "model.txt"),
        ("treelite_checkpoint", "checkpoint.tl"),
    ],
)
def test_fil_file_is_named_by_model_type(tmp_path: Path, model_type: str | None, name: str) -> None:
    assert model_file_path(fil(model_type), tmp_path) == tmp_path / name


def test_fil_default_model_filename_file_or_folder(tmp_path: Path) -> None:
    assert model_file_path(fil("lightgbm", "trees.txt"), tmp_path) == tmp_path / "trees.txt"
    (tmp_path / "bundle").mkdir()
    # a folder: FIL looks for the model_type's file inside it
    assert model_file_path(fil("lightgbm", "bundle"), tmp_path) == tmp_path / "bundle" / "model.txt"
    with pytest.raises(FileNotFoundError, match="model.txt does not exist"):
        find_model_file(fil("lightgbm", "bundle"), tmp_path)
