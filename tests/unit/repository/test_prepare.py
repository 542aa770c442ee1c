"""Unit tests: a configuration's way to its backend (pdserve.repository.prepare), here
with auto-complete turned off (tritonserver's --disable-auto-complete-config)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve import config as cfgmod
from pdserve.backends.base import ModelSpec
from pdserve.repository import layout, prepare

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "model_repository"


@pytest.fixture
def no_auto_complete() -> Iterator[None]:
    prepare.set_auto_complete(False)
    yield
    prepare.set_auto_complete(True)


def _repo(tmp_path: Path, *names: str) -> dict[str, layout.ModelDir]:
    if not EXAMPLES.is_dir():
        pytest.skip("examples/model_repository not built")
    for name in names:
        shutil.copytree(EXAMPLES / name, tmp_path / name, symlinks=True)
    return layout.scan_repository(tmp_path)


def _complete(mdir: layout.ModelDir, root: Path) -> cfgmod.ModelConfig:
    cfg = prepare.read_config(mdir)
    version = mdir.versions[-1]
    spec = ModelSpec(mdir.name, version, cfg, mdir.path, mdir.path / str(version), root)
    asyncio.run(prepare.complete_config(spec, prepare.backend_for(cfg)))
    return cfg


def test_auto_complete_fills_a_missing_config(tmp_path: Path) -> None:
    models = _repo(tmp_path, "tiny_autocomplete")
    cfg = _complete(models["tiny_autocomplete"], tmp_path)
    assert [i.name for i in cfg.input] == ["INPUT0"] and [o.name for o in cfg.output]


def test_no_auto_complete_needs_a_config_file(tmp_path: Path, no_auto_complete: None) -> None:
    models = _repo(tmp_path, "tiny_autocomplete")
    with pytest.raises(cfgmod.ConfigError, match="no model configuration file"):
        prepare.read_config(models["tiny_autocomplete"])


def test_no_auto_complete_refuses_what_it_would_fill(
    tmp_path: Path, no_auto_complete: None
) -> None:
    models = _repo(tmp_path, "tiny", "tiny_autocomplete")
    # tiny's config.pbtxt gives everything: unchanged
    cfg = _complete(models["tiny"], tmp_path)
    assert cfg.max_batch_size == 128 and [o.name for o in cfg.output] == ["OUTPUT0"]
    # a config.pbtxt that names only the platform leaves input and output to auto-complete
    (tmp_path / "tiny_autocomplete" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
    )
    with pytest.raises(cfgmod.ConfigError, match="must give input, output"):
        _complete(models["tiny_autocomplete"], tmp_path)
