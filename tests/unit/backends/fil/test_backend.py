"""Unit tests for pdserve.backends.fil.backend: auto-complete against the model file,
instances per instance_group, and a batch of requests run and split."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

import pdserve.backends.fil  # noqa: F401 - the package
from pdserve.backends.base import ExecRequest, ModelSpec
from pdserve.backends.fil.backend import (
    FilBackend,
    FilInstance,
    complete_fil_config,
    predict_on_cpu,
    read_forest,
)
from pdserve.config import ConfigError
from pdserve.core.types import InferRequest


def model_dir(tmp_path: Path, src: Path, pbtxt: str) -> Path:
    mdir = tmp_path / "m"
    (mdir / "1").mkdir(parents=True)
    shutil.copy(src, mdir / "1" / src.name)
    (mdir / "config.pbtxt").write_text(pbtxt)
    return mdir


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


BINARY = """name: "m" backend: "fil" max_batch_size: 64
parameters { key: "model_type" value { string_value: "xgboost_json" } }
parameters { key: "is_classifier" value { string_value: "true" } }
parameters { key: "predict_proba" value { string_value: "true" } }
"""


def complete(mdir: Path) -> model_config_pb2.ModelConfig:
    cfg = parse((mdir / "config.pbtxt").read_text())
    complete_fil_config(cfg, read_forest(cfg, mdir / "1", "c"), "c")
    return cfg


def test_autocomplete_fills_fils_tensors(tree_files: dict[str, Path], tmp_path: Path) -> None:
    cfg = complete(model_dir(tmp_path, tree_files["xgb_binary_json"], BINARY))
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [
        ("input__0", model_config_pb2.TYPE_FP32, [6])
    ]
    assert [(o.name, list(o.dims)) for o in cfg.output] == [("output__0", [2])]


def test_binary_proba_may_declare_one_column(tree_files: dict[str, Path], tmp_path: Path) -> None:
    text = BINARY + 'output { name: "output__0" data_type: TYPE_FP32 dims: [ 1 ] }'
    cfg = complete(model_dir(tmp_path, tree_files["xgb_binary_json"], text))
    assert list(cfg.output[0].dims) == [1]


@pytest.mark.parametrize(
    ("extra", "field", "text"),
    [
        ('input { name: "input__0" data_type: TYPE_FP32 dims: [ 5 ] }', "input[0].dims", "[-1,6]"),
        (
            'output { name: "output__0" data_type: TYPE_FP32 dims: [ 3 ] }',
            "output[0].dims",
            "[-1,2]",
        ),
        (
            'input { name: "input__0" data_type: TYPE_FP64 dims: [ 6 ] }',
            "input[0].data_type",
            "FP32",
        ),
        (
            'output { name: "treeshap_output" data_type: TYPE_FP32 dims: [ 7 ] }',
            "output[0].name",
            "SHAP",
        ),
    ],
)
def test_config_disagreeing_with_model_is_refused(
    tree_files: dict[str, Path], tmp_path: Path, extra: str, field: str, text: str
) -> None:
    mdir = model_dir(tmp_path, tree_files["xgb_binary_json"], BINARY + extra)
    with pytest.raises(ConfigError) as e:
        complete(mdir)
    assert e.value.field == field and text in e.value.message


def test_kind_auto_is_cpu_for_models_no_gpu_runs(
    tree_files: dict[str, Path], tmp_path: Path
) -> None:
    text = """name: "m" backend: "fil" max_batch_size: 8 instance_group { kind: KIND_AUTO }
parameters { key: "model_type" value { string_value: "lightgbm" } }"""
    cfg = complete(model_dir(tmp_path, tree_files["lgb_reg"], text))
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert [(o.name, list(o.dims)) for o in cfg.output] == [("output__0", [1])]


def spec_for(mdir: Path, cfg: model_config_pb2.ModelConfig) -> ModelSpec:
    return ModelSpec("m", 1, cfg, mdir, mdir / "1", mdir.parent)


def request(rows: np.ndarray) -> ExecRequest:
    return ExecRequest(
        {"input__0": rows}, ["output__0"], InferRequest(model_name="m"), batch_size=len(rows)
    )


def test_instances_run_and_split_a_batch(tree_files: dict[str, Path], tmp_path: Path) -> None:
    text = BINARY + "instance_group { kind: KIND_CPU count: 2 }"
    mdir = model_dir(tmp_path, tree_files["xgb_binary_json"], text)
    cfg = complete(mdir)
    data = np.load(tree_files["data"])

    async def go() -> list[object]:
        instances = await FilBackend().load(spec_for(mdir, cfg))
        assert [(i.name, i.kind) for i in instances] == [("m_0", "KIND_CPU"), ("m_1", "KIND_CPU")]
        assert isinstance(instances[0], FilInstance)
        assert instances[0].predictor.name == "tl2cgen"
        try:
            return await instances[1].execute([request(data["x"][:3]), request(data["x"][3:8])])
        finally:
            for i in instances:
                await i.close()

    first, second = asyncio.run(go())
    assert isinstance(first, dict) and isinstance(second, dict)
    np.testing.assert_allclose(first["output__0"], data["xgb_binary"][:3], atol=1e-6)
    np.testing.assert_allclose(second["output__0"], data["xgb_binary"][3:8], atol=1e-6)


def test_kind_gpu_without_gpu_fails_with_reason(
    tree_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    text = BINARY + 'instance_group { name: "g" kind: KIND_GPU gpus: [ 0 ] }'
    mdir = model_dir(tmp_path, tree_files["xgb_binary_json"], text)
    cfg = complete(mdir)
    with pytest.raises(RuntimeError, match="instance group 'g' asks for KIND_GPU on GPU 0, but"):
        asyncio.run(FilBackend().load(spec_for(mdir, cfg)))


def test_predict_on_cpu_gives_class_ids(tree_files: dict[str, Path], tmp_path: Path) -> None:
    text = BINARY.replace(
        '"predict_proba" value { string_value: "true"',
        '"predict_proba" value { string_value: "false"',
    )
    mdir = model_dir(tmp_path, tree_files["xgb_multi_json"], text)
    cfg = complete(mdir)
    data = np.load(tree_files["data"])
    got = predict_on_cpu(cfg, mdir / "1", data["x"])
    np.testing.assert_array_equal(got, data["xgb_multi_class"].reshape(-1, 1).astype(np.float32))
