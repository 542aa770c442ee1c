"""pdserve.backends.devices: the driver's GPUs under CUDA_VISIBLE_DEVICES, asked once for
every backend and the model manager."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.backends import devices
from pdserve.backends.devices import check_gpu_ids, visible_gpu_count, visible_gpus
from pdserve.backends.registry import get_backend


def _driver(tmp_path: Path, n: int) -> Path:
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for i in range(n):
        (gpus / f"0000:0{i}:00.0").mkdir()
    return gpus


def test_no_driver_means_no_gpu(tmp_path: Path) -> None:
    assert visible_gpu_count({}, tmp_path / "absent") == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1"}, tmp_path / "absent") == 0


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, 4),  # unset: every GPU of the driver
        ("", 0),
        ("-1", 0),
        ("NoDevFiles", 0),
        ("2", 1),
        ("0,3", 2),
        ("1,-1,2", 1),  # CUDA stops at the first invalid entry
        ("GPU-8f3c0a4e-1111-2222-3333-444455556666", 1),
        ("0,1,2,3,4,5", 4),  # never more than the driver has
    ],
)
def test_cuda_visible_devices(tmp_path: Path, visible: str | None, expected: int) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert visible_gpu_count(env, _driver(tmp_path, 4)) == expected


def test_visible_gpus_are_cuda_ids_from_zero(tmp_path: Path) -> None:
    gpus = _driver(tmp_path, 4)
    assert visible_gpus({}, gpus) == [0, 1, 2, 3]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,1"}, gpus) == [0, 1]  # renumbered by CUDA
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, gpus) == []
    assert visible_gpus({}, tmp_path / "absent") == []


def test_check_gpu_ids() -> None:
    check_gpu_ids("g", [0, 1], visible=2)
    check_gpu_ids("g", [], visible=0)
    with pytest.raises(RuntimeError) as e:
        check_gpu_ids("m_0", [0, 2, 5], visible=2)
    assert str(e.value) == (
        "instance group 'm_0' asks for KIND_GPU on GPU 2, 5, but this process sees 2 GPU(s) "
        "(NVIDIA driver and CUDA_VISIBLE_DEVICES); use KIND_CPU"
    )
    with pytest.raises(RuntimeError, match="sees 0 GPU"):
        check_gpu_ids("g", [-1], visible=0)


def test_backends_resolve_kind_auto_from_this_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KIND_AUTO: the python backend takes every visible GPU (Triton); ONNX Runtime only
    when its build has the CUDA execution provider (this test's onnxruntime has not)."""
    import onnxruntime

    monkeypatch.setattr(devices, "NVIDIA_GPUS_DIR", _driver(tmp_path, 2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert get_backend("python").usable_gpus() == [0, 1]
    providers = onnxruntime.get_available_providers()
    ort_gpus = get_backend("onnxruntime").usable_gpus()
    assert ort_gpus == ([0, 1] if "CUDAExecutionProvider" in providers else [])
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider"])
    assert get_backend("onnxruntime").usable_gpus() == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert get_backend("onnxruntime").usable_gpus() == [0]


@pytest.mark.parametrize(
    ("visible", "device", "expected"),
    [
        (None, 0, "0"),
        (None, 3, "3"),
        ("5,7", 1, "7"),
        ("GPU-aaaa,GPU-bbbb", 0, "GPU-aaaa"),
        ("2, 6", 1, "6"),
    ],
)
def test_cuda_visible_devices_for_one_gpu(visible: str | None, device: int, expected: str) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert devices.cuda_visible_devices_for(device, env) == expected


@pytest.mark.parametrize(("visible", "device"), [("5,7", 2), ("1,-1,2", 1), (None, -1)])
def test_cuda_visible_devices_for_an_unlisted_gpu(visible: str | None, device: int) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    with pytest.raises(ValueError, match=f"GPU id {device}"):
        devices.cuda_visible_devices_for(device, env)


@pytest.mark.parametrize(("visible", "expected"), [(None, "1|GPU|1"), ("4,6", "6|GPU|1")])
def test_python_kind_gpu_worker_sees_only_its_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str | None, expected: str
) -> None:
    """A python-backend KIND_GPU instance on GPU 1 (of a fake 2-GPU driver): its worker
    gets Triton's args (kind GPU, device id 1) and CUDA_VISIBLE_DEVICES naming only
    that GPU, the physical one when the server's own variable maps them."""
    import asyncio

    import numpy as np

    from pdserve import config as cfgmod
    from pdserve.backends.base import ExecRequest, ModelSpec
    from pdserve.core.types import InferRequest

    monkeypatch.setattr(devices, "NVIDIA_GPUS_DIR", _driver(tmp_path, 2))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    model_dir = Path(__file__).resolve().parents[2] / "data" / "python_models" / "gpu_env"
    cfg = cfgmod.load_model_config(model_dir)
    cfgmod.normalize_platform(cfg, model_dir / "config.pbtxt")
    cfgmod.apply_defaults(cfg, gpus=[0, 1])
    spec = ModelSpec("gpu_env", 1, cfg, model_dir, model_dir / "1", model_dir.parent)

    async def run() -> bytes:
        instances = await get_backend("python").load(spec)
        try:
            assert [i.kind for i in instances] == ["KIND_GPU"]
            req = ExecRequest({"INPUT0": np.zeros(1, np.float32)}, ["ENV"], InferRequest("m"))
            (result,) = await instances[0].execute([req])
            assert isinstance(result, dict)
            return result["ENV"][0]
        finally:
            for i in instances:
                await i.close()

    assert asyncio.run(run()).decode() == expected


def test_pytorch_kind_auto_needs_a_cuda_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PyTorch backend puts KIND_AUTO on GPUs only when torch is a CUDA build."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(devices, "NVIDIA_GPUS_DIR", _driver(tmp_path, 2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    expected = [0, 1] if torch.version.cuda and torch.cuda.is_available() else []
    assert get_backend("pytorch").usable_gpus() == expected[: torch.cuda.device_count()]
