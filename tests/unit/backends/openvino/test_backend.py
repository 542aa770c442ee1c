"""The OpenVINO backend: instances per instance_group, batches, padding, GPU refusal."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.backends.base import ExecRequest, ModelSpec
from pdserve.backends.openvino.backend import OpenVinoBackend, model_path, openvino_gpus
from pdserve.core.errors import InferError
from pdserve.core.types import InferRequest
from tests.openvino_models import write_double

pytest.importorskip("openvino")


def _spec(tmp_path: Path, text: str, shape: list[int] | None = None) -> ModelSpec:
    write_double(tmp_path / "m" / "1", shape or [-1, 4])
    cfg = text_format.Parse('backend: "openvino" ' + text, model_config_pb2.ModelConfig(name="m"))
    return ModelSpec("m", 1, cfg, tmp_path / "m", tmp_path / "m" / "1", tmp_path)


def _request(rows: int) -> ExecRequest:
    x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    return ExecRequest({"x": x}, ["y"], InferRequest("m", "1", {}), rows)


async def _load_and_run(spec: ModelSpec, batch: list[ExecRequest]) -> tuple[int, list[object]]:
    backend = OpenVinoBackend()
    await backend.auto_complete(spec)
    instances = await backend.load(spec)
    try:
        return len(instances), await instances[0].execute(batch)
    finally:
        for instance in instances:
            await instance.close()


def test_instances_follow_instance_group_and_batches_split(tmp_path: Path) -> None:
    spec = _spec(
        tmp_path,
        "max_batch_size: 8 instance_group [ { count: 3, kind: KIND_CPU } ] "
        'parameters { key: "NUM_STREAMS" value { string_value: "1" } }',
    )
    count, results = asyncio.run(_load_and_run(spec, [_request(2), _request(3)]))
    assert count == 3
    assert spec.config.input[0].name == "x" and list(spec.config.input[0].dims) == [4]
    for rows, result in zip((2, 3), results, strict=True):
        assert isinstance(result, dict)
        want = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) * 2
        np.testing.assert_array_equal(result["y"], want)
    assert model_path(spec).name == "model.xml"


def test_cpu_instances_infer_in_f32_unless_hint_bf16_asks(tmp_path: Path) -> None:
    """OpenVINO alone would pick bf16 on CPUs with AVX512_BF16 or AMX."""

    async def precision() -> str:
        backend = OpenVinoBackend()
        spec = _spec(tmp_path, "max_batch_size: 8")
        await backend.auto_complete(spec)
        instances = await backend.load(spec)
        try:
            compiled = instances[0].request.get_compiled_model()  # type: ignore[attr-defined]
            return str(compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())
        finally:
            for instance in instances:
                await instance.close()

    assert asyncio.run(precision()) == "f32"


def test_a_fixed_batch_pads_with_enable_batch_padding(tmp_path: Path) -> None:
    params = (
        'parameters { key: "SKIP_OV_DYNAMIC_BATCHSIZE" value { string_value: "YES" } } '
        'parameters { key: "ENABLE_BATCH_PADDING" value { string_value: "YES" } }'
    )
    spec = _spec(tmp_path, "max_batch_size: 4 " + params)
    _, (result,) = asyncio.run(_load_and_run(spec, [_request(3)]))
    assert isinstance(result, dict) and result["y"].shape == (3, 4)
    np.testing.assert_array_equal(result["y"][2], np.arange(8, 12, dtype=np.float32) * 2)


def test_a_fixed_batch_without_padding_fails_the_batch_as_triton_does(tmp_path: Path) -> None:
    params = 'parameters { key: "SKIP_OV_DYNAMIC_BATCHSIZE" value { string_value: "YES" } }'
    spec = _spec(tmp_path, "max_batch_size: 4 " + params)
    with pytest.raises(InferError) as e:
        asyncio.run(_load_and_run(spec, [_request(3)]))
    assert "expected requests with batch size '4', got '3'" in e.value.message
    assert "ENABLE_BATCH_PADDING" in e.value.message


@pytest.mark.skipif(bool(openvino_gpus()), reason="OpenVINO sees a GPU here")
def test_kind_gpu_without_an_openvino_gpu_fails_the_load(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "max_batch_size: 4 instance_group [ { kind: KIND_GPU } ]")
    with pytest.raises(RuntimeError) as e:
        asyncio.run(_load_and_run(spec, []))
    text = str(e.value)
    assert "model 'm'" in text and "KIND_GPU (GPU.0)" in text
    assert "OpenVINO sees no such GPU device here (its devices: CPU" in text
    assert "use KIND_CPU" in text
    assert OpenVinoBackend().usable_gpus() == []
