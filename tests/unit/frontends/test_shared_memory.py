"""The system shared-memory registry (:mod:`pdserve.frontends.shared_memory`), on
files in a temporary folder standing in for /dev/shm."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferRequest, InferResponse, RequestedOutput
from pdserve.frontends.shared_memory import (
    SharedMemoryRegistry,
    ShmInput,
    infer_with_shm,
    shm_output_names,
    shm_params,
)


@pytest.fixture()
def reg(tmp_path: Path) -> SharedMemoryRegistry:
    return SharedMemoryRegistry(enabled=True, shm_dir=str(tmp_path))


def make(tmp_path: Path, name: str, data: bytes) -> str:
    (tmp_path / name).write_bytes(data)
    return "/" + name


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_off_refuses_everything(tmp_path: Path) -> None:
    off = SharedMemoryRegistry(shm_dir=str(tmp_path))
    for call in (
        lambda: off.register("r", "/x", 0, 4),
        lambda: off.status(),
        lambda: off.unregister(),
        lambda: off.acquire([("r", "input 'x'")]),
        lambda: off.cuda_status(),
        lambda: off.cuda_unregister(),
        lambda: off.cuda_register("c"),
    ):
        with pytest.raises(InferError) as e:
            call()
        assert e.value.code is ErrorCode.UNSUPPORTED and "--allow-client-shm" in e.value.message


def test_register_status_unregister(reg: SharedMemoryRegistry, tmp_path: Path) -> None:
    key = make(tmp_path, "a", bytes(100))
    before = fds()
    reg.register("r1", key, 10, 50)
    reg.register("r2", key, 0, 100)
    assert reg.status("r1") == [{"name": "r1", "key": key, "offset": 10, "byte_size": 50}]
    assert [r["name"] for r in reg.status()] == ["r1", "r2"]
    with pytest.raises(InferError) as e:
        reg.register("r1", key, 0, 4)
    assert e.value.code is ErrorCode.ALREADY_EXISTS
    reg.unregister("r1")
    reg.unregister("r1")  # nothing to do: no error (Triton)
    with pytest.raises(InferError) as e:
        reg.status("r1")
    assert e.value.code is ErrorCode.NOT_FOUND
    reg.unregister()
    assert reg.status() == [] and fds() == before


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("a", "invalid key"),
        ("/", "invalid key"),
        ("/..", "invalid key"),
        ("/sub/a", "invalid key"),
        ("/a\0b", "invalid key"),
        ("/" + "x" * 300, "invalid key"),
        ("/triton_x", "reserved prefix 'triton_'"),
        ("/sem.lock", "reserved prefix 'sem.'"),
        ("/missing", "no such shared-memory object"),
        (5, "'key' must be a string"),
    ],
)
def test_bad_keys(reg: SharedMemoryRegistry, key: object, words: str) -> None:
    with pytest.raises(InferError) as e:
        reg.register("r", key, 0, 4)
    assert e.value.code is ErrorCode.INVALID_ARG and words in e.value.message


def test_symlinks_directories_and_other_owners(reg: SharedMemoryRegistry, tmp_path: Path) -> None:
    target = tmp_path.parent / f"{tmp_path.name}_outside"
    target.write_bytes(bytes(64))
    (tmp_path / "link").symlink_to(target)
    (tmp_path / "dir").mkdir()
    for key, words in (("/link", "symbolic link"), ("/dir", "directory")):
        with pytest.raises(InferError) as e:
            reg.register("r", key, 0, 4)
        assert words in e.value.message
    if os.geteuid() == 0:
        other = make(tmp_path, "other", bytes(64))
        os.chown(tmp_path / "other", 65534, 65534)
        with pytest.raises(InferError) as e:
            reg.register("r", other, 0, 4)
        assert "not owned by the server's user" in e.value.message
    assert reg.status() == []


@pytest.mark.parametrize(
    ("offset", "size", "words"),
    [
        (0, 65, "past the end"),
        (64, 1, "past the end"),
        (0, 0, "'byte_size' must be an integer > 0"),
        (-1, 4, "'offset' must be an integer >= 0"),
        (0, "4", "'byte_size' must be an integer > 0"),
        (1.5, 4, "'offset' must be an integer >= 0"),
    ],
)
def test_bad_offsets_and_sizes(
    reg: SharedMemoryRegistry, tmp_path: Path, offset: object, size: object, words: str
) -> None:
    key = make(tmp_path, "a", bytes(64))
    with pytest.raises(InferError) as e:
        reg.register("r", key, offset, size)
    assert words in e.value.message


def test_read_inputs_copies(reg: SharedMemoryRegistry, tmp_path: Path) -> None:
    x = np.arange(6, dtype=np.float32)
    key = make(tmp_path, "a", b"\xff" * 8 + x.tobytes())
    reg.register("r", key, 8, 24)
    ref = ShmInput("FP32", [2, 3], 6, "r", 24, 0)
    got = reg.read_inputs({"x": ref})["x"]
    np.testing.assert_array_equal(got, x.reshape(2, 3))
    (tmp_path / "a").write_bytes(bytes(32))  # the client rewrites the bytes: the copy stays
    np.testing.assert_array_equal(got, x.reshape(2, 3))
    assert got.flags.writeable
    with pytest.raises(InferError, match="does not match the 24 bytes"):
        reg.read_inputs({"x": ShmInput("FP32", [2, 3], 6, "r", 20, 0)})
    with pytest.raises(InferError, match="past the end of region 'r'"):
        reg.read_inputs({"x": ShmInput("FP32", [1], 1, "r", 4, 24)})
    with pytest.raises(InferError, match="Unable to find shared memory region: 'q'") as e:
        reg.read_inputs({"x": ShmInput("FP32", [1], 1, "q", 4, 0)})
    assert e.value.code is ErrorCode.NOT_FOUND  # Triton: TRITONSERVER_ERROR_NOT_FOUND


def test_bytes_inputs_and_outputs(reg: SharedMemoryRegistry, tmp_path: Path) -> None:
    blob = (3).to_bytes(4, "little") + b"abc" + (0).to_bytes(4, "little")
    key = make(tmp_path, "a", blob + bytes(64))
    reg.register("r", key, 0, len(blob) + 64)
    got = reg.read_inputs({"s": ShmInput("BYTES", [2], 2, "r", len(blob), 0)})["s"]
    assert got.tolist() == [b"abc", b""]
    out = np.array([b"hello"], dtype=object)
    reg.write_outputs({"o": out}, {"o": ("r", 9, len(blob))})
    data = (tmp_path / "a").read_bytes()
    assert data[len(blob) : len(blob) + 9] == (5).to_bytes(4, "little") + b"hello"


def test_truncated_file_is_an_error(reg: SharedMemoryRegistry, tmp_path: Path) -> None:
    key = make(tmp_path, "a", bytes(64))
    reg.register("r", key, 0, 64)
    os.truncate(tmp_path / "a", 8)
    with pytest.raises(InferError, match="was truncated"):
        reg.read_inputs({"x": ShmInput("FP32", [16], 16, "r", 64, 0)})
    with pytest.raises(InferError, match="was truncated"):
        reg.write_outputs({"o": np.zeros(4, np.float32)}, {"o": ("r", 16, 16)})
    assert (tmp_path / "a").stat().st_size == 8  # nothing written past the end


def test_write_outputs_checks_size_overlap_and_read_only(
    reg: SharedMemoryRegistry, tmp_path: Path
) -> None:
    key = make(tmp_path, "a", bytes(64))
    reg.register("r", key, 16, 48)
    y = np.arange(4, dtype=np.float32)
    reg.write_outputs({"y": y}, {"y": ("r", 16, 4)})
    raw = (tmp_path / "a").read_bytes()
    assert raw[20:36] == y.tobytes() and raw[:20] == bytes(20)
    with pytest.raises(InferError, match="should be at least 16 bytes"):
        reg.write_outputs({"y": y}, {"y": ("r", 8, 0)})
    with pytest.raises(InferError, match="overlap in shared memory"):
        reg.write_outputs({"a": y, "b": y}, {"a": ("r", 16, 0), "b": ("r", 16, 12)})
    with pytest.raises(InferError, match="was not produced"):
        reg.write_outputs({}, {"y": ("r", 16, 0)})
    ro = make(tmp_path, "ro", bytes(16))
    os.chmod(tmp_path / "ro", 0o400)
    if os.geteuid() != 0:  # root may open anything for writing
        reg.register("ro", ro, 0, 16)
        reg.read_inputs({"x": ShmInput("FP32", [4], 4, "ro", 16, 0)})
        with pytest.raises(InferError, match="read-only"):
            reg.write_outputs({"y": y}, {"y": ("ro", 16, 0)})


def test_unregister_in_use_defers_the_close(reg: SharedMemoryRegistry, tmp_path: Path) -> None:
    key = make(tmp_path, "a", np.float32([2.0]).tobytes() + bytes(4))
    before = fds()
    reg.register("r", key, 0, 8)
    request = InferRequest(
        "m",
        inputs={"x": np.empty(0)},
        outputs=[
            RequestedOutput(
                "y",
                parameters={
                    "shared_memory_region": "r",
                    "shared_memory_byte_size": 4,
                    "shared_memory_offset": 4,
                },
            )
        ],
    )
    request.shm_inputs = {"x": ShmInput("FP32", [1], 1, "r", 4, 0)}

    async def infer(req: InferRequest) -> InferResponse:
        reg.unregister("r")  # while the request holds the region
        assert reg.status() == []
        with pytest.raises(InferError, match="Unable to find shared memory region: 'r'") as e:
            reg.acquire([("r", "input 'x'")])
        assert e.value.code is ErrorCode.NOT_FOUND and "input 'x'" in e.value.message
        return InferResponse("m", "1", outputs={"y": req.inputs["x"] * 3})

    names = shm_output_names(request)
    assert names == frozenset({"y"})
    response = asyncio.run(infer_with_shm(reg, request, infer, names))
    assert request.shm_inputs is None and response.outputs["y"].tolist() == [6.0]
    assert np.frombuffer((tmp_path / "a").read_bytes()[4:], np.float32).tolist() == [6.0]
    assert fds() == before  # closed once the request let go


def test_params_and_cuda() -> None:
    assert shm_params({"shared_memory_region": "r", "shared_memory_byte_size": 8}, "x") == (
        "r",
        8,
        0,
    )
    for params, words in (
        ({"shared_memory_region": ""}, "non-empty string"),
        ({"shared_memory_region": "r"}, "no 'shared_memory_byte_size'"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": True}, "integer > 0"),
        (
            {"shared_memory_region": "r", "shared_memory_byte_size": 4, "shared_memory_offset": -1},
            "integer >= 0",
        ),
    ):
        with pytest.raises(InferError, match=words):
            shm_params(params, "input 'x'")
    assert shm_output_names(InferRequest("m")) is None
    assert shm_output_names(InferRequest("m", outputs=[RequestedOutput("y")])) is None


def test_cuda_shared_memory_answers_as_triton_without_gpus(reg: SharedMemoryRegistry) -> None:
    assert reg.cuda_status() == []
    reg.cuda_unregister()
    reg.cuda_unregister("never_registered")  # nothing to do: success
    with pytest.raises(InferError) as e:
        reg.cuda_status("c")
    assert e.value.code is ErrorCode.NOT_FOUND
    assert e.value.message == "Unable to find cuda shared memory region: 'c'"
    with pytest.raises(InferError) as e:
        reg.cuda_register("c")
    assert e.value.code is ErrorCode.INVALID_ARG
    assert e.value.message.startswith(
        "failed to register CUDA shared memory region: 'c', GPUs not supported"
    )
    assert reg.status() == []  # the system regions are untouched


def test_large_tensors_are_copied_off_the_event_loop(
    reg: SharedMemoryRegistry, tmp_path: Path
) -> None:
    x = np.arange(2 * 1024 * 1024 // 4 * 2, dtype=np.float32)  # 4 MiB: over OFFLOAD_BYTES
    key = make(tmp_path, "big", x.tobytes() * 2)
    reg.register("big", key, 0, 2 * x.nbytes)
    params = {
        "shared_memory_region": "big",
        "shared_memory_byte_size": x.nbytes,
        "shared_memory_offset": x.nbytes,
    }
    request = InferRequest("m", outputs=[RequestedOutput("y", parameters=params)])
    request.shm_inputs = {"x": ShmInput("FP32", [x.size], x.size, "big", x.nbytes, 0)}

    async def infer(req: InferRequest) -> InferResponse:
        return InferResponse("m", "1", outputs={"y": req.inputs["x"] + 1})

    asyncio.run(infer_with_shm(reg, request, infer, shm_output_names(request)))
    got = np.frombuffer((tmp_path / "big").read_bytes()[x.nbytes :], np.float32)
    np.testing.assert_array_equal(got, x + 1)
