"""The model manager's request checks and error scrubbing (pdserve.repository.manager)."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest

from pdserve.config import ModelConfig
from pdserve.core.errors import ErrorCode, InferError
from pdserve.repository import manager as mgr
from pdserve.repository import staging


@pytest.mark.parametrize("name", ["tiny", "a b", "ü" * 127, "x" * 255, "model-1.onnx_v2"])
def test_model_names_accepted(name: str) -> None:
    staging.check_model_name(name)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("", "empty or blank"),
        ("  \t", "empty or blank"),
        (".", "one folder name"),
        ("..", "one folder name"),
        (".hidden", "one folder name"),
        ("a/b", "one folder name"),
        ("a\\b", "one folder name"),
        ("a\0b", "one folder name"),
        ("/abs", "one folder name"),
        ("x" * 256, "256 bytes long"),
        ("ü" * 128, "256 bytes long"),
    ],
)
def test_model_names_refused(name: str, words: str) -> None:
    with pytest.raises(InferError) as e:
        staging.check_model_name(name)
    assert e.value.code is ErrorCode.INVALID_ARG
    assert words in e.value.message
    assert len(e.value.message) < 300  # a long name is cut, not echoed whole


def test_file_paths_accepted() -> None:
    staging.check_file_paths(["1/model.onnx", "labels.txt", "2/sub/dir/weights.bin", "1/.hidden"])


@pytest.mark.parametrize(
    ("paths", "words"),
    [
        ([""], "names no file"),
        (["1/"], "names a folder"),
        (["1//model.onnx"], "empty path component"),
        (["../x"], "'..'"),
        (["1/../../x"], "'..'"),
        (["./1/model.onnx"], "'..'"),
        (["/etc/passwd"], "not absolute"),
        (["1/a\0b"], "NUL"),
        (["1\\model.onnx"], "NUL or '\\'"),
        (["config.pbtxt"], "'config' parameter"),
        (["1", "1/model.onnx"], "'file:1' names a folder that other"),
        (["1/" + "x" * 256], "at most 255 bytes"),
        (["a/" * 600 + "x"], "at most 1024 bytes"),
    ],
)
def test_file_paths_refused(paths: list[str], words: str) -> None:
    with pytest.raises(InferError) as e:
        staging.check_file_paths(paths)
    assert e.value.code is ErrorCode.INVALID_ARG
    assert words in e.value.message


def test_public_messages_hold_no_absolute_path(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    m = mgr.ModelManager(repo)
    staged = os.path.join(tempfile.gettempdir(), staging.STAGING_PREFIX + "ab12cd")
    said = m._public(
        f"model file {repo}/tiny/1/model.onnx does not exist; "
        f"'{repo}' is the repository; Load model from {staged}/tiny/3/model.onnx failed; "
        f"{staged}/tiny/config.pbtxt: max_batch_size: bad",
        override_dir=Path(staged) / "tiny",
    )
    assert str(tmp_path) not in said and tempfile.gettempdir() not in said
    assert "model file tiny/1/model.onnx does not exist" in said
    assert "'<model repository>' is the repository" in said
    assert "<override>/tiny/3/model.onnx" in said
    assert "<config override>: max_batch_size" in said


def test_files_need_a_config_and_leave_the_repository_alone(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    m = mgr.ModelManager(repo)
    with pytest.raises(InferError, match="require a 'config'"):
        asyncio.run(m.load_model("m", None, {"1/model.onnx": b"x"}))
    with pytest.raises(InferError, match="'..'"):
        asyncio.run(m.load_model("m", ModelConfig(name="m"), {"../x": b"x"}))
    assert sorted(p.name for p in repo.rglob("*")) == ["1", "m"]
