"""Unit tests for pdserve.repository.layout: scanning, version policy, fingerprints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.config import model_file
from pdserve.repository import layout


def cfg(pbtxt: str = "") -> model_config_pb2.ModelConfig:
    return text_format.Parse(pbtxt, model_config_pb2.ModelConfig())


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with two models, stray files and non-numeric folders."""
    root = tmp_path / "repo"
    a = root / "alpha"
    for v in ("1", "2", "10"):
        (a / v).mkdir(parents=True)
        (a / v / "model.onnx").write_bytes(b"onnx" * int(v))
    (a / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    (a / "labels.txt").write_text("a\nb\n")
    (a / "latest").mkdir()  # non-numeric: ignored
    (a / "01").mkdir()  # not a canonical number: ignored
    (a / ".3").mkdir()  # hidden: ignored
    (a / "7").write_text("a file, not a version folder")
    b = root / "beta"
    (b / "3").mkdir(parents=True)
    (b / "3" / "model.py").write_text("class TritonPythonModel: ...\n")
    (root / ".hidden_model" / "1").mkdir(parents=True)
    (root / "README.md").write_text("not a model")
    (root / "empty").mkdir()
    return root


def test_scan_repository(repo: Path) -> None:
    models = layout.scan_repository(repo)
    assert list(models) == ["alpha", "beta", "empty"]
    alpha = models["alpha"]
    assert alpha.name == "alpha" and alpha.path == repo / "alpha"
    assert alpha.versions == [1, 2, 10]  # numeric order, not string order
    assert models["beta"].versions == [3]
    assert models["empty"].versions == []
    assert alpha.config_path == repo / "alpha" / "config.pbtxt"
    assert alpha.version_path(2) == repo / "alpha" / "2"


def test_scan_missing_repository(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        layout.scan_repository(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        layout.scan_repository(tmp_path / "file")


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("", [10]),  # default: latest 1
        ("version_policy { latest { num_versions: 1 } }", [10]),
        ("version_policy { latest { num_versions: 2 } }", [2, 10]),
        ("version_policy { latest { num_versions: 9 } }", [1, 2, 10]),
        ("version_policy { all { } }", [1, 2, 10]),
        ("version_policy { specific { versions: [ 10, 1 ] } }", [1, 10]),
        ("version_policy { specific { versions: [ 2, 5 ] } }", [2]),  # 5 missing: skipped
        ("version_policy { specific { versions: [ 5 ] } }", []),
    ],
)
def test_select_versions(policy: str, expected: list[int]) -> None:
    assert layout.select_versions(cfg(policy), [10, 1, 2]) == expected


def test_version_folders_over_int64_are_ignored(tmp_path: Path) -> None:
    """As Triton (``std::stoll`` out of range is skipped): no request could name them."""
    model = tmp_path / "m"
    for name in ("1", str(2**63 - 1), str(2**63), "99999999999999999999999", "9" * 255):
        (model / name).mkdir(parents=True)
    assert layout.list_versions(model) == [1, 2**63 - 1]


def test_select_versions_none_available() -> None:
    assert layout.select_versions(cfg(), []) == []
    assert layout.select_versions(cfg("version_policy { all { } }"), []) == []


def test_missing_versions() -> None:
    c = cfg("version_policy { specific { versions: [ 2, 5, 7 ] } }")
    assert layout.missing_versions(c, [1, 2]) == [5, 7]
    assert layout.missing_versions(cfg(), [1]) == []


def test_version_dir_files(repo: Path) -> None:
    alpha = layout.scan_repository(repo)["alpha"]
    assert layout.version_dir_files(alpha, 2) == ["model.onnx"]
    assert layout.version_dir_files(repo / "beta", 3) == ["model.py"]
    assert layout.version_dir_files(alpha, 99) == []


def test_model_file_path(repo: Path) -> None:
    alpha = layout.scan_repository(repo)["alpha"]
    onnx_cfg = cfg('backend: "onnxruntime"')
    assert (
        model_file.model_file_path(onnx_cfg, layout.version_path(alpha, 1))
        == repo / "alpha" / "1" / "model.onnx"
    )
    named = cfg('backend: "onnxruntime" default_model_filename: "net.onnx"')
    assert (
        model_file.model_file_path(named, layout.version_path(alpha, 1))
        == repo / "alpha" / "1" / "net.onnx"
    )
    assert model_file.model_file_path(cfg('backend: "python"'), repo / "beta" / "3") == (
        repo / "beta" / "3" / "model.py"
    )
    assert (
        model_file.model_file_path(cfg('backend: "pytorch"'), layout.version_path(alpha, 1)).name
        == "model.pt"
    )
    assert (
        model_file.model_file_path(cfg('platform: "ensemble"'), layout.version_path(alpha, 1))
        is None
    )
    # A large ONNX model: the "file" is a folder holding model.onnx.
    (repo / "alpha" / "2" / "big.onnx").mkdir()
    big = cfg('backend: "onnxruntime" default_model_filename: "big.onnx"')
    assert (
        model_file.model_file_path(big, layout.version_path(alpha, 2))
        == repo / "alpha" / "2" / "big.onnx" / "model.onnx"
    )
    with pytest.raises(ValueError):
        model_file.model_file_path(cfg(), layout.version_path(alpha, 1))


def test_find_model_file(repo: Path) -> None:
    """The lookup every backend and the manager use: the file must exist."""
    alpha = layout.scan_repository(repo)["alpha"]
    assert layout.version_path(alpha, 10) == repo / "alpha" / "10" == alpha.version_path(10)
    assert layout.version_path(repo / "beta", 3) == repo / "beta" / "3"
    onnx_cfg = cfg('backend: "onnxruntime"')
    assert (
        model_file.find_model_file(onnx_cfg, layout.version_path(alpha, 2))
        == repo / "alpha" / "2" / "model.onnx"
    )
    python_cfg = cfg('backend: "python"')
    assert (
        model_file.find_model_file(python_cfg, repo / "beta" / "3")
        == repo / "beta" / "3" / "model.py"
    )
    missing = repo / "alpha" / "1" / "model.py"
    with pytest.raises(FileNotFoundError) as e:
        model_file.find_model_file(python_cfg, layout.version_path(alpha, 1))
    assert str(e.value) == f"model file {missing} does not exist"
    # a folder is not a model file (except an ONNX folder holding model.onnx)
    (repo / "alpha" / "1" / "dir.onnx").mkdir()
    with pytest.raises(FileNotFoundError, match="dir.onnx/model.onnx does not exist"):
        model_file.find_model_file(
            cfg('backend: "onnxruntime" default_model_filename: "dir.onnx"'),
            layout.version_path(alpha, 1),
        )
    with pytest.raises(ValueError, match="ensemble"):
        model_file.find_model_file(
            cfg('name: "e" platform: "ensemble"'), layout.version_path(alpha, 1)
        )


def _touch_later(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def test_fingerprint_changes(repo: Path) -> None:
    alpha = layout.scan_repository(repo)["alpha"]
    fp1 = layout.fingerprint(alpha, 1)
    fp2 = layout.fingerprint(alpha, 2)
    assert fp1 == layout.fingerprint(alpha, 1)  # stable
    assert fp1 != fp2  # different version folders

    # A file in version 2 changes: version 1's fingerprint does not.
    _touch_later(repo / "alpha" / "2" / "model.onnx")
    assert layout.fingerprint(alpha, 2) != fp2
    assert layout.fingerprint(alpha, 1) == fp1

    # config.pbtxt content changes every version's fingerprint.
    (repo / "alpha" / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 4\n')
    fp1b = layout.fingerprint(alpha, 1)
    assert fp1b != fp1

    # A file next to the config (labels) counts too; so does a new file in a version.
    _touch_later(repo / "alpha" / "labels.txt")
    fp1c = layout.fingerprint(alpha, 1)
    assert fp1c != fp1b
    (repo / "alpha" / "1" / "sub").mkdir()
    (repo / "alpha" / "1" / "sub" / "extra.bin").write_bytes(b"x")
    assert layout.fingerprint(alpha, 1) != fp1c


def test_fingerprint_without_config(repo: Path) -> None:
    beta = layout.scan_repository(repo)["beta"]
    fp = layout.fingerprint(beta, 3)
    assert fp == layout.fingerprint(beta, 3)
    (repo / "beta" / "config.pbtxt").write_text('backend: "python"\n')
    assert layout.fingerprint(beta, 3) != fp
    assert isinstance(layout.fingerprint(beta), str)


def test_framework_model_files(tmp_path: Path) -> None:
    """A SavedModel is a folder (so may be what OpenVINO reads); torch_aoti is model.pt2."""
    version = tmp_path / "m" / "1"
    (version / "model.savedmodel").mkdir(parents=True)
    tf_cfg = cfg('platform: "tensorflow_savedmodel" backend: "tensorflow"')
    assert model_file.model_may_be_folder(tf_cfg)
    assert model_file.find_model_file(tf_cfg, version) == version / "model.savedmodel"
    ov_cfg = cfg('backend: "openvino" default_model_filename: "model.savedmodel"')
    assert model_file.find_model_file(ov_cfg, version) == version / "model.savedmodel"
    assert model_file.model_file_path(cfg('backend: "openvino"'), version) == version / "model.xml"
    pt2 = cfg('platform: "torch_aoti" backend: "pytorch"')
    assert not model_file.model_may_be_folder(pt2)
    assert model_file.model_file_path(pt2, version) == version / "model.pt2"
    (version / "model.pt2").mkdir()
    with pytest.raises(FileNotFoundError, match="model.pt2 does not exist"):
        model_file.find_model_file(pt2, version)
