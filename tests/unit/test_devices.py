"""pdserve.backends.devices.visible_gpu_count: the driver's GPUs under CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.backends.devices import visible_gpu_count


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
