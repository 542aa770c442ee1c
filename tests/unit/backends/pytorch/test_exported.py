"""PyTorch 2 exported models (``torch_aoti``): Triton's tensor names, loading a
``torch.export`` program, checking a configuration against its signature."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.backends.base import ExecRequest, ModelSpec
from pdserve.backends.pytorch.backend import PyTorchBackend
from pdserve.backends.pytorch.exported import (
    check_config_against,
    is_aoti_package,
    load_pt2,
    pt2_input_plan,
    pt2_output_plan,
)
from pdserve.config import ConfigError
from pdserve.core.types import InferRequest

torch = pytest.importorskip("torch")


def test_tritons_torch_aoti_names() -> None:
    plan = pt2_input_plan(["ARGS[1]", "ARGS[0]"], ["a", "b"])
    assert (plan.order, plan.rule) == (("ARGS[0]", "ARGS[1]"), "ARGS[<index>]")
    assert pt2_input_plan(["INPUT__0"], ["x"]).order == ("INPUT__0",)
    assert pt2_input_plan(["b", "a"], ["a", "b"]).order == ("a", "b")
    assert pt2_output_plan(["RESULT"]) == {"RESULT": 0}
    assert pt2_output_plan(["RESULT[1]", "RESULT[0]"]) == {"RESULT[1]": 1, "RESULT[0]": 0}
    assert pt2_output_plan(["OUTPUT__1", "OUTPUT__0"]) == {"OUTPUT__1": 1, "OUTPUT__0": 0}
    with pytest.raises(ValueError, match=r"indices \[0, 2\] are not 0..1"):
        pt2_input_plan(["ARGS[0]", "ARGS[2]"], None)
    with pytest.raises(ValueError, match="both name result element 0"):
        pt2_output_plan(["RESULT", "RESULT[0]"])


class _Affine(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2 + y, x - y


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pt2")
    batch = torch.export.Dim("batch", min=1, max=16)
    example = (torch.ones(2, 3), torch.ones(2, 3))
    program = torch.export.export(_Affine(), example, dynamic_shapes=({0: batch}, {0: batch}))
    (root / "m" / "1").mkdir(parents=True)
    torch.export.save(program, str(root / "m" / "1" / "model.pt2"))
    return root


def _spec(repo: Path, io: str) -> ModelSpec:
    cfg = text_format.Parse(
        'platform: "torch_aoti" backend: "pytorch" max_batch_size: 8 ' + io,
        model_config_pb2.ModelConfig(name="m"),
    )
    return ModelSpec("m", 1, cfg, repo / "m", repo / "m" / "1", repo)


IO = (
    'input { name: "ARGS[0]" data_type: TYPE_FP32 dims: [3] } '
    'input { name: "ARGS[1]" data_type: TYPE_FP32 dims: [3] } '
    'output { name: "RESULT[0]" data_type: TYPE_FP32 dims: [3] } '
    'output { name: "RESULT[1]" data_type: TYPE_FP32 dims: [3] }'
)


def test_an_exported_program_serves_through_the_pytorch_backend(repo: Path) -> None:
    path = repo / "m" / "1" / "model.pt2"
    assert not is_aoti_package(path)
    assert load_pt2("m", path, torch.device("cpu")).arguments == ["x", "y"]
    spec = _spec(repo, IO)

    async def run() -> list[object]:
        backend = PyTorchBackend()
        await backend.auto_complete(spec)
        instances = await backend.load(spec)
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        y = np.ones((2, 3), np.float32)
        request = ExecRequest(
            {"ARGS[0]": x, "ARGS[1]": y}, ["RESULT[1]", "RESULT[0]"], InferRequest("m", "1", {}), 2
        )
        try:
            return await instances[0].execute([request])
        finally:
            for instance in instances:
                await instance.close()

    (result,) = asyncio.run(run())
    assert isinstance(result, dict)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(result["RESULT[0]"], x * 2 + 1)
    np.testing.assert_array_equal(result["RESULT[1]"], x - 1)


@pytest.mark.parametrize(
    ("io", "field", "needle"),
    [
        (IO.replace("TYPE_FP32", "TYPE_INT64", 1), "input[0].data_type", "FP32"),
        (IO.replace("dims: [3]", "dims: [4]", 1), "input[0].dims", "disagree"),
        (IO + ' output { name: "RESULT[2]" data_type: TYPE_FP32 dims: [3] }', "output", "2 "),
    ],
)
def test_the_config_is_checked_against_the_signature(
    repo: Path, io: str, field: str, needle: str
) -> None:
    spec = _spec(repo, io)
    with pytest.raises(ConfigError) as e:
        check_config_against(spec.config, repo / "m" / "1" / "model.pt2", "m", "m/config.pbtxt")
    assert e.value.field == field and needle in e.value.message


def test_a_corrupt_file_names_it_and_the_loader(tmp_path: Path) -> None:
    path = tmp_path / "model.pt2"
    path.write_bytes(b"PK\x03\x04 no archive")
    with pytest.raises(RuntimeError) as e:
        load_pt2("bad", path, torch.device("cpu"))
    text = str(e.value)
    assert f"model 'bad': cannot load {path}: torch.export.load refused it" in text
