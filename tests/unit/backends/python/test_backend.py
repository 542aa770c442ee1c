"""The python backend driven directly (pdserve.backends.python.backend): auto-complete
and load of a real ``model.py`` in worker processes, execute, output checks, close; and
the worker side's helpers (pdserve.backends.python.worker) run in this process."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.backends.base import ExecRequest, ModelSpec
from pdserve.backends.python.backend import PythonBackend, PythonInstance
from pdserve.backends.python.messages import WorkerInit
from pdserve.backends.python.worker import _is_decoupled, _model_args, load_model_module
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferRequest

MODELS = Path(__file__).resolve().parents[3] / "data" / "python_models"


def _spec(tmp_path: Path, model: str, config: str) -> ModelSpec:
    shutil.copytree(MODELS / model / "1", tmp_path / model / "1")
    cfg = text_format.Parse(config, model_config_pb2.ModelConfig())
    model_dir = tmp_path / model
    return ModelSpec(model, 1, cfg, model_dir, model_dir / "1", tmp_path)


def _add_sub(inst: PythonInstance, a: list[float], b: list[float], outputs: list[str]) -> object:
    x = np.array(a, np.float32)
    y = np.array(b, np.float32)
    req = ExecRequest({"INPUT0": x, "INPUT1": y}, outputs, InferRequest("add_sub"), 1)
    return inst.execute([req])


def test_auto_complete_load_execute_and_close(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "add_sub", 'name: "add_sub" backend: "python"')

    async def main() -> None:
        backend = PythonBackend()
        await backend.auto_complete(spec)
        assert [(t.name, list(t.dims)) for t in spec.config.input] == [
            ("INPUT0", [4]),
            ("INPUT1", [4]),
        ]
        assert [t.name for t in spec.config.output] == ["OUTPUT0", "OUTPUT1"]
        instances = await backend.load(spec)
        assert [i.name for i in instances] == ["add_sub_0_0"]
        (inst,) = instances
        assert isinstance(inst, PythonInstance)
        try:
            (pid,) = inst.worker_pids()
            assert pid > 0 and pid != os.getpid()
            (out,) = await _add_sub(inst, [1, 2, 3, 4], [1, 1, 1, 1], ["OUTPUT0", "OUTPUT1"])
            assert isinstance(out, dict)
            assert out["OUTPUT0"].tolist() == [2, 3, 4, 5]
            assert out["OUTPUT1"].tolist() == [0, 1, 2, 3]
            (only,) = await _add_sub(inst, [5, 5, 5, 5], [2, 2, 2, 2], ["OUTPUT1"])
            assert isinstance(only, dict) and list(only) == ["OUTPUT1"]
            assert only["OUTPUT1"].tolist() == [3, 3, 3, 3]
        finally:
            await inst.close()

    asyncio.run(main())


_INPUTS = (
    'name: "add_sub" backend: "python" '
    'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, '
    '{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ] '
)


@pytest.mark.parametrize(
    ("outputs", "asked", "message"),
    [
        (
            ["OUTPUT0", "OUTPUT1", "OUTPUT2"],
            ["OUTPUT2"],
            "python model 'add_sub' did not return requested output 'OUTPUT2' "
            "(it returned none)",  # the worker drops outputs nobody asked for
        ),
        (
            ["OUTPUT0"],
            [],  # none asked: every output the model returns comes back
            "python model 'add_sub' returned output 'OUTPUT1', which its model "
            "configuration does not declare",
        ),
    ],
)
def test_outputs_missing_or_undeclared_are_internal_naming_them(
    tmp_path: Path, outputs: list[str], asked: list[str], message: str
) -> None:
    declared = ", ".join(
        f'{{ name: "{name}" data_type: TYPE_FP32 dims: [ 4 ] }}' for name in outputs
    )
    spec = _spec(tmp_path, "add_sub", _INPUTS + f"output [ {declared} ]")

    async def main() -> object:
        (inst,) = await PythonBackend().load(spec)
        assert isinstance(inst, PythonInstance)
        try:
            (out,) = await _add_sub(inst, [1, 2, 3, 4], [1, 1, 1, 1], asked)
            return out
        finally:
            await inst.close()

    out = asyncio.run(main())
    assert isinstance(out, InferError) and out.code is ErrorCode.INTERNAL
    assert out.message == message


def test_a_model_file_without_the_class_fails_to_import_in_the_worker(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.py").write_text("X = 1\n")
    cfg = text_format.Parse('name: "m" backend: "python"', model_config_pb2.ModelConfig())
    spec = ModelSpec("m", 1, cfg, tmp_path / "m", tmp_path / "m" / "1", tmp_path)
    with pytest.raises(RuntimeError, match="does not define class TritonPythonModel"):
        asyncio.run(PythonBackend().load(spec))


def test_worker_helpers() -> None:
    assert _is_decoupled(json.dumps({"model_transaction_policy": {"decoupled": True}}))
    assert not _is_decoupled(json.dumps({"model_transaction_policy": {}}))
    assert not _is_decoupled("{}") and not _is_decoupled("not json") and not _is_decoupled("[]")
    init = WorkerInit(
        mode="serve",
        model_file="/r/m/1/model.py",
        version_dir="/r/m/1",
        model_dir="/r/m",
        model_name="m",
        model_version=3,
        model_config='{"name": "m"}',
        instance_name="m_0_1",
        instance_kind="GPU",
        device_id=2,
    )
    assert _model_args(init) == {
        "model_config": '{"name": "m"}',
        "model_instance_kind": "GPU",
        "model_instance_name": "m_0_1",
        "model_instance_device_id": "2",
        "model_repository": "/r/m",
        "model_version": "3",
        "model_name": "m",
    }


def test_load_model_module_imports_model_py_with_pb_utils(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "model", raising=False)
    version = MODELS / "add_sub" / "1"
    module = load_model_module(str(version / "model.py"), str(version), str(version.parent))
    assert sys.modules["model"] is module
    assert sys.path[:2] == [str(version), str(version.parent)]
    assert hasattr(module.TritonPythonModel, "auto_complete_config")
    bad = tmp_path / "model.py"
    bad.write_text("X = 1\n")
    with pytest.raises(AttributeError, match="does not define class TritonPythonModel"):
        load_model_module(str(bad), str(tmp_path), str(tmp_path))
    monkeypatch.delitem(sys.modules, "model", raising=False)
